"""Datasets and their train / val / cal / test splits."""

from __future__ import annotations

from dpsm_ray.data.glyphs import glyph_sizes, load_glyphs, make_glyphs, parse_glyphs
from dpsm_ray.data.splits import SPLIT_NAMES, DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.data.tabular import DIGITS_SIZES, SYNTHETIC_FRACTIONS, load_digits, load_synthetic, make_synthetic, parse_synthetic
from dpsm_ray.data.vision import LOADERS as VISION_LOADERS
from dpsm_ray.data.vision import PAPER_SIZES, fitted_sizes
from dpsm_ray.data.vision import check_data_present as check_image_data

DATASETS = ("digits", "synthetic", "glyphs", "fashion_mnist", "cifar100", "caltech101", "inaturalist", "inaturalist2018")
# the generated datasets, whose names take options (``synthetic:classes=20``)
OPTION_PARSERS = {"synthetic": parse_synthetic, "glyphs": parse_glyphs}


def check_dataset(name: str) -> str:
    base = name.partition(":")[0]
    if base not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {name!r}")
    if base in OPTION_PARSERS:
        OPTION_PARSERS[base](name)
    elif name != base:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)} (only {' and '.join(OPTION_PARSERS)} take options); got {name!r}")
    return name


def split_sizes(name: str) -> dict[str, int]:
    """Sizes of the four splits of ``name``, known without loading any data (for the image
    datasets, the paper's sizes: a smaller copy on disk gets them scaled down)."""
    check_dataset(name)
    if name == "digits":
        return dict(DIGITS_SIZES)
    if name in PAPER_SIZES:
        return dict(PAPER_SIZES[name])
    if name.partition(":")[0] == "glyphs":
        return glyph_sizes(parse_glyphs(name))
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
    if name.partition(":")[0] == "glyphs":
        return load_glyphs(name, seed)
    return load_synthetic(name, seed)


__all__ = [
    "DATASETS", "PAPER_SIZES", "SPLIT_NAMES", "DataSplits", "FileSource", "Split", "TensorSource", "check_data_present", "check_dataset",
    "fitted_sizes", "load_splits", "make_glyphs", "make_synthetic", "split_sizes", "stratified_partition",
]
