"""A trial group: N configurations trained side by side in one process, each exactly as it would
train alone.

Each member is the one loop (``dpsm_ray.train.loop.training``) of its own configuration with its
own environment -- its seed, model, optimizer, q, data, checkpoint and rows -- advanced one
training step at a time, the members in turn.  The members share nothing but the process, and the
one piece of process state the loop reads, torch's global RNG (a model's initial weights, dropout,
the RNG a checkpoint saves), is swapped in and out around every turn (``Lane.turn``), so a member
draws exactly what it would draw alone and its rows are a lone run's.

Why (bench/README.md): one ResNet-110 trial's captured step at batch 128 is a long chain of small
kernels that uses ~1.4% of an H100; processes sharing a GPU are time-sliced and never run their
kernels at once, but kernels on different CUDA streams of one process can.  So on a CUDA device
each member's turns run on a stream of its own, queued from this one host thread without waiting:
a captured step is one launch that returns at once, the batches are assembled from data already on
the device, and the loop reads no number back inside an epoch.  A turn that does read one (the
epoch's end: its statistics and evaluation) waits for its own stream only, while the other
members' queued steps go on.  On a CPU there are no streams: the members run one after another,
turn by turn, and give the same rows.

A member that raises is restarted from its own checkpoint up to ``retries`` times, then ends
with its error while its neighbours go on (``ended`` hears of each member as it ends).  A full disk
ends the whole group: nothing more can be written.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from dpsm_ray.files import is_disk_full
from dpsm_ray.config import TrainConfig
from dpsm_ray.train.loop import RunResult, training


class Lane:
    """Where one member's turns run: its own CUDA stream on a CUDA device (none elsewhere), and
    its own copy of torch's global RNG state, swapped in for each turn and out after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            # the member's work follows whatever was queued before the group began
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.rng: dict | None = None  # the member's RNG state between its turns (None before its first)

    @contextlib.contextmanager
    def turn(self):
        """The member's turn: its RNG state in, its stream current; both put back after."""
        if self.rng is not None:
            torch.set_rng_state(self.rng["cpu"])
            if "cuda" in self.rng:
                torch.cuda.set_rng_state(self.rng["cuda"], self.device)
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                yield
        finally:
            self.rng = {"cpu": torch.get_rng_state()}
            if self.stream is not None:
                self.rng["cuda"] = torch.cuda.get_rng_state(self.device)

    def join(self) -> None:
        """The device's current stream waits for this lane's work (the group has ended)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def side_by_side(turns: Sequence[Callable[[], object]], lanes: Sequence[Lane]) -> list:
    """One round: each ``turns[i]()`` in its lane, in order, without waiting for any of them
    (bench/group.py times the members' bare steps with it)."""
    outcomes = []
    for run, lane in zip(turns, lanes):
        with lane.turn():
            outcomes.append(run())
    return outcomes


@dataclass
class Member:
    """One configuration of a group: its environment (``LocalEnv``-like: where its checkpoint,
    rows and log lines go) and its lane."""

    config: TrainConfig
    env: object
    lane: Lane
    attempts: int = 0
    run: Generator[None, None, RunResult] | None = None

    def start(self) -> None:
        self.attempts += 1
        self.run = training(self.config, self.env)  # resumes from the env's checkpoint, if it holds one


def error_line(error: BaseException) -> str:
    """The last line of ``error``'s traceback, as a trial's failure reads when Tune gives up on it."""
    lines = "".join(traceback.format_exception(error)).strip().splitlines()
    return lines[-1][:500] if lines else type(error).__name__


def train_group(
    members: Sequence[tuple[TrainConfig, object]],
    *,
    retries: int = 0,
    ended: Callable[[int, RunResult | BaseException], None] | None = None,
) -> list[RunResult | BaseException]:
    """Train every ``(config, env)`` of ``members`` side by side (module docstring): one training
    step of each in turn, each in its own lane, until all have ended.  Returns each member's
    ``RunResult``, or the error it ended with after ``retries`` restarts from its checkpoint;
    ``ended(position, outcome)`` is called as each one ends, in its lane.  Every member trains on
    the device of its env (one device for the group)."""
    group = [Member(config, env, Lane(env.device)) for config, env in members]
    outcomes: list[RunResult | BaseException | None] = [None] * len(group)
    for member in group:
        member.start()
    alive = list(range(len(group)))
    try:
        while alive:
            for position in list(alive):
                member = group[position]
                with member.lane.turn():
                    try:
                        next(member.run)
                        continue
                    except StopIteration as done:
                        outcome = done.value
                    except Exception as error:  # noqa: BLE001 -- the member's failure, not the group's
                        if is_disk_full(error):
                            raise
                        if member.attempts <= retries:
                            member.env.log(f"failed ({error_line(error)}); restarting from its last checkpoint "
                                           f"(attempt {member.attempts + 1} of {retries + 1})")
                            member.start()
                            continue
                        outcome = error
                    outcomes[position] = outcome
                    alive.remove(position)
                    member.run = None
                    if ended is not None:
                        ended(position, outcome)
    finally:
        for member in group:
            if member.run is not None:  # the group stopped early: the member's open parts (timers, loaders) end
                with member.lane.turn():
                    member.run.close()
            member.lane.join()
    return outcomes
