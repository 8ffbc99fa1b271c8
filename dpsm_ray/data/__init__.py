"""Datasets and their train / val / cal / test splits."""

from __future__ import annotations

from dpsm_ray.catalog import DATASETS, check_dataset, split_sizes
from dpsm_ray.data.fonts import find_faces, load_fonts
from dpsm_ray.data.glyphs import load_glyphs, make_glyphs
from dpsm_ray.data.splits import SPLIT_NAMES, DataSplits, FileSource, Split, TensorSource, stratified_partition
from dpsm_ray.data.tabular import load_digits, load_synthetic, make_synthetic
from dpsm_ray.data.vision import LOADERS as VISION_LOADERS
from dpsm_ray.data.vision import PAPER_SIZES, fitted_sizes
from dpsm_ray.data.vision import check_data_present as check_image_data

def check_data_present(name: str, data_root: str | None = None, download: bool = False) -> None:
    """Raise ``FileNotFoundError`` (naming the expected path and ``--download``) if dataset ``name``
    needs files that are not under ``data_root``; the bundled and generated datasets always pass."""
    check_dataset(name)
    if name in VISION_LOADERS:
        check_image_data(name, data_root, download)
    if name.partition(":")[0] == "fonts":
        find_faces(data_root)


def load_splits(name: str, data_root: str | None = None, *, seed: int, download: bool = False, data_workers: int = 4) -> DataSplits:
    """The four splits of dataset ``name``, stratified and disjoint, chosen by ``seed``.

    The image datasets are read from (or, with ``download``, fetched into) ``data_root``; the
    fonts from the font files under it (default /usr/share/fonts);
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
    if name.partition(":")[0] == "fonts":
        return load_fonts(name, data_root, seed)
    return load_synthetic(name, seed)


__all__ = [
    "DATASETS", "PAPER_SIZES", "SPLIT_NAMES", "DataSplits", "FileSource", "Split", "TensorSource", "check_data_present", "check_dataset",
    "fitted_sizes", "load_splits", "make_glyphs", "make_synthetic", "split_sizes", "stratified_partition",
]
