"""The GPU sweeps' resource logic on a CPU machine: an embedded Ray that declares two GPUs it does
not have (bench/gpu_shaped.py) runs sweeps/cifar100.py -- packed single-worker trials, a DDP trial
of two one-GPU workers, a trial whose GPU share has no CUDA device behind it, and a request larger
than the cluster.  ``--device cpu`` trains GPU-shaped trials on the CPU on purpose; this tests
placement, not speed (small MLPs on the synthetic set).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
GPUS, CPUS = 2, 8
SMALL = ["--dataset", "synthetic", "--model", "mlp", "--init", "scratch", "--batch-size", "64", "--methods", "ce", "--final-seeds", "1"]
PACKED_EPOCHS = 40  # long enough that the eighth trial starts before the first ends, on 2 loaded cores


@pytest.fixture(scope="module")
def gpu_shaped(tmp_path_factory):
    """Four sweeps on one GPU-shaped Ray: their results directories and the driver's output."""
    root = tmp_path_factory.mktemp("gpu_shaped")
    script = str(ROOT / "sweeps" / "cifar100.py")
    runs = {
        "packed": [*SMALL, "--device", "cpu", "--cpus-per-worker", "1", "--trials-per-gpu", "4", "--trials", "8", "--concurrency", "8",
                   "--epochs", str(PACKED_EPOCHS)],
        "ddp": [*SMALL, "--device", "cpu", "--workers", "2", "--gpus-per-worker", "1", "--cpus-per-worker", "1", "--trials", "1", "--epochs", "2"],
        "no_cuda": [*SMALL, "--device", "auto", "--cpus-per-worker", "1", "--trials", "1", "--epochs", "1", "--trial-retries", "0"],
        "too_big": [*SMALL, "--device", "cpu", "--gpus-per-worker", "3", "--trials", "1", "--epochs", "1"],
    }
    argv = []
    for name, args in runs.items():
        argv += ["--next", script, "--results-dir", str(root / name), *args]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_shaped.py"), str(GPUS), str(CPUS), *argv[1:]],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    codes = re.findall(r"^exit cifar100 (\S+)$", done.stdout, re.M)
    assert len(codes) == len(runs), output[-3000:]
    return root, dict(zip(runs, codes)), output


def intervals(results: Path, stage: str) -> list[tuple[float, float]]:
    """Each trial's (start, end) in wall-clock seconds, from Tune's result.json of the trial."""
    spans = []
    for path in sorted((results / "tune").glob(f"*/trial_{stage}_*/result.json")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        spans.append((rows[0]["timestamp"] - rows[0]["time_total_s"], rows[-1]["timestamp"]))
    return spans


def test_four_trials_per_gpu_run_eight_at_once_on_two_gpus(gpu_shaped):
    root, statuses, output = gpu_shaped
    assert statuses["packed"] == "0", output[-3000:]
    trials = pd.read_parquet(root / "packed" / "trials.parquet")
    search = trials[trials.stage == "search"]
    assert len(search) == 8 and (search.status == "ok").all()
    assert (trials.device == "cpu").all()
    # 0.25 GPU each: every trial held one of the two declared GPUs, four trials on each
    assert sorted(search.gpu_ids.value_counts().to_dict().items()) == [("0", 4), ("1", 4)], search.gpu_ids.tolist()
    spans = intervals(root / "packed", "search-ce")
    assert len(spans) == 8
    assert max(start for start, _ in spans) < min(end for _, end in spans), f"the eight trials did not all run at once: {spans}"


def test_two_one_gpu_workers_place_a_ddp_trial(gpu_shaped):
    root, statuses, output = gpu_shaped
    assert statuses["ddp"] == "0", output[-3000:]
    trials = pd.read_parquet(root / "ddp" / "trials.parquet")
    assert len(trials) == 2 and (trials.status == "ok").all()
    # rank 0 reports: it trained on the CPU (gloo) while holding one whole declared GPU
    assert (trials.device == "cpu").all() and set(trials.gpu_ids) <= {"0", "1"}, trials[["device", "gpu_ids"]]


def test_a_gpu_share_without_a_cuda_device_fails_the_trial_instead_of_training_on_the_cpu(gpu_shaped):
    root, statuses, output = gpu_shaped
    trials = pd.read_parquet(root / "no_cuda" / "trials.parquet")
    assert (trials.status == "failed").all(), trials[["status", "error"]]
    error = trials.error.iloc[0]
    assert re.search(r"node \d+\.\d+\.\d+\.\d+: this trial holds GPU (\d) \(CUDA_VISIBLE_DEVICES='\1'\) but torch sees no CUDA device", error), error
    assert "--device cpu" in error
    assert "every search trial of ce failed" in output


def test_a_request_larger_than_the_embedded_cluster_fails_at_once_naming_the_gpus(gpu_shaped):
    root, statuses, output = gpu_shaped
    assert statuses["too_big"] != "0"
    assert not (root / "too_big" / "trials.parquet").exists()
    assert re.search(r"3 GPUs.*2 GPUs|2 GPUs.*3 GPUs", output), output[-2000:]
