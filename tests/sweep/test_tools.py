"""A sweep beside the tools its user already has open: MLflow (a real ``mlflow server`` on
127.0.0.1 with a SQLite backend, started and stopped here), TensorBoard's reader on the event files
Tune writes, optuna-dashboard (served like MLflow, read through its own JSON API), and its
sweep.json given back as --config (docs/tracking.md).

One tiny digits sweep (DPSM only: two Optuna trials, one final seed, 2 epochs, trials in their own
processes) is shared by the module; every trial costs Ray several seconds on 2 cores.
"""

import contextlib
import json
import math
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.sweep.cli import main
from dpsm_ray.train.loop import EPOCH_TIMINGS

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
DIGITS = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))["DEFAULTS"]
TINY = ["--methods", "dpsm", "--trials", "2", "--final-seeds", "1", "--base-epochs", "2", "--epochs", "2", "--workers", "0", "--seed", "3"]
# What differs between two runs of one sweep: Tune's random trial ids, the clock, and the paths
# under each results directory
UNREPEATABLE = ["trial_id", "wall_seconds", *EPOCH_TIMINGS, "config_json"]
PATHS = ("cache_dir", "init_checkpoint")
SERVER_START_S = 240  # mlflow server took 55 s to start on 2 busy cores (its SQLite migrations)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1: runs in a SQLite file, artifacts served from a local folder."""
    home = tmp_path_factory.mktemp("mlflow")
    uri = f"http://127.0.0.1:{free_port()}"
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
               "--artifacts-destination", str(home / "artifacts"), "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1], "--workers", "1"]
    with served(command, f"{uri}/health", home / "server.log"):
        yield uri


@pytest.fixture(scope="module")
def sweep(ray_session, mlflow_server, tmp_path_factory):
    results = tmp_path_factory.mktemp("tools") / "digits"
    assert main("digits", "digits", DIGITS, ["--results-dir", str(results), *TINY, "--tracking", f"mlflow={mlflow_server}"]) == 0
    return results


def rows(results: Path, name: str) -> tuple[pd.DataFrame, list[dict]]:
    """A Parquet file's rows in a fixed order without what may differ, and each row's configuration
    without its paths (compared as values: the JSON of 1.0 and of 1 differ)."""
    frame = pd.read_parquet(results / f"{name}.parquet")
    keys = [c for c in ("stage", "trial_index", "method", "seed", "epoch", "score", "split", "label") if c in frame]
    frame = frame.sort_values(keys).reset_index(drop=True)
    configs = [{k: v for k, v in json.loads(text).items() if k not in PATHS} for text in frame.config_json] if "config_json" in frame else []
    return frame.drop(columns=[c for c in UNREPEATABLE if c in frame]), configs


def test_each_trial_is_an_mlflow_run_with_its_configuration_epochs_evaluations_and_predictor(sweep, mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(str(sweep))  # one experiment per sweep, named after its results directory
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    trials = pd.read_parquet(sweep / "trials.parquet")
    epochs = pd.read_parquet(sweep / "epochs.parquet")
    evals = pd.read_parquet(sweep / "evals.parquet")
    assert len(runs) == len(trials) == 4  # 2 search trials, the final DPSM model and the base model
    for run in runs:
        tags = run.data.tags
        row = trials[trials.trial_id == tags["tune_trial_id"]].iloc[0]
        assert tags["stage"] == ("final" if row.stage == "final" else "search-dpsm") and int(tags["trial_index"]) == row.trial_index
        assert run.info.status == "FINISHED" and tags["parquet_run_id"] == row.run_id
        config = json.loads(row.config_json)
        assert run.data.params["method"] == row.method and math.isclose(float(run.data.params["lr"]), config["lr"])
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_coverage")}
        expected = epochs[epochs.trial_id == row.trial_id].set_index("epoch").val_coverage.to_dict()
        assert history.keys() == expected.keys() and all(math.isclose(history[e], expected[e]) for e in expected)
        assert len(expected) == (0 if row.method == "base" else 2)
        if tags["stage"] == "final":
            for score, part in evals[evals.trial_id == row.trial_id].groupby("score"):
                assert math.isclose(run.data.metrics[f"test_coverage_{score}"], part.coverage.mean())
                assert math.isclose(run.data.metrics[f"test_set_size_{score}"], part.set_size.mean())
            assert {"predictor/predictor.json", "predictor/weights.pt"} <= {a.path for a in client.list_artifacts(run.info.run_id, "predictor")}
        else:
            assert not any(name.startswith("test_") for name in run.data.metrics)  # the search never sees test data


def test_the_sweep_json_given_back_as_config_reproduces_the_sweep_s_rows(sweep, tmp_path):
    """Reproduced without --tracking: tracking is not part of what a sweep computes."""
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
        # a session of its own: mlflow server runs uvicorn and a job runner as its children
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):  # children that outlived it
                os.killpg(server.pid, signal.SIGKILL)
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


def documented_tensorboard_tags() -> list[str]:
    text = (ROOT / "docs" / "tracking.md").read_text()
    section = text.split("## TensorBoard", 1)[1].split("\n## ", 1)[0]
    return sorted(set(re.findall(r"`(ray/tune/[a-z_]+)`", section)))


def test_the_tensorboard_tags_the_docs_name_are_in_each_trained_trial_s_event_files(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = documented_tensorboard_tags()
    assert len(tags) >= 8 and "ray/tune/val_coverage" in tags
    epochs = pd.read_parquet(sweep / "epochs.parquet")
    trained = pd.read_parquet(sweep / "trials.parquet").query("method != 'base'")
    for trial_id in trained.trial_id:
        (trial_dir,) = (sweep / "tune").glob(f"*/trial_*_{trial_id}")
        events = EventAccumulator(str(trial_dir))
        events.Reload()
        assert set(tags) <= set(events.Tags()["scalars"]), f"{trial_dir}: {sorted(set(tags) - set(events.Tags()['scalars']))}"
        logged = {event.step: event.value for event in events.Scalars("ray/tune/val_coverage")}
        rows = epochs[epochs.trial_id == trial_id]
        assert len(rows) == 2 and all(math.isclose(logged[row.epoch], row.val_coverage, rel_tol=1e-6) for row in rows.itertuples())
