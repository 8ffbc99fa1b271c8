"""Training throughput (images/s) on CIFAR-100-shaped data: the official-style pipeline against ours.

    python bench/throughput.py                       # the full benchmark on the GPU (bench/README.md's targets)
    python bench/throughput.py --device cpu --quick  # small sizes on CPU, under a minute (CI runs it)

Pipelines, each timed over whole training steps (forward of B1 + B2, objective, backward, SGD):
- ``official``: what the official DPSM code does -- a torchvision-style dataset of PIL images,
  RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor + Normalize in DataLoader worker
  processes, fp32, an eager step.
- ``ours``: uint8 images resident on the device, crop and flip as batched tensor ops
  (``dpsm_ray.data.augment``), bf16 autocast and channels_last on CUDA, and the whole step
  captured in one CUDA graph (``dpsm_ray.train.step.GraphStep``); on CPU the same data path with
  the eager fp32 step.
- ``packed``: P processes, each running ``ours`` for one trial, sharing the device; the figure is
  their aggregate images/s.
- ``compiled`` (only with ``--pipelines``): ``ours`` with the model ``torch.compile``d
  (``--compile-mode``; ``reduce-overhead`` adds CUDA graphs) in the eager step, the objective and
  optimizer as they are; its warmup steps include the compilation.

Prints one JSON line (every measurement, the summary ratios, the machine) and then a table.
A measurement that fails is recorded with its error and the benchmark goes on.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback

import numpy as np
import torch

from dpsm_ray.collective import LocalCollective
from dpsm_ray.data.vision import CIFAR100_MEAN, CIFAR100_STD, cifar100_transform
from dpsm_ray.cards import build_model
from dpsm_ray.cards import METHODS, PAPER_METHODS, build_objective
from dpsm_ray.train.step import EagerStep, GraphStep
from record import emit, listed, with_preset  # bench/record.py (bench/ is on the path of python bench/NAME.py)

CLASSES = 100
FULL = dict(models="resnet110,densenet100", methods=",".join(PAPER_METHODS), batches="64,128", packs="1,2,4,8", steps=50, warmup=10, images=50000)
QUICK = dict(models="resnet20", methods=",".join(PAPER_METHODS), batches="32", packs="1,2", steps=3, warmup=1, images=256)
PIPELINES = ("official", "ours", "compiled")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (for CPU and CI): %s" % QUICK)
    for name in ("models", "methods", "batches", "packs"):
        parser.add_argument(f"--{name}", help=f"comma-separated (default: {FULL[name]}; quick: {QUICK[name]}; --packs 0: none)")
    parser.add_argument("--pipelines", default="official,ours", help=f"comma-separated, of {', '.join(PIPELINES)} (default: %(default)s)")
    parser.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile's mode for the compiled pipeline (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, help="untimed steps first (graph capture, cuDNN autotuning)")
    parser.add_argument("--images", type=int, help="images in the synthetic CIFAR-100-shaped dataset")
    parser.add_argument("--loader-workers", type=int, default=min(8, os.cpu_count() or 1), help="DataLoader processes of the official pipeline (default: %(default)s)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    with_preset(args, QUICK, FULL)
    args.models = args.models.split(",")
    args.methods = args.methods.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.packs = [int(p) for p in args.packs.split(",") if int(p) > 0]
    args.pipelines = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    if unknown := [p for p in args.pipelines if p not in PIPELINES]:
        parser.error(f"--pipelines: unknown {', '.join(unknown)}; allowed: {', '.join(PIPELINES)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        parser.error(f"--methods: unknown {', '.join(bad)}; allowed: {', '.join(METHODS)}")
    for name in ("steps", "images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if min(args.batches) < 2 or any(b % 2 for b in args.batches) or max(args.batches) > args.images:
        parser.error(f"--batches must be even, >= 2 and at most --images {args.images}; got {args.batches}")
    return args


def synthetic_cifar(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``[N, 32, 32, 3]`` (CIFAR's own layout) and labels in 0..99."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8), rng.integers(0, CLASSES, size=count)


class PILCifar(torch.utils.data.Dataset):
    """What torchvision's ``CIFAR100.__getitem__`` does: a PIL image per example, then transforms."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        from torchvision import transforms

        self.images, self.labels = images, labels
        self.transform = transforms.Compose([
            transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize(CIFAR100_MEAN, CIFAR100_STD),
        ])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.images[index])), int(self.labels[index])


def make_trial(model_name: str, method: str, device: torch.device, channels_last: bool):
    torch.manual_seed(0)
    model = build_model(model_name, CLASSES).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    objective = build_objective(method, alpha=0.1, conformal_weight=0.5, sigmoid_temperature=0.1, sort_temperature=0.01, quantile_lr=0.01, collective=LocalCollective())
    objective.initialize(torch.rand(1000, device=device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    return model, objective, optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(batches, step_of, warmup: int, steps: int, batch: int, device: torch.device, barrier=None) -> dict:
    """Run ``warmup`` then ``steps`` steps; images/s over the timed ones."""
    step = None
    for i in range(warmup + steps):
        x1, y1, x2, y2 = next(batches)
        if step is None:
            step = step_of((x1, y1, x2, y2))
        if i == warmup:
            synchronize(device)
            if barrier is not None:
                barrier.wait()
            started = time.perf_counter()
        stats = step(x1, y1, x2, y2)
    float(stats["upper"])  # waits for the last step
    synchronize(device)
    seconds = time.perf_counter() - started
    return {"images": steps * batch, "seconds": seconds, "images_per_s": steps * batch / seconds, "step_ms": 1000 * seconds / steps}


def official_batches(images, labels, batch: int, device: torch.device, workers: int):
    loader = torch.utils.data.DataLoader(
        PILCifar(images, labels), batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
        pin_memory=device.type == "cuda", persistent_workers=workers > 0,
    )
    while True:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            half = batch // 2
            yield x[:half], y[:half], x[half:], y[half:]


def our_batches(images, labels, batch: int, device: torch.device):
    """Device-resident uint8 images, two halves drawn at random, augmented as tensor ops."""
    stored = torch.as_tensor(images).permute(0, 3, 1, 2).contiguous().to(device)  # [N, 3, 32, 32]
    targets = torch.as_tensor(labels).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    half = batch // 2
    seed = 0
    while True:
        ids = torch.randint(0, stored.shape[0], (batch,), device=device, generator=generator)
        x = cifar100_transform(stored[ids], ids, True, seed)
        seed += 1
        yield x[:half], targets[ids[:half]], x[half:], targets[ids[half:]]


def fast_settings(device: torch.device) -> dict:
    """Our step on this device: the captured bf16 channels_last step on CUDA, eager fp32 on CPU."""
    if device.type == "cuda":
        return {"step": "graph", "precision": "bf16", "channels_last": True}
    return {"step": "eager", "precision": "fp32", "channels_last": False}


def measure(pipeline: str, model_name: str, method: str, batch: int, args, data, barrier=None) -> dict:
    device = torch.device(args.device)
    row = {"pipeline": pipeline, "model": model_name, "method": method, "batch": batch}
    settings = {"step": "eager", "precision": "fp32", "channels_last": False} if pipeline == "official" else fast_settings(device)
    if pipeline == "compiled":
        settings = {**settings, "step": "eager", "compile_mode": args.compile_mode}
    row.update(settings)
    try:
        model, objective, optimizer = make_trial(model_name, method, device, settings["channels_last"])
        if pipeline == "compiled":
            model = torch.compile(model, mode=args.compile_mode)
        kwargs = {"precision": settings["precision"], "channels_last": settings["channels_last"]}
        if settings["step"] == "graph":
            step_of = lambda example: GraphStep(model, objective, optimizer, example, **kwargs)  # noqa: E731
        else:
            step_of = lambda example: EagerStep(model, objective, optimizer, **kwargs)  # noqa: E731
        batches = official_batches(*data, batch, device, args.loader_workers) if pipeline == "official" else our_batches(*data, batch, device)
        row.update(timed(batches, step_of, args.warmup, args.steps, batch, device, barrier))
    except Exception as error:  # a failed measurement is reported, not fatal
        if barrier is not None:
            barrier.abort()
        row["error"] = f"{type(error).__name__}: {error}"
        row["traceback"] = traceback.format_exc(limit=4)
    return row


def packed_worker(args, model_name, method, batch, barrier, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(args.packs)))
    data = synthetic_cifar(args.images)
    queue.put(measure("ours", model_name, method, batch, args, data, barrier))


def measure_packed(args, model_name: str, method: str, batch: int, packs: int) -> dict:
    """``packs`` processes, each one trial; they start timing together (a barrier)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    barrier, queue = context.Barrier(packs), context.Queue()
    processes = [context.Process(target=packed_worker, args=(args, model_name, method, batch, barrier, queue)) for _ in range(packs)]
    for process in processes:
        process.start()
    rows = [queue.get() for _ in processes]
    for process in processes:
        process.join()
    row = {"pipeline": "packed", "model": model_name, "method": method, "batch": batch, "packs": packs, **fast_settings(torch.device(args.device))}
    errors = [r["error"] for r in rows if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row
    seconds = max(r["seconds"] for r in rows)
    row.update(images=sum(r["images"] for r in rows), seconds=seconds, images_per_s=sum(r["images"] for r in rows) / seconds,
               per_trial_images_per_s=[round(r["images_per_s"], 1) for r in rows])
    return row


def summary(rows: list[dict], args) -> dict:
    """The issue's target ratios, from the measurements that exist."""

    def rate(pipeline, model, method, batch, packs=None):
        for r in rows:
            if (r["pipeline"], r["model"], r["method"], r["batch"], r.get("packs")) == (pipeline, model, method, batch, packs) and "images_per_s" in r:
                return r["images_per_s"]
        return None

    out = {}
    model, batch = args.models[0], max(args.batches)
    for method in args.methods:
        ours, official = rate("ours", model, method, batch), rate("official", model, method, batch)
        if ours and official:
            out[f"speedup_{method}_{model}_b{batch}"] = ours / official
    for method in args.methods:
        ours, compiled = rate("ours", model, method, batch), rate("compiled", model, method, batch)
        if ours and compiled:
            out[f"compiled_over_ours_{method}_{model}_b{batch}"] = compiled / ours
    if rate("ours", model, "ce", batch) and rate("ours", model, "dpsm", batch):
        out[f"dpsm_step_cost_vs_ce_{model}_b{batch}"] = rate("ours", model, "ce", batch) / rate("ours", model, "dpsm", batch) - 1
    packed = [r for r in rows if r["pipeline"] == "packed" and "images_per_s" in r]
    if packed:
        best = max(packed, key=lambda r: r["images_per_s"])
        out[f"packed_best_{best['model']}_b{best['batch']}"] = {"packs": best["packs"], "images_per_s": best["images_per_s"]}
    return out


def table(rows: list[dict]) -> str:
    header = f"{'pipeline':<9} {'model':<12} {'method':<7} {'batch':>5} {'packs':>5} {'step':<6} {'prec':<5} {'images/s':>10} {'ms/step':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        result = f"{r['images_per_s']:>10.0f} {r['step_ms']:>9.1f}" if "step_ms" in r else (f"{r['images_per_s']:>10.0f} {'':>9}" if "images_per_s" in r else f"  failed: {r['error'][:60]}")
        step = "comp" if r["pipeline"] == "compiled" else r["step"]
        lines.append(f"{r['pipeline']:<9} {r['model']:<12} {r['method']:<7} {r['batch']:>5} {r.get('packs', 1):>5} {step:<6} {r['precision']:<5} {result}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    data = synthetic_cifar(args.images)
    rows = []
    for model_name in args.models:
        for batch in args.batches:
            for method in args.methods:
                for pipeline in args.pipelines:
                    rows.append(measure(pipeline, model_name, method, batch, args, data))
                    print(f"[bench] {table(rows[-1:]).splitlines()[-1]}", file=sys.stderr, flush=True)
    pack_method = "dpsm" if "dpsm" in args.methods else args.methods[0]
    for packs in args.packs:
        rows.append(measure_packed(args, args.models[0], pack_method, max(args.batches), packs))
        print(f"[bench] {table(rows[-1:]).splitlines()[-1]}", file=sys.stderr, flush=True)
    record = {
        "benchmark": "throughput", "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick, "steps": args.steps, "warmup": args.warmup, "images": args.images,
        "loader_workers": args.loader_workers, "results": [{k: v for k, v in r.items() if k != "traceback"} for r in rows],
        "summary": summary(rows, args), "failed": sum("error" in r for r in rows), "seconds": time.perf_counter() - started,
    }
    emit(record, args.json_out)
    print(table(rows))
    for key, value in record["summary"].items():
        print(f"{key}: {value}")
    for r in rows:
        if "traceback" in r:
            print(f"\n{r['pipeline']} {r['model']} {r['method']} b{r['batch']} failed:\n{r['traceback']}", file=sys.stderr)
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
