"""Datasets and their train / val / cal / test splits."""

from __future__ import annotations

from dpsm_ray.data.splits import SPLIT_NAMES, DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.data.tabular import DIGITS_SIZES, SYNTHETIC_FRACTIONS, load_digits, load_synthetic, make_synthetic
from dpsm_ray.data.vision import LOADERS as VISION_LOADERS
from dpsm_ray.data.vision import PAPER_SIZES, fitted_sizes
from dpsm_ray.data.vision import check_data_present as check_image_data

DATASETS = ("digits", "synthetic", "cifar100", "caltech101", "inaturalist", "inaturalist2018")


def check_dataset(name: str) -> str:
    base = name.partition(":")[0]
    if base not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {name!r}")
    if base == "synthetic":
        from dpsm_ray.data.tabular import parse_synthetic

        parse_synthetic(name)
    elif name != base:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)} (only synthetic takes options); got {name!r}")
    return name


def split_sizes(name: str) -> dict[str, int]:
    """Sizes of the four splits of ``name``, known without loading any data (for the image
    datasets, the paper's sizes: a smaller copy on disk gets them scaled down)."""
    check_dataset(name)
    if name == "digits":
        return dict(DIGITS_SIZES)
    if name in PAPER_SIZES:
        return dict(PAPER_SIZES[name])
    from dpsm_ray.data.tabular import parse_synthetic

    size = parse_synthetic(name)["size"]
    return {split: int(size * fraction) for split, fraction in SYNTHETIC_FRACTIONS.items()}


def check_data_present(name: str, data_root: str | None = None, download: bool = False) -> None:
    """Raise ``FileNotFoundError`` (naming the expected path and ``--download``) if dataset ``name``
    needs files that are not under ``data_root``; the bundled and generated datasets always pass."""
    check_dataset(name)
    if name in VISION_LOADERS:
        check_image_data(name, data_root, download)


def load_splits(name: str, data_root: str | None = None, *, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """The four splits of dataset ``name``, stratified and disjoint, chosen by ``seed``.

    The image datasets are read from (or, with ``download``, fetched into) ``data_root``;
    ``data_workers`` DataLoader processes decode the file-based ones (Caltech-101, iNaturalist).
    """
    check_dataset(name)
    if name == "digits":
        return load_digits(seed)
    if name in VISION_LOADERS:
        if not isinstance(data_workers, int) or data_workers < 0:
            raise ValueError(f"data_workers must be an integer >= 0; got {data_workers!r}")
        return VISION_LOADERS[name](data_root, seed, download, data_workers)
    return load_synthetic(name, seed)


__all__ = [
    "DATASETS", "PAPER_SIZES", "SPLIT_NAMES", "DataSplits", "FileSource", "Split", "TensorSource", "check_data_present", "check_dataset",
    "fitted_sizes", "load_splits", "make_synthetic", "split_sizes", "stratified_partition",
]
