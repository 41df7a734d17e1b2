"""The bf16 MLP layers against torch.autocast through nn.Linear: same outputs, gradients within
bf16 rounding, master weights and their gradients fp32."""

from __future__ import annotations

import torch
from torch import nn

from recscale.model import MLP
from recscale.model.bf16_linear import bf16_autocast_on, linear_with_bias


def test_mlp_in_bf16_autocast_matches_nn_linear_under_autocast() -> None:
    torch.manual_seed(0)
    mlp = MLP(13, [64, 32, 1], final_activation=False)
    ref = nn.Sequential(*[m for m in MLP(13, [64, 32, 1], final_activation=False)])
    ref.load_state_dict(mlp.state_dict())
    x = torch.randn(40, 13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bf16_autocast_on(x)
        got = mlp(x)
        want = ref(x)
    assert not bf16_autocast_on(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    grad = torch.randn(got.shape).bfloat16()
    ours = torch.autograd.grad(got, list(mlp.parameters()), grad)
    theirs = torch.autograd.grad(want, list(ref.parameters()), grad)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)
    # fp32 outside autocast: exactly nn.Sequential's forward
    torch.testing.assert_close(mlp(x), ref(x), atol=0, rtol=0)


def test_linear_with_bias_equals_addmm() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(s, generator=gen).bfloat16() for s in ((9, 16), (24, 16), (24,)))
    torch.testing.assert_close(linear_with_bias(x, w, b), torch.addmm(b, x, w.t()), atol=1e-2, rtol=1e-2)
    xf, wf, bf = x.float(), w.float(), b.float()
    torch.testing.assert_close(linear_with_bias(xf, wf, bf), torch.addmm(bf, xf, wf.t()))


def test_mlp_takes_batched_3d_input_under_bf16_autocast() -> None:
    mlp = MLP(6, [4, 2])
    x = torch.randn(3, 5, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(x)
    assert out.shape == (3, 5, 2) and out.dtype == torch.bfloat16
