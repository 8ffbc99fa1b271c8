"""Model builders: ``build_model(name, num_classes, input_shape=..., pretrained_path=...)``.

- ``mlp``, ``cnn``, ``lenet``: small models for the offline datasets; ``mlp_bn``: ConfTr's
  Fashion-MNIST MLP, 2 x 64 units with BatchNorm (``small.py``).
- ``resnet20`` .. ``resnet110``: CIFAR ResNets (``cifar_resnet.py``); ``densenet100``:
  DenseNet-BC-100, growth rate 12 (``densenet.py``) -- the paper's CIFAR-100 models.
- ``resnet50``, ``densenet121``: torchvision's ImageNet models for the 224-pixel datasets,
  optionally from local ImageNet weights (``imagenet.py``).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from dpsm_ray.catalog import DEFAULT_MODELS, MODELS, PRETRAINABLE, check_model, default_model
from dpsm_ray.models.cifar_resnet import CifarResNet
from dpsm_ray.models.densenet import CifarDenseNet
from dpsm_ray.models.imagenet import imagenet_model, load_backbone
from dpsm_ray.models.small import MLP, LeNet, SmallCNN

def build_model(name: str, num_classes: int, *, input_shape: tuple[int, ...] = (3, 32, 32), pretrained_path: str | Path | None = None) -> nn.Module:
    """A freshly initialised ``name`` for inputs ``input_shape`` and ``num_classes`` outputs.

    ``pretrained_path``: a local ImageNet state dict for ``resnet50`` / ``densenet121``; every
    tensor but the classifier head is loaded from it.
    """
    check_model(name)
    if pretrained_path is not None and name not in PRETRAINABLE:
        raise ValueError(f"pretrained_path is for the models {', '.join(PRETRAINABLE)}; got model {name!r}")
    if name == "mlp":
        return MLP(input_shape, num_classes)
    if name == "mlp_bn":
        return MLP(input_shape, num_classes, width=64, depth=2, batch_norm=True)
    if name == "cnn":
        return SmallCNN(input_shape, num_classes)
    if name == "lenet":
        return LeNet(input_shape, num_classes)
    if len(input_shape) != 3:
        raise ValueError(f"model: {name} needs image inputs [C, H, W]; got input shape {input_shape}")
    if name == "densenet100":
        return CifarDenseNet(100, num_classes, growth_rate=12, in_channels=input_shape[0])
    if name in PRETRAINABLE:
        if input_shape[0] != 3:
            raise ValueError(f"model: {name} takes RGB images [3, H, W]; got input shape {input_shape}")
        model = imagenet_model(name, num_classes)
        return model if pretrained_path is None else load_backbone(model, name, pretrained_path)
    return CifarResNet(int(name.removeprefix("resnet")), num_classes, in_channels=input_shape[0])


__all__ = [
    "DEFAULT_MODELS", "MLP", "MODELS", "PRETRAINABLE", "CifarDenseNet", "CifarResNet", "LeNet", "SmallCNN", "build_model",
    "check_model", "default_model",
]
