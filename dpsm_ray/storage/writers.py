"""Writing results: every file is written atomically (``dpsm_ray.files``), so a reader never sees
half a file and an interrupted write leaves the previous version intact, and every Parquet file's
sha256 is recorded in ``manifest.json`` beside it, so a changed byte is named when the results are
read back (``dpsm_ray.storage.layout.verify_manifest``)."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dpsm_ray.files import (
    atomic_write,
    sha256_bytes,
    write_bytes,
    write_checked_json,
    write_json,
)
from dpsm_ray.storage.layout import MANIFEST, MODEL_FILE, PARQUET, read_manifest
from dpsm_ray.storage.schema import CLASSES, EPOCHS, EVALS, arrow_schema



def table(rows: list[dict] | pd.DataFrame, columns: dict[str, pa.DataType]) -> pa.Table:
    """Rows as a table with exactly ``columns`` (missing values become null)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame = frame.reindex(columns=list(columns))
    return pa.Table.from_pandas(frame, schema=arrow_schema(columns), preserve_index=False)


def write_parquet(path: str | os.PathLike, rows: list[dict] | pd.DataFrame, columns: dict[str, pa.DataType]) -> None:
    """Write ``rows`` with exactly ``columns`` and record the file's sha256 in the manifest.

    The manifest entry is written first and keeps the previous checksum as ``replaces``: a kill
    between the two renames leaves the previous file, which the manifest still accepts."""
    path = Path(path)
    sink = pa.BufferOutputStream()
    pq.write_table(table(rows, columns), sink)
    data = sink.getvalue().to_pybytes()
    manifest = read_manifest(path.parent)
    previous = manifest.get(path.name, {}).get("sha256")
    manifest[path.name] = {"sha256": sha256_bytes(data), "replaces": previous}
    write_checked_json(path.parent / MANIFEST, manifest)
    write_bytes(path, data)


def run_key(config) -> dict:
    """The columns that identify a run in every file; ``model`` is the architecture that ran (``auto`` resolved)."""
    return {
        "run_id": config.config_hash(),
        "dataset": config.dataset,
        "model": config.resolved_model(),
        "method": config.method,
        "seed": config.seed,
    }


def runtime(result) -> dict:
    """What fixes a run's numbers besides its configuration (docs/fidelity.md, "Repeatability"):
    the device and the processor's model, torch's thread count in the process that trained it, and
    the versions of Python and of the libraries that compute it.  On one device with one thread and
    these versions, a configuration gives the same rows bit for bit (tests/test_repeatability.py);
    another thread count sums in another order, and the rows drift apart over the epochs; another
    processor may take other vector paths (the Fashion-MNIST league's base models, docs/league.md)."""
    import platform

    import numpy
    import torch

    from dpsm_ray import __version__

    return {
        "device": result.device,
        "cpu": cpu_model(),
        "torch_threads": result.torch_threads if result.torch_threads is not None else torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "dpsm_ray": __version__,
    }


def cpu_model() -> str:
    """The processor's model name (/proc/cpuinfo's on Linux), else what ``platform`` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def write_run(out_dir: str | os.PathLike, result) -> None:
    """A finished run's files: config.json, splits.json, epochs.parquet, evals.parquet,
    classes.parquet, model.pt."""
    import torch

    out = Path(out_dir)
    atomic_write(out / MODEL_FILE, lambda handle: torch.save(result.model_state, handle))
    key = run_key(result.config)
    record = {**result.config.to_dict(), "run_id": key["run_id"], "split_sizes": result.split_sizes, "runtime": runtime(result)}
    write_json(out / "config.json", record)
    write_json(out / "splits.json", result.split_ids)
    write_parquet(out / PARQUET["epochs"], [{**key, **row} for row in result.epochs], EPOCHS)
    write_parquet(out / PARQUET["evals"], [{**key, **row} for row in result.evals], EVALS)
    write_parquet(out / PARQUET["classes"], [{**key, **row} for row in result.classes], CLASSES)
