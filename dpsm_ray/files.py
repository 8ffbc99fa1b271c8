"""Writing files so that none is ever half-written, checked files, and a full disk named.

Every file the service writes goes through ``atomic_write``: the bytes go to a temporary file in
the same directory, which is flushed and fsynced, then renamed over the target, and the directory
is fsynced -- so after a kill or a power cut the target is its old version or its new one, never a
mix.  A write that runs out of space raises ``DiskFullError``, which names the path and the free
space.  A killed writer leaves its temporary file behind: ``remove_temporaries`` removes those
(``.NAME.PID.tmp``) once no writer can be running.

``write_checked_json`` / ``read_checked_json`` store a sha256 of their payload inside the file, so
a flipped byte is noticed when the file is read back instead of changing a result silently.

Nothing here imports the rest of the package.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What a full disk looks like when a library reports it in words (SQLite through SQLAlchemy).
_DISK_FULL_TEXTS = ("No space left on device", "database or disk is full", "Disk quota exceeded", "DiskFullError")
TEMPORARY = re.compile(r"^\..+\.\d+\.tmp$")


class DiskFullError(OSError):
    """A write found no space left on its device."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        super().__init__(errno.ENOSPC, f"no space left on the device of {self.path} ({free_space(self.path)} free)")

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # Ray and Tune copy and pickle a trial's exception
        return (_disk_full, (str(self.path), self.strerror))


class CorruptFileError(ValueError):
    """A file whose content does not match the checksum recorded for it, or cannot be parsed."""

    def __init__(self, path: str | os.PathLike, why: str) -> None:
        self.path = Path(path)
        super().__init__(f"{self.path} {why}")

    def __reduce__(self):
        return (_corrupt_file, (str(self.path), str(self)))


def _disk_full(path: str, message: str) -> DiskFullError:
    error = DiskFullError.__new__(DiskFullError)
    OSError.__init__(error, errno.ENOSPC, message)
    error.path = Path(path)
    return error


def _corrupt_file(path: str, message: str) -> CorruptFileError:
    error = CorruptFileError.__new__(CorruptFileError)
    ValueError.__init__(error, message)
    error.path = Path(path)
    return error


def cache_home() -> Path:
    """Where the package caches what it can make again (base models, rendered datasets):
    ``$DPSM_RAY_CACHE``, default ``~/.cache/dpsm_ray``."""
    return Path(os.environ.get("DPSM_RAY_CACHE", Path.home() / ".cache" / "dpsm_ray"))


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return human_bytes(shutil.disk_usage(candidate).free)
    return "unknown"


def human_bytes(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def is_disk_full(error: BaseException | str) -> bool:
    """Whether ``error`` (or anything in its chain, or its text: Ray and SQLAlchemy re-wrap
    exceptions, and Tune hands a trial's error over as text) is a full disk."""
    if isinstance(error, str):
        return any(text in error for text in _DISK_FULL_TEXTS)
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write(path: str | os.PathLike, write: Callable, *, binary: bool = True) -> None:
    """Write ``path`` through ``write(handle)`` so that it is whole or absent (module docstring)."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(error) and not isinstance(error, DiskFullError):
            raise DiskFullError(path) from None
        raise


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where the file system cannot)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, payload) -> None:
    write_text(path, json.dumps(payload, indent=2, sort_keys=True, default=_jsonable))


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _canonical_json(payload) -> bytes:
    return json.dumps(payload, sort_keys=True, default=_jsonable).encode("utf-8")


def write_checked_json(path: str | os.PathLike, payload) -> None:
    """``payload`` as JSON with the sha256 of its canonical form beside it."""
    write_text(path, json.dumps({"sha256": sha256_bytes(_canonical_json(payload)), "payload": payload}, default=_jsonable))


def read_checked_json(path: str | os.PathLike):
    """The payload ``write_checked_json`` wrote; ``CorruptFileError`` (naming the file) when it
    does not parse or no longer matches its checksum."""
    try:
        stored = json.loads(Path(path).read_text(encoding="utf-8"))
        payload, recorded = stored["payload"], stored["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CorruptFileError(path, "is not a readable record (truncated or garbled)") from None
    if sha256_bytes(_canonical_json(payload)) != recorded:
        raise CorruptFileError(path, "does not match the sha256 recorded in it (changed after it was written)")
    return payload


def temporaries(root: str | os.PathLike, skip: tuple[str, ...] = ()) -> Iterator[Path]:
    """Temporary files ``atomic_write`` leaves when its writer is killed, under ``root``
    (directories named in ``skip`` are not entered)."""
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in skip]
        for name in files:
            if TEMPORARY.match(name):
                yield Path(directory) / name


def remove_temporaries(root: str | os.PathLike, skip: tuple[str, ...] = ()) -> list[Path]:
    """Remove every temporary file under ``root`` (call only when no writer can be running)."""
    removed = []
    for path in temporaries(root, skip):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
