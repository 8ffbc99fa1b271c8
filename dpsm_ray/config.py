"""The one frozen, validated configuration of a training run.

Every field carries its help text and allowed range -- a setting every method shares here, one that
only some methods read on the cards (``MethodOption``, dpsm_ray/cards/methods.py), held in
``options`` and read as an attribute alike; the CLI builds its options from these, the sweep builds
configs from dicts, and ``validate()`` gives one error naming the field, the value and what is
allowed -- before any data is loaded or any Ray work starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field

from dpsm_ray import cards
from dpsm_ray.facts import QUANTILE_LR_PER_EPOCH
from dpsm_ray.conformal import CALIBRATIONS
from dpsm_ray.conformal.levels import min_calibration_size
from dpsm_ray.own_data import split_path_spec
from dpsm_ray.cards import check_model, default_model, paper_score_names, pretrainable_models, score_names, split_sizes
from dpsm_ray.cards import BASE_MODEL, METHODS, headline_method, method_names, method_options, reads
from dpsm_ray.cards.methods import BUILT_IN_OPTIONS


class ConfigError(ValueError):
    """A configuration value outside its allowed range."""

    def __init__(self, name: str, value, allowed: str) -> None:
        self.field, self.value, self.allowed = name, value, allowed
        super().__init__(f"{name}={value!r} is invalid: {allowed}")


def option(
    default,
    help,
    *,
    operational: bool = False,
    path: bool = False,
    sweep: bool = False,
    column: bool = False,
    label: str | None = None,
    recorded_at_default: bool = True,
    **metadata,
):
    """A config field, declared once: its default and help text (a string, or a function returning
    one where the text lists cards, so that cards registered later show in ``--help``), and what
    the rest of the package does with it:

    - ``operational``: it does not change what a run computes (left out of the config hash);
    - ``path``: a path, made absolute before a trial runs elsewhere;
    - ``sweep``: the sweep scripts and the studies offer it as an option (``dpsm-ray train``
      offers every field but those with ``cli=False``);
    - ``column``: a column of trials.parquet (null for a method that does not read it);
    - ``label``: a row of the report's table of each method's settings, so labelled;
    - ``recorded_at_default=False``: left out of ``to_dict`` -- so of the config hash, sweep.json,
      config.json -- while it holds its default: a field added after runs were recorded, so that those
      runs keep their hash (and their cached base models), and their sweeps resume.

    ``type`` and ``nargs`` tell argparse what a ``None`` default or a tuple holds;
    ``renamed_from`` an earlier release's flag; ``cli=False`` keeps it off the command line."""
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults")
    marks = {"operational": operational, "path": path, "sweep": sweep, "column": column, "recorded_at_default": recorded_at_default,
             **({"label": label} if label else {})}
    return field(default=default, metadata={"help": help, **marks, **metadata})


def field_help(name: str) -> str:
    """The help text of config field or method option ``name``."""
    text = config_specs()[name].metadata["help"]
    return text() if callable(text) else text


def _datasets_help() -> str:
    described = []
    for name in cards.dataset_names():
        card = cards.dataset_card(name)
        options = (
            ""
            if card.options is None
            else ",".join(f"{key}={value:g}" if not isinstance(value, str) else f"{key}={value}" for key, value in card.options.items())
        )
        described.append(f"{name}:PATH[:{options}]" if card.path else name if card.options is None else f"{name}[:{options}]")
    return "dataset: " + ", ".join(described)


def _models_help() -> str:
    defaults = ", ".join(f"{name}: {cards.default_model(name)}" for name in cards.dataset_names())
    return f"model architecture: {cards.model_choices()}; auto picks the dataset's default ({defaults})"


PRECISIONS = ("fp32", "bf16")
_LR_SCHEDULES = ("step", "exp")
STEPS = ("eager", "graph")
# ``auto`` (step and precision): the fastest path measured on the run's device, resolved by
# ``dpsm_ray.train.step.resolve_step`` / ``resolve_precision`` where the run trains.
_AUTO = "auto"
# Fields that do not change what a run computes: left out of the config hash.
WEIGHTS = "weights:"  # --init weights:FILE
_WEIGHT_SUFFIXES = (".pt", ".pth", ".safetensors")
MAX_SEED = 2**63


@dataclass(frozen=True)
class TrainConfig:
    # --- what to train --------------------------------------------------------------------
    dataset: str = option("digits", _datasets_help, sweep=True)
    data_root: str | None = option(
        None,
        "directory holding the image datasets: cifar-100-python/, caltech101/101_ObjectCategories/, 2021_train_mini/ + 2021_valid/"
        " (iNaturalist), 2018/ (iNaturalist 2018), Fashion-MNIST's IDX files; for fonts, the font files (default /usr/share/fonts)",
        type=str,
        operational=True,
        path=True,
        sweep=True,
    )
    download: bool = option(False, "download the dataset into --data-root if it is missing", operational=True)
    model: str = option("auto", _models_help, sweep=True)
    pretrained_path: str | None = option(
        None,
        lambda: f"a local weights file whose every tensor but the classifier head's starts {'/'.join(pretrainable_models())}:"
        " torchvision's ImageNet state dict, or a run's model.pt (lenet: e.g. pretrained on fonts for fonts_transfer);"
        " nothing is downloaded",
        type=str,
        path=True,
        sweep=True,
    )
    method: str = option(
        headline_method(),
        f"training objective: {', '.join(METHODS)}; or {BASE_MODEL} (the CE base model itself, evaluated without training: --init base"
        " --epochs 0)",
    )
    init: str = option(
        "scratch",
        "start from random weights (scratch), fine-tune the cached CE base model (base), or start from your own weights "
        "(weights:FILE, a .pt/.pth state dict read with weights_only=True or a .safetensors file, every key and shape matching the model)",
        sweep=True,
        column=True,
        label="init",
    )
    init_checkpoint: str | None = option(
        None, "weights to start from; set from --init base by the base-model cache", cli=False, operational=True
    )
    base_epochs: int | None = option(None, "CE base model epochs (default: the model's recipe)", type=int, sweep=True)
    base_lr: float | None = option(None, "CE base model learning rate (default: the model's recipe)", type=float)
    base_batch_size: int | None = option(None, "CE base model batch size (default: the model's recipe)", type=int)
    base_milestones: tuple[int, ...] | None = option(
        None, "CE base model learning-rate milestones (default: the model's recipe)", type=int, nargs="*"
    )
    cache_dir: str | None = option(
        None, "base-model cache directory (default: $DPSM_RAY_CACHE or ~/.cache/dpsm_ray)", type=str, operational=True, path=True
    )
    # --- the objective ------------------------------------------------------------------------
    alpha: float = option(0.1, "target miscoverage alpha, in (0, 1)", sweep=True, column=True)
    conformal_weight: float = option(
        0.05,
        "the paper's lambda: weight of the conformal term L_c, >= 0 (the official code's 0.05: docs/method.md)",
        renamed_from="--lambda",
        column=True,
        label="λ (conformal_weight)",
    )
    options: tuple[tuple[str, object], ...] = option(
        (), "the method options given (``MethodOption``: the cards'), as (name, value) pairs; read as attributes", cli=False
    )
    # --- optimisation -----------------------------------------------------------------------
    lr: float = option(0.05, "eta: SGD learning rate of the model, > 0", column=True, label="η (lr)")
    batch_size: int = option(
        64, "total batch per step over all workers; half from D1, half from D2", sweep=True, column=True, label="batch size"
    )
    epochs: int = option(30, "number of epochs, >= 1", sweep=True, column=True, label="epochs")
    milestones: tuple[int, ...] = option(
        (), "epochs at which the learning rate is multiplied by --lr-decay", column=True, label="lr milestones"
    )
    lr_decay: float = option(
        0.1,
        "learning-rate decay factor, in (0, 1]: applied at each milestone (--lr-schedule step) or after every epoch from the first"
        " milestone on (exp)",
        column=True,
        label="lr decay",
    )
    lr_schedule: str = option(
        "step",
        "how --lr-decay applies: step (once at each milestone) or exp (after every epoch from the first milestone on, or from the start"
        " without milestones)",
        sweep=True,
        column=True,
        label="lr schedule",
    )
    momentum: float = option(0.9, "SGD momentum, in [0, 1)")
    nesterov: bool = option(False, "Nesterov momentum (Stutz et al.'s optimizer)")
    weight_decay: float = option(1e-4, "SGD weight decay, >= 0")
    seed: int = option(0, "run seed: initialisation, batches, augmentation, evaluation (and the data split, unless --split-seed)")
    split_seed: int | None = option(
        None,
        "seed of the train/val/cal/test split (default: the run seed); sweeps fix it to the sweep seed, so that every seed re-trains on the"
        " split the search selected on",
        type=int,
    )
    train_subset: int | None = option(None, "train on a stratified subset of N training examples (smoke runs)", type=int, sweep=True)
    # --- evaluation ---------------------------------------------------------------------------
    val_splits: int = option(5, "validation re-splits (calibrate on half of val, measure on the other half)")
    diagnostic_examples: int = option(
        10000,
        "training examples the per-epoch diagnostics of epochs.parquet (Q_n, |q - Q_n|, the figures' losses and sizes) score: a seeded"
        " sample of N, the same every epoch (the whole split when it is no larger); 0 = the whole training split (docs/results.md)",
    )
    eval_splits: int = option(10, "random calibration/test re-splits of the final evaluation")
    eval_scores: tuple[str, ...] = option(
        paper_score_names(),
        lambda: f"scores evaluated at the end: {', '.join(score_names())} (the paper's: {', '.join(paper_score_names())})",
    )
    eval_calibrations: tuple[str, ...] = option(
        ("marginal",),
        f"how the final evaluation calibrates each score: {', '.join(CALIBRATIONS)} (marginal: one threshold, 1 - alpha coverage on"
        " average; class: a threshold per class, 1 - alpha in every class; cluster and rc3p: a threshold per class from fewer points a"
        " class, docs/predictor.md); each gives its rows in evals.parquet and classes.parquet",
        type=str,
        recorded_at_default=False,
    )
    evaluate_test: bool = option(
        True, "evaluate on the calibration/test splits at the end (sweeps switch it off while searching)", cli=False, operational=True
    )
    # --- execution ----------------------------------------------------------------------------
    workers: int = option(0, "Ray Train data-parallel workers; 0 trains in this process", sweep=True)
    gpus_per_worker: float = option(0.0, "GPUs per Ray Train worker (fractions pack workers on a GPU)", operational=True, sweep=True)
    cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each Ray Train worker (fractions allowed)", operational=True, sweep=True)
    device: str = option(
        "auto",
        "auto (a GPU when there is one; under Ray the GPU it assigned, and a trial holding a GPU share that sees no CUDA "
        "device fails instead of training on the CPU), cpu (also GPU-shaped trials, on purpose), cuda, cuda:N",
        operational=True,
        sweep=True,
    )
    data_workers: int = option(4, "DataLoader processes for file-based datasets", operational=True, sweep=True)
    precision: str = option(
        "auto",
        "fp32, bf16 (autocast of the model's forward; losses and quantiles stay in fp32), or auto (the measured fast path of the run's"
        " device: bf16 on CUDA, fp32 on a CPU)",
        sweep=True,
    )
    channels_last: bool = option(
        False,
        "keep image batches and conv weights in channels_last memory format (--step auto turns it on on CUDA)",
        operational=True,
        sweep=True,
    )
    step: str = option(
        "auto",
        "training step: eager, graph (the whole step -- forward, loss, backward, SGD, DPSM's q -- captured in one CUDA graph; needs CUDA"
        " and one worker), or auto (the measured fast path of the run's device: graph with channels_last on CUDA for one worker, eager"
        " otherwise)",
        operational=True,
        sweep=True,
    )
    checkpoint_every: int = option(1, "checkpoint every N epochs (and always after the last)", operational=True)
    max_failures: int = option(0, "restarts of a failed worker group from its last checkpoint", operational=True)
    debug_sync_checks: bool = option(False, "assert every step that q and the parameters are identical on all workers", operational=True)

    def __post_init__(self) -> None:
        validate(self)

    def __getattr__(self, name: str):
        """A method option (``dpsm_ray.cards.MethodOption``): its value given, or its default."""
        if name.startswith("__") or name == "options":  # not an option (and ``options`` itself while unpickling)
            raise AttributeError(name)
        given = dict(self.options)
        if name in given:
            return given[name]
        known = method_options()
        if name in known:
            return known[name].default
        raise AttributeError(f"{type(self).__name__} has no field or method option {name!r}")

    def to_dict(self) -> dict:
        """Every field's value and every method option's (``options`` spelled out; an outside
        method's option only for that method or when given), but the fields marked
        ``recorded_at_default=False`` while at their default (``from_dict`` gives them their
        default again)."""
        values = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self) if spec.name != "options"}
        values = {k: v for k, v in values.items() if k in _RECORDED_AT_DEFAULT or v != TrainConfig.__dataclass_fields__[k].default}
        given = dict(self.options)
        for name, spec in method_options().items():
            if name in given or name in BUILT_IN_OPTIONS or reads(self.method, name):
                values[name] = given.get(name, spec.default)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = set(config_specs()) - {"options"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(unknown[0], values[unknown[0]], f"not a training option (known: {', '.join(sorted(known))})")
        tuples = {"milestones", "eval_scores", "eval_calibrations", "base_milestones"}
        return cls(**{k: tuple(v) if k in tuples and v is not None else v for k, v in values.items()})

    def resolved_model(self) -> str:
        """The architecture a run builds: ``model``, or for ``auto`` the dataset card's default."""
        return default_model(self.dataset) if self.model == "auto" else self.model

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def steps_per_epoch(self, train_size: int) -> int:
        """Global steps in an epoch over ``train_size`` training examples (either split: the
        halves D1/D2 give each step half a batch, ConfTr's batch split whole batches)."""
        return (train_size // 2) // (self.batch_size // 2)

    def resolved_quantile_lr(self, train_size: int) -> float:
        """gamma per step: ``quantile_lr``, or by default QUANTILE_LR_PER_EPOCH spread over the
        epoch's steps (a reparametrisation of the paper's constant step)."""
        return self.quantile_lr if self.quantile_lr is not None else QUANTILE_LR_PER_EPOCH / self.steps_per_epoch(train_size)

    def data_seed(self) -> int:
        """The seed that chooses the train/val/cal/test split (and a ``train_subset``)."""
        return self.seed if self.split_seed is None else self.split_seed

    def with_absolute_paths(self) -> TrainConfig:
        """The same config with its paths made absolute: Ray workers and Tune trials run in
        directories of their own, where a relative path means something else."""
        from pathlib import Path

        def absolute(path: str) -> str:
            return str(Path(path).expanduser().resolve())

        changes = {name: absolute(getattr(self, name)) for name in _PATH_FIELDS if getattr(self, name) is not None}
        if cards.dataset_card(self.dataset).path:  # folder:PATH, table:FILE
            family, path, tail = split_path_spec(self.dataset)
            changes["dataset"] = f"{family}:{absolute(path)}" + (f":{tail}" if tail else "")
        if self.init.startswith(WEIGHTS):
            changes["init"] = WEIGHTS + absolute(self.init.removeprefix(WEIGHTS))
        return self.replace(**changes)

    def config_hash(self) -> str:
        """Hash of everything that determines the run's results (operational fields excluded)."""
        relevant = {k: v for k, v in self.to_dict().items() if k not in _OPERATIONAL_FIELDS}
        if self.init == "scratch":  # the base recipe only matters when starting from the base model
            relevant = {k: v for k, v in relevant.items() if not k.startswith("base_")}
        # options only some methods read (their cards' fields) are left out of the other methods'
        # hash, so fixing them for a whole sweep does not split the runs of methods they do not change
        relevant = {k: v for k, v in relevant.items() if reads(self.method, k)}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _init_with_options(init):
    """``TrainConfig(..., sigmoid_temperature=0.5)``: the keywords that are not fields are method
    options, kept in ``options`` when they differ from the option's default, sorted (so that equal
    configs compare and hash equal)."""
    names = frozenset(spec.name for spec in dataclasses.fields(TrainConfig))

    def __init__(self, **values):
        given = dict(values.pop("options", ()))
        given.update({name: values.pop(name) for name in [name for name in values if name not in names]})
        known = method_options()
        kept = {name: value for name, value in given.items() if name not in known or value != known[name].default}
        init(self, options=tuple(sorted(kept.items())), **values)

    return __init__


TrainConfig.__init__ = _init_with_options(TrainConfig.__init__)


# -- what the fields' metadata declares (``option``), for the rest of the package ---------------------
def config_specs() -> dict:
    """Every field (a ``dataclasses.Field``) and every method option (a ``MethodOption``, after
    ``conformal_weight``: the trials' columns keep their order), by name: what the command line,
    config files, the trials' columns and the report's labels are generated from."""
    specs = {}
    for spec in dataclasses.fields(TrainConfig):
        specs[spec.name] = spec
        if spec.name == "conformal_weight":
            specs.update(method_options())
    return specs


def fields_marked(mark: str) -> tuple[str, ...]:
    return tuple(name for name, spec in config_specs().items() if spec.metadata.get(mark))


def field_type(name: str) -> str:
    """A field's or option's value type: ``float``, ``int``, ``str``, ``bool``, ``list[int]`` or
    ``list[str]`` (a ``None`` default aside)."""
    spec = config_specs()[name]
    if not isinstance(spec, dataclasses.Field):
        return spec.kind
    annotation = spec.type.replace(" | None", "")
    return {"tuple[int, ...]": "list[int]", "tuple[str, ...]": "list[str]"}.get(annotation, annotation)


# not ``workers``: without SyncBatchNorm a BatchNorm model trained by W workers is another model
_OPERATIONAL_FIELDS = frozenset(fields_marked("operational"))
_RECORDED_AT_DEFAULT = frozenset(fields_marked("recorded_at_default"))
_PATH_FIELDS = fields_marked("path")
TRIAL_COLUMNS = fields_marked("column")
SETTING_LABELS = {name: spec.metadata["label"] for name, spec in config_specs().items() if "label" in spec.metadata}


# -- the command line: one generator of options for every front end -------------------------------
def _flag(spec) -> str:
    return "--" + spec.name.replace("_", "-")


def _renamed_option():
    """An argparse action for an option's name in an earlier release (``--lambda``): it still
    works, with a warning."""
    import argparse
    import warnings

    class RenamedOption(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            warnings.warn(
                f"{option_string} is now {self.const}; {option_string} is accepted until the next release", FutureWarning, stacklevel=2
            )
            setattr(namespace, self.dest, values)

    return RenamedOption


def add_config_options(parser, names: tuple[str, ...] | None = None, defaults: dict | None = None) -> None:
    """The command-line options of the fields ``names`` (default: every field not marked
    ``cli=False``), each from its metadata: ``dpsm-ray train``'s and the sweep scripts' one
    generator.  ``defaults`` are the values a script sets instead of the fields' (shown in the
    help); every option's own default is "not given"."""
    import argparse

    for spec in config_specs().values():
        if not spec.metadata.get("cli", True) if names is None else spec.name not in names:
            continue
        flag, default, help_text = _flag(spec), spec.default, field_help(spec.name)
        shown = (defaults or {}).get(spec.name, default)
        kwargs = {"dest": spec.name, "default": argparse.SUPPRESS, "help": f"{help_text} (default: {shown})"}
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", **kwargs)
        elif isinstance(default, tuple) or "nargs" in spec.metadata:
            item_type = spec.metadata.get("type", str if spec.name == "eval_scores" else int)
            parser.add_argument(flag, nargs="*", type=item_type, **kwargs)
        else:
            parser.add_argument(flag, type=spec.metadata.get("type", type(default)), **kwargs)
        if "renamed_from" in spec.metadata:
            parser.add_argument(
                spec.metadata["renamed_from"],
                dest=spec.name,
                type=type(default),
                default=argparse.SUPPRESS,
                action=_renamed_option(),
                const=flag,
                help=argparse.SUPPRESS,
            )


def calibration_warnings(config: TrainConfig) -> list[str]:
    """Where ``alpha`` needs more calibration points than a split has: split conformal then
    returns q = +inf, every prediction set holds every class, and coverage is trivially 1."""
    need, sizes = min_calibration_size(config.alpha), split_sizes(config.dataset)
    parts = {"the calibration split": sizes["cal"], "half of the validation split (what the search calibrates on)": sizes["val"] // 2}
    return [f"alpha={config.alpha:g} needs at least {need} calibration points for a finite threshold, but {where} has {n}: "
            "every prediction set will hold every class (coverage 1, a trivial result)" for where, n in parts.items() if n < need]


def check_pretrained(config: TrainConfig) -> None:
    """The pretrained weights a run names, checked before any Ray work (not in ``validate``: a
    stored configuration stays readable after its weights file moves): the file exists, and where
    the dataset is cut for a backbone (``fonts_transfer``), the run that made the weights trained on
    that backbone's data.  ConfigError naming ``pretrained_path`` otherwise."""
    path = config.pretrained_path
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError("pretrained_path", path, "no such file: give a local state dict file (a run's model.pt, an ImageNet file)")
    problem = cards.pretrained_problem(config.dataset, path)
    if problem is not None:
        raise ConfigError("pretrained_path", path, f"the weights {problem}")


class _Checks:
    """What validate's parts share: a failed check raises ``ConfigError`` naming the field."""

    def __init__(self, config: TrainConfig):
        self.config = config

    def need(self, ok: bool, name: str, allowed: str) -> None:
        if not ok:
            raise ConfigError(name, getattr(self.config, name), allowed)

    def number(self, name: str) -> float:
        value = getattr(self.config, name)
        self.need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name, "must be a finite number")
        return value

    def integer(self, name: str) -> int:
        value = getattr(self.config, name)
        self.need(_is_integer(value), name, "must be an integer")
        return value

    def optional(self, name: str, ok, allowed: str) -> None:
        """None (the default: the method or the data decides), or a value ``ok`` allows."""
        value = getattr(self.config, name)
        self.need(value is None or ok(value), name, allowed)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(config: TrainConfig) -> None:
    """Every field in range, in one order (the first bad field is the one named): the data, model
    and start; the objective's options; the schedule; the evaluation; where and how it runs."""
    checks = _Checks(config)
    try:
        train_size = split_sizes(config.dataset)["train"]
    except ValueError as error:
        raise ConfigError("dataset", config.dataset, str(error).partition("; got")[0]) from None
    _check_model_and_start(config, checks)
    _check_objective(config, checks)
    _check_schedule(config, checks, train_size)
    _check_evaluation(config, checks)
    _check_resources(config, checks)


def _check_model_and_start(config: TrainConfig, checks: _Checks) -> None:
    need = checks.need
    if config.model != "auto":
        try:
            check_model(config.model)
        except ValueError as error:
            raise ConfigError(
                "model", config.model, f"must be auto or one of {cards.model_choices()}" if "must be one of" in str(error) else str(error)
            ) from None
    model = config.resolved_model()
    need(
        config.pretrained_path is None or model in pretrainable_models(),
        "pretrained_path",
        f"only applies to the models {', '.join(pretrainable_models())}",
    )
    need(config.method in (*method_names(), BASE_MODEL), "method", f"must be one of {', '.join(method_names())}, or {BASE_MODEL}")
    if config.init.startswith(WEIGHTS):
        weights = config.init.removeprefix(WEIGHTS)
        need(weights.lower().endswith(_WEIGHT_SUFFIXES), "init", f"weights:FILE must name a {', '.join(_WEIGHT_SUFFIXES)} file")
        need(os.path.isfile(weights), "init", f"weights:FILE: no such file {weights}")
    else:
        need(config.init in ("scratch", "base"), "init", "must be one of scratch, base, or weights:FILE")
    checks.optional("base_epochs", lambda value: isinstance(value, int) and value >= 1, "must be an integer >= 1")
    checks.optional("base_lr", lambda value: isinstance(value, (int, float)) and value > 0, "must be > 0")
    checks.optional("base_batch_size", lambda value: isinstance(value, int) and value >= 2 and value % 2 == 0,
                    "must be an even integer >= 2")


def _check_objective(config: TrainConfig, checks: _Checks) -> None:
    """The objectives' options (each read by the methods whose card lists it), each by its card's check."""
    need, number = checks.need, checks.number
    need(0 < number("alpha") < 1, "alpha", "must be in the open interval (0, 1)")
    need(number("conformal_weight") >= 0, "conformal_weight", "must be >= 0 (the paper's lambda)")
    known = method_options()
    for name, value in config.options:
        need(name in known, name, f"not a training option (the method options: {', '.join(known)})")
    for name, spec in known.items():
        problem = spec.problem(getattr(config, name))
        need(problem is None, name, problem)


def _check_schedule(config: TrainConfig, checks: _Checks, train_size: int) -> None:
    need, number, integer = checks.need, checks.number, checks.integer
    need(number("lr") > 0, "lr", "eta must be > 0")
    need(
        integer("batch_size") >= 2 and config.batch_size % 2 == 0, "batch_size", "must be an even integer >= 2 (half from D1, half from D2)"
    )
    if config.method == BASE_MODEL:
        need(config.init == "base", "init", f"must be base for method {BASE_MODEL} (the CE base model, evaluated as it is)")
        need(integer("epochs") == 0, "epochs", f"must be 0 for method {BASE_MODEL}: the base model is evaluated, not trained")
    else:
        need(integer("epochs") >= 1, "epochs", "must be an integer >= 1")
    need(all(isinstance(m, int) and 0 < m for m in config.milestones), "milestones", "must be positive epoch numbers")
    need(list(config.milestones) == sorted(set(config.milestones)), "milestones", "must be strictly increasing")
    need(0 < number("lr_decay") <= 1, "lr_decay", "must be in (0, 1]")
    need(config.lr_schedule in _LR_SCHEDULES, "lr_schedule", f"must be one of {', '.join(_LR_SCHEDULES)}")
    need(0 <= number("momentum") < 1, "momentum", "must be in [0, 1)")
    need(number("weight_decay") >= 0, "weight_decay", "must be >= 0")
    need(0 <= integer("seed") < MAX_SEED, "seed", "must be an integer in [0, 2**63) (torch generators take 64-bit seeds)")
    checks.optional("split_seed", lambda value: _is_integer(value) and 0 <= value < MAX_SEED, "must be an integer in [0, 2**63)")
    checks.optional("train_subset", lambda value: isinstance(value, int) and value >= 2, "must be an integer >= 2")
    need(
        config.train_subset is None or config.train_subset <= train_size,
        "train_subset",
        f"must be at most the training split's {train_size} examples",
    )
    usable = 2 * ((config.train_subset or train_size) // 2)
    need(
        config.batch_size <= usable,
        "batch_size",
        f"must be at most {usable}: each step takes half the batch from each half of the {config.train_subset or train_size} training"
        " examples",
    )


def _check_evaluation(config: TrainConfig, checks: _Checks) -> None:
    need, integer = checks.need, checks.integer
    need(integer("val_splits") >= 1, "val_splits", "must be an integer >= 1")
    need(
        integer("diagnostic_examples") >= 0 and config.diagnostic_examples != 1,
        "diagnostic_examples",
        "must be 0 (the whole training split) or an integer >= 2",
    )
    need(integer("eval_splits") >= 1, "eval_splits", "must be an integer >= 1")
    need(
        len(config.eval_scores) > 0 and all(s in score_names() for s in config.eval_scores),
        "eval_scores",
        f"must be a non-empty subset of {', '.join(score_names())}",
    )
    need(
        len(config.eval_calibrations) > 0 and set(config.eval_calibrations) <= set(CALIBRATIONS)
        and len(set(config.eval_calibrations)) == len(config.eval_calibrations),
        "eval_calibrations",
        f"must be some of {', '.join(CALIBRATIONS)}, each once",
    )


def _check_resources(config: TrainConfig, checks: _Checks) -> None:
    need, number, integer = checks.need, checks.number, checks.integer
    need(integer("workers") >= 0, "workers", "must be an integer >= 0")
    need(config.workers == 0 or config.batch_size % (2 * config.workers) == 0, "batch_size",
         f"must be divisible by 2 * workers = {2 * config.workers} (each worker takes batch_size / workers, half from D1 and half from D2)")
    need(number("gpus_per_worker") >= 0, "gpus_per_worker", "must be >= 0")
    need(number("cpus_per_worker") > 0, "cpus_per_worker", "must be > 0")
    need(config.device in ("auto", "cpu", "cuda") or config.device.startswith("cuda:"), "device", "must be auto, cpu, cuda or cuda:N")
    need(integer("data_workers") >= 0, "data_workers", "must be an integer >= 0")
    need(config.precision in (*PRECISIONS, _AUTO), "precision", f"must be one of {', '.join(PRECISIONS)}, {_AUTO}")
    need(config.step in (*STEPS, _AUTO), "step", f"must be one of {', '.join(STEPS)}, {_AUTO}")
    need(config.step != "graph" or config.workers <= 1, "step", "graph captures one process's step: it needs workers 0 or 1")
    need(config.step != "graph" or config.device != "cpu", "step", "graph needs a CUDA device; device is cpu")
    need(integer("checkpoint_every") >= 1, "checkpoint_every", "must be an integer >= 1")
    need(integer("max_failures") >= 0, "max_failures", "must be an integer >= 0")
