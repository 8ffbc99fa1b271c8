"""A sweep's CE base models trained one after another in the driver, against as Ray tasks side by side: seconds, and the weights.

    python bench/base_models.py                     # 4 LeNet base models on fonts (the league's data), 2 epochs each
    python bench/base_models.py --quick             # 2 MLP base models on digits, 2 epochs (the tests run it)

Trains ``--seeds`` base models (``--dataset``'s default model, ``--epochs`` epochs each) into a
fresh cache three ways: in this process one after another, as the sweep driver did before its base
models became Ray tasks -- once at one torch thread (the studies' setting) and once at torch's
default for this machine -- and through ``dpsm_ray.sweep.driver.with_base_models``, one Ray task
per seed holding a trial's CPU, as many at once as the Ray instance holds.  ``identical`` says
whether each way's weights are bit for bit those of the one-thread driver's: where they are, where
a base model trains changes its speed alone.  Ray is the one ``RAY_ADDRESS`` names, or one started
here (its start is not timed; its workers' start, importing torch and loading the data, is: a
sweep pays it).  One untimed base model first loads the data and warms the code in this process.

Prints one JSON line (every measurement, the machine) and then a table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from dpsm_ray.config import TrainConfig
from dpsm_ray.sweep.spec import SweepSpec
from dpsm_ray.train import resolve_base_model
from record import emit, machine, print_speed_table, with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

FULL = dict(dataset="fonts:train=1", seeds=4, epochs=2)
QUICK = dict(dataset="digits", seeds=2, epochs=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts (for CI): %s" % QUICK)
    parser.add_argument("--dataset", help=f"the base models' data (default: {FULL['dataset']}; quick: {QUICK['dataset']})")
    parser.add_argument("--seeds", type=int, help=f"base models, seeds 0..N-1 (default: {FULL['seeds']}; quick: {QUICK['seeds']})")
    parser.add_argument("--epochs", type=int, help=f"epochs of each (default: {FULL['epochs']}; quick: {QUICK['epochs']})")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = with_preset(parser.parse_args(argv), QUICK, FULL)
    if args.seeds < 1 or args.epochs < 1:
        parser.error(f"--seeds and --epochs must be >= 1; got {args.seeds} and {args.epochs}")
    return args


def weights(config: TrainConfig) -> dict[str, torch.Tensor]:
    return torch.load(config.init_checkpoint, weights_only=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dpsm_ray.sweep.driver import with_base_models
    from dpsm_ray.train.ray_session import ensure_ray, leaving_ray_as_it_was

    spec = SweepSpec(name="bench", base=TrainConfig(dataset=args.dataset, init="base", base_epochs=args.epochs, epochs=1), methods=("ce",))
    base = spec.base  # as a sweep has it (its split seed set)
    seeds = list(range(args.seeds))
    default_threads = torch.get_num_threads()
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as scratch, leaving_ray_as_it_was():
        # untimed: the data loaded and the code warmed once in this process, as a sweep's driver has them
        resolve_base_model(base.replace(seed=len(seeds), base_epochs=1, cache_dir=str(Path(scratch) / "warm-up")), log=lambda line: None)
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            cache = Path(scratch) / f"driver-{threads}"
            started = time.perf_counter()
            made = {seed: resolve_base_model(base.replace(seed=seed, cache_dir=str(cache)), log=lambda line: None) for seed in seeds}
            seconds = time.perf_counter() - started
            states = {seed: weights(config) for seed, config in made.items()}
            reference = states if reference is None else reference
            rows.append({"how": f"driver, one after another, {threads} thread{'s' if threads > 1 else ''}", "seconds": seconds,
                         "identical": all(all(torch.equal(states[s][k], reference[s][k]) for k in reference[s]) for s in seeds)})
        torch.set_num_threads(default_threads)
        session = ensure_ray(worker_output=False)
        import ray

        cpus = int(ray.cluster_resources().get("CPU", 0))
        started = time.perf_counter()
        made = with_base_models(spec, seeds, Path(scratch) / "tasks", lambda line: None)
        seconds = time.perf_counter() - started
        states = {seed: weights(config) for seed, config in made.items()}
        rows.append({"how": f"Ray tasks, 1 CPU each, side by side on {cpus} CPUs", "seconds": seconds,
                     "identical": all(all(torch.equal(states[s][k], reference[s][k]) for k in reference[s]) for s in seeds)})
        del session
    record = {"benchmark": "base_models", "quick": args.quick, "seeds": args.seeds, "epochs": args.epochs, "dataset": args.dataset,
              "model": base.resolved_model(), "default_threads": default_threads,
              "machine": machine(),
              "results": rows}
    emit(record, args.json_out)
    print_speed_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
