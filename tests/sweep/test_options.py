"""What a sweep script refuses before torch and Ray load: storage the service cannot use."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsm_ray.sweep.cli import main
from dpsm_ray.sweep.options import storage_problem

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"trials": 1, "final_seeds": 1, "config": {"dataset": "digits", "workers": 0, "cpus_per_worker": 1}}


@pytest.mark.parametrize("argv, shown", [
    (["--results-dir", "s3://x"], "--results-dir s3://x: s3://"),
    (["--data-root=gs://bucket/data"], "--data-root gs://bucket/data: gs://"),
    (["--optuna-storage", "http://user:secret@host/optuna"], "--optuna-storage http://user:***@host/optuna: http://"),
])
def test_a_sweep_script_refuses_storage_it_cannot_use_in_under_a_second(argv, shown, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py"), *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - started
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sweeps/digits.py: error: {shown}"), run.stderr
    assert "mounted at the same path on every node" in lines[0] and "sqlite:///" in lines[0] and "postgresql://" in lines[0]
    assert "secret" not in run.stderr
    assert seconds < 1.0, f"{seconds:.2f}s: the refusal must come before torch and Ray load"
    assert list(tmp_path.iterdir()) == []  # no ./s3: folder


def test_the_optuna_storage_from_the_environment_is_checked_too(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPSM_RAY_OPTUNA_STORAGE": "s3://bucket/optuna"}
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--optuna-storage s3://bucket/optuna: s3://" in run.stderr


@pytest.mark.parametrize("option, value", [
    ("optuna_storage", "sqlite:////abs/optuna.db"), ("optuna_storage", "postgresql+psycopg://u@head/optuna"), ("optuna_storage", "mysql://u@h/db"),
    ("results_dir", "/mnt/nfs/results/digits"), ("results_dir", "results/digits"), ("data_root", "C:\\data"), ("data_root", None),
])
def test_paths_and_database_urls_are_accepted(option, value):
    assert storage_problem(option, value) is None


@pytest.mark.parametrize("option, value", [("results_dir", "file:///tmp/x"), ("results_dir", "sqlite:///x.db"), ("optuna_storage", "redis://h/0")])
def test_any_other_uri_is_refused(option, value):
    assert "is not storage this service can use" in storage_problem(option, value)


def test_an_abbreviated_option_is_refused_once_parsed_before_ray_starts(tmp_path, capsys, monkeypatch, no_ray_start):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main("t", "test", DEFAULTS, ["--results", "s3://x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--results-dir s3://x: s3:// is not storage" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
