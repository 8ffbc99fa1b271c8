"""``dpsm-ray predict``'s output: one row per input (docs/predictor.md), as Parquet, CSV, JSON or
JSON Lines.

    input_id      int64 (a position, or the input's integer id) or string (an image's path in its folder, a string id)
    set           list<int32>    the classes of the prediction set, ascending
    set_names     list<string>   the same classes by name (predictors whose classes have names)
    set_size      int32
    top1          int32          the most probable class (ties: the lower index)
    top1_name     string         (predictors whose classes have names)
    label         int32          the input's label, where the inputs are labelled (a table's label column, an .npz's y)
    covered       bool           whether the set holds the label (labelled inputs)
    probabilities list<double>   the softmax row (--probabilities)
    p_value_K     double         one column per class K = 0, 1, ...: its conformal p-value (--p-values); the set is {K : p_value_K > alpha}

A Parquet file's schema metadata (``dpsm_ray``) records the predictor's run_id, the score, the
calibration (marginal or class), alpha, q (marginal) or each class's q_y (class), whether empty sets
were given the top class (``non_empty``) and whether p-values are there; a JSON file holds the same
as ``{"dpsm_ray": metadata, "rows": [...]}``; CSV and JSON Lines hold the rows only, a list as its
JSON text in a CSV cell.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from dpsm_ray.files import write_bytes
from dpsm_ray.predict.inputs import InputSource
from dpsm_ray.predict.predictor import Predictor

# inputs above this many forward passes get a progress bar
_PROGRESS_BATCHES = 10
FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "jsonl"}
_ORDER = ("input_id", "set", "set_names", "set_size", "top1", "top1_name", "label", "covered", "probabilities")


def _p_value_column(label: int) -> str:
    return f"p_value_{label}"


def _predict_rows(
    predictor: Predictor, source: InputSource, *, score: str, probabilities: bool, batch_size: int, non_empty: bool = False,
    calibration: str | None = None, p_values: bool = False,
) -> dict[str, list]:
    """The output columns for every input of ``source``, computed chunk by chunk."""
    from tqdm import tqdm

    names = predictor.class_names
    columns: dict[str, list] = {"input_id": list(source.ids), "set": [], "set_size": [], "top1": []}
    if names is not None:
        columns.update(set_names=[], top1_name=[])
    if source.labels is not None:
        columns.update(label=source.labels.tolist(), covered=[])
    if probabilities:
        columns["probabilities"] = []
    if p_values:
        columns.update({_p_value_column(label): [] for label in range(predictor.num_classes)})
    bar = tqdm(total=source.count, unit="input", file=sys.stderr, disable=source.count <= _PROGRESS_BATCHES * batch_size)
    start = 0
    for chunk in source.batches(batch_size):
        probs = predictor.ordered_proba(chunk, batch_size=batch_size)  # a table's columns were matched by name
        ids = torch.from_numpy(source.example_ids[start : start + len(chunk)])
        sets = predictor.sets_from_proba(probs, score, calibration=calibration, example_ids=ids, non_empty=non_empty)
        top1 = probs.argmax(dim=1).tolist()
        columns["set"] += sets.lists
        columns["set_size"] += [len(classes) for classes in sets.lists]
        columns["top1"] += top1
        if names is not None:
            columns["set_names"] += [[names[k] for k in classes] for classes in sets.lists]
            columns["top1_name"] += [names[k] for k in top1]
        if source.labels is not None:
            labels = source.labels[start : start + len(chunk)]
            columns["covered"] += [label in classes for label, classes in zip(labels.tolist(), sets.lists)]
        if probabilities:
            columns["probabilities"] += probs.tolist()
        if p_values:
            values = predictor.p_values_from_proba(probs, score, calibration=calibration, example_ids=ids)
            for label, column in enumerate(values.T.tolist()):
                columns[_p_value_column(label)] += column
        start += len(chunk)
        bar.update(len(chunk))
    bar.close()
    return columns


def output_format(out: str | os.PathLike, given: str | None) -> str:
    """``--format``, else the one ``out``'s suffix names (ValueError naming the file otherwise)."""
    if given is not None:
        return given
    suffix = os.path.splitext(str(out))[1].lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out {out}: cannot tell the format from its suffix; end it with {', '.join(FORMATS)} or give --format")
    return FORMATS[suffix]


def write_sets(predictor: Predictor, source: InputSource, out: str | os.PathLike, *, score: str = "hps", probabilities: bool = False,
               batch_size: int = 512, non_empty: bool = False, format: str = "parquet", calibration: str | None = None,
               p_values: bool = False) -> dict[str, list]:
    """Predict every input of ``source`` and write the rows to ``out`` (atomically) as
    ``format`` (parquet, csv, json, jsonl); returns the columns.  ``calibration``: marginal or
    class sets (None: the predictor's own); ``p_values``: a p-value column per class."""
    how = predictor.check_request(score, calibration, p_values)
    columns = _predict_rows(predictor, source, score=score, probabilities=probabilities, batch_size=batch_size, non_empty=non_empty,
                           calibration=how, p_values=p_values)
    order = [name for name in _ORDER if name in columns] + [_p_value_column(k) for k in range(predictor.num_classes) if p_values]
    if any(isinstance(i, str) for i in columns["input_id"]):
        columns["input_id"] = [str(i) for i in columns["input_id"]]
    metadata = {
        "run_id": predictor.info["run_id"],
        "score": score,
        "calibration": how,
        "alpha": predictor.alpha,
        "threshold": predictor.threshold(score) if how == "marginal" else None,
        "non_empty": non_empty,
        "p_values": p_values,
    }
    if how != "marginal":  # JSON has no infinity: a class every set holds (too few calibration points) is null
        thresholds, rank_limits = predictor.set_thresholds(score, how)
        metadata["class_thresholds"] = [q if math.isfinite(q) else None for q in thresholds.tolist()]
        if rank_limits is not None:
            metadata["rank_limits"] = rank_limits.tolist()
    encode = {"parquet": _parquet_bytes, "csv": _csv_bytes, "json": _json_bytes, "jsonl": _jsonl_bytes}[format]
    write_bytes(out, encode(columns, order, metadata))
    return columns


def _parquet_bytes(columns: dict[str, list], order: list[str], metadata: dict) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {
        "input_id": pa.string() if columns["input_id"] and isinstance(columns["input_id"][0], str) else pa.int64(),
        "set": pa.list_(pa.int32()),
        "set_names": pa.list_(pa.string()),
        "set_size": pa.int32(),
        "top1": pa.int32(),
        "top1_name": pa.string(),
        "label": pa.int32(),
        "covered": pa.bool_(),
        "probabilities": pa.list_(pa.float64()),
    }
    schema = pa.schema([(name, types.get(name, pa.float64())) for name in order], metadata={"dpsm_ray": json.dumps(metadata)})
    table = pa.table({name: pa.array(columns[name], type=schema.field(name).type) for name in order}, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def rows(columns: dict[str, list], order: list[str]) -> list[dict]:
    return [dict(zip(order, values)) for values in zip(*(columns[name] for name in order))]


def _csv_bytes(columns: dict[str, list], order: list[str], metadata: dict) -> bytes:
    import csv
    import io

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(order)
    for row in rows(columns, order):
        writer.writerow([json.dumps(value) if isinstance(value, list) else value for value in row.values()])
    return text.getvalue().encode()


def _json_bytes(columns: dict[str, list], order: list[str], metadata: dict) -> bytes:
    threshold = metadata["threshold"]
    finite = {**metadata, "threshold": threshold if threshold is None or math.isfinite(threshold) else None}  # JSON has no infinity
    return json.dumps({"dpsm_ray": finite, "rows": rows(columns, order)}).encode()


def _jsonl_bytes(columns: dict[str, list], order: list[str], metadata: dict) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows(columns, order)).encode()


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``dpsm_ray`` metadata of a file ``write_sets`` wrote."""
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[b"dpsm_ray"])
