"""A researcher's own data, without code: ``--dataset folder:PATH`` (an image folder tree) and
``--dataset table:FILE`` (feature columns and a label column) -- their options parsed, their files
listed and checked, their split sizes, and the fingerprints of what they read: everything the
command line and the dataset cards need before anything is loaded, torch-free (the loaders are
``dpsm_ray/data/folder.py`` and ``dpsm_ray/data/table.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from dpsm_ray.facts import parse_options
from dpsm_ray.files import cache_home, write_json

# the splits' fractions when the data does not come split (train: the rest)
_OWN_FRACTIONS = {"val": 0.15, "cal": 0.15, "test": 0.2}
# size: the side images are resized (shorter side) and centre-cropped to; channels: 1 or 3, or 0 for
# 1 when every image is greyscale, else 3; skip: 1 to leave out (and count) files that are not images
FOLDER_DEFAULTS = {"size": 32, "channels": 0, **_OWN_FRACTIONS, "skip": 0}
TABLE_DEFAULTS = {"label": "label", **_OWN_FRACTIONS}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
PRESPLIT = ("train", "val", "cal", "test")  # PATH/train/CLASS/... etc.: the data's own split
_TABLE_SUFFIXES = (".parquet", ".csv", ".npz")
_READINGS_VERSION = 1  # image_readings' cached verdicts
_OPTIONS_TAIL = re.compile(r"^[a-z_]+=[^/=]*(,[a-z_]+=[^/=]*)*$")


def split_path_spec(spec: str) -> tuple[str, str, str]:
    """``family:PATH[:key=value,...]`` -> ``(family, PATH, "key=value,..." or "")``."""
    family, _, rest = spec.partition(":")
    path, _, tail = rest.rpartition(":")
    if not (path and _OPTIONS_TAIL.match(tail)):
        path, tail = rest, ""
    return family, path, tail


def _path_spec(spec: str, defaults: dict) -> tuple[str, dict]:
    """``family:PATH`` or ``family:PATH:key=value,...`` -> the path and the options (defaults
    filled in, each read as its default's type; the fractions checked)."""
    family, path, tail = split_path_spec(spec)
    if not path:
        raise ValueError(f"dataset: {family} needs a path: {family}:PATH (options after it: {family}:PATH:key=value,...)")
    options = parse_options(family, tail, defaults)
    fractions = [options[split] for split in _OWN_FRACTIONS]
    if not (all(0 < f < 1 for f in fractions) and sum(fractions) < 1):
        raise ValueError(
            f"dataset: {family} options val, cal and test must be fractions in (0, 1) summing to less than 1 (train is the rest); "
            f"got {', '.join(f'{split}={options[split]:g}' for split in _OWN_FRACTIONS)}"
        )
    return path, options


def _own_split_sizes(total: int, options: dict) -> dict[str, int]:
    """The four splits of ``total`` examples at the options' fractions (train: the rest)."""
    sizes = {split: int(round(total * options[split])) for split in _OWN_FRACTIONS}
    sizes = {"train": total - sum(sizes.values()), **sizes}
    if min(sizes.values()) < 1:
        raise ValueError(
            f"dataset: {total} examples are too few to split at val={options['val']:g}, cal={options['cal']:g}, test={options['test']:g}: "
            f"a split would be empty ({sizes})"
        )
    return sizes


def parse_folder(spec: str) -> tuple[str, dict]:
    path, options = _path_spec(spec, FOLDER_DEFAULTS)
    if options["size"] < 8 or options["channels"] not in (0, 1, 3) or options["skip"] not in (0, 1):
        raise ValueError(
            f"dataset: folder needs size >= 8, channels 0 (from the images), 1 or 3, skip 0 or 1; "
            f"got size={options['size']}, channels={options['channels']}, skip={options['skip']}"
        )
    return path, options


class MissingDataError(FileNotFoundError, ValueError):
    """A folder or table that is not there: a FileNotFoundError, and a ValueError like every other
    bad ``--dataset`` value, so that validating a config names it in one line."""


def missing(family: str, path: str, what: str, fix: str) -> MissingDataError:
    where = f" (relative to the current directory {Path.cwd()})" if not Path(path).is_absolute() else ""
    return MissingDataError(f"dataset {family}:{path}: no such {what}{where}; {fix}")


@functools.lru_cache(maxsize=16)
def folder_files(
    path: str, skip: int
) -> tuple[tuple[str, ...], dict[str, tuple[tuple[str, str], ...]], tuple[str, ...], frozenset, frozenset]:
    """The images of an image folder tree (torchvision's ImageFolder layout), each decoded once
    (``image_readings``): ``(class names, {split or "": ((class, relative path), ...)}, the files
    left out, the images' modes, their (width, height)s)``.  The split is the data's own
    (PATH/train/CLASS/..., PATH/val/..., PATH/cal/..., PATH/test/...) or "" (PATH/CLASS/...).
    ValueError naming the path for a layout it cannot use, or the first file that is not a
    readable image -- not an image file, or one whose header or pixels do not read (a truncated
    download) -- with ``skip``: such files are left out and listed."""
    root = Path(path)
    if root.is_file():
        raise ValueError(f"dataset folder:{path} is a file, not a folder; give the folder that holds a folder of images for each class "
                         "(PATH/CLASS/IMAGE), or a table of features as table:FILE")
    if not root.is_dir():
        raise missing("folder", path, "folder", "give the folder that holds a folder of images for each class (PATH/CLASS/IMAGE)")
    presplit = [name for name in PRESPLIT if (root / name).is_dir()]
    if presplit and len(presplit) < len(PRESPLIT):
        raise ValueError(
            f"dataset folder:{path}: has {', '.join(n + '/' for n in presplit)} but not"
            f" {', '.join(n + '/' for n in PRESPLIT if n not in presplit)}; give all four split folders, or none (the classes' folders"
            " directly under it, split at random)"
        )
    listed = {}
    for split in presplit or [""]:
        base = root / split
        loose = sorted(p.name for p in base.iterdir() if p.is_file())
        if loose:
            raise ValueError(f"dataset folder:{path}: {base / loose[0]} is not in a class folder (the layout is {base}/CLASS/IMAGE)")
        listed[split] = []
        for class_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for directory, subdirectories, names in os.walk(class_dir):
                subdirectories.sort()
                listed[split] += [(class_dir.name, Path(directory) / name) for name in sorted(names)]
    readings = image_readings(root, [file for entries in listed.values() for _, file in entries if file.suffix.lower() in IMAGE_SUFFIXES])
    files, skipped, classes, modes, shapes = {}, [], set(), set(), set()
    for split, entries in listed.items():
        kept = []
        for name, file in entries:
            reading = readings.get(str(file), f"is not an image ({', '.join(IMAGE_SUFFIXES)})")
            if isinstance(reading, str):
                if not skip:
                    raise ValueError(
                        f"dataset folder:{path}: {file} {reading}; remove or replace it, or add the option skip=1"
                        f" (folder:{path}:skip=1) to leave such files out"
                    )
                skipped.append(str(file))
                continue
            mode, width, height = reading
            modes.add(mode)
            shapes.add((width, height))
            kept.append((name, str(file.relative_to(root))))
        files[split] = tuple(kept)
        classes.update(name for name, _ in kept)
    if not classes:
        raise ValueError(
            f"dataset folder:{path}: no class folder with images under it (the layout is {path}/CLASS/IMAGE, as torchvision's ImageFolder)"
        )
    if len(classes) < 2:
        raise ValueError(f"dataset folder:{path}: one class ({next(iter(classes))}); a classifier needs at least 2")
    return tuple(sorted(classes)), files, tuple(skipped), frozenset(modes), frozenset(shapes)


def image_readings(root: Path, files: list[Path], keep: bool = True) -> dict[str, list | str]:
    """Each image file decoded in full once: ``{file: [mode, width, height]}``, or for one that
    does not read, why (its header: not an image; its pixels: truncated or corrupt, which opening
    the header alone does not notice).  With ``keep``, kept in the cache (``$DPSM_RAY_CACHE/folders``)
    by every file's path, size and modification time, so that each trial's listing reads the
    verdicts instead of decoding again."""
    from PIL import Image, UnidentifiedImageError

    record = readings_record(root, files) if keep else None
    if record is not None and record.is_file():
        return json.loads(record.read_text())
    readings = {}
    for file in files:
        try:
            with Image.open(file) as image:
                readings[str(file)] = (image.mode, *image.size)
                image.draft(None, (1, 1))  # a JPEG at 1/8 scale: every byte read, 8x faster (a 4000x3000 photo: 44 -> 6 ms)
                image.load()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as error:
            header = str(file) not in readings
            readings[str(file)] = (
                f"cannot be read as an image ({type(error).__name__})"
                if header
                else f"cannot be decoded, a truncated or corrupt image ({str(error).splitlines()[0][:100]})"
            )
    if record is not None:
        write_json(record, readings)
    return readings


def readings_record(root: Path, files: list[Path]) -> Path:
    """Where ``image_readings`` keeps its verdicts on ``files`` as they are now (and Pillow's version:
    a newer one may read what an older one could not)."""
    import PIL

    key = f"{_READINGS_VERSION} {PIL.__version__} {file_fingerprint(files)}"
    return cache_home() / "folders" / f"{root.name}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.readings.json"


def file_fingerprint(files: list[Path]) -> str:
    """A short hash of the files' paths, sizes and modification times: what a cache of what was
    made from them (their decoded images, a base model trained on them) is keyed by."""
    listing = [[str(file), file.stat().st_size, file.stat().st_mtime_ns] for file in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def folder_fingerprint(spec: str) -> str:
    path, options = parse_folder(spec)
    files = folder_files(path, options["skip"])[1]
    return file_fingerprint([Path(path) / rel for entries in files.values() for _, rel in entries])


def table_fingerprint(spec: str) -> str:
    return file_fingerprint([Path(parse_table(spec)[0]).resolve()])


# A data record (``dpsm_ray.cards.data_record``): what a results directory, a run and a predictor keep of the data
# they were made from, so that the same path holding other data is noticed.  Cheap at any size: a
# file is hashed whole up to FULL_HASH_BYTES (beyond, SAMPLED_CHUNKS chunks of 1 MiB spread across it
# and its size); a folder by its listing (every file's path and size) and the content of a sample
# of SAMPLED_FILES files spread across it.  Modification times are kept to say when, never compared:
# a copy of the same data is the same data.
FULL_HASH_BYTES = 256 * 2**20
_SAMPLED_CHUNKS = 64
_SAMPLED_FILES = 64


def _content_hash(path: Path) -> str:
    """sha256 of a file's bytes (``sha256sum``'s), or past ``FULL_HASH_BYTES`` of its size and a
    sample of its bytes (the comment above)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(2**20), b""):
                digest.update(block)
        else:
            digest.update(f"{size} bytes, sampled".encode())
            for k in range(_SAMPLED_CHUNKS):
                handle.seek((size - 2**20) * k // (_SAMPLED_CHUNKS - 1))
                digest.update(handle.read(2**20))
    return digest.hexdigest()


def when(mtime: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))


def path_record(path: str) -> dict:
    """The record of a data file or folder at ``path`` (``FULL_HASH_BYTES``'s comment)."""
    where = Path(path).resolve()
    if not where.exists():
        return {"kind": "missing", "path": str(where)}
    if where.is_file():
        stat = where.stat()
        return {"kind": "file", "path": str(where), "bytes": stat.st_size, "modified": when(stat.st_mtime), "sha256": _content_hash(where)}
    listing = []
    for directory, subdirectories, names in os.walk(where):
        subdirectories.sort()
        for name in sorted(names):
            file = Path(directory) / name
            stat = file.stat()
            listing.append((str(file.relative_to(where)), stat.st_size, stat.st_mtime))
    sample = [listing[k * len(listing) // _SAMPLED_FILES] for k in range(min(_SAMPLED_FILES, len(listing)))]
    digest = hashlib.sha256()
    for relative, _, _ in dict.fromkeys(sample):
        digest.update(relative.encode() + b"\0" + _content_hash(where / relative).encode())
    return {"kind": "folder", "path": str(where), "files": len(listing), "bytes": sum(size for _, size, _ in listing),
            "modified": when(max((mtime for _, _, mtime in listing), default=0.0)),
            "listing_sha256": hashlib.sha256(json.dumps([[r, n] for r, n, _ in listing]).encode()).hexdigest(),
            "sample_sha256": digest.hexdigest()}


def record_change(recorded: dict, now: dict) -> str | None:
    """How the data of record ``now`` differs from ``recorded`` (the same path's, earlier), in
    words, or None when it is the same data."""
    keys = [k for k in ("dataset", "kind", "path", "sha256", "listing_sha256", "sample_sha256") if k in recorded or k in now]
    if all(recorded.get(k) == now.get(k) for k in keys):
        return None
    if now.get("kind") == "missing":
        return f"{now['path']} is not there any more"
    if recorded.get("dataset") != now.get("dataset") or recorded.get("kind") != now.get("kind"):
        return f"it was {recorded.get('dataset')} ({recorded.get('kind')}), it is {now.get('dataset')} ({now.get('kind')})"
    def state(record: dict) -> str:
        from dpsm_ray.files import human_bytes

        files = f"{record['files']} files, " if record.get("kind") == "folder" else ""
        return f"{files}{human_bytes(record['bytes'])}, modified {record['modified']}"

    what = "its files differ" if now.get("kind") == "folder" else "its content differs"
    return f"{now['path']}: {what} (then {state(recorded)}; now {state(now)})"


def folder_sizes(spec: str) -> dict[str, int]:
    path, options = parse_folder(spec)
    classes, files = folder_files(path, options["skip"])[:2]
    if "" not in files:
        return {split: len(files[split]) for split in PRESPLIT}
    counts = {name: 0 for name in classes}
    for name, _ in files[""]:
        counts[name] += 1
    few = [name for name, count in counts.items() if count < len(PRESPLIT)]
    if few:
        raise ValueError(
            f"dataset folder:{path}: class {few[0]!r} has {counts[few[0]]} images; each class needs at least {len(PRESPLIT)} "
            "(one for each of train, val, cal and test)"
        )
    return _own_split_sizes(len(files[""]), options)


def parse_table(spec: str) -> tuple[str, dict]:
    path, options = _path_spec(spec, TABLE_DEFAULTS)
    if Path(path).suffix.lower() not in _TABLE_SUFFIXES:
        raise ValueError(f"dataset table:{path}: give a {', '.join(_TABLE_SUFFIXES)} file")
    return path, options


def read_table(spec: str):
    """The table of ``table:FILE[:label=NAME,...]`` checked: ``(features float32 [n, F], label
    strings or integers [n], feature names, label name)`` as numpy arrays.  ValueError naming the
    file (and the column) for a table with no rows, a missing label column, a feature that is not
    a number, a missing value, or fewer than 2 classes; MissingDataError for no such file."""
    path, options = parse_table(spec)
    file = Path(path)
    if not file.is_file():
        raise missing("table", path, "file", f"give a {', '.join(_TABLE_SUFFIXES)} file with one row per example")
    stat = file.stat()
    return _read_table(str(file.resolve()), stat.st_size, stat.st_mtime_ns, options["label"])


@functools.lru_cache(maxsize=8)
def _read_table(path: str, size: int, mtime: int, label: str):
    import numpy as np

    suffix = Path(path).suffix.lower()
    no_rows = f"dataset table:{path}: the table has no rows; it needs one row per example (its features and its label {label!r})"
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            if label not in archive.files:
                raise ValueError(
                    f"dataset table:{path}: no array {label!r} of labels (it holds {', '.join(archive.files)}; name it with label=NAME)"
                )
            arrays = {name: archive[name] for name in archive.files}
        labels = arrays.pop(label)
        if labels.size == 0:
            raise ValueError(no_rows)
        if len(arrays) != 1 or next(iter(arrays.values())).ndim != 2:
            raise ValueError(
                f"dataset table:{path}: an .npz holds the labels {label!r} and one 2-D array of features; it holds"
                f" {', '.join([label, *arrays])}"
            )
        name, features = next(iter(arrays.items()))
        columns = [f"{name}[{i}]" for i in range(features.shape[1])]
    else:
        import pandas as pd

        try:
            frame = pd.read_parquet(path) if suffix == ".parquet" else pd.read_csv(path)
        except (OSError, ValueError) as error:
            raise ValueError(f"dataset table:{path}: not a readable {suffix[1:]} file ({str(error).splitlines()[0][:160]})") from None
        if frame.empty:  # before the columns' types: a CSV header alone reads as columns of no type (object)
            raise ValueError(no_rows)
        if suffix == ".csv" and len(frame.columns) == 1 and ";" in str(frame.columns[0]):
            raise ValueError(f"dataset table:{path}: its header reads as one column, {str(frame.columns[0])[:60]!r}: the file looks "
                             "separated by semicolons; write it with commas (pandas: frame.to_csv(path, index=False))")
        if label not in frame.columns:
            names = [str(column) for column in frame.columns]
            shown = names if len(names) <= 13 else [*names[:12], "...", names[-1]]
            raise ValueError(
                f"dataset table:{path}: no label column {label!r}; its {len(frame.columns)} columns: {', '.join(shown)}; name the label "
                f"column with label=NAME (table:{path}:label=NAME)"
            )
        empty = frame[label].isna().to_numpy()
        if empty.any():
            raise ValueError(f"dataset table:{path}: {int(empty.sum())} rows have no label in column {label!r} (the first: row "
                             f"{int(empty.argmax())}, counting from 0 after the header); fill them in or drop those rows")
        columns = [str(c) for c in frame.columns if c != label]
        wrong = [c for c in frame.columns if c != label and not pd.api.types.is_numeric_dtype(frame[c])]
        if wrong:
            raise ValueError(
                f"dataset table:{path}: column {wrong[0]!r} is {frame[wrong[0]].dtype}, not a number (every column but the label {label!r}"
                " is a feature)"
            )
        labels, features = frame[label].to_numpy(), frame.drop(columns=[label]).to_numpy(dtype=np.float64)
    if not columns:
        raise ValueError(f"dataset table:{path}: no feature column besides the label {label!r}")
    missing = ~np.isfinite(features.astype(np.float64))
    if missing.any():
        row, column = map(int, np.argwhere(missing)[0])
        raise ValueError(
            f"dataset table:{path}: {int(missing.any(axis=1).sum())} rows have a missing or infinite feature (the first: row {row}, column"
            f" {columns[column]!r})"
        )
    if labels.dtype.kind == "f" and not np.all(labels == np.round(labels)):
        raise ValueError(f"dataset table:{path}: labels {label!r} must be integers or names; got fractions")
    if labels.dtype.kind not in "iubfUSO" or (labels.dtype.kind == "O" and not all(isinstance(v, str) for v in labels)):
        raise ValueError(f"dataset table:{path}: labels {label!r} must be integers or names; got {labels.dtype}")
    if len(np.unique(labels)) < 2:
        raise ValueError(f"dataset table:{path}: labels {label!r} hold one class; a classifier needs at least 2")
    return features.astype(np.float32), labels, tuple(columns), label


def table_sizes(spec: str) -> dict[str, int]:
    features, labels, _, _ = read_table(spec)
    return _own_split_sizes(len(labels), parse_table(spec)[1])
