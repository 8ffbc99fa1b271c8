"""The fidelity study (sweeps/fidelity.py) at its CI size: it must run its sweep and write every table."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.objectives import METHODS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_fidelity_study_runs_quick_and_writes_its_tables(tmp_path):
    out = tmp_path / "study"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded Ray
    result = subprocess.run([sys.executable, str(ROOT / "sweeps" / "fidelity.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = json.loads((out / "fidelity.json").read_text())
    assert study["quick"] and list(study["arms"]) == ["base", "scratch"]
    assert (out / "fidelity.md").read_text().strip() in result.stdout
    for arm, arm_study in study["arms"].items():
        check_arm(out, arm, arm_study)
    assert study["arms"]["base"]["init"] == "base" and study["arms"]["scratch"]["init"] == "scratch"
    # the regime: one CE base model per final seed in the fine-tuning arm, none from scratch
    assert [row["seed"] for row in study["arms"]["base"]["base_models"]] == [0, 1]
    for row in study["arms"]["base"]["base_models"]:
        assert 0 <= row["train_quantile"] <= 1 and 0 <= row["cal_quantile"] <= 1
    assert study["arms"]["scratch"]["base_models"] == []
    assert study["wall_seconds"] == pytest.approx(sum(s["wall_seconds"] for s in study["arms"].values()))


def check_arm(out: Path, arm: str, study: dict) -> None:
    assert study["final_seeds"] == 2 and study["trials"] == 3
    # the sweep's own files, with the final stage's rows: methods x seeds x scores x re-splits
    sweep = out / f"glyphs-quick-{arm}"
    evals = pd.read_parquet(sweep / "evals.parquet")
    final = evals[evals.stage == "final"]
    assert len(final) == len(METHODS) * 2 * 3 * study["eval_splits"]
    assert (sweep / "report.md").exists()
    assert (out / f"search-{arm}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [row["method"] for row in study["final_models"]] == ["ce", "cut", "conftr", "dpsm"]

    # each method's best-so-far curve never rises, and ends at the best feasible finished trial
    trials = pd.read_parquet(sweep / "trials.parquet")
    for method, curve in study["curves"].items():
        assert len(curve) == 3
        values = [v for v in curve if not math.isnan(v)]
        assert values == sorted(values, reverse=True)
        search = trials[(trials.stage == "search") & (trials.method == method) & (trials.status == "ok") & (trials.feasible == True)]  # noqa: E712
        assert values[-1] == pytest.approx(search.val_set_size.min())

    # the table and the intervals: DPSM against one baseline per score, every method against CE
    assert study["table"][0] == ["method", "HPS", "APS", "RAPS"] and study["table"][-1][0] == "DPSM vs best baseline"
    assert [c["score"] for c in study["dpsm_vs_best"]] == ["hps", "aps", "raps"]
    for change in study["dpsm_vs_best"] + study["vs_ce"]:
        assert change["seeds"] == 2 and change["low"] <= change["mean"] <= change["high"]
        assert change["mean"] == pytest.approx(sum(change["per_seed"]) / 2, abs=0.01)
    best = study["dpsm_vs_best"][0]
    per_seed = final[final.score == "hps"].groupby(["seed", "method"]).set_size.mean().unstack()
    assert best["per_seed"][0] == pytest.approx(100 * (per_seed.dpsm[0] - per_seed[best["against"]][0]) / per_seed[best["against"]][0], abs=0.01)
    assert len(study["vs_ce"]) == 3 * 3
    assert [row["method"] for row in study["diagnostics"]] == ["conftr", "dpsm"]


def test_fidelity_study_refuses_a_used_directory_and_bad_sizes(tmp_path):
    (tmp_path / "old").write_text("")
    result = subprocess.run([sys.executable, str(ROOT / "sweeps" / "fidelity.py"), "--quick", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "is not empty" in result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "sweeps" / "fidelity.py"), "--final-seeds", "1", "--out", str(tmp_path / "new")], capture_output=True, text=True)
    assert result.returncode == 2 and "--final-seeds must be an integer >= 2" in result.stderr
    result = subprocess.run([sys.executable, str(ROOT / "sweeps" / "fidelity.py"), "--arms", "base,warm", "--out", str(tmp_path / "new")], capture_output=True, text=True)
    assert result.returncode == 2 and "--arms must name some of base, scratch" in result.stderr
