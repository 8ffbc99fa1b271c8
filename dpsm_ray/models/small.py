"""Small models for the offline datasets and Fashion-MNIST.  Only ``mlp_bn`` has batch-dependent
layers (BatchNorm, as ConfTr's Fashion-MNIST model); with the others, data-parallel training with
per-worker batch b equals one worker with batch W * b exactly."""

from __future__ import annotations

import math

from torch import nn


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden layers of ``width`` ReLU units (each Linear followed by
    BatchNorm with ``batch_norm``: ConfTr's Fashion-MNIST MLP is 2 x 64 of those, Stutz et al.
    2022, models.py, BatchNorm momentum 0.9 in Haiku's convention = 0.1 in torch's)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 128, depth: int = 2, batch_norm: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(input_shape)
        for _ in range(depth):
            layers += [nn.Linear(features, width), *([nn.BatchNorm1d(width, momentum=0.1)] if batch_norm else []), nn.ReLU()]
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


class LeNet(nn.Module):
    """LeNet-style (LeCun et al. 1998, with ReLU and max pooling): two blocks of a 3x3 convolution
    and a 2x2 max pool, then a hidden layer of ``hidden`` units and the head.  For the glyphs: the
    pooling makes it cheap on 16x16 images (~0.4M multiply-adds, against ~4.7M for ``SmallCNN``,
    whose full-resolution features are averaged to 2x2), and the hidden layer gives it the
    capacity to fit 20 images of each of 100 classes under augmentation."""

    HEAD = "net.9"  # the classifier a pretrained backbone's new head replaces (--pretrained-path)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: int = 32, hidden: int = 256) -> None:
        super().__init__()
        if len(input_shape) != 3 or min(input_shape[1:]) < 4:
            raise ValueError(f"model: lenet needs image inputs [C, H, W] with H, W >= 4; got input shape {input_shape}")
        features = 2 * channels * (input_shape[1] // 4) * (input_shape[2] // 4)
        self.net = nn.Sequential(
            nn.Conv2d(input_shape[0], channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)
