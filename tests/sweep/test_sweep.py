"""End-to-end sweeps on digits through Ray Tune + Optuna (+ Ray Train): the Parquet files, the
coverage constraint on the Optuna trials, the report, failed trials, and resuming after Ctrl-C.

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

from dpsm_ray.results.schema import CLASSES, EPOCHS, EVALS, TRIALS, arrow_schema
from dpsm_ray.sweep.protocol import SweepError, SweepSpec, run_sweep
from dpsm_ray.sweep.spec import SweepFinished
from dpsm_ray.train.config import TrainConfig

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
    _, results, _ = finished_sweep
    evals = assert_schema(results / "evals.parquet", EVALS)
    assert set(evals.stage) == {"final"}  # test data only for the final models
    assert len(evals) == 3 * 2 * 3 * 4  # methods (and the base models) x seeds x scores x re-splits
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
    assert all(m[3] for m in counted[:-1]) and not counted[-1][3]  # an estimate until the last one
    assert any(re.search(r"search-dpsm 2/2  done in (\d+m)?\d+s  val size", line) for line in lines)
    # the base models' epochs: "trained in" after each, no line per epoch
    assert sum("base model: trained in" in line for line in lines) == 2 and not any("[ce] epoch" in line for line in lines)


def test_report_table_and_figures(finished_sweep):
    _, results, lines = finished_sweep
    printed = "\n".join(lines)
    assert "DPSM vs best baseline" in printed
    report = (results / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith(("| CE | ", "| DPSM | "))]
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
    with pytest.raises(SweepError, match="different settings .*trials"):
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


# A sweep small enough to run several times: 2 methods x 2 Optuna trials, 1 final seed, 2 epochs.
TINY_SWEEP = ["--methods", "ce,dpsm", "--trials", "2", "--final-seeds", "1", "--base-epochs", "2", "--epochs", "2", "--workers", "0", "--seed", "3"]
# What may differ between two runs of one sweep: Tune's random trial ids and the clock.
UNREPEATABLE = ["trial_id", "wall_seconds", "epoch_seconds"]


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


@pytest.fixture(scope="module")
def uninterrupted_sweep(ray_session, tmp_path_factory) -> Path:
    results = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    command = [sys.executable, str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(results), *TINY_SWEEP]
    run = subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    # attached to a running Ray (RAY_ADDRESS), the trials' own output stays out of the terminal:
    # one line per trial, no forwarded "(run_trial pid=...)" epoch or checkpoint lines
    assert not re.search(r"\(\w+ pid=\d+", run.stdout + run.stderr), run.stdout + run.stderr
    assert sum(" done in " in line for line in run.stdout.splitlines()) == 2 * 2 + 2 + 1  # the base model too
    return results


def test_the_same_command_run_again_shows_the_finished_sweep_and_exits_0(uninterrupted_sweep):
    """Issue 24: pasting the quick start twice exited 3.  The second run trains nothing: it prints
    the finished sweep's report and how to run another."""
    before = (uninterrupted_sweep / "trials.parquet").read_bytes()
    command = [sys.executable, str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(uninterrupted_sweep), *TINY_SWEEP]
    again = subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (uninterrupted_sweep / "report.md").read_text().rstrip() in again.stdout
    assert "holds a finished sweep" in again.stdout and "new --results-dir" in again.stdout and " done in " not in again.stdout
    assert (uninterrupted_sweep / "trials.parquet").read_bytes() == before


def test_each_trial_records_where_its_time_went_and_an_experiment_s_trials_share_one_process(uninterrupted_sweep, tmp_path):
    """Issue 26: the trial's own timestamps and seconds per part in its record, the driver's in
    finished.json; the in-process trials of the sweep's one Tune experiment -- every method's
    search, then the final stage -- run one after another in one process."""
    from dpsm_ray.sweep.ledger import Ledger

    ledger = Ledger(uninterrupted_sweep)
    stages = {stage: ledger.records(stage) for stage in ("search-ce", "search-dpsm", "final")}
    assert [len(records) for records in stages.values()] == [2, 2, 3]
    for stage, records in stages.items():
        for record in records.values():
            timings = record["timings"]
            order = [timings[k] for k in ("process_started", "import_started", "imported", "launched", "trial_started", "finished", "recorded")]
            # an experiment's first trial: its process starts after the launch; a later one's before it
            first = timings["import_started"] >= timings["launched"] - 0.5
            assert order[:3] == sorted(order[:3]) and order[3:] == sorted(order[3:]) and (order[2] <= order[4])
            parts = timings["seconds"]
            trained = record["config"]["epochs"] > 0
            expected = {"load_data", "build", "report", "train", "evaluate"} if trained else {"load_data", "build"}
            assert expected | ({"final_evaluation"} if stage == "final" else set()) == set(parts) - {"base_model"}, parts
            assert all(seconds > 0 for seconds in parts.values())
            assert not first or timings["process_started"] >= timings["launched"] - 0.5
    # one process for the whole experiment: every trial after the first reused it
    processes = {record["timings"]["import_started"] for records in stages.values() for record in records.values()}
    assert len(processes) == 1, processes
    seconds = json.loads((uninterrupted_sweep / "finished.json").read_text())["seconds"]
    assert {"ray_start", "base_model", "stages", "collect", "pick", "export", "report"} <= set(seconds) and min(seconds.values()) >= 0
    # the benchmark reads these: every part found, none negative; and it times Ray's and Tune's
    # share of a sweep of this shape (the same trials, each reporting once per epoch, doing nothing else)
    shown = subprocess.run([sys.executable, str(ROOT / "bench" / "sweep_overhead.py"), "--analyse", str(uninterrupted_sweep), "--floor", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300, check=True, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    analysed = json.loads(shown.stdout.splitlines()[0])
    assert analysed["trials"] == 7 and analysed["fresh_processes"] == 1 and analysed["experiments"] == 1
    assert min(analysed["parts"].values()) >= 0 and analysed["parts"]["train"] > 0
    work = analysed["epoch_seconds"] + analysed["final_evaluation_s"]
    floor = analysed["floor"]
    assert floor["trials"] == 7 and floor["reports"] == len(pd.read_parquet(uninterrupted_sweep / "epochs.parquet"))
    assert floor["wall_s"] > 0 and floor["floor_plus_work_over_work"] == round((floor["wall_s"] + work) / work, 2)

def optuna_states(results: Path) -> dict[str, list[str]]:
    import optuna

    studies = json.loads((results / "sweep.json").read_text())["studies"]
    storage = f"sqlite:///{results / 'optuna.db'}"
    return {m: [t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials] for m, name in studies.items()}


def assert_same_rows(results: Path, expected: Path, what: str) -> None:
    """Every Parquet row of ``results`` equals the uninterrupted sweep's; each search trial is once
    in its Optuna study; no temporary file is left."""
    want, got = repeatable_rows(expected), repeatable_rows(results)
    for name in want:
        pd.testing.assert_frame_equal(got[name], want[name], obj=f"{name}.parquet after {what}")
    assert pd.read_parquet(results / "trials.parquet").trial_id.is_unique
    assert optuna_states(results) == {"ce": ["COMPLETE", "COMPLETE"], "dpsm": ["COMPLETE", "COMPLETE"]}
    assert not [p for p in results.rglob("*.tmp") if "tune" not in p.parts], "a temporary file was left"


def finished_trial(line: str) -> tuple[str, int]:
    """``[0:01:02] search-ce 2/2  done in 9s ...`` -> ("search-ce", 1): the stage and trial index."""
    stage, counter = line.split("] ", 1)[1].split()[:2]
    return stage, int(counter.split("/")[0]) - 1


def interrupted(point: str, results: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(Path(__file__).with_name("interrupted_sweep.py")), point, "--results-dir", str(results), *TINY_SWEEP]
    if (results / "sweep.json").exists():
        command.append("--resume")
    return subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=600)


# Instants at which the driver is stopped with Ctrl-C, one after another on the same sweep, each run
# resuming the last: during a search trial, as the final stage is chosen, and as a final trial
# sends its last report.
INTERRUPTIONS = ["search:search-ce:2", "between:final", "finishing:final:1"]


def test_an_interrupted_sweep_resumes_to_the_rows_of_an_uninterrupted_one(uninterrupted_sweep, tmp_path):
    """Each Ctrl-C stops the sweep (exit 3, saying how to resume) and the next run resumes it
    without repeating a trial that had finished; the same seed fixes every row, so the sweep must
    end with exactly the uninterrupted one's rows, with nothing lost or repeated."""
    results = tmp_path / "sweep"
    runs = [(point, interrupted(point, results)) for point in [*INTERRUPTIONS, "none"]]
    done = []
    for point, run in runs:
        expected = 0 if point == "none" else 3  # stopped, not finished and not crashed
        assert run.returncode == expected, f"{point}:\n{run.stdout}{run.stderr}"
        assert point == "none" or "rerun with --resume" in run.stderr, f"{point}:\n{run.stdout}{run.stderr}"
        done.append({finished_trial(line) for line in run.stdout.splitlines() if " done in " in line})
    for (point, _), before, after in zip(runs, done, done[1:]):
        assert not before & after, f"finished before the Ctrl-C at {point} and again after it: {before & after}"
    assert_same_rows(results, uninterrupted_sweep, "Ctrl-C at " + ", ".join(INTERRUPTIONS))
    trials = pd.read_parquet(results / "trials.parquet")
    assert {(f"search-{m}" if s == "search" else s, i) for s, m, i in zip(trials.stage, trials.method, trials.trial_index)} >= set().union(*done)


# Instants at which the driver is killed (kill -9), one after another on the same sweep, each run
# resuming the last: its k-th file write half done (sweep.json; the base model's checkpoint, Parquet
# files and manifest; a stage's Parquet files and manifest; a figure; report.md -- a resumed run
# counts its own writes), right after a trial's record and before Optuna hears of it, right after
# Optuna is told (as the "done" line prints), and in the middle of proposing a trial.  Issue 21: a
# kill as a trial finished left Optuna and Tune disagreeing for ever.  (`interrupted_sweep.py
# trace-writes` lists a run's writes.)
KILLS = [
    "kill-write:1", "kill-write:3", "kill-write:6", "kill-recorded:search-ce:1", "kill-told:search-ce:2", "kill-asked:search-dpsm:2",
    "kill-recorded:search-dpsm:2", "kill-write:12", "kill-recorded:final:1", "kill-write:20", "kill-write:26", "kill-write:32",
]


def test_a_sweep_killed_at_many_instants_resumes_each_time_to_the_rows_of_an_uninterrupted_one(uninterrupted_sweep, tmp_path):
    results = tmp_path / "sweep"
    outcomes = []
    for point in KILLS:
        run = interrupted(point, results)
        assert run.returncode in (0, -signal.SIGKILL), f"{point}:\n{run.stdout}{run.stderr}"
        outcomes.append((point, run.returncode))
    while (run := interrupted("none", results)).returncode != 0:
        raise AssertionError(f"the last resume failed:\n{run.stdout}{run.stderr}")
    killed = [point for point, code in outcomes if code == -signal.SIGKILL]
    assert len(killed) >= 10, outcomes  # the instants were reached, not skipped by a finished sweep
    assert_same_rows(results, uninterrupted_sweep, "kills at " + ", ".join(killed))


def tree_digests(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_moved_or_copied_results_directory_resumes_where_it_is_and_a_copy_leaves_the_original_alone(uninterrupted_sweep, tmp_path):
    """Issue 21: the pickled searcher held the absolute optuna.db URL, so a resumed copy wrote into
    the original's study, and a moved directory (what `ray rsync-down` of an interrupted sweep
    gives) could not be resumed.  Tune's own saved state is never read back either: garbling it
    changes nothing."""
    import shutil

    original = tmp_path / "a" / "sweep"
    first = interrupted("between:final", original)
    assert first.returncode == 3, first.stdout + first.stderr
    for state in (original / "tune").rglob("*.json"):
        state.write_bytes(state.read_bytes()[:50])
    copy = tmp_path / "b" / "sweep"
    shutil.copytree(original, copy)
    before = tree_digests(original)
    resumed = interrupted("none", copy)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_rows(copy, uninterrupted_sweep, "a resumed copy")
    assert tree_digests(original) == before, "resuming the copy changed the original"
    moved = tmp_path / "c" / "sweep"
    moved.parent.mkdir()
    original.rename(moved)
    trials = bytearray((moved / "trials.parquet").read_bytes())
    trials[len(trials) // 2] ^= 1  # and a changed byte in a results file is named, then rebuilt from the records
    (moved / "trials.parquet").write_bytes(bytes(trials))
    resumed = interrupted("none", moved)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"warning: {moved / 'trials.parquet'} does not match the sha256 recorded in {moved / 'manifest.json'}" in resumed.stdout
    assert_same_rows(moved, uninterrupted_sweep, "a moved directory")
    trials = pd.read_parquet(moved / "trials.parquet")
    assert trials.config_json.str.contains(str(moved)).all() and not trials.config_json.str.contains(str(original)).any()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs, which needs root (CI runs as root); test_files.py checks the error's text")
def test_a_full_disk_stops_the_sweep_in_one_line_and_it_resumes_once_there_is_space(uninterrupted_sweep, tmp_path):
    """Issue 21: on a 6 MB file system a sweep printed 9,090 lines with 371 tracebacks and could not
    be resumed once space was back.  The tiny sweep needs ~2.7 MB; 1.2 MB fills during the search."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], check=True)
    try:
        results = mount / "sweep"
        full = interrupted("none", results)
        assert full.returncode == 3, full.stdout + full.stderr
        said = [line for line in full.stderr.strip().splitlines() if not re.match(r"\d{4}-\d\d-\d\d [\d:,]+\s+INFO ", line)]  # Ray's "Connecting to ..."
        assert len(said) == 1, full.stderr[-5000:]
        assert re.search(rf"no space left on the device of {results}/\S+ \([\d.]+ (bytes|KiB|MiB) free\)", said[0]), said[0]
        assert "free some space and rerun with --resume" in said[0]
        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        resumed = interrupted("none", results)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert_same_rows(results, uninterrupted_sweep, "a full disk")
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


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
    assert set(evals.trial_id) == set(final.trial_id) and len(evals) == 3 * 4  # scores x re-splits
    assert evals.coverage.between(0, 1).all() and (evals.set_size >= 0).all()
    classes = assert_schema(tmp_path / "classes.parquet", CLASSES)
    assert len(classes) == len(evals) * 10
    n_test = classes.groupby(["score", "split"]).n_test.sum()
    assert (n_test == evals.set_index(["score", "split"]).n_test.reindex(n_test.index)).all()
    deadline = time.monotonic() + 30  # Ray Train's cleaner looks once a second
    while (left := [g for pg, g in ray.util.placement_group_table().items() if pg not in groups_before and g["state"] != "REMOVED"]) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, left
