"""Datasets and their train / val / cal / test splits."""

from __future__ import annotations

from dpsm_ray.data.splits import SPLIT_NAMES, DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.data.tabular import DIGITS_SIZES, SYNTHETIC_FRACTIONS, load_digits, load_synthetic, make_synthetic

DATASETS = ("digits", "synthetic")


def check_dataset(name: str) -> str:
    base = name.partition(":")[0]
    if base not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {name!r}")
    if base == "synthetic":
        from dpsm_ray.data.tabular import parse_synthetic

        parse_synthetic(name)
    return name


def split_sizes(name: str) -> dict[str, int]:
    """Sizes of the four splits of ``name``, known without loading any data."""
    check_dataset(name)
    if name == "digits":
        return dict(DIGITS_SIZES)
    from dpsm_ray.data.tabular import parse_synthetic

    size = parse_synthetic(name)["size"]
    return {split: int(size * fraction) for split, fraction in SYNTHETIC_FRACTIONS.items()}


def load_splits(name: str, data_root: str | None = None, *, seed: int, download: bool = False) -> DataSplits:
    """The four splits of dataset ``name``, stratified and disjoint, chosen by ``seed``."""
    check_dataset(name)
    if name == "digits":
        return load_digits(seed)
    return load_synthetic(name, seed)


__all__ = ["DATASETS", "SPLIT_NAMES", "DataSplits", "FileSource", "Split", "TensorSource", "check_dataset", "load_splits", "make_synthetic", "split_sizes", "stratified_partition"]
