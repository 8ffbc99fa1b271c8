"""Marginal, class-conditional, clustered and RC3P sets side by side on fonts: one CE model, every class's coverage over 10 re-splits.

    python bench/classwise_fonts.py            # trains runs/classwise-fonts (or finds it complete);
                                               # writes bench/results/classwise-fonts-2026-11-29/
    python bench/classwise_fonts.py --quick --out DIR --results DIR     # the tests: 12 classes, 2 epochs, 3 re-splits
    python bench/classwise_fonts.py --report-from bench/results/classwise-fonts-2026-11-29 [--markdown]
                                               # the table (docs/predictor.md's block) from the committed files alone

Trains one CE model with the league's base-model recipe (sweeps/league-fonts.yaml: ``fonts:train=1``,
LeNet, 20 epochs, lr 0.05 divided by 10 at epochs 10 and 15; batch 64, the small models' recipe the
yaml leaves in place -- its ``batch_size: 128`` is the fine-tuning's; momentum 0.9, weight decay
1e-4, seed 0) through ``dpsm-ray train --out``, whose final evaluation calibrates HPS, APS and RAPS
four ways on 10 calibration/test re-splits (``--eval-calibrations marginal class cluster rc3p``).
A run directory that already holds a finished run is read, not trained again; an interrupted one
resumes from its checkpoint (the CLI's own resume).  Torch runs on ``--threads`` threads (1: the
league's setting, bit for bit repeatable, and gentle on a shared machine).

Per score and calibration, over the re-splits: mean test coverage, mean set size (and its standard
deviation), the range of the classes' coverages -- each class's coverage averaged over the
re-splits first, then the lowest and highest class -- the classes under 1 - alpha (of those
averages; and the mean over re-splits of evals.parquet's ``classes_under``, each re-split's count)
and CovGap.  Writes into ``--results``: ``evals.csv`` (evals.parquet's rows, the columns used),
``classes.csv`` (each class's coverage, set size, calibration points and share of infinite thresholds averaged over the
re-splits), ``table.csv`` (the table, computed from the two files as ``--report-from`` computes it,
so the committed table is exactly what they give) and ``classwise_fonts.json`` (the command, the
commit, the wall time, the recipe).  Prints one JSON line and the table.

Measured 2026-11-29 on the 2-core development machine beside other work, one thread: the full run
665 s (20 epochs of 23-39 s, then the evaluation); ``--quick`` about 20 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from record import emit, machine  # bench/record.py (bench/ is on the path of python bench/NAME.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "bench" / "results" / "classwise-fonts-2026-11-29"
SCORES = ("hps", "aps", "raps")
CALIBRATIONS = ("marginal", "class", "cluster", "rc3p")
# the league's base model (sweeps/league-fonts.yaml; dpsm_ray.train.base_model.base_config of it)
FULL = {"dataset": "fonts:train=1", "epochs": 20, "milestones": (10, 15), "eval_splits": 10, "out": ROOT / "runs" / "classwise-fonts",
        "results": RESULTS}
QUICK = {"dataset": "fonts:classes=12,train=1", "epochs": 2, "milestones": (), "eval_splits": 3,
         "out": ROOT / "runs" / "classwise-fonts-quick", "results": ROOT / "runs" / "classwise-fonts-quick-results"}
# a class's coverage averaged over re-splits is a sum of fractions: one at exactly 1 - alpha on
# every re-split may land a rounding error below it, and is not under
UNDER_TOLERANCE = 1e-9
EVAL_COLUMNS = ("score", "calibration", "split", "alpha", "n_cal", "n_test", "coverage", "set_size", "covgap", "classes_under",
                "class_coverage_min", "class_coverage_max", "empty_rate", "singleton_rate", "accuracy")
TABLE_FILE, EVALS_FILE, CLASSES_FILE, RECORD_FILE = "table.csv", "evals.csv", "classes.csv", "classwise_fonts.json"
WALL_FILE = "bench_wall.json"  # in the run directory: the training's wall time, for a later call that finds the run complete


def train_arguments(preset: dict, out: Path) -> list[str]:
    """``dpsm-ray train``'s arguments for the CE model (``preset``: FULL or QUICK)."""
    return ["train", "--dataset", preset["dataset"], "--model", "lenet", "--method", "ce", "--init", "scratch",
            "--epochs", str(preset["epochs"]), *(["--milestones", *map(str, preset["milestones"])] if preset["milestones"] else []),
            "--lr-decay", "0.1", "--lr", "0.05", "--batch-size", "64", "--momentum", "0.9", "--weight-decay", "0.0001", "--seed", "0",
            "--eval-splits", str(preset["eval_splits"]), "--eval-scores", *SCORES, "--eval-calibrations", *CALIBRATIONS,
            "--data-workers", "0", "--out", str(out)]


def complete(out: Path) -> bool:
    """A finished ``train --out`` run: its Parquet files and its predictor, which the CLI writes last."""
    from dpsm_ray.cli import PREDICTOR_DIR
    from dpsm_ray.predict.predictor import INFO_FILE
    from dpsm_ray.storage.layout import PARQUET

    return all((out / name).is_file() for name in (PARQUET["evals"], PARQUET["classes"], "config.json", f"{PREDICTOR_DIR}/{INFO_FILE}"))


def train(arguments: list[str], out: Path) -> float | None:
    """Trains (or resumes) the run unless ``out`` holds it complete; the training's wall seconds
    (this call's, or the call's that trained it; None when that was not recorded)."""
    if complete(out):
        print(f"{out} holds a finished run: read, not trained again", file=sys.stderr)
        wall = out / WALL_FILE
        return json.loads(wall.read_text())["train_wall_seconds"] if wall.is_file() else None
    from dpsm_ray.cli import main as dpsm_ray
    from dpsm_ray.files import write_json

    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the CLI's progress lines; stdout keeps the JSON line and the table
        code = dpsm_ray(arguments)
    if code != 0 or not complete(out):
        raise SystemExit(f"dpsm-ray {' '.join(arguments)} failed (exit {code}); run this again to resume it")
    seconds = round(time.perf_counter() - started, 1)
    write_json(out / WALL_FILE, {"train_wall_seconds": seconds})
    return seconds


def write_inputs(out: Path, results: Path) -> None:
    """The run's evals.parquet rows (the columns the table reads) and each class's re-split averages, as CSV."""
    import pandas as pd

    from dpsm_ray.files import write_text
    from dpsm_ray.storage.layout import PARQUET

    evals = pd.read_parquet(out / PARQUET["evals"])[list(EVAL_COLUMNS)].sort_values(["score", "calibration", "split"])
    classes = pd.read_parquet(out / PARQUET["classes"])
    classes = classes.assign(infinite_q=classes.q == float("inf"))  # the class's threshold infinite in a re-split
    averaged = (classes.groupby(["score", "calibration", "label"], sort=True)
                .agg(class_name=("class_name", "first"), splits=("coverage", "count"), n_cal=("n_cal", "mean"),
                     n_test=("n_test", "mean"), coverage=("coverage", "mean"), set_size=("set_size", "mean"),
                     infinite_q=("infinite_q", "mean"))
                .reset_index())
    results.mkdir(parents=True, exist_ok=True)
    write_text(results / EVALS_FILE, evals.to_csv(index=False, float_format="%.6g"))
    write_text(results / CLASSES_FILE, averaged.to_csv(index=False, float_format="%.6g"))


def summary(results: Path):
    """The table, a row per score and calibration (in SCORES x CALIBRATIONS order), from ``results``'
    evals.csv and classes.csv alone."""
    import pandas as pd

    evals = pd.read_csv(results / EVALS_FILE)
    classes = pd.read_csv(results / CLASSES_FILE)
    rows = []
    for (score, calibration), mine in evals.groupby(["score", "calibration"]):
        alpha = float(mine.alpha.iloc[0])
        per_class = classes[(classes.score == score) & (classes.calibration == calibration)].coverage.dropna()
        rows.append({"score": score, "calibration": calibration, "alpha": alpha, "splits": len(mine), "classes": len(per_class),
                     "coverage": mine.coverage.mean(), "set_size": mine.set_size.mean(), "set_size_sd": mine.set_size.std(ddof=1),
                     "class_coverage_min": per_class.min(), "class_coverage_max": per_class.max(),
                     "classes_under": int((per_class < 1 - alpha - UNDER_TOLERANCE).sum()),
                     "classes_under_per_split": mine.classes_under.mean(), "covgap": mine.covgap.mean()})
    order = {(s, c): i for i, (s, c) in enumerate((s, c) for s in SCORES for c in CALIBRATIONS)}
    rows.sort(key=lambda row: order.get((row["score"], row["calibration"]), len(order)))
    return pd.DataFrame(rows)


def table_csv(table) -> str:
    return table.to_csv(index=False, float_format="%.6g")


def human(table) -> str:
    alpha = table.alpha.iloc[0]
    lines = [f"{'score':<5} {'calibration':<11} {'coverage':>8} {'set size (sd)':>14} {'class coverage min-max':>22} "
             f"{f'under {1 - alpha:g}: of averages':>23} {'a re-split':>10} {'CovGap %':>8}"]
    for r in table.itertuples():
        lines.append(f"{r.score:<5} {r.calibration:<11} {r.coverage:>8.4f} {f'{r.set_size:.3f} ({r.set_size_sd:.3f})':>14} "
                     f"{f'{r.class_coverage_min:.3f}-{r.class_coverage_max:.3f}':>22} {f'{r.classes_under} of {r.classes}':>23} "
                     f"{r.classes_under_per_split:>10.1f} {r.covgap:>8.2f}")
    return "\n".join(lines) + "\n"


def markdown(table) -> str:
    """docs/predictor.md's block: a row per score and calibration."""
    level, classes, splits = f"{1 - table.alpha.iloc[0]:g}", int(table.classes.max()), int(table.splits.iloc[0])
    header = ["score", "calibration", "coverage", "set size (sd)", "class coverage, min-max",
              f"classes under {level} (of {classes}, coverage averaged over {splits} re-splits)", "classes under, a re-split (mean)",
              "CovGap"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for r in table.itertuples():
        lines.append(f"| {r.score.upper()} | {r.calibration} | {r.coverage:.3f} | {r.set_size:.2f} ({r.set_size_sd:.2f}) | "
                     f"{r.class_coverage_min:.3f}-{r.class_coverage_max:.3f} | {r.classes_under} | {r.classes_under_per_split:.1f} | "
                     f"{r.covgap:.2f}% |")
    return "\n".join(lines) + "\n"


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help=f"a tiny run for the tests: {', '.join(f'{k} {v}' for k, v in QUICK.items())}")
    parser.add_argument("--out", type=Path, help=f"the train run's directory (default: {FULL['out'].relative_to(ROOT)}; quick: "
                                                 f"{QUICK['out'].relative_to(ROOT)})")
    parser.add_argument("--results", type=Path, help=f"where the CSV and JSON files go (default: {FULL['results'].relative_to(ROOT)}; "
                                                     f"quick: {QUICK['results'].relative_to(ROOT)})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training and evaluation (default: %(default)s)")
    parser.add_argument("--report-from", type=Path, metavar="DIR",
                        help="print the table from DIR's evals.csv and classes.csv; train nothing")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/predictor.md's block)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    if args.report_from is not None:
        if args.quick or args.out or args.results or args.json_out:
            parser.error("--report-from reads committed files: it takes --markdown alone")
        table = summary(args.report_from)
        print(markdown(table) if args.markdown else human(table), end="")
        return 0
    if args.threads < 1:
        parser.error(f"--threads must be an integer >= 1; got {args.threads}")
    import torch

    preset = QUICK if args.quick else FULL
    out, results = (args.out or preset["out"]).resolve(), (args.results or preset["results"]).resolve()
    torch.set_num_threads(args.threads)
    started, code = time.perf_counter(), commit()  # the code that trains: HEAD may move during a long run
    arguments = train_arguments(preset, out)
    train_seconds = train(arguments, out)
    write_inputs(out, results)
    table = summary(results)

    from dpsm_ray.files import write_json, write_text

    write_text(results / TABLE_FILE, table_csv(table))
    recipe = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k not in ("cache_dir", "data_root")}  # local paths
    record = {"benchmark": "classwise_fonts", "quick": args.quick, "command": " ".join(["python", "bench/classwise_fonts.py", *argv]),
              "train_command": "dpsm-ray " + " ".join(a if a != str(out) else "RUN_DIR" for a in arguments),
              "commit": code, "train_wall_seconds": train_seconds, "seconds_this_run": round(time.perf_counter() - started, 1),
              "threads": args.threads, "machine": machine(), "recipe": recipe,
              "rows": len(table)}
    write_json(results / RECORD_FILE, record)
    emit({k: v for k, v in record.items() if k != "recipe"}, args.json_out)
    print(markdown(table) if args.markdown else human(table), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
