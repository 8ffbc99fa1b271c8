"""ResNet for 32x32 images (He et al. 2016, section 4.2): a 3x3 convolution to 16 channels, three
stages of ``n`` basic blocks with 16, 32 and 64 channels at strides 1, 2, 2, global average
pooling and a linear layer; depth ``6n + 2`` (ResNet-110: n = 18, the paper's CIFAR-100 ResNet).

Shortcuts where the shape changes are 1x1 convolution + BatchNorm projections (option B), as in
the PyTorch CIFAR code whose recipes the official DPSM code uses (bearpaw/pytorch-classification);
they add 2.6k weights, so ResNet-110 keeps the published 1.7M parameters.
"""

from __future__ import annotations

from torch import nn

from dpsm_ray.facts import CIFAR_RESNET_DEPTHS


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and a shortcut, ReLU after the sum."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth: int, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        if (depth - 2) % 6 != 0 or depth < 8:
            raise ValueError(
                f"model: a CIFAR ResNet has depth 6n + 2 with n >= 1 (e.g. {', '.join(map(str, CIFAR_RESNET_DEPTHS))}); got {depth}"
            )
        blocks = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        stages, channels = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for index in range(blocks):
                stages.append(BasicBlock(channels, width, stride if index == 0 else 1))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")  # He et al. 2015
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        return self.fc(self.pool(self.stages(self.stem(x))))
