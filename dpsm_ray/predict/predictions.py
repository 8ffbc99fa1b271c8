"""``dpsm-ray predict``'s output: one Parquet row per input (docs/predictor.md).

    input_id      int64 (a position, or the input's integer id) or string (an image's path in its folder, a string id)
    set           list<int32>    the classes of the prediction set, ascending
    set_names     list<string>   the same classes by name (predictors whose classes have names)
    set_size      int32
    top1          int32          the most probable class (ties: the lower index)
    top1_name     string         (predictors whose classes have names)
    probabilities list<double>   the softmax row (--probabilities)

The file's schema metadata (``dpsm_ray``) records the predictor's run_id, the score, alpha, q and
whether empty sets were given the top class (``non_empty``).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from dpsm_ray.files import write_bytes
from dpsm_ray.predict.inputs import InputSource
from dpsm_ray.predict.predictor import Predictor

# inputs above this many forward passes get a progress bar
PROGRESS_BATCHES = 10


def predict_rows(
    predictor: Predictor, source: InputSource, *, score: str, probabilities: bool, batch_size: int, non_empty: bool = False
) -> dict[str, list]:
    """The output columns for every input of ``source``, computed chunk by chunk."""
    from tqdm import tqdm

    names = predictor.class_names
    columns: dict[str, list] = {"input_id": list(source.ids), "set": [], "set_size": [], "top1": []}
    if names is not None:
        columns.update(set_names=[], top1_name=[])
    if probabilities:
        columns["probabilities"] = []
    bar = tqdm(total=source.count, unit="input", file=sys.stderr, disable=source.count <= PROGRESS_BATCHES * batch_size)
    start = 0
    for chunk in source.batches(batch_size):
        probs = predictor.predict_proba(chunk, batch_size=batch_size)
        ids = torch.from_numpy(source.example_ids[start : start + len(chunk)])
        sets = predictor.sets_from_proba(probs, score, example_ids=ids, non_empty=non_empty)
        top1 = probs.argmax(dim=1).tolist()
        columns["set"] += sets.lists
        columns["set_size"] += [len(classes) for classes in sets.lists]
        columns["top1"] += top1
        if names is not None:
            columns["set_names"] += [[names[k] for k in classes] for classes in sets.lists]
            columns["top1_name"] += [names[k] for k in top1]
        if probabilities:
            columns["probabilities"] += probs.tolist()
        start += len(chunk)
        bar.update(len(chunk))
    bar.close()
    return columns


def write_sets(predictor: Predictor, source: InputSource, out: str | os.PathLike, *, score: str = "hps", probabilities: bool = False,
               batch_size: int = 512, non_empty: bool = False) -> dict[str, list]:
    """Predict every input of ``source`` and write the rows to the Parquet file ``out``
    (atomically); returns the columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = predict_rows(predictor, source, score=score, probabilities=probabilities, batch_size=batch_size, non_empty=non_empty)
    id_type = pa.string() if any(isinstance(i, str) for i in columns["input_id"]) else pa.int64()
    types = {
        "input_id": id_type,
        "set": pa.list_(pa.int32()),
        "set_names": pa.list_(pa.string()),
        "set_size": pa.int32(),
        "top1": pa.int32(),
        "top1_name": pa.string(),
        "probabilities": pa.list_(pa.float64()),
    }
    order = [name for name in ("input_id", "set", "set_names", "set_size", "top1", "top1_name", "probabilities") if name in columns]
    metadata = {
        "run_id": predictor.info["run_id"],
        "score": score,
        "alpha": predictor.alpha,
        "threshold": predictor.threshold(score),
        "non_empty": non_empty,
    }
    schema = pa.schema([(name, types[name]) for name in order], metadata={"dpsm_ray": json.dumps(metadata)})
    if id_type == pa.string():
        columns["input_id"] = [str(i) for i in columns["input_id"]]
    table = pa.table({name: pa.array(columns[name], type=types[name]) for name in order}, schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_bytes(out, sink.getvalue().to_pybytes())
    return columns


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``dpsm_ray`` metadata of a file ``write_sets`` wrote."""
    import pyarrow.parquet as pq

    return json.loads(pq.read_schema(path).metadata[b"dpsm_ray"])
