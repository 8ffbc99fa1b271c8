"""Datasets and their train / val / cal / test splits: what the dataset cards' loaders build
(``dpsm_ray.cards.load_splits`` loads a dataset by name)."""

from __future__ import annotations

from dpsm_ray.data.glyphs import make_glyphs
from dpsm_ray.data.splits import SPLIT_NAMES, DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.data.tabular import from_tensors, make_synthetic
from dpsm_ray.data.vision import fitted_sizes


__all__ = [
    "SPLIT_NAMES", "DataSplits", "FileSource", "Split", "TensorSource", "fitted_sizes", "from_tensors", "make_glyphs", "make_synthetic",
    "stratified_partition",
]
