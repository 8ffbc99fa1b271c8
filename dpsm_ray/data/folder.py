"""A researcher's own images: ``folder:PATH``, an image folder tree as torchvision's ImageFolder
reads it (``PATH/CLASS/IMAGE``, or already split: ``PATH/{train,val,cal,test}/CLASS/IMAGE``).

The files are listed and each checked (``dpsm_ray.own_data.folder_files``: the split sizes, and
every unreadable or truncated file, known before anything runs), then decoded once -- each
converted to one mode (greyscale when every image is, else RGB, or as the option ``channels``
says), its shorter side resized to ``size`` and the centre ``size`` x ``size`` cropped, exactly
as a predictor reads an image (``preprocessing.read_pixels``) -- and cached as uint8 arrays
(``$DPSM_RAY_CACHE/folders``, keyed by every file's path, size and modification time and the
options), so a sweep's trials load the cache instead of decoding again.
The inputs are standardised per channel by the training split's pixel statistics, saved in the
input spec (and so in every predictor).  Without its own split, the data is split stratified at
random by the run's data seed (fractions ``val``, ``cal``, ``test``; train is the rest).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from dpsm_ray.own_data import PRESPLIT, file_fingerprint, folder_files, folder_sizes, parse_folder
from dpsm_ray.files import CorruptFileError, atomic_write, cache_home

_CACHE_VERSION = 1
_GREYSCALE_MODES = ("1", "L", "LA", "I", "I;16", "F")


def cache_path(path: str, options: dict, files: dict) -> Path:
    """The cache file of the folder as it is now: every file's split, class, path, size and
    modification time, and the options that change the pixels."""
    root = Path(path)
    payload = {
        "version": _CACHE_VERSION,
        "size": options["size"],
        "channels": options["channels"],
        "files": [[split, name, rel] for split, entries in files.items() for name, rel in entries],
        "stat": file_fingerprint([root / rel for entries in files.values() for _, rel in entries]),
    }
    return cache_home() / "folders" / f"{root.name}-{hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:20]}.npz"


def decoded(spec: str, log=None) -> dict[str, np.ndarray]:
    """The folder's images as ``images`` uint8 ``[N, C, size, size]``, ``labels``, ``splits`` (the
    index in PRESPLIT of each image's own split, or -1) and ``classes`` (the class names): read from
    the cache, or decoded and cached (written whole or not at all).  The files were checked when
    listed (``dpsm_ray.own_data.folder_files``)."""
    path, options = parse_folder(spec)
    classes, files, skipped, modes, shapes = folder_files(path, options["skip"])
    cache = cache_path(path, options, files)
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as arrays:
            return {key: arrays[key] for key in ("images", "labels", "splits", "classes")}
    root, index = Path(path), {name: i for i, name in enumerate(classes)}
    entries = [(split, name, rel) for split, pairs in files.items() for name, rel in pairs]
    mode = {1: "L", 3: "RGB"}.get(options["channels"]) or ("L" if modes <= set(_GREYSCALE_MODES) else "RGB")
    size = options["size"]
    say = log or (lambda line: print(line, file=sys.stderr))
    widths, heights = sorted(w for w, _ in shapes), sorted(h for _, h in shapes)
    pixels = f"{widths[0]}x{heights[0]}" if len(shapes) == 1 else f"{widths[0]}-{widths[-1]} x {heights[0]}-{heights[-1]}"
    say(
        f"folder:{path}: decoding {len(entries)} images of {len(classes)} classes once (cached in {cache.parent}): modes"
        f" {', '.join(sorted(modes))}, {pixels} pixels -> each converted to {mode}, its shorter side resized to {size} and the centre"
        f" {size}x{size} cropped"
        + (f"; {left_out(skipped)} left out (skip=1)" if skipped else "")
        + (f"; some images are greyscale: folder:{path}:channels=1 makes every image greyscale instead"
           if mode == "RGB" and modes & set(_GREYSCALE_MODES) and not options["channels"] else "")
    )
    images = np.stack([_pixels_of(root / rel, path, mode, size) for _, _, rel in entries])
    arrays = {
        "images": images,
        "labels": np.array([index[name] for _, name, _ in entries], dtype=np.int64),
        "splits": np.array([PRESPLIT.index(split) if split else -1 for split, _, _ in entries], dtype=np.int64),
        "classes": np.array(classes),
    }
    atomic_write(cache, lambda handle: np.savez(handle, **arrays))
    return arrays


def left_out(files: tuple[str, ...]) -> str:
    """``1 file that is not a readable image (PATH)`` or ``N files that are not readable images (the first: PATH)``."""
    if len(files) == 1:
        return f"1 file that is not a readable image ({files[0]})"
    return f"{len(files)} files that are not readable images (the first: {files[0]})"


def _pixels_of(file: Path, path: str, mode: str, size: int) -> np.ndarray:
    """``read_pixels``, with an image that no longer decodes (changed since it was listed and
    checked) named."""
    from dpsm_ray.data.preprocessing import read_pixels

    try:
        return read_pixels(file, mode, size, (size, size))
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise CorruptFileError(
            file, f"in dataset folder:{path} cannot be decoded ({type(error).__name__}: {str(error)[:120]}); remove or replace it"
        ) from None


def check_folder(spec: str, data_root=None, download: bool = False) -> None:
    """What the driver runs before anything starts: the layout checked and the images decoded
    into the cache (each trial then loads the cache)."""
    folder_sizes(spec)
    decoded(spec)


def load_folder(spec: str, seed: int):
    import torch

    from dpsm_ray.data.preprocessing import ImageSpec, InputSpec, pixel_statistics, spec_transform
    from dpsm_ray.data.splits import DataSplits, Split, TensorSource, stratified_partition
    from dpsm_ray.data.vision import per_channel
    from dpsm_ray.seeding import derive_seed

    path, options = parse_folder(spec)
    arrays = decoded(spec)
    images, labels = torch.from_numpy(arrays["images"]), torch.from_numpy(arrays["labels"])
    if (arrays["splits"] >= 0).any():
        parts = [torch.from_numpy(np.flatnonzero(arrays["splits"] == i)) for i in range(len(PRESPLIT))]
    else:
        sizes = folder_sizes(spec)
        parts = stratified_partition(labels, [sizes[split] for split in PRESPLIT], derive_seed(seed, "folder"))
    channels, size = images.shape[1], images.shape[2]
    train = arrays["images"][parts[0].numpy()]  # uint8: the statistics come from each channel's histogram
    statistics = [pixel_statistics(train[:, channel], ddof=1) for channel in range(channels)]
    mean, std = [m for m, _ in statistics], [max(s, 1e-3) for _, s in statistics]
    mode = "L" if channels == 1 else "RGB"
    input_spec = InputSpec(
        (channels, size, size),
        255.0,
        per_channel(tuple(mean)),
        per_channel(tuple(std)),
        f"8-bit {'greyscale' if channels == 1 else 'RGB'} pixel values 0..255 in [C, H, W] order, [{channels}, {size}, {size}]",
        ImageSpec(mode, size),
    )
    source = TensorSource(images, labels, functools.partial(spec_transform, spec=input_spec))
    splits = [Split(name, ids, source) for name, ids in zip(PRESPLIT, parts)]
    return DataSplits(
        spec,
        len(arrays["classes"]),
        (channels, size, size),
        *splits,
        input_spec=input_spec,
        class_names=tuple(str(name) for name in arrays["classes"]),
    )
