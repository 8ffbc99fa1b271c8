"""The fidelity study (dpsm_ray/sweep/study.py): its comparisons by hand, and the CIFAR-100 study's
dry run on a generated copy of CIFAR-100 (what a GPU user submits, at CPU size)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dpsm_ray.results.stats import paired_change, t_interval

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["base", "ce", "dpsm_official", "dpsm", "dpsm_tex", "conftr", "cut"]


def test_t_interval_by_hand():
    mean, low, high = t_interval([1.0, 2.0, 6.0])
    sd = math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t_{0.975, 2}
    assert (mean, low, high) == pytest.approx((3.0, 3.0 - half, 3.0 + half))
    assert math.isnan(t_interval([2.0])[1])


def test_an_arm_is_compared_per_seed_with_its_reference():
    """Seed 0: DPSM 1.8 against CE 2.0 (-10%); seed 1: 2.2 against 2.0 (+10%), each the mean over
    that seed's re-splits: the mean change is 0, and its interval holds 0."""
    rows = []
    for seed, ce, dpsm in ((0, (1.9, 2.1), (1.7, 1.9)), (1, (2.0, 2.0), (2.1, 2.3))):
        for split, (c, d) in enumerate(zip(ce, dpsm)):
            rows += [{"stage": "ce", "seed": seed, "score": "hps", "split": split, "set_size": c},
                     {"stage": "dpsm", "seed": seed, "score": "hps", "split": split, "set_size": d}]
    change = paired_change(pd.DataFrame(rows), "dpsm", "ce", "hps")
    assert change["per_seed"] == [-10.0, 10.0] and change["mean"] == pytest.approx(0.0) and change["seeds"] == 2
    assert change["low"] < 0 < change["high"] and not change["significant"]


@pytest.mark.ray
def test_the_cifar100_fidelity_study_dry_runs_on_a_generated_copy(ray_session, tmp_path):
    import ray

    from fake_datasets import write_cifar100

    write_cifar100(tmp_path / "data")
    out = tmp_path / "study"
    command = [sys.executable, str(ROOT / "sweeps" / "cifar100_fidelity.py"), "--quick", "--data-root", str(tmp_path / "data"), "--out", str(out)]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("this study trains ") and "GPU-hours" in run.stdout.splitlines()[0]
    # the base models' rows say they were not trained, not "val size nan"
    assert "no training epochs, nothing validated" in run.stdout and "val size nan" not in run.stdout
    analysis = json.loads((out / "fidelity.json").read_text())
    assert [row["arm"] for row in analysis["table"]] == ARMS and analysis["seeds"] == [0, 1]
    evals = pd.read_parquet(out / "evals.parquet")
    assert len(evals) == len(ARMS) * 2 * 3 * 2  # arms x seeds x scores x re-splits
    trials = pd.read_parquet(out / "trials.parquet").set_index(["stage", "seed"])
    assert (trials.status == "ok").all() and trials.loc["base"].epochs_completed.eq(0).all()
    assert trials.drop(index="base", level="stage").epochs_completed.eq(1).all()
    assert trials.loc["base"].method.eq("base").all() and set(trials.loc["dpsm_tex"].method) == {"dpsm"}
    # the official arm trains as the official code does: its configuration, read back from the run
    official = json.loads(trials.loc[("dpsm_official", 0)].config_json)
    assert (official["sigmoid_temperature"], official["conformal_weight"], official["quantile_lr"], official["ce_batch"], official["dpsm_split"]) == (1.0, 0.05, 0.01, "full", "batch")
    tex = json.loads(trials.loc[("dpsm_tex", 0)].config_json)
    assert (tex["ce_batch"], tex["sigmoid_temperature"], tex["conformal_weight"]) == ("half", 0.1, 0.5)
    # one base model per seed, shared by every arm that fine-tunes
    assert len(list((out / "base_models").glob("cifar100-resnet20-seed*-*/model.pt"))) == 2  # --quick's model
    comparisons = analysis["comparisons"]
    assert {(c["arm"], c["against"]) for c in comparisons} == {(a, r) for r in ("ce", "base") for a in ARMS if a != r}
    assert all(len(c["per_seed"]) == 2 for c in comparisons)
    assert "CE base model, not fine-tuned" in (out / "fidelity.md").read_text()
    # the compact results regenerate the tables: what docs/ commits and `--report-from` reads
    printed = subprocess.run([*command[:2], "--quick", "--report-from", str(out / "compact")], capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0 and printed.stdout == (out / "fidelity.md").read_text(), printed.stderr[-2000:]
    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and " done in " not in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    # the tables of what the directory holds, nothing trained: here every arm, as the study's own
    (out / "fidelity.md").unlink()
    now = subprocess.run([*command, "--report-now"], capture_output=True, text=True, timeout=300)
    assert now.returncode == 0 and now.stdout == (out / "fidelity.md").read_text() == printed.stdout, now.stderr[-2000:]
