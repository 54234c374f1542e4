"""The built-in models (there is no CPU torchvision): a CNN for 8x8 digits and an MLP.

Chosen in params.yaml by `model.name`; any other model comes in by `model.target`
(training.workload). Their `nn.Dropout` is schedule-independent through logical ranks
(training.trainer).
"""

from __future__ import annotations

import torch
from torch import nn



class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head, for 1x8x8 images (sklearn digits).

    `width` is the channel count of the first block; the second has twice as many.
    """

    def __init__(self, width: int = 16, num_classes: int = 10, in_channels: int = 1, image_size: int = 8, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        pooled = image_size // 2
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * width * pooled * pooled, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    """A plain multi-layer perceptron over flattened images."""

    def __init__(self, width: int = 128, depth: int = 2, num_classes: int = 10, in_features: int = 64, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        features = in_features
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU(), nn.Dropout(dropout)]
            features = width
        layers.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS: dict[str, type[nn.Module]] = {"small_cnn": SmallCNN, "mlp": MLP}  # built by training.workload.build_model
