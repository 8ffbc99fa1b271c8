"""What the benchmarks here share: their sizes from a preset (``--quick`` or the full one) where an
option is not given, a comma-separated option checked against what it may name, and how each
ends -- its record as one JSON line on stdout, and, with ``--json-out FILE``, the same line
written to FILE whole or not at all (a temporary file renamed)."""

import json
import os


def emit(record: dict, json_out: str | None) -> None:
    line = json.dumps(record)
    print(line)
    if json_out:
        with open(json_out + ".tmp", "w") as file:
            file.write(line + "\n")
        os.replace(json_out + ".tmp", json_out)


def with_preset(args, quick: dict, full: dict):
    """``args`` with each option of the preset (``quick`` under --quick, else ``full``) that was not given."""
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def listed(parser, option: str, text: str, allowed) -> list[str]:
    """The names of a comma-separated ``option``; a parser error naming the first unknown ones and what is allowed."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in allowed]:
        parser.error(f"{option}: unknown {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return names


def machine() -> dict:
    """The machine a record was measured on: its CPU, its cores and torch's version."""
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__}


def print_speed_table(rows: list[dict]) -> None:
    """Rows of ``how``, ``seconds`` and ``identical`` (to the first row's result), each with its speed-up over the first."""
    first = rows[0]["seconds"]
    print(f"{'how':<48} {'seconds':>8} {'speed-up':>8} {'identical':>9}")
    for row in rows:
        print(f"{row['how']:<48} {row['seconds']:>8.1f} {first / row['seconds']:>7.2f}x {str(row['identical']):>9}")
