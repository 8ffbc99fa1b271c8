"""Resuming a sweep: the digits sweep script run as a user runs it, stopped with Ctrl-C or
``kill -9`` at chosen instants (tests/sweep/interrupted_sweep.py), moved or copied, or out of disk
space, then resumed -- each time to exactly the rows of one uninterrupted run of the same sweep,
with nothing lost or repeated -- and where a finished sweep's time went.

Kept few and small: every sweep costs Ray several seconds on 2 cores.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from same_rows import repeatable_rows, sweep_env

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


# A sweep small enough to run several times: 2 methods x 2 Optuna trials, 1 final seed, 2 epochs.
TINY_SWEEP = ["--methods", "ce,dpsm", "--trials", "2", "--final-seeds", "1", "--base-epochs", "2", "--epochs", "2", "--workers", "0", "--seed", "3"]




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
    (results.parent / "stdout.txt").write_text(run.stdout)
    return results


def test_the_same_command_run_again_shows_the_finished_sweep_and_exits_0(uninterrupted_sweep):
    """Pasting the quick start twice: the second run trains nothing; it prints the finished sweep's
    headline tables as the first run printed them (the same plain table, not the report's Markdown
    or its 200-odd lines) and how to run another, once."""
    from dpsm_ray.results.report import headline

    before = (uninterrupted_sweep / "trials.parquet").read_bytes()
    command = [sys.executable, str(ROOT / "sweeps" / "digits.py"), "--results-dir", str(uninterrupted_sweep), *TINY_SWEEP]
    again = subprocess.run(command, capture_output=True, text=True, env=sweep_env(), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    head = headline(uninterrupted_sweep)
    assert head.startswith("Average prediction set size at alpha = 0.1") and "DPSM vs best baseline" in head
    assert head in (uninterrupted_sweep.parent / "stdout.txt").read_text() and again.stdout.startswith(head)
    assert "## " not in again.stdout and "| method |" not in again.stdout and len(again.stdout.splitlines()) < 20 and again.stdout.count("holds a finished sweep") == 1
    assert "holds a finished sweep" in again.stdout and "new --results-dir" in again.stdout and " done in " not in again.stdout
    assert (uninterrupted_sweep / "trials.parquet").read_bytes() == before


def test_after_a_finished_sweep_other_options_are_refused_and_another_dataset_runs_its_own_sweep(uninterrupted_sweep, tmp_path):
    """The quick start, then the README's own-data line without --results-dir: the default
    directory follows the dataset, so the table's sweep runs (it does not answer with the digits
    table); the quick start's command with another option is refused in one line, exit 2, before
    Ray starts, naming the setting and the ways out."""
    import shutil

    from sklearn.datasets import load_breast_cancer

    shutil.copytree(uninterrupted_sweep, tmp_path / "results" / "digits-ce-dpsm")  # TINY_SWEEP's methods name its default directory
    script = str(ROOT / "sweeps" / "digits.py")
    other = subprocess.run([sys.executable, script, *TINY_SWEEP, "--trials", "3"], cwd=tmp_path, capture_output=True, text=True,
                           env=sweep_env(), timeout=120)
    assert other.returncode == 2 and other.stdout == "", other.stdout + other.stderr
    assert len(other.stderr.strip().splitlines()) == 1 and "--trials: 2 there, 3 here" in other.stderr and "new --results-dir" in other.stderr
    frame = load_breast_cancer(as_frame=True).frame.rename(columns={"target": "diagnosis"})
    frame.to_csv(tmp_path / "breast_cancer.csv", index=False)
    # the fair budget, as a user asks for it: one trial per knob (CE has 1, DPSM 4)
    small = [*TINY_SWEEP[:2], "--trials-per-knob", "1", "--final-seeds", "1", "--base-epochs", "1", "--epochs", "1", "--workers", "0"]
    own = subprocess.run([sys.executable, script, "--dataset", "table:breast_cancer.csv:label=diagnosis", *small], cwd=tmp_path,
                         capture_output=True, text=True, env=sweep_env(), timeout=600)
    assert own.returncode == 0, own.stdout + own.stderr
    assert "holds a finished sweep" not in own.stdout and " done in " in own.stdout
    table = pd.read_parquet(tmp_path / "results" / "table-breast_cancer-ce-dpsm" / "trials.parquet")
    assert set(table.dataset) == {f"table:{tmp_path / 'breast_cancer.csv'}:label=diagnosis"}
    assert table[table.stage == "search"].groupby("method").size().to_dict() == {"ce": 1, "dpsm": 4}
    # the default sampler (sobol-tpe) starts every method from the sweep's Sobol points: CE's lr is DPSM's first one
    search = table[table.stage == "search"].sort_values("trial_index")
    assert search[search.method == "ce"].lr.tolist() == search[search.method == "dpsm"].lr.tolist()[:1]
    assert "search: Sobol-started Optuna TPE trials, 1 per knob of each method (ce 1, dpsm 4)" in own.stdout


def test_each_trial_records_where_its_time_went_and_an_experiment_s_trials_share_one_process(uninterrupted_sweep, tmp_path):
    """Issue 26: the trial's own timestamps and seconds per part in its record, the driver's in
    finished.json; the in-process trials of the sweep's one Tune experiment -- every method's
    search, then the final stage -- run one after another in one process."""
    from dpsm_ray.storage.layout import Ledger

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
# sends its last report; and with SIGTERM (`kill`, a scheduler's preemption) during a search trial.
INTERRUPTIONS = ["search:search-ce:2", "term:search:search-dpsm:1", "between:final", "finishing:final:1"]


def test_an_interrupted_sweep_resumes_to_the_rows_of_an_uninterrupted_one(uninterrupted_sweep, tmp_path):
    """Each Ctrl-C or SIGTERM stops the sweep (exit 3, saying how to resume) and the next run resumes it
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
# resuming the last: its k-th file write half done (sweep.json; a stage's Parquet files and
# manifest; a figure; report.md -- a resumed run counts its own writes), while the Ray task that
# trains the base model runs (it dies with the driver's job; the next one resumes its checkpoint),
# right after a trial's record and before Optuna hears of it, right after Optuna is told (as the
# "done" line prints), and in the middle of proposing a trial.  Issue 21: a
# kill as a trial finished left Optuna and Tune disagreeing for ever.  (`interrupted_sweep.py
# trace-writes` lists a run's writes.)
KILLS = [
    "kill-write:1", "kill-base-model", "kill-recorded:search-ce:1", "kill-told:search-ce:2", "kill-asked:search-dpsm:2",
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
    assert "kill-base-model" in killed, outcomes  # the driver died while its base model's task trained
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
