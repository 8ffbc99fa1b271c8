"""Writing results: every file is written to a temporary name and renamed into place, so a
reader never sees half a file and an interrupted write leaves the previous version intact."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dpsm_ray.results.schema import CLASSES, EPOCHS, EVALS, arrow_schema


def atomic_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_json(path: str | os.PathLike, payload) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(path)
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def table(rows: list[dict] | pd.DataFrame, columns: dict[str, pa.DataType]) -> pa.Table:
    """Rows as a table with exactly ``columns`` (missing values become null)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame = frame.reindex(columns=list(columns))
    return pa.Table.from_pandas(frame, schema=arrow_schema(columns), preserve_index=False)


def write_parquet(path: str | os.PathLike, rows: list[dict] | pd.DataFrame, columns: dict[str, pa.DataType]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(path)
    pq.write_table(table(rows, columns), tmp)
    os.replace(tmp, path)


def run_key(config) -> dict:
    """The columns that identify a run in every file; ``model`` is the architecture that ran (``auto`` resolved)."""
    from dpsm_ray.models import default_model

    model = default_model(config.dataset) if config.model == "auto" else config.model
    return {"run_id": config.config_hash(), "dataset": config.dataset, "model": model, "method": config.method, "seed": config.seed}


def write_run(out_dir: str | os.PathLike, result) -> None:
    """A finished run's files: config.json, splits.json, epochs.parquet, evals.parquet,
    classes.parquet, model.pt."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(out / "model.pt")
    torch.save(result.model_state, tmp)
    os.replace(tmp, out / "model.pt")
    key = run_key(result.config)
    write_json(out / "config.json", {**result.config.to_dict(), "run_id": key["run_id"], "split_sizes": result.split_sizes})
    write_json(out / "splits.json", result.split_ids)
    write_parquet(out / "epochs.parquet", [{**key, **row} for row in result.epochs], EPOCHS)
    write_parquet(out / "evals.parquet", [{**key, **row} for row in result.evals], EVALS)
    write_parquet(out / "classes.parquet", [{**key, **row} for row in result.classes], CLASSES)
