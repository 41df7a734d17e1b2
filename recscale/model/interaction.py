"""Feature interactions between the bottom-MLP output and the pooled embeddings."""

from __future__ import annotations

import torch
from torch import nn

from recscale.model.native import interaction_kernels


class DotInteraction(nn.Module):
    """Pairwise dot products of all F vectors (strictly lower triangle), concatenated with the
    bottom-MLP output, as in DLRM. Output width: ``dim + F (F - 1) / 2``.

    Forward is one batched matmul (the Gram matrix) and one gather of its lower triangle.
    Backward uses the symmetry of the Gram matrix: the gradient of ``X X^T`` read through the
    triangle is ``(G + G^T) X``, one batched matmul, where autograd's generic rule for
    ``bmm(X, X^T)`` would run two plus a transpose-add of ``[B, F, D]`` tensors.
    """

    def __init__(self, num_vectors: int, dim: int, native: bool = True) -> None:
        """``native``: on the CPU in fp32, use the compiled kernel (``recscale.model.native``)
        when it builds; the PyTorch formulation otherwise (and on other devices and dtypes)."""
        super().__init__()
        self.native = native
        self.num_vectors = num_vectors
        self.dim = dim
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        self.register_buffer("_flat_index", rows * num_vectors + cols, persistent=False)

    @property
    def out_features(self) -> int:
        return self.dim + self.num_vectors * (self.num_vectors - 1) // 2

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        b = dense.shape[0]
        if pooled.dtype != dense.dtype:  # bf16 MLPs: interact in the MLPs' precision
            pooled = pooled.to(dense.dtype)
        vectors = torch.cat([dense, pooled], dim=1).view(b, self.num_vectors, self.dim)
        kernels = interaction_kernels() if self.native and vectors.device.type == "cpu" and vectors.dtype == torch.float32 else None
        if kernels is not None:
            pairs = _NativePairs.apply(vectors.contiguous(), kernels)
        else:
            pairs = _TrianglePairs.apply(vectors, self._flat_index)
        return torch.cat([dense, pairs], dim=1)


class _NativePairs(torch.autograd.Function):
    """``_TrianglePairs`` computed by the C++ kernel: each sample's pairs in one cache-resident pass."""

    @staticmethod
    def forward(ctx, vectors: torch.Tensor, kernels) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(vectors)
        ctx.kernels = kernels
        return kernels.pairs_forward(vectors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (vectors,) = ctx.saved_tensors
        return ctx.kernels.pairs_backward(vectors, grad.contiguous().float()), None


class _TrianglePairs(torch.autograd.Function):
    """``[B, F, D] -> [B, P]``: the dot products of the pairs listed by ``flat_index`` (i > j)."""

    @staticmethod
    def forward(ctx, vectors: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        b, f, _ = vectors.shape
        ctx.save_for_backward(vectors, flat_index)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))
        return gram.view(b, f * f).index_select(1, flat_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        vectors, flat_index = ctx.saved_tensors
        b, f, _ = vectors.shape
        g = grad.new_zeros(b, f * f).index_copy_(1, flat_index, grad.contiguous()).view(b, f, f)
        sym = g + g.transpose(1, 2)
        return torch.bmm(sym.to(vectors.dtype), vectors), None
