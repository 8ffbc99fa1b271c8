"""Data-parallel equivalence without Ray: W gloo processes with per-worker batch b train exactly
like one process with batch W * b (the MLP on digits has no batch-dependent layers).

Two levels.  One step in float64 must agree to rounding (1e-12): that is the exact statement that
DDP + the global quantile/all-gather compute the global-batch gradient.  Whole runs in float32
must agree to 1e-5; there W workers sum gradients in a different order (about 1e-7 apart), so the
run uses settings where such differences do not grow -- with lambda = 1 and a sharp soft sort,
ConfTr from scratch amplifies a 1e-7 weight perturbation to O(1) within two epochs on one worker
alone, which would test chaos, not distribution.
"""

import contextlib
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpsm_ray.collective import LocalCollective, TorchDistributedCollective, current_collective
from dpsm_ray.cards import build_objective
from dpsm_ray.train import LocalEnv, TrainConfig, train
from dpsm_ray.train.env import ProcessGroupEnv

METHODS = ("ce", "conftr", "cut", "dpsm")
BASE = dict(
    dataset="digits", model="mlp", epochs=2, batch_size=64, eval_splits=2, val_splits=2,
    conformal_weight=0.1, lr=0.01, quantile_lr=0.2, sort_temperature=0.3, sigmoid_temperature=0.5,
)


@contextlib.contextmanager
def process_group(rank, world, store):
    """A spawned worker's gloo group, torn down so that the process exits cleanly: every rank done
    with it (a barrier) and its DDP wrappers and pending work freed before it is destroyed.  (A
    gloo thread still holding work when the interpreter finalises aborts the process: SIGABRT,
    'terminate called without an active exception', seen once in CI.)"""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def _run_workers(rank, world, store, out_dir, configs):
    with process_group(rank, world, store):
        results = [train(TrainConfig.from_dict(c), ProcessGroupEnv(torch.device("cpu"), log=lambda line: None)) for c in configs]
        torch.save([(r.epochs, r.evals, r.model_state) for r in results], f"{out_dir}/rank{rank}.pt")
        del results


def spawn(world, configs, tmp_path, function=_run_workers):
    mp.spawn(function, args=(world, str(tmp_path / "store"), str(tmp_path), configs), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


# the four methods, and the options that change what a step draws: ConfTr's random batch split
# and CUT's APS uniforms must not depend on the worker count either
VARIANTS = [(m, {}) for m in METHODS] + [("conftr", {"conftr_split": "batch"}), ("cut", {"cut_score": "aps"})]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Every variant trained once by two gloo workers (with the per-step sync assertion on)."""
    configs = [TrainConfig(**BASE, method=m, **options, debug_sync_checks=True).to_dict() for m, options in VARIANTS]
    return spawn(2, configs, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("index,method,options", [(i, m, o) for i, (m, o) in enumerate(VARIANTS)])
def test_two_workers_train_like_one_worker_with_the_global_batch(two_workers, index, method, options):
    single = train(TrainConfig(**BASE, method=method, **options), LocalEnv(torch.device("cpu"), log=lambda line: None))
    epochs, evals, state = two_workers[0][index]
    for one, two in zip(single.epochs, epochs):
        for column in ("upper_loss", "ce_loss", "conformal_loss", "lower_loss", "q", "q_dataset", "q_error", "soft_size", "q_error_train", "upper_gap", "lower_gap", "train_set_size_q"):
            a, b = one[column], two[column]
            # the hard set size counts classes with a score <= q: a score within float rounding of q (the two runs' weights
            # differ in the last bits) can put one class of one example in or out, a step of 1/n; every other column is smooth
            tolerance = 1e-3 if column == "train_set_size_q" else 1e-5
            assert (math.isnan(a) and math.isnan(b)) or abs(a - b) < tolerance, (method, column, a, b)
    for name, tensor in single.model_state.items():
        assert torch.allclose(tensor, state[name], atol=1e-5), (method, name)
    for one, two in zip(single.evals, evals):
        assert one["coverage"] == pytest.approx(two["coverage"], abs=1e-9)


def test_every_rank_ends_with_the_same_model_and_quantile(two_workers):
    for (epochs0, _, state0), (epochs1, _, state1) in zip(two_workers[0], two_workers[1]):
        assert [r["q"] for r in epochs0] == pytest.approx([r["q"] for r in epochs1], nan_ok=True)
        assert all(torch.equal(state0[k], state1[k]) for k in state0)


def mlp_with_batchnorm(name, num_classes, **kwargs):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, num_classes))


def _run_batchnorm_workers(rank, world, store, out_dir, configs):
    import dpsm_ray.train.loop as loop

    loop.build_model = mlp_with_batchnorm  # this spawned process only
    _run_workers(rank, world, store, out_dir, configs)


def test_batchnorm_workers_evaluate_with_rank_0s_statistics(tmp_path):
    """Each worker's last step updates its BatchNorm running statistics from its own batch; the
    gathered evaluation must still come from one model, the one rank 0 checkpoints."""
    import dpsm_ray.train.loop as loop

    config = TrainConfig(**BASE, method="dpsm")
    (rank0,), (rank1,) = spawn(2, [config.to_dict()], tmp_path, _run_batchnorm_workers)
    (epochs0, evals0, state0), (epochs1, evals1, state1) = rank0, rank1
    assert any("running_mean" in k for k in state0)
    assert all(torch.equal(state0[k], state1[k]) for k in state0)
    model = mlp_with_batchnorm("mlp", 10)
    model.load_state_dict(state0)
    data = loop.load_data(config, torch.device("cpu"))
    single, _ = loop.final_evaluation(model, data, config, LocalEnv(torch.device("cpu")))
    assert [r["coverage"] for r in evals0] == pytest.approx([r["coverage"] for r in single], abs=1e-12)
    assert [r["set_size"] for r in evals0] == pytest.approx([r["set_size"] for r in single], abs=1e-12)
    val = loop.validation_metrics(model, data.val, data.num_classes, config, LocalEnv(torch.device("cpu")))
    assert epochs0[-1]["val_set_size"] == pytest.approx(val["val_set_size"], abs=1e-12)


def _gather_gradient(rank, world, store, out_dir, _):
    with process_group(rank, world, store):
        local = torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)
        local.requires_grad_(True)
        gathered = TorchDistributedCollective().gather(local)
        weights = torch.tensor([1.0, 10.0, 100.0, 1000.0], dtype=torch.float64) * (rank + 1)
        (weights * gathered).sum().backward()
        torch.save((gathered.detach(), local.grad), f"{out_dir}/rank{rank}.pt")
        del local, gathered, weights


def test_the_all_gather_sends_every_workers_gradient_back_to_its_owner(tmp_path):
    (gathered0, grad0), (gathered1, grad1) = spawn(2, None, tmp_path, _gather_gradient)
    assert gathered0.tolist() == gathered1.tolist() == [1.0, 2.0, 2.0, 4.0]
    # d/d(local part) of the sum over both ranks' losses: rank weights 1x and 2x add up
    assert grad0.tolist() == [1.0 * 3, 10.0 * 3]
    assert grad1.tolist() == [100.0 * 3, 1000.0 * 3]


def _step_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).double()
    gen = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(32, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    y1, y2 = (torch.randint(0, 4, (32,), generator=gen) for _ in range(2))
    return model, x1, y1, x2, y2


def _one_step(model, method, collective, x1, y1, x2, y2):
    objective = build_objective(method, alpha=0.1, conformal_weight=1.0, sigmoid_temperature=0.1, sort_temperature=0.01, quantile_lr=0.1, collective=collective)
    objective.initialize(torch.linspace(0, 1, 11, dtype=torch.float64))
    logits1, logits2 = model(torch.cat([x1, x2])).split([x1.shape[0], x2.shape[0]])
    objective(logits1, y1, logits2, y2).loss.backward()
    module = model.module if hasattr(model, "module") else model
    return [p.grad.clone() for p in module.parameters()], objective.state_dict().get("q")


def _step_workers(rank, world, store, out_dir, _):
    with process_group(rank, world, store):
        results = {}
        for method in METHODS:
            model, x1, y1, x2, y2 = _step_setup()
            mine = slice(rank * 16, (rank + 1) * 16)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            results[method] = _one_step(ddp, method, current_collective(), x1[mine], y1[mine], x2[mine], y2[mine])
            del ddp, model
        torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_one_step_gradients_and_q_equal_the_global_batch_exactly_in_float64(tmp_path):
    per_rank = spawn(2, None, tmp_path, _step_workers)
    for method in METHODS:
        model, x1, y1, x2, y2 = _step_setup()
        grads, q = _one_step(model, method, LocalCollective(), x1, y1, x2, y2)
        for rank in range(2):
            rank_grads, rank_q = per_rank[rank][method]
            for a, b in zip(grads, rank_grads):
                assert torch.allclose(a, b, atol=1e-12, rtol=0), method
            if q is not None:
                assert rank_q.item() == q.item(), method
