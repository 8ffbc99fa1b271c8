"""What each method searches over, and the paper's grid (SPEC section 4, paper appendix D).

Knobs are named as researchers say them (``lambda``, ``lr``, ``gamma``, ``temperature``) and map
to ``TrainConfig`` fields.  Ranges default to the paper grid's bounds and are log-uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpsm_ray.methods import method_card

KNOB_FIELDS = {
    "lambda": "conformal_weight",
    "lr": "lr",
    "gamma": "quantile_lr",
    "temperature": "sigmoid_temperature",
}


@dataclass(frozen=True)
class Range:
    """A log-uniform (or uniform) interval [low, high]."""

    low: float
    high: float
    log: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"range must have finite low < high; got [{self.low}, {self.high}]")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-uniform range needs low > 0; got [{self.low}, {self.high}]")

    def to_tune(self):
        from ray import tune

        return tune.loguniform(self.low, self.high) if self.log else tune.uniform(self.low, self.high)


DEFAULT_RANGES = {
    "lambda": Range(0.01, 5.0),  # paper grid {0.01, 0.05, 0.1, 0.5, 1, 5}
    "lr": Range(0.001, 0.1),  # paper grid {0.001, 0.005, 0.01, 0.05, 0.1}
    "gamma": Range(1e-4, 0.5),  # paper grid {1e-4, ..., 0.5}
    "temperature": Range(0.01, 1.0),  # not in the paper grid; the official code fixes 1.0
}


def method_knobs(method: str) -> tuple[str, ...]:
    """What a search varies for ``method``: its card's knobs (dpsm_ray/methods.py)."""
    return method_card(method).knobs


# The paper's grid: shared axes, then each method's own.
PAPER_GRID = {
    "batch_size": (64, 128),
    "epochs": (30, 40, 60),
    "lr": (0.001, 0.005, 0.01, 0.05, 0.1),
    "milestones": ((3,), (25,), (25, 40)),
    "lr_decay": (0.1, 0.97),
    "lambda": (0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    "gamma": (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5),
}
# each method's axes: its card's ``grid_axes``


def field_name(knob: str) -> str:
    """The ``TrainConfig`` field of a knob or grid axis (``lambda`` -> ``conformal_weight``)."""
    return KNOB_FIELDS.get(knob, knob)


def parse_range(text: str) -> tuple[str, Range]:
    """``lambda=0.01:1`` (log-uniform) or ``lambda=0.01:1:linear`` -> (knob, Range)."""
    knob, _, bounds = text.partition("=")
    if knob not in DEFAULT_RANGES:
        raise ValueError(f"--range: unknown knob {knob!r}; allowed: {', '.join(DEFAULT_RANGES)}")
    parts = bounds.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("log", "linear")):
        raise ValueError(f"--range {text!r}: expected {knob}=LOW:HIGH[:log|linear]")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--range {text!r}: LOW and HIGH must be numbers") from None
    return knob, Range(low, high, log=len(parts) == 2 or parts[2] == "log")


def search_space(method: str, ranges: dict[str, Range] | None = None) -> dict:
    """Tune search space (config field -> sampler) for ``method``'s knobs."""
    ranges = {**DEFAULT_RANGES, **(ranges or {})}
    return {field_name(knob): ranges[knob].to_tune() for knob in method_knobs(method)}


def paper_grid(method: str, fixed: dict[str, object] | None = None, subsets: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """The paper grid's axes for ``method`` (config field -> values), with some axes fixed to
    one value or cut down to a subset of their values."""
    fixed, subsets = fixed or {}, subsets or {}
    for axis in (*fixed, *subsets):
        if axis not in PAPER_GRID:
            raise ValueError(f"grid axis must be one of {', '.join(PAPER_GRID)}; got {axis!r}")
    axes = {}
    for axis in method_card(method).grid_axes:
        values = (fixed[axis],) if axis in fixed else tuple(subsets.get(axis, PAPER_GRID[axis]))
        axes[field_name(axis)] = values
    return axes


def grid_size(axes: dict[str, tuple]) -> int:
    return math.prod(len(values) for values in axes.values())
