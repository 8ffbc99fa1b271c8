"""Rebuild a sweep's Parquet files from its ledger (``dpsm_ray.storage.layout``).

The files are a pure function of the run records on disk (one row per trial, per trial and epoch,
per final model, score and re-split, and per final model, score, re-split and class), rewritten
atomically after every stage: a resumed or re-run sweep replaces rows instead of appending
duplicates.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpsm_ray.config import TRIAL_COLUMNS, TrainConfig
from dpsm_ray.cards import reads
from dpsm_ray.storage.layout import PARQUET, CoverageFloor, Ledger
from dpsm_ray.storage.schema import CLASSES, EPOCHS, EVALS, TRIALS
from dpsm_ray.storage.writers import run_key, write_parquet
from dpsm_ray.train.loop import EPOCH_COLUMNS

# The files a sweep writes (docs/results.md) and the TrainConfig fields each trials.parquet row spells
# out: null where the row's method does not read the field (its card's fields: CE's lambda and T).
_FILES = {"trials": TRIALS, "epochs": EPOCHS, "evals": EVALS, "classes": CLASSES}


def collect(sweep: str, floor: CoverageFloor, ledger: Ledger, stage: str, name: str) -> dict[str, list[dict]]:
    """Rows of each of FILES for the stage ``name`` of the sweep (or study) named ``sweep``,
    labelled ``stage`` in the files; ``floor`` says which trials are feasible."""
    trials, epochs, evals, classes = [], [], [], []
    for index, record in sorted(ledger.records(name).items()):
        config = TrainConfig.from_dict(record["config"])
        key = {"sweep": sweep, "stage": stage, "trial_id": record["trial_id"], **run_key(config)}
        rows = [row for row in ledger.epochs(name, index) if row["epoch"] <= record["epochs_completed"]]
        epochs += [{**key, **{c: row.get(c) for c in EPOCH_COLUMNS}} for row in rows]
        metrics = record["metrics"]
        trials.append({
            **key,
            "trial_index": index,
            "node_ip": record["node_ip"],
            "device": record.get("device"),  # records before these two columns lack them
            "gpu_ids": record.get("gpu_ids"),
            "status": record["status"],
            "error": record["error"],
            "feasible": floor.feasible(metrics.get("val_coverage")) if record["status"] != "failed" else None,
            **metrics,
            "epochs_completed": len(rows),
            "wall_seconds": record["wall_seconds"],
            **config_columns(config),
            "config_json": json.dumps(config.to_dict()),
        })
        if record["status"] == "ok" and config.evaluate_test:
            result = ledger.result(name, index)
            evals += [{**key, **row} for row in result["evals"]]
            classes += [{**key, **row} for row in result["classes"]]
    return {"trials": trials, "epochs": epochs, "evals": evals, "classes": classes}


def config_columns(config: TrainConfig) -> dict:
    """trials.parquet's configuration columns of ``config`` (the fields marked ``column``): a field
    its method does not read is null (a value there was never used, and a reader would take it for one)."""
    return {column: _value_of(getattr(config, column)) if reads(config.method, column) else None for column in TRIAL_COLUMNS}


def _value_of(value):
    return list(value) if isinstance(value, tuple) else value


def write_results(results: Path, sweep: str, floor: CoverageFloor, stages: list[tuple[str, str]]) -> None:
    """Rewrite every one of FILES from the records of ``stages`` so far: ``(label in the files,
    stage name under runs/)`` -- a sweep's searches and final stage, or a study's arms."""
    ledger = Ledger(results)
    rows = {name: [] for name in _FILES}
    for stage, name in stages:
        for file, part in collect(sweep, floor, ledger, stage, name).items():
            rows[file] += part
    for file, schema in _FILES.items():
        write_parquet(results / PARQUET[file], rows[file], schema)


def sweep_stages(methods) -> list[tuple[str, str]]:
    """A sweep's stages as ``write_results`` takes them: each method's search, then the final stage."""
    return [*(("search", f"search-{m}") for m in methods), ("final", "final")]
