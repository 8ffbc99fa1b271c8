"""What a sweep script refuses before torch and Ray load (storage the service cannot use), and its --config files."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from dpsm_ray.sweep.cli import config_options, build_parser, main, spec_from_args
from dpsm_ray.sweep.options import parse_with_config, storage_problem
from dpsm_ray.sweep.spec import sweep_file

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"trials": 1, "final_seeds": 1, "config": {"dataset": "digits", "workers": 0, "cpus_per_worker": 1}}


@pytest.mark.parametrize("argv, shown", [
    (["--results-dir", "s3://x"], "--results-dir s3://x: s3://"),
    (["--data-root=gs://bucket/data"], "--data-root gs://bucket/data: gs://"),
    (["--optuna-storage", "http://user:secret@host/optuna"], "--optuna-storage http://user:***@host/optuna: http://"),
])
def test_a_sweep_script_refuses_storage_it_cannot_use_before_torch_or_ray_load(argv, shown, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "sweeps" / "digits.py"), *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "ray", "optuna"}, "the refusal must come before torch and Ray load"
    lines = [line for line in run.stderr.strip().splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and lines[0].startswith(f"sweeps/digits.py: error: {shown}"), run.stderr
    assert "mounted at the same path on every node" in lines[0] and "sqlite:///" in lines[0] and "postgresql://" in lines[0]
    assert "secret" not in run.stderr
    assert list(tmp_path.iterdir()) == []  # no ./s3: folder


def test_the_optuna_storage_from_the_environment_is_checked_too(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPSM_RAY_OPTUNA_STORAGE": "s3://bucket/optuna"}
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--optuna-storage s3://bucket/optuna: s3://" in run.stderr


def test_storage_named_in_a_config_file_is_refused_before_torch_loads(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("base:\n  data_root: gs://bucket/data\n")
    run = subprocess.run([sys.executable, str(ROOT / "sweeps" / "digits.py"), "--config", str(config)], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--data-root gs://bucket/data: gs://" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]


@pytest.mark.parametrize("option, value", [
    ("optuna_storage", "sqlite:////abs/optuna.db"), ("optuna_storage", "postgresql+psycopg://u@head/optuna"), ("optuna_storage", "mysql://u@h/db"),
    ("results_dir", "/mnt/nfs/results/digits"), ("results_dir", "results/digits"), ("data_root", "C:\\data"), ("data_root", None),
])
def test_paths_and_database_urls_are_accepted(option, value):
    assert storage_problem(option, value) is None


@pytest.mark.parametrize("option, value", [("results_dir", "file:///tmp/x"), ("results_dir", "sqlite:///x.db"), ("optuna_storage", "redis://h/0")])
def test_any_other_uri_is_refused(option, value):
    assert "is not storage this service can use" in storage_problem(option, value)


def test_an_abbreviated_option_is_refused_naming_the_whole_one_before_ray_starts(tmp_path, capsys, monkeypatch, no_ray_start):
    """argparse's abbreviations are off: ``--results`` is not silently ``--results-dir``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main("t", "test", DEFAULTS, ["--results", "s3://x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --results s3://x; did you mean --results-dir?" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# --- config files ---------------------------------------------------------------------------

DIGITS = runpy.run_path(str(ROOT / "sweeps" / "digits.py"))["DEFAULTS"]


def parsed_spec(argv: list[str]):
    parser = build_parser("digits", "", DIGITS)
    return spec_from_args("digits", parse_with_config(parser, "digits", config_options(), argv), DIGITS)


@pytest.mark.parametrize("argv", [
    ["--methods", "ce,dpsm", "--trials", "3", "--seed", "7", "--range", "conformal_weight=0.05:2", "--range", "lr=0.001:0.1:linear", "--epochs", "4",
     "--scheduler", "asha", "--grace-period", "2", "--preset", "official", "--coverage-slack", "0.03", "--sampler", "random", "--alpha", "0.05"],
    ["--grid", "paper", "--methods", "dpsm", "--fix", "milestones=25+40", "--subset", "lr=0.01,0.1", "--grid-budget", "3", "--final-seeds", "1"],
])
def test_the_sweep_json_a_sweep_writes_gives_back_the_same_sweep(argv, tmp_path):
    spec = parsed_spec(["--results-dir", str(tmp_path / "a"), *argv])
    written = tmp_path / "a" / "sweep.json"
    written.parent.mkdir()
    written.write_text(json.dumps(sweep_file(spec, tmp_path / "a")))  # what the sweep writes, versions and all
    again = parsed_spec(["--config", str(written), "--results-dir", str(tmp_path / "b")])
    assert again == spec and again.describe() == spec.describe()


def test_a_yaml_config_takes_options_by_their_names_and_the_command_line_overrides_it(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("trials: 5\nfinal-seeds: 1\nmethods: [ce, cut]\nrange: [lr=0.01:0.2]\nepochs: 3\nworker_logs: true\n")
    spec = parsed_spec(["--config", str(config), "--trials", "2"])
    assert (spec.trials, spec.final_seeds, spec.methods, spec.base.epochs, spec.worker_logs) == (2, 1, ("ce", "cut"), 3, True)
    assert dict(spec.ranges)["lr"].high == 0.2


@pytest.mark.parametrize("text, message", [
    ('{"trails": 3}', "unknown key 'trails'; did you mean 'trials'?"),
    ('{"base": {"lrr": 0.1}}', "unknown key 'base.lrr'; did you mean 'base.lr'?"),
    ('{"name": "cifar100"}', "describes a sweep named 'cifar100'"),
    ('{"trials": 2.5}', "trials: 2.5 is not a valid int"),
    ('{"sampler": "grid"}', "sampler: 'grid' is not one of tpe, random"),
    ('[1, 2]', "expected a mapping"),
])
def test_a_bad_config_file_exits_2_with_one_line_naming_the_key(text, message, tmp_path, capsys, no_ray_start):
    config = tmp_path / "c.json"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main("digits", "test", DIGITS, ["--config", str(config), "--results-dir", str(tmp_path / "r")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()
