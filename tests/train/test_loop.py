import math
from pathlib import Path

import pytest
import torch

from dpsm_ray.files import CorruptFileError
from dpsm_ray.storage.schema import CLASSES, EPOCHS
from dpsm_ray.train import DivergedError, LocalEnv, TrainConfig, train
from dpsm_ray.train.loop import EPOCH_COLUMNS, EPOCH_TIMINGS, halves, split_batches, step_batches

QUIET = dict(log=lambda line: None)
SMALL = dict(dataset="digits", epochs=2, batch_size=64, eval_splits=3, val_splits=2)


def run(tmp_path=None, **changes):
    config = TrainConfig(**{**SMALL, **changes})
    checkpoint = tmp_path / "checkpoint.pt" if tmp_path is not None else None
    return train(config, LocalEnv(torch.device("cpu"), checkpoint, **QUIET))


def test_halves_are_disjoint_equal_and_seeded():
    d1, d2 = halves(101, seed=4)
    assert d1.numel() == d2.numel() == 50
    assert set(d1.tolist()).isdisjoint(d2.tolist())
    assert torch.equal(halves(101, 4)[0], d1) and not torch.equal(halves(101, 5)[0], d1)


def test_worker_slices_tile_the_global_batches_without_padding():
    half = torch.arange(103)
    single = step_batches(half, epoch=2, seed=0, name="d1", global_batch=10, rank=0, world=1)
    workers = [step_batches(half, 2, 0, "d1", 10, rank, 2) for rank in range(2)]
    assert len(single) == 10  # 103 // 10 steps: the partial last batch is dropped
    for step, global_batch in enumerate(single):
        assert torch.equal(torch.cat([workers[0][step], workers[1][step]]), global_batch)
    seen = torch.cat(single)
    assert seen.unique().numel() == seen.numel() == 100
    assert not torch.equal(torch.cat(step_batches(half, 3, 0, "d1", 10, 0, 1)), seen)  # reshuffled per epoch


def test_conftr_batch_split_halves_random_batches_of_the_whole_pool():
    pool = torch.arange(103)
    calibration, prediction = split_batches(pool, epoch=1, seed=0, batch_size=12, rank=0, world=1)
    assert len(calibration) == len(prediction) == 8  # 103 // 12 batches of 6 + 6
    assert all(part.numel() == 6 for part in calibration + prediction)
    seen = torch.cat([torch.cat(calibration), torch.cat(prediction)])
    assert seen.unique().numel() == seen.numel() == 96  # disjoint halves, no example twice in an epoch
    # both halves draw from the whole pool: no fixed D1/D2 behind them
    assert {int(i) < 52 for i in torch.cat(calibration)} == {True, False}
    workers = [split_batches(pool, 1, 0, 12, rank, 2) for rank in range(2)]
    for half in (0, 1):
        for step in range(8):
            assert torch.equal(torch.cat([workers[0][half][step], workers[1][half][step]]), (calibration, prediction)[half][step])
    assert not torch.equal(torch.cat(split_batches(pool, 2, 0, 12, 0, 1)[0]), torch.cat(calibration))  # reshuffled per epoch


@pytest.mark.parametrize("method", ["ce", "conftr", "cut", "dpsm"])
def test_every_method_trains_on_digits_with_valid_coverage(method):
    result = run(method=method, epochs=3)
    assert [row["epoch"] for row in result.epochs] == [1, 2, 3]
    assert set(EPOCH_COLUMNS) <= set(result.epochs[-1]) <= set(EPOCHS)
    assert len(result.evals) == 3 * 3
    last = result.epochs[-1]
    assert last["val_coverage"] > 0.8 and last["val_accuracy"] > 0.5
    mean_coverage = sum(r["coverage"] for r in result.evals) / len(result.evals)
    assert mean_coverage > 0.85
    has_quantile = method in ("dpsm", "conftr")
    for column in ("q", "q_error", "q_error_train", "upper_loss_q", "upper_gap", "lower_gap", "train_set_size_q"):
        assert math.isfinite(last[column]) == has_quantile, column
    assert math.isfinite(last["q_dataset"]) and math.isfinite(last["q_dataset_train"]) and last["soft_size"] > 0
    # the final model's class rows: every score, re-split and class
    assert len(result.classes) == 3 * 3 * 10 and set(result.classes[0]) <= set(CLASSES)
    hps = [r for r in result.classes if r["score"] == "hps" and r["split"] == 0]
    mean_coverage = sum(r["coverage"] * r["n_test"] for r in hps if r["n_test"]) / sum(r["n_test"] for r in hps)
    assert mean_coverage == pytest.approx(next(r["coverage"] for r in result.evals if r["score"] == "hps" and r["split"] == 0))


@pytest.mark.parametrize("changes", [
    dict(method="conftr", conftr_split="batch"),
    dict(method="cut", cut_score="aps"),
    dict(method="dpsm", q_init="zero"),
    dict(method="ce", lr_schedule="exp", milestones=(1,), lr_decay=0.5),
])
def test_the_papers_open_choices_train(changes):
    result = run(epochs=3, **changes)
    last = result.epochs[-1]
    assert last["val_coverage"] > 0.8 and last["val_accuracy"] > 0.5 and math.isfinite(last["upper_loss"])
    if changes.get("lr_schedule") == "exp":
        assert [row["lr"] for row in result.epochs] == pytest.approx([0.05, 0.025, 0.0125])


def test_dpsm_learned_quantile_tracks_the_dataset_quantile():
    # From scratch Q_n falls from ~0.9 to ~0.05 within five epochs; above every score q can only
    # descend at gamma * alpha per step, so it lags, then catches up and stays close.  At the
    # default gamma (2 / 15 steps per epoch here) it has caught up by epoch 10; at the paper
    # grid's 0.01 it would still be ~0.8 above Q_n (docs/method.md).
    result = run(method="dpsm", epochs=10)
    assert [row["quantile_lr"] for row in result.epochs] == pytest.approx([2 / 15] * 10)  # 500 // 32 steps
    errors = [row["q_error"] for row in result.epochs]
    assert errors[-1] < 0.03 and errors[-1] < max(errors) / 5
    assert abs(result.epochs[-1]["q"] - result.epochs[-1]["q_dataset_train"]) == pytest.approx(result.epochs[-1]["q_error_train"])


def test_a_random_initial_quantile_starts_away_from_the_dataset_quantile_and_converges():
    lines = []
    config = TrainConfig(**{**SMALL, "method": "dpsm", "epochs": 10, "q_init": "random", "seed": 2})
    result = train(config, LocalEnv(torch.device("cpu"), log=lines.append))
    start = next(line for line in lines if "q_0" in line).split()
    q_0, q_n = float(start[start.index("q_0") + 1]), float(start[start.index("Q_n") + 1])
    assert "(random)" in start and abs(q_0 - q_n) > 0.5  # seed 2 draws q_0 = 0.157; the untrained model's Q_n is ~0.9
    errors = [row["q_error"] for row in result.epochs]
    assert errors[-1] < 0.03 and errors[-1] < abs(q_0 - q_n) / 10


class Interrupted(Exception):
    pass


class InterruptingEnv(LocalEnv):
    """Saves the checkpoint of ``stop_after`` epochs, then dies."""

    def __init__(self, stop_after, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_after = stop_after

    def report(self, row, checkpoint, epochs=None):
        super().report(row, checkpoint, epochs)
        if row["epoch"] == self.stop_after:
            raise Interrupted


def without_timing(rows):
    """Rows to compare: no wall time, and NaN (a method without a quantile) equal to NaN."""
    return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items() if k not in EPOCH_TIMINGS} for row in rows]


@pytest.mark.parametrize("method,changes", [
    ("dpsm", {}), ("conftr", {}), ("dpsm", {"q_init": "random", "lr_schedule": "exp"}), ("cut", {"cut_score": "aps"}), ("conftr", {"conftr_split": "batch"}),
])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, method, changes):
    config = TrainConfig(**{**SMALL, "method": method, "epochs": 4, **changes})
    reference = train(config, LocalEnv(torch.device("cpu"), None, **QUIET))
    with pytest.raises(Interrupted):
        train(config, InterruptingEnv(2, torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    saved_q = torch.load(tmp_path / "ck.pt", weights_only=True)["objective"]
    resumed = train(config, LocalEnv(torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    assert without_timing(resumed.epochs) == without_timing(reference.epochs)
    assert without_timing(resumed.evals) == without_timing(reference.evals)
    assert without_timing(resumed.classes) == without_timing(reference.classes)
    if method == "dpsm":
        # q continued from its checkpointed value (after epoch 2), not from a fresh Q_n
        assert saved_q["q"].item() == pytest.approx(reference.epochs[1]["q"])


def test_a_resumed_run_with_dropout_continues_the_global_rng_stream(tmp_path, monkeypatch):
    """Dropout draws from torch's global RNG, which the checkpoint carries: without restoring it,
    the resumed epochs would see other dropout masks than the uninterrupted run."""
    import dpsm_ray.train.loop as loop

    def mlp_with_dropout(name, num_classes, **kwargs):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, num_classes))

    monkeypatch.setattr(loop, "build_model", mlp_with_dropout)
    config = TrainConfig(**{**SMALL, "method": "dpsm", "epochs": 4})
    reference = train(config, LocalEnv(torch.device("cpu"), None, **QUIET))
    with pytest.raises(Interrupted):
        train(config, InterruptingEnv(2, torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    torch.manual_seed(12345)  # whatever the process did in between must not matter
    resumed = train(config, LocalEnv(torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    assert without_timing(resumed.epochs) == without_timing(reference.epochs)
    assert resumed.evals == reference.evals


def test_a_checkpoint_of_another_configuration_is_refused(tmp_path):
    with pytest.raises(Interrupted):
        train(TrainConfig(**{**SMALL, "epochs": 3}), InterruptingEnv(1, torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    with pytest.raises(RuntimeError, match="different configuration"):
        train(TrainConfig(**{**SMALL, "epochs": 3, "lr": 0.01}), LocalEnv(torch.device("cpu"), tmp_path / "ck.pt", **QUIET))


class Planted:
    """A pickle that runs code when unpickled: what a stranger with write access to a shared
    results directory could leave as a checkpoint (issue 21: it ran, as root, on --resume)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def test_a_planted_checkpoint_is_refused_and_never_unpickled(tmp_path):
    import pickle

    marker = tmp_path / "pwned"
    torch.save({"epoch": 0, "model": Planted(marker)}, tmp_path / "ck.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(CorruptFileError, match=r"ck.pt is not a checkpoint this service wrote: it holds Python objects, which are never unpickled"):
        train(TrainConfig(**{**SMALL, "epochs": 2}), LocalEnv(torch.device("cpu"), tmp_path / "ck.pt", **QUIET))
    assert not marker.exists()
    (tmp_path / "ck.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CorruptFileError, match=r"ck.pt cannot be read as a checkpoint"):
        train(TrainConfig(**{**SMALL, "epochs": 2}), LocalEnv(torch.device("cpu"), tmp_path / "ck.pt", **QUIET))


def test_nothing_in_the_package_unpickles_what_it_reads():
    """Checkpoints, weights and results are read with weights_only=True or as JSON/Parquet; the
    only pickles left are Ray Tune's own experiment files, which the service never reads back."""
    package = Path(__file__).resolve().parents[2] / "dpsm_ray"
    offenders = [f"{path.name}:{n}" for path in package.rglob("*.py") for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "weights_only=False" in line or "pickle.load" in line or "cloudpickle" in line]
    assert not offenders, offenders


def test_a_diverging_run_fails_loudly():
    with pytest.raises(DivergedError, match="epoch 1"):
        run(method="ce", lr=1e12, epochs=1)


# --- the epoch diagnostics against a hand computation -----------------------------------------

TABLE_LOGITS = [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0], [-1.0, 2.0, 0.5], [0.3, -0.2, 0.1]]
TABLE_LABELS = [0, 1, 2, 1, 0, 2]


class Table(torch.nn.Module):
    """A 'model' whose logits for example i are row i of a fixed table (input: the index)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("logits", torch.tensor(TABLE_LOGITS))

    def forward(self, x):
        return self.logits[x[:, 0].long()]


def table_data():
    from dpsm_ray.data import DataSplits, Split, TensorSource

    source = TensorSource(torch.arange(6.0)[:, None], torch.tensor(TABLE_LABELS))
    split = Split("train", torch.arange(6), source)
    return DataSplits("table", 3, (1,), split, split, split, split)


def by_hand(alpha, temperature, weight, d1, d2, quantile, sample=range(6)):
    """Every diagnostic with plain floats: HPS scores 1 - softmax, Q_n the ceil(n (1 - alpha))-th
    smallest label score, the pinball loss rho, the sigmoid soft size; over the table's rows in
    ``sample`` (D1 and D2: their rows in it)."""
    sample = list(sample)
    d1, d2 = [i for i in d1 if i in sample], [i for i in d2 if i in sample]
    probs = {i: [math.exp(v) / sum(math.exp(w) for w in TABLE_LOGITS[i]) for v in TABLE_LOGITS[i]] for i in sample}
    scores = {i: [1 - p for p in row] for i, row in probs.items()}
    label_score = {i: scores[i][TABLE_LABELS[i]] for i in sample}
    kth = lambda values, level: sorted(values)[math.ceil(round(len(values) * level, 9)) - 1]
    q_d1, q_train = kth([label_score[i] for i in d1], 1 - alpha), kth(label_score.values(), 1 - alpha)
    soft = lambda rows, q: sum(1 / (1 + math.exp(-(q - s) / temperature)) for row in rows for s in row) / len(rows)
    rho = lambda q: sum((1 - alpha) * (s - q) if s >= q else alpha * (q - s) for s in label_score.values()) / len(sample)
    ce = -sum(math.log(probs[i][TABLE_LABELS[i]]) for i in sample) / len(sample)
    hard = sum(s <= quantile for row in scores.values() for s in row) / len(sample)
    scores = list(scores.values())
    return {
        "q_dataset": q_d1,
        "q_dataset_train": q_train,
        "soft_size": soft([scores[sample.index(i)] for i in d2], q_d1),
        "q_error": abs(quantile - q_d1),
        "q_error_train": abs(quantile - q_train),
        "upper_loss_q": ce + weight * soft(scores, quantile),
        "upper_loss_qn": ce + weight * soft(scores, q_train),
        "upper_gap": weight * (soft(scores, quantile) - soft(scores, q_train)),
        "lower_loss_q": rho(quantile),
        "lower_loss_qn": rho(q_train),
        "lower_gap": rho(quantile) - rho(q_train),
        "train_soft_size_q": soft(scores, quantile),
        "train_set_size_q": hard,
    }


def diagnostics_of(method, objective_setup, **config_changes):
    from dpsm_ray.cards import build_objective
    from dpsm_ray.train.loop import epoch_diagnostics

    config = TrainConfig(dataset="digits", method=method, alpha=0.4, sigmoid_temperature=0.2, conformal_weight=0.7, sort_temperature=0.0, **config_changes)
    objective = build_objective(method, alpha=0.4, conformal_weight=0.7, sigmoid_temperature=0.2, sort_temperature=0.0, quantile_lr=0.1)
    objective_setup(objective)
    d1, d2 = torch.tensor([4, 0, 2]), torch.tensor([1, 5, 3])
    return epoch_diagnostics(Table(), objective, table_data(), d1, d2, config, LocalEnv(torch.device("cpu"), **QUIET)), d1.tolist(), d2.tolist()


def test_dpsm_epoch_diagnostics_by_hand():
    def set_q(objective):
        objective.q = torch.tensor(0.5)

    row, d1, d2 = diagnostics_of("dpsm", set_q)
    expected = by_hand(0.4, 0.2, 0.7, d1, d2, quantile=0.5)
    assert set(row) == set(expected)
    for name, value in expected.items():
        assert row[name] == pytest.approx(value, abs=1e-6), name
    assert row["lower_gap"] >= 0  # Q_n minimises the pinball loss


def test_dpsm_epoch_diagnostics_on_a_sample_of_the_training_split_by_hand():
    from dpsm_ray.train.loop import diagnostic_sample

    def set_q(objective):
        objective.q = torch.tensor(0.5)

    config = TrainConfig(dataset="digits", diagnostic_examples=4)
    sample = diagnostic_sample(6, config)
    assert sample.tolist() == sorted(set(sample.tolist())) and sample.numel() == 4 and torch.equal(diagnostic_sample(6, config), sample)
    assert not torch.equal(sample, diagnostic_sample(6, config.replace(seed=1)))  # seeded by the run seed
    row, d1, d2 = diagnostics_of("dpsm", set_q, diagnostic_examples=4)
    expected = by_hand(0.4, 0.2, 0.7, d1, d2, quantile=0.5, sample=sample.tolist())
    assert expected != by_hand(0.4, 0.2, 0.7, d1, d2, quantile=0.5)  # the sample changes the figures
    for name, value in expected.items():
        assert row[name] == pytest.approx(value, abs=1e-6), name
    # the whole split: the setting 0, or a sample no smaller than the split
    assert diagnostic_sample(6, config.replace(diagnostic_examples=0)) is None and diagnostic_sample(6, config.replace(diagnostic_examples=6)) is None


def test_conftr_epoch_diagnostics_by_hand():
    # batch 6: one calibration batch of 3 holding all of D1, so tau is its conformal quantile,
    # the ceil((3 + 1)(1 - 0.4)) = 3rd smallest of D1's scores
    row, d1, d2 = diagnostics_of("conftr", lambda objective: None, batch_size=6)
    probs = [[math.exp(v) / sum(math.exp(w) for w in r) for v in r] for r in TABLE_LOGITS]
    tau = sorted(1 - probs[i][TABLE_LABELS[i]] for i in d1)[2]
    expected = by_hand(0.4, 0.2, 0.7, d1, d2, quantile=tau)
    for name, value in expected.items():
        assert row[name] == pytest.approx(value, abs=1e-6), name


def test_methods_without_a_quantile_have_only_the_dataset_quantiles():
    row, d1, d2 = diagnostics_of("cut", lambda objective: None)
    expected = by_hand(0.4, 0.2, 0.7, d1, d2, quantile=0.0)
    for name in ("q_dataset", "q_dataset_train", "soft_size"):
        assert row[name] == pytest.approx(expected[name], abs=1e-6)
    assert all(math.isnan(value) for name, value in row.items() if name not in ("q_dataset", "q_dataset_train", "soft_size"))


TRAIN_MODE_COLUMNS = ("q_dataset_train_mode", "q_error_train_mode", "q_dataset_train_mode_d1", "q_error_train_mode_d1")


class TrainMode(Table):
    """The table's logits, doubled in train mode (as augmentation or BatchNorm's batch statistics
    change what training sees); a train-mode forward also counts itself in a buffer and draws from
    torch's RNG (as BatchNorm and dropout do) -- what the diagnostics must put back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.forwards += 1
        torch.rand(1)
        return 2 * super().forward(x)


@pytest.mark.parametrize("method", ["dpsm", "conftr"])
def test_train_mode_quantiles_by_hand_and_nothing_of_the_run_changes(method):
    from dpsm_ray.cards import build_objective
    from dpsm_ray.train.loop import train_mode_quantiles

    config = TrainConfig(dataset="digits", method=method, alpha=0.4, batch_size=6, sigmoid_temperature=0.2, conformal_weight=0.7)
    objective = build_objective(method, alpha=0.4, conformal_weight=0.7, sigmoid_temperature=0.2, sort_temperature=0.0, quantile_lr=0.1)
    if method == "dpsm":
        objective.q = torch.tensor(0.5)
    model, d1 = TrainMode().eval(), torch.tensor([4, 0, 2])
    rng = torch.get_rng_state()
    row = train_mode_quantiles(model, objective, table_data().train, d1, 0, config, LocalEnv(torch.device("cpu"), **QUIET))
    # by hand: the label scores of 1 - softmax(2 x logits); Q_n the ceil(6 x 0.6) = 4th smallest
    probs = [[math.exp(2 * v) / sum(math.exp(2 * w) for w in r) for v in r] for r in TABLE_LOGITS]
    scores = [1 - probs[i][TABLE_LABELS[i]] for i in range(6)]
    q_train = sorted(scores)[3]
    # DPSM: its q; ConfTr: one calibration batch of 3 (all of D1), tau its conformal quantile, the 3rd smallest
    learned = 0.5 if method == "dpsm" else sorted(scores[i] for i in d1.tolist())[2]
    assert row["q_dataset_train_mode"] == pytest.approx(q_train, abs=1e-6)  # the table's logits are float32
    assert row["q_error_train_mode"] == pytest.approx(abs(learned - q_train), abs=1e-6)
    # against D1's part alone (examples 4, 0, 2): Q_n the ceil(3 x 0.6) = 2nd smallest of their scores
    q_d1 = sorted(scores[i] for i in d1.tolist())[1]
    assert row["q_dataset_train_mode_d1"] == pytest.approx(q_d1, abs=1e-6)
    assert row["q_error_train_mode_d1"] == pytest.approx(abs(learned - q_d1), abs=1e-6)
    assert float(model.forwards) == 0 and not model.training and torch.equal(torch.get_rng_state(), rng)
    if method == "dpsm":
        assert float(objective.q) == 0.5


def test_term_gradient_norms_are_each_terms_gradient_at_the_epochs_first_batch_and_change_nothing():
    import copy

    from dpsm_ray.cards import build_model, build_objective, load_splits
    from dpsm_ray.seeding import derive_seed
    from dpsm_ray.train.loop import term_gradient_norms
    from dpsm_ray.train.step import forward_objective

    config = TrainConfig(dataset="digits", model="mlp_bn", method="dpsm", batch_size=32, sigmoid_temperature=0.1, conformal_weight=0.5)
    data = load_splits("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("mlp_bn", 10, input_shape=data.input_shape)
    objective = build_objective("dpsm", alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, quantile_lr=0.01)
    objective.q = torch.tensor(0.9)
    d1, d2 = halves(len(data.train), 0)
    twin, twin_objective = copy.deepcopy(model), copy.deepcopy(objective)
    buffers, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
    env = LocalEnv(torch.device("cpu"), **QUIET)
    row = term_gradient_norms(model, objective, data.train, d1, d2, 2, config, env)
    # the same by hand: epoch 3's first B1 and B2, augmented as its steps are, the twin in train mode
    seed = derive_seed(0, "augment", 2)
    x1, y1 = next(data.train.batches(step_batches(d1, 2, 0, "d1", 16, 0, 1)[:1], augment=True, seed=seed))
    x2, y2 = next(data.train.batches(step_batches(d2, 2, 0, "d2", 16, 0, 1)[:1], augment=True, seed=seed))
    twin.train()
    out = forward_objective(twin, twin_objective, x1, y1, x2, y2, "fp32", False)  # the step's own forward: B1 and B2 in one batch
    norm = lambda term: math.sqrt(sum(float(g.pow(2).sum()) for g in torch.autograd.grad(term, list(twin.parameters()), retain_graph=True)))
    assert row["ce_grad_norm"] == pytest.approx(norm(out.parts["ce"]), rel=1e-6)
    assert row["size_grad_norm"] == pytest.approx(norm(out.parts["size"]), rel=1e-6)
    assert row["size_grad_norm"] > 0 and row["ce_grad_norm"] > 0
    # nothing of the run moved: BatchNorm's statistics, DPSM's q, torch's RNG, the mode
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers())) and float(objective.q) == pytest.approx(0.9)
    assert torch.equal(torch.get_rng_state(), rng) and model.training  # a built model starts in train mode, and stays so
    # CE: no size term (0); a loss that is not CE + size (RWCE): not measured
    ce = build_objective("ce", alpha=0.1, conformal_weight=0.5)
    assert term_gradient_norms(model, ce, data.train, d1, d2, 0, config.replace(method="ce"), env)["size_grad_norm"] == 0.0
    rwce = build_objective("rwce", alpha=0.1, conformal_weight=0.5)
    assert all(math.isnan(v) for v in term_gradient_norms(model, rwce, data.train, d1, d2, 0, config.replace(method="rwce"), env).values())


def test_the_diagnostics_leave_training_as_it_would_be_without_them(monkeypatch):
    """A run's weights and rows are the same whether or not its epochs measure the gradient norms
    and the train-mode quantiles (mlp_bn: BatchNorm, whose train-mode forwards would move it)."""
    import dpsm_ray.train.loop as loop

    changes = dict(model="mlp_bn", method="dpsm", sigmoid_temperature=0.1, conformal_weight=0.5)
    measured = run(**changes)
    monkeypatch.setattr(loop, "term_gradient_norms", lambda *a, **k: {"ce_grad_norm": math.nan, "size_grad_norm": math.nan})

    def unmeasured_quantiles(*args, **kwargs):  # what training runs: a generator, its row its return value
        yield from ()
        return dict.fromkeys(TRAIN_MODE_COLUMNS, math.nan)

    monkeypatch.setattr(loop, "_train_mode_scoring", unmeasured_quantiles)
    unmeasured = run(**changes)
    assert all(math.isnan(r["q_dataset_train_mode"]) and math.isnan(r["size_grad_norm"]) for r in unmeasured.epochs)
    assert all(torch.equal(measured.model_state[k], unmeasured.model_state[k]) for k in measured.model_state)
    skip = {*EPOCH_TIMINGS, "ce_grad_norm", "size_grad_norm", *TRAIN_MODE_COLUMNS}
    assert [{k: v for k, v in r.items() if k not in skip} for r in measured.epochs] == [{k: v for k, v in r.items() if k not in skip} for r in unmeasured.epochs]
    assert all(r["size_grad_norm"] > 0 and r["q_dataset_train_mode"] > 0 for r in measured.epochs)


def test_the_diagnostics_restore_state_an_objective_moves_to_the_device_before_its_first_step():
    """A DPSM whose q still sits where the checkpoint left it (a resumed run on a GPU): its call
    moves q as a new tensor (``prepare``) and steps it. The probe must leave q as it found it, on
    the tensor the run's steps then use."""
    from dpsm_ray.cards import build_model, build_objective, load_splits
    from dpsm_ray.train.loop import term_gradient_norms

    class Moving(type(build_objective("dpsm", alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, quantile_lr=0.01))):
        moved = False

        def prepare(self, device):  # what a CPU -> CUDA move does: a new tensor, once
            if not self.moved:
                self.q, self.moved = self.q.clone(), True

    objective = Moving(alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, quantile_lr=0.5)
    objective.q = torch.tensor(0.9)
    data = load_splits("digits", seed=0)
    d1, d2 = halves(len(data.train), 0)
    config = TrainConfig(dataset="digits", method="dpsm", batch_size=32, sigmoid_temperature=0.1, conformal_weight=0.5)
    model = build_model("mlp", 10, input_shape=data.input_shape)
    row = term_gradient_norms(model, objective, data.train, d1, d2, 0, config, LocalEnv(torch.device("cpu"), **QUIET))
    assert row["size_grad_norm"] > 0 and objective.moved and float(objective.q) == pytest.approx(0.9)


@pytest.mark.parametrize("architecture, shape", [("lenet", (1, 32, 32)), ("mlp_bn", (1, 28, 28))])
def test_a_forward_pass_in_eval_mode_gives_the_same_logits_in_chunks_of_any_size(monkeypatch, architecture, shape):
    """EVAL_BATCH is speed alone: the logits a run's diagnostics, validation and evaluation read are
    bit for bit the same in chunks of 512 (what runs used before it was 256), 256, 64 or 8 -- of 8 or more
    examples, the last one too; a chunk of 1 or 2 takes another kernel, a last bit apart (PyTorch 2.14, CPU)."""
    import dpsm_ray.train.loop as loop
    from dpsm_ray.cards import build_model
    from dpsm_ray.data import Split, TensorSource
    from dpsm_ray.train.loop import predict

    torch.manual_seed(0)
    model = build_model(architecture, 141, input_shape=shape)
    n = 600  # a partial last chunk of 88 (512, 256) or 24 (64) examples
    split = Split("test", torch.arange(n), TensorSource(torch.rand(n, *shape), torch.zeros(n, dtype=torch.long)))
    env = LocalEnv(torch.device("cpu"), **QUIET)
    logits = {}
    for chunk in (512, 256, 64, 8):
        monkeypatch.setattr(loop, "EVAL_BATCH", chunk)
        logits[chunk] = predict(model, split, torch.arange(n), 141, env)
    assert logits[512].shape == (n, 141)
    assert all(torch.equal(logits[512], logits[chunk]) for chunk in (256, 64, 8))
