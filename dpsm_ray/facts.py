"""Facts the command line checks, known without importing torch or Ray: the methods' option
choices, the built-in datasets' sizes and options (the fonts' characters and typefaces), the
models' depths and heads.  What the cards (``dpsm_ray.cards``) and the CLI read, so that
``--help``, ``--version`` and every argument error answer before torch is imported.  Facts only:
no registry, no checks but the parsing of a dataset's options.
"""

from __future__ import annotations

import math

# how a search proposes its trials (dpsm_ray.sweep.search.MethodStudy), as sweep.json names them and
# as the progress lines and the report write them
SAMPLER_TITLES = {"tpe": "Optuna TPE", "random": "Optuna random", "sobol": "Sobol-sequence", "sobol-tpe": "Sobol-started Optuna TPE",
                  "gp": "Optuna GP"}


def _dataset_options(spec: str, defaults: dict) -> dict:
    """``family`` or ``family:key=value,...`` -> ``defaults`` updated by the named options."""
    family, _, rest = spec.partition(":")
    return parse_options(family, rest, defaults)


def parse_options(family: str, text: str, defaults: dict) -> dict:
    """``key=value,...`` -> ``defaults`` updated by the named options, each read as its default's
    type (an int, a float that must be finite, or a string).  Range checks are the caller's."""
    options = dict(defaults)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"dataset: unknown {family} option {key!r}; allowed: {', '.join(defaults)}")
        kind = type(defaults[key])
        try:
            options[key] = kind(value)
        except ValueError:
            raise ValueError(f"dataset: {family} option {key} must be a number; got {value!r}") from None
        if kind is float and not math.isfinite(options[key]):
            raise ValueError(f"dataset: {family} option {key} must be a finite number; got {value!r}")
    return options


# -- the methods' options ---------------------------------------------------------------------
CE_BATCHES = ("full", "half")
CONFTR_SPLITS = ("halves", "batch")
CUT_SCORES = ("hps", "aps")
Q_INITS = ("dataset", "zero", "random")
SPLITS = ("halves", "batch")  # DPSM's D1 / D2 split of a batch
# DPSM's default gamma per epoch: in an epoch q moves at most this times alpha down (times 1 - alpha
# up), whatever the number of steps.  Chosen by |q - Q_n| from scratch and fine-tuning
# (docs/method.md): from scratch Q_n falls from ~0.9 to ~0.01 within five epochs.
QUANTILE_LR_PER_EPOCH = 2.0

# -- datasets --------------------------------------------------------------------------------
DIGITS_SIZES = {"train": 1000, "val": 300, "cal": 200, "test": 297}  # all 1797 digits
SYNTHETIC_DEFAULTS = {"classes": 10, "dim": 16, "size": 3000, "noise": 1.0}
SYNTHETIC_FRACTIONS = {"train": 0.5, "val": 0.15, "cal": 0.1, "test": 0.25}
GLYPHS_DEFAULTS = {"classes": 100, "train": 20, "noise": 0.2}
GLYPHS_PER_CLASS_EVAL = {"val": 10, "cal": 10, "test": 20}
GLYPHS_POOL = 24  # strokes shared by all classes
GLYPHS_STROKES = 3  # strokes per glyph: C(24, 3) = 2024 distinct glyphs
# fonts (dpsm_ray/data/fonts.py): the characters that are classes -- digits, Latin, then the Greek
# and Cyrillic letters whose glyph is not pixel-identical to an earlier class's in at least half of
# the fonts below (tests/data/test_fonts.py derives this list again from the installed fonts)
FONT_CLASSES = (
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    "ΓΔΘΛΞΠΣΦΨΩαβγδεζηθικλμνξπρςστυφχψω"
    "БДЖЗИЙКЛУФЦЧШЩЪЫЬЭЮЯбвгджзийклмнптфцчшщъыьэюя"
)
# the typefaces, grouped by design (a clone or sibling of a design is in its group), and the split
# each design's renders go to: "train", or "held_out" (validation, calibration and test)
FONT_DESIGNS = {
    "Helvetica-like sans": (
        "train",
        {
            "Arimo": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Liberation Sans": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Liberation Sans Narrow": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Nimbus Sans": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Nimbus Sans Narrow": ("Regular", "Oblique", "Bold", "Bold Oblique"),
            "FreeSans": ("Regular", "Oblique", "Bold", "Bold Oblique"),
        },
    ),
    "Times-like serif": (
        "train",
        {
            "Tinos": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Liberation Serif": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Nimbus Roman": ("Regular", "Italic", "Bold", "Bold Italic"),
            "FreeSerif": ("Regular", "Italic", "Bold", "Bold Italic"),
        },
    ),
    "Courier-like mono": (
        "train",
        {"Nimbus Mono PS": ("Regular", "Italic", "Bold", "Bold Italic"), "FreeMono": ("Regular", "Oblique", "Bold", "Bold Oblique")},
    ),
    "DejaVu": (
        "train",
        {
            "DejaVu Sans": (
                "Book",
                "Oblique",
                "Bold",
                "Bold Oblique",
                "ExtraLight",
                "Condensed",
                "Condensed Oblique",
                "Condensed Bold",
                "Condensed Bold Oblique",
            ),
            "DejaVu Sans Mono": ("Book", "Oblique", "Bold", "Bold Oblique"),
            "DejaVu Serif": (
                "Book",
                "Italic",
                "Bold",
                "Bold Italic",
                "Condensed",
                "Condensed Italic",
                "Condensed Bold",
                "Condensed Bold Italic",
            ),
        },
    ),
    "Lato": (
        "train",
        {
            "Lato": (
                "Hairline",
                "Hairline Italic",
                "Thin",
                "Thin Italic",
                "Light",
                "Light Italic",
                "Regular",
                "Italic",
                "Medium",
                "Medium Italic",
                "Semibold",
                "Semibold Italic",
                "Bold",
                "Bold Italic",
                "Heavy",
                "Heavy Italic",
                "Black",
                "Black Italic",
            )
        },
    ),
    "Palatino-like serif": ("train", {"P052": ("Roman", "Italic", "Bold", "Bold Italic")}),
    "Bookman-like serif": ("train", {"URW Bookman": ("Light", "Light Italic", "Demi", "Demi Italic")}),
    "Zapf Chancery-like script": ("train", {"Z003": ("Medium Italic",)}),
    "Cousine and Liberation Mono": (
        "held_out",
        {"Cousine": ("Regular", "Italic", "Bold", "Bold Italic"), "Liberation Mono": ("Regular", "Italic", "Bold", "Bold Italic")},
    ),
    "Noto": (
        "held_out",
        {
            "Noto Sans": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Noto Sans Display": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Noto Serif": ("Regular", "Italic", "Bold", "Bold Italic"),
            "Noto Serif Display": ("Regular", "Italic", "Bold", "Bold Italic"),
        },
    ),
    "Century Schoolbook-like serif": ("held_out", {"C059": ("Roman", "Italic", "Bold", "Bold Italic")}),
    "Avant Garde-like sans": ("held_out", {"URW Gothic": ("Book", "Book Oblique", "Demi", "Demi Oblique")}),
}
# the Debian packages that install them (README, .ci/run)
FONT_PACKAGES = (
    "fonts-dejavu-core",
    "fonts-liberation",
    "fonts-urw-base35",
    "fonts-noto-core",
    "fonts-freefont-ttf",
    "fonts-croscore",
    "fonts-lato",
)
FONTS_NOISE = 50.0  # the renders' noise by default (standard deviation, 0..255 units; dpsm_ray/data/fonts.py)
# renders of each class in each training / held-out font, and their noise
FONTS_DEFAULTS = {"classes": len(FONT_CLASSES), "train": 2, "eval": 3, "noise": FONTS_NOISE}
# fonts_transfer: K classes from FONT_CLASSES[first], ``shots`` training images a class from the held-out
# faces' renders (``eval`` a face, at ``noise``); the backbone it is made for is pretrained on
# fonts:classes=B,eval=E,noise=S (B: ``backbone_classes``), whose classes hold the K or none of them
FONTS_TRANSFER_DEFAULTS = {"classes": 100, "first": 0, "shots": 40, "eval": 5, "noise": 20.0, "backbone_classes": len(FONT_CLASSES)}
IMAGE_TITLES = {  # the image datasets read from files (dpsm_ray/data/vision.py)
    "cifar100": "CIFAR-100", "caltech101": "Caltech-101", "inaturalist": "iNaturalist 2021 (Fungi)",
    "inaturalist2018": "iNaturalist 2018 (Fungi)", "fashion_mnist": "Fashion-MNIST",
}
PAPER_SIZES = {
    "cifar100": {"train": 45000, "val": 5000, "cal": 3000, "test": 7000},
    "caltech101": {"train": 4310, "val": 1256, "cal": 1111, "test": 2000},
    "inaturalist": {"train": 15345, "val": 1705, "cal": 1410, "test": 2000},
    "inaturalist2018": {"train": 15345, "val": 1705, "cal": 1410, "test": 2000},
    "fashion_mnist": {"train": 55000, "val": 5000, "cal": 5000, "test": 5000},  # ConfTr's (dpsm_ray/data/vision.py)
}


def parse_synthetic(spec: str) -> dict[str, float]:
    """``synthetic`` or ``synthetic:classes=20,dim=8,size=5000,noise=1.5`` -> parameters."""
    options = _dataset_options(spec, SYNTHETIC_DEFAULTS)
    if options["classes"] < 2 or options["dim"] < 1 or options["size"] < 20 * options["classes"] or options["noise"] <= 0:
        raise ValueError(f"dataset: synthetic needs classes >= 2, dim >= 1, size >= 20 * classes, noise > 0; got {options}")
    return options


def glyphs_max_classes() -> int:
    return math.comb(GLYPHS_POOL, GLYPHS_STROKES)


def parse_glyphs(spec: str) -> dict[str, float]:
    """``glyphs`` or ``glyphs:classes=K,train=N,noise=S`` -> the options (defaults filled in)."""
    options = _dataset_options(spec, GLYPHS_DEFAULTS)
    if not (2 <= options["classes"] <= glyphs_max_classes() and options["train"] >= 2 and 0 <= options["noise"] < math.inf):
        raise ValueError(
            f"dataset: glyphs needs 2 <= classes <= {glyphs_max_classes()}, train >= 2 (images per class), noise >= 0; got {options}"
        )
    return options


def glyph_sizes(options: dict[str, float]) -> dict[str, int]:
    """The four splits' sizes: ``train`` and ``GLYPHS_PER_CLASS_EVAL`` images per class."""
    per_class = {"train": options["train"], **GLYPHS_PER_CLASS_EVAL}
    return {split: options["classes"] * count for split, count in per_class.items()}


def font_faces(split: str) -> list[tuple[str, str]]:
    """The (family, style) faces whose renders go to ``split`` ("train" or "held_out")."""
    return [
        (family, style)
        for where, families in FONT_DESIGNS.values()
        if where == split
        for family, styles in families.items()
        for style in styles
    ]


def parse_fonts(spec: str) -> dict[str, float]:
    """``fonts`` or ``fonts:classes=K,train=R,eval=R,noise=S`` -> the options (defaults filled in):
    the first K classes of FONT_CLASSES, R renders of each class in each training / held-out face,
    each with Gaussian noise of standard deviation S (0..255 units)."""
    options = _dataset_options(spec, FONTS_DEFAULTS)
    if not (2 <= options["classes"] <= len(FONT_CLASSES) and options["train"] >= 1 and options["eval"] >= 1 and options["noise"] >= 0):
        raise ValueError(
            f"dataset: fonts needs 2 <= classes <= {len(FONT_CLASSES)}, train >= 1 and eval >= 1 (renders of a class in each face),"
            f" noise >= 0; got {options}"
        )
    return options


def parse_fonts_transfer(spec: str) -> dict[str, float]:
    """``fonts_transfer`` or ``fonts_transfer:classes=K,first=F,shots=N,eval=R,noise=S,backbone_classes=B``
    -> the options (defaults filled in): the K classes FONT_CLASSES[F : F + K], N training images of
    each from the held-out faces' R renders a face, and the rest of those renders for validation,
    calibration and test.  The backbone is pretrained on ``fonts:classes=B,eval=R,noise=S`` (its
    first B classes), and the K classes lie inside those (F + K <= B: the backbone saw them) or
    wholly outside them (B <= F: classes it never saw); a partial overlap is refused."""
    options = _dataset_options(spec, FONTS_TRANSFER_DEFAULTS)
    classes, first, backbone = options["classes"], options["first"], options["backbone_classes"]
    if not (classes >= 2 and first >= 0 and 2 <= backbone <= len(FONT_CLASSES)
            and (first + classes <= backbone or (backbone <= first and first + classes <= len(FONT_CLASSES)))):
        raise ValueError(
            f"dataset: fonts_transfer needs 2 <= classes, 0 <= first, 2 <= backbone_classes <= {len(FONT_CLASSES)}, and its classes"
            f" first..first+classes-1 inside the backbone's 0..backbone_classes-1 (first + classes <= backbone_classes) or outside"
            f" them (backbone_classes <= first, first + classes <= {len(FONT_CLASSES)}); got classes={classes}, first={first},"
            f" backbone_classes={backbone} (classes {first}..{first + classes - 1} against the backbone's 0..{backbone - 1})"
        )
    held_out = len(font_faces("held_out")) * options["eval"]
    if not (options["eval"] >= 1 and options["noise"] >= 0 and 1 <= options["shots"] <= held_out - 5):
        raise ValueError(
            f"dataset: fonts_transfer needs eval >= 1, noise >= 0 and 1 <= shots <= {len(font_faces('held_out'))} * eval - 5 (a"
            f" class's held-out renders, less 5 for validation, calibration and test); got {options}"
        )
    return options


def _fonts_transfer_disjoint(options: dict) -> bool:
    """Whether ``fonts_transfer``'s classes are ones its backbone never saw (``first`` at or past
    ``backbone_classes``), rather than some of the backbone's own."""
    return options["first"] >= options["backbone_classes"]


def fonts_backbone_options(options: dict) -> dict:
    """The ``fonts`` options of the data ``fonts_transfer`` with ``options`` is made for -- its
    backbone's pretraining data, whose training faces' pixel statistics standardise its inputs:
    ``backbone_classes`` classes, the default renders a training face, its ``eval`` and ``noise``."""
    classes, renders, noise = int(options["backbone_classes"]), int(options["eval"]), float(options["noise"])
    return {**FONTS_DEFAULTS, "classes": classes, "eval": renders, "noise": noise}


def fonts_target_options(options: dict) -> dict:
    """The ``fonts`` options whose renders ``fonts_transfer`` with ``options`` cuts its splits from:
    the backbone's data (``fonts_backbone_options``) where its classes are the backbone's; where they
    are disjoint from it, the same data with the classes up to the target's last (``first +
    classes``), which the backbone's data does not hold."""
    backbone = fonts_backbone_options(options)
    if not _fonts_transfer_disjoint(options):
        return backbone
    return {**backbone, "classes": int(options["first"] + options["classes"])}


def fonts_backbone_problem(spec: str, pretrained_on: str) -> str | None:
    """Why weights pretrained on dataset ``pretrained_on`` are not the backbone ``fonts_transfer``
    ``spec`` is made for (None: they are): that backbone's data is ``fonts_backbone_options``, whose
    pixel statistics standardise the inputs (and, where the target's classes are the backbone's,
    whose renders are cut), and its classes must be those the target is inside or outside of."""
    transfer = parse_fonts_transfer(spec)
    expected = fonts_backbone_options(transfer)
    wanted = "fonts:" + ",".join(f"{key}={value:g}" for key, value in expected.items())
    if pretrained_on.partition(":")[0] != "fonts":
        return f"were pretrained on {pretrained_on}; {spec} needs a backbone pretrained on {wanted}"
    got = parse_fonts(pretrained_on)
    differ = [key for key in expected if got[key] != expected[key]]
    if not differ:
        return None
    theirs, ours = (", ".join(f"{key}={options[key]:g}" for key in differ) for options in (got, expected))
    uses = "is standardised by the pixel statistics of" if _fonts_transfer_disjoint(transfer) else "cuts the renders of"
    return (f"were pretrained on {pretrained_on} ({theirs}); {spec} {uses} {wanted} ({ours}): pretrain on that,"
            f" or give {spec} the backbone's options")


def font_transfer_sizes(options: dict[str, float]) -> dict[str, int]:
    """The four splits' sizes: ``shots`` training images of each class; the rest of its held-out
    renders cut into validation (a fifth) and calibration and test (halves of the rest)."""
    rest = len(font_faces("held_out")) * options["eval"] - options["shots"]
    val = rest // 5
    cal = (rest - val) // 2
    per_class = {"train": options["shots"], "val": val, "cal": cal, "test": rest - val - cal}
    return {split: options["classes"] * count for split, count in per_class.items()}


def font_sizes(options: dict[str, float]) -> dict[str, int]:
    """The four splits' sizes: every render in a training face is a training image; a class's
    renders in the held-out faces are cut into validation (a sixth), calibration and test (halves
    of the rest)."""
    held_out = len(font_faces("held_out")) * options["eval"]
    val = held_out // 6
    cal = (held_out - val) // 2
    per_class = {"train": len(font_faces("train")) * options["train"], "val": val, "cal": cal, "test": held_out - val - cal}
    return {split: options["classes"] * count for split, count in per_class.items()}


# -- models ----------------------------------------------------------------------------------
CIFAR_RESNET_DEPTHS = (20, 32, 56, 110)
IMAGENET_HEADS = {"resnet50": "fc", "densenet121": "classifier"}  # the classifier layer a new head replaces
