"""The sweep driver, which runs the sweep protocol (the paper's experimental protocol, its appendix D):

1. the CE base model, once per (dataset, model, seed), from the content-addressed cache;
2. per method, a search (Optuna TPE with the coverage constraint, or the paper's grid) that is
   scored on the validation split only -- the test data is never evaluated during the search;
3. each method's best feasible configuration re-trained with S seeds and evaluated on the
   calibration/test data over random re-splits, for HPS, APS and RAPS -- the paper's table;
4. ``trials.parquet``, ``epochs.parquet``, ``evals.parquet`` and ``classes.parquet``, rebuilt from
   the sweep's ledger after every stage; every final model as a conformal predictor under
   ``predictors/`` (``dpsm_ray.predict.export``); and the report.

A study is a sweep with given arms (``SweepSpec.arms``): no search, no pick -- each arm re-trained
with every seed, its Parquet files written as a sweep's, the one driver, marker and resume.

The driver holds an exclusive lock on the results directory while it runs.  Every trial's outcome
is in the ledger (``dpsm_ray.storage.layout``) the moment it ends, so ``resume=True`` after any
interruption -- Ctrl-C, a kill, a full disk, a move of the whole directory -- runs exactly the
trials that had not ended, each from its last checkpoint, and ends with the rows of an
uninterrupted sweep.
"""

from __future__ import annotations

import os
import time
from contextlib import closing, contextmanager
from pathlib import Path

from dpsm_ray.files import CorruptFileError, remove_temporaries, write_json
from dpsm_ray import cards
from dpsm_ray.cards import BASE_MODEL
from dpsm_ray.facts import SAMPLER_TITLES
from dpsm_ray.storage.layout import BASE_MODELS, PARQUET, TUNE
from dpsm_ray.seeding import derive_seed
from dpsm_ray.sweep.pick import best_overrides
from dpsm_ray.sweep.space import DEFAULT_RANGES, grid_size, method_knobs
from dpsm_ray.sweep.spec import (
    FINISHED_FILE,
    SAMPLERS,
    SCHEDULERS,
    SWEEP_FILE,
    SweepError,
    SweepInterrupted,
    SweepSpec,
    check_results_dir,
    claim_results_dir,
    first_line,
    masked,
    optuna_storage_url,
)
from dpsm_ray.timing import Stopwatch
from dpsm_ray.config import TrainConfig, calibration_warnings
from dpsm_ray.train.ray_session import check_before_start, check_capacity, ensure_ray

__all__ = ["SAMPLERS", "SCHEDULERS", "SweepError", "SweepInterrupted", "SweepOutOfSpace", "SweepSpec", "run_sweep"]


class SweepOutOfSpace(SweepError):
    """A write found the results directory's device full; resumable once there is space."""


def run_sweep(spec: SweepSpec, results_dir: str | os.PathLike, *, resume: bool = False, log=print, search_only: bool = False) -> Path:
    """Run (or, with ``resume``, continue) ``spec`` into ``results_dir``; returns that directory.
    ``log`` gets the progress lines (time-stamped, with the sweep's trial counter and estimate);
    ``search_only`` stops after the searches (benchmarks of the search itself)."""
    from dpsm_ray.sweep.progress import Progress

    log = log if isinstance(log, Progress) else Progress(log)
    results = Path(results_dir).resolve()
    with holding(results, spec.base, log):
        settings = check_results_dir(spec, results, resume)
        for line in calibration_warnings(spec.base):
            log(f"warning: {line}")
        _before_ray(results, spec.trial_demand(), spec.address, log)
        return drive(spec, results, settings, resume, log, search_only)


# -- what every driver (a sweep, a study) does around its stages ----------------------------------
@contextmanager
def holding(results: Path, config: TrainConfig, log):
    """The data there and the results directory claimed and locked by this driver for the block
    (SweepError naming the holder when another driver has it)."""
    from dpsm_ray.cards import check_data_present
    from dpsm_ray.config import check_pretrained
    from dpsm_ray.storage.layout import ResultsInUse, ResultsLock, describe_holder

    check_data_present(config.dataset, config.data_root, config.download)
    check_pretrained(config)
    claim_results_dir(results)
    lock = ResultsLock(results)
    try:
        previous = lock.acquire()
    except ResultsInUse as error:
        raise SweepError(str(error)) from None
    try:
        if previous is not None:
            log(f"an earlier driver of this directory ({describe_holder(previous)}) ended without finishing; continuing where it stopped")
        yield
    finally:
        lock.release()


def _before_ray(results: Path, demand: dict, address: str | None, log) -> None:
    """Once the directory is held: what an interrupted write left removed, and the trials' demand
    checked against what the machine or cluster could ever give (before Ray starts)."""
    for leftover in remove_temporaries(results, skip=(TUNE,)):  # no writer is running: the lock says so
        log(f"removed {leftover}, a file an interrupted write left")
    check_before_start(demand, address)


def _start_ray(demand: dict, address: str | None, resource_timeout: float, worker_output: bool, log) -> None:
    """Ray started (or attached to) with the progress output the drivers print, and the room for
    one trial waited for."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # our own progress lines instead of Tune's tables
    os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")  # a failed trial is one FAILED line; its traceback stays in error.txt
    import signal

    _quiet_libraries()
    before = signal.getsignal(signal.SIGTERM)
    ensure_ray(address, worker_output=worker_output)
    _stop_on_sigterm(before)
    check_capacity(demand, timeout_s=resource_timeout, log=log)


def _stop_on_sigterm(before) -> None:
    """SIGTERM (``kill``, a batch scheduler's preemption) stops the sweep as Ctrl-C does --
    resumable, in one line -- instead of through the handler ``ray.init`` sets (``sys.exit(15)``
    from wherever the driver is, and a stack from Ray's core).  In the main thread, in place of
    Ray's or the default (``before``: the handler before Ray started), never a caller's own."""
    import signal
    import threading

    now = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread() and (now is not before or now in (signal.SIG_DFL, None)):
        signal.signal(signal.SIGTERM, _as_ctrl_c)


def _as_ctrl_c(signum, frame) -> None:
    """What Ctrl-C would do now: the SIGINT handler in place (Tune's, while an experiment runs,
    which ends it so that its trials' records are kept; Python's, a KeyboardInterrupt), or a
    KeyboardInterrupt where SIGINT is ignored (a background job's)."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):
        raise KeyboardInterrupt
    handler(signal.SIGINT, frame)


def drive(spec: SweepSpec, results: Path, settings: dict, resume: bool, log, search_only: bool) -> Path:
    if spec.arms:
        return _drive_arms(spec, results, settings, resume, log)
    return _drive_search(spec, results, settings, resume, log, search_only)


def _rebuild_if_changed(results: Path, log) -> None:
    """A resumed sweep's Parquet files that changed after they were written are rebuilt from the
    run records (their manifest removed, rewritten with them)."""
    from dpsm_ray.storage.layout import MANIFEST
    from dpsm_ray.storage.layout import verify_manifest

    try:
        verify_manifest(results, list(PARQUET.values()))
    except CorruptFileError as error:
        log(f"warning: {error}; the results are rebuilt from the run records under {results / 'runs'}")
        (results / MANIFEST).unlink(missing_ok=True)


def _drive_arms(spec: SweepSpec, results: Path, settings: dict, resume: bool, log) -> Path:
    """A study: each arm a stage of given points (its seeds), in one Tune experiment -- the first arm
    alone, its trials training each seed's base model (into the cache), then the others beside each
    other, from those models.  Its Parquet files are written as a sweep's; its analysis is the
    caller's (``dpsm_ray.sweep.study``)."""
    from dpsm_ray.storage.layout import read_sweep_settings
    from dpsm_ray.sweep.collect import write_results
    from dpsm_ray.sweep.stage import Stage

    if resume:
        _rebuild_if_changed(results, log)
    _start_ray(spec.trial_demand(), spec.address, spec.resource_timeout, spec.worker_logs, log)
    if not (results / SWEEP_FILE).exists() or read_sweep_settings(results) != settings:
        write_json(results / SWEEP_FILE, settings)  # a new study, or arms added: a later resume must name them too
    stages = [Stage(arm.name, spec.arm_config(arm, results), len(spec.seeds), ("seed",), points=[{"seed": seed} for seed in spec.seeds])
              for arm in spec.arms]
    for arm in spec.arms:
        log(f"arm {arm.name}: {arm.title}, {len(spec.seeds)} seeds")
    if spec.group_size > 1:
        log(_group_text(spec))
    log.plan(sum(stage.total for stage in stages))
    arm_stages = [(arm.name, arm.name) for arm in spec.arms]

    def the_other_arms() -> list:
        write_results(results, spec.name, spec.floor, arm_stages)
        return stages[1:]

    run(spec, results, stages[:1], log, name="study", then=the_other_arms if len(stages) > 1 else None)
    write_results(results, spec.name, spec.floor, arm_stages)
    write_json(results / FINISHED_FILE, {"finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "trials": log.total})
    return results


def _drive_search(spec: SweepSpec, results: Path, settings: dict, resume: bool, log, search_only: bool) -> Path:
    from dpsm_ray.predict.export import export_sweep
    from dpsm_ray.results.report import write_report
    from dpsm_ray.sweep.collect import sweep_stages, write_results

    if resume:
        _rebuild_if_changed(results, log)
    clock = Stopwatch()  # where this driver's time goes: finished.json's "seconds" (bench/sweep_overhead.py)
    with clock("ray_start"):
        _start_ray(spec.trial_demand(), spec.address, spec.resource_timeout, spec.worker_logs, log)
    if not (results / SWEEP_FILE).exists():  # only now: a sweep refused above leaves no sweep to --resume
        write_json(results / SWEEP_FILE, settings)
    planned_final = len(spec.methods) * spec.final_seeds + (spec.final_seeds if spec.base.init == "base" else 0)
    log.plan(sum(search_size(spec, method) for method in spec.methods) + (0 if search_only else planned_final))
    with clock("base_model"):
        # every final seed's base model before the Tune experiment starts: trained from inside it (the
        # final stage's), their Ray tasks would wait for CPUs its idle reused trial processes hold
        seeds = [spec.base.seed + offset for offset in range(1 if search_only else spec.final_seeds)]
        base = with_base_models(spec, seeds, results, log)[spec.base.seed]
    if not spec.grid:
        floor = f", at least {spec.min_trials} each" if spec.min_trials else ""
        each = ", ".join(f"{method} {spec.search_trials(method)}" for method in spec.methods)
        if spec.trials_per_knob is None and not spec.min_trials:
            budget = f"{spec.trials} {SAMPLER_TITLES[spec.sampler]} trials for each of {', '.join(spec.methods)}"
        elif spec.trials_per_knob is None:
            budget = f"{SAMPLER_TITLES[spec.sampler]} trials, {spec.trials} a method{floor} ({each})"
        else:
            budget = f"{SAMPLER_TITLES[spec.sampler]} trials, {spec.trials_per_knob} per knob of each method{floor} ({each})"
        log(f"search: {budget}, minimising the validation set size (validation coverage >= {spec.coverage_floor:g} as a constraint)"
            f"{_asha_text(spec)}")
    if spec.group_size > 1:
        log(_group_text(spec))
    searches = [search_stage(spec, base.replace(**spec.method_settings(method)), results, settings, log) for method in spec.methods]

    def then() -> list:
        """The final stage, once every search trial has ended: their Parquet rows, the pick."""
        with clock("collect"):
            write_results(results, spec.name, spec.floor, sweep_stages(spec.methods))
        with clock("pick"):
            final = final_stage(spec, results, log)
        if final is None:
            raise SweepError(f"every search trial of every method failed; nothing to re-train (errors in {results / 'trials.parquet'})")
        log.replan(planned_final, final.total)
        return [final]

    # one Tune experiment: the searches' trials, then the final stage's, share its processes
    with clock("stages"):
        run(spec, results, searches, log, name="sweep", then=None if search_only else then)
    with clock("collect"):
        write_results(results, spec.name, spec.floor, sweep_stages(spec.methods))
    if search_only:
        return results
    with clock("export"):
        index = export_sweep(results, log=log, build=export_predictors(spec))
    if spec.tracking:
        from dpsm_ray.sweep.tracking import log_predictors

        with clock("tracking"):
            log_predictors(spec.tracking, results, index, log=log)
    with clock("report"):
        write_report(results, log=log, brief=True)
    # "seconds": this driver's (a resumed sweep's: since it resumed), by part
    write_json(results / FINISHED_FILE, {"finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "trials": log.total,
                                         "seconds": {part: round(seconds, 3) for part, seconds in clock.seconds.items()}})
    return results


def run(spec: SweepSpec, results: Path, stages: list, log, name: str, then=None) -> None:
    """The sweep's ``stages`` in one Tune experiment called ``name``, then ``then()``'s
    (``run_stages``); an interruption or a full disk as the drivers' resumable errors."""
    from dpsm_ray.sweep.stage import StageInterrupted, StageOutOfSpace, run_stages

    callbacks = []
    if spec.tracking:
        from dpsm_ray.sweep.tracking import tracking_callbacks

        callbacks = tracking_callbacks(spec.tracking, results)
    try:
        run_stages(stages, results, name=name, resources=dict(spec.trial_resources), concurrency=spec.concurrency,
                   retries=spec.trial_retries, log=log, callbacks=callbacks, reuse=not spec.process_per_trial, then=then,
                   group_size=spec.group_size)
    except StageInterrupted as error:
        raise SweepInterrupted(f"{error}; rerun with --resume to continue") from None
    except StageOutOfSpace as error:
        raise SweepOutOfSpace(f"{error}; free some space and rerun with --resume to continue") from None


def _quiet_libraries() -> None:
    """Keep Optuna's and Tune's INFO chatter out of the sweep's progress output."""
    import logging

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("ray.tune").setLevel(logging.WARNING)
    # "Trials did not complete: [...]" after a stage with failed or interrupted trials: each has
    # its own line already (FAILED, or the interruption's)
    logging.getLogger("ray.tune.tune").setLevel(logging.CRITICAL)
    # Tune's saved experiment state, and the metrics of its results files, are never read back
    # (docs/results.md): failing to write or read them (a full disk) is not the sweep's error, which
    # the sweep reports in one line of its own
    logging.getLogger("ray.tune.execution.experiment_state").setLevel(logging.CRITICAL)
    # ... nor is uploading that state from Tune's staging directory to ``results/tune`` (its
    # "Last sync command failed" traceback, every time a sync meets the full disk)
    logging.getLogger("ray.train._internal.syncer").setLevel(logging.CRITICAL)
    logging.getLogger("ray.tune.analysis.experiment_analysis").setLevel(logging.ERROR)


def with_base_models(spec: SweepSpec, seeds, results: Path, log) -> dict[int, TrainConfig]:
    """``spec.base`` for each of ``seeds``, pointed at its cached base model under
    ``results/base_models``.  Those not cached yet train at once, each as a Ray task holding what a
    trial holds: on a cluster a training node's GPU, never the driver's CPU, and one seed's beside
    another's on a laptop's cores.  (With Ray Train workers a base model trains on them, from here.)
    One base model's lines reach ``log`` as if it trained here; several report as each ends."""
    import ray
    from ray.util.queue import Queue

    from dpsm_ray.timing import duration_text
    from dpsm_ray.train import resolve_base_model
    from dpsm_ray.train.base_model import cached_weights
    from dpsm_ray.train.lines import EpochLine

    configs = {seed: spec.base.replace(seed=seed, cache_dir=str(results / BASE_MODELS)) for seed in seeds}
    missing = [seed for seed, config in configs.items()
               if config.init == "base" and not cached_weights(config, config.cache_dir).exists()]
    if spec.base.workers > 0 or not missing:
        return {seed: resolve_base_model(config, log) for seed, config in configs.items()}
    options, held = _trial_task_options(spec)
    resolved = {seed: resolve_base_model(config, log) for seed, config in configs.items() if seed not in missing}  # the cached
    if len(missing) == 1:
        log(f"base model: seed {missing[0]} trains as a Ray task holding a trial's resources ({held})")
    else:
        log(f"base models: training {len(missing)} (seeds {', '.join(map(str, missing))}) as Ray tasks holding a trial's "
            f"resources ({held}) each, as many at once as fit")
    lines = Queue(actor_options={"num_cpus": 0}) if len(missing) == 1 else None
    started = time.monotonic()
    task = ray.remote(_train_base_model).options(**options)
    outside = cards.outside_cards()  # a dataset or model registered outside the package: the task's process registers it too
    pending = {task.remote(configs[seed].to_dict(), lines, outside): seed for seed in missing}

    def said() -> None:  # the one base model's own lines, as they come
        for text, numbers in lines.get_nowait_batch(lines.qsize()):
            log(EpochLine(text, **numbers) if numbers else text)

    try:  # a task cancelled (interrupted, or another seed failed) resumes from its checkpoint next time
        with closing(_each_ended(pending, poll=said if lines is not None else None)) as ended:
            for done, (seed, (weights, seconds, host, pid)) in enumerate(ended, 1):
                resolved[seed] = configs[seed].replace(init_checkpoint=weights)
                left = f", about {duration_text((time.monotonic() - started) / done * len(pending))} left" if pending else ""
                if lines is None:  # one base model's own lines said it already
                    log(f"base model: trained in {seconds:.0f}s, seed {seed} (process {pid} on {host}; {done} of {len(missing)}{left})")
    finally:
        if lines is not None:
            lines.shutdown()
    return {seed: resolved[seed] for seed in seeds}


def _each_ended(pending: dict, poll=None):
    """``pending``'s Ray tasks (``{ref: key}``, emptied as they end) in the order they end, as
    ``(key, result)``.  A failing task raises its own error (the driver's, not Ray's wrapper of
    it); the tasks still pending when the caller stops -- a failure, an interrupt, an error of its
    own -- are cancelled (use it with ``contextlib.closing``).  ``poll()``: called about once a
    second while waiting."""
    import ray

    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=None if poll is None else 1.0)
            if poll is not None:
                poll()
            for ref in ready:
                key = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayTaskError as error:
                    raise (error.cause if isinstance(error.cause, Exception) else error) from None  # the driver's own error
                yield key, result
    finally:
        for ref in pending:
            ray.cancel(ref)


def _trial_task_options(spec: SweepSpec) -> tuple[dict, str]:
    """Ray task options that hold what one of ``spec``'s trials holds (its CPUs, its share of a
    GPU, custom resources), and those resources in words."""
    resources = dict(spec.trial_resources)
    # a node lost under a task (a preempted GPU node) starts it again (from its checkpoint, if it has one), as a trial's retries would
    options = {"num_cpus": resources.pop("cpu", 0), "num_gpus": resources.pop("gpu", 0), "resources": resources,
               "max_retries": spec.trial_retries}
    return options, ", ".join(f"{name} {amount:g}" for name, amount in spec.trial_resources)


def export_predictors(spec: SweepSpec):
    """``export_sweep``'s builder for a sweep: each final model's predictor written by a Ray task
    holding what a trial holds -- its forward passes on a training node's GPU, never on the
    driver's CPU, and side by side -- so it computes them as the trial's own evaluation did.  A
    failing one raises its own error; the others are cancelled (a resumed sweep writes them)."""

    def build(results: Path, sweep: str, stale: dict[int, dict], log) -> None:
        import ray

        from dpsm_ray.predict.export import ExportProgress

        options, held = _trial_task_options(spec)
        log(f"predictors: {len(stale)} Ray task{'s' * (len(stale) > 1)} holding a trial's resources ({held}) each, as many at once as fit")
        task = ray.remote(_exported_where).options(**options)
        outside = cards.outside_cards()  # cards registered outside the package, which the task's process registers too
        pending = {task.remote(str(results), index, record, sweep, outside): index for index, record in stale.items()}
        progress = ExportProgress(len(stale), log)
        with closing(_each_ended(pending)) as ended:
            for _, (name, host, pid) in ended:
                progress.ended(name, f" (process {pid} on {host})")

    return build


def _exported_where(results: str, index: int, record: dict, sweep: str, outside=()) -> tuple[str, str, int]:
    """A Ray task: final trial ``index``'s predictor written (``export_final_model``); its name,
    and where it ran (host, process).  ``outside``: the driver's cards registered outside the
    package, registered here too (as a trial does)."""
    import socket

    from dpsm_ray.predict.export import export_final_model

    cards.register_cards(outside)
    return export_final_model(results, index, record, sweep), socket.gethostname(), os.getpid()


_EPOCH_NUMBERS = ("epoch", "epochs", "seconds", "val_set_size", "method")


def _train_base_model(config: dict, lines, outside=()) -> tuple[str, float, str, int]:
    """A Ray task: ``config``'s base model found or trained into its cache (``with_base_models``),
    its log lines put on ``lines`` (a Ray queue, or None); its weights' path, the seconds it took,
    and where it trained (host, process).  ``outside``: as ``_exported_where``'s."""
    import socket

    cards.register_cards(outside)

    from dpsm_ray.train import resolve_base_model
    from dpsm_ray.train.lines import EpochLine

    def forward(line: str) -> None:
        if lines is not None:  # an epoch line's numbers (a str subclass's attributes) do not pickle with it
            numbers = {name: getattr(line, name) for name in _EPOCH_NUMBERS} if isinstance(line, EpochLine) else None
            lines.put_nowait((str(line), numbers))

    started = time.monotonic()
    weights = resolve_base_model(TrainConfig.from_dict(config), log=forward).init_checkpoint
    return weights, time.monotonic() - started, socket.gethostname(), os.getpid()


def search_stage(spec: SweepSpec, base: TrainConfig, results: Path, settings: dict, log):
    """The search of ``base.method``: Optuna over its knobs, or the paper's grid."""
    from dpsm_ray.sweep.search import MethodStudy
    from dpsm_ray.sweep.stage import Stage

    method = base.method
    name = f"search-{method}"
    asha = (spec.grace_period, spec.reduction_factor) if spec.scheduler == "asha" else None
    if spec.grid:
        axes = spec.grid_axes(method)
        points = _method_grid_points(spec, method)
        budget = f", a seeded random {len(points)} of them" if len(points) < grid_size(axes) else ""
        log(
            f"{name}: the paper grid has {grid_size(axes)} configurations"
            f" ({' x '.join(f'{k} {len(v)}' for k, v in axes.items())}){budget}{_asha_text(spec)}"
        )
        knobs = tuple(k for k, v in axes.items() if len(v) > 1)
        return Stage(name, base, len(points), knobs, points=points, asha=asha, coverage_floor=spec.coverage_floor)
    knobs = method_knobs(method)  # the trials' lines show them
    ranges = {**DEFAULT_RANGES, **dict(spec.ranges)}
    url = optuna_storage_url(spec, results)
    try:
        study = MethodStudy(url, settings["studies"][method], method, {k: ranges[k] for k in method_knobs(method)},
                            sampler=spec.sampler, seed=spec.seed, total=spec.search_trials(method))
    except Exception as error:
        raise SweepError(f"cannot open the Optuna storage {masked(url)}: {first_line(error)}") from None
    return Stage(name, base, spec.search_trials(method), knobs, study=study, asha=asha, coverage_floor=spec.coverage_floor)


def _asha_text(spec: SweepSpec) -> str:
    if spec.scheduler != "asha":
        return ""
    return f"; ASHA stops trials early (grace period {spec.grace_period} epochs, reduction factor {spec.reduction_factor})"


def _group_text(spec: SweepSpec) -> str:
    """Where a sweep's trials train in groups (``Stage.groups``): stages of given points without
    early stopping, trained in the trial's own process."""
    if spec.base.workers > 0:
        return f"--group-size {spec.group_size}: no trial groups, each trial runs on Ray Train workers (--workers {spec.base.workers})"
    if spec.arms:
        where = "every arm's seeds"
    elif spec.grid and spec.scheduler != "asha":
        where = "the grid searches and the final stage"
    else:
        why = "ASHA stops trials" if spec.grid else "Optuna proposes them"
        where = f"the final stage (a search trial is one configuration: {why})"
    return f"trial groups: up to {spec.group_size} configurations a trial, side by side in its process and resources, in {where}"


def search_size(spec: SweepSpec, method: str) -> int:
    """Trials in ``method``'s search: the Optuna budget, or the grid's (possibly budgeted) points."""
    return len(_method_grid_points(spec, method)) if spec.grid else spec.search_trials(method)


def _method_grid_points(spec: SweepSpec, method: str) -> list[dict]:
    """The points of ``method``'s paper grid the sweep runs (all, or ``--grid-budget`` of them chosen by the seed)."""
    return grid_points(spec.grid_axes(method), spec.grid_budget, derive_seed(spec.seed, "grid", method))


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


def final_stage(spec: SweepSpec, results: Path, log):
    """Each method's chosen configuration re-trained with every final seed (None when every
    search trial of every method failed)."""
    from dpsm_ray.sweep.stage import Stage

    chosen = {method: best_overrides(results, method, spec.grid_axes(method) if spec.grid else method_knobs(method), log)
              for method in spec.methods}
    chosen = {method: overrides for method, overrides in chosen.items() if overrides is not None}
    if not chosen:
        return None
    seeds = [spec.base.seed + offset for offset in range(spec.final_seeds)]
    bases = with_base_models(spec, seeds, results, log)
    points = [
        {**spec.method_settings(method), **overrides, "seed": seed, "init_checkpoint": bases[seed].init_checkpoint}
        for method, overrides in chosen.items() for seed in seeds
    ]
    described = f"{len(chosen)} methods x {len(seeds)} seeds"
    if spec.base.init == "base":  # the paper's CE column: each seed's base model evaluated as it is
        points += [{"method": BASE_MODEL, "epochs": 0, "seed": seed, "init_checkpoint": bases[seed].init_checkpoint} for seed in seeds]
        described += f", and the {len(seeds)} CE base models as they are"
    log(f"final: {described}, evaluated on the calibration/test splits")
    return Stage("final", spec.base.replace(evaluate_test=True), len(points), ("method", "seed"), points=points)
