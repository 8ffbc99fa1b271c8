"""What a sweep script checks before torch and Ray load (importing them takes seconds on a busy
machine, this module a few milliseconds): storage the service cannot use.

A sweep reads and writes its results directory, and its trials read the dataset, with plain file
operations from every node, so both must be paths on a file system mounted at the same place on
every node; Optuna's studies live in SQLite or a database that SQLAlchemy reaches.  An object-store
URI such as ``s3://bucket/x`` given as a path would otherwise become a local folder ``./s3:``.
"""

from __future__ import annotations

import os
import re
import sys

OPTUNA_STORAGE_ENV = "DPSM_RAY_OPTUNA_STORAGE"  # as dpsm_ray.sweep.spec (not imported: it loads torch)
STORAGE_OPTIONS = ("results_dir", "data_root", "optuna_storage")
URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# SQLAlchemy's own dialects; third-party ones (cockroachdb, ...) register an entry point
SQL_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
ROUTES = ("supported: a directory on a file system mounted at the same path on every node (a local disk for one machine, NFS or "
          "similar for a cluster); for --optuna-storage, SQLite (sqlite:////abs/path/optuna.db) or a database URL (postgresql://..., mysql://...)")


def database_dialects() -> set[str]:
    from importlib.metadata import entry_points

    return set(SQL_DIALECTS) | {entry.name.split(".")[0] for entry in entry_points(group="sqlalchemy.dialects")}


def storage_problem(option: str, value: str | None) -> str | None:
    """Why ``value`` of ``--results-dir``, ``--data-root`` or ``--optuna-storage`` is storage the
    service cannot use (one line naming the option, the value and the supported routes), or None."""
    match = URI.match(value or "")
    if match is None:
        return None
    scheme = match.group(1).lower()
    if option == "optuna_storage" and scheme.split("+")[0] in database_dialects():
        return None
    shown = re.sub(r"(://[^:/@\s]*):[^@\s]*@", r"\1:***@", value)  # never echo a password
    flag = "--" + option.replace("_", "-")
    return f"{flag} {shown}: {scheme}:// is not storage this service can use; {ROUTES}"


def check_storage(values: dict) -> None:
    """Raise ValueError for the first of ``values``' storage options the service cannot use."""
    for option in STORAGE_OPTIONS:
        problem = storage_problem(option, values.get(option))
        if problem is not None:
            raise ValueError(problem)


def option_values(argv: list[str], names=STORAGE_OPTIONS) -> dict:
    """The last value of each option ``names`` in ``argv`` (``--opt VALUE`` or ``--opt=VALUE``);
    a shallow reading of the command line, before argparse (which needs torch's config classes)."""
    found = {}
    flags = {"--" + name.replace("_", "-"): name for name in names}
    for i, word in enumerate(argv):
        if word == "--":
            break
        flag, equals, value = word.partition("=")
        if flag in flags and equals:
            found[flags[flag]] = value
        elif word in flags and i + 1 < len(argv):
            found[flags[word]] = argv[i + 1]
    return found


def refuse_unusable_storage(prog: str, argv: list[str]) -> None:
    """Exit 2 with one line when the command line names storage the service cannot use: the
    first thing a sweep script does, so the answer comes in a fraction of a second.  Everything
    else, abbreviated options included, is checked again once the parser has read it all."""
    values = {"optuna_storage": os.environ.get(OPTUNA_STORAGE_ENV), **option_values(argv)}
    try:
        check_storage(values)
    except ValueError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        sys.exit(2)
