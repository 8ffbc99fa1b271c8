"""Stacked trials against separate ones: training images/s of N trials of one architecture.

    python bench/stacked.py                                   # on the GPU: ResNet-110, CIFAR-100 shaped, batch 128
    python bench/stacked.py --device cpu --quick              # LeNet, fonts shaped, under a minute

For each N: ``separate``, the N trials' eager steps one after another in one process (what one
process holding N trials would do; packed processes time-slice the same kernels), and ``stacked``,
one vmapped step of all N (``dpsm_ray.train.stacked.StackedTrials``: every kernel N times larger,
N times fewer).  On CUDA each is also measured captured in one CUDA graph and replayed
(``separate_graph``: the N trials' steps in one graph, as the service's captured step runs each;
``stacked_graph``): the eager paths are bound by the host's kernel launches, which capture removes.
Both train with CE and SGD on random data of the model's shape; fp32, or bf16 autocast with
``--precision bf16``.  Prints one JSON line, then a table; a measurement that fails (e.g. out of
memory) is recorded with its error and the benchmark goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from dpsm_ray.cards import build_model
from dpsm_ray.train.stacked import StackedTrials

FULL = dict(model="resnet110", classes=100, shape=(3, 32, 32), batch=128, trials="1,2,4,8", steps=20, warmup=5)
PATHS = ("separate", "stacked", "separate_graph", "stacked_graph")  # the captured two on CUDA only
QUICK = dict(model="lenet", classes=141, shape=(1, 32, 32), batch=64, trials="1,2,4", steps=5, warmup=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help=f"small sizes (for CPU): {QUICK}")
    parser.add_argument("--model", help=f"a model card (default: {FULL['model']}; quick: {QUICK['model']})")
    parser.add_argument("--batch", type=int, help="images per trial per step")
    parser.add_argument("--trials", help="comma-separated numbers of trials N")
    parser.add_argument("--steps", type=int, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in ("model", "batch", "trials", "steps", "warmup"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.classes, args.shape = preset["classes"], preset["shape"]
    args.trials = [int(n) for n in str(args.trials).split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    for name in ("batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if min(args.trials) < 1:
        parser.error(f"--trials must be >= 1 each; got {args.trials}")
    return args


def models(args, count: int, device: torch.device) -> list[torch.nn.Module]:
    built = []
    for seed in range(count):
        torch.manual_seed(seed)
        built.append(build_model(args.model, args.classes, input_shape=args.shape).to(device))
    return built


def captured(run_step, warmup: int):
    """``run_step`` captured in one CUDA graph after ``warmup`` eager steps on a side stream (at
    least one: SGD's momentum buffers exist before capture); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            run_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step()
    return graph.replay


def timed(run_step, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        run_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        run_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(args, path: str, count: int, device: torch.device) -> dict:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    x = torch.randn(count, args.batch, *args.shape, device=device)
    y = torch.randint(0, args.classes, (count, args.batch), device=device)
    trials = models(args, count, device)
    if path.startswith("separate"):
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4) for m in trials]

        def run_step():
            for i, (model, optimizer) in enumerate(zip(trials, optimizers)):
                optimizer.zero_grad(set_to_none=True)
                with autocast:
                    loss = F.cross_entropy(model(x[i]), y[i])
                loss.backward()
                optimizer.step()
    else:
        stacked = StackedTrials(trials, [0.1] * count, [0.9] * count, [5e-4] * count)
        losses = [F.cross_entropy] * count

        def run_step():
            with autocast:
                stacked.step(x, y, losses)

    if path.endswith("_graph"):
        run_step = captured(run_step, args.warmup)
    seconds = timed(run_step, args.steps, args.warmup, device)
    return {
        "path": path,
        "trials": count,
        "images_per_second": count * args.batch * args.steps / seconds,
        "step_ms": 1000 * seconds / args.steps,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    paths = PATHS if device.type == "cuda" else PATHS[:2]
    for count in args.trials:
        for path in paths:
            try:
                rows.append(measure(args, path, count, device))
            except Exception as error:  # noqa: BLE001 -- recorded, the benchmark goes on
                rows.append({"path": path, "trials": count, "error": f"{type(error).__name__}: {error}"[:500]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    machine = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads()}
    summary = {}
    for count in args.trials:
        pair = {row["path"]: row for row in rows if row["trials"] == count and "error" not in row}
        for suffix in ("", "_graph"):
            if f"stacked{suffix}" in pair and f"separate{suffix}" in pair:
                ratio = pair[f"stacked{suffix}"]["images_per_second"] / pair[f"separate{suffix}"]["images_per_second"]
                summary[f"stacked_over_separate{suffix}_{count}"] = ratio
    record = {"benchmark": "stacked", "model": args.model, "batch": args.batch, "precision": args.precision, "shape": list(args.shape),
              "classes": args.classes, "steps": args.steps, "machine": machine, "rows": rows, "summary": summary}
    line = json.dumps(record)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            handle.write(line + "\n")
    print(f"\n{args.model}, batch {args.batch} per trial, {args.precision}, on {machine['device']}")
    for suffix, words in (("", "eager"), ("_graph", "captured")):
        if not any(row["path"] == f"stacked{suffix}" for row in rows):
            continue
        print(f"{'N':>3}  {'separate img/s':>15}  {'stacked img/s':>14}  {'stacked / separate':>18}  ({words})")
        for count in args.trials:
            cells = {row["path"]: row for row in rows if row["trials"] == count}
            text = [f"{cells[p]['images_per_second']:.0f}" if "images_per_second" in cells[p] else "error" for p in (f"separate{suffix}", f"stacked{suffix}")]
            ratio = summary.get(f"stacked_over_separate{suffix}_{count}")
            print(f"{count:>3}  {text[0]:>15}  {text[1]:>14}  {f'{ratio:.2f}x' if ratio else '-':>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
