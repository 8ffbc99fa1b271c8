"""One card per dataset, model and score: what each is, and the one place every list of them reads.

The method cards (``methods.py``) set the pattern; this module finishes it for the other three
axes a researcher extends.  The CLI's choices and ``--help``, config validation, the sweep's GPU
packing, the report's score order, the predictor and ``evaluate`` all ask the cards; a dataset,
model or score defined outside the package joins through ``register_dataset``,
``register_model`` or ``register_score`` (docs/extending.md), and a sweep sends those cards to its
trials as it sends method cards.

Known without importing torch or Ray: a built-in card's code is reached through a small function
holding a literal import (as Ray's ``SEARCH_ALG_IMPORT``), run only when a run needs it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dpsm_ray import catalog, own_data


# -- the cards -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetCard:
    """A dataset: ``--dataset NAME``, ``NAME:key=value,...`` where it has ``options``, or
    ``NAME:PATH[:key=value,...]`` where it takes a ``path`` (a researcher's folder or table).

    ``sizes(spec)``: the four splits' sizes, known without loading the data (a ValueError naming
    the bad option or file otherwise); ``load(spec, data_root=..., seed=..., download=...,
    data_workers=...)`` returns its ``dpsm_ray.data.DataSplits``; ``check_files(spec, data_root,
    download)`` raises FileNotFoundError naming a missing path (None: it needs no files) and does
    any one-time work (decoding into a cache): the driver runs it before anything starts.
    ``options``: the option names with their defaults (None: the name takes none).
    ``fingerprint(spec)``: a hash of the files it reads, for data that can change under the same
    name (a cached base model is keyed by it too).
    """

    name: str
    title: str
    sizes: Callable[[str], dict[str, int]]
    load: Callable[..., Any]
    default_model: str
    check_files: Callable[[str, str | None, bool], Any] | None = None
    options: Mapping[str, float] | None = None
    path: bool = False
    fingerprint: Callable[[str], str] | None = None


@dataclass(frozen=True)
class ModelCard:
    """A model: ``build(input_shape, num_classes, pretrained_path)`` returns a freshly initialised
    ``nn.Module`` with ``num_classes`` outputs.  ``inputs``: what it accepts -- ``any`` shape,
    ``image`` ``[C, H, W]``, or ``rgb`` ``[3, H, W]`` (greyscale ``[1, H, W]`` is given to it as three
    equal channels: ``grey_as_rgb``); ``pretrainable``: it takes a local weights
    file (``--pretrained-path``); ``trials_per_gpu``: how many trials share one GPU by default
    (a model that fills a GPU on its own: 1); ``argument``: the name takes one, ``NAME:ARGUMENT``
    (``torchvision:resnet18``), passed to ``build`` as ``argument=`` and checked by
    ``check_argument(argument)`` (a ValueError naming what is wrong) when a config is validated.

    Besides the cards, ``--model PKG.MODULE:FACTORY`` names a researcher's own code: ``FACTORY(
    num_classes)`` returns the network (``factory_card``); the module must be importable wherever
    a trial runs.
    """

    name: str
    title: str
    build: Callable[..., Any]
    inputs: str = "any"
    pretrainable: bool = False
    trials_per_gpu: int = 4
    argument: str | None = None
    check_argument: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class ScoreCard:
    """A non-conformity score S(x, y), smaller meaning more conforming: ``matrix(probs, u,
    **parameters)`` maps probabilities ``[n, K]`` and one uniform per example ``[n]`` (None: no
    randomisation) to the scores of every label ``[n, K]``.  ``randomised``: its sets depend on
    the uniforms (a predictor records it); ``parameters``: its own hyperparameters with their
    defaults (RAPS's ``lambda`` and ``k_reg``), recorded in every predictor calibrated with it."""

    name: str
    title: str
    matrix: Callable[..., Any]
    randomised: bool = False
    parameters: Mapping[str, float] = field(default_factory=dict)


MODEL_INPUTS = ("any", "image", "rgb")
_DATASETS: dict[str, DatasetCard] = {}
_MODELS: dict[str, ModelCard] = {}
_SCORES: dict[str, ScoreCard] = {}  # in the report's order
# models first: a dataset card names its default model, so a trial registers the models it is sent first
_REGISTRIES = {"model": _MODELS, "dataset": _DATASETS, "score": _SCORES}
_BUILT_IN: set[tuple[str, str]] = set()  # (kind, name) of the cards this module registers


def _register(registry: dict, kind: str, card, replace: bool):
    if not card.name.isidentifier():
        raise ValueError(f"{kind} name must be an identifier (letters, digits, _); got {card.name!r}")
    if (kind, card.name) in _BUILT_IN and _BUILT_IN_DONE:
        raise ValueError(f"{kind} {card.name!r} is built in")
    if card.name in registry and not replace and registry[card.name] != card:
        raise ValueError(f"{kind} {card.name!r} is registered already (pass replace=True to change it)")
    registry[card.name] = card
    if not _BUILT_IN_DONE:
        _BUILT_IN.add((kind, card.name))
    return card


def register_dataset(card: DatasetCard, *, replace: bool = False) -> DatasetCard:
    """Make ``card``'s dataset known to validation, sweeps and the CLI in this process."""
    if card.default_model not in _MODELS:
        raise ValueError(
            f"dataset {card.name}: default_model must be a registered model ({', '.join(model_names())}); got {card.default_model!r}"
        )
    return _register(_DATASETS, "dataset", card, replace)


def register_model(card: ModelCard, *, replace: bool = False) -> ModelCard:
    """Make ``card``'s model known to validation, sweeps, the predictor and the CLI in this process."""
    if card.inputs not in MODEL_INPUTS:
        raise ValueError(f"model {card.name}: inputs must be one of {', '.join(MODEL_INPUTS)}; got {card.inputs!r}")
    if not (isinstance(card.trials_per_gpu, int) and card.trials_per_gpu >= 1):
        raise ValueError(f"model {card.name}: trials_per_gpu must be an integer >= 1; got {card.trials_per_gpu!r}")
    return _register(_MODELS, "model", card, replace)


def register_score(card: ScoreCard, *, replace: bool = False) -> ScoreCard:
    """Make ``card``'s score known to evaluation, reports, predictors and the CLI in this process."""
    return _register(_SCORES, "score", card, replace)


def unregister(kind: str, name: str) -> None:
    """Forget the ``kind`` ("dataset", "model" or "score") card ``name`` registered from outside."""
    if built_in(kind, name):
        raise ValueError(f"{kind} {name!r} is built in")
    _REGISTRIES[kind].pop(name, None)


def built_in(kind: str, name: str) -> bool:
    """Whether the ``kind`` ("dataset", "model" or "score") card ``name`` ships with the package."""
    return (kind, name) in _BUILT_IN


def outside_cards() -> tuple:
    """The dataset, model and score cards registered from outside the package (a sweep sends
    them to its trials, with the method cards)."""
    return tuple(card for kind, registry in _REGISTRIES.items() for name, card in registry.items() if not built_in(kind, name))


def register_card(card, *, replace: bool = True):
    """Register a card of any axis (what a trial does with the cards its sweep sends)."""
    from dpsm_ray.methods import MethodCard, register_method

    for kind, register in (
        (MethodCard, register_method),
        (DatasetCard, register_dataset),
        (ModelCard, register_model),
        (ScoreCard, register_score),
    ):
        if isinstance(card, kind):
            return register(card, replace=replace)
    raise TypeError(f"not a card: {card!r}")


# -- reading them ----------------------------------------------------------------------------------
def dataset_names() -> tuple[str, ...]:
    return tuple(_DATASETS)


def model_names() -> tuple[str, ...]:
    return tuple(_MODELS)


def model_cards() -> tuple[ModelCard, ...]:
    return tuple(_MODELS.values())


def score_names() -> tuple[str, ...]:
    """Every score, in the report's order."""
    return tuple(_SCORES)


def dataset_card(spec: str) -> DatasetCard:
    """The card of ``spec`` (``NAME`` or ``NAME:options``); ValueError naming the choices."""
    name = spec.partition(":")[0]
    if name not in _DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(_DATASETS)}; got {spec!r}")
    return _DATASETS[name]


FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def model_choices() -> str:
    """The models in words, for errors and ``--help``."""
    named = [f"{name}:{card.argument}" if card.argument else name for name, card in _MODELS.items()]
    return f"{', '.join(named)}, or PKG.MODULE:FACTORY (your FACTORY(num_classes) -> nn.Module)"


def model_card(spec: str) -> ModelCard:
    """The card of ``spec``: a registered model (``NAME``, or ``NAME:ARGUMENT`` for a card that
    takes one), or a factory of the researcher's own (``PKG.MODULE:FACTORY``, ``factory_card``).
    Nothing is imported."""
    name, colon, argument = spec.partition(":")
    card = _MODELS.get(name)
    if card is not None and bool(colon) == bool(card.argument) and (not colon or argument):
        return card
    if card is None and FACTORY.match(spec):
        return factory_card(spec)
    raise ValueError(f"model must be one of {model_choices()}; got {spec!r}")


def is_factory(spec: str) -> bool:
    """Whether ``spec`` names code of the researcher's own (importing it runs that code)."""
    return spec.partition(":")[0] not in _MODELS and bool(FACTORY.match(spec))


def factory_card(spec: str) -> ModelCard:
    """``PKG.MODULE:FACTORY`` as a card: ``FACTORY(num_classes)`` builds the network."""

    def build(input_shape, num_classes, pretrained_path=None):
        return import_factory(spec)(num_classes)

    return ModelCard(spec, f"{spec}(num_classes)", build, trials_per_gpu=1)


def import_factory(spec: str) -> Callable:
    """The callable ``PKG.MODULE:FACTORY`` names; ValueError naming what is missing."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model {spec}: cannot import {module_name} ({error}); it must be importable (installed, or on PYTHONPATH) "
            "in the driver and on every Ray node"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"model {spec}: {module_name} has no callable {attribute!r}")
    return factory


def score_card(name: str) -> ScoreCard:
    if name not in _SCORES:
        raise ValueError(f"score must be one of {', '.join(_SCORES)}; got {name!r}")
    return _SCORES[name]


def split_sizes(spec: str) -> dict[str, int]:
    """Sizes of the four splits of ``spec``, known without loading any data (for the image
    datasets, the paper's sizes: a smaller copy on disk gets them scaled down); ValueError naming
    the bad part of ``spec``."""
    card = dataset_card(spec)
    if card.options is None and not card.path and spec != card.name:
        takes = [name for name, other in _DATASETS.items() if other.options is not None and not other.path]
        paths = [f"{name}:PATH" for name, other in _DATASETS.items() if other.path]
        raise ValueError(
            f"dataset must be one of {', '.join(_DATASETS)} (only {', '.join(takes)} take options, and {', '.join(paths)} a path); got"
            f" {spec!r}"
        )
    return dict(card.sizes(spec))


def check_dataset(spec: str) -> str:
    """``spec`` if it names a dataset with valid options; ValueError naming the bad part."""
    split_sizes(spec)
    return spec


def default_model(spec: str) -> str:
    """The model ``--model auto`` picks for ``spec``."""
    return dataset_card(spec).default_model


def check_model(spec: str) -> str:
    """``spec`` if it names a model that can be built: a card (its argument checked by the card's
    ``check_argument``, e.g. a torchvision architecture's name), or an importable factory."""
    card = model_card(spec)
    if is_factory(spec):
        import_factory(spec)
    elif card.argument and card.check_argument is not None:
        card.check_argument(spec.partition(":")[2])
    return spec


def pretrainable_models() -> tuple[str, ...]:
    return tuple(name for name, card in _MODELS.items() if card.pretrainable)


def check_score(name: str) -> str:
    score_card(name)
    return name


def score_matrix(probs, kind: str, *, u=None, parameters: Mapping[str, float] | None = None):
    """Scores of every label, ``[n, K]``, by the score card ``kind``; smaller means more
    conforming.  ``u`` is one uniform per example (shape ``[n]``) for the randomised scores, shared
    by all labels of that example so that APS/RAPS sets stay prefixes of the sorted labels;
    ``None`` means U = 1 (not randomised).  ``parameters`` override the card's own
    hyperparameters (RAPS's ``lambda`` and ``k_reg``)."""
    card = score_card(kind)
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [n, K]; got {tuple(probs.shape)}")
    unknown = sorted(set(parameters or {}) - set(card.parameters))
    if unknown:
        raise ValueError(f"score {kind} has no parameter {', '.join(unknown)}; it has {', '.join(card.parameters) or 'none'}")
    return card.matrix(probs, u, **{**card.parameters, **(parameters or {})})


def check_data_present(spec: str, data_root: str | None = None, download: bool = False) -> None:
    """Raise ``FileNotFoundError`` (naming the expected path and ``--download``) if dataset
    ``spec`` needs files that are not under ``data_root``; the bundled and generated datasets
    always pass.  Reads no data: the CLI and the sweep call it before anything starts."""
    check_dataset(spec)
    card = dataset_card(spec)
    if card.check_files is not None:
        card.check_files(spec, data_root, download)


def load_splits(spec: str, data_root: str | None = None, *, seed: int, download: bool = False, data_workers: int = 4):
    """The four splits of dataset ``spec`` (its card's loader, a ``dpsm_ray.data.DataSplits``),
    stratified and disjoint, chosen by ``seed``.  The image datasets are read from (or, with
    ``download``, fetched into) ``data_root``; the fonts from the font files under it (default
    /usr/share/fonts); ``data_workers`` DataLoader processes decode the file-based ones."""
    check_dataset(spec)
    if not isinstance(data_workers, int) or isinstance(data_workers, bool) or data_workers < 0:
        raise ValueError(f"data_workers must be an integer >= 0; got {data_workers!r}")
    return dataset_card(spec).load(spec, data_root=data_root, seed=seed, download=download, data_workers=data_workers)


def build_model(name: str, num_classes: int, *, input_shape: tuple[int, ...] = (3, 32, 32), pretrained_path=None):
    """A freshly initialised model ``name`` (its card's builder, a ``torch.nn.Module``) for inputs
    ``input_shape`` and ``num_classes`` outputs.  ``pretrained_path``: a local weights file for a
    pretrainable model (``resnet50`` / ``densenet121``: an ImageNet state dict; every tensor but
    the classifier head is loaded from it)."""
    from torch import nn

    card = model_card(name)
    if pretrained_path is not None and not card.pretrainable:
        raise ValueError(f"pretrained_path is for the models {', '.join(pretrainable_models())}; got model {name!r}")
    if card.inputs != "any" and len(input_shape) != 3:
        raise ValueError(f"model: {name} needs image inputs [C, H, W]; got input shape {input_shape}")
    if card.inputs == "rgb" and input_shape[0] == 1:  # a greyscale folder into an RGB network
        model = build_model(name, num_classes, input_shape=(3, *input_shape[1:]), pretrained_path=pretrained_path)
        model.register_forward_pre_hook(grey_as_rgb)
        return model
    if card.inputs == "rgb" and input_shape[0] != 3:
        raise ValueError(f"model: {name} takes RGB images [3, H, W] or greyscale [1, H, W]; got input shape {input_shape}")
    argument = {}
    if card.argument:
        argument["argument"] = name.partition(":")[2]
        if card.check_argument is not None:
            card.check_argument(argument["argument"])
    model = card.build(tuple(input_shape), num_classes, pretrained_path, **argument)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model {name}: its card's build returned {type(model).__name__}, not a torch.nn.Module")
    if card.argument or not built_in("model", card.name):
        check_outputs(model, name, tuple(input_shape), num_classes)
    return model


def grey_as_rgb(module, inputs):
    """A forward pre-hook: a greyscale batch ``[n, 1, H, W]`` given as RGB ``[n, 3, H, W]``, each
    channel the grey one -- exactly the inputs of ``folder:PATH:channels=3`` (PIL's L -> RGB repeats
    the value, and the three channels' statistics are the grey one's).  A hook, not a wrapper: the
    state dict stays the RGB architecture's, so ``--init weights:FILE`` and predictors read it."""
    return (inputs[0].expand(-1, 3, -1, -1), *inputs[1:])


def check_outputs(model, name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    """A model from outside the package must map a batch ``[n, *input_shape]`` to logits
    ``[n, num_classes]``: one forward of two zero inputs in eval mode (no state changes) says so."""
    import torch

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, *input_shape))
    except Exception as error:
        raise ValueError(
            f"model {name}: a batch of inputs {[2, *input_shape]} fails in its forward: {type(error).__name__}: {error}"
        ) from None
    finally:
        model.train(training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"model {name}: must return logits [n, {num_classes}] for inputs [n, {', '.join(map(str, input_shape))}]; got {got} for n = 2"
        )


def score_functions(names=None, parameters: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Callable]:
    """``{name: matrix(probs, u)}`` for the scores ``names`` (default: every score), each with its
    card's parameters, overridden by ``parameters[name]``: what ``dpsm_ray.conformal.evaluate``
    takes."""
    names = score_names() if names is None else tuple(names)
    for name in names:
        check_score(name)

    def bound(name: str) -> Callable:
        given = (parameters or {}).get(name)
        return lambda probs, u=None: score_matrix(probs, name, u=u, parameters=given)

    return {name: bound(name) for name in names}


# -- the built-in datasets -------------------------------------------------------------------------
# Each loader holds a literal import: the data modules import torch, the cards must not.
def _load_digits(spec, *, seed, **_):
    from dpsm_ray.data.tabular import load_digits

    return load_digits(seed)


def _load_synthetic(spec, *, seed, **_):
    from dpsm_ray.data.tabular import load_synthetic

    return load_synthetic(spec, seed)


def _load_glyphs(spec, *, seed, **_):
    from dpsm_ray.data.glyphs import load_glyphs

    return load_glyphs(spec, seed)


def _load_fonts(spec, *, data_root, seed, **_):
    from dpsm_ray.data.fonts import load_fonts

    return load_fonts(spec, data_root, seed)


def _fonts_present(spec, data_root, download):
    from dpsm_ray.data.fonts import find_faces

    find_faces(data_root)


def _load_image_dataset(spec, *, data_root, seed, download, data_workers):
    from dpsm_ray.data.vision import LOADERS

    return LOADERS[spec](data_root, seed, download, data_workers)


def _image_files_present(spec, data_root, download):
    from dpsm_ray.data.vision import check_data_present

    check_data_present(spec, data_root, download)


def _folder_check(spec, data_root, download):
    from dpsm_ray.data.folder import check_folder

    check_folder(spec)


def _load_folder(spec, *, seed, **_):
    from dpsm_ray.data.folder import load_folder

    return load_folder(spec, seed)


def _load_table(spec, *, seed, **_):
    from dpsm_ray.data.table import load_table

    return load_table(spec, seed)


def _paper_sizes(spec):
    return dict(catalog.PAPER_SIZES[spec])


def _synthetic_sizes(spec):
    size = catalog.parse_synthetic(spec)["size"]
    return {split: int(size * fraction) for split, fraction in catalog.SYNTHETIC_FRACTIONS.items()}


# -- the built-in models ---------------------------------------------------------------------------
def _mlp(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.small import MLP

    return MLP(input_shape, num_classes)


def _mlp_bn(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.small import MLP

    return MLP(input_shape, num_classes, width=64, depth=2, batch_norm=True)


def _cnn(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.small import SmallCNN

    return SmallCNN(input_shape, num_classes)


def _lenet(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.small import LeNet

    return LeNet(input_shape, num_classes)


def _cifar_resnet(depth: int):
    def build(input_shape, num_classes, pretrained_path=None):
        from dpsm_ray.models.cifar_resnet import CifarResNet

        return CifarResNet(depth, num_classes, in_channels=input_shape[0])

    return build


def _torchvision(input_shape, num_classes, pretrained_path=None, *, argument):
    import torchvision

    return torchvision.models.get_model(argument, weights=None, num_classes=num_classes)


def _check_torchvision(name: str) -> None:
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        close = [n for n in names if n.startswith(name[:4])][:6]
        raise ValueError(
            f"model torchvision:{name}: not a torchvision classification architecture"
            + (f" (close: {', '.join(close)})" if close else f" ({len(names)} of them: torchvision.models.list_models())")
        )


def _densenet100(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.densenet import CifarDenseNet

    return CifarDenseNet(100, num_classes, growth_rate=12, in_channels=input_shape[0])


def _imagenet(name: str):
    def build(input_shape, num_classes, pretrained_path=None):
        from dpsm_ray.models.imagenet import imagenet_model, load_backbone

        model = imagenet_model(name, num_classes)
        return model if pretrained_path is None else load_backbone(model, name, pretrained_path)

    return build


# -- the built-in scores ---------------------------------------------------------------------------
def _hps(probs, u=None):
    from dpsm_ray.conformal.scores import hps_matrix

    return hps_matrix(probs)


def _aps(probs, u=None):
    from dpsm_ray.conformal.scores import aps_matrix

    return aps_matrix(probs, u)


def _raps(probs, u=None, *, k_reg, **parameters):
    from dpsm_ray.conformal.scores import aps_matrix

    return aps_matrix(probs, u, penalty=parameters["lambda"], k_reg=k_reg)


_BUILT_IN_DONE = False
# smaller models pack 4 trials to a GPU (ResNet-110 at batch 128 reaches the large-batch ceiling of
# an H100 with ~4 captured trials); the ImageNet-size models fill one on their own
for _card in (
    ModelCard("mlp", "MLP, 2 x 128 units", _mlp),
    ModelCard("mlp_bn", "MLP, 2 x 64 units with BatchNorm (ConfTr's Fashion-MNIST model)", _mlp_bn),
    ModelCard("cnn", "small CNN", _cnn, inputs="image"),
    *(
        ModelCard(f"resnet{depth}", f"ResNet-{depth} (CIFAR)", _cifar_resnet(depth), inputs="image")
        for depth in catalog.CIFAR_RESNET_DEPTHS
    ),
    ModelCard("densenet100", "DenseNet-BC-100, growth rate 12 (CIFAR)", _densenet100, inputs="image"),
    *(
        ModelCard(name, f"torchvision {name} (ImageNet architecture)", _imagenet(name), inputs="rgb", pretrainable=True, trials_per_gpu=1)
        for name in catalog.IMAGENET_HEADS
    ),
    ModelCard("lenet", "LeNet-5", _lenet, inputs="image"),
    ModelCard(
        "torchvision",
        "any torchvision classification architecture, randomly initialised, its classifier for the dataset's classes",
        _torchvision,
        inputs="rgb",
        trials_per_gpu=1,
        argument="NAME",
        check_argument=_check_torchvision,
    ),
):
    register_model(_card)
for _card in (
    DatasetCard("digits", "scikit-learn's 8x8 digits", lambda spec: dict(catalog.DIGITS_SIZES), _load_digits, "mlp"),
    DatasetCard("synthetic", "Gaussian classes (generated)", _synthetic_sizes, _load_synthetic, "mlp", options=catalog.SYNTHETIC_DEFAULTS),
    DatasetCard(
        "glyphs",
        "procedural stroke glyphs (generated)",
        lambda spec: catalog.glyph_sizes(catalog.parse_glyphs(spec)),
        _load_glyphs,
        "lenet",
        options=catalog.GLYPHS_DEFAULTS,
    ),
    DatasetCard(
        "fonts",
        "characters rendered from real typefaces",
        lambda spec: catalog.font_sizes(catalog.parse_fonts(spec)),
        _load_fonts,
        "lenet",
        check_files=_fonts_present,
        options=catalog.FONTS_DEFAULTS,
    ),
    DatasetCard(
        "fashion_mnist",
        catalog.IMAGE_TITLES["fashion_mnist"],
        _paper_sizes,
        _load_image_dataset,
        "mlp_bn",
        check_files=_image_files_present,
    ),
    DatasetCard(
        "cifar100", catalog.IMAGE_TITLES["cifar100"], _paper_sizes, _load_image_dataset, "resnet110", check_files=_image_files_present
    ),
    DatasetCard(
        "caltech101", catalog.IMAGE_TITLES["caltech101"], _paper_sizes, _load_image_dataset, "resnet50", check_files=_image_files_present
    ),
    DatasetCard(
        "inaturalist", catalog.IMAGE_TITLES["inaturalist"], _paper_sizes, _load_image_dataset, "resnet50", check_files=_image_files_present
    ),
    DatasetCard(
        "inaturalist2018",
        catalog.IMAGE_TITLES["inaturalist2018"],
        _paper_sizes,
        _load_image_dataset,
        "resnet50",
        check_files=_image_files_present,
    ),
    DatasetCard(
        "folder",
        "your images (an ImageFolder tree)",
        own_data.folder_sizes,
        _load_folder,
        "resnet20",
        check_files=_folder_check,
        options=own_data.FOLDER_DEFAULTS,
        path=True,
        fingerprint=own_data.folder_fingerprint,
    ),
    DatasetCard(
        "table",
        "your features (a Parquet, CSV or .npz table)",
        own_data.table_sizes,
        _load_table,
        "mlp",
        check_files=lambda spec, data_root, download: own_data.table_sizes(spec),
        options=own_data.TABLE_DEFAULTS,
        path=True,
        fingerprint=own_data.table_fingerprint,
    ),
):
    register_dataset(_card)
for _card in (
    ScoreCard("hps", "HPS (THR, LAC): 1 - p_y", _hps),
    ScoreCard("aps", "APS: the mass ranked above y plus U p_y", _aps, randomised=True),
    ScoreCard("raps", "RAPS: APS plus lambda max(0, rank(y) - k_reg)", _raps, randomised=True, parameters={"lambda": 0.01, "k_reg": 5}),
):
    register_score(_card)
_BUILT_IN_DONE = True
