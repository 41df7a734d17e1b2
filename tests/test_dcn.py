"""DCNv2's low-rank cross network against a plain-PyTorch reference of its formula (forward and
every gradient), inside DLRM (fp32 and bf16 MLPs) and from the config."""

from __future__ import annotations

import pytest
import torch

from recscale.model import DCNInteraction, LowRankCrossNet


def _reference(x0: torch.Tensor, vs: list[torch.Tensor], ws: list[torch.Tensor], bs: list[torch.Tensor]) -> torch.Tensor:
    """x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l, one sample at a time."""
    rows = []
    for x0_i in x0:
        x = x0_i
        for v, w, b in zip(vs, ws, bs):
            x = x0_i * (w @ (v @ x) + b) + x
        rows.append(x)
    return torch.stack(rows) if rows else x0.new_zeros(x0.shape)


@pytest.mark.parametrize("b,f,d,layers,rank", [(5, 4, 3, 3, 2), (1, 2, 8, 1, 16), (9, 27, 4, 2, 5)])
def test_cross_net_matches_reference_forward_and_gradients(b: int, f: int, d: int, layers: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(b + 10 * f + 100 * layers)
    inter = DCNInteraction(f, d, layers, rank).double()
    with torch.no_grad():  # non-zero biases, so their path is exercised
        for bias in inter.cross.biases:
            bias.copy_(torch.randn(bias.shape, generator=gen, dtype=torch.float64))
    dense = torch.randn(b, d, generator=gen, dtype=torch.float64, requires_grad=True)
    pooled = torch.randn(b, (f - 1) * d, generator=gen, dtype=torch.float64, requires_grad=True)
    out = inter(dense, pooled)
    assert out.shape == (b, inter.out_features) == (b, f * d)
    cross = inter.cross
    vs = [v.detach().clone().requires_grad_() for v in cross.v_kernels]
    ws = [w.detach().clone().requires_grad_() for w in cross.w_kernels]
    bs = [x.detach().clone().requires_grad_() for x in cross.biases]
    d2, p2 = dense.detach().clone().requires_grad_(), pooled.detach().clone().requires_grad_()
    ref = _reference(torch.cat([d2, p2], 1), vs, ws, bs)
    torch.testing.assert_close(out, ref)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, [dense, pooled, *cross.v_kernels, *cross.w_kernels, *cross.biases], grad)
    want = torch.autograd.grad(ref, [d2, p2, *vs, *ws, *bs], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # The fused backward forms each weight gradient in its parameter's own layout.
    assert all(p.grad is None for p in cross.parameters())
    inter(dense, pooled).backward(grad)
    assert all(p.grad is not None and p.grad.is_contiguous() for p in cross.parameters())


def test_fused_cross_layers_match_autograd_in_fp32_and_bf16() -> None:
    """The hand-written backward against autograd through the same ops, in both precisions."""
    gen = torch.Generator().manual_seed(7)
    net = LowRankCrossNet(48, 3, 8)
    with torch.no_grad():
        for bias in net.biases:
            bias.normal_(generator=gen)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x0 = torch.randn(16, 48, generator=gen).to(dtype).requires_grad_()
        x1 = x0.detach().clone().requires_grad_()
        grad = torch.randn(16, 48, generator=gen).to(dtype)
        fused, ref = net(x0), net.forward_autograd(x1)
        assert fused.dtype == ref.dtype == dtype
        torch.testing.assert_close(fused, ref, atol=tol, rtol=tol)
        params = list(net.parameters())
        got = torch.autograd.grad(fused, [x0, *params], grad)
        want = torch.autograd.grad(ref, [x1, *params], grad)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, atol=tol * 10, rtol=tol)


def test_cross_net_initialisation_and_bad_sizes() -> None:
    net = LowRankCrossNet(12, 2, 3)
    assert [tuple(v.shape) for v in net.v_kernels] == [(3, 12)] * 2
    assert [tuple(w.shape) for w in net.w_kernels] == [(12, 3)] * 2
    assert all(not b.detach().any() for b in net.biases)
    with pytest.raises(ValueError, match="low_rank"):
        LowRankCrossNet(12, 2, 0)


def _dlrm(precision: str, interaction: str = "dcn"):
    from recscale.embedding import TableBatchedEmbeddingBags, TableConfig, make_optimizer
    from recscale.model import DLRM

    torch.manual_seed(0)
    tables = [TableConfig(f"t{i}", 50, 8, (f"f{i}",)) for i in range(3)]
    emb = TableBatchedEmbeddingBags(tables, make_optimizer("sgd", lr=0.1), seed=0)
    return DLRM(emb, 5, [16, 8], [16, 1], mlp_precision=precision, interaction=interaction, dcn_layers=2, dcn_low_rank=4)


def test_dlrm_with_dcn_trains_and_bf16_stays_close_to_fp32() -> None:
    from recscale.sparse import JaggedBatch

    ids = torch.arange(3 * 32) % 50
    batch = JaggedBatch(("f0", "f1", "f2"), ids, torch.ones(3 * 32, dtype=torch.int64))
    dense = torch.randn(32, 5, generator=torch.Generator().manual_seed(1))
    fp32, bf16 = _dlrm("fp32"), _dlrm("bf16")
    assert isinstance(fp32.interaction, DCNInteraction) and fp32.top[0].in_features == 4 * 8
    a, b = fp32(dense, batch), bf16(dense, batch)
    assert a.shape == (32,) and b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)
    b.sum().backward()  # master weights and their gradients stay fp32 in bf16 mode
    v = bf16.interaction.cross.v_kernels[0]
    assert v.dtype == torch.float32 and v.grad is not None and v.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="interaction"):
        _dlrm("fp32", interaction="cross")


@pytest.mark.parametrize("key,value", [("model.dcn_layers", "0"), ("model.dcn_low_rank", "-1"), ("model.interaction", "dcnv2")])
def test_config_rejects_bad_dcn_settings_naming_the_key(key: str, value: str) -> None:
    from recscale.train.config import ConfigError, load_config

    sets = ["model.interaction=dcn", f"{key}={value}"]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, sets)


def test_mlperf_dlrmv2_config_has_the_mlperf_shape() -> None:
    from pathlib import Path

    from recscale.train.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "mlperf_dlrmv2.toml")
    m = cfg.model
    assert (m.interaction, m.dcn_layers, m.dcn_low_rank, m.embedding_dim) == ("dcn", 3, 512, 128)
    assert m.bottom_mlp == [512, 256, 128] and m.top_mlp == [1024, 1024, 512, 256, 1]
    assert len(m.table_rows) == 26 and len(cfg.data.pooling_factors) == 26
    assert cfg.data.pooling_factors[20] == 100
