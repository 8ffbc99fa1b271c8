"""A finished sweep's final models written as predictors in the driver one after another, against as Ray tasks side by side.

    python bench/predictor_export.py --results results/league-fonts     # a finished sweep's 80 final models (LeNet, fonts)
    python bench/predictor_export.py --quick                            # a tiny digits sweep run here first (the tests run it)

Every predictor of the sweep in ``--results`` is written again into a scratch copy of that
directory (its files hard-linked, its ``predictors/`` left out), two ways: by
``dpsm_ray.predict.export.export_sweep`` in this process, one model after another -- as the sweep
driver wrote them before they became Ray tasks -- and through the sweep's own builder
(``dpsm_ray.sweep.driver.export_predictors``), one Ray task per model holding a trial's CPU, as
many at once as the Ray instance holds.  The driver runs at one torch thread (the studies'
setting) and at torch's default for this machine.  ``identical`` says whether each way's
predictors (their run, thresholds and test figures) are those of the one-thread driver's.  Ray is
the one ``RAY_ADDRESS`` names, or one started here (its start is not timed; its workers' start,
importing torch, is: a sweep pays it).  ``--quick`` first runs a digits sweep of 3 final models
into the scratch directory (not timed).

Prints one JSON line (every measurement, the machine) and then a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpsm_ray.config import TrainConfig
from dpsm_ray.files import read_checked_json
from dpsm_ray.storage.layout import INDEX_FILE, PREDICTORS, Ledger
from record import emit, machine, print_speed_table  # bench/record.py (bench/ is on the path of python bench/NAME.py)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="a finished sweep's results directory (read, never written)")
    parser.add_argument("--quick", action="store_true", help="run a tiny digits sweep here first and export its 3 final models (for CI)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    if (args.results is None) == (not args.quick):
        parser.error("give --results DIR (a finished sweep) or --quick, one of them")
    if args.results is not None and not (Path(args.results) / PREDICTORS / INDEX_FILE).is_file():
        parser.error(f"--results {args.results}: no finished sweep there (no {PREDICTORS}/{INDEX_FILE})")
    return args


def tiny_sweep(where: Path) -> Path:
    from dpsm_ray.sweep import run_sweep
    from dpsm_ray.sweep.spec import SweepSpec

    base = TrainConfig(dataset="digits", init="base", base_epochs=1, epochs=1, val_splits=2, eval_splits=2)
    results = where / "sweep"
    run_sweep(SweepSpec(name="bench", base=base, methods=("ce", "dpsm"), trials=1, final_seeds=1), results, log=lambda line: None)
    return results


def copy_without_predictors(source: Path, to: Path) -> Path:
    """``source``'s files hard-linked under ``to`` (copied where a link cannot be made), but for its predictors and lock."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, to, ignore=shutil.ignore_patterns(PREDICTORS, ".lock"), copy_function=link)
    return to


def written(results: Path) -> dict[str, dict]:
    """Each predictor's run, thresholds and test figures, by name."""
    index = read_checked_json(results / PREDICTORS / INDEX_FILE)
    infos = {entry["name"]: read_checked_json(results / entry["directory"] / "predictor.json") for entry in index["predictors"]}
    return {name: {k: info[k] for k in ("run_id", "scores", "test")} for name, info in infos.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    from dpsm_ray.predict.export import export_sweep
    from dpsm_ray.sweep.driver import export_predictors
    from dpsm_ray.sweep.spec import SweepSpec
    from dpsm_ray.train.ray_session import ensure_ray, leaving_ray_as_it_was

    default_threads = torch.get_num_threads()
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as scratch, leaving_ray_as_it_was():
        session = ensure_ray(worker_output=False)
        import ray

        source = tiny_sweep(Path(scratch)) if args.quick else Path(args.results)
        records = Ledger(source).records("final")
        models = sum(record["status"] == "ok" for record in records.values())
        base = TrainConfig.from_dict(next(iter(records.values()))["config"])
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            results = copy_without_predictors(source, Path(scratch) / f"driver-{threads}")
            started = time.perf_counter()
            export_sweep(results, log=lambda line: None, device="cpu")
            seconds = time.perf_counter() - started
            made = written(results)
            reference = made if reference is None else reference
            rows.append({"how": f"driver, one after another, {threads} thread{'s' if threads > 1 else ''}", "seconds": seconds,
                         "identical": made == reference})
        torch.set_num_threads(default_threads)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        results = copy_without_predictors(source, Path(scratch) / "tasks")
        started = time.perf_counter()
        export_sweep(results, log=lambda line: None, build=export_predictors(SweepSpec(name="bench", base=base, methods=("ce",))))
        seconds = time.perf_counter() - started
        rows.append({"how": f"Ray tasks, 1 CPU each, side by side on {cpus} CPUs", "seconds": seconds, "identical": written(results) == reference})
        del session
    record = {"benchmark": "predictor_export", "quick": args.quick, "results": None if args.quick else str(args.results), "models": models,
              "dataset": base.dataset, "model": base.resolved_model(), "default_threads": default_threads,
              "machine": machine(),
              "rows": rows}
    emit(record, args.json_out)
    print_speed_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
