"""Model builders: ``build_model(name, num_classes, input_shape=...)``."""

from __future__ import annotations

from torch import nn

from dpsm_ray.models.small import MLP, SmallCNN

MODELS = ("mlp", "cnn")


def check_model(name: str) -> str:
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")
    return name


def build_model(name: str, num_classes: int, *, input_shape: tuple[int, ...] = (3, 32, 32)) -> nn.Module:
    check_model(name)
    if name == "mlp":
        return MLP(input_shape, num_classes)
    return SmallCNN(input_shape, num_classes)


__all__ = ["MLP", "MODELS", "SmallCNN", "build_model", "check_model"]
