"""One card per training method: everything the rest of the package needs to know about it.

Config validation and hashing, the trials' columns, the search space, the paper grid, the report's
order, names and colours, and the base-model cache key all read the cards; the training loop asks
the objective itself (``dpsm_ray.objectives.base.Objective``) what it learns.  Adding a method is
its objective, its card and its tests (docs/extending.md); a method defined outside the package
joins through ``register_method``.

Known without importing torch or Ray (the CLI validates ``--methods`` before either loads): an
in-package card names its objective as ``"module:Class"``, imported when a run builds it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

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
# What every objective's constructor takes whatever its card says.
COMMON_ARGUMENTS = ("alpha", "conformal_weight", "collective")
# "base": the CE base model itself, evaluated without further training (the paper's table's CE
# column, docs/method.md); a run of it trains 0 epochs from --init base.  Not a card: it builds CE.
BASE_MODEL = "base"


@dataclass(frozen=True)
class MethodCard:
    """A training method.

    ``fields``: the ``TrainConfig`` fields the method reads besides the ones every run reads (the
    others are left out of its config hash and are null in its trials.parquet rows); each is
    passed to the objective's constructor under its own name, or under ``arguments[field]``.
    ``knobs``: what a search varies (names of ``DEFAULT_RANGES`` above).
    ``grid_axes``: its axes of the paper's grid (``PAPER_GRID`` above).
    ``paper``: in the paper's table, so a sweep runs it unless told otherwise.
    ``colour`` / ``marker``: its matplotlib style in every figure (None: one drawn from its name).
    """

    name: str
    title: str
    objective: Any  # the Objective subclass (or a callable returning one), or "module:Class"
    fields: tuple[str, ...] = ()
    arguments: Mapping[str, str] = field(default_factory=dict)
    knobs: tuple[str, ...] = ("lr",)
    grid_axes: tuple[str, ...] = SHARED_GRID_AXES
    paper: bool = False
    short_title: str | None = None  # tick labels and legends; the title when None
    colour: str | None = None
    marker: str | None = None

    def objective_class(self):
        if not isinstance(self.objective, str):
            return self.objective
        module, _, name = self.objective.partition(":")
        return getattr(importlib.import_module(module), name)

    def reads(self, field_name: str) -> bool:
        return field_name in self.fields

    def build(self, values: Mapping[str, Any], *, seed: int = 0, collective=None):
        """The objective for a run whose config fields are ``values`` (``alpha``,
        ``conformal_weight`` and the card's ``fields``); ``seed`` goes to a constructor that
        takes one (DPSM's random q_0, CUT's APS uniforms)."""
        cls = self.objective_class()
        kwargs = {"alpha": values["alpha"], "conformal_weight": values["conformal_weight"], "collective": collective}
        # a field left out of ``values`` takes the constructor's default
        kwargs.update(
            {self.arguments.get(name, name): values[name] for name in self.fields if name not in COMMON_ARGUMENTS and name in values}
        )
        if "seed" in inspect.signature(cls).parameters:
            kwargs["seed"] = seed
        return cls(**kwargs)


_CARDS: dict[str, MethodCard] = {}  # in the report's order
BUILT_IN_NAMES: tuple[str, ...] = ()  # set once the built-in cards are registered


def register_method(card: MethodCard, *, replace: bool = False) -> MethodCard:
    """Make ``card``'s method known to config validation, sweeps and reports in this process.

    A sweep sends the cards registered outside the package to its Tune trials (a trial that is a
    Ray Train run with ``workers >= 1`` needs the method importable on its workers).  The card's
    knobs and grid axes must be among ``DEFAULT_RANGES`` and ``PAPER_GRID``."""
    if not card.name.isidentifier() or card.name == BASE_MODEL:
        raise ValueError(f"method name must be an identifier other than {BASE_MODEL!r}; got {card.name!r}")
    shared = sorted(set(card.fields) - method_fields()) if BUILT_IN_NAMES else []
    if card.name not in BUILT_IN_NAMES and shared:
        # a field every method reads would leave every other method's config hash
        raise ValueError(
            f"method {card.name}: fields must be method-specific options ({', '.join(sorted(method_fields()))}); got {', '.join(shared)}"
        )
    renamed = {"knobs": tuple(knob_name(k, f"method {card.name}'s knobs") for k in card.knobs),
               "grid_axes": tuple(knob_name(a, f"method {card.name}'s grid_axes") for a in card.grid_axes)}
    if renamed != {"knobs": card.knobs, "grid_axes": card.grid_axes}:
        card = dataclasses.replace(card, **renamed)
    unknown = [k for k in card.knobs if k not in DEFAULT_RANGES] + [a for a in card.grid_axes if a not in PAPER_GRID]
    if unknown:
        raise ValueError(
            f"method {card.name}: knobs must be among {', '.join(DEFAULT_RANGES)} and grid axes among {', '.join(PAPER_GRID)}; got"
            f" {', '.join(unknown)}"
        )
    if card.name in _CARDS and not replace and _CARDS[card.name] != card:
        raise ValueError(f"method {card.name!r} is registered already (pass replace=True to change it)")
    _CARDS[card.name] = card
    return card


def unregister_method(name: str) -> None:
    if name in BUILT_IN_NAMES:
        raise ValueError(f"method {name!r} is built in")
    _CARDS.pop(name, None)


def method_card(name: str) -> MethodCard:
    if name not in _CARDS:
        raise ValueError(f"method must be one of {', '.join(method_names())}; got {name!r}")
    return _CARDS[name]


def method_names() -> tuple[str, ...]:
    """Every registered method, sorted by name (what errors and ``--help`` list)."""
    return tuple(sorted(_CARDS))


def cards() -> tuple[MethodCard, ...]:
    """Every card, in the report's order (the built-in ones, then others as registered)."""
    return tuple(_CARDS.values())


def outside_cards() -> tuple[MethodCard, ...]:
    """The cards registered from outside the package: what a sweep ships to its trials."""
    return tuple(card for name, card in _CARDS.items() if name not in BUILT_IN_NAMES)


def reads(method: str, field_name: str) -> bool:
    """Whether a run of ``method`` reads the config field ``field_name``: a field no card lists
    is read by every method; a method-specific one only by the methods whose card lists it (the
    CE base model, ``base``, by none)."""
    if field_name not in method_fields():
        return True
    return method in _CARDS and _CARDS[method].reads(field_name)


def method_fields() -> frozenset[str]:
    """The config fields some method reads and another does not."""
    return frozenset(name for card in _CARDS.values() for name in card.fields)


# -- the built-in methods, in the report's order ---------------------------------------------------
_BUILT_IN_CARDS = (
    MethodCard(
        "ce",
        "CE",
        "dpsm_ray.objectives.ce:CrossEntropy",
        paper=True,
        colour="tab:blue",
        marker="o",
    ),
    MethodCard(
        "cut",
        "CUT",
        "dpsm_ray.objectives.cut:CUT",
        fields=("conformal_weight", "sort_temperature", "cut_score", "ce_batch"),
        arguments={"cut_score": "score"},
        knobs=("conformal_weight", "lr"),
        grid_axes=(*SHARED_GRID_AXES, "conformal_weight"),
        paper=True,
        colour="tab:green",
        marker="s",
    ),
    MethodCard(
        "conftr",
        "ConfTr",
        "dpsm_ray.objectives.conftr:ConfTr",
        fields=("conformal_weight", "sigmoid_temperature", "sort_temperature", "conftr_split"),
        arguments={"conftr_split": "split"},
        knobs=("conformal_weight", "lr", "sigmoid_temperature"),
        grid_axes=(*SHARED_GRID_AXES, "conformal_weight"),
        paper=True,
        colour="tab:orange",
        marker="^",
    ),
    MethodCard(
        "conftr_published",
        "ConfTr (published)",
        "dpsm_ray.objectives.conftr:ConfTrPublished",
        fields=("conformal_weight", "sigmoid_temperature", "sort_temperature", "size_target", "ce_weight"),
        # its size weight sits inside a logarithm, where it only shifts the loss: not a knob
        knobs=("lr", "sigmoid_temperature"),
        short_title="ConfTr (pub.)",
        colour="tab:brown",
        marker="v",
    ),
    MethodCard(
        "dpsm",
        "DPSM",
        "dpsm_ray.objectives.dpsm:DPSM",
        fields=("conformal_weight", "sigmoid_temperature", "quantile_lr", "q_init", "dpsm_split", "ce_batch"),
        arguments={"dpsm_split": "split"},
        knobs=("conformal_weight", "lr", "quantile_lr", "sigmoid_temperature"),
        grid_axes=(*SHARED_GRID_AXES, "conformal_weight", "quantile_lr"),
        paper=True,
        colour="tab:red",
        marker="D",
    ),
    # Methods published since, not in the paper's table (docs/baselines.md: each one's source,
    # its knobs and where it departs from the public code).  Their colours are outside
    # dpsm_ray/results/figures.py's fallback palette, which a method without a card draws from.
    MethodCard(
        "confts",
        "ConfTS",
        "dpsm_ray.objectives.confts:ConfTS",
        # trains one temperature, the network frozen: the model learning rate (lr) is T's, on log T
        colour="black",
        marker="<",
    ),
    MethodCard(
        "vr_conftr",
        "VR-ConfTr",
        "dpsm_ray.objectives.vr_conftr:VRConfTr",
        fields=("conformal_weight", "sigmoid_temperature", "vr_neighbours"),
        arguments={"vr_neighbours": "neighbours"},
        knobs=("conformal_weight", "lr", "sigmoid_temperature"),  # ConfTr's; m stays the authors' 4
        grid_axes=(*SHARED_GRID_AXES, "conformal_weight"),
        colour="goldenrod",
        marker=">",
    ),
    MethodCard(
        "rwce",
        "RWCE",
        "dpsm_ray.objectives.rwce:RankWeightedCE",
        fields=("rank_exponent",),
        colour="slateblue",
        marker="p",
    ),
)
for _card in _BUILT_IN_CARDS:
    register_method(_card)
BUILT_IN = {card.name: card for card in _BUILT_IN_CARDS}
BUILT_IN_NAMES = tuple(BUILT_IN)


def paper_grid(method: str, fixed: dict[str, object] | None = None, subsets: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """The paper grid's axes for ``method`` (config field -> values), with some axes fixed to
    one value or cut down to a subset of their values."""
    fixed, subsets = fixed or {}, subsets or {}
    for axis in (*fixed, *subsets):
        if axis not in PAPER_GRID:
            raise ValueError(f"grid axis must be one of {', '.join(PAPER_GRID)}; got {axis!r}")
    return {axis: (fixed[axis],) if axis in fixed else tuple(subsets.get(axis, PAPER_GRID[axis])) for axis in method_card(method).grid_axes}
