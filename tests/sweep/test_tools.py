"""A sweep beside the tools its user already has open: its sweep.json given back as --config.

One tiny digits sweep (DPSM only: two Optuna trials, one final seed, 2 epochs, trials in their own
processes) is shared by the module; every trial costs Ray several seconds on 2 cores.
"""

import json
import runpy
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.sweep.cli import main

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
DIGITS = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))["DEFAULTS"]
TINY = ["--methods", "dpsm", "--trials", "2", "--final-seeds", "1", "--base-epochs", "2", "--epochs", "2", "--workers", "0", "--seed", "3"]
# What differs between two runs of one sweep: Tune's random trial ids, the clock, and the paths
# under each results directory
UNREPEATABLE = ["trial_id", "wall_seconds", "epoch_seconds", "config_json"]
PATHS = ("cache_dir", "init_checkpoint")


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    results = tmp_path_factory.mktemp("tools") / "digits"
    assert main("digits", "digits", DIGITS, ["--results-dir", str(results), *TINY]) == 0
    return results


def rows(results: Path, name: str) -> tuple[pd.DataFrame, list[dict]]:
    """A Parquet file's rows in a fixed order without what may differ, and each row's configuration
    without its paths (compared as values: the JSON of 1.0 and of 1 differ)."""
    frame = pd.read_parquet(results / f"{name}.parquet")
    keys = [c for c in ("stage", "trial_index", "method", "seed", "epoch", "score", "split", "label") if c in frame]
    frame = frame.sort_values(keys).reset_index(drop=True)
    configs = [{k: v for k, v in json.loads(text).items() if k not in PATHS} for text in frame.config_json] if "config_json" in frame else []
    return frame.drop(columns=[c for c in UNREPEATABLE if c in frame]), configs


def test_the_sweep_json_given_back_as_config_reproduces_the_sweep_s_rows(sweep, tmp_path):
    again = tmp_path / "again"
    assert main("digits", "digits", DIGITS, ["--config", str(sweep / "sweep.json"), "--results-dir", str(again)]) == 0
    for name in ("trials", "epochs", "evals"):
        (first, first_configs), (second, second_configs) = rows(sweep, name), rows(again, name)
        assert len(first) > 0
        pd.testing.assert_frame_equal(first, second, obj=f"{name}.parquet")
        assert first_configs == second_configs
