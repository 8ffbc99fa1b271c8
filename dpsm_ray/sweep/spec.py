"""A sweep's specification: what it computes, checked before any Ray work starts, and the results
directory it claims (``sweep.json``, which a resumed sweep must match)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dpsm_ray.cards import PAPER_METHODS, knob_name, method_names, paper_grid
from dpsm_ray.facts import SAMPLER_TITLES
from dpsm_ray.storage.layout import (
    BASE_MODELS, FINISHED_FILE, OPTUNA_DB, SWEEP_FILE, CoverageFloor, UnreadableResults, package_versions, read_sweep_settings,
)
from dpsm_ray.results.studies import Arm
from dpsm_ray.sweep.options import OPTUNA_STORAGE_ENV, masked
from dpsm_ray.sweep.space import Range, method_knobs
from dpsm_ray.config import MAX_SEED, ConfigError, TrainConfig
from dpsm_ray.train.presets import PRESET_NAMES, preset_values
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S, Demand, run_demand


# Search schedulers: every trial to the end, or asynchronous successive halving over epochs
# (ASHA, Li et al. 2020) on the validation set size.
SCHEDULERS = ("fifo", "asha")
SAMPLERS = tuple(SAMPLER_TITLES)  # dpsm_ray.sweep.search.MethodStudy; bench/search_quality.py measures them


class SweepError(RuntimeError):
    """A sweep that cannot start or continue as asked (the message says what to do)."""


class SweepFinished(SweepError):
    """The results directory holds a finished sweep (not an error: the command was run twice)."""


class ResultsDirUnusable(SweepError):
    """--results-dir cannot be a directory (a file, an unwritable parent): bad input, exit 2."""


class SweepInterrupted(SweepError):
    """Tune stopped before every trial of a stage finished (Ctrl-C): rerun with --resume."""


@dataclass(frozen=True)
class SweepSpec:
    """Everything that defines a sweep.  ``base`` holds the settings every trial shares.

    With ``arms``, the sweep is a study: no search and no pick, each arm (a method and its settings
    over ``base``) re-trained with the seeds ``seed .. seed + final_seeds - 1`` -- its stages are
    given, as the grid's and the final stage's are.  A study resumed may add arms or run a subset
    of them, never change one."""

    name: str
    base: TrainConfig
    methods: tuple[str, ...] = PAPER_METHODS
    trials: int = 8  # per method (search mode)
    # per knob of each method instead (search mode): a method with K knobs gets K times as many, so
    # a budget follows what each search has to explore (CE 1 knob, CUT 2, ConfTr 3, DPSM 4)
    trials_per_knob: int | None = None
    # a floor on every method's budget (search mode): no method searches fewer trials, so a method
    # with one knob is not left with 2 (bench/search_quality.py: the regret of short searches)
    min_trials: int | None = None
    final_seeds: int = 3
    coverage_slack: float = 0.0  # feasible: val_coverage >= 1 - alpha - slack
    ranges: tuple[tuple[str, Range], ...] = ()  # overrides of DEFAULT_RANGES
    grid: bool = False  # the paper's exhaustive grid instead of Optuna
    grid_fixed: tuple[tuple[str, object], ...] = ()
    grid_subsets: tuple[tuple[str, tuple], ...] = ()
    grid_budget: int | None = None  # a seeded random subset of this many grid points
    sampler: str = "sobol-tpe"  # how a search proposes (SAMPLERS; MethodStudy): chosen by bench/search_quality.py (docs/sweeps.md)
    scheduler: str = "fifo"  # or "asha": stop unpromising search trials early (SCHEDULERS)
    grace_period: int = 5  # ASHA: epochs every trial runs before it can be stopped
    reduction_factor: int = 3  # ASHA: 1 in reduction_factor trials goes on at each rung
    concurrency: int = 1
    seed: int = 0
    trial_resources: tuple[tuple[str, float], ...] = (("cpu", 1.0),)
    preset: str | None = None  # each method's objective settings from a preset (dpsm_ray/train/presets.py), under the search
    arms: tuple[Arm, ...] = ()  # a study's fixed arms, in the order they run (the first alone: it trains the base models)
    # how the sweep runs, not what it computes: free to differ on --resume
    address: str | None = field(default=None, compare=False)
    # seconds a cluster may take to provide one trial's resources
    resource_timeout: float = field(default=DEFAULT_RESOURCE_TIMEOUT_S, compare=False)
    trial_retries: int = field(default=2, compare=False)  # restarts of a trial from its last checkpoint after a crash (a lost node)
    worker_logs: bool = field(default=False, compare=False)  # forward trials' own output (epoch lines, Tune's) to this terminal
    process_per_trial: bool = field(default=False, compare=False)  # no reuse of a trial's process by the next trial of its Tune experiment
    optuna_storage: str | None = field(default=None, compare=False)  # SQLAlchemy URL; default: sqlite in the results directory
    # "mlflow" or "mlflow=URI": each trial an MLflow run (dpsm_ray.sweep.tracking)
    tracking: str | None = field(default=None, compare=False)
    # configurations one trial trains side by side where no early stopping is asked (the grid without
    # ASHA, the final stage, a study's arms; dpsm_ray.sweep.stage): every row is the same whatever it is
    group_size: int = field(default=1, compare=False)

    def __post_init__(self) -> None:
        for name in ("ranges", "grid_fixed", "grid_subsets"):  # an earlier release's knob names, warned
            object.__setattr__(self, name, tuple((knob_name(knob, f"SweepSpec.{name}"), value) for knob, value in getattr(self, name)))
        for method in self.methods:
            if method not in method_names():
                raise ConfigError("methods", method, f"must be among {', '.join(method_names())}")
        if not self.methods and not self.arms:
            raise ConfigError("methods", self.methods, "must name at least one method")
        if self.arms and self.methods:
            raise ConfigError("methods", ",".join(self.methods), "must be empty in a study: its arms name their methods")
        if len({arm.name for arm in self.arms}) < len(self.arms):
            raise ConfigError("arms", ",".join(arm.name for arm in self.arms), "must name each arm once")
        if len(set(self.methods)) < len(self.methods):
            raise ConfigError("methods", ",".join(self.methods), "must name each method once")
        optuna_only, alpha = "must be an integer >= 1, for an Optuna search (not --grid paper)", self.base.alpha
        for name, ok, allowed in (  # in this order: the first that fails is the one named
            ("trials", lambda: self.trials >= 1, "must be an integer >= 1"),
            ("min_trials", lambda: self.min_trials is None or (self.min_trials >= 1 and not self.grid), optuna_only),
            ("trials_per_knob", lambda: self.trials_per_knob is None or (self.trials_per_knob >= 1 and not self.grid), optuna_only),
            ("final_seeds", lambda: self.final_seeds >= 1, "must be an integer >= 1"),
            ("coverage_slack", lambda: 0 <= self.coverage_slack < 1 - alpha, f"must be in [0, 1 - alpha) = [0, {1 - alpha:g})"),
            ("concurrency", lambda: self.concurrency >= 1, "must be an integer >= 1"),
            ("sampler", lambda: self.sampler in SAMPLERS, f"must be one of {', '.join(SAMPLERS)}"),
            ("scheduler", lambda: self.scheduler in SCHEDULERS, f"must be one of {', '.join(SCHEDULERS)}"),
            ("grace_period", lambda: self.grace_period >= 1, "must be an integer >= 1 (epochs)"),
            ("reduction_factor", lambda: self.reduction_factor >= 2, "must be an integer >= 2"),
            ("grid_budget", lambda: self.grid_budget is None or (self.grid_budget >= 1 and self.grid),
             "must be an integer >= 1, with --grid paper"),
            ("trial_retries", lambda: self.trial_retries >= 0, "must be an integer >= 0"),
            ("group_size", lambda: self.group_size >= 1, "must be an integer >= 1"),
            ("group_size", lambda: self.group_size == 1 or not self.tracking,
             "must be 1 with --tracking: an MLflow run is a Tune trial, not a member"),
            ("resource_timeout", lambda: self.resource_timeout > 0, "must be a number of seconds > 0"),
            ("seed", lambda: 0 <= self.seed <= MAX_SEED - self.final_seeds,
             f"must be an integer in [0, 2**63 - final_seeds] (the final seeds are seed .. seed + {self.final_seeds - 1})"),
        ):
            if not ok():
                raise ConfigError(name, getattr(self, name), allowed)
        if self.optuna_storage is not None:
            _check_storage_url(self.optuna_storage)
        if self.preset is not None and self.preset not in PRESET_NAMES:
            raise ConfigError("preset", self.preset, f"must be one of {', '.join(PRESET_NAMES)}")
        # the search never evaluates on test data; every seed trains on the one split the search
        # selected on (otherwise seed S+1's cal/test would hold seed S's validation points); and
        # trials run in directories of their own, so paths must be absolute
        base = self.base.replace(evaluate_test=False, split_seed=self.seed if self.base.split_seed is None else self.base.split_seed)
        object.__setattr__(self, "base", base.with_absolute_paths())
        for arm in self.arms:
            try:
                self.arm_config(arm)
            except ConfigError as error:
                raise ConfigError(error.field, error.value, f"{error.allowed} (arm {arm.name})") from None
        for method in self.methods:  # every grid value and range bound must make a valid config
            for overrides in self.stage_points(method):
                try:
                    TrainConfig.from_dict({**self.base.to_dict(), **self.method_settings(method), **overrides})
                except ConfigError as error:
                    if error.field not in overrides:
                        raise
                    option, text = self.option_setting(error.field, overrides[error.field])
                    raise ConfigError(option, text, f"{error.allowed} (sets {error.field}={error.value!r} for {method})") from None

    @property
    def seeds(self) -> tuple[int, ...]:
        """The seeds every final model (or arm) is trained with."""
        return tuple(range(self.seed, self.seed + self.final_seeds))

    def arm_config(self, arm: Arm, results: Path | None = None) -> TrainConfig:
        """``arm``'s configuration (seed ``seed``), evaluated on test data, its base models cached in
        ``results``; validated."""
        values = {**self.base.to_dict(), **arm.settings, "evaluate_test": True}
        if results is not None:
            values["cache_dir"] = str(results / BASE_MODELS)
        return TrainConfig.from_dict(values).with_absolute_paths()

    def method_settings(self, method: str) -> dict:
        """What every trial of ``method`` sets over ``base``: the method, and the preset's settings
        of its objective (the search and the pick set their knobs over these)."""
        return {"method": method, **(preset_values(self.preset, method, schedule=False) if self.preset else {})}

    def search_trials(self, method: str) -> int:
        return search_budget(self.trials, self.trials_per_knob, method, self.min_trials)

    def trial_demand(self) -> Demand:
        """What one trial holds at once (its own process, and its Ray Train workers)."""
        base = self.base
        return run_demand(base.workers, base.cpus_per_worker, base.gpus_per_worker, own=dict(self.trial_resources))

    @property
    def floor(self) -> CoverageFloor:
        """What makes a trial feasible (validation coverage >= 1 - alpha - slack)."""
        return CoverageFloor(self.base.alpha, self.coverage_slack)

    @property
    def coverage_floor(self) -> float:
        return self.floor.value

    def grid_axes(self, method: str) -> dict[str, tuple]:
        return paper_grid(method, dict(self.grid_fixed), dict(self.grid_subsets))

    def stage_points(self, method: str) -> list[dict]:
        """Configurations that together hold every value the search of ``method`` can set: every
        grid value (the other axes at their first value), or every range's two bounds.
        Validating them checks the whole search before any Ray work starts (TrainConfig's checks
        on these fields are per field, and monotone in the ranged ones)."""
        from dpsm_ray.sweep.space import DEFAULT_RANGES

        if self.grid:
            axes = self.grid_axes(method)
            first = {name: values[0] for name, values in axes.items()}
            return [{**first, name: value} for name, values in axes.items() for value in values]
        ranges = {**DEFAULT_RANGES, **dict(self.ranges)}
        return [{knob: getattr(ranges[knob], bound)} for knob in method_knobs(method) for bound in ("low", "high")]

    def option_setting(self, field: str, value) -> tuple[str, str]:
        """The option (and its text) that made a trial's ``field`` take ``value``, for errors."""
        from dpsm_ray.sweep.space import DEFAULT_RANGES

        if not self.grid:
            bounds = {**DEFAULT_RANGES, **dict(self.ranges)}[field]
            return "range", f"{field}={bounds.low:g}:{bounds.high:g}"
        option = "fix" if field in dict(self.grid_fixed) else "subset" if field in dict(self.grid_subsets) else "grid"
        return option, f"{field}={value}"

    def describe(self) -> dict:
        """What ``sweep.json`` records: the settings that decide the results."""
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        payload["base"] = self.base.to_dict()
        payload["arms"] = {arm.name: arm.settings for arm in self.arms}  # a resume matches arms by name
        return json.loads(json.dumps(payload, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else list(v)))


def search_budget(trials: int, trials_per_knob: int | None, method: str, min_trials: int | None = None) -> int:
    """The Optuna budget of ``method``'s search: ``trials``, or ``trials_per_knob`` times its
    number of knobs, and at least ``min_trials`` (a spec's, or those a sweep.json stored)."""
    budget = trials if trials_per_knob is None else trials_per_knob * len(method_knobs(method))
    return max(budget, min_trials or 0)


# --- the results directory ------------------------------------------------------------------

# sweep.json's "ledger" key: the sweep keeps run records under runs/ (dpsm_ray.storage.layout); a
# sweep without it was written by an earlier version, whose state lived in Tune's pickles
LEDGER_FORMAT = 1
# Settings a resumed sweep may change: they do not change what any trial computes.
_RESUMABLE_CHANGES = ("init_checkpoint", "download")


def _check_storage_url(url: str) -> None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError:
        raise ConfigError(
            "optuna_storage",
            masked(url),
            "must be a SQLAlchemy database URL, e.g. sqlite:////abs/path/optuna.db or postgresql://user@host/db",
        ) from None


def optuna_storage_url(spec: SweepSpec, results: Path) -> str:
    """Where each method's Optuna study lives: ``--optuna-storage`` (any SQLAlchemy URL, e.g. a
    PostgreSQL on a cluster's head node) or a SQLite file in the results directory -- wherever
    that directory is now (a moved or copied sweep uses its own)."""
    return spec.optuna_storage or f"sqlite:///{results / OPTUNA_DB}"


def claim_results_dir(results: Path) -> None:
    """Create the results directory (a clear error where it cannot be one)."""
    try:
        if results.exists() and not results.is_dir():
            raise ResultsDirUnusable(f"--results-dir {results} is a file, not a directory")
        results.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ResultsDirUnusable(f"cannot create --results-dir {results}: {error.strerror}") from None


def read_sweep_file(results: Path) -> dict:
    """sweep.json of a sweep this version can resume (SweepError otherwise)."""
    try:
        stored = read_sweep_settings(results)
    except UnreadableResults as error:
        raise SweepError(str(error)) from None
    if stored.get("ledger") != LEDGER_FORMAT:
        raise SweepError(f"the sweep in {results} was started by an earlier version of dpsm_ray, whose sweeps this one cannot resume "
                         "(it has no run records); finish it with that version, or start a new --results-dir")
    return stored


def sweep_file(spec: SweepSpec, results: Path) -> dict:
    """What a new sweep writes to ``sweep.json``: its settings, the names of its Optuna studies
    (kept when the directory is moved or renamed), for an external storage its URL without the
    password, and the versions that ran it (not compared on ``--resume``)."""
    from dpsm_ray.cards import data_record

    return {
        **spec.describe(),
        "data": data_record(spec.base.dataset),  # compared on every later run (check_same_data), never a setting
        "ledger": LEDGER_FORMAT,
        "studies": {method: f"{results.name}-{method}" for method in spec.methods},
        "optuna_storage": masked(spec.optuna_storage) if spec.optuna_storage else None,
        "versions": package_versions(),
    }


def check_results_dir(spec: SweepSpec, results: Path, resume: bool) -> dict:
    """One sweep per results directory, answering only for its own settings: a new sweep needs a
    directory without a sweep; the same command again finds its finished sweep (``SweepFinished``:
    its report is shown) or its unfinished one (``--resume`` continues it); a directory holding a
    sweep with other settings is refused (``ResultsDirUnusable``, naming each setting that
    differs), finished or not, resumed or not.  A resumed sweep needs the same Optuna storage too.
    Returns the sweep's ``sweep.json`` content (to be written, for a new sweep)."""
    if (results / SWEEP_FILE).exists():
        stored = read_sweep_file(results)
        _check_same_data(stored, spec.base.dataset, results)
        described = spec.describe()
        differences = settings_differences(stored, described)
        finished = (results / FINISHED_FILE).exists()
        if differences:
            state = "finished" if finished else "unfinished"
            raise ResultsDirUnusable(
                f"{results} holds a{'n' * (state == 'unfinished')} {state} sweep with different settings ({'; '.join(differences)}); "
                f"give a new --results-dir for this one, or the options that sweep ran with to {'show' if finished else 'resume'} it "
                f"(--config {results / SWEEP_FILE} --results-dir {results}{' --resume' * (not finished)})"
            )
        added = sorted(set(described["arms"]) - set(stored.get("arms") or {}))
        if not resume and added:
            raise SweepError(f"the study in {results} has not run the arms {', '.join(added)}; pass --resume to run them beside what it "
                             "holds")
        if not resume:
            if finished:
                raise SweepFinished(f"{results} holds a finished sweep; choose another --results-dir to run one again")
            raise SweepError(
                f"{results} already holds a sweep that has not finished; pass --resume to continue it, or choose another --results-dir"
            )
        if spec.arms:  # the arms run now and those it has had: a later resume must name them too
            return {**stored, "arms": {**(stored.get("arms") or {}), **described["arms"]}}
        if not spec.grid:
            _check_same_storage(spec, stored.get("optuna_storage"))
            _study_names(optuna_storage_url(spec, results))  # readable, before any Ray work starts
        return stored
    if resume:
        raise SweepError(f"--resume: no sweep to resume in {results}")
    planned = sweep_file(spec, results)
    if not spec.grid and (
        spec.optuna_storage or (results / OPTUNA_DB).exists()
    ):  # a study of the same name would feed another sweep's trials to TPE
        taken = set(_study_names(optuna_storage_url(spec, results))) & set(planned["studies"].values())
        if taken:
            raise SweepError(
                f"the Optuna storage {masked(optuna_storage_url(spec, results))} already holds the studies {', '.join(sorted(taken))}; "
                "choose another --results-dir name or delete them (optuna delete-study)"
            )
    return planned


def _check_same_data(stored: dict, dataset: str, results: Path) -> None:
    """``ResultsDirUnusable`` naming what changed when the data a results directory was made from
    (``sweep.json``'s ``data``) is no longer what ``dataset`` holds: its results would answer for
    other data."""
    from dpsm_ray.cards import data_change

    if stored.get("base", {}).get("dataset") != dataset:
        return  # another dataset: a setting that differs, named as such
    change = data_change(stored.get("data"), dataset)
    if change is not None:
        raise ResultsDirUnusable(f"{results} holds results of other data than {dataset} holds now -- {change}; give a new --results-dir "
                                 "for the data as it is, or put the data back as it was to use these results")


# the option behind each of sweep.json's settings whose option is not named after it
_SETTING_OPTIONS = {
    "ranges": "--range", "grid_fixed": "--fix", "grid_subsets": "--subset", "trial_resources": "--cpus-per-worker/--gpus-per-worker",
}


def settings_differences(stored: dict, described: dict) -> list[str]:
    """Each setting of a stored ``sweep.json`` that ``described`` (``SweepSpec.describe()``) changes,
    as ``--option: VALUE there, VALUE here`` (the settings a resumed sweep may change left out)."""
    def shown(value) -> str:
        text = json.dumps(value) if isinstance(value, (list, dict)) else repr(value)
        return text if len(text) <= 80 else text[:77] + "..."

    pairs = [(k, stored.get(k), described[k]) for k in sorted(described) if k not in ("base", "arms")]
    stored_arms = stored.get("arms") or {}  # arms may be added, or a subset run: one of the same name must not change
    pairs += [(f"arm {name}", stored_arms[name], settings) for name, settings in sorted(described["arms"].items()) if name in stored_arms]
    pairs += [(k, stored.get("base", {}).get(k), v) for k, v in sorted(described["base"].items()) if k not in _RESUMABLE_CHANGES]
    def named(k: str) -> str:
        return k if k.startswith("arm ") else _SETTING_OPTIONS.get(k, "--" + k.replace("_", "-"))

    return [f"{named(k)}: {shown(there)} there, {shown(here)} here" for k, there, here in pairs if there != here]


def _check_same_storage(spec: SweepSpec, stored: str | None) -> None:
    given = masked(spec.optuna_storage) if spec.optuna_storage else None
    if stored is not None and given is None:
        raise SweepError(
            f"the Optuna studies of this sweep live in {stored}: pass --optuna-storage with that URL (or set {OPTUNA_STORAGE_ENV})"
        )
    if given != stored:
        where = stored or "the results directory's optuna.db"
        raise SweepError(f"--optuna-storage {given} is not where this sweep's Optuna studies live ({where}); rerun with the same storage")


def _study_names(url: str) -> list[str]:
    """The studies in an Optuna storage (one line naming the storage when it cannot be read)."""
    import optuna

    try:
        return optuna.study.get_all_study_names(url)
    except ImportError:
        raise SweepError(f"cannot open the Optuna storage {masked(url)}: its database driver is not installed "
                         "(PostgreSQL: pip install -e '.[postgres]')") from None
    except Exception as error:
        raise SweepError(f"cannot read the Optuna storage {masked(url)}: {first_line(error)}") from None


def first_line(error: BaseException) -> str:
    """The first line of an error's message, without the password of any URL in it."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"(://[^:/@\s]*):[^@\s]*@", r"\1:***@", lines[0][:300])
