"""Where a run's time goes: seconds per named part, measured by the run itself.

A sweep's trials record theirs in the sweep's record (``record.json``'s ``timings``) and the
driver its own in ``finished.json``; ``bench/sweep_overhead.py`` reads both.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path


class Stopwatch:
    """Seconds spent in each named part (``with clock("load_data"): ...``), summed over repeats.
    A part timed inside another counts for itself alone: the outer part's seconds leave it out,
    so the parts add up to the time they cover."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [part, since when it counts], innermost last

    @contextmanager
    def __call__(self, part: str):
        now = time.perf_counter()
        if self._open:  # the enclosing part pauses
            outer = self._open[-1]
            self.add(outer[0], now - outer[1])
        timing = [part, now]
        self._open.append(timing)
        try:
            yield
        finally:
            now = time.perf_counter()
            self._open.pop()
            self.add(part, now - timing[1])
            if self._open:
                self._open[-1][1] = now

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds


def process_started_at() -> float | None:
    """When this process started (seconds since the epoch, to 10 ms; Linux /proc), or None elsewhere."""
    import os

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: start, in clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def skip_final_collection() -> None:
    """At this process's exit, after the ``atexit`` work registered since (Ray's shutdown), leave
    out the interpreter's last garbage collections: with torch, Ray, Tune, pandas and matplotlib
    loaded they take ~2 s of a finished sweep's exit on 2 cores (2.6 s -> 0.4 s, measured).  What
    a command writes is closed before it returns; only objects in reference cycles are left
    unfinalised, as the process ends."""
    global _skipping
    if not _skipping:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _skipping = True


_skipping = False


def duration_text(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h10m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
