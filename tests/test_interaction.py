"""The dot interaction's fused forward/backward against autograd through the plain formula,
and the opt-in bf16 MLP mode against fp32."""

from __future__ import annotations

import pytest
import torch

from recscale.model import DotInteraction


def _reference(dense: torch.Tensor, pooled: torch.Tensor, f: int, d: int) -> torch.Tensor:
    b = dense.shape[0]
    v = torch.cat([dense, pooled], 1).view(b, f, d)
    gram = torch.bmm(v, v.transpose(1, 2))
    rows, cols = torch.tril_indices(f, f, offset=-1)
    return torch.cat([dense, gram[:, rows, cols]], 1)


@pytest.mark.parametrize("b,f,d", [(5, 4, 3), (1, 2, 8), (17, 27, 16), (0, 3, 4)])
def test_dot_interaction_matches_autograd_reference(b: int, f: int, d: int) -> None:
    gen = torch.Generator().manual_seed(b * 100 + f)
    dense = torch.randn(b, d, generator=gen, dtype=torch.float64, requires_grad=True)
    pooled = torch.randn(b, (f - 1) * d, generator=gen, dtype=torch.float64, requires_grad=True)
    inter = DotInteraction(f, d)
    out = inter(dense, pooled)
    ref = _reference(dense, pooled, f, d)
    assert out.shape == (b, inter.out_features)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (dense, pooled), grad)
    want = torch.autograd.grad(ref, (dense, pooled), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_dot_interaction_gradcheck() -> None:
    dense = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    pooled = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(DotInteraction(4, 4), (dense, pooled))


def test_bf16_mlp_mode_close_to_fp32_with_fp32_master_weights() -> None:
    from recscale.embedding import TableBatchedEmbeddingBags, TableConfig, make_optimizer
    from recscale.model import DLRM
    from recscale.sparse import JaggedBatch

    def build(precision: str) -> DLRM:
        torch.manual_seed(0)
        tables = [TableConfig(f"t{i}", 50, 8, (f"f{i}",)) for i in range(3)]
        emb = TableBatchedEmbeddingBags(tables, make_optimizer("sgd", lr=0.1), seed=0)
        return DLRM(emb, 5, [16, 8], [16, 1], mlp_precision=precision)

    ids = torch.arange(3 * 32) % 50
    batch = JaggedBatch(("f0", "f1", "f2"), ids, torch.ones(3 * 32, dtype=torch.int64))
    dense = torch.randn(32, 5, generator=torch.Generator().manual_seed(1))
    fp32, bf16 = build("fp32"), build("bf16")
    a, b = fp32(dense, batch), bf16(dense, batch)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)
    assert not torch.equal(a, b)  # the bf16 path really ran in reduced precision
    b.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in bf16.dense_parameters())
    assert all(p.dtype == torch.float32 for p in bf16.dense_parameters())
    with pytest.raises(ValueError, match="mlp_precision"):
        build("fp8")


@pytest.mark.parametrize("b,f,d", [(33, 27, 64), (7, 5, 3), (0, 4, 8), (2, 2, 1)])
def test_native_kernel_matches_pytorch_formulation(b: int, f: int, d: int) -> None:
    from recscale.model.native import interaction_kernels

    if interaction_kernels() is None:
        pytest.skip("the native interaction kernel cannot be built here (no C++ compiler?)")
    gen = torch.Generator().manual_seed(7)
    dense64 = torch.randn(b, d, generator=gen, dtype=torch.float64)
    pooled64 = torch.randn(b, (f - 1) * d, generator=gen, dtype=torch.float64)
    grad64 = torch.randn(b, d + f * (f - 1) // 2, generator=gen, dtype=torch.float64)
    results = {}
    for native in (True, False):
        dense = dense64.float().requires_grad_()
        pooled = pooled64.float().requires_grad_()
        out = DotInteraction(f, d, native=native)(dense, pooled)
        out.backward(grad64.float())
        results[native] = (out.detach(), dense.grad, pooled.grad)
    dense, pooled = dense64.clone().requires_grad_(), pooled64.clone().requires_grad_()
    ref = _reference(dense, pooled, f, d)
    ref.backward(grad64)
    want = (ref.detach(), dense.grad, pooled.grad)
    for got in results.values():  # both within fp32 rounding of the float64 reference
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
