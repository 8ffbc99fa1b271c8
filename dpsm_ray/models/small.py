"""Small models for the offline datasets.  Neither has batch-dependent layers (no BatchNorm), so
data-parallel training with per-worker batch b equals one worker with batch W * b exactly."""

from __future__ import annotations

import math

from torch import nn


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden layers of ``width`` ReLU units."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 128, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(input_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU()]
            features = width
        layers.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear head, for small images ``[C, H, W]`` (e.g. 8x8 digits)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: int = 32) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"model: cnn needs image inputs [C, H, W]; got input shape {input_shape}")
        self.net = nn.Sequential(
            nn.Conv2d(input_shape[0], channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(8 * channels, num_classes),
        )

    def forward(self, x):
        return self.net(x)
