"""DCNv2: the low-rank cross network of DLRM-DCNv2 (the MLPerf recommendation benchmark).

The bottom-MLP output and the F - 1 pooled embeddings are concatenated into one vector
``x_0`` of width ``F * dim``; each cross layer ``l`` computes

    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l

with ``V_l: [rank, F * dim]`` and ``W_l: [F * dim, rank]`` (a rank-``rank`` factorisation of the
full ``[F * dim, F * dim]`` matrix of DCNv2) and ``*`` elementwise. The output ``x_L`` (same width)
goes to the top MLP. This is TorchRec's ``LowRankCrossNet`` formula, initialised the same way
(Xavier-normal kernels, zero biases).
"""

from __future__ import annotations

import torch
from torch import nn


class LowRankCrossNet(nn.Module):
    """``num_layers`` low-rank cross layers over ``in_features``-wide vectors."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        if in_features <= 0 or num_layers <= 0 or low_rank <= 0:
            raise ValueError(
                f"cross network needs positive in_features, num_layers and low_rank, got "
                f"{in_features}, {num_layers}, {low_rank}"
            )
        self.in_features, self.num_layers, self.low_rank = in_features, num_layers, low_rank
        self.v_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)
        )
        self.w_kernels = nn.ParameterList(
            nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w, b in zip(self.v_kernels, self.w_kernels, self.biases):
            # addmm fuses the bias into the second matmul (one pass over the wide output).
            x = torch.addcmul(x, x0, torch.addmm(b, x @ v.t(), w.t()))
        return x


class DCNInteraction(nn.Module):
    """The DCNv2 interaction: ``[B, dim]`` bottom output and ``[B, (F - 1) * dim]`` pooled
    embeddings in, ``[B, F * dim]`` crossed features out. Same call as ``DotInteraction``."""

    def __init__(self, num_vectors: int, dim: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.num_vectors, self.dim = num_vectors, dim
        self.cross = LowRankCrossNet(num_vectors * dim, num_layers, low_rank)

    @property
    def out_features(self) -> int:
        return self.num_vectors * self.dim

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if pooled.dtype != dense.dtype:  # bf16 MLPs: cross in the MLPs' precision
            pooled = pooled.to(dense.dtype)
        return self.cross(torch.cat([dense, pooled], dim=1))
