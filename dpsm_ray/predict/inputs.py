"""The inputs ``dpsm-ray predict`` reads, streamed in chunks so that a large input never sits in
memory whole:

- ``.npy``: an array ``[n, *shape]`` (or ``[n, features]``), memory-mapped;
- ``.npz``: the array ``x`` (or the file's only array), integer ``ids`` and integer labels ``y`` if present;
- ``.parquet`` or ``.csv``: one numeric column per feature and an optional ``id`` column; for a
  predictor trained on a table with named columns, the columns are matched to its features by name
  (in any order; a missing or unexpected one is refused), otherwise taken in order; the training
  table's label column, where present, gives each input's label;
- a folder: every image file under it that PIL reads (sorted by path; other files are skipped and
  counted), converted, resized and cropped as the predictor's ``input.image`` says.

Each source gives the inputs' ids for the output rows (integer positions, the ``ids``/``id``
values, or the files' relative paths) and the integers that draw the APS/RAPS uniforms (integer
ids, else positions in the whole input -- never positions within a chunk, so the chunk size does
not change a set), and, where the inputs are labelled, their labels (class indices) so that
``predict`` can report coverage.  Arrays are never unpickled (``allow_pickle=False``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpsm_ray.data.preprocessing import InputSpec, read_pixels


class InputFileError(ValueError):
    """An input file or folder that cannot be read as inputs (the message names it)."""


@dataclass
class InputSource:
    path: Path
    count: int
    ids: list  # one per input: int positions / ids, or str relative paths
    example_ids: np.ndarray  # int64, one per input: draws the APS/RAPS uniforms
    chunks: object  # callable(size) -> iterator of raw arrays, in order
    skipped: list[str] = field(default_factory=list)  # files of a folder PIL could not read
    labels: np.ndarray | None = None  # int64 class indices, one per input, where the inputs are labelled

    def batches(self, size: int) -> Iterator[np.ndarray]:
        return self.chunks(size)


def open_inputs(
    path: str | os.PathLike, spec: InputSpec, *, label_column: str | None = None, feature_names=None, class_names=None,
    num_classes: int | None = None, skip_unreadable: bool = False,
) -> InputSource:
    """The inputs at ``path``.  A table's ``label_column`` (the training table's), where present, is
    read as labels (by ``class_names``) and left out of the features; ``feature_names`` (the
    predictor's) match a table's columns by name.  An ``.npz``'s ``y`` holds labels as class
    indices below ``num_classes``.  A folder's file that is not a readable image is refused, as
    training refuses it, or with ``skip_unreadable`` left out and counted (training's ``skip=1``)."""
    from dpsm_ray.own_data import IMAGE_SUFFIXES

    path = Path(path)
    if path.is_dir():
        return _image_folder(path, spec, skip_unreadable)
    if not path.is_file():
        raise InputFileError(f"--input {path}: no such file or folder")
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:  # one image
        return _image_files(path.parent, [path], [], spec)
    if suffix == ".npy":
        return _array_source(path, _load_array(path, lambda: np.load(path, mmap_mode="r", allow_pickle=False)), None)
    if suffix == ".npz":
        archive = _load_array(path, lambda: np.load(path, allow_pickle=False))
        names = list(archive.files)
        if "x" in names:
            key = "x"
        elif len([n for n in names if n not in ("ids", "y")]) == 1:
            key = next(n for n in names if n not in ("ids", "y"))
        else:
            raise InputFileError(
                f"--input {path}: an .npz must hold the inputs as 'x' (or as its only array besides 'ids' and 'y'); it holds"
                f" {', '.join(names) or 'nothing'}"
            )
        return _array_source(
            path,
            _load_array(path, lambda: archive[key]),
            _load_array(path, lambda: archive["ids"]) if "ids" in names else None,
            _array_labels(path, _load_array(path, lambda: archive["y"]), num_classes) if "y" in names and key != "y" else None,
        )
    if suffix in (".parquet", ".csv"):
        return _table_source(path, spec, label_column, feature_names, class_names)
    raise InputFileError(f"--input {path}: give an .npy or .npz array, a .parquet or .csv table of feature columns, an image, or a folder "
                         "of images")


def _load_array(path: Path, load):
    try:
        return load()
    except (ValueError, OSError, EOFError) as error:  # includes numpy's refusal of pickled objects
        raise InputFileError(f"--input {path} cannot be read as a numpy array ({str(error).splitlines()[0][:160]})") from None


def _array_labels(path: Path, labels: np.ndarray, num_classes: int | None) -> np.ndarray:
    """An .npz's ``y``: one class index per input, each below ``num_classes``."""
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise InputFileError(f"--input {path}: 'y' must hold one integer class index per input; got {labels.dtype.name} of shape "
                             f"{list(labels.shape)}")
    if len(labels) and num_classes is not None and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
        raise InputFileError(f"--input {path}: 'y' must hold class indices in 0..{num_classes - 1}; found {int(labels.min())}.."
                             f"{int(labels.max())}")
    return labels.astype(np.int64)


def _array_source(path: Path, array: np.ndarray, ids: np.ndarray | None, labels: np.ndarray | None = None) -> InputSource:
    if array.ndim < 1:
        raise InputFileError(f"--input {path} holds a single number, not a batch of inputs")
    count = len(array)
    positions = np.arange(count, dtype=np.int64)
    if ids is not None:
        if ids.shape != (count,) or ids.dtype.kind not in "iu":
            raise InputFileError(
                f"--input {path}: 'ids' must be {count} integers, one per input; got {ids.dtype.name} of shape {list(ids.shape)}"
            )
        example_ids = ids.astype(np.int64)
    else:
        example_ids = positions
    if labels is not None and len(labels) != count:
        raise InputFileError(f"--input {path}: 'y' holds {len(labels)} labels for {count} inputs")
    return InputSource(
        path, count, example_ids.tolist(), example_ids, lambda size: (np.asarray(array[i : i + size]) for i in range(0, count, size)),
        labels=labels,
    )


def _table_source(path: Path, spec: InputSpec, label_column: str | None = None, feature_names=None, class_names=None) -> InputSource:
    """A Parquet or CSV table: one numeric column per feature -- matched by name to
    ``feature_names`` where the predictor has them, else taken in order -- an optional ``id``
    column, and the training table's ``label_column``, read as labels where present."""
    import pyarrow.csv
    import pyarrow.parquet as pq
    import pyarrow.types as types

    kind = "CSV" if path.suffix.lower() == ".csv" else "Parquet"
    try:
        table = pyarrow.csv.read_csv(path) if kind == "CSV" else pq.read_table(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise InputFileError(f"--input {path} is not a readable {kind} file ({str(error).splitlines()[0][:160]})") from None
    features = [name for name in table.column_names if name not in ("id", label_column)]
    if feature_names is not None:
        missing = [name for name in feature_names if name not in features]
        extra = [name for name in features if name not in feature_names]
        if missing or extra:
            said = [f"{what} {', '.join(map(repr, names[:5]))}{', ...' if len(names) > 5 else ''}"
                    for what, names in (("missing", missing), ("unexpected", extra)) if names]
            raise InputFileError(f"--input {path}: the predictor reads its {len(feature_names)} features by name; the table has "
                                 f"{' and '.join(said)} (columns besides 'id' and the label {label_column!r})")
        features = list(feature_names)
    elif len(features) != spec.features:
        left_out = ", ".join(repr(name) for name in ("id", label_column) if name)
        raise InputFileError(f"--input {path}: the predictor takes {spec.features} features (shape {list(spec.shape)}), one column each; "
                             f"the table has {len(features)} columns besides {left_out}")
    count = table.num_rows
    if count == 0:
        raise InputFileError(f"--input {path}: the table has its columns but no rows")
    wrong = [
        name
        for name in features
        if not (types.is_integer(table.schema.field(name).type) or types.is_floating(table.schema.field(name).type))
    ]
    if wrong:
        raise InputFileError(f"--input {path}: column {wrong[0]!r} is {table.schema.field(wrong[0]).type}, not a number")
    if any(table.column(name).null_count for name in features):
        raise InputFileError(f"--input {path}: feature columns hold nulls")
    array = np.column_stack([table.column(name).to_numpy() for name in features])
    example_ids = np.arange(count, dtype=np.int64)
    ids: list = example_ids.tolist()
    if "id" in table.column_names:
        ids = table.column("id").to_pylist()
        if types.is_integer(table.schema.field("id").type):
            example_ids = np.asarray(ids, dtype=np.int64)
    labels = None
    if label_column is not None and label_column in table.column_names:
        labels = _table_labels(path, table.column(label_column).to_pylist(), label_column, class_names)
    return InputSource(path, count, ids, example_ids, lambda size: (array[i : i + size] for i in range(0, count, size)), labels=labels)


def _table_labels(path: Path, values: list, column: str, class_names) -> np.ndarray:
    """A table's label column as class indices: each value is its class's name (as training named
    the classes: the values as text)."""
    index = {name: k for k, name in enumerate(class_names or ())}
    unknown = [value for value in dict.fromkeys(values) if value is None or str(value) not in index]
    if unknown:
        raise InputFileError(f"--input {path}: label column {column!r} holds {unknown[0]!r}, not a class the predictor knows "
                             f"({', '.join(list(index)[:8])}{', ...' if len(index) > 8 else ''})")
    return np.asarray([index[str(value)] for value in values], dtype=np.int64)


def _image_folder(path: Path, spec: InputSpec, skip_unreadable: bool = False) -> InputSource:
    """Every file under ``path`` (sorted by path) as an image, each decoded in full first as
    training checks a ``folder:`` (``dpsm_ray.own_data.image_readings``): a file that is not
    a readable image is refused naming it, or with ``skip_unreadable`` left out and counted."""
    from dpsm_ray.own_data import IMAGE_SUFFIXES, image_readings

    if spec.image is None:
        raise InputFileError(
            f"--input {path} is a folder of images, but the predictor takes {spec.raw}, not images: give an .npy, .npz or .parquet"
        )
    listed = []
    for directory, subdirectories, names in os.walk(path):
        subdirectories.sort()
        listed += [Path(directory) / name for name in sorted(names)]
    readings = image_readings(path, [file for file in listed if file.suffix.lower() in IMAGE_SUFFIXES], keep=False)
    files, skipped = [], []
    for file in listed:
        reading = readings.get(str(file), f"is not an image ({', '.join(IMAGE_SUFFIXES)})")
        if not isinstance(reading, str):
            files.append(file)
        elif skip_unreadable:
            skipped.append(str(file.relative_to(path)))
        else:
            raise InputFileError(f"--input {path}: {file} {reading}; remove or replace it, or pass --skip-unreadable to leave such files "
                                 "out (as training's folder:PATH:skip=1)")
    if not files:
        raise InputFileError(f"--input {path}: no image file PIL can read under it")
    return _image_files(path, files, skipped, spec)


def _image_files(root: Path, files: list[Path], skipped: list[str], spec: InputSpec) -> InputSource:
    """The image ``files`` (under ``root``, which names them in the output) as inputs."""
    if spec.image is None:
        raise InputFileError(f"--input {files[0]} is an image, but the predictor takes {spec.raw}, not images: give an .npy, .npz or "
                             ".parquet")
    positions = np.arange(len(files), dtype=np.int64)

    def chunks(size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(files), size):
            yield np.stack([read_image(file, spec) for file in files[start : start + size]])

    return InputSource(root, len(files), [str(file.relative_to(root)) for file in files], positions, chunks, skipped)


def read_image(file: Path, spec: InputSpec) -> np.ndarray:
    """One image file as a raw input ``[C, H, W]`` (docs/predictor.md): ``spec.image.mode``, the
    shorter side resized to ``resize``, the centre ``H x W`` cropped (``read_pixels``), pixels
    times ``pixel_scale``."""
    image_spec = spec.image
    pixels = read_pixels(file, image_spec.mode, image_spec.resize, tuple(spec.shape[1:]))
    return pixels if image_spec.pixel_scale == 1 else pixels.astype(np.float32) * np.float32(image_spec.pixel_scale)
