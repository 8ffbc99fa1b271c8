"""What two runs of one sweep must agree on (the resume and trial-group tests): every row of its
Parquet files but Tune's random trial ids and the clock, and the sweep scripts they start joined to
the test session's Ray."""

import os
from pathlib import Path

import pandas as pd

from dpsm_ray.train.loop import EPOCH_TIMINGS

# What may differ between two runs of one sweep: Tune's random trial ids and the clock.
UNREPEATABLE = ["trial_id", "wall_seconds", *EPOCH_TIMINGS]


def sweep_env() -> dict:
    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}


def repeatable_rows(results: Path) -> dict[str, pd.DataFrame]:
    """The three Parquet files without what may differ between runs (paths made relative)."""
    frames = {}
    for name in ("trials", "epochs", "evals"):
        frame = pd.read_parquet(results / f"{name}.parquet")
        frame = frame.drop(columns=[c for c in UNREPEATABLE if c in frame.columns])
        if "config_json" in frame:
            frame["config_json"] = frame.config_json.str.replace(str(results), "RESULTS", regex=False)
        frames[name] = frame
    return frames
