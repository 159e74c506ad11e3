"""A small ResNet for 28-32 px images (CIFAR-style): a 3x3 stem, three stages of basic residual blocks
(widths 16, 32, 64 by default; the 2nd and 3rd stage halve the resolution), global average pooling and a
linear classifier; batch norm after every convolution.

It takes raw uint8 pixels (B, C, H, W) and normalises them itself with the training images' per-channel
mean and std (from the dataset's `info`), so the saved weights need no separate preprocessing.
`channels_last=true` stores weights and activations as NHWC, the layout tensor cores and oneDNN prefer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from ..typed_args import Setting
from . import register

SETTINGS = {"widths": Setting([16, 32, 64], list, 1), "blocks": Setting([2, 2, 2], list, 1),
            "channels_last": Setting(False, bool)}


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, widths=(16, 32, 64), blocks=(2, 2, 2),
                 mean=(0.5,), std=(0.25,), channels_last: bool = False):
        super().__init__()
        self.channels_last = channels_last
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        layers, c = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(BasicBlock(c, w, 2 if i > 0 and j == 0 else 1))
                c = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """uint8 (or 0-255 float) pixels (B, C, H, W) -> logits (B, classes). The pixels become floats of the
        weights' own dtype: fp32 normally, 16-bit where an engine casts the weights (DeepSpeed bf16/fp16)."""
        dtype = self.stem[0].weight.dtype
        x = (inputs.to(dtype) / 255 - self.mean.to(dtype)) / self.std.to(dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@register("cnn", SETTINGS)
def cnn(info: dict, widths: list[int], blocks: list[int], channels_last: bool) -> ResNet:
    if info.get("task") != "image_classification":
        raise UsageError("--model cnn classifies images: train it on --dataset digits, imagefolder or hub (mnist, ...)")
    if len(widths) != len(blocks) or not widths:
        raise UsageError(f"cnn widths {list(widths)} and blocks {list(blocks)} need one entry per stage each")
    return ResNet(info["image_shape"][0], info["num_classes"], tuple(widths), tuple(blocks), info["mean"],
                  info["std"], channels_last)
