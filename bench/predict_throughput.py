"""Prediction throughput (inputs/s) of a conformal predictor: the digits MLP and ResNet-110 on CIFAR-100-shaped inputs.

    python bench/predict_throughput.py                        # the GPU when there is one
    python bench/predict_throughput.py --device cpu --quick   # small counts, under a minute (CI runs it)

Each measurement times ``Predictor.predict_sets`` end to end on raw inputs already in memory -- the
preprocessing, the forward pass in eval mode, the softmax, the score and the threshold, the sets as
a mask and as lists -- over ``--batches`` calls of ``batch`` inputs each, after ``--warmup`` untimed
calls.  The predictors are built as a sweep's are (the dataset's own input description, a model
of the dataset's architecture) with random weights, calibrated on random labels: the work per
input does not depend on the weights.

Prints one JSON line (every measurement, the machine) and then a table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from dpsm_ray.cards import score_names
from dpsm_ray.cards import build_model
from dpsm_ray.predict.predictor import Predictor
from record import emit, listed, with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

MODELS = {  # name -> (architecture, classes, where its input description comes from)
    "mlp": ("mlp", 10, "digits"),
    "resnet110": ("resnet110", 100, "cifar100"),
}
FULL = dict(models="mlp,resnet110", batch_sizes="mlp:512,resnet110:128", scores="hps,aps", batches=50, warmup=5)
QUICK = dict(models="mlp,resnet110", batch_sizes="mlp:512,resnet110:32", scores="hps,aps", batches=3, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help="small counts (for CPU and CI): %s" % QUICK)
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: {FULL['models']})")
    parser.add_argument("--batch-sizes", help=f"MODEL:SIZE,... inputs per predict_sets call (default: {FULL['batch_sizes']}; quick: {QUICK['batch_sizes']})")
    parser.add_argument("--scores", help=f"comma-separated, of hps, aps, raps (default: {FULL['scores']})")
    parser.add_argument("--batches", type=int, help=f"timed calls per measurement (default: {FULL['batches']}; quick: {QUICK['batches']})")
    parser.add_argument("--warmup", type=int, help="untimed calls first")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    with_preset(args, QUICK, FULL)
    args.models = listed(parser, "--models", args.models, MODELS)
    try:
        sizes = dict((name, int(size)) for name, size in (item.split(":") for item in args.batch_sizes.split(",")))
    except ValueError:
        parser.error(f"--batch-sizes must be MODEL:SIZE,...; got {args.batch_sizes!r}")
    missing = [m for m in args.models if m not in sizes]
    if missing or min(sizes.values()) < 1:
        parser.error(f"--batch-sizes needs a size >= 1 for every model; got {args.batch_sizes!r}")
    args.batch_sizes = sizes
    args.scores = args.scores.split(",")
    bad = [s for s in args.scores if s not in score_names()]
    if bad:
        parser.error(f"--scores: unknown {', '.join(bad)}; allowed: hps, aps, raps")
    if args.batches < 1 or args.warmup < 0:
        parser.error(f"--batches must be >= 1 and --warmup >= 0; got {args.batches} and {args.warmup}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    return args


def input_spec(dataset: str):
    if dataset == "digits":
        from dpsm_ray.cards import load_splits

        return load_splits("digits", seed=0).input_spec
    from dpsm_ray.data.vision import CIFAR100_INPUT

    return CIFAR100_INPUT


def raw_inputs(spec, count: int, generator: torch.Generator) -> torch.Tensor:
    """Random raw inputs in the dataset's own units: 8-bit pixels for CIFAR, 0..16 for the digits."""
    if spec.divisor == 255:
        return torch.randint(0, 256, (count, *spec.shape), generator=generator, dtype=torch.uint8)
    return torch.randint(0, int(spec.divisor) + 1, (count, *spec.shape), generator=generator).float()


def build_predictor(name: str, device: str) -> Predictor:
    architecture, classes, dataset = MODELS[name]
    spec = input_spec(dataset)
    torch.manual_seed(0)
    model = build_model(architecture, classes, input_shape=spec.shape)
    predictor = Predictor.create(model, architecture=architecture, input_spec=spec, num_classes=classes, alpha=0.1, device=device)
    generator = torch.Generator().manual_seed(1)
    calibration = raw_inputs(spec, 200, generator)
    return predictor.recalibrate(calibration, torch.randint(0, classes, (200,), generator=generator))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(predictor: Predictor, name: str, batch: int, score: str, args) -> dict:
    inputs = raw_inputs(predictor.input_spec, batch, torch.Generator().manual_seed(2))
    for _ in range(args.warmup):
        predictor.predict_sets(inputs, score, batch_size=batch)
    synchronize(args.device)
    started = time.perf_counter()
    for _ in range(args.batches):
        predictor.predict_sets(inputs, score, batch_size=batch)
    synchronize(args.device)
    seconds = time.perf_counter() - started
    count = batch * args.batches
    return {"model": name, "batch": batch, "score": score, "inputs": count, "seconds": seconds, "inputs_per_s": count / seconds,
            "ms_per_batch": 1000 * seconds / args.batches}


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<10} {'batch':>6} {'score':<6} {'inputs':>7} {'seconds':>8} {'inputs/s':>10} {'ms/batch':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<10} {r['batch']:>6} {r['score']:<6} {r['inputs']:>7} {r['seconds']:>8.3f} {r['inputs_per_s']:>10.0f} {r['ms_per_batch']:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rows = []
    for name in args.models:
        predictor = build_predictor(name, args.device)
        for score in args.scores:
            rows.append(measure(predictor, name, args.batch_sizes[name], score, args))
            print(f"[bench] {table(rows[-1:]).splitlines()[-1]}", file=sys.stderr, flush=True)
    record = {
        "benchmark": "predict_throughput", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "quick": args.quick, "batches": args.batches, "warmup": args.warmup,
        "results": rows, "seconds": time.perf_counter() - started,
    }
    emit(record, args.json_out)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
