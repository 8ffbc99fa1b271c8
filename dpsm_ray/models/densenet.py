"""DenseNet-BC for 32x32 images (Huang et al. 2017, section 3): a 3x3 convolution to 2k channels,
three dense blocks of bottleneck layers (BN-ReLU-1x1 conv to 4k, BN-ReLU-3x3 conv to k, the k new
channels concatenated to the input) joined by transitions that halve the channels (compression
0.5) and the resolution, then BN-ReLU, global average pooling and a linear layer.  Depth ``L``
gives ``(L - 4) / 6`` layers per block; DenseNet-BC-100 with growth rate k = 12 is the paper's
CIFAR-100 DenseNet (0.8M parameters).
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, growth_rate: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, 4 * growth_rate, 1, bias=False),
            nn.BatchNorm2d(4 * growth_rate),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth_rate, growth_rate, 3, padding=1, bias=False),
        )

    def forward(self, x):
        return torch.cat([x, self.layers(x)], dim=1)


def _transition(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.BatchNorm2d(in_channels), nn.ReLU(inplace=True), nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.AvgPool2d(2)
    )


class CifarDenseNet(nn.Module):
    def __init__(self, depth: int, num_classes: int, growth_rate: int = 12, compression: float = 0.5, in_channels: int = 3) -> None:
        super().__init__()
        if (depth - 4) % 6 != 0 or depth < 10:
            raise ValueError(f"model: a DenseNet-BC has depth 6n + 4 with n >= 1 (e.g. 100); got {depth}")
        layers_per_block = (depth - 4) // 6  # two convolutions per bottleneck layer, three blocks
        channels = 2 * growth_rate
        modules: list[nn.Module] = [nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)]
        for block in range(3):
            for _ in range(layers_per_block):
                modules.append(Bottleneck(channels, growth_rate))
                channels += growth_rate
            if block < 2:
                reduced = int(channels * compression)
                modules.append(_transition(channels, reduced))
                channels = reduced
        modules += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*modules)
        self.classifier = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, x):
        return self.classifier(self.features(x))
