"""bf16 against fp32 on data a model can learn: the same runs in each precision, compared by seed SD.

    python bench/precision.py --data-root /usr/share/datasets/fashion-mnist   # a GPU: full-length runs
    python bench/precision.py --device cpu --quick                            # the CPU twin (the tests run it)

Trains one configuration -- dataset, model, method, schedule -- for each seed in each precision
(``--precision`` fp32 or bf16: autocast of the forward; losses and quantiles stay fp32), everything
else the same (on CUDA the captured step with channels_last, on a CPU the eager step), ``--parallel``
runs at a time, each in its own process (runs of a small model leave a GPU mostly idle). Then, for
each score, the final test set size and coverage (means over the evaluation's re-splits): their mean
and SD over the seeds in each precision, and whether the means differ by less than one seed SD (the
two precisions' SDs pooled) -- the check that bf16 trains like fp32 on learnable data.

Prints one JSON line (every run's figures, each epoch's time by part, the comparison, the machine)
and a table; ``--json-out`` also writes the JSON line to a file. A run that fails is recorded with
its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from record import with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16")
SCORES = ("hps", "aps")
# Fashion-MNIST at ConfTr's alpha (docs/fidelity.md), a ResNet-20 from scratch
FULL = dict(dataset="fashion_mnist", model="resnet20", method="dpsm", alpha=0.01, seeds="0,1,2", epochs=15, milestones="10", batch_size=128, lr=0.05, parallel=6,
            train_subset=None)
QUICK = dict(dataset="digits", model="mlp", method="dpsm", alpha=0.1, seeds="0,1", epochs=2, milestones="", batch_size=64, lr=0.05, parallel=1, train_subset=None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/precision.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"the CPU twin's sizes: {QUICK}")
    parser.add_argument("--data-root", help="the dataset's files (Fashion-MNIST: /usr/share/datasets/fashion-mnist)")
    for name, kind in (("dataset", str), ("model", str), ("method", str), ("alpha", float), ("seeds", str), ("epochs", int), ("milestones", str),
                       ("batch_size", int), ("lr", float), ("parallel", int), ("train_subset", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"default: {FULL[name]}; quick: {QUICK[name]}")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: train the config in this JSON file, write its figures to --result
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with_preset(args, QUICK, FULL)
    try:
        args.seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
        args.milestones = tuple(int(m) for m in str(args.milestones).split(",") if m.strip())
    except ValueError:
        parser.error(f"--seeds and --milestones take comma-separated integers; got {args.seeds!r}, {args.milestones!r}")
    if len(args.seeds) < 2:
        parser.error("--seeds: at least two seeds (a seed SD needs two)")
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1; got {args.parallel}")
    return args


def run_config(args, precision: str, seed: int) -> dict:
    cuda = args.device.startswith("cuda")
    return {"dataset": args.dataset, "data_root": args.data_root, "model": args.model, "method": args.method, "init": "scratch", "alpha": args.alpha,
            "epochs": args.epochs, "milestones": list(args.milestones), "batch_size": args.batch_size, "lr": args.lr, "seed": seed, "train_subset": args.train_subset,
            "precision": precision, "step": "graph" if cuda else "eager", "channels_last": cuda, "device": args.device, "data_workers": 0}


def train_one(config_path: str, result_path: str) -> None:
    """In a process of its own: train, then the figures the comparison reads."""
    from dpsm_ray.train import TrainConfig, run_training

    config = TrainConfig.from_dict(json.loads(Path(config_path).read_text()))
    started = time.perf_counter()
    result = run_training(config, log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - started
    figures = {"seconds": round(seconds, 1), "scores": {}}
    for score in SCORES:
        rows = [row for row in result.evals if row["score"] == score]
        figures["scores"][score] = {name: statistics.fmean(row[name] for row in rows) for name in ("set_size", "coverage", "accuracy")}
    last = result.epochs[-1]
    figures["last_epoch"] = {name: last[name] for name in ("ce_loss", "upper_loss", "q", "q_dataset", "val_coverage", "val_set_size", "val_accuracy")}
    figures["epoch_parts"] = {name: [round(row[name], 3) for row in result.epochs] for name in ("epoch_seconds", "train_seconds", "diagnostics_seconds", "validation_seconds")}
    Path(result_path).write_text(json.dumps(figures))


def run_all(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="precision_"))
    jobs = [(precision, seed) for seed in args.seeds for precision in PRECISIONS]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))

    def run(job) -> dict:
        precision, seed = job
        name = f"{precision}_seed{seed}"
        (work / f"{name}.json").write_text(json.dumps(run_config(args, precision, seed)))
        command = [sys.executable, __file__, "--one", str(work / f"{name}.json"), "--result", str(work / f"{name}.result.json")]
        with open(work / f"{name}.log", "w") as log:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        record = {"precision": precision, "seed": seed, "exit": status}
        if status == 0:
            record.update(json.loads((work / f"{name}.result.json").read_text()))
        else:
            record["error"] = (work / f"{name}.log").read_text().strip().splitlines()[-1:]
        print(f"[precision] {name}: {'ok' if status == 0 else 'FAILED'}", file=sys.stderr, flush=True)
        return record

    with ThreadPoolExecutor(args.parallel) as pool:
        return list(pool.map(run, jobs))


def compare(runs: list[dict]) -> dict:
    """Per score and metric: each precision's mean and seed SD, the difference of the means
    (bf16 - fp32), the pooled SD, and whether |difference| < the pooled SD."""
    ok = [run for run in runs if run["exit"] == 0]
    comparison = {}
    for score in SCORES:
        for metric in ("set_size", "coverage"):
            values = {p: [run["scores"][score][metric] for run in ok if run["precision"] == p] for p in PRECISIONS}
            if any(len(v) < 2 for v in values.values()):
                comparison[f"{score}_{metric}"] = {"error": "fewer than two finished seeds in a precision"}
                continue
            means = {p: statistics.fmean(v) for p, v in values.items()}
            sds = {p: statistics.stdev(v) for p, v in values.items()}
            pooled = math.sqrt((sds["fp32"] ** 2 + sds["bf16"] ** 2) / 2)
            difference = means["bf16"] - means["fp32"]
            comparison[f"{score}_{metric}"] = {"fp32_mean": means["fp32"], "fp32_sd": sds["fp32"], "bf16_mean": means["bf16"], "bf16_sd": sds["bf16"],
                                               "difference": difference, "pooled_sd": pooled, "within_one_sd": abs(difference) < pooled or difference == 0}
    return comparison


def machine(device: str) -> dict:
    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def table(record: dict) -> str:
    lines = [f"{'score / metric':<18} {'fp32 mean ± SD':>18} {'bf16 mean ± SD':>18} {'bf16 - fp32':>12} {'< 1 SD':>7}"]
    for name, row in record["comparison"].items():
        if "error" in row:
            lines.append(f"{name:<18} {row['error']}")
            continue
        lines.append(f"{name:<18} {row['fp32_mean']:>10.4f} ± {row['fp32_sd']:<6.4f} {row['bf16_mean']:>10.4f} ± {row['bf16_sd']:<6.4f} "
                     f"{row['difference']:>+12.4f} {'yes' if row['within_one_sd'] else 'NO':>7}")
    for run in record["runs"]:
        seconds = run.get("epoch_parts", {})
        parts = "  ".join(f"{k.removesuffix('_seconds')} {statistics.fmean(v):.2f}s" for k, v in seconds.items() if v)
        lines.append(f"  {run['precision']} seed {run['seed']}: {'ok' if run['exit'] == 0 else 'FAILED ' + str(run.get('error'))}  {run.get('seconds', '')}s  per epoch: {parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        train_one(args.one, args.result)
        return 0
    started = time.perf_counter()
    runs = run_all(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("one", "result", "json_out", "quick")}
    record = {"benchmark": "precision", "settings": settings, "runs": runs, "comparison": compare(runs), "seconds": round(time.perf_counter() - started, 1),
              "machine": machine(args.device)}
    line = json.dumps(record)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(table(record))
    return 0 if all(run["exit"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
