"""The mixed-width row codec: per-row 2/3/4/8-bit widths inside a fixed byte budget."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_utils import ckpt_dir, run_training
from recscale.checkpoint.quantize import WIDTHS, Codec, allocate_widths, make_codec, mixed_tags, row_importance
from recscale.cli import main
from recscale.train.config import ConfigError, load_config


def rows(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g)
    if n > 2:
        x[1] = 0.25  # a constant row
    return x, torch.rand(n, generator=g) ** 6  # a skewed importance, as Adagrad's is


@pytest.mark.parametrize("n,d,bits,seed", [(0, 8, 3, 0), (1, 8, 3, 1), (37, 5, 3, 2), (500, 64, 3, 3),
                                           (301, 16, 2, 4), (128, 12, 4, 5), (64, 7, 8, 6)])
def test_each_row_decodes_as_the_uniform_codec_at_its_width(n, d, bits, seed):
    x, imp = rows(n, d, seed)
    codec = Codec("mixed", bits=bits)
    tags = allocate_widths(x.amax(1) - x.amin(1), imp, d, bits) if n else torch.zeros(0, dtype=torch.uint8)
    buf = codec.encode(x, tags)
    assert len(buf) == codec.nbytes_of(buf, n, d) <= 4 * n + (n + 3) // 4 + (n * d * bits + 7) // 8 + 3
    got = codec.decode(buf, n, d)
    with pytest.raises(ValueError, match="sizes"):
        codec.decode(buf + b"\0", n, d)
    assert int(sum(WIDTHS[t] for t in tags.tolist())) * d <= n * d * bits  # within the budget
    for t, width in enumerate(WIDTHS):
        pick = torch.nonzero(tags == t).reshape(-1)
        if pick.numel():
            ref = Codec("uniform", bits=width)
            want = ref.decode(ref.encode(x[pick]), pick.numel(), d)
            assert torch.equal(got[pick], want), width


def test_important_rows_get_more_bits_and_the_weighted_error_falls():
    x, imp = rows(2000, 32, 7)
    x = torch.randn(2000, 32, generator=torch.Generator().manual_seed(8))  # equal spread: importance decides
    span = x.amax(1) - x.amin(1)
    tags = allocate_widths(span, imp, 32, 3).long()
    order = torch.argsort(imp, descending=True)
    assert tags[order[:50]].min() >= 2 and tags[order[-500:]].max() == 0  # 4 or 8 bits; 2 bits
    assert torch.bincount(tags, minlength=4).tolist() != [0, 2000, 0, 0]

    def weighted(codec: Codec) -> float:
        y = codec.decode(codec.encode(x, tags) if codec.method == "mixed" else codec.encode(x), 2000, 32)
        return float(((y - x) ** 2).sum(1).mul(imp).sum())

    assert weighted(Codec("mixed", bits=3)) < 0.5 * weighted(Codec("uniform", bits=3))
    # with no importance every row is alike, and the widths follow the row ranges only
    assert torch.equal(allocate_widths(span, None, 32, 3), allocate_widths(span, torch.ones(2000), 32, 3))
    # rows of a narrower table cost fewer bits: the budget counts every row's own columns
    cols = torch.tensor([32] * 1000 + [8] * 1000)
    mixed = allocate_widths(span, imp, cols, 3)
    assert int((torch.tensor(WIDTHS)[mixed.long()] * cols).sum()) <= int(cols.sum()) * 3


def test_importance_comes_from_accumulated_squared_gradients():
    assert torch.equal(row_importance({"sum_sq": torch.tensor([[1.0], [4.0]])}), torch.tensor([1.0, 2.0]))
    v = torch.tensor([[7.0, 9.0], [0.0, 2.0]])
    assert torch.equal(row_importance({"exp_avg": -v, "exp_avg_sq": v}), torch.tensor([8.0, 1.0]).sqrt())
    assert row_importance({}) is None


def test_mixed_is_a_known_quantization_and_bad_values_are_named():
    assert make_codec("mixed", "fp32", 3).name == "mixed3"
    with pytest.raises(ConfigError, match="checkpoint.quantization.*mixed"):
        load_config(None, ["checkpoint.quantization=mixd"])
    with pytest.raises(ValueError, match="checkpoint.bits"):
        load_config(None, ["checkpoint.dir='/tmp/x'", "checkpoint.quantization=mixed", "checkpoint.bits=5"])


def test_training_restores_mixed_checkpoints_and_verify_reads_them(tmp_path, capsys):
    root = tmp_path / "ck"
    common = [f"checkpoint.dir='{root}'", "checkpoint.quantization=mixed", "checkpoint.bits=3"]
    _, state, _ = run_training(common + ["train.max_steps=8", "checkpoint.interval_steps=4"])
    manifest = json.loads((ckpt_dir(root, 8) / "manifest.json").read_text())
    assert manifest["weight_codec"]["method"] == "mixed" and manifest["weight_codec"]["bits"] == 3
    # the widths are allocated over the whole checkpoint: 3 bits on average over every table's
    # rows, more to some tables than to others
    data = (ckpt_dir(root, 8) / "rank00000.bin").read_bytes()
    spent = budget = 0
    means = []
    for c in manifest["chunks"]:
        widths = torch.tensor(WIDTHS)[mixed_tags(data[c["offset"] + c["id_bytes"] :], c["num_rows"]).long()]
        spent += int(widths.sum()) * c["num_cols"]
        budget += 3 * c["num_rows"] * c["num_cols"]
        means.append(float(widths.float().mean()))
    assert 0.98 * budget <= spent <= budget and max(means) > 3.2 and min(means) < 2.9
    assert main(["ckpt", "verify", str(root)]) == 0
    assert "intact" in capsys.readouterr().out
    out = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(root), "--out", str(out)]) == 0
    restored = torch.load(out)
    for name in ("t_s0", "t_s1", "t_s2"):
        w, r = state[f"{name}.weight"], restored[f"embeddings.{name}.weight"]
        # every row within half a 2-bit step of its range (fp16 scale and offset aside)
        half = (w.amax(1, keepdim=True) - w.amin(1, keepdim=True)) / 6
        assert bool(((r - w).abs() <= half * 1.01 + 1e-3).all())
        assert not torch.equal(r, w)
        assert torch.equal(restored[f"embeddings.{name}.sum_sq"], state[f"{name}.sum_sq"])
