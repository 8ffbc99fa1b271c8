"""One card per training method: everything the rest of the package needs to know about it.

Config validation and hashing, the trials' columns, the search space, the paper grid, the report's
order, names and colours, and the base-model cache key all read the cards; the training loop asks
the objective itself (``dpsm_ray.objectives.base.Objective``) what it learns.  Adding a method is
its objective, its card and its tests (docs/extending.md); a method defined outside the package
joins through ``register_method``.

Known without importing torch or Ray (the CLI validates ``--methods`` before either loads): an
in-package card names its objective as ``"module:class"``, imported when a run builds it
(``dpsm_ray.lazy.imported``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dpsm_ray.facts import CE_BATCHES, CONFTR_SPLITS, CUT_SCORES, Q_INITS, QUANTILE_LR_PER_EPOCH, SPLITS
from dpsm_ray.cards.knobs import DEFAULT_RANGES, PAPER_GRID, SHARED_GRID_AXES, knob_name, paper_grid as grid_of
from dpsm_ray.cards.registry import built_in, register, registry, seal, sealed, unregister
from dpsm_ray.lazy import imported

if TYPE_CHECKING:
    from dpsm_ray.objectives.base import Objective

# What every objective's constructor takes whatever its card says.
_COMMON_ARGUMENTS = ("alpha", "conformal_weight", "collective")
# "base": the CE base model itself, evaluated without further training (the paper's table's CE
# column, docs/method.md); a run of it trains 0 epochs from --init base.  Not a card: it builds CE.
BASE_MODEL = "base"
# Plain cross-entropy: what a base model trains with (and ``base`` builds), and the reference every
# league and study compares the other methods with.
REFERENCE_METHOD = "ce"


@dataclass(frozen=True)
class MethodOption:
    """A training option some methods read and the others do not: declared once (the built-in ones
    below, an outside method's on its card), it is a ``TrainConfig`` value like a field --
    ``config.<name>``, ``--<name>`` on the command line, a key of config files and sweeps, checked
    by ``validate``, in the config hash of the methods whose card lists it only.

    ``default``: its value when not given (``None``, with ``type``: the method decides);
    ``type``: ``float``, ``int`` or ``str`` (the default's when empty); ``choices``: a ``str``
    option's allowed values; ``check``: whether a value of its type is allowed, and ``allowed``
    what the error then says; ``sweep``, ``column``, ``label``, ``renamed_from``: as a field's
    (``dpsm_ray.config.option``)."""

    name: str
    default: Any
    help: str
    allowed: str = ""
    check: Callable[[Any], bool] | None = None
    choices: tuple[str, ...] | None = None
    type: str = ""
    sweep: bool = False
    column: bool = False
    label: str | None = None
    renamed_from: str | None = None

    @property
    def kind(self) -> str:
        return self.type or type(self.default).__name__

    @property
    def metadata(self) -> dict:
        """What ``dpsm_ray.config.option`` records of a field, for the code that reads fields and options alike."""
        kinds = {"float": float, "int": int, "str": str, "bool": bool}
        marks = {"label": self.label, "renamed_from": self.renamed_from, "type": kinds[self.kind]}
        return {"help": self.help, "sweep": self.sweep, "column": self.column, "recorded_at_default": True,
                **{key: value for key, value in marks.items() if value is not None}}

    def problem(self, value) -> str | None:
        """Why ``value`` is not allowed (the error's words), or None."""
        if value is None:
            return None if self.default is None else f"must be {'a number' if self.kind != 'str' else 'given'}"
        if self.kind == "float" and not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            return "must be a finite number"
        if self.kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
            return "must be an integer"
        if self.kind == "bool" and not isinstance(value, bool):
            return "must be true or false"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.kind == "str" and not isinstance(value, str):
            return "must be a string"
        return None if self.check is None or self.check(value) else self.allowed


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
    ``headline``: the method the report's headline compares with the best of the others (the paper's).
    ``presets``: the settings each named preset gives it (``--preset``, dpsm_ray/train/presets.py).
    ``options``: options of its own (``MethodOption``), which it reads besides ``fields``: how a
    method registered outside the package brings one.
    """

    name: str
    title: str
    objective: Any  # the Objective subclass, or where it is as "module:name" (imported when a run builds it)
    fields: tuple[str, ...] = ()
    arguments: Mapping[str, str] = field(default_factory=dict)
    knobs: tuple[str, ...] = ("lr",)
    grid_axes: tuple[str, ...] = SHARED_GRID_AXES
    paper: bool = False
    short_title: str | None = None  # tick labels and legends; the title when None
    colour: str | None = None
    marker: str | None = None
    headline: bool = False
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    options: tuple[MethodOption, ...] = ()

    def objective_class(self):
        return imported(self.objective) if isinstance(self.objective, str) else self.objective

    def reads(self, field_name: str) -> bool:
        return field_name in self.fields or any(option.name == field_name for option in self.options)

    def build(self, values: Mapping[str, Any], *, seed: int = 0, collective=None):
        """The objective for a run whose config fields are ``values`` (``alpha``,
        ``conformal_weight`` and the card's ``fields``); ``seed`` goes to a constructor that
        takes one (DPSM's random q_0, CUT's APS uniforms)."""
        cls = self.objective_class()
        kwargs = {"alpha": values["alpha"], "conformal_weight": values["conformal_weight"], "collective": collective}
        # a field left out of ``values`` takes the constructor's default
        read = (*self.fields, *(option.name for option in self.options))
        kwargs.update({self.arguments.get(name, name): values[name] for name in read if name not in _COMMON_ARGUMENTS and name in values})
        if "seed" in inspect.signature(cls).parameters:
            kwargs["seed"] = seed
        return cls(**kwargs)


_CARDS = registry("method")  # in the report's order
_OPTIONS: dict[str, MethodOption] = {}  # every method option, the built-in ones first (validate's order)


def register_method(card: MethodCard, *, replace: bool = False) -> MethodCard:
    """Make ``card``'s method known to config validation, sweeps and reports in this process.

    A sweep sends the cards registered outside the package to its Tune trials (a trial that is a
    Ray Train run with ``workers >= 1`` needs the method importable on its workers).  The card's
    knobs and grid axes must be among ``DEFAULT_RANGES`` and ``PAPER_GRID``."""
    if not card.name.isidentifier() or card.name == BASE_MODEL:
        raise ValueError(f"method name must be an identifier other than {BASE_MODEL!r}; got {card.name!r}")
    outside = "method" in sealed()
    own = {option.name: option for option in card.options}
    shared = sorted(set(card.fields) - method_fields() - set(own)) if outside else []
    if not built_in("method", card.name) and shared:
        # a field every method reads would leave every other method's config hash
        raise ValueError(
            f"method {card.name}: fields must be method-specific options ({', '.join(sorted(method_fields()))}) or its own options;"
            f" got {', '.join(shared)}"
        )
    # a name of a field, a built-in option or another card's option (the same card again, unpickled in a trial's process, may)
    owners = {option.name: other.name for other in _CARDS.values() for option in other.options}
    clash = [name for name in own if name in CONFIG_FIELDS or name in BUILT_IN_OPTIONS or owners.get(name, card.name) != card.name]
    if clash or any(not name.isidentifier() for name in own):
        raise ValueError(f"method {card.name}: its options must be new identifiers, not options or config fields that exist; got"
                         f" {', '.join(clash or own)}")
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
    card = register("method", card, replace)
    _OPTIONS.update(own)
    return card


def unregister_method(name: str) -> None:
    unregister("method", name)
    kept = {option.name for card in _CARDS.values() for option in card.options}
    for option in [name for name in _OPTIONS if name not in kept and name not in BUILT_IN_OPTIONS]:
        del _OPTIONS[option]


def method_card(name: str) -> MethodCard:
    if name not in _CARDS:
        raise ValueError(f"method must be one of {', '.join(method_names())}; got {name!r}")
    return _CARDS[name]


def method_names() -> tuple[str, ...]:
    """Every registered method, sorted by name (what errors and ``--help`` list)."""
    return tuple(sorted(_CARDS))


def method_cards() -> tuple[MethodCard, ...]:
    """Every card, in the report's order (the built-in ones, then others as registered)."""
    return tuple(_CARDS.values())


def reads(method: str, field_name: str) -> bool:
    """Whether a run of ``method`` reads the config field ``field_name``: a field no card lists
    is read by every method; a method-specific one only by the methods whose card lists it (the
    CE base model, ``base``, by none)."""
    if field_name not in method_fields():
        return True
    return method in _CARDS and _CARDS[method].reads(field_name)


def headline_method() -> str | None:
    """The method the report's headline compares with the others (the first card marked so)."""
    return next((card.name for card in _CARDS.values() if card.headline), None)


def preset_settings(preset: str, method: str) -> dict:
    """What preset ``preset`` gives ``method`` beyond its shared schedule (nothing for a method
    whose card names no such preset, or for the base model)."""
    card = _CARDS.get(method)
    return dict(card.presets.get(preset, {})) if card is not None else {}


def method_fields() -> frozenset[str]:
    """The config fields and options some method reads and another does not."""
    return frozenset(name for card in _CARDS.values() for name in card.fields) | frozenset(_OPTIONS)


def method_options() -> dict[str, MethodOption]:
    """Every method option (the built-in ones, then those of methods registered outside), by name."""
    return dict(_OPTIONS)


# -- the built-in options: each read by the methods whose card lists it in ``fields`` ------------------
# ``TrainConfig``'s own fields, which a method's option must not be named as (kept here: the cards import no config)
CONFIG_FIELDS = frozenset({
    "dataset", "data_root", "download", "model", "pretrained_path", "method", "init", "init_checkpoint", "base_epochs", "base_lr",
    "base_batch_size", "base_milestones", "cache_dir", "alpha", "conformal_weight", "lr", "batch_size", "epochs", "milestones",
    "lr_decay", "lr_schedule", "momentum", "nesterov", "weight_decay", "seed", "split_seed", "train_subset", "val_splits",
    "diagnostic_examples", "eval_splits", "eval_scores", "eval_calibrations", "evaluate_test", "workers", "gpus_per_worker",
    "cpus_per_worker", "device", "data_workers", "precision", "channels_last", "step", "checkpoint_every", "max_failures",
    "debug_sync_checks", "options",
})
_BUILT_IN_OPTIONS = (
    MethodOption(
        "sigmoid_temperature", 1.0,
        "the paper's T (tau_Sigmoid): temperature of the soft set size, > 0 (the official code's 1: docs/method.md)",
        "must be > 0", lambda value: value > 0, renamed_from="--temperature", column=True, label="T (sigmoid_temperature)",
    ),
    MethodOption(
        "sort_temperature", 0.01, "soft-sort temperature for ConfTr's quantile and CUT, >= 0 (0 = exact sort)",
        "must be >= 0", lambda value: value >= 0, sweep=True, column=True, label="soft-sort temperature",
    ),
    MethodOption(
        "quantile_lr", None,
        f"the paper's gamma: DPSM's learning rate for q, per step, > 0; default: {QUANTILE_LR_PER_EPOCH:g} / (steps per epoch), so that q"
        " moves as far per epoch on any dataset size (docs/method.md)",
        "gamma must be > 0", lambda value: value > 0, type="float", column=True, label="γ (quantile_lr, per step)",
    ),
    MethodOption(
        "q_init", "dataset",
        "DPSM's q_0: dataset (Q_n of the starting model's D1 scores), zero, or random (Unif(0, 1) from the run seed: Algorithm 1's random"
        " start)",
        choices=Q_INITS, sweep=True, column=True, label="q_0 (q_init)",
    ),
    MethodOption(
        "conftr_split", "batch",
        "ConfTr's calibration/prediction split: batch (each batch of the whole training set split at random, CE on all of it: Stutz et al."
        " and the official code) or halves (B1 from D1 calibrates, B2 from D2 predicts, CE on B1: Algorithm 1's halves)",
        choices=CONFTR_SPLITS, sweep=True, column=True, label="ConfTr's split (conftr_split)",
    ),
    MethodOption(
        "ce_batch", "full",
        "DPSM's and CUT's cross-entropy: full (the whole batch, B1 and B2: the official code) or half (B1 only: the tex's Algorithm 1,"
        " where D2 gets no CE gradient)",
        choices=CE_BATCHES, sweep=True, column=True, label="CE on (ce_batch)",
    ),
    MethodOption(
        "dpsm_split", "halves",
        "DPSM's B1 (quantile) and B2 (size loss): halves (from the fixed halves D1 and D2: Algorithm 1) or batch (the two random halves of"
        " each batch of the whole training set: the official code splits each batch in place)",
        choices=SPLITS, sweep=True, column=True, label="DPSM's B1/B2 (dpsm_split)",
    ),
    MethodOption(
        "size_target", 0.0, "ConfTr (published)'s kappa: the size loss is max(soft size - kappa, 0), >= 0",
        "kappa must be >= 0", lambda value: value >= 0, label="κ (size_target)",
    ),
    MethodOption(
        "ce_weight", 0.0, "ConfTr (published)'s weight of its optional classification loss (CE), >= 0 (its THR configuration: 0)",
        "must be >= 0", lambda value: value >= 0, label="CE weight (ce_weight)",
    ),
    MethodOption(
        "cut_score", "hps",
        "CUT's training score: hps (1 - p_y), or aps (randomised APS conformity scores, uniform for a calibrated model: Einbinder et al.)",
        choices=CUT_SCORES, sweep=True, column=True, label="CUT's score (cut_score)",
    ),
    MethodOption(
        "vr_neighbours", 4,
        "VR-ConfTr's m: the calibration scores nearest the batch quantile whose mean gradient stands for the quantile's, >= 1 (the"
        " authors' Fashion-MNIST setting: 4)",
        "must be an integer >= 1 (VR-ConfTr's m)", lambda value: value >= 1, sweep=True, column=True, label="VR-ConfTr's m (vr_neighbours)",
    ),
    MethodOption(
        "rank_exponent", 1.0,
        "RWCE's gamma: each example's cross-entropy is weighted by the rank of its true label to this power, >= 0 (0: plain CE; the"
        " public RWCE code's default: 1)",
        "must be >= 0 (RWCE's gamma)", lambda value: value >= 0, sweep=True, column=True, label="RWCE's γ (rank_exponent)",
    ),
)
BUILT_IN_OPTIONS = {option.name: option for option in _BUILT_IN_OPTIONS}
_OPTIONS.update(BUILT_IN_OPTIONS)


# -- the built-in methods, in the report's order ---------------------------------------------------
# Each objective named as ``module:class``, imported when a run builds it (dpsm_ray.lazy.imported): the objectives import torch,
# the cards must not.

_BUILT_IN_CARDS = (
    MethodCard(
        "ce",
        "CE",
        "dpsm_ray.objectives.ce:CrossEntropy",
        paper=True,
        presets={"official": {}},
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
        # YuanjieSh/DPSM_code's CUT path (CE on the whole batch, train_cifar.py:265-268); its README has no command for it
        presets={"official": {"conformal_weight": 0.05, "ce_batch": "full"}},
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
        # the same code's ConfTr path (CE on the whole batch, train_cifar.py:196-199): T and lambda as DPSM's
        presets={"official": {"sigmoid_temperature": 1.0, "conformal_weight": 0.05, "conftr_split": "batch"}},
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
        # ConfTr's own code (google-deepmind/conformal_training, experiments/run_fashion_mnist.py and run.py): from
        # scratch, batch 100, 150 epochs, lr 0.01 divided by 10 at epochs 60, 90 and 120, Nesterov momentum 0.9, weight
        # decay 5e-4 * sum of squares (1e-3 as torch's coefficient), T 0.1, size weight 0.01 inside the logarithm,
        # kappa 0, no CE, smooth sort dispersion 0.1
        presets={"official": {
            "init": "scratch", "batch_size": 100, "epochs": 150, "lr": 0.01, "milestones": (60, 90, 120), "lr_decay": 0.1,
            "lr_schedule": "step", "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3, "sigmoid_temperature": 0.1,
            "conformal_weight": 0.01, "size_target": 0.0, "ce_weight": 0.0, "sort_temperature": 0.1,
        }},
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
        headline=True,
        # YuanjieSh/DPSM_code at 6bb92ed: CE on the whole batch, each batch split in place into the quantile's and the
        # size loss's halves (train_cifar.py:300, 358-361), T = 1 and lambda 0.05 (the ResNet-110 command), q's fixed step
        # 0.01 (--lr_qr)
        presets={"official": {"sigmoid_temperature": 1.0, "conformal_weight": 0.05, "quantile_lr": 0.01, "ce_batch": "full",
                              "dpsm_split": "batch"}},
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
seal("method")
BUILT_IN = {card.name: card for card in _BUILT_IN_CARDS}


def paper_grid(method: str, fixed: dict[str, object] | None = None, subsets: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """The paper grid's axes for ``method`` (config field -> values), with some axes fixed to
    one value or cut down to a subset of their values."""
    return grid_of(method_card(method).grid_axes, fixed, subsets)


def build_objective(method: str, *, seed: int = 0, collective=None, **values) -> Objective:
    """The objective of ``method`` (its card) from config field values
    (``alpha``, ``conformal_weight``, ``quantile_lr`` ...); a field the method does not read is
    ignored, one left out takes the objective's default.  ``seed`` is the run seed: DPSM's random
    q_0 and CUT's APS uniforms derive from it."""
    unknown = set(values) - method_fields() - {"alpha", "conformal_weight"}
    if unknown:
        raise TypeError(f"build_objective: no method reads {', '.join(sorted(unknown))}")
    return method_card(REFERENCE_METHOD if method == BASE_MODEL else method).build(values, seed=seed, collective=collective)


# the built-in methods (``method_names()`` adds registered ones), and the paper's table: what a sweep runs by default
METHODS = tuple(sorted(BUILT_IN))
PAPER_METHODS = tuple(name for name in METHODS if BUILT_IN[name].paper)
