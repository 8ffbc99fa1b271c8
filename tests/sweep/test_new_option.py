"""A new training option costs its field (and its check): marked in its metadata, it appears in
`dpsm-ray train --help`, the sweep scripts' `--help`, trials.parquet and the report's settings
table with no other file touched.  The test marks an existing field that is none of those
(``momentum``) in a copy of the package, and runs the copy."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
DECLARED = 'momentum: float = option(0.9, "SGD momentum, in [0, 1)")'
MARKED = 'momentum: float = option(0.9, "SGD momentum, in [0, 1)", sweep=True, column=True, label="SGD momentum (momentum)")'

PROBE = """
import argparse, json, sys
from pathlib import Path
import pandas as pd
from dpsm_ray.cli import build_parser
from dpsm_ray.sweep.cli import build_parser as sweep_parser
from dpsm_ray.sweep.driver import run_sweep
from dpsm_ray.sweep.cli import spec_from_args

out = Path(sys.argv[1])
train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"].format_help()
script = sweep_parser("digits", "a sweep", {"trials": 1, "final_seeds": 1, "config": {"dataset": "digits"}})
args = script.parse_args(["--results-dir", str(out), "--methods", "ce", "--epochs", "1", "--init", "scratch", "--momentum", "0.5", "--workers", "0"])
run_sweep(spec_from_args("digits", args, {"trials": 1, "final_seeds": 1, "config": {"dataset": "digits"}}), out, log=lambda line: None)
trials = pd.read_parquet(out / "trials.parquet")
print(json.dumps({"train": "--momentum" in train, "sweep": "--momentum" in script.format_help(),
                  "column": trials.momentum.tolist() if "momentum" in trials else None,
                  "report": [line for line in (out / "report.md").read_text().splitlines() if "SGD momentum (momentum)" in line]}))
"""


def test_an_option_marked_on_its_field_reaches_train_the_sweep_scripts_trials_and_the_report(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "dpsm_ray", copy / "dpsm_ray", ignore=shutil.ignore_patterns("__pycache__"))
    config = (copy / "dpsm_ray" / "config.py").read_text()
    assert DECLARED in config, "the test's field changed: mark another one"
    (copy / "dpsm_ray" / "config.py").write_text(config.replace(DECLARED, MARKED))
    env = {"PYTHONPATH": str(copy), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "RAY_ADDRESS": ""}
    result = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "sweep")], cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["train"] and seen["sweep"]
    assert seen["column"] and set(seen["column"]) == {0.5}
    assert seen["report"] and "0.5" in seen["report"][0]
