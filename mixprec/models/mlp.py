"""The lesson's model: Linear(100, 256) -> ReLU -> Linear(256, 128) -> ReLU -> Linear(128, 10)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from ..typed_args import Setting
from . import register

SETTINGS = {"hidden": Setting([256, 128], list, 1)}


class MLP(nn.Module):
    def __init__(self, in_features: int = 100, hidden: tuple[int, ...] = (256, 128), num_classes: int = 10):
        super().__init__()
        layers, width = [], in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs.flatten(1))


@register("mlp", SETTINGS)
def mlp(info: dict, hidden: list[int]) -> MLP:
    if "num_features" not in info:
        raise UsageError("--model mlp reads tables of numbers (--dataset synthetic, lesson or file): "
                         "use --model cnn for images, a gpt model for text")
    return MLP(info["num_features"], tuple(hidden), info["num_classes"])
