"""Fonts: a many-class benchmark of real typefaces, made offline.  Each class is a character --
the digits, the Latin letters, and the Greek and Cyrillic letters that do not look exactly like an
earlier class (``facts.FONT_CLASSES``) -- and an image is the character rendered by Pillow in one
face of an open typeface that Debian packages (``facts.FONT_PACKAGES``), at 32x32 greyscale
(white on black), with seeded jitter of its size, position, rotation and stroke width, then dimmed
and overlaid with noise (``CONTRAST``, ``NOISE``).

    fonts                               141 classes, 2 renders of each in each training face,
                                        3 in each held-out face
    fonts:classes=20,train=1,eval=3     the first 20 classes; any of the options
    fonts:noise=20                      less noise on every render (``NOISE``: 50)
    fonts_transfer                      small data on pretrained features: 40 training images of each
                                        of 100 classes from the held-out faces, for a network
                                        pretrained on the training faces (``load_fonts_transfer``)
    fonts_transfer:classes=79,first=62,backbone_classes=62
                                        the Greek and Cyrillic classes, for a network pretrained
                                        on the digits and Latin letters only

**Split by design, not by image.**  The typefaces are grouped by design (``facts.FONT_DESIGNS``:
metric clones such as Arimo, Liberation Sans, Nimbus Sans and FreeSans are one design, and so are
a superfamily's siblings), and each design goes whole to training (96 faces) or to the held-out
pool (32 faces: Cousine and Liberation Mono, Noto, C059, URW Gothic).  Every held-out render of a
class is cut at random (the run seed) into validation, calibration and test, so calibration and
test are exchangeable, and a model is always asked about typefaces it never saw.

**Look-alike characters.**  Latin A, Greek Alpha and Cyrillic A are one shape in most fonts: such
a pair would make two labels for one image.  A Greek or Cyrillic letter is left out when its glyph
is pixel-identical to an earlier class's (digits, then Latin, Greek, Cyrillic) in at least half of
the faces (``identical_glyphs``; 34 of 175 candidates).  What remains ambiguous is ambiguous to a
reader too, and is part of the benchmark: letters that differ by size only (o / O, Cyrillic к / К
under the size jitter), l / I / 1 in some sans faces, and italic Cyrillic т, п, и against m, n, u.

The renders are a pure function of the options and the font files, made once and cached as one
uint8 array file (no pickle) under ``$DPSM_RAY_CACHE/fonts`` (default ``~/.cache/dpsm_ray``),
named by the hash of everything they depend on; the run seed chooses only the split.  Training
batches are shifted by up to ``AUGMENT_PADDING`` pixels (no flips: a mirrored letter is another
letter or none).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from dpsm_ray.facts import (
    FONT_CLASSES,
    FONT_DESIGNS,
    FONT_PACKAGES,
    FONTS_DEFAULTS,
    FONTS_NOISE,
    font_faces,
    font_sizes,
    font_transfer_sizes,
    fonts_backbone_options,
    fonts_target_options,
    parse_fonts,
    parse_fonts_transfer,
)
from dpsm_ray.files import atomic_write, cache_home, sha256_file

SIZE = 32  # pixels of an image
_SCALE = 2  # rendered at twice the size, then averaged down (anti-aliasing)
POINT_SIZES = range(34, 47)  # the font size at the rendering scale (cap height ~ 0.4-0.55 of the image)
ROTATION = 12.0  # degrees, largest rotation either way
SHIFT = 4  # pixels at the rendering scale, largest shift of the glyph's centre
STROKES = (0, 1)  # extra stroke width at the rendering scale: thicker or not
# Each image then degraded: its glyph dimmed to a fraction of full white, and Gaussian noise added
# (standard deviation in 0..255 units).  Without them a LeNet reached 85% held-out accuracy and HPS
# sets of 1.1 at alpha 0.1 in 8 epochs, past the paper's regime; with noise 40 / 60: 70% / 58%,
# HPS 2.4 / 5.5 (docs/datasets.md).  The noise is an option (``fonts:noise=S``); NOISE is its default.
CONTRAST = (0.25, 1.0)
NOISE = FONTS_NOISE
AUGMENT_PADDING = 2
DATA_SEED = 1234  # the images are fixed by the options; only the split depends on the run seed
_RENDER_VERSION = 2  # bump when the rendering changes: it is part of the cache key (2: the dimming and noise)
_FONT_ROOT = Path("/usr/share/fonts")
APT_LINE = "apt-get install " + " ".join(FONT_PACKAGES)


def cache_dir() -> Path:
    return cache_home() / "fonts"


def face_name(path: Path) -> tuple[str, str] | None:
    """(family, style) of a font file, as its name table gives them (the typographic names where
    present), or None when fontTools cannot read it."""
    from fontTools.ttLib import TTFont

    try:
        with TTFont(path, lazy=True) as font:
            names = font["name"]
            family = names.getDebugName(16) or names.getDebugName(1)
            style = names.getDebugName(17) or names.getDebugName(2)
    except Exception:  # a damaged or unusual file anywhere under the fonts folder is just not one of these faces
        return None
    return (family, style) if family and style else None


def find_faces(root: str | os.PathLike | None = None) -> dict[tuple[str, str], Path]:
    """Every face of ``facts.FONT_DESIGNS`` -> its file under ``root`` (default /usr/share/fonts);
    ``FileNotFoundError`` naming the missing faces and the apt line that installs them.  The folder
    is read once per process (a few seconds): the data check before a run and the load both ask."""
    return dict(faces_under(Path(root) if root is not None else _FONT_ROOT))


@functools.lru_cache(maxsize=4)
def faces_under(root: Path) -> tuple[tuple[tuple[str, str], Path], ...]:
    wanted = set(font_faces("train") + font_faces("held_out"))
    found: dict[tuple[str, str], Path] = {}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            if path.suffix.lower() in (".ttf", ".otf") and path.is_file():
                face = face_name(path)
                if face in wanted:
                    found.setdefault(face, path)
    missing = sorted(wanted - set(found))
    if missing:
        shown = ", ".join(f"{family} {style}" for family, style in missing[:6]) + (
            f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        )
        raise FileNotFoundError(f"dataset fonts: {len(missing)} of its {len(wanted)} font faces are not under {root} ({shown}); "
                                f"Debian/Ubuntu: {APT_LINE}, or pass --data-root DIR holding them")
    return tuple(found.items())


def draw(font_file: Path, character: str, *, point_size: int, angle: float = 0.0, shift: tuple[int, int] = (0, 0), stroke: int = 0):
    """``character`` in ``font_file``, white on black on a canvas ``_SCALE`` times the image's size,
    centred (Pillow's "mm" anchor: the middle of the line's ascender and descender, so a lowercase
    letter sits lower than a capital), shifted and rotated: a greyscale PIL image."""
    from PIL import Image, ImageDraw

    side = SIZE * _SCALE
    image = Image.new("L", (side, side))
    centre = (side / 2 + shift[0], side / 2 + shift[1])
    ImageDraw.Draw(image).text(
        centre, character, fill=255, font=truetype(str(font_file), point_size), anchor="mm", stroke_width=stroke, stroke_fill=255
    )
    return image.rotate(angle, resample=Image.Resampling.BILINEAR, center=centre) if angle else image


def render(font_file: Path, character: str, **jitter) -> np.ndarray:
    """``draw``'s image averaged down to uint8 ``[SIZE, SIZE]``."""
    from PIL import Image

    return np.asarray(draw(font_file, character, **jitter).resize((SIZE, SIZE), Image.Resampling.BOX), dtype=np.uint8)


@functools.lru_cache(maxsize=512)
def truetype(path: str, point_size: int):
    from PIL import ImageFont

    return ImageFont.truetype(path, point_size)


def render_face(font_file: Path, classes: str, renders: int, rng: np.random.Generator, noise: float = NOISE) -> np.ndarray:
    """``renders`` jittered images of each of ``classes`` in one face: ``[len(classes) * renders,
    SIZE, SIZE]``, class by class, each dimmed and overlaid with Gaussian noise of s.d. ``noise``."""
    images = np.empty((len(classes) * renders, SIZE, SIZE), dtype=np.uint8)
    for index in range(len(images)):
        glyph = render(
            font_file,
            classes[index // renders],
            point_size=int(rng.choice(POINT_SIZES)),
            angle=float(rng.uniform(-ROTATION, ROTATION)),
            shift=(int(rng.integers(-SHIFT, SHIFT + 1)), int(rng.integers(-SHIFT, SHIFT + 1))),
            stroke=int(rng.choice(STROKES)),
        )
        degraded = glyph * rng.uniform(*CONTRAST) + rng.normal(0.0, noise, size=glyph.shape)
        images[index] = np.clip(np.rint(degraded), 0, 255)
    return images


def _rendering_key(options: dict, faces: dict[tuple[str, str], Path]) -> str:
    """The hash of everything the renders depend on: the options, the rendering's settings and
    version, Pillow's and FreeType's versions, and every font file's bytes."""
    import PIL
    from PIL import features

    # the noise is hashed as a setting, so the keys made before it was an option still hold
    counts = {k: int(v) for k, v in sorted(options.items()) if k != "noise"}
    payload = {
        "options": counts, "classes": FONT_CLASSES, "version": _RENDER_VERSION, "seed": DATA_SEED,
        "pillow": PIL.__version__, "freetype": features.version("freetype2"),
        "settings": [SIZE, _SCALE, list(POINT_SIZES), ROTATION, SHIFT, list(STROKES), list(CONTRAST), float(options.get("noise", NOISE))],
        "faces": [[family, style, sha256_file(faces[(family, style)])] for family, style in font_faces("train") + font_faces("held_out")],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def rendered(options: dict, root: str | os.PathLike | None = None, log=None) -> dict[str, np.ndarray]:
    """Every render of the options -- ``images`` uint8 ``[N, SIZE, SIZE]``, ``labels``, ``faces``
    (the index of each image's face in ``font_faces("train") + font_faces("held_out")``) --
    read from the cache, or rendered and cached (written whole or not at all)."""
    faces = find_faces(root)
    path = cache_dir() / f"fonts-{_rendering_key(options, faces)}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as cached:
            return {key: cached[key] for key in ("images", "labels", "faces")}
    classes = FONT_CLASSES[: int(options["classes"])]
    order = font_faces("train") + font_faces("held_out")
    if log is not None:
        log(f"fonts: rendering {len(classes)} characters in {len(order)} font faces (once; cached in {path.parent})")
    rng = np.random.default_rng(DATA_SEED)
    images, labels, face_ids = [], [], []
    for index, face in enumerate(order):
        renders = int(options["train"] if index < len(font_faces("train")) else options["eval"])
        images.append(render_face(faces[face], classes, renders, rng, float(options.get("noise", NOISE))))
        labels.append(np.repeat(np.arange(len(classes), dtype=np.int64), renders))
        face_ids.append(np.full(len(classes) * renders, index, dtype=np.int64))
    arrays = {"images": np.concatenate(images), "labels": np.concatenate(labels), "faces": np.concatenate(face_ids)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda handle: np.savez(handle, **arrays))
    return arrays


def _held_out_parts(
    labels: np.ndarray, held_out: np.ndarray, sizes: dict[str, int], classes: int, seed: int, splits=("val", "cal", "test")
) -> list[np.ndarray]:
    """The held-out images' ids cut into ``splits`` (validation, calibration and test), the same
    number of each class in each (``sizes`` divided by ``classes``), at random by ``seed``."""
    rng = np.random.default_rng([DATA_SEED, seed])
    per_class = [sizes[split] // classes for split in splits]
    parts = [[] for _ in splits]
    for label in range(classes):
        ids = rng.permutation(held_out[labels[held_out] == label])
        bounds = np.cumsum([0, *per_class])
        for part, start, stop in zip(parts, bounds, bounds[1:]):
            part.append(ids[start:stop])
    return [np.sort(np.concatenate(part)) for part in parts]


def load_fonts(spec: str, data_root: str | os.PathLike | None, seed: int, log=None):
    options = parse_fonts(spec)
    classes = int(options["classes"])
    sizes = font_sizes(options)
    arrays = rendered(options, data_root, log=log)
    labels, faces = arrays["labels"], arrays["faces"]
    train = np.flatnonzero(faces < len(font_faces("train")))
    parts = [train, *_held_out_parts(labels, np.flatnonzero(faces >= len(font_faces("train"))), sizes, classes, seed)]
    return _font_splits(spec, arrays, parts, classes, arrays["images"][train], FONT_CLASSES[:classes])


def load_fonts_transfer(spec: str, data_root: str | os.PathLike | None, seed: int, log=None):
    """``fonts_transfer``: small data on pretrained features, as Caltech-101's networks start from
    ImageNet.  Every split comes from the held-out faces: ``shots`` training images of each of the
    ``classes`` classes from FONT_CLASSES[``first``] on (labelled 0, 1, ... in that order), and the
    rest of its renders cut into validation, calibration and test, at random by ``seed``.  The
    inputs are standardised by the training faces of the backbone's data,
    ``fonts:classes=B,eval=E,noise=S`` (``facts.fonts_backbone_options``), so a network pretrained
    there (``--pretrained-path``: its model.pt; every layer but the head) sees the pixel scale it
    learned on.

    Where the classes are the backbone's (``first + classes <= B``) they are cut from that same
    cache.  Where the backbone never saw them (``first >= B``) they are cut from the renders of
    ``fonts:classes=first+classes`` at the same ``eval`` and ``noise`` (``facts.fonts_target_options``),
    and the statistics still come from the backbone's own cache: one seeded generator draws every
    render, face by face and class by class, so a class's renders depend on how many classes the
    cache holds (only the first face's agree), and the backbone's statistics are exact only from
    its own renders.  The round-three target (``classes=79,first=62,backbone_classes=62``) is cut
    from ``fonts:eval=5,noise=20``, the default transfer's backbone data, read from its cache when
    that backbone was pretrained here."""
    options = parse_fonts_transfer(spec)
    classes, first = int(options["classes"]), int(options["first"])
    backbone, target = fonts_backbone_options(options), fonts_target_options(options)
    cut = rendered(target, data_root, log=log)
    pretraining = cut if target == backbone else rendered(backbone, data_root, log=log)
    # the classes before ``first`` are dropped and the rest relabelled from 0; with ``first`` 0 the
    # source is the whole cache, as before the option existed, so a run's saved split ids still hold
    kept = np.flatnonzero(cut["labels"] >= first)
    arrays = {"images": cut["images"][kept], "labels": cut["labels"][kept] - first, "faces": cut["faces"][kept]}
    held_out = np.flatnonzero(arrays["faces"] >= len(font_faces("train")))
    parts = _held_out_parts(arrays["labels"], held_out, font_transfer_sizes(options), classes, seed, ("train", "val", "cal", "test"))
    statistics_of = pretraining["images"][pretraining["faces"] < len(font_faces("train"))]
    return _font_splits(spec, arrays, parts, classes, statistics_of, FONT_CLASSES[first : first + classes])


def _font_splits(spec: str, arrays: dict, parts: list[np.ndarray], classes: int, statistics_of: np.ndarray, class_names: str):
    """The four splits (``parts``: ids into ``arrays``) of the ``classes`` classes named by the
    characters ``class_names``, standardised by the pixel statistics of the uint8 images
    ``statistics_of`` (a training split's, or a backbone's pretraining data's)."""
    import torch

    from dpsm_ray.data.preprocessing import ImageSpec, InputSpec, pixel_statistics, spec_transform
    from dpsm_ray.data.splits import DataSplits, Split, TensorSource

    mean, std = pixel_statistics(statistics_of)
    input_spec = InputSpec((1, SIZE, SIZE), 255.0, mean, std, f"8-bit greyscale pixel values 0..255, white on black, [1, {SIZE}, {SIZE}]",
                           ImageSpec("L", SIZE))
    source = TensorSource(torch.from_numpy(arrays["images"][:, None]).contiguous(), torch.from_numpy(arrays["labels"]),
                          functools.partial(spec_transform, spec=input_spec, padding=AUGMENT_PADDING))
    splits = [Split(name, torch.from_numpy(ids), source) for name, ids in zip(("train", "val", "cal", "test"), parts)]
    return DataSplits(spec, classes, (1, SIZE, SIZE), *splits, input_spec=input_spec, class_names=tuple(class_names))


def identical_glyphs(faces: dict[tuple[str, str], Path], candidates: str) -> dict[tuple[str, str], int]:
    """For each pair (earlier, later) of ``candidates`` whose glyphs are pixel-identical in some
    face (drawn at the middle size, unjittered, before averaging down), the number of such faces: how the look-alike
    rule of the module docstring chose ``facts.FONT_CLASSES``."""
    counts: dict[tuple[str, str], int] = {}
    point_size = POINT_SIZES[len(POINT_SIZES) // 2]
    for path in faces.values():
        images = {}
        for character in candidates:
            images.setdefault(draw(path, character, point_size=point_size).tobytes(), []).append(character)
        for same in images.values():
            for later in range(1, len(same)):
                for earlier in same[:later]:
                    counts[(earlier, same[later])] = counts.get((earlier, same[later]), 0) + 1
    return counts


__all__ = ["APT_LINE", "FONT_DESIGNS", "find_faces", "identical_glyphs", "load_fonts", "load_fonts_transfer", "render", "rendered"]
