"""How fast the front door answers: ``--help``, ``--version`` and argument errors of ``dpsm-ray``
and of a sweep script, each a fresh Python process (target: under 1 s; none may import torch or Ray).

    python bench/cli_startup.py            # 5 repeats of each command, the median reported
    python bench/cli_startup.py --repeats 2 --json-out startup.json

Each command is timed from process start to exit (wall clock, ``subprocess.run``); the JSON line
also says, for each command, whether torch, Ray, Optuna or pandas were imported (``-X importtime``).
Prints one JSON line and then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = str(ROOT / "sweeps" / "digits.py")
CLI = ["-m", "dpsm_ray.cli"]
COMMANDS = {  # name -> (arguments after the Python executable, the exit status it must give)
    "dpsm-ray --help": ([*CLI, "--help"], 0),
    "dpsm-ray --version": ([*CLI, "--version"], 0),
    "dpsm-ray train --help": ([*CLI, "train", "--help"], 0),
    "dpsm-ray train --alpha 2": ([*CLI, "train", "--alpha", "2"], 2),
    "dpsm-ray train --dataset foo": ([*CLI, "train", "--dataset", "foo"], 2),
    "sweeps/digits.py --help": ([SWEEP, "--help"], 0),
    "sweeps/digits.py --methods ce,foo": ([SWEEP, "--methods", "ce,foo"], 2),
    "sweeps/digits.py --alpha 2": ([SWEEP, "--alpha", "2"], 2),
}
HEAVY = ("torch", "ray", "optuna", "pandas")
TARGET_S = 1.0


def imported(arguments: list[str]) -> list[str]:
    """The heavy top-level packages the command imports."""
    result = subprocess.run([sys.executable, "-X", "importtime", *arguments], capture_output=True, text=True, cwd=ROOT)
    names = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    return sorted(name for name in HEAVY if name in names)


def measure(arguments: list[str], status: int, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, cwd=ROOT)
        seconds.append(time.perf_counter() - started)
        if result.returncode != status:
            raise SystemExit(f"{' '.join(arguments)}: exit {result.returncode}, expected {status}: {result.stderr[-500:]}")
    return {"median_s": statistics.median(seconds), "max_s": max(seconds), "repeats": repeats, "heavy_imports": imported(arguments)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command; the median is reported (default: %(default)s)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.exit(2, f"{parser.prog}: error: --repeats must be >= 1; got {args.repeats}\n")
    results = [{"command": name, **measure(arguments, status, args.repeats)} for name, (arguments, status) in COMMANDS.items()]
    record = {
        "benchmark": "cli_startup", "target_s": TARGET_S, "results": results,
        "slowest_s": max(r["median_s"] for r in results), "all_under_target": all(r["median_s"] < TARGET_S for r in results),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]},
    }
    line = json.dumps(record)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(f"{'command':<36} {'median s':>9} {'max s':>7}  heavy imports")
    for r in results:
        print(f"{r['command']:<36} {r['median_s']:>9.3f} {r['max_s']:>7.3f}  {', '.join(r['heavy_imports']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
