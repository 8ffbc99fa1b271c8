"""How much training a search spends to find a good configuration: the paper's exhaustive grid
against Optuna's TPE, TPE with ASHA early stopping, and random search with ASHA.

    python bench/sweep_efficiency.py            # the full comparison, ~15 minutes on 2 CPU cores
    python bench/sweep_efficiency.py --quick    # a small one, a few minutes (the tests run it)

Every arm searches CUT's two knobs -- lr (eta) and lambda -- in the paper grid's box (lr 0.001 to
0.1, lambda 0.01 to 5; CUT is the method whose knobs are exactly two of the grid's axes, so the grid
and Optuna search the same space) on an offline dataset hard enough for configurations to differ
(20 Gaussian classes), each trial a Ray Tune trial training in its own process:

- ``grid``: the 5 x 6 paper grid values of lr and lambda;
- ``tpe``: Optuna TPE, ``--trials`` trials over the log-uniform box;
- ``tpe+asha``: the same with ASHA stopping trials early (``--grace-period``, ``--reduction-factor``);
- ``random+asha``: random sampling with ASHA.

For each: the training epochs spent (every epoch of every trial, stopped ones included), the wall
time, and the best validation set size of a finished, feasible trial reached as a function of the
epochs spent so far (trials in the order they were proposed; one at a time, so that order is the
order they ran).  Prints one JSON line, then a table; writes the curves to ``--out``/sweep_efficiency.png.
Target: ``tpe+asha`` within 2% of the grid's best with at most a third of its epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd

from dpsm_ray.sweep.driver import SweepSpec, run_sweep
from dpsm_ray.sweep.space import PAPER_GRID
from dpsm_ray.config import TrainConfig

FULL = dict(dataset="synthetic:classes=20,dim=16,size=4000,noise=1.5", epochs=12, trials=10, grace_period=2, lr=PAPER_GRID["lr"], lam=PAPER_GRID["conformal_weight"])
QUICK = dict(dataset="synthetic:classes=10,dim=8,size=1000,noise=1.5", epochs=3, trials=3, grace_period=1, lr=(0.01, 0.1), lam=(0.1, 1.0))
ARMS = {
    "grid": dict(grid=True),
    "tpe": dict(),
    "tpe+asha": dict(scheduler="asha"),
    "random+asha": dict(sampler="random", scheduler="asha"),
}
METHOD = "cut"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK['dataset']}, {QUICK['epochs']} epochs, a 2 x 2 grid, {QUICK['trials']} trials")
    parser.add_argument("--trials", type=int, help=f"trials of each Optuna arm (default: {FULL['trials']}, a third of the grid's; quick: {QUICK['trials']})")
    parser.add_argument("--epochs", type=int, help=f"epochs of a trial that runs to the end (default: {FULL['epochs']}; quick: {QUICK['epochs']})")
    parser.add_argument("--grace-period", type=int, help=f"ASHA's grace period in epochs (default: {FULL['grace_period']}; quick: {QUICK['grace_period']})")
    parser.add_argument("--reduction-factor", type=int, default=3, help="ASHA's reduction factor (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sweep seed of every arm (default: %(default)s)")
    parser.add_argument("--out", default="results/sweep_efficiency", help="results of every arm, the PNG and the JSON line (default: %(default)s)")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in ("trials", "epochs", "grace_period"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    for name, value in (("trials", args.trials), ("epochs", args.epochs), ("grace_period", args.grace_period)):
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be an integer >= 1; got {value}")
    args.dataset, args.lr, args.lam = preset["dataset"], preset["lr"], preset["lam"]
    return args


def arm_spec(name: str, args: argparse.Namespace) -> SweepSpec:
    base = TrainConfig(dataset=args.dataset, method=METHOD, init="scratch", epochs=args.epochs, batch_size=64, val_splits=5, seed=args.seed)
    options = dict(ARMS[name])
    if options.get("grid"):
        # the grid's other axes fixed to this bench's schedule: no decay within the run
        options.update(grid_fixed=(("batch_size", 64), ("epochs", args.epochs), ("milestones", (args.epochs + 1,)), ("lr_decay", 0.1)),
                       grid_subsets=(("lr", tuple(args.lr)), ("conformal_weight", tuple(args.lam))))
    return SweepSpec(name=name, base=base, methods=(METHOD,), trials=args.trials, final_seeds=1, coverage_slack=0.02, seed=args.seed,
                     grace_period=args.grace_period, reduction_factor=args.reduction_factor, **options)


def best_so_far(trials: pd.DataFrame) -> list[dict]:
    """After each trial, in proposal order: epochs spent so far and the best feasible validation
    set size of a trial that ran to the end (NaN until there is one)."""
    spent, best, curve = 0, float("nan"), []
    for row in trials.sort_values("trial_index").itertuples():
        spent += row.epochs_completed
        if row.status == "ok" and row.feasible and (math.isnan(best) or row.val_set_size < best):
            best = row.val_set_size
        curve.append({"trial": int(row.trial_index), "epochs": spent, "best": best})
    return curve


def run_arm(name: str, args: argparse.Namespace, out: Path) -> dict:
    results = out / name
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the sweep's progress lines; stdout holds the JSON line and the table
        run_sweep(arm_spec(name, args), results, log=lambda line: print(f"[{name}] {line}", flush=True), search_only=True)
    wall = time.perf_counter() - started
    trials = pd.read_parquet(results / "trials.parquet")
    epochs = pd.read_parquet(results / "epochs.parquet")
    curve = best_so_far(trials)
    return {
        "arm": name, "trials": len(trials), "stopped": int((trials.status == "stopped").sum()), "failed": int((trials.status == "failed").sum()),
        "epochs": len(epochs), "wall_s": round(wall, 1), "best": curve[-1]["best"] if curve else float("nan"), "curve": curve,
    }


def plot(arms: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for arm in arms:
        axis.step([p["epochs"] for p in arm["curve"]], [p["best"] for p in arm["curve"]], where="post", label=arm["arm"])
    axis.set_yscale("log")  # a poor first grid point would flatten the differences near the best
    axis.set_xlabel("training epochs spent")
    axis.set_ylabel("best feasible validation set size")
    axis.set_title(f"{METHOD.upper()} search, {len(arms[0]['curve'])}-point grid against Optuna")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        print(f"bench/sweep_efficiency.py: error: --out {out} is not empty (each arm is a sweep of its own there)", file=sys.stderr)
        return 2
    from dpsm_ray.train.ray_session import start_embedded

    start_embedded(worker_output=False)
    arms = [run_arm(name, args, out) for name in ARMS]
    grid, asha = arms[0], next(a for a in arms if a["arm"] == "tpe+asha")
    summary = {
        "tpe_asha_vs_grid_best_percent": round(100 * (asha["best"] - grid["best"]) / grid["best"], 2),
        "tpe_asha_vs_grid_epochs": round(asha["epochs"] / grid["epochs"], 3),
    }
    summary["target_met"] = summary["tpe_asha_vs_grid_best_percent"] <= 2.0 and summary["tpe_asha_vs_grid_epochs"] <= 1 / 3
    plot(arms, out / "sweep_efficiency.png")
    record = {"bench": "sweep_efficiency", "dataset": args.dataset, "method": METHOD, "epochs_per_trial": args.epochs, "seed": args.seed,
              "grace_period": args.grace_period, "reduction_factor": args.reduction_factor, "arms": arms, "summary": summary,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    line = json.dumps(record)
    (out / "sweep_efficiency.json").write_text(line + "\n")
    print(line)
    print(f"\n{'arm':<12} {'trials':>6} {'stopped':>7} {'failed':>6} {'epochs':>6} {'wall s':>7} {'best val size':>13}")
    for arm in arms:
        print(f"{arm['arm']:<12} {arm['trials']:>6} {arm['stopped']:>7} {arm['failed']:>6} {arm['epochs']:>6} {arm['wall_s']:>7.0f} {arm['best']:>13.3f}")
    print(f"\ntpe+asha against the grid: best {summary['tpe_asha_vs_grid_best_percent']:+.2f}%, epochs x{summary['tpe_asha_vs_grid_epochs']:.2f} "
          f"(target: within +2% with at most x0.33: {'met' if summary['target_met'] else 'NOT met'})")
    print(f"curves: {out / 'sweep_efficiency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
