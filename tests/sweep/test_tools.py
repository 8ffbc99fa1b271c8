"""A sweep beside the tools its user already has open: its sweep.json given back as --config, and
its Optuna studies in optuna-dashboard (the real program, served on 127.0.0.1 by the test).

One tiny digits sweep (DPSM only: two Optuna trials, one final seed, 2 epochs, trials in their own
processes) is shared by the module; every trial costs Ray several seconds on 2 cores.
"""

import contextlib
import json
import math
import runpy
import socket
import subprocess
import sys
import time
import urllib.request
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
SERVER_START_S = 120  # a server's start on 2 busy cores


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def served(command: list[str], ready_url: str, log: Path):
    """Run a server program until the block ends (it is stopped, then killed if it lingers);
    entered once ``ready_url`` answers."""
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + SERVER_START_S
            while True:
                if server.poll() is not None:
                    raise AssertionError(f"{command[0]} exited with {server.returncode}: {log.read_text()[-2000:]}")
                try:
                    urllib.request.urlopen(ready_url, timeout=5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{command[0]} did not answer {ready_url} within {SERVER_START_S}s: {log.read_text()[-2000:]}") from None
                    time.sleep(0.5)
            yield
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_optuna_dashboard_shows_each_trial_s_coverage_constraint_and_its_parquet_keys(sweep, tmp_path):
    """What optuna-dashboard's own JSON API serves for the sweep's study: every trial's constraint
    (floor - validation coverage, feasible when <= 0) and the user attributes that join it to
    trials.parquet."""
    settings = json.loads((sweep / "sweep.json").read_text())
    floor = 1 - settings["base"]["alpha"] - settings["coverage_slack"]
    search = pd.read_parquet(sweep / "trials.parquet").query("stage == 'search'").set_index("trial_index")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    dashboard = str(Path(sys.executable).parent / "optuna-dashboard")
    with served([dashboard, f"sqlite:///{sweep / 'optuna.db'}", "--host", "127.0.0.1", "--port", str(port)], f"{api}/meta", tmp_path / "dashboard.log"):
        studies = {s["study_name"]: s["study_id"] for s in get_json(f"{api}/studies")["study_summaries"]}
        assert set(studies) == {settings["studies"]["dpsm"]}
        trials = get_json(f"{api}/studies/{studies[settings['studies']['dpsm']]}")["trials"]
    assert len(trials) == len(search) == 2
    for trial in trials:
        row = search.loc[trial["number"]]
        assert len(trial["constraints"]) == 1 and math.isclose(trial["constraints"][0], floor - row.val_coverage)
        assert (trial["constraints"][0] <= 0) == row.feasible
        attributes = {a["key"]: a["value"] for a in trial["user_attrs"]}
        assert attributes["run_id"] == row.run_id and attributes["tune_trial_id"] == row.trial_id
        assert math.isclose(float(attributes["val_coverage"]), row.val_coverage) and math.isclose(float(attributes["val_set_size"]), row.val_set_size)
