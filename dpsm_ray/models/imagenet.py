"""torchvision's ImageNet architectures for the 224-pixel datasets, with a new ``num_classes``
head, optionally starting from ImageNet weights in a local file (a torchvision state dict, e.g.
``resnet50-0676ba61.pth``).  Nothing is downloaded at run time: a cluster node may have no
internet, and a sweep must not depend on it.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from dpsm_ray.models.weights import load_backbone as load_pretrained

# the classifier layer of each architecture, replaced for the dataset's classes
from dpsm_ray.facts import IMAGENET_HEADS as HEADS
# torchvision's DenseNet checkpoints predate its module names: "denselayer1.norm.1.weight" is now
# "denselayer1.norm1.weight" (the same rename as torchvision.models.densenet._load_state_dict)
_OLD_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$")


def imagenet_model(name: str, num_classes: int) -> nn.Module:
    """A randomly initialised torchvision ``name`` with ``num_classes`` outputs."""
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)


def load_backbone(model: nn.Module, name: str, path: str | Path) -> nn.Module:
    """Copy every tensor except the classifier head from the torchvision state dict saved at
    ``path`` (``dpsm_ray.models.weights.load_backbone``), its older DenseNet keys renamed."""
    return load_pretrained(model, name, path, HEADS[name], rename=_current_key)


def _current_key(key: str) -> str:
    match = _OLD_DENSENET_KEY.match(key)
    return match.group(1) + match.group(2) if match else key
