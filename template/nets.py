"""Example networks: plain ``nn.Module``s with no Lightning inside, so plain PyTorch code ports as is."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Fully connected classifier over flattened inputs."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden_sizes: Sequence[int] = (128, 64),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class ConvNet(nn.Module):
    """Small convolutional classifier for ``(channels, height, width)`` images."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (16, 32),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"ConvNet needs input_shape (channels, height, width), got {tuple(input_shape)}")
        layers: list[nn.Module] = []
        in_channels = input_shape[0]
        for out_channels in channels:
            layers += [nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.BatchNorm2d(out_channels), nn.ReLU()]
            in_channels = out_channels
        # Global pooling keeps the head independent of the image size.
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_channels, num_classes)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)
