"""A plain ReLU MLP: the bottom and top towers of a DLRM."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from recscale.model.bf16_linear import bf16_autocast_on, bf16_linear


class MLP(nn.Sequential):
    """Linear + ReLU layers; the last layer has no activation when ``final_activation`` is False."""

    def __init__(self, in_features: int, sizes: Sequence[int], final_activation: bool = True) -> None:
        if not sizes:
            raise ValueError("MLP needs at least one layer size")
        layers: list[nn.Module] = []
        prev = in_features
        for i, size in enumerate(sizes):
            linear = nn.Linear(prev, size)
            # DLRM's initialisation: normal weights scaled by fan-in and fan-out.
            nn.init.normal_(linear.weight, 0.0, (2.0 / (prev + size)) ** 0.5)
            nn.init.normal_(linear.bias, 0.0, (1.0 / size) ** 0.5)
            layers.append(linear)
            if i < len(sizes) - 1 or final_activation:
                layers.append(nn.ReLU())
            prev = size
        super().__init__(*layers)
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.dim() == 2 and bf16_autocast_on(x):  # bf16 MLPs: autocast's math, faster GEMMs
            for layer in self:
                x = bf16_linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else layer(x)
            return x
        return super().forward(x)
