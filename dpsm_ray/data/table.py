"""A researcher's own features: ``table:FILE``, a Parquet or CSV table (or an ``.npz``) with one
row per example -- feature columns (e.g. the embeddings of a frozen backbone) and a label column
(option ``label``, default ``label``) of integers or class names.  Read and checked once per
process (``dpsm_ray.own_data.read_table``), split stratified at random by the run's data seed (fractions
``val``, ``cal``, ``test``; train is the rest), standardised per feature by the training split.
Class names: the label column's names (sorted), or, for integer labels, the integers as text.
"""

from __future__ import annotations

import numpy as np

from dpsm_ray.own_data import read_table, table_sizes


def _class_index(labels: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Labels -> ``(0..K-1 indices, class names)``: the distinct values, sorted, in that order."""
    names, index = np.unique(labels, return_inverse=True)
    return index.astype(np.int64), tuple(str(name.item() if hasattr(name, "item") else name) for name in names)


def load_table(spec: str, seed: int):
    import torch

    from dpsm_ray.data.tabular import from_tensors
    from dpsm_ray.seeding import derive_seed

    features, labels, columns, label = read_table(spec)
    index, names = _class_index(labels)
    raw = f"{len(columns)} numeric features, in the table's column order: {', '.join(columns[:6])}{', ...' if len(columns) > 6 else ''}"
    return from_tensors(
        spec, torch.from_numpy(features), torch.from_numpy(index), table_sizes(spec), derive_seed(seed, "table"), raw=raw, class_names=names
    )
