"""torchvision's ImageNet architectures for the 224-pixel datasets, with a new ``num_classes``
head, optionally starting from ImageNet weights in a local file (a torchvision state dict, e.g.
``resnet50-0676ba61.pth``).  Nothing is downloaded at run time: a cluster node may have no
internet, and a sweep must not depend on it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

# the classifier layer of each architecture, replaced for the dataset's classes
from dpsm_ray.catalog import IMAGENET_HEADS as HEADS
# torchvision's DenseNet checkpoints predate its module names: "denselayer1.norm.1.weight" is now
# "denselayer1.norm1.weight" (the same rename as torchvision.models.densenet._load_state_dict)
OLD_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$")


def imagenet_model(name: str, num_classes: int) -> nn.Module:
    """A randomly initialised torchvision ``name`` with ``num_classes`` outputs."""
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)


def load_backbone(model: nn.Module, name: str, path: str | Path) -> nn.Module:
    """Copy every tensor except the classifier head from the state dict saved at ``path``.

    The head is left as initialised (its shape depends on the class count); every other tensor
    must be in the file with the model's shape, so a file for another architecture fails loudly
    instead of leaving a silently random backbone.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights not found at {path}: give a local torchvision state dict (.pth) for {name}")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict):
        raise ValueError(f"pretrained weights at {path} must be a state dict (name -> tensor); got {type(saved).__name__}")
    saved = {_current_key(key): value for key, value in saved.items()}
    head = HEADS[name] + "."
    backbone = {key: value for key, value in model.state_dict().items() if not key.startswith(head)}
    # BatchNorm's step counters are absent from older torchvision files and not needed to predict
    unfit = [
        key
        for key, value in backbone.items()
        if not key.endswith("num_batches_tracked") and (key not in saved or saved[key].shape != value.shape)
    ]
    if unfit:
        raise ValueError(
            f"pretrained weights at {path} do not fit {name}: {len(unfit)} of its {len(backbone)} backbone tensors are missing or of"
            f" another shape (first: {unfit[0]})"
        )
    model.load_state_dict({key: saved[key] for key in backbone if key in saved}, strict=False)
    return model


def _current_key(key: str) -> str:
    match = OLD_DENSENET_KEY.match(key)
    return match.group(1) + match.group(2) if match else key
