"""One card per model: what builds it, what inputs it takes, how many trials share a GPU.  A model
of the researcher's own code joins as ``--model PKG.MODULE:FACTORY`` (``_factory_card``), or as a
card of its own through ``register_model`` (docs/extending.md).

Known without importing torch: a built-in card reaches its code through a function that imports
it (``_small``'s by name, through ``dpsm_ray.lazy.imported``) only when a run builds the model.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable

from dpsm_ray import facts
from dpsm_ray.cards.registry import built_in, register, registry, seal
from dpsm_ray.lazy import imported


@dataclass(frozen=True)
class ModelCard:
    """A model: ``build(input_shape, num_classes, pretrained_path)`` returns a freshly initialised
    ``nn.Module`` with ``num_classes`` outputs.  ``inputs``: what it accepts -- ``any`` shape,
    ``image`` ``[C, H, W]``, or ``rgb`` ``[3, H, W]`` (greyscale ``[1, H, W]`` is given to it as three
    equal channels: ``_grey_as_rgb``); ``pretrainable``: it takes a local weights
    file (``--pretrained-path``); ``trials_per_gpu``: how many trials share one GPU by default
    (a model that fills a GPU on its own: 1); ``argument``: the name takes one, ``NAME:ARGUMENT``
    (``torchvision:resnet18``), passed to ``build`` as ``argument=`` and checked by
    ``check_argument(argument)`` (a ValueError naming what is wrong) when a config is validated.

    Besides the cards, ``--model PKG.MODULE:FACTORY`` names a researcher's own code: ``FACTORY(
    num_classes)`` returns the network (``_factory_card``); the module must be importable wherever
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


_MODEL_INPUTS = ("any", "image", "rgb")
_MODELS = registry("model")


def register_model(card: ModelCard, *, replace: bool = False) -> ModelCard:
    """Make ``card``'s model known to validation, sweeps, the predictor and the CLI in this process."""
    if card.inputs not in _MODEL_INPUTS:
        raise ValueError(f"model {card.name}: inputs must be one of {', '.join(_MODEL_INPUTS)}; got {card.inputs!r}")
    if not (isinstance(card.trials_per_gpu, int) and card.trials_per_gpu >= 1):
        raise ValueError(f"model {card.name}: trials_per_gpu must be an integer >= 1; got {card.trials_per_gpu!r}")
    return register("model", card, replace)


def model_names() -> tuple[str, ...]:
    return tuple(_MODELS)


def model_cards() -> tuple[ModelCard, ...]:
    return tuple(_MODELS.values())


FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def model_choices() -> str:
    """The models in words, for errors and ``--help``."""
    named = [f"{name}:{card.argument}" if card.argument else name for name, card in _MODELS.items()]
    return f"{', '.join(named)}, or PKG.MODULE:FACTORY (your FACTORY(num_classes) -> nn.Module)"


def model_card(spec: str) -> ModelCard:
    """The card of ``spec``: a registered model (``NAME``, or ``NAME:ARGUMENT`` for a card that
    takes one), or a factory of the researcher's own (``PKG.MODULE:FACTORY``, ``_factory_card``).
    Nothing is imported."""
    name, colon, argument = spec.partition(":")
    card = _MODELS.get(name)
    if card is not None and bool(colon) == bool(card.argument) and (not colon or argument):
        return card
    if card is None and FACTORY.match(spec):
        return _factory_card(spec)
    raise ValueError(f"model must be one of {model_choices()}; got {spec!r}")


def is_factory(spec: str) -> bool:
    """Whether ``spec`` names code of the researcher's own (importing it runs that code)."""
    return spec.partition(":")[0] not in _MODELS and bool(FACTORY.match(spec))


def _factory_card(spec: str) -> ModelCard:
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


def build_model(name: str, num_classes: int, *, input_shape: tuple[int, ...] = (3, 32, 32), pretrained_path=None):
    """A freshly initialised model ``name`` (its card's builder, a ``torch.nn.Module``) for inputs
    ``input_shape`` and ``num_classes`` outputs.  ``pretrained_path``: a local weights file for a
    pretrainable model (``resnet50`` / ``densenet121``: an ImageNet state dict; ``lenet``: a run's
    model.pt); every tensor but the classifier head's is loaded from it."""
    from torch import nn

    card = model_card(name)
    if pretrained_path is not None and not card.pretrainable:
        raise ValueError(f"pretrained_path is for the models {', '.join(pretrainable_models())}; got model {name!r}")
    if card.inputs != "any" and len(input_shape) != 3:
        raise ValueError(f"model: {name} needs image inputs [C, H, W]; got input shape {input_shape}")
    if card.inputs == "rgb" and input_shape[0] == 1:  # a greyscale folder into an RGB network
        model = build_model(name, num_classes, input_shape=(3, *input_shape[1:]), pretrained_path=pretrained_path)
        model.register_forward_pre_hook(_grey_as_rgb)
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


def _grey_as_rgb(module, inputs):
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


# -- the built-in models ---------------------------------------------------------------------------
def _small(name: str, **options):
    """A model of ``dpsm_ray.models.small`` (imported when a run builds it: the cards must not import torch)."""

    def build(input_shape, num_classes, pretrained_path=None):
        return imported(f"dpsm_ray.models.small:{name}")(input_shape, num_classes, **options)

    return build


def _lenet(input_shape, num_classes, pretrained_path=None):
    from dpsm_ray.models.small import LeNet

    model = LeNet(input_shape, num_classes)
    if pretrained_path is None:
        return model
    from dpsm_ray.models.weights import load_backbone

    return load_backbone(model, "lenet", pretrained_path, LeNet.HEAD)


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


# smaller models pack 4 trials to a GPU (ResNet-110 at batch 128 reaches the large-batch ceiling of
# an H100 with ~4 captured trials); the ImageNet-size models fill one on their own
for _card in (
    ModelCard("mlp", "MLP, 2 x 128 units", _small("MLP")),
    ModelCard("mlp_bn", "MLP, 2 x 64 units with BatchNorm (ConfTr's Fashion-MNIST model)",
              _small("MLP", width=64, depth=2, batch_norm=True)),
    ModelCard("cnn", "small CNN", _small("SmallCNN"), inputs="image"),
    *(
        ModelCard(f"resnet{depth}", f"ResNet-{depth} (CIFAR)", _cifar_resnet(depth), inputs="image")
        for depth in facts.CIFAR_RESNET_DEPTHS
    ),
    ModelCard("densenet100", "DenseNet-BC-100, growth rate 12 (CIFAR)", _densenet100, inputs="image"),
    *(
        ModelCard(name, f"torchvision {name} (ImageNet architecture)", _imagenet(name), inputs="rgb", pretrainable=True, trials_per_gpu=1)
        for name in facts.IMAGENET_HEADS
    ),
    ModelCard("lenet", "LeNet-5", _lenet, inputs="image", pretrainable=True),
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
seal("model")
