"""The eval-mode forward pass in chunks of each size: seconds, and whether the logits equal the first size's to the last bit.

    python bench/eval_batch.py                     # LeNet on fonts-shaped inputs, MLP+BN on Fashion-MNIST-shaped, CPU
    python bench/eval_batch.py --quick             # small counts, under a minute (the tests run it)

Times ``dpsm_ray.train.loop.predict`` -- what a run's diagnostics, validation and final evaluation
call, in chunks of ``EVAL_BATCH`` -- over ``--examples`` random inputs of each model's shape with
random weights (the work per input does not depend on them), at each ``--chunks`` size, on
``--threads`` torch threads (the studies run with 1).  Each size is timed ``--repeats`` times and
the fastest kept.  ``identical`` says whether that size's logits are bit for bit those of the
first size: where it holds, the chunk size is speed alone and changes no row a run writes.

Prints one JSON line (every measurement, the machine) and then a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

from dpsm_ray.cards import build_model
from dpsm_ray.data import Split, TensorSource
from dpsm_ray.train import LocalEnv
from dpsm_ray.train.loop import predict
from record import emit, listed, with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

MODELS = {  # name -> (architecture, classes, input shape): the studies' models
    "lenet": ("lenet", 141, (1, 32, 32)),  # fonts
    "mlp_bn": ("mlp_bn", 10, (1, 28, 28)),  # Fashion-MNIST
}
FULL = dict(models="lenet,mlp_bn", chunks="512,256,128,64", examples=8192, repeats=3)
QUICK = dict(models="lenet,mlp_bn", chunks="512,256", examples=600, repeats=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts (for CI): %s" % QUICK)
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: {FULL['models']})")
    parser.add_argument("--chunks", help=f"comma-separated chunk sizes, the first the reference (default: {FULL['chunks']})")
    parser.add_argument("--examples", type=int, help=f"inputs per timed pass (default: {FULL['examples']}; quick: {QUICK['examples']})")
    parser.add_argument("--repeats", type=int, help="timed passes per size; the fastest is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s, as the studies run)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    with_preset(args, QUICK, FULL)
    args.models = listed(parser, "--models", args.models, MODELS)
    try:
        args.chunks = [int(size) for size in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks must be comma-separated integers; got {args.chunks!r}")
    if min(args.chunks) < 1 or args.examples < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--chunks, --examples, --repeats and --threads must be >= 1")
    return args


def measure(name: str, args) -> list[dict]:
    import dpsm_ray.train.loop as loop

    architecture, classes, shape = MODELS[name]
    torch.manual_seed(0)
    model = build_model(architecture, classes, input_shape=shape)
    split = Split("test", torch.arange(args.examples), TensorSource(torch.rand(args.examples, *shape), torch.zeros(args.examples, dtype=torch.long)))
    env = LocalEnv(torch.device("cpu"), log=lambda line: None)
    default, rows, reference = loop.EVAL_BATCH, [], None
    try:
        for chunk in args.chunks:
            loop.EVAL_BATCH = chunk
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                logits = predict(model, split, torch.arange(args.examples), classes, env)
                best = min(best, time.perf_counter() - started)
            reference = logits if reference is None else reference
            rows.append({"model": name, "chunk": chunk, "examples": args.examples, "seconds": best,
                         "inputs_per_s": args.examples / best, "identical": bool(torch.equal(logits, reference))})
    finally:
        loop.EVAL_BATCH = default
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from dpsm_ray.train.loop import EVAL_BATCH

    rows = [row for name in args.models for row in measure(name, args)]
    record = {"benchmark": "eval_batch", "quick": args.quick, "threads": args.threads, "eval_batch": EVAL_BATCH,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__},
              "results": rows}
    emit(record, args.json_out)
    print(f"{'model':<8} {'chunk':>6} {'seconds':>8} {'inputs/s':>9} {'identical':>9}")
    for row in rows:
        print(f"{row['model']:<8} {row['chunk']:>6} {row['seconds']:>8.3f} {row['inputs_per_s']:>9.0f} {str(row['identical']):>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
