"""The results directory's one owner: where everything lives in it, and the one reader of each file
(docs/results.md).  Everything else asks this module for a path or a file's content.

    RESULTS/sweep.json                    the sweep's settings (``read_sweep``, ``read_sweep_settings``)
    RESULTS/study.json                    an earlier release's study settings (read, never written: a study is
                                          a sweep now, its settings in sweep.json)
    RESULTS/finished.json                 written last: the sweep has nothing left to do
    RESULTS/{trials,epochs,evals,classes}.parquet   the rows, rebuilt from the ledger (``PARQUET``;
                                          read through ``Results``), their sha256 in manifest.json
    RESULTS/optuna.db                     the searches' Optuna studies (SQLite, unless elsewhere)
    RESULTS/base_models/                  the cached CE base models
    RESULTS/tune/                         Ray Tune's own state (never needed to resume)
    RESULTS/runs/<stage>/<index>/         one trial (``Ledger``):
                                 checkpoint.pt   the trial's training state (rank 0, every epoch)
                                 epochs.json     its epoch rows so far
                                 result.json     its final evaluation rows (final stage)
                                 record.json     written by the driver when the trial ended:
                                                 status (ok | stopped | failed), error, metrics,
                                                 the epochs it reported, the configuration,
                                                 Tune's trial id and node
    RESULTS/predictors/<name>/            the final models as predictors; ``predictors/index.json``
                                          names each method's chosen one (``read_index``)
    RESULTS/.lock                         held by the process that writes the directory (``ResultsLock``)

A single run's directory (``dpsm-ray train --out``) holds the same ``checkpoint.pt`` and Parquet files,
and ``settings.json``: the configuration it started with and its data's record (``read_run_settings``).
``Results(DIR)`` reads any of them -- a sweep's, a study's, a single run's: their settings, their
rows, and the coverage floor that makes a trial feasible (``CoverageFloor``, the one rule).

**The ledger.**  The sweep's own record of its trials is the single source of truth for what has
run.  A trial *ended* exactly when its ``record.json`` exists.  Everything else is derived from these
files: the Parquet files, a resumed search's Optuna study (a trial it holds without a record is
proposed again with the same parameters; one finished there but not here is told again, which
Optuna skips), and ASHA's rungs.  Tune's and Optuna's own saved state is never needed to resume,
so a kill at any instant, a corrupt Tune file or a moved results directory cannot strand a sweep.
Every JSON file here carries a sha256 of its content (``dpsm_ray.files``).

Paths inside the results directory are stored relative to it, so the directory can be moved or
copied and resumed there; a copy never writes to the original.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from dataclasses import dataclass
from functools import cached_property

from dpsm_ray.files import CorruptFileError, read_checked_json, sha256_file, write_checked_json

SWEEP_FILE = "sweep.json"
STUDY_FILE = "study.json"
PARQUET = {name: f"{name}.parquet" for name in ("trials", "epochs", "evals", "classes")}
MANIFEST = "manifest.json"  # the Parquet files' sha256 (dpsm_ray.storage.writers)
OPTUNA_DB = "optuna.db"
BASE_MODELS = "base_models"
TUNE = "tune"
FINISHED_FILE = "finished.json"  # written last, once the report is: the sweep has nothing left to do
RUNS = "runs"
RECORD_FILE = "record.json"
CHECKPOINT_FILE = "checkpoint.pt"
MODEL_FILE = "model.pt"  # a finished run's weights (its state dict)
EPOCHS_FILE = "epochs.json"
RESULT_FILE = "result.json"
PREDICTORS = "predictors"
INDEX_FILE = "index.json"
LOCK_FILE = ".lock"
RUN_SETTINGS_FILE = "settings.json"  # a single run's: the configuration it started with, and its data's record
def read_run_settings(directory: Path) -> dict | None:
    """A single run's ``settings.json`` (``{"config": TrainConfig fields, "data": its data's record}``),
    or None where it has none (a new directory, or a run started before it was written)."""
    path = Path(directory) / RUN_SETTINGS_FILE
    return read_checked_json(path) if path.is_file() else None


def write_run_settings(directory: Path, config: dict, data: dict) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_checked_json(Path(directory) / RUN_SETTINGS_FILE, {"config": config, "data": data})


# TrainConfig fields that may hold a path inside the results directory
_RESULT_PATHS = ("init_checkpoint", "cache_dir")


class UnreadableResults(ValueError):
    """A file of the results directory that cannot be read as what it should hold."""


def read_sweep_settings(results: Path) -> dict:
    """sweep.json's content, its knobs under their current names (UnreadableResults, naming the
    file, when it cannot be read)."""
    from dpsm_ray.cards import with_current_knob_names

    path = results / SWEEP_FILE
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise UnreadableResults(
            f"{path} is not readable JSON ({error}); it holds the sweep's settings: restore it, or start a new --results-dir"
        ) from None
    if not isinstance(stored, dict) or "base" not in stored:
        raise UnreadableResults(f"{path} does not hold a sweep's settings; restore it, or start a new --results-dir")
    return with_current_knob_names(stored)


def read_sweep(results: Path) -> dict | None:
    """sweep.json's content, or None: a single run's directory, or a file that cannot be read."""
    try:
        return read_sweep_settings(results) if (results / SWEEP_FILE).exists() else None
    except (OSError, UnreadableResults):
        return None


_VERSIONED = ("dpsm_ray", "torch", "ray", "optuna")


def package_versions() -> dict[str, str]:
    """The installed versions of the packages that decide a sweep's results, and Python's: what
    sweep.json records under ``versions``."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def read_index(results: Path) -> dict | None:
    """predictors/index.json: the sweep's predictors and each method's chosen one; None before any."""
    path = results / PREDICTORS / INDEX_FILE
    return read_checked_json(path) if path.exists() else None


def read_manifest(directory: Path) -> dict:
    """``{file name: {"sha256", "replaces"}}``; empty where no manifest was written yet."""
    path = directory / MANIFEST
    return read_checked_json(path) if path.exists() else {}


def verify_manifest(directory: str | os.PathLike, names: list[str] | None = None) -> list[str]:
    """Check the Parquet files of ``directory`` (``names``, or every one) against the manifest;
    raises ``CorruptFileError`` naming the first that does not match.  Returns the files present
    that have no checksum (written before checksums were recorded)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    names = names if names is not None else sorted(p.name for p in directory.glob("*.parquet"))
    unrecorded = []
    for name in names:
        path = directory / name
        if not path.exists():
            continue
        entry = manifest.get(name)
        if entry is None:
            unrecorded.append(name)
            continue
        if sha256_file(path) not in (entry["sha256"], entry.get("replaces")):
            raise CorruptFileError(path, f"does not match the sha256 recorded in {directory / MANIFEST} (changed after it was written)")
    return unrecorded


class Ledger:
    def __init__(self, results: Path) -> None:
        self.results = results

    def run_dir(self, stage: str, index: int) -> Path:
        return self.results / RUNS / stage / f"{index:04d}"

    def records(self, stage: str) -> dict[int, dict]:
        """``{index: record}`` of every trial of ``stage`` that ended."""
        root = self.results / RUNS / stage
        found = {}
        for path in sorted(root.glob(f"*/{RECORD_FILE}")) if root.exists() else []:
            record = read_checked_json(path)
            found[record["index"]] = self.absolute(record)
        return found

    def write_record(self, stage: str, index: int, record: dict) -> None:
        write_checked_json(self.run_dir(stage, index) / RECORD_FILE, self.relative({**record, "stage": stage, "index": index}))

    def epochs(self, stage: str, index: int) -> list[dict]:
        path = self.run_dir(stage, index) / EPOCHS_FILE
        return read_checked_json(path) if path.exists() else []

    def started(self, stage: str) -> list[int]:
        """Indexes of the trials of ``stage`` that wrote anything (ended or not)."""
        root = self.results / RUNS / stage
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []

    def result(self, stage: str, index: int) -> dict | None:
        path = self.run_dir(stage, index) / RESULT_FILE
        return read_checked_json(path) if path.exists() else None

    def relative(self, record: dict) -> dict:
        """``record`` with its configuration's paths inside the results directory made relative."""
        config = dict(record.get("config") or {})
        for name in _RESULT_PATHS:
            value = config.get(name)
            if isinstance(value, str) and Path(value).is_relative_to(self.results):
                config[name] = str(Path(value).relative_to(self.results))
        return {**record, "config": config}

    def absolute(self, record: dict) -> dict:
        config = dict(record.get("config") or {})
        for name in _RESULT_PATHS:
            value = config.get(name)
            if isinstance(value, str) and not os.path.isabs(value):
                config[name] = str(self.results / value)
        return {**record, "config": config}


class ResultsInUse(RuntimeError):
    """Another live driver holds the results directory."""


class ResultsLock:
    """An exclusive lock on a results directory, held by the live sweep driver.

    ``flock`` on ``RESULTS/.lock``: the kernel releases it when its holder dies, however it dies,
    so a lock is never stale; the file names its holder (pid, host, start time) for the message a
    second driver gets, and for the line saying an earlier driver ended without finishing.
    """

    def __init__(self, results: Path) -> None:
        self.path = results / LOCK_FILE
        self._handle = None

    def acquire(self) -> dict | None:
        """Take the lock or raise ``ResultsInUse`` naming the holder; returns what an earlier,
        dead holder left in the file (None if the last holder released it)."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = describe_holder(_parse_holder(handle.read().strip()))
            handle.close()
            raise ResultsInUse(
                f"{self.path.parent} is in use by another sweep driver ({holder}); wait for it to finish or stop it first"
            ) from None
        handle.seek(0)
        previous = handle.read().strip()
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        handle.flush()
        self._handle = handle
        return _parse_holder(previous)

    def release(self) -> None:
        if self._handle is not None:
            import fcntl

            self._handle.seek(0)
            self._handle.truncate()
            self._handle.flush()
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    def __enter__(self) -> ResultsLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _parse_holder(text: str) -> dict | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


def describe_holder(holder: dict | None) -> str:
    if holder is None:
        return "holder unknown"
    return f"pid {holder['pid']} on {holder.get('host', '?')}, since {holder.get('since', '?')}"


# --- the coverage floor and the one reader -------------------------------------------------------


@dataclass(frozen=True)
class CoverageFloor:
    """What makes a trial feasible: validation coverage >= 1 - alpha - slack.  The one place this
    rule is computed -- the search's Optuna constraint, trials.parquet's ``feasible``, the pick,
    the predictors' choice and a study's arms read it from here."""

    alpha: float
    slack: float = 0.0

    @property
    def value(self) -> float:
        return 1 - self.alpha - self.slack

    def feasible(self, val_coverage: float | None) -> bool | None:
        """Whether ``val_coverage`` reaches the floor; None where there is no coverage (a failed trial)."""
        if val_coverage is None or val_coverage != val_coverage:  # NaN
            return None
        return val_coverage >= self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, settings: dict) -> CoverageFloor:
        """The floor of a sweep's settings (sweep.json: ``base.alpha``, ``coverage_slack``) or a
        study's (``common.alpha``: studies take no slack)."""
        if "base" in settings:
            return cls(settings["base"]["alpha"], settings.get("coverage_slack", 0.0))
        return cls(settings["common"]["alpha"])


class Results:
    """One reader over a results directory: a sweep's, a study's or a single run's (``dpsm-ray
    train --out``).  Its settings, its rows as DataFrames (each file checked against the manifest,
    read once), and its coverage floor.  A file that is not there reads as an empty frame; one that
    cannot be read raises ``CorruptFileError`` naming it."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._frames: dict = {}

    def path(self, name: str) -> Path:
        """The path of a Parquet file by its short name (``trials``, ``epochs``, ``evals``, ``classes``)."""
        return self.directory / PARQUET[name]

    @cached_property
    def settings(self) -> dict | None:
        """sweep.json's (knobs under their current names) or study.json's content; None for a
        single run's directory, or a file that cannot be read."""
        if (self.directory / STUDY_FILE).exists():
            try:
                return read_checked_json(self.directory / STUDY_FILE)
            except (OSError, CorruptFileError):
                return None
        return read_sweep(self.directory)

    @cached_property
    def sweep(self) -> dict | None:
        """sweep.json's content: None for a study's or a single run's directory."""
        return read_sweep(self.directory)

    @property
    def floor(self) -> CoverageFloor | None:
        return CoverageFloor.of(self.settings) if self.settings is not None else None

    def unrecorded(self) -> list[str]:
        """Check every Parquet file against the manifest (``CorruptFileError`` for one changed after
        it was written); returns those written before checksums were recorded."""
        return verify_manifest(self.directory)

    def frame(self, name: str):
        """Every row of ``trials``, ``epochs``, ``evals`` or ``classes`` (an empty frame without the file)."""
        if name not in self._frames:
            import pandas as pd

            path = self.path(name)
            try:
                self._frames[name] = pd.read_parquet(path) if path.exists() else pd.DataFrame()
            except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
                raise CorruptFileError(path, f"is not a readable Parquet file ({str(error).splitlines()[0][:160]})") from None
        return self._frames[name]

    def final(self, name: str):
        """The rows of the final models: a sweep's final stage; a single run's rows, which name no stage."""
        frame = self.frame(name)
        if "stage" in frame and frame["stage"].notna().any():
            return frame[frame["stage"] == "final"]
        return frame

    trials = property(lambda self: self.frame("trials"))
    epochs = property(lambda self: self.frame("epochs"))
    evals = property(lambda self: self.frame("evals"))
    classes = property(lambda self: self.frame("classes"))
