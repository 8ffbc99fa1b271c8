"""One Tune trial = one training run; the searcher that knows about the coverage constraint; and
the progress lines a researcher watches.

A trial's parameters are ``{"base": <TrainConfig dict>, "overrides": {field: value}}``: the sweep's
shared settings plus what the searcher (or the grid) chose.  With ``workers >= 1`` the trial is a
small driver that runs a Ray Train ``TorchTrainer`` (RAY_NOTES: Train V2 inside Tune); with
``workers == 0`` it trains inside the trial's own process.
"""

from __future__ import annotations

import math
import time

import optuna
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from dpsm_ray.train.config import TrainConfig
from dpsm_ray.train.env import pick_device
from dpsm_ray.train.loop import train
from dpsm_ray.train.ray_train import FINISHED, TuneTrialEnv, trainer_for

# The Parquet/report column that a trial is scored on, and the one constrained.
OBJECTIVE = "val_set_size"
CONSTRAINED = "val_coverage"


def trial_config(params: dict) -> TrainConfig:
    return TrainConfig.from_dict({**params["base"], **params["overrides"]})


def proposal_order(trials: list) -> list:
    """``trials`` in the order Tune created them, i.e. the order the searcher (Optuna, or the
    grid) proposed them: the leading number of each trial's experiment tag, which is kept
    across restores.  Tune's own list is not: a restore reorders it by last result time."""
    return sorted(trials, key=lambda trial: int(trial.experiment_tag.split("_", 1)[0]))


def run_trial(params: dict) -> None:
    """The Tune trainable.  Errors propagate: Tune marks the trial ERROR and the sweep goes on."""
    config = trial_config(params)
    if config.workers == 0:
        env = TuneTrialEnv(pick_device(config.device))
        env.finish(train(config, env))
        return
    from ray.tune.integration.ray_train import TuneReportCallback

    context = tune.get_context()
    # deterministic per trial, so a retried or restored trial resumes its Train run
    name = f"{context.get_experiment_name()}-{context.get_trial_id()}"
    trainer_for(config, params["train_storage"], name, callbacks=[TuneReportCallback()]).fit()


class ConstrainedOptunaSearch(OptunaSearch):
    """Optuna search that records validation coverage >= 1 - alpha - slack as a real constraint.

    Ray does not expose Optuna's constraints, so the value (1 - alpha - slack) - val_coverage
    (feasible when <= 0) is set on the Optuna trial just before Ray tells the study the result;
    Optuna 5's samplers (TPE by default) read it from there.  A trial that failed, or finished
    without a coverage, is told as failed by Ray and carries no constraint.  A trial a scheduler
    stopped early (ASHA) is told as pruned: its last validation set size is not a finished run's.
    """

    def __init__(self, *args, coverage_floor: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.coverage_floor = coverage_floor

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        optuna_trial = self._ot_trials.get(trial_id)
        if optuna_trial is None or trial_id in self._completed_trials:
            return super().on_trial_complete(trial_id, result=result, error=error)
        coverage = (result or {}).get(CONSTRAINED)
        if not error and isinstance(coverage, (int, float)) and math.isfinite(coverage):
            optuna_trial.set_constraint("coverage", self.coverage_floor - float(coverage))
        if not error and result and not result.get(FINISHED):
            self._ot_study.tell(optuna_trial, state=optuna.trial.TrialState.PRUNED)
            self._completed_trials.add(trial_id)
            return
        super().on_trial_complete(trial_id, result=result, error=error)

    def study(self):
        return self._ot_study


class ProgressPrinter(tune.Callback):
    """One line when a trial finishes, is stopped early or fails, and a line per epoch for trials
    that run long."""

    def __init__(self, label: str, total: int, knobs: tuple[str, ...], epoch_every_s: float = 30.0) -> None:
        self.label, self.total, self.knobs = label, total, knobs
        self.epoch_every_s = epoch_every_s
        self._last_line: dict[str, float] = {}

    def _say(self, trials, trial, text: str) -> None:
        print(f"[{self.label} {proposal_order(trials).index(trial) + 1}/{self.total}] trial {trial.trial_id}  {text}", flush=True)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self._last_line[trial.trial_id] = time.monotonic()

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if result.get(FINISHED) or "epoch" not in result:
            return
        now = time.monotonic()
        if now - self._last_line.get(trial.trial_id, now) >= self.epoch_every_s:
            self._last_line[trial.trial_id] = now
            self._say(trials, trial, f"epoch {result['epoch']}/{trial_config(trial.config).epochs}  val cov {result[CONSTRAINED]:.3f}  val size {result[OBJECTIVE]:.2f}")

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        result = trial.last_result or {}
        config = trial_config(trial.config)
        knobs = "  ".join(f"{name}={short(getattr(config, name))}" for name in self.knobs)
        seconds = result.get("time_total_s", 0.0)
        ended = f"done in {seconds:.0f}s" if result.get(FINISHED) else f"stopped by ASHA after {result.get('epoch', 0)}/{config.epochs} epochs, {seconds:.0f}s"
        self._say(trials, trial, f"{ended}  val size {result.get(OBJECTIVE, float('nan')):.3f}  val cov {result.get(CONSTRAINED, float('nan')):.3f}  {knobs}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        error = trial.get_error()
        lines = str(error).strip().splitlines() if error is not None else []
        self._say(trials, trial, f"FAILED: {lines[-1] if lines else 'see error.txt in ' + str(trial.local_path)}")


def short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
