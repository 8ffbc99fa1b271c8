"""A trial group (dpsm_ray/train/group.py) without Ray: several configurations trained side by side
in one process give each configuration exactly the rows, weights and checkpoint it gets alone; a
diverging member fails while its neighbours finish; a group stopped part-way resumes every member
from its own checkpoint; a member that fails once is restarted from its checkpoint.  On a GPU the
members' turns run on CUDA streams of their own: the `gpu` tests check that their replays overlap
and that a group there still gives each configuration its lone run's rows."""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from dpsm_ray.train import DivergedError, LocalEnv, TrainConfig, train
from dpsm_ray.train.env import load_checkpoint
from dpsm_ray.train.group import Lane, error_line, side_by_side, train_group
from dpsm_ray.train.loop import EPOCH_TIMINGS

SMALL = dict(dataset="digits", train_subset=256, init="scratch", epochs=2, batch_size=64, val_splits=2, eval_splits=2,
             eval_scores=("hps", "aps"), evaluate_test=True)
# three configurations that differ in everything a member owns: seed, method (DPSM's learned q,
# ConfTr's batch split), lr, batch size (so steps per epoch), epochs, and a model with dropout, whose
# masks draw from torch's global RNG at every step
CONFIGS = [
    dict(method="ce", seed=0, lr=0.05, model="test_group:dropout_mlp"),
    dict(method="dpsm", seed=1, lr=0.02, batch_size=32, epochs=3),
    dict(method="conftr", seed=2, lr=0.05, epochs=1, model="test_group:dropout_mlp"),
]


def dropout_mlp(num_classes: int) -> nn.Module:
    """``--model test_group:dropout_mlp``: digits' 8x8 pixels, a dropout layer between two linear ones."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, num_classes))


def config(**changes) -> TrainConfig:
    return TrainConfig(**{**SMALL, **changes})


class Recording(LocalEnv):
    """A LocalEnv that notes each epoch report in ``seen`` as (name, epoch), then calls ``hook``."""

    def __init__(self, name, checkpoint, seen, lines, hook=None):
        super().__init__(torch.device("cpu"), checkpoint, log=lines.append)
        self.name, self.seen, self.hook = name, seen, hook

    def report(self, row, checkpoint, epochs=None):
        super().report(row, checkpoint, epochs)
        self.seen.append((self.name, row["epoch"]))
        if self.hook is not None:
            self.hook(self.name, row["epoch"])


def envs(folder, seen, lines, hook=None):
    return [Recording(i, folder / str(i) / "checkpoint.pt", seen, lines, hook) for i in range(len(CONFIGS))]


def repeatable(result) -> dict:
    """What a run computes, without its clock."""
    return {"epochs": [{k: v for k, v in row.items() if k not in EPOCH_TIMINGS} for row in result.epochs], "evals": result.evals,
            "classes": result.classes, "split_ids": result.split_ids}


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (a method without a quantile has NaN in its q columns)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def assert_same_run(got, want, what):
    assert same(repeatable(got), repeatable(want)), what
    assert got.model_state.keys() == want.model_state.keys()
    assert all(torch.equal(got.model_state[k], want.model_state[k]) for k in want.model_state), f"{what}: weights differ"


def assert_same_checkpoint(got, want, what):
    got, want = load_checkpoint(got), load_checkpoint(want)
    assert got["epoch"] == want["epoch"] and got["config_hash"] == want["config_hash"], what
    for part in ("model", "rng"):
        assert got[part].keys() == want[part].keys() and all(torch.equal(got[part][k], want[part][k]) for k in want[part]), f"{what}: {part}"
    momenta = [(state["momentum_buffer"], want["optimizer"]["state"][k]["momentum_buffer"]) for k, state in got["optimizer"]["state"].items()]
    assert momenta and all(torch.equal(a, b) for a, b in momenta), f"{what}: momentum"
    assert repr(got["objective"]) == repr(want["objective"]), f"{what}: the objective's state (DPSM's q)"


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Each configuration trained on its own: its result, its checkpoint."""
    folder = tmp_path_factory.mktemp("alone")
    runs = []
    for i, changes in enumerate(CONFIGS):
        checkpoint = folder / str(i) / "checkpoint.pt"
        runs.append((train(config(**changes), LocalEnv(torch.device("cpu"), checkpoint, log=lambda line: None)), checkpoint))
    return runs


def test_a_group_trains_each_configuration_as_it_trains_alone(alone, tmp_path):
    seen, lines, ended = [], [], []
    group = envs(tmp_path, seen, lines)
    outcomes = train_group([(config(**c), env) for c, env in zip(CONFIGS, group)], ended=lambda i, outcome: ended.append(i))
    for i, (result, checkpoint) in enumerate(alone):
        assert_same_run(outcomes[i], result, f"member {i}")
        assert_same_checkpoint(tmp_path / str(i) / "checkpoint.pt", checkpoint, f"member {i}")
    # one step of each in turn: member 2 (1 epoch of 4 steps) ends first, member 1 (3 epochs of 8) last,
    # and the epochs' reports interleave instead of coming member after member. The epochs' ends take
    # turns too, a batch of their forward passes each (members 0 and 2: 6 turns; member 1, batch 32: 10),
    # so member 1's first epoch (8 steps) reports before member 0's second
    assert ended == [2, 0, 1]
    assert seen == [(0, 1), (2, 1), (1, 1), (0, 2), (1, 2), (1, 3)]


def test_a_diverging_member_fails_alone_and_its_neighbours_finish(alone, tmp_path):
    seen, lines, ended = [], [], []
    group = envs(tmp_path, seen, lines)
    members = [(config(**CONFIGS[0]), group[0]), (config(**{**CONFIGS[1], "lr": 1e12}), group[1]), (config(**CONFIGS[2]), group[2])]
    outcomes = train_group(members, retries=1, ended=lambda i, outcome: ended.append((i, type(outcome).__name__)))
    # member 1 diverges at the end of its first epoch's 8 steps, twice (the retry starts over): before
    # member 0 has stepped through its two epochs and their ends
    assert isinstance(outcomes[1], DivergedError) and ended == [(2, "RunResult"), (1, "DivergedError"), (0, "RunResult")]
    # the error's line is what a lone trial's record holds: the last line of its traceback
    assert error_line(outcomes[1]) == f"dpsm_ray.train.loop.DivergedError: {outcomes[1]}" and "training loss is nan in epoch 1" in error_line(outcomes[1])
    # retried once from its checkpoint (none yet: from the start), as Tune retries a failed trial
    assert sum("restarting from its last checkpoint (attempt 2 of 2)" in line for line in lines) == 1
    for i in (0, 2):
        assert_same_run(outcomes[i], alone[i][0], f"member {i} beside a diverging one")


class Stop(BaseException):
    """Stands for the process being stopped (a kill, Ctrl-C) at one instant."""


def test_a_group_stopped_part_way_resumes_every_member_from_its_own_checkpoint(alone, tmp_path):
    def stop_at_member_1_epoch_1(name, epoch):
        if (name, epoch) == (1, 1):
            raise Stop

    seen, lines = [], []
    with pytest.raises(Stop):
        train_group([(config(**c), env) for c, env in zip(CONFIGS, envs(tmp_path, seen, lines, stop_at_member_1_epoch_1))])
    assert seen == [(0, 1), (2, 1), (1, 1)]  # stopped at member 1's epoch 1 of 3: member 2 had ended, member 0 was in epoch 2
    seen, lines = [], []
    outcomes = train_group([(config(**c), env) for c, env in zip(CONFIGS, envs(tmp_path, seen, lines))])
    assert seen == [(0, 2), (1, 2), (1, 3)]  # only what had not run
    assert sorted(line for line in lines if line.startswith("resumed")) == ["resumed from the checkpoint after epoch 1"] * 3
    for i, (result, checkpoint) in enumerate(alone):
        assert_same_run(outcomes[i], result, f"member {i} resumed")
        assert_same_checkpoint(tmp_path / str(i) / "checkpoint.pt", checkpoint, f"member {i} resumed")


def test_a_member_that_fails_once_is_restarted_from_its_checkpoint_and_finishes_as_alone(alone, tmp_path):
    failed = []

    def fail_once_at_epoch_2(name, epoch):
        if (name, epoch) == (1, 2) and not failed:
            failed.append(name)
            raise OSError("the shared file system went away")

    seen, lines = [], []
    outcomes = train_group([(config(**c), env) for c, env in zip(CONFIGS, envs(tmp_path, seen, lines, fail_once_at_epoch_2))], retries=1)
    assert failed == [1] and any("(OSError: the shared file system went away); restarting" in line for line in lines)
    # its epoch-2 checkpoint was written before it failed: it goes on from there, epoch 2 is not trained twice
    assert seen.count((1, 2)) == 1 and "resumed from the checkpoint after epoch 2" in lines
    for i, (result, _) in enumerate(alone):
        assert_same_run(outcomes[i], result, f"member {i}")
    # without a retry it ends with its error, the others finish
    failed.clear()
    again = envs(tmp_path / "again", [], [], fail_once_at_epoch_2)
    outcomes = train_group([(config(**CONFIGS[i]), again[i]) for i in (1, 2)])
    assert isinstance(outcomes[0], OSError) and same(repeatable(outcomes[1]), repeatable(alone[2][0]))


def test_a_full_disk_ends_the_whole_group():
    def full(name, epoch):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        train_group([(config(**CONFIGS[0], epochs=1), Recording(0, None, [], [], full)), (config(**CONFIGS[2]), Recording(2, None, [], []))],
                    retries=2)


def test_each_lane_draws_from_torch_s_global_rng_as_if_alone():
    """Two lanes seeded differently, drawing in turn: each sees its own seed's stream, as an
    independent generator gives it."""
    lanes = [Lane(torch.device("cpu")) for _ in range(2)]
    assert [lane.stream for lane in lanes] == [None, None]  # streams are a CUDA notion
    draws = {0: [], 1: []}
    for i, lane in enumerate(lanes):
        with lane.turn():
            torch.manual_seed(100 + i)
    for _ in range(3):
        for i, lane in enumerate(lanes):
            with lane.turn():
                draws[i].append(torch.rand(2))
    for i in range(2):
        alone = torch.Generator().manual_seed(100 + i)
        assert all(torch.equal(draw, torch.rand(2, generator=alone)) for draw in draws[i])


def near(a, b) -> bool:
    """``same``, numbers within float noise: 1% or 0.02 (a coverage may move by one example of a
    split when a threshold sits at a score)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(near(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(near(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isnan(b) if math.isnan(a) else math.isclose(a, b, rel_tol=1e-2, abs_tol=0.02)
    return a == b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: streams are a CUDA notion (the CPU tests above)")
def test_a_group_on_the_gpu_trains_each_configuration_as_it_trains_alone():
    """The three configurations on CUDA's fast path (captured bf16 steps), as a group -- each
    member's turns on a stream of its own, its batches, q and dropout masks drawn there -- and each
    alone.  A member reading another's unfinished work, or a number read back before its own stream
    got there, gives values far from alone's; the tolerance allows only the float noise of GPU
    kernels that are not bitwise repeatable from run to run (atomics), which lone runs show too."""
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as folder:
        def env(name):
            return LocalEnv(device, Path(folder) / name / "checkpoint.pt", log=lambda line: None)

        alone = [train(config(**changes, device="cuda"), env(f"alone{i}")) for i, changes in enumerate(CONFIGS)]
        outcomes = train_group([(config(**changes, device="cuda"), env(f"member{i}")) for i, changes in enumerate(CONFIGS)])
    for i, (got, want) in enumerate(zip(outcomes, alone)):
        assert not isinstance(got, BaseException), f"member {i}: {error_line(got)}"
        assert [row["epoch"] for row in got.epochs] == [row["epoch"] for row in want.epochs], f"member {i}"
        assert near(repeatable(got), repeatable(want)), f"member {i}: {repeatable(got)['epochs']} != {repeatable(want)['epochs']}"
        assert got.model_state.keys() == want.model_state.keys()
        for name, value in want.model_state.items():
            assert torch.allclose(got.model_state[name].float(), value.float(), rtol=1e-2, atol=1e-3), f"member {i}: {name}"


def steps_of(device: torch.device, count: int, model: str = "resnet20", batch: int = 64, graph: bool = False):
    """``count`` members' steps on random CIFAR-shaped batches (each its own weights, data, SGD),
    built in their lanes: on CUDA the captured bf16 channels_last step, else the eager fp32 one."""
    from dpsm_ray.cards import build_model, build_objective
    from dpsm_ray.collective import LocalCollective
    from dpsm_ray.train.step import EagerStep, GraphStep

    lanes, steps = [Lane(device) for _ in range(count)], []
    for i, lane in enumerate(lanes):
        with lane.turn():
            torch.manual_seed(i)
            net = build_model(model, 10, input_shape=(3, 32, 32)).to(device)
            objective = build_objective("dpsm", alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0.01,
                                        quantile_lr=0.01, collective=LocalCollective())
            objective.initialize(torch.rand(100, device=device))
            optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
            half = batch // 2
            example = (torch.randn(half, 3, 32, 32, device=device), torch.randint(0, 10, (half,), device=device),
                       torch.randn(half, 3, 32, 32, device=device), torch.randint(0, 10, (half,), device=device))
            if graph:
                net = net.to(memory_format=torch.channels_last)
                step = GraphStep(net, objective, optimizer, example, precision="bf16", channels_last=True)
            else:
                step = EagerStep(net, objective, optimizer)
            steps.append((step, example, net))
    return lanes, steps


def test_members_stepped_side_by_side_on_a_cpu_equal_each_stepped_alone():
    """The CPU twin of the GPU test below: side_by_side runs each member's step in its lane, one
    after another, and each ends where it ends stepped on its own."""
    device = torch.device("cpu")
    lanes, steps = steps_of(device, 2, model="lenet", batch=8)
    for _ in range(3):
        side_by_side([lambda step=step, example=example: step(*example) for step, example, _ in steps], lanes)
    for i in range(2):
        single, example, net = steps_of(device, 2, model="lenet", batch=8)[1][i]  # the same member, built again, stepped on its own
        for _ in range(3):
            single(*example)
        assert all(torch.equal(a, b) for a, b in zip(steps[i][2].parameters(), net.parameters()))
        assert not all(torch.equal(a, b) for a, b in zip(steps[0][2].parameters(), steps[1][2].parameters()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: streams are a CUDA notion (the CPU twin is above)")
def test_members_replays_on_their_own_streams_overlap_on_the_gpu():
    """Each member's captured step replayed in its lane (its own stream) from this one thread,
    events recorded around every replay: the replays of different members are in flight at once
    (their intervals overlap), where the same replays on one stream follow each other."""
    device = torch.device("cuda")
    lanes, steps = steps_of(device, 2, model="resnet56", batch=128, graph=True)
    rounds = 6

    def intervals(lanes_used):
        marks = []
        for _ in range(rounds):
            events = []
            for (step, example, _), lane in zip(steps, lanes_used):
                with lane.turn():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step(*example)
                    end.record()
                    events.append((start, end))
            marks.append(events)
        torch.cuda.synchronize()
        origin = marks[0][0][0]
        return [[(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in events] for events in marks]

    def overlap(rounds_of_intervals) -> float:
        """Milliseconds during which a replay of member 0 and one of member 1 were both in flight."""
        first = [events[0] for events in rounds_of_intervals]
        second = [events[1] for events in rounds_of_intervals]
        return sum(max(0.0, min(b0, b1) - max(a0, a1)) for a0, b0 in first for a1, b1 in second)

    intervals(lanes)  # warm-up
    side = intervals(lanes)
    one_stream = Lane(device)
    serial = intervals([one_stream, one_stream])
    busy = sum(b - a for events in side for a, b in events[:1])
    assert overlap(side) > 0.2 * busy, (side, busy)
    assert overlap(serial) < 0.01 * busy, serial
    for step, _, _ in steps:
        assert all(math.isfinite(float(value)) for value in step.stats.values())
