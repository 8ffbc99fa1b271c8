"""Trial groups in a sweep (``--group-size``): which trials the searcher groups, the option's checks,
and the digits sweep script with a paper grid of three points (one of them diverging) and two final
seeds run as a user runs it -- one configuration a trial, in groups, and in groups killed mid-group
and resumed -- each time to the same rows.

Kept few and small: every sweep costs Ray several seconds on 2 cores.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.config import ConfigError, TrainConfig
from dpsm_ray.storage.layout import Ledger
from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.sweep.stage import Stage, StageSearcher
from same_rows import repeatable_rows, sweep_env

ROOT = Path(__file__).resolve().parents[2]
# the paper grid of CE at lr 0.01, 0.05 and 100 (which diverges in its second epoch), then the pick
# re-trained with seeds 3 and 4: with --group-size 3 one trial trains the three grid points, one the two seeds
GRID = ["--methods", "ce", "--grid", "paper", "--subset", "lr=0.01,0.05,100", "--fix", "batch_size=64", "--fix", "epochs=2", "--fix",
        "milestones=25", "--fix", "lr_decay=0.1", "--final-seeds", "2", "--init", "scratch", "--train-subset", "256", "--workers", "0",
        "--seed", "3", "--trial-retries", "0"]
# what may differ between two runs of one sweep: Tune's trial ids and the clock


# --- which trials are grouped (no Ray) ----------------------------------------------------------

def points_of(params: dict) -> list[tuple[str, int]]:
    return [(point["stage"], point["index"]) for point in params.get("group", [params["point"]])]


def test_the_searcher_groups_given_points_where_no_early_stopping_is_asked():
    """Groups of up to three from the grid (its ended trial left out) running on into the final
    stage; a stage with ASHA keeps one configuration a trial; each trial carries the settings of
    every stage it trains; with groups of 1 a trial's parameters are what they were before groups."""
    base = TrainConfig(dataset="digits", method="ce", workers=0)
    grid = Stage("search-ce", base, 5, ("lr",), points=[{"lr": lr} for lr in (0.001, 0.005, 0.01, 0.05, 0.1)])
    asha = Stage("search-cut", base.replace(method="cut"), 2, ("lr",), points=[{"lr": 0.01}, {"lr": 0.1}], asha=(1, 2))
    final = Stage("final", base.replace(evaluate_test=True), 4, ("seed",), points=[{"seed": seed} for seed in range(4)])
    assert grid.groups and final.groups and not asha.groups
    assert not Stage("final", base.replace(workers=1), 1, (), points=[{}]).groups  # Ray Train trials are one configuration each

    searcher = StageSearcher([(grid, {1: {"status": "ok"}}), (asha, {}), (final, {})], group_size=3, retries=2)
    suggested = [searcher.suggest(f"t{i}") for i in range(6)]
    assert [points_of(p) for p in suggested] == [
        [("search-ce", 0), ("search-ce", 2), ("search-ce", 3)], [("search-ce", 4)], [("search-cut", 0)], [("search-cut", 1)],
        [("final", 0), ("final", 1), ("final", 2)], [("final", 3)]]
    assert suggested[0]["retries"] == 2 and "group" not in suggested[1] and "retries" not in suggested[1]
    assert searcher.suggest("t6") == StageSearcher.FINISHED

    across = StageSearcher([(Stage("search-ce", base, 2, ("lr",), points=[{"lr": 0.01}, {"lr": 0.1}]), {}), (final, {})], group_size=3)
    first = across.suggest("t0")
    assert points_of(first) == [("search-ce", 0), ("search-ce", 1), ("final", 0)] and set(first["bases"]) == {"search-ce", "final"}
    assert first["point"] == first["group"][0] and first["bases"]["final"]["evaluate_test"] is True

    single = StageSearcher([(grid, {}), (final, {})])
    assert single.suggest("t0") == {"bases": {"search-ce": base.to_dict()}, "point": {"stage": "search-ce", "index": 0, "overrides": {"lr": 0.001}}}


def test_a_group_size_below_1_or_beside_tracking_is_refused_in_one_line(capsys):
    from dpsm_ray.sweep.cli import main

    base = TrainConfig(dataset="digits")
    with pytest.raises(ConfigError, match="group_size=0 is invalid: must be an integer >= 1"):
        SweepSpec(name="s", base=base, methods=("ce",), group_size=0)
    with pytest.raises(ConfigError, match="must be 1 with --tracking"):
        SweepSpec(name="s", base=base, methods=("ce",), group_size=2, tracking="mlflow")
    assert SweepSpec(name="s", base=base, methods=("ce",), group_size=4).describe() == SweepSpec(name="s", base=base, methods=("ce",)).describe()
    with pytest.raises(SystemExit) as stopped:
        main("digits", "digits", {"trials": 1, "final_seeds": 1, "config": {"dataset": "digits"}}, ["--group-size", "0", "--results-dir", "x"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == "sweeps/digits.py: error: --group-size=0 is invalid: must be an integer >= 1"


def test_a_sweep_script_may_set_its_default_group_size():
    import argparse

    from dpsm_ray.sweep.cli import add_running_options

    for defaults, argv, size in (({}, [], 1), ({"group_size": 4}, [], 4), ({"group_size": 4}, ["--group-size", "2"], 2)):
        parser = argparse.ArgumentParser()
        add_running_options(parser, defaults)
        assert parser.parse_args(argv).group_size == size


# --- the digits sweep, grouped and not ------------------------------------------------------------


def sweep(results: Path, *options: str, script=None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(script or ROOT / "sweeps" / "digits.py"), "--results-dir", str(results), *GRID, *options]
    return subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=900)



def assert_same_rows(results: Path, expected: Path, what: str) -> None:
    want, got = repeatable_rows(expected), repeatable_rows(results)
    for name in want:
        pd.testing.assert_frame_equal(got[name], want[name], obj=f"{name}.parquet {what}")
    assert pd.read_parquet(results / "trials.parquet").trial_id.is_unique


@pytest.fixture(scope="module")
def lone_sweep(ray_session, tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("lone") / "sweep"
    run = sweep(results)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "trial groups" not in run.stdout
    trials = pd.read_parquet(results / "trials.parquet")
    assert list(trials.status) == ["ok", "ok", "failed", "ok", "ok"] and "DivergedError: training loss is nan" in trials.error[2]
    return results


@pytest.mark.ray
def test_a_grouped_sweep_writes_the_rows_of_one_configuration_a_trial(lone_sweep, tmp_path):
    results = tmp_path / "sweep"
    run = sweep(results, "--group-size", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "trial groups: up to 3 configurations a trial, side by side in its process and resources, in the grid searches and the final stage" \
           in run.stdout
    assert "search-ce 3/3  FAILED: dpsm_ray.train.loop.DivergedError: training loss is nan in epoch 2" in run.stdout
    assert_same_rows(results, lone_sweep, "of a grouped sweep")
    # one Tune trial (one process) for the grid's three points, one for the two final seeds
    trials = pd.read_parquet(results / "trials.parquet")
    groups = trials.trial_id.str.rsplit("_m", n=1).str[0]
    assert list(trials.trial_id.str.rsplit("_m", n=1).str[1]) == ["0", "1", "2", "0", "1"] and groups.nunique() == 2
    ledger = Ledger(results)
    started = {(stage, index): ledger.records(stage)[index]["timings"]["trial_started"] for stage, index in
               [("search-ce", 0), ("search-ce", 1), ("search-ce", 2), ("final", 0), ("final", 1)]}
    assert len(set(started.values())) == 2


KILL_MID_GROUP = """
import os, runpy, signal, sys
from dpsm_ray.sweep import stage
from dpsm_ray.train.ray_train import FINISHED, RESUMED

on_result = stage.LedgerCallback.on_trial_result


def hooked(self, iteration, trials, trial, result, **info):
    # kill -9 as the driver hears that the grid's second point has trained its first epoch
    if (result.get("trial_stage"), result.get("trial_index"), result.get("epoch")) == ("search-ce", 1, 1) and not (
            result.get(FINISHED) or result.get(RESUMED)):
        os.kill(os.getpid(), signal.SIGKILL)
    return on_result(self, iteration, trials, trial, result, **info)


stage.LedgerCallback.on_trial_result = hooked
digits = runpy.run_path(sys.argv.pop(1))
sys.exit(digits["main"]("digits", "digits sweep, killed mid-group", digits["DEFAULTS"], sys.argv[1:]))
"""


@pytest.mark.ray
def test_a_sweep_killed_mid_group_resumes_every_member_from_its_own_checkpoint(lone_sweep, tmp_path):
    script = tmp_path / "killed_mid_group.py"
    script.write_text(KILL_MID_GROUP)
    results = tmp_path / "sweep"
    command = [sys.executable, str(script), str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(results), *GRID, "--group-size", "3"]
    killed = subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    ledger = Ledger(results)
    assert ledger.records("search-ce") == {}  # no member had ended
    first_epochs = {i: ledger.epochs("search-ce", i)[0] for i in (0, 1)}  # each had checkpointed its first epoch
    resumed = sweep(results, "--group-size", "3", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ended = {line.split("] ", 1)[1].split("  ")[0]: line for line in resumed.stdout.splitlines() if " done in " in line or "FAILED" in line}
    assert sorted(ended) == ["final 1/2", "final 2/2", "search-ce 1/3", "search-ce 2/3", "search-ce 3/3"], resumed.stdout
    assert "FAILED" in ended["search-ce 3/3"]
    assert_same_rows(results, lone_sweep, "after a kill mid-group and --resume")
    # members 0 and 1 went on from their checkpoints: the epoch rows they had written stand, clock and all
    for i, row in first_epochs.items():
        assert ledger.epochs("search-ce", i)[0] == row, f"member {i} trained its first epoch again"
    assert json.loads((results / "finished.json").read_text())["trials"] == 5
