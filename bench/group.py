"""A trial group's members side by side, each on a CUDA stream of its own, against one trial's
captured step: aggregate training images/s of N members in one process.

    python bench/group.py                        # on the GPU: ResNet-110, DPSM, batch 128, bf16, channels_last, N = 1, 2, 4, 8
    python bench/group.py --device cpu --quick   # small sizes on a CPU, where the members run one after another

Measurements, in this order, in one process (each printed as a ``[group]`` line as it ends):

- ``single``: one trial's step on the device's current stream, as ``bench/throughput.py``'s
  ``ours`` runs it (uint8 data on the device, GPU crop and flip, the whole step captured in one
  CUDA graph, bf16 autocast, channels_last; eager fp32 on a CPU): the baseline.
- ``step`` for each N: N members, each with its own model, objective, optimizer, data on the device
  and captured step, stepped round by round from this one host thread, each member's batch and
  step in its lane (``dpsm_ray.train.group.side_by_side``: its own CUDA stream).
- ``overlap`` (CUDA only): a profiler trace of a few rounds of min(4, largest N) members: the
  share of the time kernels ran during which kernels of two or more streams ran at once (0 when the
  members' steps never overlap; ``--trace FILE`` keeps the trace, gzipped).
- ``end_to_end`` for each N: ``dpsm_ray.train.group.train_group``, the loop ``dpsm-ray train``
  runs (data, steps, diagnostics, validation, a checkpoint every epoch), of N members (seeds
  0..N-1) on generated CIFAR-100 files: the N members' training images of the last epoch over its
  wall time, and its ratio to the ``step`` figure of the same N.
- ``sync_points`` (CUDA only): one member of the end-to-end run (two epochs) under torch's sync
  debug mode: every call that made the host wait for the device, counted by the line of
  ``dpsm_ray`` that made it, those inside an epoch's steps (``train_epoch``) apart, and how many
  training steps ran.  A wait in every step serialises a group's members: the host cannot queue
  member k+1's step until member k's has run.
- ``step`` again with ``torch.backends.cudnn.benchmark`` on (``--cudnn-benchmark``), set before
  the members are built and captured.

A measurement that would start after ``--budget-s`` is skipped (recorded so), so that the whole
fits in one device call; one that fails is recorded with its error and the next one runs.  Prints
one JSON line (every measurement, the summary, the machine) and then a table.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from record import emit  # noqa: E402
from throughput import fast_settings, make_trial, our_batches, synthetic_cifar, timed  # noqa: E402

from dpsm_ray.config import TrainConfig  # noqa: E402
from dpsm_ray.train.env import LocalEnv  # noqa: E402
from dpsm_ray.train.group import Lane, side_by_side, train_group  # noqa: E402
from dpsm_ray.train.step import EagerStep, GraphStep  # noqa: E402

FULL = dict(model="resnet110", method="dpsm", batch=128, members="1,2,4,8", rounds=30, warmup=5, images=50000, files=(50000, 10000),
            train_subset=20000, epochs=2, trace_rounds=3, budget_s=480.0)
QUICK = dict(model="lenet", method="dpsm", batch=32, members="1,2", rounds=3, warmup=1, images=256, files=(200, 100), train_subset=64,
             epochs=1, trace_rounds=1, budget_s=480.0)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/group.py", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help=f"small sizes (for a CPU): {QUICK}")
    parser.add_argument("--members", help=f"comma-separated group sizes N (default: {FULL['members']}; quick: {QUICK['members']})")
    parser.add_argument("--rounds", type=int, help="timed rounds (one step of every member) per step measurement")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (graph capture, cuDNN's set-up)")
    parser.add_argument("--epochs", type=int, help="epochs of each end-to-end member (the last one is timed)")
    parser.add_argument("--train-subset", type=int, help="training images of each end-to-end member")
    parser.add_argument("--cudnn-benchmark", choices=("off", "on", "off,on"), help="step measurements without and with cudnn.benchmark "
                        "(default: off,on on CUDA, off on a CPU)")
    parser.add_argument("--budget-s", type=float, help="skip the measurements that would start after this many seconds")
    parser.add_argument("--trace", metavar="FILE", help="keep the overlap check's profiler trace here (gzipped chrome trace)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in ("members", "rounds", "warmup", "epochs", "train_subset", "budget_s"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.model, args.method, args.batch, args.images = preset["model"], preset["method"], preset["batch"], preset["images"]
    args.files, args.trace_rounds = preset["files"], preset["trace_rounds"]
    try:
        args.members = [int(n) for n in str(args.members).split(",")]
    except ValueError:
        parser.error(f"--members must be comma-separated integers; got {args.members!r}")
    if min(args.members) < 1:
        parser.error(f"--members must be >= 1 each; got {args.members}")
    for name in ("rounds", "epochs", "train_subset"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device")
    if args.cudnn_benchmark is None:
        args.cudnn_benchmark = "off,on" if args.device.startswith("cuda") else "off"
    args.cudnn_benchmark = [value == "on" for value in args.cudnn_benchmark.split(",")]
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Members:
    """``count`` trials of ``bench/throughput.py``'s ``ours``, each built in its own lane: a
    callable per member that draws its next batch (from its own data on the device) and steps."""

    def __init__(self, args, count: int, data, device: torch.device) -> None:
        settings = fast_settings(device)
        self.lanes = [Lane(device) for _ in range(count)]
        self.turns = []
        for lane in self.lanes:
            with lane.turn():
                model, objective, optimizer = make_trial(args.model, args.method, device, settings["channels_last"])
                self.turns.append(self.turn(model, objective, optimizer, our_batches(*data, args.batch, device), settings))

    @staticmethod
    def turn(model, objective, optimizer, batches, settings):
        step = None

        def run():
            nonlocal step
            batch = next(batches)
            if step is None:
                kwargs = {"precision": settings["precision"], "channels_last": settings["channels_last"]}
                step = GraphStep(model, objective, optimizer, batch, **kwargs) if settings["step"] == "graph" else \
                    EagerStep(model, objective, optimizer, **kwargs)
            return step(*batch)

        return run

    def round(self) -> list[dict]:
        return side_by_side(self.turns, self.lanes)


def measure_single(args, data, device) -> dict:
    model, objective, optimizer = make_trial(args.model, args.method, device, fast_settings(device)["channels_last"])
    settings = fast_settings(device)
    kwargs = {"precision": settings["precision"], "channels_last": settings["channels_last"]}
    if settings["step"] == "graph":
        step_of = lambda example: GraphStep(model, objective, optimizer, example, **kwargs)  # noqa: E731
    else:
        step_of = lambda example: EagerStep(model, objective, optimizer, **kwargs)  # noqa: E731
    return {**settings, **timed(our_batches(*data, args.batch, device), step_of, args.warmup, args.rounds, args.batch, device)}


def measure_step(args, count: int, data, device) -> dict:
    members = Members(args, count, data, device)
    for _ in range(max(1, args.warmup)):
        members.round()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(args.rounds):
        stats = members.round()
    for member_stats in stats:
        float(member_stats["upper"])  # waits for each member's last step
    synchronize(device)
    seconds = time.perf_counter() - started
    images = args.rounds * args.batch * count
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds, "round_ms": 1000 * seconds / args.rounds}


def kernel_intervals(trace: dict) -> list[tuple[float, float, int]]:
    """``(start, end, stream)`` in microseconds of every GPU kernel of a chrome trace (torch.profiler's export)."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"]["stream"])) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") == "kernel" and "stream" in e.get("args", {})]


def concurrency(kernels: list[tuple[float, float, int]]) -> dict:
    """How much the streams' kernels overlap: ``busy_us``, the time any kernel ran; ``concurrent_us``,
    the time kernels of two or more streams ran at once; their ratio; the streams seen."""
    edges = sorted([(start, 1, stream) for start, _, stream in kernels] + [(end, -1, stream) for _, end, stream in kernels])
    running: collections.Counter = collections.Counter()
    busy = concurrent = 0.0
    last = None
    for at, change, stream in edges:  # at equal times ends (-1) come before starts: touching kernels do not overlap
        if last is not None:
            streams = sum(1 for count in running.values() if count > 0)
            busy += (at - last) if streams >= 1 else 0.0
            concurrent += (at - last) if streams >= 2 else 0.0
        running[stream] += change
        last = at
    return {"kernels": len(kernels), "streams": len({stream for _, _, stream in kernels}), "busy_us": busy, "concurrent_us": concurrent,
            "concurrent_share": concurrent / busy if busy else 0.0}


def measure_overlap(args, count: int, data, device, trace_path: str | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    members = Members(args, count, data, device)
    for _ in range(max(1, args.warmup)):
        members.round()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(args.trace_rounds):
            members.round()
        synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if trace_path:
            with open(path, "rb") as source, gzip.open(trace_path, "wb") as target:
                shutil.copyfileobj(source, target)
    return {"members": count, "rounds": args.trace_rounds, **concurrency(kernel_intervals(trace))}


class Timed(LocalEnv):
    """A member's env for the end-to-end run: a LocalEnv (a checkpoint every epoch) noting when it reported each epoch."""

    def __init__(self, device: torch.device, checkpoint: Path) -> None:
        super().__init__(device, checkpoint, log=lambda line: None)
        self.reported: dict[int, float] = {}

    def report(self, row: dict, checkpoint: dict | None, epochs: list[dict] | None = None) -> None:
        super().report(row, checkpoint, epochs)
        self.reported[row["epoch"]] = time.perf_counter()


def measure_end_to_end(args, count: int, data_root: Path, device) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        configs = [TrainConfig(dataset="cifar100", data_root=str(data_root), model=args.model, method=args.method, init="scratch",
                               epochs=args.epochs, batch_size=args.batch, seed=seed, train_subset=args.train_subset, device=str(device),
                               eval_splits=2, data_workers=0) for seed in range(count)]
        envs = [Timed(device, Path(folder) / str(seed) / "checkpoint.pt") for seed in range(count)]
        started = time.perf_counter()
        outcomes = train_group(list(zip(configs, envs)))
    errors = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    if errors:
        return {"error": errors[0]}
    last = args.epochs
    # the last epoch of all the members: from the first member's end of the epoch before (or the
    # group's start) to the last member's end of it, each member's evaluation and checkpoint included
    since = min(env.reported[last - 1] for env in envs) if last > 1 else started
    seconds = max(env.reported[last] for env in envs) - since
    images = count * configs[0].steps_per_epoch(args.train_subset) * args.batch
    steps_seconds = max(outcome.epochs[-1]["train_seconds"] for outcome in outcomes)
    return {"images": images, "seconds": seconds, "images_per_s": images / seconds, "steps_images_per_s": images / steps_seconds,
            "epochs": args.epochs, "train_subset": args.train_subset, "val_set_size": [round(o.epochs[-1]["val_set_size"], 3) for o in outcomes]}


def measure_sync_points(args, data_root: Path, device) -> dict:
    import traceback as tb
    import warnings

    from dpsm_ray.train.loop import training

    package = str(ROOT / "dpsm_ray")
    sites: collections.Counter = collections.Counter()
    in_steps: collections.Counter = collections.Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in tb.extract_stack()[:-1] if f.filename.startswith(package)]
        where = f"{Path(ours[-1].filename).relative_to(ROOT)}:{ours[-1].lineno} ({ours[-1].name})" if ours else f"{filename}:{lineno}"
        sites[where] += 1
        if any(f.name == "train_epoch" for f in ours):
            in_steps[where] += 1

    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig(dataset="cifar100", data_root=str(data_root), model=args.model, method=args.method, init="scratch",
                             epochs=args.epochs, batch_size=args.batch, seed=0, train_subset=args.train_subset, device=str(device),
                             eval_splits=2, data_workers=0)
        run, steps = training(config, Timed(device, Path(folder) / "checkpoint.pt")), 0
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown, warnings.showwarning = warnings.showwarning, note
            torch.cuda.set_sync_debug_mode("warn")
            try:
                while True:
                    next(run)
                    steps += 1
            except StopIteration:
                pass
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown
    return {"steps": steps, "epochs": args.epochs, "sites": dict(sites.most_common()),
            "in_steps": dict(in_steps.most_common())}


def measured(kind: str, row: dict, work, started: float, args) -> dict:
    """``row`` with what ``work()`` measured, its error, or its skip (past ``--budget-s``); printed as it ends."""
    row = {"measurement": kind, **row}
    if time.perf_counter() - started > args.budget_s:
        row["skipped"] = f"past --budget-s {args.budget_s:g}"
    else:
        try:
            row.update(work())
        except Exception as error:  # a failed measurement is recorded, the next one runs
            row["error"] = f"{type(error).__name__}: {error}"
            row["traceback"] = traceback.format_exc(limit=6)
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(f"[group] {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}", file=sys.stderr, flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    """Each figure against one trial's captured step (``single``), and end to end against the group's step."""
    def rate(kind, members=None, cudnn=False):
        return next((r["images_per_s"] for r in rows if r["measurement"] == kind and r.get("members") == members
                     and r.get("cudnn_benchmark", False) == cudnn and "images_per_s" in r), None)

    out = {}
    single = rate("single", 1)
    if single:
        out["single_images_per_s"] = single
    for r in rows:
        if r["measurement"] == "step" and "images_per_s" in r and single:
            out[f"step_{r['members']}_over_single" + ("_cudnn_benchmark" if r["cudnn_benchmark"] else "")] = r["images_per_s"] / single
        if r["measurement"] == "end_to_end" and "images_per_s" in r:
            step = rate("step", r["members"])
            if step:
                out[f"end_to_end_{r['members']}_over_step"] = r["images_per_s"] / step
            if single:
                out[f"end_to_end_{r['members']}_over_single"] = r["images_per_s"] / single
        if r["measurement"] == "overlap" and "concurrent_share" in r:
            out[f"overlap_{r['members']}_concurrent_share"] = r["concurrent_share"]
    return out


def table(rows: list[dict]) -> str:
    header = f"{'measurement':<12} {'N':>2} {'cudnn.bm':<8} {'images/s':>10}  notes"
    lines = [header, "-" * len(header)]
    for r in rows:
        if "skipped" in r or "error" in r:
            note = r.get("skipped") or f"failed: {r['error'][:70]}"
            figure = ""
        elif r["measurement"] == "sync_points":
            figure = ""
            note = (f"{sum(r['sites'].values())} host waits in {r['steps']} steps and their epochs' ends; within the steps: "
                    f"{', '.join(f'{where} x{count}' for where, count in r['in_steps'].items()) or 'none'}")
        elif r["measurement"] == "overlap":
            figure = ""
            note = f"{r['concurrent_share']:.1%} of kernel time with 2+ streams running ({r['streams']} streams, {r['kernels']} kernels)"
        else:
            figure = f"{r['images_per_s']:.0f}"
            note = f"{r['round_ms']:.1f} ms/round" if "round_ms" in r else \
                f"steps in the loop {r['steps_images_per_s']:.0f} images/s" if "steps_images_per_s" in r else f"{r.get('step_ms', 0):.1f} ms/step"
        cudnn = "on" if r.get("cudnn_benchmark") else "off"
        lines.append(f"{r['measurement']:<12} {r.get('members', 1):>2} {cudnn:<8} {figure:>10}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    data = synthetic_cifar(args.images)
    torch.backends.cudnn.benchmark = False
    rows = [measured("single", {"members": 1, "cudnn_benchmark": False}, lambda: measure_single(args, data, device), started, args)]
    for count in args.members:
        rows.append(measured("step", {"members": count, "cudnn_benchmark": False}, lambda: measure_step(args, count, data, device), started, args))
    if device.type == "cuda":
        count = min(4, max(args.members))
        rows.append(measured("overlap", {"members": count}, lambda: measure_overlap(args, count, data, device, args.trace), started, args))
    data_root = Path(tempfile.mkdtemp(prefix="bench_group_cifar100_"))
    try:
        from fake_datasets import write_cifar100

        write_cifar100(data_root, train=args.files[0], test=args.files[1])
        for count in args.members:
            rows.append(measured("end_to_end", {"members": count, "cudnn_benchmark": False},
                                 lambda: measure_end_to_end(args, count, data_root, device), started, args))
        if device.type == "cuda":
            rows.append(measured("sync_points", {"members": 1}, lambda: measure_sync_points(args, data_root, device), started, args))
    finally:
        shutil.rmtree(data_root, ignore_errors=True)
    if True in args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
        for count in args.members:
            rows.append(measured("step", {"members": count, "cudnn_benchmark": True}, lambda: measure_step(args, count, data, device),
                                 started, args))
        torch.backends.cudnn.benchmark = False
    record = {
        "benchmark": "group", "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "quick": args.quick, "model": args.model, "method": args.method, "batch": args.batch,
        "rounds": args.rounds, "warmup": args.warmup, "rows": [{k: v for k, v in r.items() if k != "traceback"} for r in rows],
        "summary": summary(rows), "failed": sum("error" in r for r in rows), "skipped": sum("skipped" in r for r in rows),
        "seconds": time.perf_counter() - started,
    }
    emit(record, args.json_out)
    print(table(rows))
    for key, value in record["summary"].items():
        print(f"{key}: {value:.4g}")
    for r in rows:
        if "traceback" in r:
            print(f"\n{r['measurement']} N={r.get('members')} failed:\n{r['traceback']}", file=sys.stderr)
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
