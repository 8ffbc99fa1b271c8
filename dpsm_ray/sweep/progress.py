"""The sweep's progress lines: each one stamped with the time since the sweep started, an overall
trial counter across all stages with an estimate of the time left, and the base model's epochs
shown once in a while instead of one line each.

    [0:00:41] base model: epoch 14/30  val size 1.21  (9s per epoch, about 2m24s left)
    [0:03:05] search-ce 2/4  done in 31s  val size 1.230  val cov 0.905  lr=0.0123  | trial 2/20, about 9m10s left

The estimate is the trials left times this run's time per ended trial: the wall time from its first
trial's start to now, over the trials that ended since.  That counts concurrency (two trials side
by side end twice as often), the work between stages and each trial's own start-up, but not the
wait for Ray before the first trial started.  The first trial's line has no estimate: with trials
side by side, the others are about to end too.  (The time between trial ends alone, the estimate
before this one, took two trials that started together and ended 20 s apart for 20 s a trial, and
said "about 9m50s left" of 100 minutes.)  A trial resumed from its checkpoint counts as the share
of its epochs that ran in this run: two resumed after 9 of 10 epochs count as a fifth of a trial,
not two.  (Counted whole, two trials resumed near their last epoch, ending 19 s and 37 s into the
run, said "about 10m57s left" of a study with 40 trials of 4-5 minutes each to go, two at a time.)
It does not count the end of the sweep (the predictors, the report: tens of seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dpsm_ray.train.lines import EpochLine
from dpsm_ray.timing import duration_text
from dpsm_ray.cards import REFERENCE_METHOD


def clock_text(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """The sweep's log (called with a line, as ``print`` is): time-stamps every line, counts the
    trials of every stage against the sweep's total, and thins the base model's epoch lines to one
    per ``epoch_every_s``."""

    def __init__(
        self, emit: Callable[[str], None] = print, *, epoch_every_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.emit, self.clock, self.epoch_every_s = emit, clock, epoch_every_s
        self.started = clock()
        self.total = 0  # trials in the whole sweep (the stages not built yet as planned)
        self.done = 0  # trials ended, in this run or (resumed) before it
        self.ended_now = 0  # trials ended in this run
        self.work_now = 0.0  # their work done in this run, in trials (a resumed trial's share of its epochs)
        self.first_start: float | None = None  # when this run's first trial started
        self._last_epoch_line = -float("inf")

    def __getstate__(self) -> dict:
        """Without where it writes: Tune pickles its callbacks (tuner.pkl), which hold this log, and
        nothing is restored from that pickle; ``print`` itself does not pickle where a library
        (Ray Train's, Ray Serve's print redirection) has put another function in its place."""
        return {**self.__dict__, "emit": None, "clock": None}

    def __call__(self, line: str) -> None:
        if isinstance(line, EpochLine):
            self.epoch(line)
            return
        self.emit(f"[{clock_text(self.clock() - self.started)}] {line}")

    # -- trials ---------------------------------------------------------------------------------
    def plan(self, total: int) -> None:
        self.total = total

    def replan(self, planned: int, actual: int) -> None:
        """A stage planned with ``planned`` trials has ``actual`` (the final stage, once the
        methods whose every search trial failed are known)."""
        self.total += actual - planned

    def already_ended(self, count: int) -> None:
        """``count`` trials that a resumed sweep finds ended."""
        self.done += count

    def trial_started(self) -> None:
        """A trial's process is up (the first one's start is where this run's estimate counts from)."""
        if self.first_start is None:
            self.first_start = self.clock()

    def trial_ended(self, share: float = 1.0) -> str:
        """Count one ended trial; the counter and estimate to append to its line.  ``share``: the
        part of the trial's work done in this run (resumed after k of n epochs: (n - k) / n)."""
        self.done += 1
        self.ended_now += 1
        self.work_now += share
        if self.first_start is None:  # ended without a start seen (a trial that failed to start)
            self.first_start = self.clock()
        left = self.left_seconds()
        return f"trial {self.done}/{self.total}" + (
            f", about {duration_text(left)} left" if left is not None and self.done < self.total else ""
        )

    def left_seconds(self) -> float | None:
        if self.ended_now < 2 or self.first_start is None or self.work_now <= 0:
            return None
        per_trial = (self.clock() - self.first_start) / self.work_now
        return max(0, self.total - self.done) * per_trial

    # -- the base model's epochs ----------------------------------------------------------------
    def epoch(self, line: EpochLine) -> None:
        now = self.clock()
        if line.epoch == 1:  # a training starts: its first line after epoch_every_s
            self._last_epoch_line = now
        if line.epoch == line.epochs or now - self._last_epoch_line < self.epoch_every_s:
            return  # the last epoch: the "trained in" line follows
        self._last_epoch_line = now
        left = (line.epochs - line.epoch) * line.seconds
        what = "base model" if line.method == REFERENCE_METHOD else line.method
        self(
            f"{what}: epoch {line.epoch}/{line.epochs}  val size {line.val_set_size:.2f}  ({line.seconds:.1f}s per epoch, about"
            f" {duration_text(left)} left)"
        )
