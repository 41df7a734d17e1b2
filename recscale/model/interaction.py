"""Feature interactions between the bottom-MLP output and the pooled embeddings."""

from __future__ import annotations

import torch
from torch import nn


class DotInteraction(nn.Module):
    """Pairwise dot products of all F vectors (strictly lower triangle), concatenated with the
    bottom-MLP output, as in DLRM. Output width: ``dim + F (F - 1) / 2``."""

    def __init__(self, num_vectors: int, dim: int) -> None:
        super().__init__()
        self.num_vectors = num_vectors
        self.dim = dim
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        self.register_buffer("_flat_index", rows * num_vectors + cols, persistent=False)

    @property
    def out_features(self) -> int:
        return self.dim + self.num_vectors * (self.num_vectors - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        b = dense.shape[0]
        vectors = torch.cat([dense, pooled], dim=1).view(b, self.num_vectors, self.dim)
        gram = torch.bmm(vectors, vectors.transpose(1, 2)).view(b, self.num_vectors * self.num_vectors)
        return torch.cat([dense, gram.index_select(1, self._flat_index)], dim=1)
