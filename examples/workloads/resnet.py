"""A CIFAR-style ResNet (He et al., 2016, section 4.2: 6n+2 layers, BatchNorm) and
CIFAR-shaped data that needs no download.

`cifar_like` draws 32x32 RGB images whose class is a smooth colour pattern at a random
position, under noise: learnable, but not by a linear model, and the same on every machine
for a given seed. With torchvision installed, `target: torchvision.models:resnet18` (and a
real CIFAR-10 dataset function of your own) plug into the same spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """depth = 6n + 2 (8, 14, 20, 32, 56, ...); three stages of width w, 2w, 4w."""

    def __init__(self, depth: int = 20, width: int = 16, num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"depth {depth} is not 6n + 2 (8, 14, 20, 32, 56, ...)")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def resnet(depth: int = 20, width: int = 16, num_classes: int = 10, dropout: float = 0.0) -> ResNet:
    return ResNet(depth, width, num_classes, dropout)


def cifar_like(train: int = 10_000, val: int = 2_000, num_classes: int = 10, noise: float = 0.6, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) TensorDatasets of 3x32x32 float images in about [-1, 1] and int64 labels."""
    g = torch.Generator().manual_seed(seed)
    # One smooth 16x16 colour template per class, upsampled: shapes, not pixels, tell classes apart.
    templates = F.interpolate(torch.randn(num_classes, 3, 8, 8, generator=g), size=16, mode="bilinear", align_corners=False)

    def draw(count: int) -> TensorDataset:
        labels = torch.randint(0, num_classes, (count,), generator=g)
        images = noise * torch.randn(count, 3, 32, 32, generator=g)
        offsets = torch.randint(0, 17, (count, 2), generator=g)
        for i in range(count):
            y, x = offsets[i].tolist()
            images[i, :, y:y + 16, x:x + 16] += templates[labels[i]]
        return TensorDataset(images.clamp_(-3, 3) / 3, labels)

    return draw(train), draw(val)
