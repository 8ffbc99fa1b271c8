"""How a raw input becomes a model's input, written down so that a predictor can do it to new data.

An ``InputSpec`` is what ``predictor.json`` records under ``input``, and what every tensor-backed
loader evaluates with (``apply`` is their transform without augmentation), so a saved predictor
preprocesses exactly as training and evaluation did:

    model input = (raw / divisor - mean) / std        (float32; mean and std broadcast against shape)

Raw inputs are what a user has: sklearn's digits pixel values 0..16, 8-bit image pixels 0..255 in
``[C, H, W]`` order, a generated dataset's features.  ``image`` says how an image file becomes a
raw input: converted to ``mode``, its shorter side resized to ``resize`` and centre-cropped to
``shape``'s height and width (torchvision's ``Resize`` and ``CenterCrop``), its 0..255 pixels
multiplied by ``pixel_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dpsm_ray.data.augment import random_crop

_IMAGE_MODES = {"L": 1, "RGB": 3}  # PIL mode -> channels


@dataclass(frozen=True)
class ImageSpec:
    mode: str
    resize: int
    pixel_scale: float = 1.0

    def to_json(self) -> dict:
        return {"mode": self.mode, "resize": self.resize, "pixel_scale": self.pixel_scale}

    @classmethod
    def from_json(cls, payload: dict, where: str) -> ImageSpec:
        spec = cls(**_fields(payload, ("mode", "resize", "pixel_scale"), where))
        if spec.mode not in _IMAGE_MODES:
            raise ValueError(f"{where}.mode must be one of {', '.join(_IMAGE_MODES)}; got {spec.mode!r}")
        if not (isinstance(spec.resize, int) and spec.resize >= 1):
            raise ValueError(f"{where}.resize must be an integer >= 1; got {spec.resize!r}")
        if not _positive(spec.pixel_scale):
            raise ValueError(f"{where}.pixel_scale must be a number > 0; got {spec.pixel_scale!r}")
        return spec


@dataclass(frozen=True)
class InputSpec:
    """See the module docstring.  ``mean`` and ``std`` are nested lists (or numbers) that broadcast
    against one input of ``shape``: per feature for the tabular data, per channel (``[C, 1, 1]``)
    for images, one number for the glyphs."""

    shape: tuple[int, ...]
    divisor: float
    mean: list | float
    std: list | float
    raw: str  # what a raw input holds, in words (docs, error messages)
    image: ImageSpec | None = None

    def __post_init__(self) -> None:
        mean, std = torch.tensor(self.mean, dtype=torch.float32), torch.tensor(self.std, dtype=torch.float32)
        for name, value in (("mean", mean), ("std", std)):
            try:  # numpy's: torch's imports sympy (0.35 s) for a loaded predictor's first call
                np.broadcast_shapes(tuple(value.shape), tuple(self.shape))
            except ValueError:
                raise ValueError(
                    f"input.{name} of shape {list(value.shape)} does not broadcast against the input shape {list(self.shape)}"
                ) from None
        if not (std > 0).all():
            raise ValueError("input.std must be > 0 everywhere")
        if self.image is not None and _IMAGE_MODES[self.image.mode] != self.shape[0]:
            raise ValueError(
                f"input.image.mode {self.image.mode} gives {_IMAGE_MODES[self.image.mode]} channels; the input shape {list(self.shape)} has"
                f" {self.shape[0]}"
            )
        # mean and std on each device that asked (the host's first): a copy from the host per batch
        # would block the host until the device had run everything queued before it
        object.__setattr__(self, "_tensors", {torch.device("cpu"): (mean, std)})

    @property
    def features(self) -> int:
        return math.prod(self.shape)

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean`` and ``std`` as float32 tensors on ``device``, copied there once."""
        if device not in self._tensors:
            self._tensors[device] = tuple(t.to(device) for t in self._tensors[torch.device("cpu")])
        return self._tensors[device]

    def __getstate__(self) -> dict:  # pickled (to a Ray worker, say) with the host's copies only
        return {**self.__dict__, "_tensors": {torch.device("cpu"): self._tensors[torch.device("cpu")]}}

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw inputs ``[n, *shape]`` (any real dtype, any device) -> float32 model inputs."""
        mean, std = self.constants(raw.device)
        return (raw.to(torch.float32) / self.divisor - mean) / std

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "divisor": self.divisor, "mean": self.mean, "std": self.std, "raw": self.raw,
                "image": self.image.to_json() if self.image is not None else None}

    @classmethod
    def from_json(cls, payload: dict, where: str = "input") -> InputSpec:
        values = _fields(payload, ("shape", "divisor", "mean", "std", "raw", "image"), where)
        shape = values["shape"]
        if not (isinstance(shape, list) and shape and all(isinstance(d, int) and d >= 1 for d in shape)):
            raise ValueError(f"{where}.shape must be a non-empty list of positive integers; got {shape!r}")
        if not _positive(values["divisor"]):
            raise ValueError(f"{where}.divisor must be a number > 0; got {values['divisor']!r}")
        image = ImageSpec.from_json(values["image"], f"{where}.image") if values["image"] is not None else None
        return cls(tuple(shape), float(values["divisor"]), values["mean"], values["std"], str(values["raw"]), image)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _fields(payload, names: tuple[str, ...], where: str) -> dict:
    if not isinstance(payload, dict):
        raise ValueError(f"{where} must be an object; got {type(payload).__name__}")
    missing = [name for name in names if name not in payload]
    if missing:
        raise ValueError(f"{where} lacks the field {missing[0]!r}")
    return {name: payload[name] for name in names}


def read_pixels(file, mode: str, resize: int, crop: tuple[int, int]) -> np.ndarray:
    """One image file as uint8 pixels ``[C, H, W]``: converted to ``mode``, its shorter side resized
    to ``resize`` and the centre ``crop`` (H, W) cut out (torchvision's ``Resize`` and
    ``CenterCrop``, as the 224-pixel datasets' evaluation transform).  What a predictor does to an
    image file, and what ``folder:`` datasets do to theirs."""
    from PIL import Image
    from torchvision import transforms

    with Image.open(file) as image:
        image = image.convert(mode)
        image = transforms.CenterCrop(crop)(transforms.Resize(resize)(image))
        pixels = np.asarray(image)
    return pixels[None] if _IMAGE_MODES[mode] == 1 else pixels.transpose(2, 0, 1)


def pixel_statistics(images: np.ndarray, ddof: int = 0) -> tuple[float, float]:
    """The mean and standard deviation (``ddof`` as numpy's) of uint8 ``images`` scaled to 0..1,
    from the histogram of their values (no float copy of the images)."""
    counts = np.bincount(images.ravel(), minlength=256).astype(np.float64)
    values = np.arange(256) / 255.0
    mean = float(counts @ values / counts.sum())
    return mean, float(np.sqrt(counts @ (values - mean) ** 2 / (counts.sum() - ddof)))


def standardising_spec(inputs: torch.Tensor, divisor: float, raw: str, image: ImageSpec | None = None) -> InputSpec:
    """Per-feature standardisation by the statistics of ``inputs`` (the training split's raw
    inputs): each feature's mean and standard deviation, the latter at least 1e-3 so that a
    constant feature (a digits corner pixel) stays finite."""
    scaled = inputs.to(torch.float32) / divisor
    return InputSpec(tuple(inputs.shape[1:]), float(divisor), scaled.mean(0).tolist(), scaled.std(0).clamp(min=1e-3).tolist(), raw, image)


def spec_transform(raw: torch.Tensor, ids: torch.Tensor, augment: bool, seed: int, *, spec: InputSpec, padding: int = 0) -> torch.Tensor:
    """A ``TensorSource`` transform: shifted by up to ``padding`` pixels when training (a crop of
    the zero-padded image: the glyphs' and the fonts' blank background), then ``spec.apply``."""
    if augment and padding:
        raw = random_crop(raw, ids, seed, padding)
    return spec.apply(raw)
