"""Glyphs: a procedural many-class image set, for studying conformal training offline in the regime
the paper's image benchmarks are in -- many classes, few training images per class, a network that
fits its training set far better than new data, and augmentation.

Each class is a glyph: ``STROKES`` line segments out of one shared pool of ``POOL`` segments, every
class a different combination.  Classes therefore share strokes, and a pair sharing all but one
differs in a single stroke, so some classes are easy and some are confused with a few others (as
CIFAR-100's are): prediction sets vary in size.  An image of a class is its glyph drawn on a
``SIZE`` x ``SIZE`` canvas with each stroke end jittered, each stroke at its own intensity, the
whole glyph shifted by up to ``SHIFT`` pixels, plus Gaussian pixel noise.

    glyphs                                   100 classes, 20 training images each, noise 0.2
    glyphs:classes=20,train=10,noise=0.2     any of the three

Validation, calibration and test splits hold ``PER_CLASS_EVAL`` images of each class.  Training
batches are augmented by a random shift of up to ``AUGMENT_PADDING`` pixel (a crop of the image
padded by that much): label-preserving, since every glyph already appears at every shift up to
``SHIFT``.  No flips: a mirrored glyph is another glyph.
"""

from __future__ import annotations

import functools

import torch

from dpsm_ray.facts import (
    GLYPHS_PER_CLASS_EVAL, GLYPHS_POOL, GLYPHS_STROKES, glyph_sizes, glyphs_max_classes, parse_glyphs,
)
from dpsm_ray.data.preprocessing import ImageSpec, InputSpec, spec_transform
from dpsm_ray.data.splits import DataSplits, Split, TensorSource, stratified_partition
from dpsm_ray.seeding import generator

PER_CLASS_EVAL = GLYPHS_PER_CLASS_EVAL
SIZE = 16  # pixels
POOL = GLYPHS_POOL  # strokes shared by all classes
STROKES = GLYPHS_STROKES  # strokes per glyph: C(24, 3) = 2024 distinct glyphs
_JITTER = 0.4  # pixels, standard deviation of each stroke end
SHIFT = 2  # pixels, largest shift of a whole glyph
_STROKE_WIDTH = 0.8  # pixels, standard deviation of the Gaussian pen
_POINTS = 8  # pen positions along a stroke
AUGMENT_PADDING = 1
DATA_SEED = 1234  # the images are fixed by the options; only the split depends on the run seed


def glyph_strokes(classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stroke pool ``[POOL, 2 ends, (row, col)]`` and each class's strokes ``[classes,
    STROKES]``: distinct combinations of distinct strokes, drawn from ``seed``."""
    if not 2 <= classes <= glyphs_max_classes():
        raise ValueError(f"classes must be in 2..{glyphs_max_classes()}; got {classes}")
    gen = generator(seed, "glyph strokes")
    # stroke ends inside the canvas with room for the jitter and the shift
    margin = SHIFT + 1.0
    pool = margin + (SIZE - 1 - 2 * margin) * torch.rand(POOL, 2, 2, generator=gen)
    combinations = torch.combinations(torch.arange(POOL), STROKES)  # every distinct glyph
    return pool, combinations[torch.randperm(len(combinations), generator=gen)[:classes]]


def make_glyphs(classes: int, per_class: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` images ``[N, 1, SIZE, SIZE]`` (float, background 0, strokes up to 1 before
    the noise) of each of ``classes`` glyphs, and their labels; a pure function of the arguments."""
    pool, members = glyph_strokes(classes, seed)
    gen = generator(seed, "glyph images")
    count = classes * per_class
    labels = torch.arange(count) % classes
    ends = pool[members[labels]] + _JITTER * torch.randn(count, STROKES, 2, 2, generator=gen)
    ends = ends + torch.randint(-SHIFT, SHIFT + 1, (count, 1, 1, 2), generator=gen)
    intensity = 0.5 + 0.5 * torch.rand(count, STROKES, generator=gen)
    pixel_noise = noise * torch.randn(count, SIZE * SIZE, generator=gen)
    along = torch.linspace(0, 1, _POINTS)[None, None, :, None]
    pen = (ends[:, :, :1] * (1 - along) + ends[:, :, 1:] * along).reshape(count, STROKES * _POINTS, 2)
    pen_intensity = intensity.repeat_interleave(_POINTS, dim=1)
    rows, cols = torch.meshgrid(torch.arange(SIZE, dtype=torch.float32), torch.arange(SIZE, dtype=torch.float32), indexing="ij")
    pixels = torch.stack([rows.flatten(), cols.flatten()], dim=1)  # [SIZE * SIZE, 2]
    images = torch.empty(count, SIZE * SIZE)
    for part in torch.arange(count).split(1024):  # [part, pen positions, pixels] stays small
        distance2 = (pen[part, :, None, :] - pixels).pow(2).sum(-1)
        ink = pen_intensity[part, :, None] * torch.exp(-distance2 / (2 * _STROKE_WIDTH**2))
        images[part] = ink.amax(dim=1)  # overlapping strokes do not add up
    return (images + pixel_noise).reshape(count, 1, SIZE, SIZE), labels


def load_glyphs(spec: str, seed: int) -> DataSplits:
    options = parse_glyphs(spec)
    sizes = glyph_sizes(options)
    images, labels = make_glyphs(options["classes"], sum(sizes.values()) // options["classes"], options["noise"], DATA_SEED)
    parts = stratified_partition(labels, list(sizes.values()), seed)
    train = images[parts[0]]
    # one mean and standard deviation for every pixel; an image file's 0..255 maps onto 0..1
    input_spec = InputSpec(
        (1, SIZE, SIZE),
        1.0,
        float(train.mean()),
        float(train.std()),
        "glyph pixel values (background 0, strokes up to about 1)",
        ImageSpec("L", SIZE, pixel_scale=1 / 255),
    )
    source = TensorSource(images, labels, functools.partial(spec_transform, spec=input_spec, padding=AUGMENT_PADDING))
    splits = [Split(name, ids, source) for name, ids in zip(sizes, parts)]
    return DataSplits(spec, options["classes"], (1, SIZE, SIZE), *splits, input_spec=input_spec)
