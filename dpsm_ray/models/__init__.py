"""The networks the model cards build (``dpsm_ray.cards.build_model``):

- ``mlp``, ``cnn``, ``lenet``: small models for the offline datasets; ``mlp_bn``: ConfTr's
  Fashion-MNIST MLP, 2 x 64 units with BatchNorm (``small.py``).
- ``resnet20`` .. ``resnet110``: CIFAR ResNets (``cifar_resnet.py``); ``densenet100``:
  DenseNet-BC-100, growth rate 12 (``densenet.py``) -- the paper's CIFAR-100 models.
- ``resnet50``, ``densenet121``: torchvision's ImageNet models for the 224-pixel datasets,
  optionally from local ImageNet weights (``imagenet.py``).
"""

from __future__ import annotations

from dpsm_ray.models.cifar_resnet import CifarResNet
from dpsm_ray.models.densenet import CifarDenseNet
from dpsm_ray.models.small import MLP, LeNet, SmallCNN

__all__ = ["MLP", "CifarDenseNet", "CifarResNet", "LeNet", "SmallCNN"]
