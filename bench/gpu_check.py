"""Everything a lent GPU should check, in one go, its figures in one JSON summary.

    bash bench/gpu_check.sh [STEPS]                 # on the GPU machine: installs .whl/, then this
    python bench/gpu_check.py --device cpu --quick  # the CPU dry run of every step (CI runs it)

Steps (``--steps``, default all, in this order), each in its own process with its own log; a
step that fails is recorded and the next one runs:

- ``environment``: the GPU, its driver, torch and CUDA, Ray and Optuna (or what is missing), in the summary.
- ``gpu_tests``: ``pytest -m gpu``, every test that needs a CUDA device.
- ``train``: ``dpsm-ray train`` of ResNet-110 with DPSM for 2 epochs on generated CIFAR-100 files
  of the real set's size: eager fp32, then bf16 + channels_last + the captured graph, then
  ``--step auto --precision auto``; images/s of the second epoch and the losses side by side.
- ``throughput``: ``bench/throughput.py`` in full (its own JSON into throughput.json).
- ``packed``: ``sweeps/cifar100.py`` for 2 epochs with ``--trials-per-gpu`` 1, 2 and 4 (one wave
  of trials each); the sweep's wall time and the images/s of all its trials together.
- ``stacked``: ``bench/stacked.py`` (bf16 on the GPU): N = 1, 2, 4, 8 ResNet-110 trials as one
  stacked model against the same trials stepped one after another; its JSON line from its log.
- ``group``: the trial group's GPU tests (``tests/train/test_group.py``), then ``bench/group.py``: a
  trial group of N = 1, 2, 4, 8 ResNet-110 members (batch 128, bf16, channels_last), each on a CUDA
  stream of its own, against one trial's captured step -- the step alone and the loop end to end --
  a profiler trace's check that the members' kernels overlap, and the step with cudnn.benchmark on;
  no measurement starts after ``GROUP_BUDGET_S``, so the step fits one device call; the trace kept
  as ``group_trace.json.gz``.

Writes into ``--out`` (default ``$OUT``, the device tool's output folder, else bench/gpu_check):
``gpu_check.json`` (rewritten after every step, so a call cut short still brings back what ran),
one ``<step>.log`` per step but ``environment``'s, ``throughput.json`` and, on a GPU, the group's
trace -- 8 files for every step on a CPU, the tool's limit; a device call runs a few steps.  One
device call runs at most 10 minutes: run the steps over several calls (bench/README.md), each
adding to the same summary only when ``--out`` keeps it, else each call's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("environment", "gpu_tests", "train", "throughput", "packed", "stacked", "group")
# sizes: the real runs on a GPU, and the CPU dry run (each step in well under a minute or two; one
# packed sweep, P = 2: every P runs the same code, a sweep of its own)
FULL = {"model": "resnet110", "epochs": 2, "batch": 128, "train_images": 50000, "test_images": 10000, "train_subset": None, "packs": (1, 2, 4)}
QUICK = {"model": "resnet20", "epochs": 1, "batch": 32, "train_images": 200, "test_images": 100, "train_subset": 64, "packs": (2,)}
# ``train``'s runs (``--train-variants``): the options of each beside the common ones
TRAIN_VARIANTS = {"eager_fp32": ["--step", "eager", "--precision", "fp32"],
                  "graph_bf16_channels_last": ["--step", "graph", "--precision", "bf16", "--channels-last"],
                  "graph_bf16_full_diagnostics": ["--step", "graph", "--precision", "bf16", "--channels-last", "--diagnostic-examples", "0"],
                  "auto": ["--step", "auto", "--precision", "auto"]}
STEP_TIMEOUT_S = {"environment": 120, "gpu_tests": 900, "train": 900, "throughput": 1200, "packed": 1200, "stacked": 600, "group": 560}
# the group step's tests, then bench/group.py, which starts no measurement once GROUP_BUDGET_S have
# passed since the step began (its last one may run a minute on): the step fits in one 10-minute
# device call with the wheels' install (~20 s) before it
GROUP_TESTS_TIMEOUT_S = 150
GROUP_BUDGET_S = 450


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda, or cpu for the dry run (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"small sizes for the CPU dry run: {QUICK}")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps to run (default: %(default)s)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "gpu_check"), help="folder of the summary and logs (default: $OUT, else bench/gpu_check)")
    parser.add_argument("--train-variants", default=",".join(TRAIN_VARIANTS), help="comma-separated runs of the train step (default: %(default)s)")
    args = parser.parse_args(argv)
    args.train_variants = [name.strip() for name in args.train_variants.split(",") if name.strip()]
    if unknown := [name for name in args.train_variants if name not in TRAIN_VARIANTS]:
        parser.error(f"--train-variants: unknown run {unknown[0]!r}; allowed: {', '.join(TRAIN_VARIANTS)}")
    args.steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = [step for step in args.steps if step not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown step {unknown[0]!r}; allowed: {', '.join(STEPS)}")
    args.sizes = QUICK if args.quick else FULL
    return args


def child_env() -> dict:
    """The steps' processes import this checkout (installed or not) and print as they go."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_logged(command: list[str], log: Path, timeout_s: float, cwd: Path = ROOT) -> dict:
    """Run ``command`` with its output appended to ``log``; its exit status and seconds."""
    started = time.perf_counter()
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(command)}\n")
        handle.flush()
        try:
            status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, env=child_env(), timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
        handle.write(f"[exit {status}]\n")
    return {"exit": status, "seconds": round(time.perf_counter() - started, 1)}


def environment(args, out: Path) -> dict:
    import importlib.metadata as metadata

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        facts.update(gpu=torch.cuda.get_device_name(), capability=".".join(map(str, torch.cuda.get_device_capability())),
                     memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    for package in ("ray", "optuna", "pandas", "pyarrow", "torchvision"):
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            facts[package] = "missing"
    try:
        facts["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        facts["driver"] = None
    facts["ok"] = (facts["cuda_available"] or args.device == "cpu") and "missing" not in (facts["ray"], facts["optuna"])
    return facts


def gpu_tests(args, out: Path) -> dict:
    log = out / "gpu_tests.log"
    # in this one process (-o addopts=): pyproject.toml's addopts start two pytest-xdist workers, and
    # the lent machine's Python has no pytest-xdist
    result = run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=", "tests"], log,
                        STEP_TIMEOUT_S["gpu_tests"])
    tail = log.read_text().splitlines()
    counts = dict((name, int(number)) for number, name in re.findall(r"(\d+) (passed|failed|skipped|errors?)", " ".join(tail[-3:])))
    return {**result, **counts, "ok": result["exit"] == 0 and not counts.get("failed")}


def cifar100_files(args) -> Path:
    """CIFAR-100 in its real on-disk format, generated (random pixels): the timing needs the
    real set's size, not its pictures."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_datasets import write_cifar100

    root = Path(tempfile.mkdtemp(prefix="gpu_check_cifar100_"))
    write_cifar100(root, train=args.sizes["train_images"], test=args.sizes["test_images"])
    return root


def epoch_rates(run_dir: Path, train_images: int) -> dict:
    import pandas as pd

    epochs = pd.read_parquet(run_dir / "epochs.parquet")
    last = epochs.iloc[-1]  # the last epoch: past graph capture and cuDNN autotuning
    rates = {"images_per_s": round(train_images / last.epoch_seconds, 1), "epoch_seconds": [round(s, 2) for s in epochs.epoch_seconds],
             "ce_loss": [round(v, 4) for v in epochs.ce_loss], "val_set_size": round(float(last.val_set_size), 3)}
    if "train_seconds" in epochs:  # the last epoch by part (the loop's own clock), and the steps' own rate
        rates["last_epoch_parts"] = {part: round(float(last[part]), 2) for part in ("train_seconds", "diagnostics_seconds", "validation_seconds")}
        rates["steps_images_per_s"] = round(train_images / last.train_seconds, 1)
        rates["end_to_end_over_steps"] = round(last.train_seconds / last.epoch_seconds, 3)
    return rates


def trained_images(sizes: dict) -> int:
    """Training images per epoch: the subset, else CIFAR-100's training split (45000 of the 60000)."""
    from dpsm_ray.facts import PAPER_SIZES
    from dpsm_ray.data import fitted_sizes

    return sizes["train_subset"] or fitted_sizes(list(PAPER_SIZES["cifar100"].values()), sizes["train_images"] + sizes["test_images"])[0]


def train(args, out: Path) -> dict:
    sizes, data = args.sizes, cifar100_files(args)
    train_images = trained_images(sizes)
    results = {}
    for name, options in TRAIN_VARIANTS.items():
        if name not in args.train_variants:
            continue
        if name.startswith("graph") and args.device == "cpu":
            results[name] = {"skipped": "the captured graph needs CUDA"}
            continue
        run_dir = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
        command = [sys.executable, "-m", "dpsm_ray.cli", "train", "--dataset", "cifar100", "--data-root", str(data), "--model", sizes["model"],
                   "--method", "dpsm", "--init", "scratch", "--epochs", str(sizes["epochs"]), "--batch-size", str(sizes["batch"]),
                   "--eval-splits", "2", "--device", args.device, "--out", str(run_dir), *options]
        if sizes["train_subset"]:
            command += ["--train-subset", str(sizes["train_subset"])]
        result = run_logged(command, out / "train.log", STEP_TIMEOUT_S["train"])
        if result["exit"] == 0:
            result.update(epoch_rates(run_dir, train_images))
        results[name] = result
    ran = [r for r in results.values() if "exit" in r]
    plain, fast = (results.get(name, {}).get("images_per_s") for name in ("eager_fp32", "graph_bf16_channels_last"))
    summary = {"train_images": train_images, "variants": results, "ok": bool(ran) and all(r["exit"] == 0 for r in ran)}
    if plain and fast:
        summary["fast_over_plain"] = round(fast / plain, 2)
    return summary


def throughput(args, out: Path) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--device", args.device, "--json-out", str(out / "throughput.json")]
    result = run_logged(command + (["--quick"] if args.quick else []), out / "throughput.log", STEP_TIMEOUT_S["throughput"])
    if (out / "throughput.json").exists():
        record = json.loads((out / "throughput.json").read_text())
        result.update(summary=record["summary"], failed=record["failed"])
    return {**result, "ok": result["exit"] == 0}


def packed(args, out: Path) -> dict:
    """One wave of P trials sharing the GPU (``--trials-per-gpu P``), for each P.  On the CPU dry
    run the sweeps run on a Ray that declares one GPU (bench/gpu_shaped.py) with ``--device cpu``."""
    import pandas as pd

    sizes, data = args.sizes, cifar100_files(args)
    results = {}
    for packs in sizes["packs"]:
        results_dir = Path(tempfile.mkdtemp(prefix=f"gpu_check_packed{packs}_"))
        sweep = [str(ROOT / "sweeps" / "cifar100.py"), "--results-dir", str(results_dir), "--data-root", str(data), "--model", sizes["model"],
                 "--methods", "dpsm", "--init", "scratch", "--epochs", str(sizes["epochs"]), "--batch-size", str(sizes["batch"]),
                 "--trials", str(packs), "--concurrency", str(packs), "--final-seeds", "1", "--trials-per-gpu", str(packs), "--device", args.device]
        if sizes["train_subset"]:
            sweep += ["--train-subset", str(sizes["train_subset"])]
        if args.device == "cpu":
            sweep += ["--cpus-per-worker", "1"]
            command = [sys.executable, str(ROOT / "bench" / "gpu_shaped.py"), "1", str(max(2, packs)), *sweep]
        else:
            command = [sys.executable, *sweep]
        result = run_logged(command, out / "packed.log", STEP_TIMEOUT_S["packed"])
        if (results_dir / "trials.parquet").exists():
            trials = pd.read_parquet(results_dir / "trials.parquet")
            epochs = pd.read_parquet(results_dir / "epochs.parquet")
            search = trials[trials.stage == "search"]
            # the search stage is one wave of P trials at once: their epoch rates add up
            rates = epochs[epochs.stage == "search"].groupby("trial_id").epoch_seconds.mean().rdiv(trained_images(sizes))
            result.update(trials_ok=int((trials.status == "ok").sum()), trials=len(trials), gpu_ids=sorted(set(search.gpu_ids.dropna())),
                          devices=sorted(set(trials.device.dropna())), images_per_s_per_trial=round(float(rates.mean()), 1),
                          images_per_s_aggregate=round(float(rates.sum()), 1))
        results[f"trials_per_gpu_{packs}"] = result
    return {"sweeps": results, "ok": all(r["exit"] == 0 and r.get("trials_ok") == r.get("trials") for r in results.values())}


def stacked(args, out: Path) -> dict:
    """``bench/stacked.py``: stacked trials against separate ones; its record is the JSON line it printed."""
    command = [sys.executable, str(ROOT / "bench" / "stacked.py"), "--device", args.device]
    command += ["--quick"] if args.quick else ["--precision", "bf16"]
    result = run_logged(command, out / "stacked.log", STEP_TIMEOUT_S["stacked"])
    lines = [line for line in (out / "stacked.log").read_text().splitlines() if line.startswith('{"benchmark": "stacked"')]
    if lines:
        record = json.loads(lines[-1])
        result.update(summary=record["summary"], rows=record["rows"])
    return {**result, "ok": result["exit"] == 0 and bool(lines)}


def this_call(log: Path, before: int) -> str:
    """What was appended to ``log`` after its first ``before`` bytes."""
    return log.read_bytes()[before:].decode(errors="replace")


def group(args, out: Path) -> dict:
    """The trial group's GPU tests (``pytest -m gpu tests/train/test_group.py``: the members' replays
    overlap; a group on CUDA gives each configuration its lone run's rows), then ``bench/group.py``:
    N members side by side, each on its own stream, against one trial's captured step, its budget
    what the tests left of ``GROUP_BUDGET_S``.  Both write into ``group.log``; the record is the
    JSON line bench/group.py printed (each measurement's ``[group]`` line is in the log as it
    ends, should the step be cut short)."""
    log = out / "group.log"
    before = log.stat().st_size if log.exists() else 0  # a kept --out's log of an earlier call
    tests = run_logged([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
                        "tests/train/test_group.py"], log, GROUP_TESTS_TIMEOUT_S)
    counts = dict((name, int(number)) for number, name in re.findall(r"(\d+) (passed|failed|skipped|errors?)", this_call(log, before)))
    budget, timeout = GROUP_BUDGET_S - tests["seconds"], STEP_TIMEOUT_S["group"] - tests["seconds"]
    command = [sys.executable, str(ROOT / "bench" / "group.py"), "--device", args.device, "--budget-s", str(round(budget))]
    command += ["--quick"] if args.quick else []
    command += ["--trace", str(out / "group_trace.json.gz")] if args.device == "cuda" else []
    result = run_logged(command, log, timeout)
    lines = [line for line in this_call(log, before).splitlines() if line.startswith('{"benchmark": "group"')]
    if lines:
        record = json.loads(lines[-1])
        result.update(summary=record["summary"], rows=record["rows"], skipped=record["skipped"])
    tests_ok = tests["exit"] == 0 and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    return {**result, "tests": {**tests, **counts}, "ok": result["exit"] == 0 and bool(lines) and tests_ok}


def write_summary(path: Path, summary: dict) -> None:
    from dpsm_ray.files import atomic_write

    atomic_write(path, lambda handle: handle.write(json.dumps(summary, indent=1) + "\n"), binary=False)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update(benchmark="gpu_check", device=args.device, quick=args.quick, sizes={k: list(v) if isinstance(v, tuple) else v for k, v in args.sizes.items()})
    steps = {"environment": environment, "gpu_tests": gpu_tests, "train": train, "throughput": throughput, "packed": packed, "stacked": stacked,
             "group": group}
    for name in args.steps:
        started = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            summary[name] = steps[name](args, out)
        except Exception as error:  # noqa: BLE001 -- recorded; the next step runs
            summary[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        summary[name]["step_seconds"] = round(time.perf_counter() - started, 1)
        write_summary(path, summary)
        print(f"[gpu_check] {name}: {'ok' if summary[name].get('ok') else 'FAILED'} in {summary[name]['step_seconds']}s", flush=True)
    print(json.dumps(summary))
    print(table(summary))
    return 0 if all(summary[name].get("ok") for name in args.steps) else 1


def table(summary: dict) -> str:
    lines = [f"{'step':<12} {'ok':<4} {'seconds':>8}  figures"]
    for name in STEPS:
        if name not in summary:
            continue
        step = summary[name]
        if name == "train":
            figures = "  ".join(f"{k} {v.get('images_per_s', v.get('skipped', v.get('exit')))}" for k, v in step.get("variants", {}).items())
        elif name == "packed":
            figures = "  ".join(f"P={k.rsplit('_', 1)[-1]}: {v.get('images_per_s_aggregate')} images/s, {v.get('seconds')}s, {v.get('trials_ok')}/{v.get('trials')} ok"
                                for k, v in step.get("sweeps", {}).items())
        elif name == "stacked":
            figures = "  ".join(f"N={k.rsplit('_', 1)[-1]}: {v:.2f}x" for k, v in step.get("summary", {}).items())
        elif name == "group":
            tests = ", ".join(f"{v} {k}" for k, v in step.get("tests", {}).items() if k not in ("exit", "seconds"))
            figures = f"tests: {tests or step.get('tests', {}).get('exit')}  " + "  ".join(
                f"N={k.removeprefix('step_').removesuffix('_over_single').replace('_cudnn_benchmark', ' cudnn.bm')}: {v:.2f}x"
                for k, v in step.get("summary", {}).items() if k.startswith("step_"))
        elif name == "throughput":
            figures = "  ".join(f"{k} {v:.3g}" for k, v in step.get("summary", {}).items() if isinstance(v, (int, float)))
        elif name == "gpu_tests":
            figures = f"{step.get('passed', 0)} passed, {step.get('failed', 0)} failed, {step.get('skipped', 0)} skipped"
        else:
            figures = f"{step.get('gpu', 'no GPU')}, torch {step.get('torch')}, ray {step.get('ray')}, optuna {step.get('optuna')}"
        lines.append(f"{name:<12} {'yes' if step.get('ok') else 'NO':<4} {step.get('step_seconds', 0):>8}  {figures}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
