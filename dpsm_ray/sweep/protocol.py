"""The sweep protocol (SPEC section 4, the paper's experimental protocol):

1. the CE base model, once per (dataset, model, seed), from the content-addressed cache;
2. per method, a search (Optuna TPE with the coverage constraint, or the paper's grid) that is
   scored on the validation split only -- the test data is never evaluated during the search;
3. each method's best feasible configuration re-trained with S seeds and evaluated on the
   calibration/test data over random re-splits, for HPS, APS and RAPS -- the paper's table;
4. ``trials.parquet``, ``epochs.parquet``, ``evals.parquet`` and the report, rebuilt from Tune's
   experiment state after every stage, so re-runs and resumes never duplicate a row.

Every stage is a Tune experiment under ``<results>/tune``; ``resume=True`` restores whatever an
interrupted run left unfinished and skips what is done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dpsm_ray.objectives import METHODS
from dpsm_ray.seeding import derive_seed
from dpsm_ray.sweep.space import METHOD_KNOBS, Range, field_name, grid_size, paper_grid, search_space
from dpsm_ray.train.config import ConfigError, TrainConfig
from dpsm_ray.train.ray_session import DEFAULT_RESOURCE_TIMEOUT_S, Demand, check_before_start, check_capacity, ensure_ray, run_demand


# Search schedulers: every trial to the end, or asynchronous successive halving over epochs
# (ASHA, Li et al. 2020) on the validation set size.
SCHEDULERS = ("fifo", "asha")
SAMPLERS = ("tpe", "random")


class SweepError(RuntimeError):
    """A sweep that cannot start or continue as asked (the message says what to do)."""


class SweepInterrupted(SweepError):
    """Tune stopped before every trial of a stage finished (Ctrl-C): rerun with --resume."""


@dataclass(frozen=True)
class SweepSpec:
    """Everything that defines a sweep.  ``base`` holds the settings every trial shares."""

    name: str
    base: TrainConfig
    methods: tuple[str, ...] = METHODS
    trials: int = 8  # per method (search mode)
    final_seeds: int = 3
    coverage_slack: float = 0.0  # feasible: val_coverage >= 1 - alpha - slack
    ranges: tuple[tuple[str, Range], ...] = ()  # overrides of DEFAULT_RANGES
    grid: bool = False  # the paper's exhaustive grid instead of Optuna
    grid_fixed: tuple[tuple[str, object], ...] = ()
    grid_subsets: tuple[tuple[str, tuple], ...] = ()
    grid_budget: int | None = None  # a seeded random subset of this many grid points
    sampler: str = "tpe"  # Optuna's sampler: "tpe", or "random" (a baseline for the search itself)
    scheduler: str = "fifo"  # or "asha": stop unpromising search trials early (SCHEDULERS)
    grace_period: int = 5  # ASHA: epochs every trial runs before it can be stopped
    reduction_factor: int = 3  # ASHA: 1 in reduction_factor trials goes on at each rung
    concurrency: int = 1
    seed: int = 0
    trial_resources: tuple[tuple[str, float], ...] = (("cpu", 1.0),)
    # how the sweep runs, not what it computes: free to differ on --resume
    address: str | None = field(default=None, compare=False)
    resource_timeout: float = field(default=DEFAULT_RESOURCE_TIMEOUT_S, compare=False)  # seconds a cluster may take to provide one trial's resources
    trial_retries: int = field(default=2, compare=False)  # restarts of a trial from its last checkpoint after a crash (a lost node)
    worker_logs: bool = field(default=False, compare=False)  # forward trials' own output (epoch lines, Tune's) to this terminal
    optuna_storage: str | None = field(default=None, compare=False)  # SQLAlchemy URL; default: sqlite in the results directory

    def __post_init__(self) -> None:
        for method in self.methods:
            if method not in METHODS:
                raise ConfigError("methods", method, f"must be among {', '.join(METHODS)}")
        if not self.methods:
            raise ConfigError("methods", self.methods, "must name at least one method")
        if self.trials < 1:
            raise ConfigError("trials", self.trials, "must be an integer >= 1")
        if self.final_seeds < 1:
            raise ConfigError("final_seeds", self.final_seeds, "must be an integer >= 1")
        if not 0 <= self.coverage_slack < 1 - self.base.alpha:
            raise ConfigError("coverage_slack", self.coverage_slack, f"must be in [0, 1 - alpha) = [0, {1 - self.base.alpha:g})")
        if self.concurrency < 1:
            raise ConfigError("concurrency", self.concurrency, "must be an integer >= 1")
        if self.sampler not in SAMPLERS:
            raise ConfigError("sampler", self.sampler, f"must be one of {', '.join(SAMPLERS)}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError("scheduler", self.scheduler, f"must be one of {', '.join(SCHEDULERS)}")
        if self.grace_period < 1:
            raise ConfigError("grace_period", self.grace_period, "must be an integer >= 1 (epochs)")
        if self.reduction_factor < 2:
            raise ConfigError("reduction_factor", self.reduction_factor, "must be an integer >= 2")
        if self.grid_budget is not None and (self.grid_budget < 1 or not self.grid):
            raise ConfigError("grid_budget", self.grid_budget, "must be an integer >= 1, with --grid paper")
        if self.trial_retries < 0:
            raise ConfigError("trial_retries", self.trial_retries, "must be an integer >= 0")
        if not self.resource_timeout > 0:
            raise ConfigError("resource_timeout", self.resource_timeout, "must be a number of seconds > 0")
        # the search never evaluates on test data; every seed trains on the one split the search
        # selected on (otherwise seed S+1's cal/test would hold seed S's validation points); and
        # trials run in directories of their own, so paths must be absolute
        base = self.base.replace(evaluate_test=False, split_seed=self.seed if self.base.split_seed is None else self.base.split_seed)
        object.__setattr__(self, "base", base.with_absolute_paths())
        for method in self.methods:  # every grid value and range bound must make a valid config
            for overrides in self.stage_points(method):
                try:
                    TrainConfig.from_dict({**self.base.to_dict(), "method": method, **overrides})
                except ConfigError as error:
                    if error.field not in overrides:
                        raise
                    option, text = self.option_setting(error.field, overrides[error.field])
                    raise ConfigError(option, text, f"{error.allowed} (sets {error.field}={error.value!r} for {method})") from None

    def trial_demand(self) -> Demand:
        """What one trial holds at once (its own process, and its Ray Train workers)."""
        base = self.base
        return run_demand(base.workers, base.cpus_per_worker, base.gpus_per_worker, own=dict(self.trial_resources))

    @property
    def coverage_floor(self) -> float:
        return 1 - self.base.alpha - self.coverage_slack

    def grid_axes(self, method: str) -> dict[str, tuple]:
        return paper_grid(method, dict(self.grid_fixed), dict(self.grid_subsets))

    def stage_points(self, method: str) -> list[dict]:
        """Configurations that together hold every value the search of ``method`` can set: every
        grid value (the other axes at their first value), or every range's two bounds.
        Validating them checks the whole search before any Ray work starts (TrainConfig's checks
        on these fields are per field, and monotone in the ranged ones)."""
        from dpsm_ray.sweep.space import DEFAULT_RANGES

        if self.grid:
            axes = {field_name(axis): values for axis, values in self.grid_axes(method).items()}
            first = {name: values[0] for name, values in axes.items()}
            return [{**first, name: value} for name, values in axes.items() for value in values]
        ranges = {**DEFAULT_RANGES, **dict(self.ranges)}
        return [{field_name(knob): getattr(ranges[knob], bound)} for knob in METHOD_KNOBS[method] for bound in ("low", "high")]

    def option_setting(self, field: str, value) -> tuple[str, str]:
        """The option (and its text) that made a trial's ``field`` take ``value``, for errors."""
        from dpsm_ray.sweep.space import DEFAULT_RANGES, KNOB_FIELDS

        knob = next((k for k, f in KNOB_FIELDS.items() if f == field), field)
        if not self.grid:
            bounds = {**DEFAULT_RANGES, **dict(self.ranges)}[knob]
            return "range", f"{knob}={bounds.low:g}:{bounds.high:g}"
        option = "fix" if knob in dict(self.grid_fixed) else "subset" if knob in dict(self.grid_subsets) else "grid"
        return option, f"{knob}={value}"

    def describe(self) -> dict:
        """What ``sweep.json`` records: the settings that decide the results."""
        payload = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        payload["base"] = self.base.to_dict()
        return json.loads(json.dumps(payload, default=lambda v: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else list(v)))


def run_sweep(spec: SweepSpec, results_dir: str | os.PathLike, *, resume: bool = False, log=print, search_only: bool = False) -> Path:
    """Run (or, with ``resume``, continue) ``spec`` into ``results_dir``; returns that directory.
    ``search_only`` stops after the searches (benchmarks of the search itself)."""
    from dpsm_ray.data import check_data_present
    from dpsm_ray.results.report import write_report
    from dpsm_ray.sweep.collect import write_results

    results = Path(results_dir).resolve()
    check_data_present(spec.base.dataset, spec.base.data_root, spec.base.download)
    new = check_results_dir(spec, results, resume)
    check_before_start(spec.trial_demand(), spec.address)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0")  # state on disk after every trial: a hard kill loses nothing finished
    # ... which is the snapshot-per-checkpoint that Tune warns about (once per report) with num_to_keep set
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # our own progress lines instead of Tune's tables
    quiet_libraries()
    ensure_ray(spec.address, worker_output=spec.worker_logs)
    check_capacity(spec.trial_demand(), timeout_s=spec.resource_timeout, log=log)
    if new:  # only now: a sweep refused above leaves no directory to --resume
        from dpsm_ray.results import write_json

        write_json(results / "sweep.json", spec.describe())
    base = with_base_model(spec.base, spec.base.seed, results, log)
    for index, method in enumerate(spec.methods):
        search_method(spec, base.replace(method=method), index, results, resume, log)
        write_results(spec, results)
    if search_only:
        return results
    final_stage(spec, results, resume, log)
    write_results(spec, results)
    write_report(results, log=log)
    return results


def quiet_libraries() -> None:
    """Keep Optuna's and Tune's INFO chatter out of the sweep's progress output."""
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    # a trial still pending when a sweep was interrupted has no results yet, which Tune warns about
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)


# Settings a resumed sweep may change: they do not change what any trial computes.
RESUMABLE_CHANGES = ("init_checkpoint", "download")


def check_results_dir(spec: SweepSpec, results: Path, resume: bool) -> bool:
    """One sweep per results directory: a new sweep needs one without a sweep, a resumed sweep
    the same spec.  Returns whether the sweep is new (its ``sweep.json`` is still to be written)."""
    marker = results / "sweep.json"
    described = spec.describe()
    if marker.exists():
        if not resume:
            raise SweepError(f"{results} already holds a sweep; pass --resume to continue it, or choose another --results-dir")
        stored = json.loads(marker.read_text())
        changed = sorted(k for k in set(stored) | set(described) if stored.get(k) != described.get(k))
        changed += sorted(f"base.{k}" for k in described["base"] if stored.get("base", {}).get(k) != described["base"][k] and k not in RESUMABLE_CHANGES)
        changed = [k for k in changed if k != "base"]
        if changed:
            raise SweepError(f"--resume: the sweep in {results} was started with different settings ({', '.join(changed)}); rerun it with the same options")
        return False
    if resume:
        raise SweepError(f"--resume: no sweep to resume in {results}")
    if not spec.grid and (spec.optuna_storage or (results / "optuna.db").exists()):  # a study of the same name would feed another sweep's trials to TPE
        import optuna

        taken = set(optuna.study.get_all_study_names(optuna_storage_url(spec, results))) & {study_name(results, m) for m in spec.methods}
        if taken:
            raise SweepError(f"the Optuna storage {optuna_storage_url(spec, results)} already holds the studies {', '.join(sorted(taken))}; "
                             "choose another --results-dir name or delete them (optuna delete-study)")
    return True


def with_base_model(config: TrainConfig, seed: int, results: Path, log) -> TrainConfig:
    """``config`` for ``seed``, pointed at its cached base model under ``results/base_models``."""
    from dpsm_ray.train import resolve_base_model

    return resolve_base_model(config.replace(seed=seed, cache_dir=str(results / "base_models")), log)


def trainable(spec: SweepSpec):
    from ray import tune

    from dpsm_ray.sweep.trials import run_trial

    return tune.with_resources(run_trial, dict(spec.trial_resources))


def experiment(spec: SweepSpec, results: Path, name: str, param_space: dict, tune_config, callbacks, resume: bool, log, *, total: int):
    """Fit one Tune experiment of ``total`` trials, restoring it when resuming; raises if it
    stopped early (Ctrl-C: Tune catches it, saves its state and returns)."""
    from ray import tune

    from dpsm_ray.sweep.collect import finished_trials

    path = results / "tune" / name
    if resume and tune.Tuner.can_restore(str(path)):
        log(f"resuming {name}")
        tuner = tune.Tuner.restore(str(path), trainable=trainable(spec), resume_unfinished=True, resume_errored=False)
    else:
        tuner = tune.Tuner(
            trainable(spec),
            param_space=param_space,
            tune_config=tune_config,
            run_config=tune.RunConfig(
                name=name, storage_path=str(results / "tune"), verbose=0, callbacks=callbacks,
                checkpoint_config=tune.CheckpointConfig(num_to_keep=1),  # only the latest is ever read
                # a trial whose process died (a lost node, an OOM kill) restarts from its last
                # checkpoint, on whichever node has room
                failure_config=tune.FailureConfig(max_failures=spec.trial_retries),
            ),
        )
    fit_keeping_ctrl_c(tuner)
    # ended as Tune's saved state says: a trial stopped right after its final report has the
    # report but is not done (its last checkpoint is not yet recorded)
    ended = len(finished_trials(path))
    if ended < total:
        raise SweepInterrupted(f"{name} stopped after {ended} of {total} trials; rerun with --resume to continue")


def fit_keeping_ctrl_c(tuner):
    """``tuner.fit()``, then this process's own Ctrl-C handling back: Tune installs a SIGINT (and
    SIGUSR1) handler that stops its run and never removes it, so without this a Ctrl-C between two
    stages would go to the finished run and be lost."""
    import signal

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, getattr(signal, "SIGUSR1", None)) if sig is not None}
    try:
        return tuner.fit()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def search_method(spec: SweepSpec, base: TrainConfig, index: int, results: Path, resume: bool, log) -> None:
    import optuna
    from ray import tune

    from dpsm_ray.sweep.trials import OBJECTIVE, ConstrainedOptunaSearch, ProgressPrinter

    method = base.method
    name = f"search-{method}"
    params = {"base": base.to_dict(), "train_storage": str(results / "train_runs")}
    knobs = tuple(field_name(k) for k in METHOD_KNOBS[method])
    stopping = ""
    scheduler = None
    if spec.scheduler == "asha":
        longest = max(spec.grid_axes(method).get("epochs", (base.epochs,))) if spec.grid else base.epochs
        # max_t one past the last epoch: ASHA stops every trial that reaches max_t, and a trial's
        # last epoch must be followed by its final report, not cut off before it
        scheduler = tune.schedulers.ASHAScheduler(
            time_attr="epoch", metric=OBJECTIVE, mode="min", max_t=longest + 1, grace_period=min(spec.grace_period, longest), reduction_factor=spec.reduction_factor,
        )
        stopping = f"; ASHA stops trials early (grace period {spec.grace_period} epochs, reduction factor {spec.reduction_factor})"
    if spec.grid:
        axes = spec.grid_axes(method)
        points = grid_points(axes, spec.grid_budget, derive_seed(spec.seed, "grid", method))
        total = len(points)
        budget = f", a seeded random {total} of them" if total < grid_size(axes) else ""
        log(f"{name}: the paper grid has {grid_size(axes)} configurations ({' x '.join(f'{k} {len(v)}' for k, v in axes.items())}){budget}{stopping}")
        params["overrides"] = tune.grid_search(points)
        tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=spec.concurrency, trial_dirname_creator=trial_dirname, scheduler=scheduler)
        knobs = tuple(k for k, v in axes.items() if len(v) > 1)
    else:
        total = spec.trials
        log(f"{name}: {total} Optuna {spec.sampler.upper()} trials over {', '.join(knobs)} (validation coverage >= {spec.coverage_floor:g} as a constraint){stopping}")
        params["overrides"] = search_space(method, dict(spec.ranges))
        sampler_seed = derive_seed(spec.seed, spec.sampler, method) % 2**32
        sampler = (optuna.samplers.TPESampler(seed=sampler_seed, n_startup_trials=min(4, total)) if spec.sampler == "tpe"
                   else optuna.samplers.RandomSampler(seed=sampler_seed))
        searcher = ConstrainedOptunaSearch(
            metric=OBJECTIVE, mode="min", sampler=sampler, coverage_floor=spec.coverage_floor,
            storage=optuna.storages.RDBStorage(optuna_storage_url(spec, results)), study_name=study_name(results, method),
        )
        tune_config = tune.TuneConfig(search_alg=searcher, num_samples=total, max_concurrent_trials=spec.concurrency, trial_dirname_creator=trial_dirname, scheduler=scheduler)
    experiment(spec, results, name, params, tune_config, [ProgressPrinter(name, total, knobs)], resume, log, total=total)


def grid_points(axes: dict[str, tuple], budget: int | None, seed: int) -> list[dict]:
    """Every point of the grid ``axes`` in order (the last axis varying fastest), or a seeded random
    ``budget`` of them, kept in that order."""
    import itertools
    import random

    points = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    if budget is None or budget >= len(points):
        return points
    keep = sorted(random.Random(seed).sample(range(len(points)), budget))
    return [points[i] for i in keep]


def optuna_storage_url(spec: SweepSpec, results: Path) -> str:
    """Where each method's Optuna study lives: ``--optuna-storage`` (any SQLAlchemy URL, e.g. a
    PostgreSQL on a cluster's head node) or a SQLite file in the results directory."""
    return spec.optuna_storage or f"sqlite:///{results / 'optuna.db'}"


def study_name(results: Path, method: str) -> str:
    """The Optuna study of ``method``'s search: named after the results directory, so that sweeps
    sharing one database server keep apart."""
    return f"{results.name}-{method}"


def trial_dirname(trial) -> str:
    return f"trial_{trial.trial_id}"


def best_overrides(spec: SweepSpec, results: Path, method: str, log) -> dict | None:
    """The chosen configuration of ``method`` (docs/results.md, "the pick"):

    1. the finished feasible trial (validation coverage >= the floor) with the lowest validation
       set size;
    2. replaced by a feasible trial that ASHA stopped after e epochs only if its set size after e
       epochs was lower than the pick's own after e epochs (the largest such margin wins);
    3. without a finished feasible trial, the feasible stopped trial that ran longest, then the
       smallest set size; without any feasible trial, the highest coverage (finished trials first).

    None (and a warning) when every search trial of ``method`` failed.  Ties (common on small
    validation splits) go to the trial proposed first, so the sweep seed fixes the choice."""
    import pandas as pd

    trials = pd.read_parquet(results / "trials.parquet")
    search = trials[(trials.stage == "search") & (trials.method == method)]
    finished, stopped = search[search.status == "ok"], search[search.status == "stopped"]
    if finished.empty and stopped.empty:
        log(f"warning: every search trial of {method} failed (errors in trials.parquet and {results / 'tune' / f'search-{method}'}); {method} is left out of the final stage")
        return None
    feasible, feasible_stopped = finished[finished.feasible == True], stopped[stopped.feasible == True]  # noqa: E712 (nullable)
    if not feasible.empty:
        chosen = feasible.sort_values(["val_set_size", "trial_index"]).iloc[0]
        if not feasible_stopped.empty:
            epochs = pd.read_parquet(results / "epochs.parquet")
            at_epoch = epochs[epochs.trial_id == chosen.trial_id].set_index("epoch").val_set_size
            margin = feasible_stopped.epochs_completed.map(at_epoch) - feasible_stopped.val_set_size
            ahead = feasible_stopped.assign(margin=margin)[margin > 0]
            if not ahead.empty:
                chosen = ahead.sort_values(["margin", "trial_index"], ascending=[False, True]).iloc[0]
                log(f"{method}: trial {chosen.trial_id}, stopped after {chosen.epochs_completed} epochs, was {chosen.margin:.3f} ahead of the best finished trial there")
    elif not feasible_stopped.empty:
        chosen = feasible_stopped.sort_values(["epochs_completed", "val_set_size", "trial_index"], ascending=[False, True, True]).iloc[0]
    else:
        log(f"warning: no {method} trial reached validation coverage {spec.coverage_floor:g}; using the one with the highest coverage")
        pool = finished if not finished.empty else stopped
        chosen = pool.sort_values(["val_coverage", "trial_index"], ascending=[False, True]).iloc[0]
    config = json.loads(chosen.config_json)
    searched = spec.grid_axes(method) if spec.grid else {field_name(k): None for k in METHOD_KNOBS[method]}
    overrides = {name: (tuple(config[name]) if isinstance(config[name], list) else config[name]) for name in searched}
    log(f"best {method}: trial {chosen.trial_id}  val size {chosen.val_set_size:.3f}  val cov {chosen.val_coverage:.3f}  "
        + "  ".join(f"{k}={v}" for k, v in overrides.items()))
    return overrides


def final_stage(spec: SweepSpec, results: Path, resume: bool, log) -> None:
    from ray import tune

    from dpsm_ray.sweep.trials import ProgressPrinter

    chosen = {method: best_overrides(spec, results, method, log) for method in spec.methods}
    chosen = {method: overrides for method, overrides in chosen.items() if overrides is not None}
    if not chosen:
        raise SweepError(f"every search trial of every method failed; nothing to re-train (errors in {results / 'trials.parquet'})")
    seeds = [spec.base.seed + offset for offset in range(spec.final_seeds)]
    bases = {seed: with_base_model(spec.base, seed, results, log) for seed in seeds}
    points = [
        {**overrides, "method": method, "seed": seed, "init_checkpoint": bases[seed].init_checkpoint}
        for method, overrides in chosen.items() for seed in seeds
    ]
    params = {
        "base": spec.base.replace(evaluate_test=True).to_dict(),
        "train_storage": str(results / "train_runs"),
        "overrides": tune.grid_search(points),
    }
    tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=spec.concurrency, trial_dirname_creator=trial_dirname)
    log(f"final: {len(chosen)} methods x {len(seeds)} seeds, evaluated on the calibration/test splits")
    experiment(spec, results, "final", params, tune_config, [ProgressPrinter("final", len(points), ("method", "seed"))], resume, log, total=len(points))


def feasible(val_coverage: float | None, floor: float) -> bool | None:
    if val_coverage is None or (isinstance(val_coverage, float) and math.isnan(val_coverage)):
        return None
    return val_coverage >= floor
