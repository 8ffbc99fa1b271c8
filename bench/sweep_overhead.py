"""Where a sweep's time goes, part by part of a trial's life.

    python bench/sweep_overhead.py                  # the default digits sweep, twice: ~6 minutes on 2 CPU cores
    python bench/sweep_overhead.py --sweeps digits,cifar  # then ResNet-110 trials on fake CIFAR-100 files (256 training images, 2 epochs)
    python bench/sweep_overhead.py --analyse DIR    # a finished sweep's results directory, as it is

Each arm runs a sweep script in a fresh process (``sweeps/digits.py`` with its defaults: 26 trials
in one Tune experiment -- the searches', then the final stage's -- one trial at a time) and times
the whole command.  The parts come from the timestamps and seconds the sweep records itself
(``dpsm_ray.timing``): each trial's ``record.json`` ``timings`` (when the driver launched it, when
its process started and imported the trial's code, when the trial started, its seconds in base_model
/ load_data / build / train / evaluate / report / final_evaluation, when it finished, when the
driver recorded it) and the driver's ``finished.json`` ``seconds`` (ray_start, base_model, stages,
collect, pick, export, report).

Arms: ``fresh`` starts a process per trial (``--process-per-trial``: what every sweep did before
trials handed their process on); ``reused`` hands each trial's process to the next trial of its Tune experiment (Tune's
actor reuse, the default).  The two arms' trials/evals/epochs rows are compared, without the
columns that hold times or Tune's trial ids; ``--compare DIR`` compares them with another
sweep's too (e.g. one run by an earlier version).

``--floor`` then times what Ray and Tune alone take for a sweep of that shape (FLOOR below), and
the ratio that floor would give with the sweep's epochs and evaluation added: the part of the
ratio no change inside the sweep can remove.

Target: sweep wall <= 3x the sum of epoch and evaluation time (epochs.parquet ``epoch_seconds``,
which holds the per-epoch validation, plus the final evaluations).  Prints one JSON line, then a
table per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from dpsm_ray.train.loop import EPOCH_TIMINGS

ROOT = Path(__file__).resolve().parents[1]
TRIAL_PARTS = ("base_model", "load_data", "build", "train", "evaluate", "report", "final_evaluation")
TIME_COLUMNS = ("trial_id", "wall_seconds", *EPOCH_TIMINGS, "finished_at", "node_ip")
ARMS = {"fresh": ["--process-per-trial"], "reused": []}
CIFAR_ARGS = ["--train-subset", "256", "--epochs", "2", "--methods", "ce", "--trials", "3", "--final-seeds", "1",
              "--init", "scratch", "--gpus-per-worker", "0", "--cpus-per-worker", "1", "--device", "cpu", "--concurrency", "1"]


def child_env() -> dict:
    """This environment, with this checkout first on the path: the child runs this very dpsm_ray."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_arm(script: str, results: Path, arm: list[str], extra: list[str]) -> float:
    """Run ``sweeps/SCRIPT.py`` into ``results``; its wall seconds, the process's start included."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "sweeps" / f"{script}.py"), "--results-dir", str(results), *arm, *extra], env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"sweeps/{script}.py failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return seconds


# Ray's and Tune's own share of a sweep of this shape: a fresh Python process that imports what a
# sweep's driver does, starts its embedded Ray as a sweep does, runs one Tune experiment (actor
# reuse, one trial at a time) of as many trials as the sweep, each reporting as often as its epochs
# and doing nothing else, and stops Ray -- no data, model, training, evaluation, Optuna, records,
# Parquet or report.  What no change inside the sweep can take below.
FLOOR = """
import sys, time
import optuna, pandas, torch
from ray import tune
from dpsm_ray.train.ray_session import start_embedded
import ray

def trial(config):
    import torch  # what a trial's process imports first
    for _ in range(config["reports"]):
        tune.report({"epoch": 1})

start_embedded(num_cpus=2, worker_output=False)
reports = [int(n) for n in sys.argv[1].split(",")]
tuner = tune.Tuner(tune.with_resources(trial, {"cpu": 1}), param_space={"reports": tune.grid_search(reports)},
                   tune_config=tune.TuneConfig(max_concurrent_trials=1, reuse_actors=True),
                   run_config=tune.RunConfig(storage_path=sys.argv[2], verbose=0))
grid = tuner.fit()
ray.shutdown()
print(sum(result.error is None for result in grid), sum(0 if result.metrics_dataframe is None else len(result.metrics_dataframe) for result in grid))
"""


def floor(results: Path, analysed: dict, out: Path) -> dict:
    """FLOOR's wall seconds for the sweep in ``results``, and the ratio it would give with the
    sweep's epochs and evaluation added (``analysed``: ``analyse``'s result for it)."""
    trials = pd.read_parquet(results / "trials.parquet")
    per_trial = pd.read_parquet(results / "epochs.parquet").groupby("trial_id").size()
    reports = [int(per_trial.get(t, 0)) for t in trials.trial_id]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FLOOR, ",".join(map(str, reports)), str(out / "floor-tune")], env=child_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"the floor's Tune experiment failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    ended, reported = map(int, done.stdout.split()[-2:])
    work = analysed["epoch_seconds"] + analysed["final_evaluation_s"]
    wall = round(seconds, 2)  # the ratio from the number the record shows, so that a reader gets the same ratio from it
    return {"wall_s": wall, "trials": ended, "reports": reported, "floor_plus_work_over_work": round((wall + work) / work, 2)}


def records(results: Path) -> list[dict]:
    from dpsm_ray.storage.layout import RUNS, Ledger

    ledger = Ledger(results)
    return [record for stage in sorted(p.name for p in (results / RUNS).iterdir()) for record in ledger.records(stage).values()]


def analyse(results: Path, wall: float | None) -> dict:
    """Seconds per part of the sweep in ``results`` (``wall``: the command's, when measured)."""
    finished = json.loads((results / "finished.json").read_text())
    driver = finished.get("seconds", {})
    epochs = pd.read_parquet(results / "epochs.parquet")
    parts = dict.fromkeys(("schedule + process start", "imports", "trial set-up", *TRIAL_PARTS, "trial other", "result to driver"), 0.0)
    trials = records(results)
    fresh = 0
    for record in trials:
        timings = record.get("timings") or {}
        seconds = timings.get("seconds", {})
        for part in TRIAL_PARTS:
            parts[part] += seconds.get(part, 0.0)
        launched, started = timings.get("launched"), timings.get("trial_started")
        if launched is None or started is None:
            continue
        new_process = timings["import_started"] >= launched - 0.5  # a reused process imported before this trial was launched
        fresh += new_process
        if new_process:
            parts["schedule + process start"] += timings["import_started"] - launched
            parts["imports"] += timings["imported"] - timings["import_started"]
            parts["trial set-up"] += started - timings["imported"]
        else:
            parts["schedule + process start"] += started - launched
        end = timings.get("finished", timings["recorded"])
        parts["trial other"] += end - started - sum(seconds.values())
        parts["result to driver"] += timings["recorded"] - end
    in_trials = sum(parts.values())
    parts["Tune between trials"] = driver.get("stages", 0.0) - in_trials
    for part in ("ray_start", "base_model", "collect", "pick", "export", "report"):
        parts[f"driver: {part}"] = driver.get(part, 0.0)
    if wall is not None:
        parts["driver: start (python, imports, checks)"] = wall - sum(driver.values())
    epoch_seconds = float(epochs.epoch_seconds.sum())
    work = epoch_seconds + parts["final_evaluation"]
    total = wall if wall is not None else sum(driver.values())
    return {"wall_s": round(total, 2), "trials": len(trials), "fresh_processes": fresh, "experiments": len([p for p in (results / "tune").iterdir() if p.is_dir()]),
            "epoch_seconds": round(epoch_seconds, 2), "final_evaluation_s": round(parts["final_evaluation"], 2),
            "wall_over_epochs_and_evaluation": round(total / work, 2), "parts": {k: round(v, 2) for k, v in parts.items()}}


def same_rows(a: Path, b: Path) -> dict[str, bool]:
    """Whether two sweeps wrote the same trials/evals/epochs rows (times and Tune ids aside)."""
    same = {}
    for name in ("trials", "evals", "epochs"):
        frames = []
        for results in (a, b):
            frame = pd.read_parquet(results / f"{name}.parquet")
            frame = frame.drop(columns=[c for c in TIME_COLUMNS if c in frame])
            if "config_json" in frame:  # paths inside the results directory
                frame["config_json"] = frame.config_json.str.replace(str(results), "RESULTS", regex=False)
            frames.append(frame)
        try:
            pd.testing.assert_frame_equal(*frames, check_exact=True)
            same[name] = True
        except AssertionError:
            same[name] = False
    return same


def table(name: str, result: dict) -> str:
    lines = [f"{name}: sweep wall {result['wall_s']:.1f} s, {result['trials']} trials ({result['fresh_processes']} in a new process, "
             f"{result['experiments']} Tune experiments); epochs {result['epoch_seconds']:.1f} s + final evaluation {result['final_evaluation_s']:.1f} s "
             f"-> wall / (epochs + evaluation) = {result['wall_over_epochs_and_evaluation']:.1f}x",
             f"  {'part':<42} {'seconds':>8} {'share':>6}"]
    for part, seconds in sorted(result["parts"].items(), key=lambda item: -item[1]):
        lines.append(f"  {part:<42} {seconds:>8.2f} {100 * seconds / result['wall_s']:>5.1f}%")
    if "floor" in result:
        lines.append(floor_line(name, result["floor"]))
    return "\n".join(lines)


def floor_line(name: str, floor: dict) -> str:
    return (f"{name} floor: Ray's start and stop and one Tune experiment of the same trials and reports, doing nothing else: "
            f"{floor['wall_s']:.1f} s; with the epochs and evaluation added, {floor['floor_plus_work_over_work']:.1f}x")


def cifar_root(out: Path) -> Path:
    root = out / "cifar-data"
    if not (root / "cifar-100-python").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_datasets import write_cifar100

        write_cifar100(root, train=2000, test=500)
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the arms' results directories go (default: a new temporary directory)")
    parser.add_argument("--arms", default="fresh,reused", help="comma-separated: fresh, reused (default: %(default)s)")
    parser.add_argument("--sweeps", default="digits", help="comma-separated: digits (sweeps/digits.py's defaults), cifar (ResNet-110 on fake "
                        "CIFAR-100 files, CPU, 256 training images, 2 epochs, 3 search trials and 1 final; default: %(default)s)")
    parser.add_argument("--compare", type=Path, help="a results directory of the default digits sweep to compare rows with")
    parser.add_argument("--analyse", type=Path, help="print the parts of this finished sweep and stop")
    parser.add_argument("--floor", action="store_true", help="then time Ray's and Tune's own share of the digits sweep's shape: its trials, "
                        "each reporting once per epoch and doing nothing else (no training, data, Optuna, records or report)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="sweep_overhead_")).resolve()
    if args.analyse:
        result = analyse(args.analyse.resolve(), None)
        if args.floor:
            result["floor"] = floor(args.analyse.resolve(), result, out)
        print(json.dumps(result))
        print(table(str(args.analyse), result))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    report = {"bench": "sweep_overhead", "host": platform.node(), "cpus": os.cpu_count(), "digits": {}, "cifar": {}}
    sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    if "digits" in sweeps:
        for arm in arms:
            results = out / f"digits-{arm}"
            report["digits"][arm] = analyse(results, run_arm("digits", results, ARMS[arm], []))
        if len(arms) == 2:
            report["digits"]["same_rows"] = same_rows(out / f"digits-{arms[0]}", out / f"digits-{arms[1]}")
        if args.compare:
            report["digits"]["same_rows_as_compare"] = same_rows(args.compare.resolve(), out / f"digits-{arms[-1]}")
        if args.floor:
            report["digits"]["floor"] = floor(out / f"digits-{arms[-1]}", report["digits"][arms[-1]], out)
    if "cifar" in sweeps:
        data = cifar_root(out)
        for arm in arms:
            results = out / f"cifar-{arm}"
            result = analyse(results, run_arm("cifar100", results, ARMS[arm], ["--data-root", str(data), *CIFAR_ARGS]))
            # a trial's fixed cost: its life but its epochs' training and evaluation, and its share of Tune's time between trials
            fixed = sum(v for k, v in result["parts"].items() if not k.startswith("driver") and k not in ("train", "evaluate"))
            result["fixed_per_trial_s"] = round(fixed / max(1, result["trials"]), 2)
            report["cifar"][arm] = result
        if len(arms) == 2:
            report["cifar"]["same_rows"] = same_rows(out / f"cifar-{arms[0]}", out / f"cifar-{arms[1]}")
    print(json.dumps(report))
    for group in ("digits", "cifar"):
        for arm, result in report[group].items():
            if arm in ARMS:
                print(table(f"{group} {arm}", result))
                if "fixed_per_trial_s" in result:
                    print(f"  fixed cost per trial (everything but its epochs' train and evaluate): {result['fixed_per_trial_s']:.2f} s")
        if "floor" in report[group]:
            print(floor_line(group, report[group]["floor"]))
        for key in ("same_rows", "same_rows_as_compare"):
            if key in report[group]:
                print(f"{group} {key}: {report[group][key]}")
    print(f"results directories: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
