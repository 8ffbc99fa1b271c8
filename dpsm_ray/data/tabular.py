"""Small offline datasets: scikit-learn's bundled digits (real, 8x8) and procedural Gaussian
classes (synthetic, any number of classes and difficulty)."""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from dpsm_ray.facts import DIGITS_SIZES, SYNTHETIC_FRACTIONS, parse_synthetic
from dpsm_ray.data.preprocessing import ImageSpec, spec_transform, standardising_spec
from dpsm_ray.data.splits import DataSplits, Split, TensorSource, stratified_partition



def from_tensors(name: str, inputs: torch.Tensor, labels: torch.Tensor, sizes: dict[str, int], seed: int, *, divisor: float = 1.0,
                 raw: str = "features", image: ImageSpec | None = None, class_names: tuple[str, ...] | None = None) -> DataSplits:
    """Raw ``inputs`` split at random; every batch is ``inputs / divisor`` standardised per
    feature by the training split's mean and standard deviation (``preprocessing.standardising_spec``)."""
    parts = stratified_partition(labels, list(sizes.values()), seed)
    spec = standardising_spec(inputs[parts[0]], divisor, raw, image)
    source = TensorSource(inputs, labels, functools.partial(spec_transform, spec=spec))
    splits = [Split(split_name, ids, source) for split_name, ids in zip(sizes, parts)]
    return DataSplits(name, int(labels.max()) + 1, tuple(inputs.shape[1:]), *splits, input_spec=spec, class_names=class_names)


def load_digits(seed: int) -> DataSplits:
    """The 1797 8x8 handwritten digits bundled with scikit-learn, as ``[1, 8, 8]`` images of
    pixel values 0..16 (light ink on a dark background), divided by 16 and standardised."""
    pixels, targets = digits_arrays()
    inputs = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8)
    labels = torch.tensor(targets, dtype=torch.int64)
    # an 8-bit grayscale image file maps its 0..255 onto the digits' 0..16
    image = ImageSpec("L", 8, pixel_scale=16 / 255)
    return from_tensors(
        "digits",
        inputs,
        labels,
        DIGITS_SIZES,
        seed,
        divisor=16.0,
        raw="sklearn digits pixel values 0..16 ([1, 8, 8] or 64 features)",
        image=image,
        class_names=tuple(str(digit) for digit in range(10)),
    )


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits()`` data and target, read from the file it reads without
    importing scikit-learn (a second of every sweep trial's start-up); through scikit-learn where
    the file is not where it ships it."""
    found = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = (
        Path(found.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if found and found.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        return bunch.data, bunch.target
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        data = np.loadtxt(handle, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def make_synthetic(classes: int, dim: int, size: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian classes with known structure: class c has mean ``m_c`` (random, unit scale) and
    isotropic noise ``noise * s_c`` where ``s_c`` grows from 0.5 to 1.5 over the classes, so some
    classes are easy and some hard (prediction sets then vary in size).  Labels are balanced."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=gen) * 2.0
    spread = noise * torch.linspace(0.5, 1.5, classes)
    labels = torch.arange(size) % classes
    labels = labels[torch.randperm(size, generator=gen)]
    inputs = means[labels] + spread[labels, None] * torch.randn(size, dim, generator=gen)
    return inputs, labels


def load_synthetic(spec: str, seed: int) -> DataSplits:
    options = parse_synthetic(spec)
    # the data itself is fixed by its parameters; only the split depends on the run seed
    inputs, labels = make_synthetic(options["classes"], options["dim"], options["size"], options["noise"], seed=1234)
    sizes = {name: int(options["size"] * fraction) for name, fraction in SYNTHETIC_FRACTIONS.items()}
    return from_tensors(spec, inputs, labels, sizes, seed, raw=f"{options['dim']} real features of the generated {spec} data")
