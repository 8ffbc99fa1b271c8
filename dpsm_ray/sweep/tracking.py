"""A sweep in MLflow: ``--tracking mlflow[=URI]`` (``pip install -e ".[mlflow]"``).

One MLflow experiment per sweep, named after its results directory (absolute path); one MLflow run
per Tune trial (a Tune ``LoggerCallback`` on the driver: the nodes need no MLflow), with

- params: the trial's whole training configuration (``TrainConfig``, as ``config_json`` holds it);
- tags: ``stage``, ``trial_index``, ``tune_trial_id``, ``method``, ``seed`` and ``parquet_run_id``,
  the ``run_id`` of the trial's rows in the Parquet files;
- metrics, step = epoch: every number of the trial's ``epochs.parquet`` rows (``val_coverage``,
  ``val_set_size``, ``upper_loss``, ``q`` ...);
- for a final model: ``test_<metric>_<score>`` (coverage, set size, CovGap, SSCV, WSC, accuracy,
  averaged over the calibration/test re-splits, as in ``evals.parquet``), and its exported
  predictor (``dpsm_ray.predict.export``) as the artifact ``predictor/``.

Without a URI: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///RESULTS/mlflow.db``.  A resumed sweep
opens new runs for the trials it runs again.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from ray.tune.logger import LoggerCallback

from dpsm_ray.files import read_checked_json
from dpsm_ray.storage.schema import EPOCHS
from dpsm_ray.storage.layout import RESULT_FILE, Ledger
from dpsm_ray.sweep.options import parse_tracking
from dpsm_ray.sweep.stage import trial_config
from dpsm_ray.train.ray_train import FINISHED, RESUMED

_FINAL_METRICS = ("coverage", "set_size", "covgap", "sscv", "wsc", "accuracy")


def _tracking_uri(text: str, results: Path) -> str:
    _, uri = parse_tracking(text)
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{results / 'mlflow.db'}"


def _experiment_name(results: Path) -> str:
    return str(results)


def tracking_callbacks(tracking: str | None, results: Path) -> list:
    """The Tune callbacks that log an experiment's trials (none without ``--tracking``)."""
    if tracking is None:
        return []
    return [SweepMLflowCallback(_tracking_uri(tracking, results), _experiment_name(results), results)]


# the numbers of an epochs.parquet row, logged per epoch
_EPOCH_METRICS = tuple(name for name, kind in EPOCHS.items() if str(kind) in ("double", "int64") and name not in ("seed", "epoch"))


class SweepMLflowCallback(LoggerCallback):
    """One MLflow run per Tune trial, on the driver (module docstring): Tune's public
    ``LoggerCallback`` and MLflow's public client, nothing of Ray's MLflow integration's insides."""

    def __init__(self, uri: str, experiment: str, results: Path) -> None:
        self.uri, self.experiment, self.results = uri, experiment, Path(results)
        self.tags = {"sweep_results": str(results)}
        self.runs: dict = {}  # trial -> its MLflow run id
        self.mlflow: MlflowClient | None = None
        self.experiment_id: str | None = None

    def setup(self, *args, **kwargs) -> None:
        self.mlflow = MlflowClient(self.uri)
        found = self.mlflow.get_experiment_by_name(self.experiment)
        self.experiment_id = found.experiment_id if found is not None else self.mlflow.create_experiment(self.experiment)

    def log_trial_start(self, trial) -> None:
        if trial in self.runs:  # a retried trial goes on in its run
            return
        config = trial_config(trial.config)
        stage, index = trial.config["point"]["stage"], trial.config["point"]["index"]
        tags = {
            **self.tags,
            "stage": stage,
            "trial_name": str(trial),
            "trial_index": str(index),
            "tune_trial_id": trial.trial_id,
            "method": config.method,
            "seed": str(config.seed),
            "parquet_run_id": config.config_hash(),
        }
        run = self.mlflow.create_run(self.experiment_id, tags=tags, run_name=f"{stage} {index:04d} {config.method} seed {config.seed}")
        self.runs[trial] = run.info.run_id
        self.mlflow.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in config.to_dict().items()])

    def log_trial_result(self, iteration: int, trial, result: dict) -> None:
        if result.get(FINISHED) or result.get(RESUMED) or "epoch" not in result or trial not in self.runs:
            return  # the last report repeats the last epoch; a resumed one, an epoch logged already
        now = int(time.time() * 1000)
        metrics = [Metric(name, float(result[name]), now, int(result["epoch"])) for name in _EPOCH_METRICS if finite(result.get(name))]
        if metrics:
            self.mlflow.log_batch(self.runs[trial], metrics=metrics)

    def log_trial_end(self, trial, failed: bool = False) -> None:
        if trial not in self.runs:
            return
        run_id = self.runs[trial]
        result_file = Ledger(self.results).run_dir(trial.config["point"]["stage"], trial.config["point"]["index"]) / RESULT_FILE
        if not failed and result_file.exists():
            evals = read_checked_json(result_file)["evals"]
            now = int(time.time() * 1000)
            metrics = []
            for score in dict.fromkeys(row["score"] for row in evals):
                rows = [row for row in evals if row["score"] == score]
                for name in _FINAL_METRICS:
                    values = [row[name] for row in rows if finite(row.get(name))]
                    if values:
                        metrics.append(Metric(f"test_{name}_{score}", sum(values) / len(values), now, 0))
            if metrics:
                self.mlflow.log_batch(run_id, metrics=metrics, tags=[RunTag("evaluated_splits", str(len(rows)))])
        self.mlflow.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def log_predictors(tracking: str | None, results: Path, index: dict, log=print) -> None:
    """Attach each exported predictor (``export_sweep``'s index) to the MLflow run of the final
    trial that trained it (the latest such run: a resumed sweep may have opened several).  The
    sweep's results are written by now: a tracking server that fails here costs a warning only."""
    if tracking is None:
        return
    uri = _tracking_uri(tracking, results)
    try:
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(_experiment_name(results))
        if experiment is None:
            return
        for entry in index["predictors"]:
            runs = client.search_runs(
                [experiment.experiment_id],
                filter_string=f"tags.stage = 'final' and tags.parquet_run_id = '{entry['run_id']}'",
                order_by=["attributes.start_time DESC"],
                max_results=1,
            )
            if runs:
                client.log_artifacts(runs[0].info.run_id, str(results / entry["directory"]), artifact_path="predictor")
    except Exception as error:  # MLflow's own errors, and the network's
        log(
            f"warning: MLflow at {uri}: the predictors were not logged"
            f" ({str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__})"
        )
        return
    log(f"MLflow: the sweep's runs and predictors are in experiment {experiment.name!r} at {uri}")
