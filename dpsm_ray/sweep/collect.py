"""Rebuild a sweep's Parquet files from its Tune experiments.

The files are a pure function of the experiment state on disk (one row per trial, per trial and
epoch, per final model, score and re-split), rewritten atomically after every stage: a resumed or
re-run sweep replaces rows instead of appending duplicates.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpsm_ray.results.schema import CLASSES, EPOCHS, EVALS, TRIALS
from dpsm_ray.results.store import run_key, write_parquet
from dpsm_ray.train.loop import EPOCH_COLUMNS
from dpsm_ray.train.ray_train import FINISHED, RESULT_FILE


# The files a sweep writes (docs/results.md) and the TrainConfig fields each trials.parquet row spells out.
FILES = {"trials": TRIALS, "epochs": EPOCHS, "evals": EVALS, "classes": CLASSES}
TRIAL_CONFIG_COLUMNS = (
    "alpha", "conformal_weight", "lr", "quantile_lr", "sigmoid_temperature", "sort_temperature", "batch_size", "epochs", "lr_decay",
    "lr_schedule", "init", "q_init", "conftr_split", "cut_score",
)


def finished_trials(path: Path) -> list[tuple[int, object, object]]:
    """``(trial_index, Trial, Result)`` for every trial of the Tune experiment at ``path`` that
    has ended (finished or failed); ``trial_index`` is the trial's position in the order the
    searcher proposed it, which the sweep seed fixes (Tune's trial ids are random).

    Trials still pending or running in the saved state (an interrupted sweep) are left out: a
    resume finishes them, and their last report or checkpoint may not be their final one."""
    from ray import tune

    from dpsm_ray.sweep.trials import proposal_order

    if not tune.Tuner.can_restore(str(path)):
        return []
    analysis = tune.ExperimentAnalysis(str(path))
    index = {trial.trial_id: position for position, trial in enumerate(proposal_order(analysis.trials))}
    ended = [(index[trial.trial_id], trial, result) for trial, result in zip(analysis.trials, tune.ResultGrid(analysis)) if trial.status in ("TERMINATED", "ERROR")]
    return sorted(ended, key=lambda item: item[0])


def final_checkpoint_path(result) -> str | None:
    """Where a finished trial's last checkpoint (holding its ``RunResult``) lives: a Ray Train
    checkpoint is forwarded as a metric, an in-process trial's is Tune's own."""
    if result.metrics.get("checkpoint_path"):
        return result.metrics["checkpoint_path"]
    return result.checkpoint.path if result.checkpoint is not None else None


def epoch_rows(history) -> list[dict]:
    """One row per epoch from a trial's reported history, in epoch order.  Tune's history is
    append-only: a run that restarted from a checkpoint older than its last report (a worker
    failure, ``checkpoint_every`` > 1) reports some epochs twice, and the later report -- the one
    the finished run continued from -- is kept."""
    if history is None or "epoch" not in history:
        return []
    rows = [r for r in history.to_dict("records") if r.get(FINISHED) is not True]  # NaN (unset) in epoch rows
    return sorted({int(r["epoch"]): r for r in rows}.values(), key=lambda r: r["epoch"])


def collect(spec, results: Path, stage: str, name: str) -> dict[str, list[dict]]:
    """Rows of each of FILES for one experiment."""
    from dpsm_ray.sweep.protocol import feasible
    from dpsm_ray.sweep.trials import trial_config

    trials, epochs, evals, classes = [], [], [], []
    for index, trial, result in finished_trials(results / "tune" / name):
        config = trial_config(trial.config)
        key = {"sweep": spec.name, "stage": stage, "trial_id": trial.trial_id, **run_key(config)}
        rows = epoch_rows(result.metrics_dataframe)
        epochs += [{**key, **{c: row.get(c) for c in EPOCH_COLUMNS}} for row in rows]
        metrics = result.metrics if result.error is None else (rows[-1] if rows else {})
        error = None if result.error is None else (str(result.error).strip().splitlines() or ["error"])[-1][:500]
        status = "failed" if result.error is not None else "ok" if result.metrics.get(FINISHED) else "stopped"  # by the scheduler (ASHA)
        trials.append({
            **key,
            "trial_index": index,
            "node_ip": result.metrics.get("node_ip"),
            "status": status,
            "error": error,
            "feasible": feasible(metrics.get("val_coverage"), spec.coverage_floor) if result.error is None else None,
            "val_coverage": metrics.get("val_coverage"),
            "val_set_size": metrics.get("val_set_size"),
            "val_accuracy": metrics.get("val_accuracy"),
            "epochs_completed": len(rows),
            "wall_seconds": result.metrics.get("time_total_s"),
            **{name: getattr(config, name) for name in TRIAL_CONFIG_COLUMNS},
            "milestones": list(config.milestones),
            "config_json": json.dumps(config.to_dict()),
        })
        checkpoint = final_checkpoint_path(result) if result.error is None and config.evaluate_test else None
        if checkpoint is not None:
            payload = load_run_payload(checkpoint)
            evals += [{**key, **row} for row in payload["evals"]]
            classes += [{**key, **row} for row in payload.get("classes", [])]
    return {"trials": trials, "epochs": epochs, "evals": evals, "classes": classes}


def load_run_payload(checkpoint_path: str) -> dict:
    import ray.train

    with ray.train.Checkpoint(checkpoint_path).as_directory() as directory:
        return torch.load(Path(directory) / RESULT_FILE, map_location="cpu", weights_only=False)


def write_results(spec, results: Path) -> None:
    """Rewrite every one of FILES from every experiment so far."""
    rows = {name: [] for name in FILES}
    for stage, name in [*(("search", f"search-{m}") for m in spec.methods), ("final", "final")]:
        for file, part in collect(spec, results, stage, name).items():
            rows[file] += part
    for file, schema in FILES.items():
        write_parquet(results / f"{file}.parquet", rows[file], schema)
