"""A sweep script's ``--config`` file, and what a sweep script checks before torch and Ray load
(importing them takes seconds on a busy machine, this module a few milliseconds): storage the
service cannot use.

``--config FILE.yaml`` (or ``.json``) holds any option of the script, named as on the command line
with or without the dashes (``results_dir: ...``, ``trials: 8``, ``range: [lambda=0.01:1]``);
options given on the command line override it.  The ``sweep.json`` a sweep writes is such a file:
its spec fields (``base``, ``ranges``, ``grid_fixed`` ...) map back to the options that made them,
and its records (``versions``, ``studies``, ``ledger``) are ignored, so ``--config
RESULTS/sweep.json --results-dir NEW`` runs the same sweep again.

A sweep reads and writes its results directory, and its trials read the dataset, with plain file
operations from every node, so both must be paths on a file system mounted at the same place on
every node; Optuna's studies live in SQLite or a database that SQLAlchemy reaches.  An object-store
URI such as ``s3://bucket/x`` given as a path would otherwise become a local folder ``./s3:``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

GENERIC = "sweep"  # the name of the sweep ``dpsm-ray sweep`` runs, unless its --config names one
OPTUNA_STORAGE_ENV = "DPSM_RAY_OPTUNA_STORAGE"  # as dpsm_ray.sweep.spec (not imported: it loads torch)
_STORAGE_OPTIONS = ("results_dir", "data_root", "optuna_storage")
_TRACKERS = ("mlflow",)
URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# SQLAlchemy's own dialects; third-party ones (cockroachdb, ...) register an entry point
_SQL_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
_ROUTES = (
    "supported: a directory on a file system mounted at the same path on every node (a local disk for one machine, NFS or "
    "similar for a cluster); for --optuna-storage, SQLite (sqlite:////abs/path/optuna.db) or a database URL (postgresql://..., mysql://...)"
)


def _database_dialects() -> set[str]:
    from importlib.metadata import entry_points

    return set(_SQL_DIALECTS) | {entry.name.split(".")[0] for entry in entry_points(group="sqlalchemy.dialects")}


def masked(url: str) -> str:
    """A database URL as it may be shown or stored: its password replaced by ***."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: show its scheme only, never what may be a password
        return f"{url.partition('://')[0]}://..." if "://" in url else "(not a URL)"


def storage_problem(option: str, value: str | None) -> str | None:
    """Why ``value`` of ``--results-dir``, ``--data-root`` or ``--optuna-storage`` is storage the
    service cannot use (one line naming the option, the value and the supported routes), or None."""
    match = URI.match(value or "")
    if match is None:
        return None
    scheme = match.group(1).lower()
    if option == "optuna_storage" and scheme.split("+")[0] in _database_dialects():
        return None
    flag = "--" + option.replace("_", "-")
    return f"{flag} {masked(value)}: {scheme}:// is not storage this service can use; {_ROUTES}"


def check_storage(values: dict) -> None:
    """Raise ValueError for the first of ``values``' storage options the service cannot use."""
    for option in _STORAGE_OPTIONS:
        problem = storage_problem(option, values.get(option))
        if problem is not None:
            raise ValueError(problem)


def parse_tracking(text: str | None) -> tuple[str, str | None] | None:
    """``mlflow`` or ``mlflow=URI`` -> ("mlflow", URI or None); ValueError naming the option
    (and the install command when MLflow is missing)."""
    if text is None:
        return None
    tracker, equals, uri = text.partition("=")
    if tracker not in _TRACKERS or (equals and not uri):
        raise ValueError(f"--tracking {text!r}: expected mlflow or mlflow=URI (e.g. mlflow=http://127.0.0.1:5000)")
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        raise ValueError("--tracking mlflow needs MLflow, which is not installed: pip install -e '.[mlflow]'")
    return tracker, uri or None


# --- config files --------------------------------------------------------------------------

# sweep.json's records of how a sweep ran, not options: ignored in a config file
_RECORDS = ("ledger", "studies", "versions", "trial_resources", "data")
# sweep.json's base fields that the sweep derives from its options (dpsm_ray.sweep.spec.SweepSpec)
_DERIVED_BASE_FIELDS = ("seed", "evaluate_test", "method", "init_checkpoint", "cache_dir")


def _read_config_file(path: str | os.PathLike) -> dict:
    """A config file's mapping, keys with ``_`` for ``-`` (ValueError naming the file otherwise)."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--config {path}: expected a .yaml, .yml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as error:  # json.JSONDecodeError, yaml.YAMLError
        raise ValueError(f"--config {path}: not valid {path.suffix[1:].upper()} ({str(error).splitlines()[0]})") from None
    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    return {key.replace("-", "_"): value for key, value in data.items()}


def nearest(key: str, valid) -> str:
    return (difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.0) or ["?"])[0]


def version_line(name: str = "%(prog)s") -> str:
    """``dpsm-ray 0.1.0 (Python 3.11.2)``: known without importing torch or Ray (``--version``)."""
    from dpsm_ray import __version__

    return f"{name} {__version__} (Python {sys.version.split()[0]})"


def parse_strictly(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, where an unknown option is one line, exit 2, naming it and the
    nearest option of the command it was given to (a subcommand's, where ``parser`` has them and
    the namespace names its parser as ``parser``).  Build parsers with ``allow_abbrev=False``, so
    that ``--epoch 1`` is unknown rather than taken as ``--epochs``."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "parser", None) or parser
        flag = next((word for word in unknown if word.startswith("-")), unknown[0]).split("=", 1)[0]
        options = [name for name in command._option_string_actions if name.startswith("--")]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.7)
        hint = f"did you mean {close[0]}?" if close else f"{command.prog} --help lists its options"
        command.exit(2, f"{command.prog}: error: unrecognized arguments: {' '.join(unknown)}; {hint}\n")
    return args


def parse_with_config(parser: argparse.ArgumentParser, name: str, config_options, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; with ``--config FILE``, the file's values become the parser's defaults and
    the command line overrides them.  Exits 2 with one line on a bad file or an unknown key (named
    with the nearest valid one).  ``config_options``: the TrainConfig fields the script takes as
    options; the file's ``base`` may set any other TrainConfig field (``base_fields``)."""
    args = parse_strictly(parser, argv)
    if getattr(args, "config", None) is None:
        return args
    try:
        defaults = _config_defaults(parser, name, config_options, _read_config_file(args.config), args.config)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    parser.set_defaults(**defaults)
    return parse_strictly(parser, argv)


def _config_defaults(parser: argparse.ArgumentParser, name: str, config_options, data: dict, path) -> dict:
    """The parser defaults (``dest -> value``) that a config file's mapping ``data`` sets."""
    from dpsm_ray.config import config_specs

    actions = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    spec_keys = ("name", "base", "ranges", "grid_fixed", "grid_subsets", "arms")
    where = f"--config {path}"
    defaults: dict = {}
    for key, value in data.items():
        if key in _RECORDS:
            continue
        if key not in actions and key not in spec_keys:
            raise ValueError(f"{where}: unknown key {key!r}; did you mean {nearest(key, [*actions, *spec_keys, *_RECORDS])!r}?")
        if key == "arms":
            if value:
                raise ValueError(f"{where}: this file describes a study (its arms: {', '.join(value)}); run it with its study's script")
        elif key == "name":
            if name == GENERIC:
                defaults["sweep_name"] = value  # dpsm-ray sweep runs any sweep under its own name
            elif value != name:
                raise ValueError(f"{where}: this file describes a sweep named {value!r}, not one of {parser.prog}")
        elif key == "base":
            if not isinstance(value, dict):
                raise ValueError(f"{where}: base must be a mapping of training options")
            fields = set(config_specs()) - {"options"}
            base_fields = {}
            for field, setting in value.items():
                if field not in fields:
                    raise ValueError(f"{where}: unknown key 'base.{field}'; did you mean {'base.' + nearest(field, fields)!r}?")
                if field in _DERIVED_BASE_FIELDS or (field == "split_seed" and setting == data.get("seed", 0)):
                    continue
                if field == "download" or field in config_options:
                    defaults[field] = _option_value(actions[field], setting, f"{where}: base.{field}")
                else:
                    base_fields[field] = setting
            defaults["base_fields"] = base_fields
        elif key == "ranges":  # [[knob, {low, high, log}], ...] -> --range knob=low:high:log
            defaults["range"] = [f"{knob}={r['low']!r}:{r['high']!r}:{'log' if r.get('log', True) else 'linear'}" for knob, r in value]
        elif key == "grid_fixed":  # [[axis, value], ...] -> --fix axis=value
            defaults["fix"] = [f"{axis}={_axis_text(v)}" for axis, v in value]
        elif key == "grid_subsets":  # [[axis, [values]], ...] -> --subset axis=v1,v2
            defaults["subset"] = [f"{axis}={','.join(_axis_text(v) for v in values)}" for axis, values in value]
        elif key == "optuna_storage" and isinstance(value, str) and "***" in value:
            continue  # sweep.json's record of an external storage, its password masked: give --optuna-storage
        else:
            defaults[key] = _option_value(actions[key], value, f"{where}: {key}")
    return defaults


def _axis_text(value) -> str:
    """A grid value as --fix/--subset take it (milestones as 25+40)."""
    return "+".join(str(v) for v in value) if isinstance(value, (list, tuple)) else repr(value) if isinstance(value, float) else str(value)


def _option_value(action: argparse.Action, value, where: str):
    """A config file's ``value`` for an option, as argparse would have made it from the command line."""
    if value is None:
        return None
    if action.nargs == 0:  # a flag (store_true)
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false; got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):  # --range, --fix, --subset: a list, or one value
        return [str(v) for v in (value if isinstance(value, list) else [value])]
    if action.dest == "methods" and isinstance(value, list):
        value = ",".join(value)
    if action.dest == "grid" and isinstance(value, bool):  # sweep.json records grid as a boolean
        value = "paper" if value else None
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        raise ValueError(f"{where}: expected one value; got {value!r}")
    try:  # from the value's text, as on the command line: 2.5 is not an int
        value = (action.type or str)(value if isinstance(value, str) else str(value))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {value!r} is not a valid {getattr(action.type, '__name__', 'value')}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value
