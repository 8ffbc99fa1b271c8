"""The sweep's own record, the lock on a results directory, and what is refused before Ray starts
(issue 21: items 3-6 and 10-11, the parts that need no Ray)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsm_ray.storage.layout import Ledger, ResultsInUse, ResultsLock
from dpsm_ray.sweep.spec import SweepError, SweepSpec, check_results_dir, masked, sweep_file
from dpsm_ray.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def spec(**changes) -> SweepSpec:
    return SweepSpec(**{"name": "t", "base": TrainConfig(dataset="digits", epochs=2), "methods": ("ce",), "trials": 2, **changes})


def test_records_keep_paths_inside_the_results_directory_relative_so_it_can_move(tmp_path):
    old, new = tmp_path / "old", tmp_path / "moved"
    config = TrainConfig(dataset="digits", init="base", init_checkpoint=str(old / "base_models" / "x" / "model.pt"), cache_dir=str(old / "base_models"))
    Ledger(old).write_record("search-ce", 3, {"trial_id": "a", "status": "ok", "config": config.to_dict()})
    stored = json.loads((old / "runs" / "search-ce" / "0003" / "record.json").read_text())["payload"]
    assert stored["config"]["init_checkpoint"] == "base_models/x/model.pt" and stored["index"] == 3
    old.rename(new)
    record = Ledger(new).records("search-ce")[3]
    assert record["config"]["init_checkpoint"] == str(new / "base_models" / "x" / "model.pt")
    assert record["config"]["cache_dir"] == str(new / "base_models") and record["status"] == "ok"
    assert Ledger(new).started("search-ce") == [3] and Ledger(new).records("final") == {}


HOLD = """
import sys, time
from pathlib import Path
from dpsm_ray.storage.layout import ResultsLock
lock = ResultsLock(Path(sys.argv[1]))
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_one_live_driver_per_results_directory_and_a_dead_one_is_named(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ResultsInUse, match=rf"in use by another sweep driver \(pid {holder.pid} on .*, since .*\)"):
            ResultsLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = ResultsLock(tmp_path)
    previous = lock.acquire()  # the kernel released a dead holder's lock; its note is still there
    assert previous["pid"] == holder.pid
    lock.release()
    assert ResultsLock(tmp_path).acquire() is None  # a released lock leaves no note


def test_a_second_sweep_on_a_directory_in_use_is_refused_before_ray_starts(tmp_path, no_ray_start):
    """Issue 21: two sweeps started together on one directory shared one study and one experiment."""
    from dpsm_ray.sweep import run_sweep

    lock = ResultsLock(tmp_path)
    lock.acquire()
    try:
        with pytest.raises(SweepError, match=f"is in use by another sweep driver \\(pid {os.getpid()}"):
            run_sweep(spec(), tmp_path, log=lambda line: None)
    finally:
        lock.release()
    assert not (tmp_path / "sweep.json").exists()


def test_a_method_named_twice_is_refused():
    with pytest.raises(ConfigError, match="methods='ce,dpsm,ce' is invalid: must name each method once"):
        spec(methods=("ce", "dpsm", "ce"))


def test_a_storage_url_is_shown_and_stored_without_its_password(tmp_path):
    assert masked("postgresql://sweeper:s3cret@db.internal:5432/optuna") == "postgresql://sweeper:***@db.internal:5432/optuna"
    assert "s3cret" not in masked("postgres ql://sweeper:s3cret@host/db")  # not a URL: only its scheme is shown
    with pytest.raises(ConfigError) as error:
        spec(optuna_storage="not a url:s3cret@x")
    assert "s3cret" not in str(error.value) and "must be a SQLAlchemy database URL" in str(error.value)
    planned = check_results_dir(spec(optuna_storage="sqlite:////tmp/x.db"), tmp_path / "r", resume=False)
    assert planned["optuna_storage"] == "sqlite:////tmp/x.db" and planned["studies"] == {"ce": "r-ce"}


def test_a_resumed_sweep_needs_the_storage_it_was_started_with(tmp_path):
    results = tmp_path / "r"
    results.mkdir()
    (results / "sweep.json").write_text(json.dumps(sweep_file(spec(optuna_storage="postgresql://u:pw@h/db"), results)))
    assert "pw" not in (results / "sweep.json").read_text()
    with pytest.raises(SweepError, match=r"live in postgresql://u:\*\*\*@h/db: pass --optuna-storage with that URL \(or set DPSM_RAY_OPTUNA_STORAGE\)"):
        check_results_dir(spec(), results, resume=True)
    with pytest.raises(SweepError, match=r"--optuna-storage postgresql://u:\*\*\*@other/db is not where"):
        check_results_dir(spec(optuna_storage="postgresql://u:pw@other/db"), results, resume=True)
    other = tmp_path / "s"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps(check_results_dir(spec(), other, resume=False)))
    assert check_results_dir(spec(), other, resume=True)["studies"] == {"ce": "s-ce"}  # the default: optuna.db inside



def test_a_sweep_json_of_an_earlier_release_resumes_and_reports_with_its_knobs_renamed(tmp_path):
    from dpsm_ray.storage.layout import read_sweep
    from dpsm_ray.results.provenance import searched_fields
    from dpsm_ray.sweep.space import Range

    results = tmp_path / "r"
    results.mkdir()
    now = spec(methods=("dpsm",), ranges=(("conformal_weight", Range(0.1, 4.0)), ("quantile_lr", Range(0.001, 0.1))))
    written = sweep_file(now, results)
    assert written["ranges"][0][0] == "conformal_weight"
    # as an earlier release wrote it: the paper's symbols (docs/results.md, "Knob names")
    written["ranges"] = [["lambda", written["ranges"][0][1]], ["gamma", written["ranges"][1][1]]]
    (results / "sweep.json").write_text(json.dumps(written))
    assert check_results_dir(now, results, resume=True)["ranges"][1][0] == "quantile_lr"
    assert read_sweep(results)["ranges"][0][0] == "conformal_weight"
    assert searched_fields(read_sweep(results), "dpsm") == ["conformal_weight", "lr", "quantile_lr", "sigmoid_temperature"]
    with pytest.raises(SweepError, match=r"different settings \(--range: .*4\.0.* there, .*5\.0.* here\)"):  # renamed, and still compared
        check_results_dir(spec(methods=("dpsm",), ranges=(("conformal_weight", Range(0.1, 5.0)), ("quantile_lr", Range(0.001, 0.1)))), results, resume=True)

def digits_spec(results: Path) -> SweepSpec:
    """The spec ``sweeps/digits.py --methods ce --results-dir RESULTS`` runs."""
    import runpy

    from dpsm_ray.sweep.cli import build_parser, spec_from_args

    digits = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))
    args = build_parser("digits", "", digits["DEFAULTS"]).parse_args(["--methods", "ce", "--results-dir", str(results)])
    return spec_from_args("digits", args, digits["DEFAULTS"])


# What a sweep script refuses in one line before Ray starts (issue 21, item 10: each of these used
# to end in a traceback, some only after Ray had started).
@pytest.mark.parametrize("argv, prepare, code, needle", [
    (["--dataset", "synthetic:noise=nan"], None, 2, "--dataset='synthetic:noise=nan' is invalid: dataset: synthetic option noise must be a finite number"),
    (["--seed", "99999999999999999999999"], None, 2, "--seed=99999999999999999999999 is invalid: must be an integer in [0, 2**63"),
    (["--methods", "ce,ce"], None, 2, "must name each method once"),
    (["--optuna-storage", "nonsense"], None, 2, "--optuna-storage='(not a URL)' is invalid: must be a SQLAlchemy database URL"),
    (["--results-dir", "{tmp}/a_file"], "file", 2, "is a file, not a directory"),  # bad input: 3 would say --resume continues
    (["--results-dir", "{tmp}/" + "x" * 300], None, 2, "cannot create --results-dir"),
    (["--results-dir", "{tmp}/r", "--resume"], "garbled", 3, "sweep.json is not readable JSON"),
    (["--results-dir", "{tmp}/r", "--resume"], "old", 3, "started by an earlier version of dpsm_ray"),
    (["--results-dir", "{tmp}/r", "--resume"], "truncated-db", 3, "cannot read the Optuna storage sqlite:///"),
])
def test_bad_input_is_one_line_before_ray_starts(argv, prepare, code, needle, tmp_path):
    results = tmp_path / "r"
    if prepare == "file":
        (tmp_path / "a_file").write_text("not a directory")
    elif prepare in ("garbled", "old", "truncated-db"):
        results.mkdir()
        settings = check_results_dir(digits_spec(results), results, resume=False)
        text = {"garbled": '{"name": "t", "base": {', "old": json.dumps({k: v for k, v in settings.items() if k != "ledger"})}.get(prepare, json.dumps(settings))
        (results / "sweep.json").write_text(text)
        if prepare == "truncated-db":
            (results / "optuna.db").write_bytes(b"SQLite format 3\0" + b"\x07" * 100)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--results-dir" not in argv:
        argv = ["--results-dir", str(results), *argv]
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py"), "--methods", "ce", *argv] if "--methods" not in argv else
                         [sys.executable, str(ROOT / "sweeps" / "digits.py"), *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == code and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert needle in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr
    assert "Started a local Ray instance" not in run.stdout + run.stderr and time.monotonic() - started < 60


def test_the_results_directory_s_file_names_are_spelled_in_one_module():
    """dpsm_ray/storage/layout.py owns the results directory: no other module of the package spells
    one of its file names as a string of its own (docstrings and messages may name them)."""
    import io
    import tokenize
    from pathlib import Path

    import dpsm_ray
    from dpsm_ray.storage import layout

    names = {layout.SWEEP_FILE, layout.STUDY_FILE, layout.FINISHED_FILE, layout.RECORD_FILE, layout.CHECKPOINT_FILE, layout.EPOCHS_FILE,
             layout.RESULT_FILE, layout.INDEX_FILE, layout.LOCK_FILE, layout.MANIFEST, layout.OPTUNA_DB, layout.BASE_MODELS, layout.TUNE,
             layout.RUN_SETTINGS_FILE, *layout.PARQUET.values()}
    package = Path(dpsm_ray.__file__).parent
    spelled = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(layout.__file__):
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
            if token.type == tokenize.STRING and token.string.strip("'\"") in names:
                spelled.append(f"{path.relative_to(package)}:{token.start[0]} {token.string}")
    assert spelled == []


# --- a results directory answers only for its own settings ------------------------------------------------------------------------

def test_a_results_directory_with_other_settings_is_refused_naming_each_difference(tmp_path):
    from dpsm_ray.sweep.spec import ResultsDirUnusable, SweepFinished

    results = tmp_path / "r"
    results.mkdir()
    (results / "sweep.json").write_text(json.dumps(sweep_file(spec(), results)))
    other = spec(trials=3, base=TrainConfig(dataset="synthetic", epochs=5))
    for resume in (False, True):  # unfinished: neither a new sweep nor --resume may take it
        with pytest.raises(ResultsDirUnusable) as error:
            check_results_dir(other, results, resume=resume)
        message = str(error.value)
        assert f"{results} holds an unfinished sweep with different settings" in message
        assert "--trials: 2 there, 3 here" in message and "--dataset: 'digits' there, 'synthetic' here" in message
        assert "--epochs: 2 there, 5 here" in message and message.count(" there, ") == 3
        assert f"give a new --results-dir for this one, or the options that sweep ran with to resume it (--config {results / 'sweep.json'}" in message
    (results / "finished.json").write_text("{}")
    with pytest.raises(ResultsDirUnusable, match=f"{results} holds a finished sweep with different settings .*to show it"):
        check_results_dir(other, results, resume=False)
    with pytest.raises(SweepFinished):  # the same settings: the finished sweep answers (its report is shown, exit 0)
        check_results_dir(spec(), results, resume=False)
    # how the sweep runs, not what it computes, may differ
    assert check_results_dir(spec(concurrency=1, worker_logs=True, trial_retries=5), results, resume=True)


def test_the_default_results_directory_follows_the_dataset_and_the_methods():
    from dpsm_ray.sweep.cli import default_results_dir

    defaults = {"config": {"dataset": "digits"}}
    def named(dataset, methods=("ce", "conftr", "cut", "dpsm")):
        return default_results_dir("digits", dataset, methods, defaults)

    assert named("digits") == "results/digits"
    assert named("digits", ("ce", "dpsm")) == "results/digits-ce-dpsm"
    assert named("synthetic:classes=3,dim=4") == "results/synthetic-classes3-dim4"
    assert named("table:/data/breast cancer.csv:label=diagnosis") == "results/table-breast_cancer"
    assert named("folder:/data/birds:size=64", ("dpsm",)) == "results/folder-birds-dpsm"


def test_trials_per_knob_gives_each_method_a_budget_that_follows_its_knobs(tmp_path):
    from dpsm_ray.sweep.cli import build_parser, spec_from_args
    from dpsm_ray.sweep.driver import search_size
    from dpsm_ray.sweep.space import method_knobs

    fair = spec(methods=("ce", "cut", "conftr", "dpsm"), trials_per_knob=3)
    assert {m: len(method_knobs(m)) for m in fair.methods} == {"ce": 1, "cut": 2, "conftr": 3, "dpsm": 4}
    assert [fair.search_trials(m) for m in fair.methods] == [search_size(fair, m) for m in fair.methods] == [3, 6, 9, 12]
    assert spec(trials=5).search_trials("dpsm") == 5  # without it: --trials for every method
    with pytest.raises(ConfigError, match="trials_per_knob=0 is invalid: must be an integer >= 1"):
        spec(trials_per_knob=0)
    with pytest.raises(ConfigError, match="for an Optuna search"):
        spec(trials_per_knob=2, grid=True)
    # from the command line, and back from the sweep.json it writes (a config file), to the same budget
    defaults = {"trials": 4, "final_seeds": 2, "config": {"dataset": "digits"}}
    parser = build_parser("digits", "d", defaults)
    made = spec_from_args("digits", parser.parse_args(["--trials-per-knob", "2", "--methods", "ce,dpsm"]), defaults)
    assert (made.trials_per_knob, made.search_trials("ce"), made.search_trials("dpsm")) == (2, 2, 8)
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_file(made, tmp_path)))
    from dpsm_ray.sweep.cli import config_options
    from dpsm_ray.sweep.options import parse_with_config

    again = spec_from_args("digits", parse_with_config(build_parser("digits", "d", defaults), "digits", config_options(),
                                                       ["--config", str(tmp_path / "sweep.json")]), defaults)
    assert again.describe() == made.describe()


def test_min_trials_is_a_floor_on_every_method_s_budget_from_options_and_config_files(tmp_path):
    """--min-trials N: no method searches fewer than N trials (CE's 1 knob no longer leaves it 2), from the command line
    and back from the sweep.json it writes; with --sampler sobol every method's trial n draws the same lr."""
    from dpsm_ray.sweep.cli import config_options, build_parser, spec_from_args
    from dpsm_ray.sweep.options import parse_with_config

    floored = spec(methods=("ce", "cut", "conftr", "dpsm"), trials_per_knob=2, min_trials=6)
    assert [floored.search_trials(m) for m in floored.methods] == [6, 6, 6, 8]
    assert spec(trials=3, min_trials=5).search_trials("dpsm") == 5
    with pytest.raises(ConfigError, match="min_trials=0 is invalid: must be an integer >= 1"):
        spec(min_trials=0)
    defaults = {"trials": 4, "final_seeds": 2, "config": {"dataset": "digits"}}
    argv = ["--trials-per-knob", "2", "--min-trials", "6", "--sampler", "sobol", "--methods", "ce,dpsm"]
    made = spec_from_args("digits", build_parser("digits", "d", defaults).parse_args(argv), defaults)
    assert (made.min_trials, made.sampler, made.search_trials("ce"), made.search_trials("dpsm")) == (6, "sobol", 6, 8)
    # the default, chosen by bench/search_quality.py (docs/sweeps.md)
    assert spec_from_args("digits", build_parser("digits", "d", defaults).parse_args([]), defaults).sampler == spec().sampler == "sobol-tpe"
    (tmp_path / "sweep.json").write_text(json.dumps(sweep_file(made, tmp_path)))
    again = spec_from_args("digits", parse_with_config(build_parser("digits", "d", defaults), "digits", config_options(),
                                                       ["--config", str(tmp_path / "sweep.json")]), defaults)
    assert again.describe() == made.describe()
    (tmp_path / "sweep.yaml").write_text("dataset: digits\nmethods: ce,dpsm\nmin_trials: 7\nsampler: sobol\n")
    from_yaml = spec_from_args("digits", parse_with_config(build_parser("digits", "d", defaults), "digits", config_options(),
                                                           ["--config", str(tmp_path / "sweep.yaml")]), defaults)
    assert (from_yaml.search_trials("ce"), from_yaml.search_trials("dpsm"), from_yaml.sampler) == (7, 7, "sobol")
