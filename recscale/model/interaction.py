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
        if pooled.dtype != dense.dtype:  # bf16 MLPs: interact in the MLPs' precision
            pooled = pooled.to(dense.dtype)
        native = self.native and dense.device.type == "cpu" and dense.dtype == torch.float32
        kernels = interaction_kernels() if native else None
        if kernels is not None:
            return _NativeInteraction.apply(dense.contiguous(), pooled.contiguous(), kernels)
        vectors = torch.cat([dense, pooled], dim=1).view(dense.shape[0], self.num_vectors, self.dim)
        pairs = _TrianglePairs.apply(vectors, self._flat_index)
        return torch.cat([dense, pairs], dim=1)


class _NativeInteraction(torch.autograd.Function):
    """The whole interaction (dense pass-through and pairs) in the C++ kernel: it reads
    ``dense`` and ``pooled`` where they lie and writes each output and gradient once, where the
    PyTorch formulation concatenates the vectors, the output, and splits their gradients."""

    @staticmethod
    def forward(ctx, dense: torch.Tensor, pooled: torch.Tensor, kernels) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(dense, pooled)
        ctx.kernels = kernels
        return kernels.interact_forward(dense, pooled)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dense, pooled = ctx.saved_tensors
        grad_dense, grad_pooled = ctx.kernels.interact_backward(dense, pooled, grad.contiguous().float())
        return grad_dense, grad_pooled, None


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
