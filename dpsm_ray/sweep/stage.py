"""Running stages of a sweep (the methods' searches, or the final re-training) on Ray Tune: the
stages given together share one Tune experiment, its processes and its concurrency.

Tune schedules the trials, holds their resources, retries a trial whose node died, and stops the
ones ASHA stops; everything a trial computes lands in its run directory and, when it ends, in the
sweep's ledger (``dpsm_ray.storage.layout``).  A stage is never restored from Tune's saved state: run
again, it starts a fresh Tune experiment for the trials the ledger does not hold yet, each of which
continues from its own checkpoint.

A trial's parameters: ``{"bases": {stage: <TrainConfig dict>}, "results": <results dir>,
"point": {"stage": name, "index": i, "overrides": {field: value}}}`` -- its stage's settings, and
what the search (or the grid, or the pick) chose for trial ``i`` of that stage.
With ``workers >= 1`` the trial is a small driver that runs a Ray Train ``TorchTrainer``
(Ray Train V2 inside Tune); with ``workers == 0`` it trains inside the trial's own process.

**Trial groups** (``group_size`` > 1): one Tune trial trains up to ``group_size`` points side by
side in its process (``dpsm_ray.train.group``; its parameters add ``"group": [point, ...]``,
``"point"`` is the first).  Each member reports, checkpoints and writes its run directory as a
trial of its own, and the ledger callback records each member the moment it ends, so resume,
collect and the pick see trials as ever.  Only stages without early stopping group their trials:
given points (the grid, the final stage, a study's arms) without ASHA, trained in the trial's own
process.  ASHA stops a Tune trial, which would stop every member of its group, and an Optuna
search would propose a group's members before any of them reported, which changes what it
proposes; both keep one configuration a trial.
"""

from __future__ import annotations

import time

_IMPORT_STARTED = time.time()  # a trial's process imports this module (torch, Ray Tune, the loop) before its first trial

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray import tune
from ray.tune.search import Searcher

from dpsm_ray.files import DiskFullError, is_disk_full
from dpsm_ray import cards
from dpsm_ray.storage.layout import TUNE, Ledger
from dpsm_ray.sweep.progress import Progress
from dpsm_ray.timing import duration_text
from dpsm_ray.sweep.search import CONSTRAINED, OBJECTIVE, AshaStopper, MethodStudy, StageStoppers
from dpsm_ray.timing import process_started_at
from dpsm_ray.config import TrainConfig
from dpsm_ray.train.group import error_line, train_group
from dpsm_ray.train.loop import train
from dpsm_ray.train.ray_train import FINISHED, MEMBER_FAILED, RESUMED, TuneTrialEnv, trainer_for, trial_device

_IMPORTED = time.time()


class StageInterrupted(RuntimeError):
    """Tune stopped before every trial of a stage ended (Ctrl-C)."""


_NEARLY_FULL_BYTES = 1 << 20  # less free than this on the results directory's device: full, for a sweep


class StageOutOfSpace(RuntimeError):
    """A trial or the driver found no space left to write (the message names the path)."""


@dataclass
class Stage:
    """One part of a sweep: ``total`` trials proposed by ``study`` (an Optuna search) or given as
    ``points`` (overrides by index: the grid, or the final re-training)."""

    name: str
    base: TrainConfig
    total: int
    knobs: tuple[str, ...]  # shown in the progress lines
    study: MethodStudy | None = None
    points: list[dict] | None = None
    asha: tuple[int, int] | None = None  # (grace period, reduction factor)
    coverage_floor: float = 0.0  # CoverageFloor's value: the Optuna constraint is floor - coverage

    @property
    def groups(self) -> bool:
        """Whether its trials may train in groups (module docstring): given points, no early
        stopping, each trial in its own process."""
        return self.points is not None and self.asha is None and self.base.workers == 0


def trial_config(params: dict, point: dict | None = None) -> TrainConfig:
    """The configuration of the trial's ``point`` (a group member's, or its first)."""
    point = params["point"] if point is None else point
    return TrainConfig.from_dict({**params["bases"][point["stage"]], **point["overrides"]})


def _member_trial_id(trial_id: str, params: dict, point: dict) -> str:
    """A trial's id in the ledger: Tune's; a group member's, Tune's with its place in the group
    (trials.parquet's trial_id is one per configuration)."""
    return trial_id if "group" not in params else f"{trial_id}_m{params['group'].index(point)}"


def run_trial(params: dict, outside=()) -> None:
    """The Tune trainable.  Errors propagate: Tune retries the trial, then reports the error.
    ``outside``: the cards (methods, models, datasets, scores) registered outside the package in
    the driver, registered here too."""
    started = time.time()
    cards.register_cards(outside)
    if "group" in params:
        _run_group(params, started)
        return
    config = trial_config(params)
    if config.workers == 0:
        config, env = in_process(params, params["point"], started)
        result = train(config, env)
        env.extra["timings"]["finished"] = time.time()
        env.finish(result)
        return
    from ray.tune.integration.ray_train import TuneReportCallback

    stage, index = params["point"]["stage"], params["point"]["index"]
    run_dir = Ledger(Path(params["results"])).run_dir(stage, index)
    trainer_for(config, run_dir, callbacks=[TuneReportCallback()], extra={"trial_stage": stage, "trial_index": index}).fit()


def in_process(params: dict, point: dict, started: float) -> tuple[TrainConfig, TuneTrialEnv]:
    """The configuration (its base model found) and environment of ``point``, trained in this
    process: alone, or as a member of a group."""
    config = trial_config(params, point)
    run_dir = Ledger(Path(params["results"])).run_dir(point["stage"], point["index"])
    env = TuneTrialEnv(trial_device(config.device), run_dir, {"trial_stage": point["stage"], "trial_index": point["index"]})
    # when this process started and imported the trial's code (before the first trial it ran),
    # when this trial started and finished, and its seconds per part (the env's clock): what
    # record.json's timings hold (bench/sweep_overhead.py); every report carries them
    env.extra["timings"] = {"process_started": process_started_at(), "import_started": _IMPORT_STARTED, "imported": _IMPORTED,
                            "trial_started": started, "seconds": env.clock.seconds}
    if config.init == "base" and config.init_checkpoint is None:
        from dpsm_ray.train import resolve_base_model

        # a study's trials find (or, the first of a seed, train and cache) their base model themselves
        with env.clock("base_model"):
            config = resolve_base_model(config, log=lambda line: None)
    return config, env


def _run_group(params: dict, started: float) -> None:
    """A trial group: its members side by side in this process (``dpsm_ray.train.group``), each
    ending with the report its lone trial would end with -- its results, or (``MEMBER_FAILED``)
    its error after ``params["retries"]`` restarts from its checkpoint.  A member the ledger
    holds already (it ended before Tune restarted this group's process) is not trained again."""
    ledger = Ledger(Path(params["results"]))
    recorded = {stage: set(ledger.records(stage)) for stage in {point["stage"] for point in params["group"]}}
    group = [in_process(params, point, started) for point in params["group"] if point["index"] not in recorded[point["stage"]]]

    def ended(position: int, outcome) -> None:
        env = group[position][1]
        env.extra["timings"]["finished"] = time.time()
        if isinstance(outcome, BaseException):
            env.fail(error_line(outcome))
        else:
            env.finish(outcome)

    train_group(group, retries=params["retries"], ended=ended)


def run_stages(stages: list[Stage], results: Path, *, name: str, resources: dict, concurrency: int, retries: int, log, callbacks=(),
               reuse: bool = True, then: Callable[[], list[Stage]] | None = None, group_size: int = 1) -> None:
    """Run the trials of ``stages`` that the ledger does not hold, in one Tune experiment called
    ``name``: the stages' trials in stage order, as many at once as ``concurrency`` allows.  Once
    every trial of them has ended, ``then()`` gives the stages that run next in the same experiment
    (the final stage after the searches: it needs their results), in the same processes.  Raises
    ``StageInterrupted`` when Tune stopped first and ``StageOutOfSpace`` when the disk filled up.
    ``log``: the sweep's ``Progress`` (a plain function gets one of its own, counting these stages
    alone); ``callbacks``: more Tune callbacks (an experiment tracker's); ``reuse``: a trial that
    trains in its own process hands it to the next trial (below); ``group_size``: the points a
    trial of a stage that ``groups`` trains side by side (module docstring); a group is one trial,
    holding ``resources`` once, and ``concurrency`` counts trials, not their members."""
    if not isinstance(log, Progress):
        log = Progress(log)
        log.plan(sum(stage.total for stage in stages))
    ledger = Ledger(results)
    pending = unfinished(stages, ledger, log)
    if not pending and then is not None:  # a resumed sweep whose searches had all ended
        added, then = then(), None
        stages, pending = [*stages, *added], unfinished(added, ledger, log)
    if not pending:
        return
    stopper = StageStoppers({stage.name: _stage_stopper(stage, ledger, ended) for stage, ended in pending})
    recorder = LedgerCallback(ledger, [stage for stage, _ in pending], stopper, log)

    def next_stages() -> list[tuple[Stage, dict[int, dict]]]:
        """``then()``'s stages, once the ledger holds every trial of the earlier ones (not so when
        the disk filled up or the sweep was interrupted: the experiment ends there)."""
        nonlocal stages
        if stopper.halted or any(len(ledger.records(stage.name)) < stage.total for stage in stages):
            return []
        added = then()
        stages = [*stages, *added]
        more = unfinished(added, ledger, log)
        for stage, ended in more:
            stopper.stoppers[stage.name] = _stage_stopper(stage, ledger, ended)
            recorder.stages[stage.name] = stage
        return more

    # a trial that trains in its own process hands that process (torch, the loop, imported and
    # warmed up) to the next trial of the experiment: Tune's actor reuse; a failed trial's process
    # is never reused.  Not for Ray Train trials: stopping a TorchTrainer can outlast Tune's reset.
    # A trial waiting for a process of its own takes a reused one as soon as one is free (Tune), so
    # on a cluster short trials may all run on the nodes whose processes started first.
    reuse = reuse and all(stage.base.workers == 0 for stage in stages)
    searcher = StageSearcher(pending, next_stages if then is not None else None, group_size=group_size, retries=retries)
    # cards registered outside the package travel with the trainable (the trial's process has
    # only the built-in cards); without any, the trainable is the plain function
    outside = cards.outside_cards()
    trainable = tune.with_parameters(run_trial, outside=outside) if outside else run_trial
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space={"results": str(results)},
        # the searcher ends the experiment: num_samples -1 is "as many as it proposes"
        tune_config=tune.TuneConfig(
            search_alg=searcher, num_samples=-1, max_concurrent_trials=concurrency, trial_dirname_creator=_trial_dirname, reuse_actors=reuse
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(results / TUNE),
            verbose=0,
            callbacks=[recorder, *callbacks],
            stop=stopper,
            # a trial whose process died (a lost node, an OOM kill) restarts from its last
            # checkpoint, on whichever node has room
            failure_config=tune.FailureConfig(max_failures=retries),
        ),
    )
    try:
        _fit_keeping_ctrl_c(tuner)
        if searcher.error is not None:
            raise searcher.error
    except Exception as error:
        line = out_of_space_line(error, recorder.out_of_space, results)
        if line is not None:
            raise StageOutOfSpace(line) from None
        raise
    if recorder.out_of_space is not None:
        raise StageOutOfSpace(recorder.out_of_space)
    for stage in stages:
        ended = len(ledger.records(stage.name))
        if ended < stage.total:
            raise StageInterrupted(f"{stage.name} stopped after {ended} of {stage.total} trials")


def unfinished(stages: list[Stage], ledger: Ledger, log: Progress) -> list[tuple[Stage, dict[int, dict]]]:
    """The stages with trials the ledger does not hold, each with the records of those it does
    (the sweep's counter counts them as ended; a study hears of any it missed)."""
    pending = []
    for stage in stages:
        ended = ledger.records(stage.name)
        for index, record in ended.items():  # a driver killed between a record and its tell
            _tell_study(stage, index, record)
        log.already_ended(len(ended))
        if len(ended) >= stage.total:
            continue
        if ended:
            log(f"{stage.name}: {len(ended)} of {stage.total} trials already ended; running the other {stage.total - len(ended)}")
        pending.append((stage, ended))
    return pending


class StageSearcher(Searcher):
    """Tune's searcher for the stages of one experiment: the first stage's trials, then the next
    one's -- a study's proposals (each with the parameters its search alone would propose), or the
    stage's points by index -- so that a sweep's stages run in one experiment, and share its
    processes, in the order of sequential stages.  With ``then``: once every trial handed out has
    ended, ``then()`` adds the stages that need their results (none: the experiment ends); an
    error it raises ends the experiment and is ``error``, for the caller to raise.

    It only proposes: the sweep's ledger callback tells a study how each trial ended, after
    recording it, and Tune keeps nothing of it to restore (``save`` is empty; ``MethodStudy``
    leaves its storage out of Tune's pickles, so no storage URL and no password are ever written
    into them).  Each trial's parameters carry its stage's settings (``bases``).

    With ``group_size`` > 1 a trial takes up to that many points in this order, as long as their
    stages ``group`` (a group may run from one such stage into the next); a group member that
    raises is restarted from its checkpoint up to ``retries`` times in its group's process."""

    def __init__(self, stages: list[tuple[Stage, dict]], then: Callable[[], list[tuple[Stage, dict]]] | None = None, *,
                 group_size: int = 1, retries: int = 0) -> None:
        super().__init__()  # no metric: Tune would demand it of every report (a base model evaluated as it is has none)
        self.stages = [(stage, set(ended), set()) for stage, ended in stages]
        self.then, self.error = then, None
        self.group_size, self.retries = group_size, retries
        self.running: set[str] = set()

    def __getstate__(self) -> dict:
        """Without ``then``: Tune pickles its searcher (closures by value), and the
        sweep's ``then`` reaches its spec, whose Optuna storage URL may carry a password."""
        return {**self.__dict__, "then": None}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        return True  # the space is the stages'

    def suggest(self, trial_id: str) -> dict | None:
        points, bases = [], {}
        while self.stages and len(points) < self.group_size:
            stage, ended, handed = self.stages[0]
            if points and not stage.groups:
                break
            if stage.study is not None:
                proposal = stage.study.propose(ended | handed)
            else:
                proposal = next(((i, point) for i, point in enumerate(stage.points) if i not in ended | handed), None)
            if proposal is None:
                # a stage with nothing left never has again: Tune asks at every step while trials
                # run, and a study's proposal reads its database
                self.stages.pop(0)
                continue
            index, overrides = proposal
            handed.add(index)
            points.append({"stage": stage.name, "index": index, "overrides": overrides})
            bases[stage.name] = stage.base.to_dict()
            if not stage.groups:
                break
        if points:
            self.running.add(trial_id)
            params = {"bases": bases, "point": points[0]}
            return params if len(points) == 1 else {**params, "group": points, "retries": self.retries}
        if self.then is None:
            return Searcher.FINISHED
        if self.running:
            return None  # the next stages wait for these trials' results
        then, self.then = self.then, None
        try:
            self.stages += [(stage, set(ended), set()) for stage, ended in then()]
        except Exception as error:
            self.error = error
            return Searcher.FINISHED
        return self.suggest(trial_id)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Only that it ended: the ledger callback tells the study (see the class docstring)."""
        self.running.discard(trial_id)

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: the proposals live in the study, the results in the ledger."""

    def restore(self, checkpoint_path: str) -> None:
        """Nothing to restore (see ``save``)."""


def _stage_stopper(stage: Stage, ledger: Ledger, ended: dict[int, dict]) -> AshaStopper:
    """ASHA for ``stage``'s trials (none without ``stage.asha``), knowing every epoch the ledger
    holds of the trials that started: those that ended, and those an interrupted run left
    part-way."""
    reached = {i: ended[i]["epochs_completed"] if i in ended else math.inf for i in ledger.started(stage.name)}
    history = {
        i: {row["epoch"]: row[OBJECTIVE] for row in ledger.epochs(stage.name, i) if row["epoch"] <= last} for i, last in reached.items()
    }
    longest = max(p.get("epochs", stage.base.epochs) for p in stage.points) if stage.points else stage.base.epochs
    return AshaStopper(*(stage.asha or (None, 2)), epochs=longest, history=history)


def _fit_keeping_ctrl_c(tuner):
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


def _trial_dirname(trial) -> str:
    point = trial.config["point"]
    return f"trial_{point['stage']}_{point['index']:04d}_{trial.trial_id}"


def out_of_space_line(error: BaseException, seen: str | None, results: Path) -> str | None:
    """The one line to stop a sweep with when ``error`` ended its Tune run because the disk filled
    up, else None.  Besides an error that says so: once a trial found the disk full (``seen``), or
    when the results directory's device is nearly full, Tune's own files written meanwhile are cut
    short and Tune fails reading them back (an ``EOFError`` from a trial's empty error.pkl)."""
    if is_disk_full(error):
        return disk_full_line(error)
    if seen is not None:
        return seen
    if shutil.disk_usage(results).free < _NEARLY_FULL_BYTES:
        return str(DiskFullError(results / TUNE))
    return None


def disk_full_line(error: BaseException) -> str:
    """The line of ``error``'s text that names the full device."""
    lines = [line.strip() for line in str(error).splitlines() if "no space left" in line.lower() or "disk is full" in line.lower()]
    return (lines[-1] if lines else "no space left on the results directory's device").removeprefix("dpsm_ray.files.DiskFullError: ")


def _local_error_text(trial) -> str:
    """The trial's error file where Tune wrote it before calling back: ``trial.get_error`` reads
    it from the storage path, where it lands only at the next sync (seen: a trial failing before
    its first report)."""
    path = Path(trial.local_path) / "error.txt" if trial.local_path else None
    try:
        return path.read_text() if path is not None else ""
    except OSError:
        return ""


class LedgerCallback(tune.Callback):
    """Records each trial of an experiment's stages when it ends (``record.json``), then tells the
    Optuna study; logs one line per trial (its wall time from launch, the sweep's counter and
    estimate), and an epoch line now and then for trials that run long.

    A trial ends finished (its last report says so), stopped (by ASHA) or failed (Tune gave up
    on it).  One that Tune tears down because the sweep was interrupted has not ended: it gets no
    record, and a resumed sweep runs it on.  A trial that failed for lack of disk space is not a
    failed trial either: the experiment halts, to be resumed once there is space.

    A trial group's members (the module docstring) are recorded one by one, each at its last
    report -- finished, or ``MEMBER_FAILED`` -- with what its lone trial's record would hold; when
    Tune gives up on the group's process, every member without a record fails with its error."""

    def __init__(self, ledger: Ledger, stages: list[Stage], stopper: StageStoppers, log: Progress, epoch_every_s: float = 30.0) -> None:
        self.ledger, self.stopper, self.log = ledger, stopper, log
        self.stages = {stage.name: stage for stage in stages}
        self.epoch_every_s = epoch_every_s
        self._last_line: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # when Tune first listed a trial
        self._launched: dict[str, float] = {}  # when its process was asked for (see on_trial_start)
        self._last_end = -math.inf
        self._member_results: dict[tuple[str, int], dict] = {}  # a group member's last report before its end
        self._recorded: set[tuple[str, int]] = set()  # the group members recorded by this driver
        self._resumed_after: dict[tuple[str, int], int] = {}  # the epochs a trial resumed from its checkpoint after
        self.out_of_space: str | None = None

    def stage_of(self, trial, point: dict | None = None) -> Stage:
        return self.stages[(point or trial.config["point"])["stage"]]

    def point_of(self, trial, result: dict) -> dict:
        """The point a report is of: the trial's, or the group member's that sent it."""
        if "group" not in trial.config:
            return trial.config["point"]
        key = (result.get("trial_stage"), result.get("trial_index"))
        return next((point for point in trial.config["group"] if (point["stage"], point["index"]) == key), trial.config["point"])

    def say(self, trial, text: str, counter: str = "", point: dict | None = None) -> None:
        point = point or trial.config["point"]
        stage = self.stage_of(trial, point)
        self.log(f"{stage.name} {point['index'] + 1}/{stage.total}  {text}" + (f"  | {counter}" if counter else ""))

    def on_step_begin(self, iteration, trials, **info) -> None:
        now = time.monotonic()
        for trial in trials:
            self._seen.setdefault(trial.trial_id, now)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        # Tune calls this once the trial's process is up; it asked for that process when the
        # trial was listed, or, if it waited for a slot, when the last trial before it ended
        now = time.monotonic()
        launched = max(self._seen.get(trial.trial_id, now), min(self._last_end, now))
        self._launched.setdefault(trial.trial_id, launched)  # a retried trial keeps its first launch
        self._last_line[trial.trial_id] = now
        self.log.trial_started()

    def launched_at(self, trial) -> float | None:
        """When the trial was launched, in seconds since the epoch."""
        launched = self._launched.get(trial.trial_id)
        return None if launched is None else time.time() - (time.monotonic() - launched)

    def wall_seconds(self, trial) -> float:
        """The trial's wall time from launch to now, its process's start-up included."""
        self._last_end = now = time.monotonic()
        return now - self._launched.get(trial.trial_id, now)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        point = self.point_of(trial, result)
        if result.get(RESUMED):
            self._resumed_after[point["stage"], point["index"]] = result.get("epoch", 0)
        if "group" in trial.config:
            if result.get(FINISHED) or MEMBER_FAILED in result:
                self.member_ended(trial, result)
                return
            self._member_results[point["stage"], point["index"]] = result
        if result.get(FINISHED) or result.get(RESUMED) or "epoch" not in result:
            return
        now = time.monotonic()
        if now - self._last_line.get(trial.trial_id, now) >= self.epoch_every_s:
            self._last_line[trial.trial_id] = now
            self.say(
                trial,
                f"epoch {result['epoch']}/{trial_config(trial.config, point).epochs}  val cov {result[CONSTRAINED]:.3f}  val size"
                f" {result[OBJECTIVE]:.2f}",
                point=point,
            )

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        result = trial.last_result or {}
        if "group" in trial.config:  # its members were recorded as each ended
            if result.get(FINISHED) or MEMBER_FAILED in result:
                self.member_ended(trial, result)
            return
        stage, index = self.stage_of(trial), trial.config["point"]["index"]
        if result.get(FINISHED):
            status = "ok"
        elif self.stopper.stopped(stage.name, index):
            status = "stopped"
        else:
            return  # torn down by an interrupted sweep: not ended
        self.record(trial, status, None, result)
        self.say_ended(trial, status, result, trial.config["point"])

    def member_ended(self, trial, result: dict) -> None:
        """Record a group member at its last report (once: a restarted group may send it again)."""
        point = self.point_of(trial, result)
        key = (point["stage"], point["index"])
        if key in self._recorded:
            return
        self._recorded.add(key)
        if MEMBER_FAILED in result:
            self.member_failed(trial, point, result[MEMBER_FAILED])
            return
        self.record(trial, "ok", None, result, point)
        self.say_ended(trial, "ok", result, point)

    def member_failed(self, trial, point: dict, message: str) -> None:
        self._recorded.add((point["stage"], point["index"]))
        self.record(trial, "failed", message, self._member_results.get((point["stage"], point["index"]), {}), point)
        self.wall_seconds(trial)
        self.say(trial, f"FAILED: {message} (a member of a trial group; its traceback is in the group's output: --worker-logs)",
                 self.log.trial_ended(self.share_now(trial, point)), point)

    def share_now(self, trial, point: dict) -> float:
        """The part of the trial's epochs that ran in this run: all of them, unless it resumed
        from a checkpoint (the estimate of the time left counts this, ``Progress``)."""
        epochs = trial_config(trial.config, point).epochs
        after = self._resumed_after.get((point["stage"], point["index"]), 0)
        return max(epochs - after, 0) / epochs if epochs else 1.0

    def say_ended(self, trial, status: str, result: dict, point: dict) -> None:
        config, stage = trial_config(trial.config, point), self.stage_of(trial, point)
        seconds = duration_text(self.wall_seconds(trial))
        ended = (
            f"done in {seconds}" if status == "ok" else f"stopped by ASHA after {result.get('epoch', 0)}/{config.epochs} epochs, {seconds}"
        )
        knobs = "  ".join(f"{name}={short(getattr(config, name))}" for name in stage.knobs)
        size, coverage = result.get(OBJECTIVE), result.get(CONSTRAINED)
        # a run without epochs (the base model, evaluated as it is) has no validation figures: say so, not "nan"
        validated = (
            f"val size {size:.3f}  val cov {coverage:.3f}" if size is not None and size == size else "no training epochs, nothing validated"
        )
        self.say(trial, f"{ended}  {validated}  {knobs}", self.log.trial_ended(self.share_now(trial, point)), point)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        error = trial.get_error()
        if error is not None and is_disk_full(error):
            if self.out_of_space is None:
                self.out_of_space = disk_full_line(error)
            self.stopper.halt()
            return
        text = str(error) if error is not None else _local_error_text(trial)
        lines = text.strip().splitlines()
        message = lines[-1][:500] if lines else "error"
        if "group" in trial.config:
            for point in trial.config["group"]:
                if (point["stage"], point["index"]) not in self._recorded:
                    self.member_failed(trial, point, message)
            return
        self.record(trial, "failed", message, trial.last_result or {})
        self.wall_seconds(trial)
        share = self.share_now(trial, trial.config["point"])
        self.say(trial, f"FAILED: {message} (traceback: {Path(trial.local_path) / 'error.txt'})", self.log.trial_ended(share))

    def record(self, trial, status: str, error: str | None, result: dict, point: dict | None = None) -> None:
        """Write the record of the trial (of its group's member at ``point``), then tell the study
        (the record is what a resume trusts)."""
        point = point or trial.config["point"]
        stage, index = self.stage_of(trial, point), point["index"]
        epochs = self.ledger.epochs(stage.name, index)
        metrics = result if status != "failed" else (epochs[-1] if epochs else {})
        record = {
            "trial_id": _member_trial_id(trial.trial_id, trial.config, point),
            "status": status,
            # the epochs the trial reported: a Ray Train trial that ASHA stopped may train on for an
            # epoch or two, and write their rows, while its workers are torn down
            "epochs_completed": len(epochs) if status == "failed" else int(result.get("epoch", len(epochs))),
            "error": error,
            "node_ip": result.get("node_ip"),
            "device": result.get("device"),
            "gpu_ids": result.get("gpu_ids"),
            "wall_seconds": result.get("time_total_s"),
            # when the driver launched the trial and recorded its end, and the trial's own
            # timestamps and seconds per part, as far as it reported them (bench/sweep_overhead.py)
            "timings": {**(result.get("timings") or {}), "launched": self.launched_at(trial), "recorded": time.time()},
            "metrics": {name: metrics.get(name) for name in ("val_coverage", "val_set_size", "val_accuracy")},
            "overrides": point["overrides"],
            "config": trial_config(trial.config, point).to_dict(),
        }
        self.ledger.write_record(stage.name, index, record)
        _tell_study(stage, index, record)


def _tell_study(stage: Stage, index: int, record: dict) -> None:
    """Tell a search's study how trial ``index`` ended, as its record says (a no-op for a stage
    without a study, and for a trial the study already holds as finished)."""
    if stage.study is None:
        return
    metrics = record["metrics"]
    attributes = {
        "tune_trial_id": record["trial_id"],
        "run_id": TrainConfig.from_dict(record["config"]).config_hash(),
        "status": record["status"],
        **{k: v for k, v in metrics.items() if k in (OBJECTIVE, CONSTRAINED) and v is not None},
    }
    stage.study.tell(
        index,
        status=record["status"],
        value=metrics.get(OBJECTIVE),
        coverage=metrics.get(CONSTRAINED),
        floor=stage.coverage_floor,
        attributes=attributes,
    )


def short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
