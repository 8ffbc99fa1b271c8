"""What each method searches over, and the paper's grid (the paper's appendix D).

A knob is named by the ``TrainConfig`` field it sets (``conformal_weight``, ``lr``, ``quantile_lr``,
``sigmoid_temperature``: the paper's lambda, eta, gamma and T).  Ranges default to the paper grid's
bounds and are log-uniform.  The knobs, their ranges and the grid are defined beside the method
cards (``dpsm_ray.cards.knobs``; ``dpsm_ray.cards.methods`` checks a card's names against them) and used from here.
"""

from __future__ import annotations

import math

# the knobs live with the cards; the names not used here are handed on to this module's importers
from dpsm_ray.cards import DEFAULT_RANGES, KNOB_ALIASES, PAPER_GRID, Range, knob_name, method_card, paper_grid  # noqa: F401


def method_knobs(method: str) -> tuple[str, ...]:
    """What a search varies for ``method``: its card's knobs (dpsm_ray/cards/methods.py)."""
    return method_card(method).knobs


def parse_range(text: str) -> tuple[str, Range]:
    """``conformal_weight=0.01:1`` (log-uniform) or ``...=0.01:1:linear`` -> (knob, Range)."""
    knob, _, bounds = text.partition("=")
    knob = knob_name(knob, f"--range {text}")
    if knob not in DEFAULT_RANGES:
        raise ValueError(f"--range: unknown knob {knob!r}; allowed: {', '.join(DEFAULT_RANGES)}")
    parts = bounds.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("log", "linear")):
        raise ValueError(f"--range {text!r}: expected {knob}=LOW:HIGH[:log|linear]")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"--range {text!r}: LOW and HIGH must be numbers") from None
    try:
        return knob, Range(low, high, log=len(parts) == 2 or parts[2] == "log")
    except ValueError as error:
        raise ValueError(f"--range {text!r}: {error}") from None


def search_space(method: str, ranges: dict[str, Range] | None = None) -> dict:
    """Tune search space (config field -> sampler) for ``method``'s knobs."""
    ranges = {**DEFAULT_RANGES, **(ranges or {})}
    return {knob: ranges[knob].to_tune() for knob in method_knobs(method)}


def grid_size(axes: dict[str, tuple]) -> int:
    return math.prod(len(values) for values in axes.values())
