"""End-to-end sweeps on digits through Ray Tune + Optuna (+ Ray Train): the Parquet files, the
coverage constraint on the Optuna trials, the report, failed and early-stopped trials, and a sweep
beside another process's Ray (resuming: tests/sweep/test_resume.py).

Kept few and small: every trial costs Ray several seconds on 2 cores.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from dpsm_ray.storage.schema import CLASSES, EPOCHS, EVALS, TRIALS, arrow_schema
from dpsm_ray.sweep.driver import SweepError, SweepSpec, run_sweep
from dpsm_ray.sweep.spec import SweepFinished
from dpsm_ray.config import TrainConfig

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_base(**overrides) -> TrainConfig:
    values = dict(dataset="digits", init="base", base_epochs=3, epochs=3, batch_size=64, val_splits=3, eval_splits=4)
    return TrainConfig(**{**values, **overrides})


def assert_schema(path: Path, schema) -> pd.DataFrame:
    expected = arrow_schema(schema)
    assert pq.read_schema(path).remove_metadata().equals(expected), pq.read_schema(path)
    return pd.read_parquet(path)


@pytest.fixture(scope="module")
def finished_sweep(ray_session, tmp_path_factory):
    """Two methods, two Optuna trials each, two final seeds; each trial trains in its own process
    (``--workers 0``, every sweep script's default).  The same files from TorchTrainer trials:
    test_asha_stops_a_poor_trial_early_records_it_and_frees_its_workers[TorchTrainer trials]."""
    results = tmp_path_factory.mktemp("sweep")
    spec = SweepSpec(
        name="tiny", base=tiny_base(workers=0), methods=("ce", "dpsm"), trials=2, final_seeds=2, coverage_slack=0.03, seed=0,
    )
    lines = []
    run_sweep(spec, results, log=lines.append)
    return spec, results, lines


def test_every_final_seeds_base_model_trains_before_the_search(finished_sweep):
    """From inside the Tune experiment (the final stage), their Ray tasks would wait for the CPUs its
    idle, reused trial processes hold: on 2 CPUs with 2 trials at once, for ever (the league on
    Fashion-MNIST, 2026-11-29)."""
    _, _, lines = finished_sweep
    said = [re.sub(r"^\[[\d:]+\] ", "", str(line)) for line in lines]  # without the clock
    first_search = next(i for i, line in enumerate(said) if line.startswith("search"))
    assert any(line.startswith("base models: training 2 (seeds 0, 1)") for line in said[:first_search]), said[:first_search]
    later = [line for line in said[first_search:] if line.startswith("base model")]
    assert later and all("cache hit" in line for line in later), later  # the final stage finds them all cached


def test_trials_parquet(finished_sweep):
    spec, results, _ = finished_sweep
    trials = assert_schema(results / "trials.parquet", TRIALS)
    assert len(trials) == 2 * 2 + 2 * 2 + 2 and trials.trial_id.is_unique
    search, final = trials[trials.stage == "search"], trials[trials.stage == "final"]
    assert search.groupby("method").size().to_dict() == {"ce": 2, "dpsm": 2}
    # each seed's CE base model is evaluated as it is, beside the fine-tuned methods: the paper's CE column
    assert sorted(zip(final.method, final.seed)) == [("base", 0), ("base", 1), ("ce", 0), ("ce", 1), ("dpsm", 0), ("dpsm", 1)]
    assert (trials.status == "ok").all() and trials.error.isna().all()
    # where each trained: the CPU, holding no GPU (tests/test_gpu_shaped.py: with GPU shares)
    assert (trials.device == "cpu").all() and trials.gpu_ids.isna().all()
    trained, base = trials[trials.method != "base"], trials[trials.method == "base"]
    assert (trained.feasible == (trained.val_coverage >= spec.coverage_floor)).all()
    assert (trained.epochs_completed == 3).all() and (base.epochs_completed == 0).all() and (trials.wall_seconds > 0).all()
    for row in trials.itertuples():  # the stored config is the one that ran, knobs included
        config = json.loads(row.config_json)
        assert config["method"] == row.method and config["seed"] == row.seed
        assert math.isclose(config["lr"], row.lr) and row.lr_schedule == config["lr_schedule"]
        assert config["evaluate_test"] == (row.stage == "final")  # the search never touches test data
        # a knob the method reads is the one that ran; one it does not read is null (CE's lambda)
        assert pd.isna(row.conformal_weight) if row.method in ("ce", "base") else math.isclose(config["conformal_weight"], row.conformal_weight)
        if row.method == "dpsm":
            assert (row.q_init, row.dpsm_split) == (config["q_init"], config["dpsm_split"])
        else:
            assert pd.isna(row.q_init) and pd.isna(row.dpsm_split)
        assert pd.isna(row.conftr_split) and pd.isna(row.cut_score)  # ConfTr's and CUT's, and neither ran
    dpsm_search = search[search.method == "dpsm"]
    assert dpsm_search.quantile_lr.nunique() == 2  # Optuna really sampled gamma
    # the final stage re-trains each method's chosen configuration
    for method, rows in final[final.method != "base"].groupby("method"):
        ok = search[(search.method == method)]
        chosen = ok[ok.feasible].sort_values("val_set_size").iloc[0] if ok.feasible.any() else ok.sort_values("val_coverage").iloc[-1]
        assert (rows.lr == chosen.lr).all()
        assert rows.conformal_weight.isna().all() if method == "ce" else (rows.conformal_weight == chosen.conformal_weight).all()


def test_epochs_parquet(finished_sweep):
    _, results, _ = finished_sweep
    trials = pd.read_parquet(results / "trials.parquet")
    epochs = assert_schema(results / "epochs.parquet", EPOCHS)
    assert len(epochs) == len(trials[trials.method != "base"]) * 3  # the base models train no epoch
    assert epochs.groupby("trial_id").epoch.apply(list).map(lambda e: e == [1, 2, 3]).all()
    dpsm, ce = epochs[epochs.method == "dpsm"], epochs[epochs.method == "ce"]
    assert dpsm.q.notna().all() and (dpsm.q_error - (dpsm.q - dpsm.q_dataset).abs()).abs().max() < 1e-6
    assert ce.q.isna().all() and ce.q_dataset.notna().all()
    assert epochs.val_coverage.between(0, 1).all() and (epochs.upper_loss > 0).all()


def test_evals_parquet(finished_sweep):
    spec, results, _ = finished_sweep
    evals = assert_schema(results / "evals.parquet", EVALS)
    assert set(evals.stage) == {"final"}  # test data only for the final models
    scores = len(spec.base.eval_scores)
    assert len(evals) == 3 * 2 * scores * 4  # methods (and the base models) x seeds x scores x re-splits
    assert evals.groupby(["method", "seed", "score"]).split.apply(sorted).map(lambda s: s == [0, 1, 2, 3]).all()
    assert evals.coverage.between(0, 1).all() and (evals.set_size >= 0).all()
    assert (evals.n_cal + evals.n_test).nunique() == 1


def test_classes_parquet_holds_each_final_model_s_class_coverage(finished_sweep):
    _, results, _ = finished_sweep
    classes = assert_schema(results / "classes.parquet", CLASSES)
    evals = pd.read_parquet(results / "evals.parquet")
    assert set(classes.stage) == {"final"} and set(classes.trial_id) == set(evals.trial_id)
    # digits: 10 classes per final model, score and re-split; the class counts add up to the test part
    assert len(classes) == len(evals) * 10
    n_test = classes.groupby(["trial_id", "score", "split"]).n_test.sum()
    assert (n_test == evals.set_index(["trial_id", "score", "split"]).n_test.reindex(n_test.index)).all()
    covered = (classes.coverage * classes.n_test).groupby([classes.trial_id, classes.score, classes.split]).sum() / n_test
    assert (covered - evals.set_index(["trial_id", "score", "split"]).coverage.reindex(covered.index)).abs().max() < 1e-12


def test_each_method_s_optuna_study_is_in_a_database_with_its_trials_values_and_constraint(finished_sweep):
    """The study Optuna's TPE sampled from, as optuna-dashboard or a notebook loads it."""
    import optuna

    from dpsm_ray.sweep.spec import optuna_storage_url

    spec, results, _ = finished_sweep
    assert optuna_storage_url(spec, results) == f"sqlite:///{results / 'optuna.db'}"
    trials = pd.read_parquet(results / "trials.parquet")
    for method in ("ce", "dpsm"):
        study = optuna.load_study(study_name=f"{results.name}-{method}", storage=optuna_storage_url(spec, results))
        assert len(study.trials) == 2
        rows = trials[(trials.stage == "search") & (trials.method == method)].set_index("trial_index")
        for optuna_trial in study.trials:  # Optuna numbers trials in the order it proposed them
            row = rows.loc[optuna_trial.number]
            params = {name.split("/")[-1]: value for name, value in optuna_trial.params.items()}  # "overrides/lr"
            assert math.isclose(params["lr"], row.lr)
            assert optuna_trial.state.name == "COMPLETE"
            assert math.isclose(optuna_trial.value, row.val_set_size)
            assert math.isclose(optuna_trial.constraints["0"], spec.coverage_floor - row.val_coverage)
            assert (optuna_trial.constraints["0"] <= 0) == row.feasible


def test_progress_lines_are_stamped_and_count_every_trial_of_every_stage(finished_sweep):
    spec, _, lines = finished_sweep
    stamp = re.compile(r"^\[\d+:\d\d:\d\d\] ")
    assert all(stamp.match(line) for line in lines if "\n" not in line), [line for line in lines if not stamp.match(line)]
    # 2 methods x 2 trials, then 2 methods x 2 seeds and the 2 seeds' base models: 10 trials
    counted = [re.search(r"\| trial (\d+)/(\d+)(, about \S+ left)?$", line) for line in lines if " done in " in line]
    assert [(int(m[1]), int(m[2])) for m in counted] == [(k, 10) for k in range(1, 11)]
    # an estimate from the second trial's end (the first one's wait for Ray and the base model would
    # drive it) until the last
    assert not counted[0][3] and all(m[3] for m in counted[1:-1]) and not counted[-1][3]
    assert any(re.search(r"search-dpsm 2/2  done in (\d+m)?\d+s  val size", line) for line in lines)
    # the base models' epochs: "trained in" after each, no line per epoch
    assert sum("base model: trained in" in line for line in lines) == 2 and not any("[ce] epoch" in line for line in lines)


def test_report_table_and_figures(finished_sweep):
    _, results, lines = finished_sweep
    printed = "\n".join(lines)
    assert "DPSM vs best baseline" in printed
    report = (results / "report.md").read_text()
    table = [line for line in report.split("\n## ")[0].splitlines() if line.startswith(("| CE | ", "| DPSM | "))]  # the first table
    assert len(table) >= 2 and all("±" in line for line in table)
    change = [line for line in report.splitlines() if line.startswith("| DPSM vs best baseline |")]
    assert len(change) == 1 and change[0].count("%") == 3
    for name in ("coverage_box", "apss_box", "losses", "q_error"):
        assert (results / "figures" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert f"figures/{name}.png" in report
    # the CLI rebuilds the same report from the directory alone
    out = subprocess.run([sys.executable, "-m", "dpsm_ray.cli", "report", str(results)], capture_output=True, text=True, check=True).stdout
    assert "DPSM vs best baseline" in out


def test_rerun_needs_resume_and_a_resumed_finished_sweep_adds_nothing(finished_sweep):
    spec, results, _ = finished_sweep
    before = {name: pd.read_parquet(results / f"{name}.parquet") for name in ("trials", "epochs", "evals")}
    assert json.loads((results / "finished.json").read_text())["trials"] == 2 * spec.trials + 3 * spec.final_seeds
    with pytest.raises(SweepFinished, match="holds a finished sweep; choose another --results-dir"):
        run_sweep(spec, results, log=lambda line: None)
    (results / "finished.json").unlink()  # as if the driver had been killed just before its last write
    with pytest.raises(SweepError, match="already holds a sweep that has not finished; pass --resume"):
        run_sweep(spec, results, log=lambda line: None)
    with pytest.raises(SweepError, match="different settings .*--trials: 2 there, 3 here"):
        run_sweep(SweepSpec(**{**spec.__dict__, "trials": 3}), results, resume=True, log=lambda line: None)
    run_sweep(spec, results, resume=True, log=lambda line: None)
    for name, frame in before.items():
        pd.testing.assert_frame_equal(pd.read_parquet(results / f"{name}.parquet"), frame)


def test_a_diverging_trial_is_marked_failed_and_the_sweep_goes_on(ray_session, tmp_path):
    """The paper grid with lr in {0.01, 100}: lr 100 blows up (NaN loss), lr 0.01 is chosen."""
    spec = SweepSpec(
        name="grid", base=tiny_base(init="scratch", epochs=2, workers=0), methods=("ce",), final_seeds=1, grid=True,
        grid_fixed=(("batch_size", 64), ("epochs", 2), ("milestones", (25,)), ("lr_decay", 0.1)),
        grid_subsets=(("lr", (0.01, 100.0)),), coverage_slack=0.1,
    )
    lines = []
    run_sweep(spec, tmp_path, log=lines.append)
    assert any("the paper grid has 2 configurations" in line for line in lines)
    trials = pd.read_parquet(tmp_path / "trials.parquet")
    search = trials[trials.stage == "search"].set_index("lr")
    assert search.loc[100.0, "status"] == "failed" and "training loss is" in search.loc[100.0, "error"]
    assert pd.isna(search.loc[100.0, "feasible"])
    assert search.loc[0.01, "status"] == "ok"
    final = trials[trials.stage == "final"]
    assert len(final) == 1 and final.lr.iloc[0] == 0.01 and final.status.iloc[0] == "ok"


def lines_of(process, seen: list[str]) -> threading.Thread:
    """Collect ``process``'s output lines into ``seen`` as they come (a pipe left unread blocks it)."""
    thread = threading.Thread(target=lambda: seen.extend(process.stdout), daemon=True)
    thread.start()
    return thread


def wait_for_line(seen: list[str], needle: str, process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(needle in line for line in list(seen)):
        assert process.poll() is None and time.monotonic() < deadline, f"no {needle!r} line:\n{''.join(seen)}"
        time.sleep(0.2)


def test_a_sweep_outlives_a_training_run_stopped_beside_it(ray_session, tmp_path):
    """Issue 13: each process gets a Ray of its own (neither joins the other's embedded instance,
    nor this test session's), so stopping one leaves the other finishing normally."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONUNBUFFERED": "1"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": env, "cwd": tmp_path}
    train = subprocess.Popen(["dpsm-ray", "train", "--dataset", "digits", "--epochs", "500", "--workers", "2"], **pipes)
    sweep = None
    try:
        train_lines: list[str] = []
        lines_of(train, train_lines)
        wait_for_line(train_lines, "epoch   2/500", train)
        smallest = ["--methods", "ce", "--trials", "1", "--final-seeds", "1", "--base-epochs", "2", "--epochs", "2", "--workers", "0"]
        sweep = subprocess.Popen([sys.executable, str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(tmp_path / "sweep"), *smallest], **pipes)
        sweep_lines: list[str] = []
        reader = lines_of(sweep, sweep_lines)
        wait_for_line(sweep_lines, "] search: ", sweep)  # its Ray is up and the search has begun
        train.send_signal(signal.SIGINT)
        assert train.wait(timeout=120) != 0
        assert sweep.wait(timeout=600) == 0, "".join(sweep_lines)
    finally:  # either one still running when the test failed (its Ray's watchdog ends the rest)
        for process in (train, sweep):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    reader.join(timeout=10)
    assert "sweep finished" in "".join(sweep_lines)
    # a two-worker run no longer prints Ray Train's placement-group cleaner warning every second
    assert not any("Failed to query Ray Train Controller" in line for line in train_lines), "".join(train_lines)


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process trials", "TorchTrainer trials"])
def test_asha_stops_a_poor_trial_early_records_it_and_frees_its_workers(ray_session, tmp_path, workers):
    """lr 1e-5 from scratch is still a random model after one epoch: ASHA (rungs at epochs 1 and
    2, one in two goes on) stops it there.  It is recorded as stopped with its one epoch, the
    finished trial is picked, and a stopped Ray Train run gives back its placement group (Ray
    issue 54305: without the dashboard's state API it leaked and the next trial hung)."""
    import ray

    groups_before = set(ray.util.placement_group_table())
    spec = SweepSpec(
        name="asha", base=tiny_base(init="scratch", epochs=3, workers=workers), methods=("ce",), final_seeds=1, grid=True,
        grid_fixed=(("batch_size", 64), ("epochs", 3), ("milestones", (25,)), ("lr_decay", 0.1)), grid_subsets=(("lr", (0.05, 1e-5)),),
        coverage_slack=0.1, scheduler="asha", grace_period=1, reduction_factor=2, trial_resources=(("cpu", 0.1 if workers else 1.0),),
    )
    lines = []
    run_sweep(spec, tmp_path, log=lines.append)
    trials = assert_schema(tmp_path / "trials.parquet", TRIALS)
    search = trials[trials.stage == "search"].set_index("lr")
    assert search.loc[1e-5, "status"] == "stopped" and search.loc[1e-5, "epochs_completed"] == 1
    assert search.loc[0.05, "status"] == "ok" and search.loc[0.05, "epochs_completed"] == 3
    epochs = assert_schema(tmp_path / "epochs.parquet", EPOCHS)
    assert epochs.groupby("lr").size().to_dict() == {1e-5: 1, 0.05: 3 + 3}  # the stopped trial's epoch; the pick's, searched and re-trained
    assert epochs.groupby("trial_id").epoch.apply(list).map(lambda e: e == [1, 2, 3][:len(e)]).all()
    final = trials[trials.stage == "final"]
    assert final.lr.tolist() == [0.05] and final.status.tolist() == ["ok"]
    # the files either kind of trial writes (the finished_sweep tests read them in detail from
    # in-process trials): the configuration that ran, and the final model's evaluations on every
    # score and re-split, with each class's rows adding up to them
    assert [json.loads(config)["workers"] for config in trials.config_json] == [workers] * len(trials)
    assert (trials.device == "cpu").all() and trials.gpu_ids.isna().all() and trials.trial_id.is_unique
    evals = assert_schema(tmp_path / "evals.parquet", EVALS)
    assert set(evals.trial_id) == set(final.trial_id) and len(evals) == len(spec.base.eval_scores) * 4  # scores x re-splits
    assert evals.coverage.between(0, 1).all() and (evals.set_size >= 0).all()
    classes = assert_schema(tmp_path / "classes.parquet", CLASSES)
    assert len(classes) == len(evals) * 10
    n_test = classes.groupby(["score", "split"]).n_test.sum()
    assert (n_test == evals.set_index(["score", "split"]).n_test.reindex(n_test.index)).all()
    deadline = time.monotonic() + 30  # Ray Train's cleaner looks once a second
    while (left := [g for pg, g in ray.util.placement_group_table().items() if pg not in groups_before and g["state"] != "REMOVED"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left
