"""DCNv2: the low-rank cross network of DLRM-DCNv2 (the MLPerf recommendation benchmark).

The bottom-MLP output and the F - 1 pooled embeddings are concatenated into one vector
``x_0`` of width ``F * dim``; each cross layer ``l`` computes

    x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l

with ``V_l: [rank, F * dim]`` and ``W_l: [F * dim, rank]`` (a rank-``rank`` factorisation of the
full ``[F * dim, F * dim]`` matrix of DCNv2) and ``*`` elementwise. The output ``x_L`` (same width)
goes to the top MLP. This is TorchRec's ``LowRankCrossNet`` formula, initialised the same way
(Xavier-normal kernels, zero biases).

The layers run as one autograd function with a hand-written backward: the wide ``[B, F * dim]``
elementwise work is fused where autograd would make separate passes (``x_0 * t + x_l`` in one
``addcmul``; in backward the ``x_0`` gradient accumulated in place and the ``x_l`` gradient added
inside the GEMM that forms it), and every weight gradient is formed by one GEMM directly in its
parameter's layout (no transposed copy). Same formula, same GEMMs as the autograd version.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from recscale.model.bf16_linear import linear_with_bias


class _CrossLayers(torch.autograd.Function):
    """``x_L`` from ``x_0`` and the ``L`` layers' ``V``, ``W``, ``b`` (passed flat: all V, all W,
    all b). Computes in ``x_0``'s dtype (bf16 MLPs: weights cast once per call); weight gradients
    come back in the weights' dtype."""

    @staticmethod
    def forward(ctx: Any, x0: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n = len(params) // 3
        dt = x0.dtype
        vs = [p.to(dt) for p in params[:n]]
        ws = [p.to(dt) for p in params[n:2 * n]]
        bs = [p.to(dt) for p in params[2 * n:]]
        xs, hs, ts = [], [], []
        x = x0
        for v, w, b in zip(vs, ws, bs):
            h = torch.mm(x, v.t())
            # The bias rides in the GEMM (addmm first broadcasts it into the whole output).
            t = linear_with_bias(h, w, b) if dt == torch.bfloat16 else torch.addmm(b, h, w.t())
            xs.append(x)
            hs.append(h)
            ts.append(t)
            x = torch.addcmul(x, x0, t)  # x_0 * t + x_l in one pass
        ctx.n = n
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.save_for_backward(*xs, *hs, *ts, *vs, *ws)
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        n = ctx.n
        saved = ctx.saved_tensors
        xs, hs, ts, vs, ws = (saved[i * n:(i + 1) * n] for i in range(5))
        x0 = xs[0]
        g = grad.to(x0.dtype).contiguous()
        low_precision = x0.dtype in (torch.bfloat16, torch.float16)
        gx0: torch.Tensor | None = None
        gvs: list[torch.Tensor] = [x0] * n
        gws: list[torch.Tensor] = [x0] * n
        gbs: list[torch.Tensor] = [x0] * n
        for layer in reversed(range(n)):
            x, h, t, v, w = xs[layer], hs[layer], ts[layer], vs[layer], ws[layer]
            gt = g * x0
            # d/dx_0 of x_0 * t: summed over the layers in one buffer, in place.
            gx0 = g * t if gx0 is None else gx0.addcmul_(g, t)
            gbs[layer] = gt.sum(0)
            gh = torch.mm(gt, w)
            if low_precision:
                # oneDNN's bf16 GEMM runs at about half speed with its first operand transposed
                # (the batch as the contracted dimension); a copy of the small [B, rank] operand
                # in transposed layout lets both weight gradients run untransposed.
                gws[layer] = torch.mm(h.t().contiguous(), gt).t()  # W^T's gradient, transposed back
                gvs[layer] = torch.mm(gh.t().contiguous(), x)
            else:
                gws[layer] = torch.mm(gt.t(), h)  # [F*dim, rank]: W's own layout
                gvs[layer] = torch.mm(gh.t(), x)  # [rank, F*dim]: V's own layout
            g = torch.addmm(g, gh, v)  # d/dx_l: the identity path plus (V^T W^T g'), one pass
        assert gx0 is not None
        gx0.add_(g)  # layer 0's x_l is x_0 itself
        dts = ctx.param_dtypes
        grads = [gr.to(d, memory_format=torch.contiguous_format) for gr, d in zip([*gvs, *gws, *gbs], dts)]
        return (gx0, *grads)


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
        x0 = x0.contiguous()
        with torch.autocast(x0.device.type, enabled=False):  # dtypes are set explicitly inside
            return _CrossLayers.apply(x0, *self.v_kernels, *self.w_kernels, *self.biases)

    def forward_autograd(self, x0: torch.Tensor) -> torch.Tensor:
        """The same layers through autograd (the reference the fused function is tested against)."""
        x = x0
        for v, w, b in zip(self.v_kernels, self.w_kernels, self.biases):
            x = torch.addcmul(x, x0, torch.addmm(b.to(x0.dtype), x @ v.to(x0.dtype).t(), w.to(x0.dtype).t()))
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
