"""The knobs a search varies and the paper's grid (its appendix D): what the method cards name
(``dpsm_ray.cards.methods`` checks a card's knobs and axes against them), what a sweep searches
(``dpsm_ray.sweep.space``) and what the report shows."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

# Search knobs and the paper's grid (the paper's appendix D): the cards name theirs among
# these; dpsm_ray/sweep/space.py builds searches from them.  A knob is named by the ``TrainConfig``
# field it sets, one name for the CLI (--range, --fix, --subset, the training flags), the logs, the
# Parquet columns and the docs; the paper's symbol is in each field's help.  The names of earlier
# releases are accepted with a FutureWarning until the next one (``knob_name``).
KNOB_ALIASES = {
    "lambda": "conformal_weight",  # the paper's lambda
    "gamma": "quantile_lr",  # the paper's gamma, per step
    "temperature": "sigmoid_temperature",  # the paper's T (tau_Sigmoid)
}


def knob_name(name: str, where: str = "knob") -> str:
    """``name``, or the knob an earlier release's name for it (``lambda``, ``gamma``,
    ``temperature``) now is, with a FutureWarning naming ``where`` it was given."""
    if name not in KNOB_ALIASES:
        return name
    new = KNOB_ALIASES[name]
    warnings.warn(f"{where}: {name!r} is now called {new!r} (the config field, CLI option and Parquet column); "
                  f"{name!r} is accepted until the next release", FutureWarning, stacklevel=3)
    return new


def with_current_knob_names(sweep: dict) -> dict:
    """A ``sweep.json``'s settings with its knobs (``ranges``, ``grid_fixed``, ``grid_subsets``)
    named as now: an earlier release's file names them ``lambda``, ``gamma``, ``temperature``
    (docs/results.md); silent, since the user gave no option to warn about."""
    renamed = dict(sweep)
    for key in ("ranges", "grid_fixed", "grid_subsets"):
        if isinstance(sweep.get(key), list):
            renamed[key] = [
                [KNOB_ALIASES.get(pair[0], pair[0]), *pair[1:]] if isinstance(pair, list) and pair else pair for pair in sweep[key]
            ]
    return renamed


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
    "conformal_weight": Range(0.01, 5.0),  # paper grid {0.01, 0.05, 0.1, 0.5, 1, 5}
    "lr": Range(0.001, 0.1),  # paper grid {0.001, 0.005, 0.01, 0.05, 0.1}
    "quantile_lr": Range(1e-4, 0.5),  # paper grid {1e-4, ..., 0.5}, per step
    "sigmoid_temperature": Range(0.01, 1.0),  # not in the paper grid; the official code fixes 1.0
}


# The paper's grid: shared axes, then each method's own.
PAPER_GRID = {
    "batch_size": (64, 128),
    "epochs": (30, 40, 60),
    "lr": (0.001, 0.005, 0.01, 0.05, 0.1),
    "milestones": ((3,), (25,), (25, 40)),
    "lr_decay": (0.1, 0.97),
    "conformal_weight": (0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    "quantile_lr": (0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5),
}
# each method's axes: its card's ``grid_axes``


# What every method's grid varies (the paper's grid, appendix D); a method adds its own axes.
SHARED_GRID_AXES = ("batch_size", "epochs", "lr", "milestones", "lr_decay")


def paper_grid(axes: tuple[str, ...], fixed: dict[str, object] | None = None, subsets: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """The paper grid's values of ``axes`` (config field -> values), with some axes fixed to one
    value or cut down to a subset of their values."""
    fixed, subsets = fixed or {}, subsets or {}
    for axis in (*fixed, *subsets):
        if axis not in PAPER_GRID:
            raise ValueError(f"grid axis must be one of {', '.join(PAPER_GRID)}; got {axis!r}")
    return {axis: (fixed[axis],) if axis in fixed else tuple(subsets.get(axis, PAPER_GRID[axis])) for axis in axes}
