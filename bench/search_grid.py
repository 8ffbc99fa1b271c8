"""Tabulated objectives of real runs for ``bench/search_quality.py``: every cell of a grid over each method's knobs, trained once.

    python bench/search_grid.py --dataset digits                 # CE, CUT, ConfTr, DPSM at the digits sweep's recipe (~400 cells)
    python bench/search_grid.py --dataset digits --resume        # after an interruption: the cells left
    python bench/search_grid.py --dataset digits --quick         # 2 values a knob, CE and DPSM, 2 epochs (the tests run it)
    python bench/search_grid.py --table-from results/search-grid-digits --out bench/results/search-grid-digits/cells.csv

A search replayed on a table costs nothing, so hundreds of repetitions compare samplers by regret
(HPOBench, YAHPO Gym and the NAS-Bench tables do this for HPO; Optuna's sampler benchmarks too).
Each cell is one configuration: a method at one value of each of its knobs (``GRID``: log-spaced
values across the knob's default search range, ``dpsm_ray.cards.DEFAULT_RANGES``), fine-tuned
from the seed-0 CE base model at the recipe of the dataset's sweep, as a search trial would be,
and evaluated on validation data (what a search sees) and on the calibration/test re-splits
(what its user gets).  The cells run as the arms of a study through the service's own driver
(``dpsm_ray.sweep.study.run_study``): resumable, one Ray trial per cell, ``--concurrency`` at once.

The table (``--out``, CSV, one row per cell): the method, its knob values, the trial's status,
validation set size, coverage and accuracy (HPS, as a search scores a trial), and the test
set size and coverage of HPS and APS (mean over the evaluation's re-splits).  The record (JSON
line, and ``--json-out``) names the commit, the cells, and the wall time the run took.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from record import emit, listed, machine  # bench/record.py (bench/ is on the path of python bench/NAME.py)

HERE = Path(__file__).resolve().parent


def log_spaced(low: float, high: float, count: int) -> tuple[float, ...]:
    """``count`` values from ``low`` to ``high``, evenly spaced in log, rounded to 4 significant digits."""
    return tuple(float(f"{low * (high / low) ** (i / (count - 1)):.4g}") for i in range(count))


# Values a knob, across DEFAULT_RANGES (lr [0.001, 0.1], lambda [0.01, 5], gamma [1e-4, 0.5],
# T [0.01, 1]): lr finest, as every method searches it; DPSM 6 x 5 x 3 x 3 = 270 cells.
GRID = {
    "lr": log_spaced(0.001, 0.1, 6),
    "conformal_weight": log_spaced(0.01, 5.0, 5),
    "quantile_lr": log_spaced(1e-4, 0.5, 3),
    "sigmoid_temperature": log_spaced(0.01, 1.0, 3),
}
QUICK_GRID = {knob: (values[0], values[-1]) for knob, values in GRID.items()}
METHODS = ("ce", "cut", "conftr", "dpsm")
# Each dataset's recipe, one seed: digits as sweeps/digits.py (its DEFAULTS' config); Fashion-MNIST
# at the league's alpha and batch (sweeps/league-fashion_mnist.yaml) with a short schedule (a 10-epoch
# CE base model, 5 epochs of fine-tuning) so that ~400 cells fit in a few hours of 2 CPU cores.
RECIPES = {
    "digits": {"dataset": "digits", "init": "base", "base_epochs": 20, "epochs": 10, "batch_size": 64, "workers": 0,
               "cpus_per_worker": 1, "val_splits": 5, "eval_splits": 10, "data_workers": 0},
    "fashion_mnist": {"dataset": "fashion_mnist", "data_root": "/usr/share/datasets/fashion-mnist", "alpha": 0.01, "init": "base",
                      "base_epochs": 10, "epochs": 5, "batch_size": 128, "workers": 0, "cpus_per_worker": 1, "val_splits": 5,
                      "eval_splits": 10, "data_workers": 0},
}
# the sweep's coverage slack there: feasible is validation coverage >= 1 - alpha - slack
COVERAGE_SLACK = {"digits": 0.02, "fashion_mnist": 0.005}
QUICK = {"epochs": 2, "base_epochs": 2, "eval_splits": 2}
COLUMNS = ("method", "lr", "conformal_weight", "quantile_lr", "sigmoid_temperature", "status", "val_set_size", "val_coverage",
           "val_accuracy", "test_set_size_hps", "test_coverage_hps", "test_set_size_aps", "test_coverage_aps")


def cells(methods, grid: dict[str, tuple]) -> list[tuple[str, dict]]:
    """``(arm name, settings)`` of every cell: each method at every combination of its knobs' values."""
    from dpsm_ray.cards import method_card

    found = []
    for method in methods:
        knobs = method_card(method).knobs
        for values in itertools.product(*(grid[knob] for knob in knobs)):
            settings = dict(zip(knobs, values))
            name = method + "".join(f"_{knob}={value:g}" for knob, value in settings.items())
            found.append((name, {"method": method, **settings}))
    return found


def grid_study(dataset: str, methods, *, quick: bool, concurrency: int):
    from dpsm_ray.config import TrainConfig
    from dpsm_ray.results.studies import Arm, Study

    common = TrainConfig.from_dict({**RECIPES[dataset], **(QUICK if quick else {})})
    arms = tuple(Arm(name, name, settings) for name, settings in cells(methods, QUICK_GRID if quick else GRID))
    return Study(name=f"search-grid-{dataset}", common=common, arms=arms, seeds=(common.seed,), concurrency=concurrency)


def cell_table(results: Path):
    """One row per cell of the grid study in ``results`` (``COLUMNS``), from its Parquet files."""
    import pandas as pd

    from dpsm_ray.storage.layout import Results
    from dpsm_ray.results.tables import calibration_rows

    reader = Results(results)
    trials = reader.trials
    trials = trials[trials.stage != "search-grid"] if "stage" in trials else trials
    evals = calibration_rows(reader.evals)
    test = evals[evals.score.isin(("hps", "aps"))].groupby(["stage", "score"])[["set_size", "coverage"]].mean().unstack("score")
    test.columns = [f"test_{column}_{score}" for column, score in test.columns]
    last = trials.sort_values("trial_index").groupby("stage").tail(1).set_index("stage")  # a cell retried: its last trial
    table = last.join(test, how="left").reset_index()
    for knob in GRID:
        if knob not in table:
            table[knob] = math.nan
    methods = table.method.astype(str)
    for knob in GRID:  # a knob the method does not search is not a value of its cell
        searched = methods.map(lambda m, k=knob: k in knobs_of(m))
        table.loc[~searched, knob] = math.nan
    return table[list(COLUMNS)].sort_values(["method", *GRID]).reset_index(drop=True)


def knobs_of(method: str) -> tuple[str, ...]:
    from dpsm_ray.cards import method_card

    return method_card(method).knobs


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_table(table, out: Path) -> None:
    from dpsm_ray.files import write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, table.to_csv(index=False, float_format="%.6g"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--dataset", choices=list(RECIPES), default="digits", help="(default: %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--results-dir", help="the study's directory (default: results/search-grid-DATASET[-quick])")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted grid in --results-dir")
    parser.add_argument("--quick", action="store_true", help=f"2 values a knob, {QUICK} (for the tests)")
    parser.add_argument("--concurrency", type=int, default=2, help="cells at once (default: %(default)s)")
    parser.add_argument("--out", help="the table to write (default: RESULTS/cells.csv)")
    parser.add_argument("--table-from", metavar="RESULTS", help="write the table of a grid study's results directory and exit")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    methods = listed(parser, "--methods", args.methods, METHODS)
    if args.concurrency < 1:
        parser.error(f"--concurrency must be an integer >= 1; got {args.concurrency}")
    if args.table_from:
        table = cell_table(Path(args.table_from))
        out = Path(args.out or Path(args.table_from) / "cells.csv")
        write_table(table, out)
        print(f"{len(table)} cells written to {out}")
        return 0

    from dpsm_ray.sweep.exits import exit_codes
    from dpsm_ray.sweep.spec import SweepFinished
    from dpsm_ray.sweep.study import run_study
    from dpsm_ray.train.ray_session import leaving_ray_as_it_was

    study = grid_study(args.dataset, methods, quick=args.quick, concurrency=args.concurrency)
    results = Path(args.results_dir or f"results/search-grid-{args.dataset}{'-quick' if args.quick else ''}").resolve()
    print(f"search grid on {args.dataset}: {len(study.arms)} cells ("
          + ", ".join(f"{m} {sum(1 for a in study.arms if a.settings['method'] == m)}" for m in methods) + f") into {results}", flush=True)
    started = time.perf_counter()
    with exit_codes(parser, where=lambda: results), leaving_ray_as_it_was():
        try:
            run_study(study, results, resume=args.resume, log=lambda line: print(line, flush=True))
        except SweepFinished:
            print(f"{results} holds this finished grid: its table follows", flush=True)
    seconds = time.perf_counter() - started
    table = cell_table(results)
    out = Path(args.out or results / "cells.csv")
    write_table(table, out)
    record = {"benchmark": "search_grid", "dataset": args.dataset, "quick": args.quick, "methods": methods,
              "grid": {k: list(v) for k, v in (QUICK_GRID if args.quick else GRID).items()}, "recipe": study.common.to_dict(),
              "coverage_slack": COVERAGE_SLACK[args.dataset], "cells": len(table), "ok": int((table.status == "ok").sum()), "seconds_this_run": round(seconds, 1),
              "commit": commit(), "machine": machine(), "table": str(out)}
    emit(json.loads(json.dumps(record, default=list)), args.json_out)
    print(f"{'method':<8} {'cells':>5} {'ok':>4} {'best val size (feasible)':>26}")
    floor = 1 - study.common.alpha - COVERAGE_SLACK[args.dataset]
    for method, rows in table.groupby("method", sort=False):
        feasible = rows[(rows.status == "ok") & (rows.val_coverage >= floor)]
        best = f"{feasible.val_set_size.min():.4f}" if len(feasible) else "none"
        print(f"{method:<8} {len(rows):>5} {int((rows.status == 'ok').sum()):>4} {best:>26}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
