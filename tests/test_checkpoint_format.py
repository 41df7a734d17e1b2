"""Checkpoint format pieces: quantizers, bit packing, policies; damaged checkpoints refused with a
clear error; the ckpt command line (list, inspect, verify, export)."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_utils import ckpt_dir, run_training
from recscale.checkpoint.manifest import MANIFEST, CheckpointError
from recscale.checkpoint.policy import Policy
from recscale.checkpoint.native import quantize_kernels
from recscale.checkpoint.quantize import (NEVER_SEARCHED, Codec, SearchSchedule, greedy_range, pack_bits, range_search,
                                          unpack_bits)
from recscale.checkpoint.settings import CheckpointSettings, bits_for_restores
from recscale.cli import main


# ---------------------------------------------------------------------- quantizers
@given(st.sampled_from([2, 3, 4, 8]), st.integers(0, 200), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_bit_packing_round_trips(bits, n, seed):
    q = np.random.default_rng(seed).integers(0, 1 << bits, n, dtype=np.uint8)
    packed = pack_bits(q, bits)
    assert len(packed) == (n * bits + 7) // 8
    assert np.array_equal(unpack_bits(packed, bits, n), q)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_error_is_within_half_a_step_and_adaptive_is_no_worse(bits):
    torch.manual_seed(bits)
    x = torch.randn(300, 24) * torch.rand(300, 1) * 0.1
    x[0] = 0.25  # a constant row
    uni, ada = Codec("uniform", bits=bits), Codec("adaptive", bits=bits, bins=25, ratio=0.6)
    buf = uni.encode(x)
    assert len(buf) == uni.nbytes(300, 24)
    y = uni.decode(buf, 300, 24)
    levels = (1 << bits) - 1
    step = ((x.amax(1) - x.amin(1)) / levels).view(-1, 1)
    # Half a step, plus what rounding the scale and offset to fp16 (2^-11 relative) can add.
    bound = step * (0.5 + levels * 2.0**-10) + x.abs().amax(1, keepdim=True) * 2.0**-10 + 1e-7
    assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() - bound).max())
    assert torch.allclose(y[0], x[0], atol=1e-3)
    z = ada.decode(ada.encode(x), 300, 24)
    e_uni, e_ada = (x - y).square().sum(), (x - z).square().sum()
    # (at 8 bits the fp16 rounding of scale and offset is of the same order as the gain)
    assert e_ada <= e_uni * 1.01, (bits, float(e_ada), float(e_uni))
    if bits <= 4:
        assert e_ada < e_uni * 0.95  # the range search pays off at low bit widths


@pytest.mark.skipif(quantize_kernels() is None, reason="the native quantizer cannot be built here (no C++ compiler)")
@given(st.integers(1, 70), st.integers(1, 140), st.sampled_from([2, 3, 4, 8]), st.integers(1, 60),
       st.floats(0.0, 0.95), st.sampled_from([1e-4, 0.1, 30.0]), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_native_range_search_equals_the_pytorch_definition(n, d, bits, bins, ratio, spread, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * spread
    x[0, : d // 2] = x[0, 0]  # repeated values: ties between the two candidate moves
    if n > 1:
        x[1] = 0.5  # a constant row
    lo_t, hi_t = greedy_range(x, bits, bins, ratio, native=False)
    lo_n, hi_n = greedy_range(x, bits, bins, ratio, native=True)
    assert torch.equal(lo_t, lo_n) and torch.equal(hi_t, hi_n)


@pytest.mark.skipif(quantize_kernels() is None, reason="the native quantizer cannot be built here (no C++ compiler)")
@given(st.integers(1, 70), st.integers(1, 140), st.sampled_from([2, 3, 4, 8]), st.integers(1, 60),
       st.floats(0.0, 0.95), st.sampled_from([1e-4, 0.1, 30.0]), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_native_warm_range_search_equals_the_pytorch_definition(n, d, bits, bins, ratio, spread, seed):
    """Rows searched warm from stored starts (any, unusable ones included: those go cold), mixed
    with rows never searched, give the same ranges and steps natively as in PyTorch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * spread
    x[0, : d // 2] = x[0, 0]
    if n > 1:
        x[1] = 0.5
    start = torch.randint(0, bins + 2, (n, 2), generator=g, dtype=torch.uint8)
    start[torch.rand(n, generator=g) < 0.3, 0] = NEVER_SEARCHED
    ref = range_search(x, bits, bins, ratio, start, native=False)
    nat = range_search(x, bits, bins, ratio, start, native=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, nat))
    cold = range_search(x, bits, bins, ratio, None, native=False)
    assert torch.equal(cold[0], greedy_range(x, bits, bins, ratio, native=True)[0])


def test_warm_range_search_finds_about_the_cold_error_on_changed_rows():
    """A row's range found warm from its last result after a training-like change of its values
    has about the L2 error of a cold search of the changed row; and a cold search's steps in
    lie within half a step of its range."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2000, 64, generator=g) * torch.rand(2000, 1, generator=g) * 0.05
    for bits in (2, 3, 4):
        lo, hi, found = range_search(x, bits, 25, 0.6)
        step = (x.amax(1) - x.amin(1)) / 25
        # (the range ends with a least-squares refit, off the grid: its steps are the nearest)
        assert bool(((x.amin(1) + found[:, 0].float() * step - lo).abs() <= step * 0.5 + 1e-6).all())
        assert bool(((x.amax(1) - found[:, 1].float() * step - hi).abs() <= step * 0.5 + 1e-6).all())
        y = x + torch.randn(x.shape, generator=g) * x.std(1, keepdim=True) * 0.05
        codec = Codec("adaptive", bits=bits)
        warm = found.clone()
        e_cold = (codec.decode(codec.encode(y), 2000, 64) - y).square().sum()
        e_warm = (codec.decode(codec.encode(y, ranges=warm), 2000, 64) - y).square().sum()
        assert e_warm <= e_cold * 1.02, (bits, float(e_warm), float(e_cold))


SCHEDULES = [SearchSchedule(3, 2, 2, (3, 1)), SearchSchedule(1, 3, 0, (2, 1)), SearchSchedule(1, 3, 0, (1, 1)),
             SearchSchedule(3, 2, 0, (3,), fits=1, cold_fits=1), SearchSchedule(1, 3, 1, (), fits=2),
             SearchSchedule(2, 1, 0, (1, 1), fits=0, cold_fits=2)]


@pytest.mark.skipif(quantize_kernels() is None, reason="the native quantizer cannot be built here (no C++ compiler)")
@given(st.sampled_from(SCHEDULES), st.integers(1, 50), st.integers(1, 140), st.sampled_from([2, 3, 4, 8]),
       st.sampled_from([1e-4, 0.1, 30.0]), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_native_search_equals_the_pytorch_definition_for_any_schedule(plan, n, d, bits, spread, seed):
    """Every way the search can run (refining rounds cold and warm, least-squares refits ending
    either, warm rounds or none) gives the same ranges, steps and bytes natively as in PyTorch:
    rows cold, warm and with unusable starts mixed, constant rows and repeated values."""
    from recscale.checkpoint import quantize
    from recscale.checkpoint.quantize import quantize_packed, search_packed

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * spread
    x[0, : d // 2] = x[0, 0]
    if n > 1:
        x[1] = 0.5
    start = torch.randint(0, 27, (n, 2), generator=g, dtype=torch.uint8)
    start[torch.rand(n, generator=g) < 0.3, 0] = NEVER_SEARCHED
    with patch.object(quantize, "search_schedule", lambda bits: plan):
        for s in (None, start):
            ref = range_search(x, bits, 25, 0.6, s, native=False)
            nat = range_search(x, bits, 25, 0.6, s, native=True)
            assert all(torch.equal(a, b) for a, b in zip(ref, nat))
            sc, bi, codes = quantize_packed(x, ref[0], ref[1], bits, native=False)
            found, sc_n, bi_n, codes_n = search_packed(x, bits, 25, 0.6, s)
            assert torch.equal(found, ref[2]) and bytes(codes) == bytes(codes_n)
            assert torch.equal(sc.view(torch.int16), sc_n.view(torch.int16))
            assert torch.equal(bi.view(torch.int16), bi_n.view(torch.int16))


def _sq_error(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row, the float64 squared error of quantizing on [lo, hi] (no fp16 rounding)."""
    levels = (1 << bits) - 1
    x, lo, hi = x.double(), lo.double().view(-1, 1), hi.double().view(-1, 1)
    s = ((hi - lo) / levels).clamp(min=1e-30)
    q = ((x - lo) / s).clamp(0, levels).round()
    return (lo + q * s - x).square().sum(1)


@given(st.integers(1, 60), st.integers(2, 140), st.sampled_from([2, 3, 4, 8]),
       st.sampled_from(["normal", "uniform", "heavy", "skewed"]), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_the_search_is_never_worse_than_uniform_and_a_refit_never_worse_than_its_start(n, d, bits, kind, seed):
    """On random rows of any shape: the searched range (cold, ending with a refit at 2 bits) errs
    no more than [min, max] per row, and a least-squares refit errs no more than the range it
    started from (float32 rounding aside)."""
    from recscale.checkpoint.quantize import _refit

    g = torch.Generator().manual_seed(seed)
    x = {"normal": lambda: torch.randn(n, d, generator=g),
         "uniform": lambda: torch.rand(n, d, generator=g) - 0.5,
         "heavy": lambda: torch.randn(n, d, generator=g) ** 3,
         "skewed": lambda: torch.rand(n, d, generator=g) ** 4}[kind]() * torch.rand(n, 1, generator=g)
    mn, mx = x.amin(1), x.amax(1)
    e_uni = _sq_error(x, mn, mx, bits)
    ulp = d * (x.abs().amax(1).double() * 2.0**-20) ** 2  # float32 rounding of the range's ends
    lo, hi, _ = range_search(x, bits, 25, 0.6, native=False)
    assert bool((_sq_error(x, lo, hi, bits) <= e_uni * (1 + 1e-4) + ulp).all())
    start_lo = mn + (mx - mn) * torch.rand(n, generator=g) * 0.4
    start_hi = mx - (mx - mn) * torch.rand(n, generator=g) * 0.4
    fit_lo, fit_hi = _refit(x.t().contiguous(), start_lo, start_hi, (1 << bits) - 1)
    e_start = _sq_error(x, start_lo, start_hi, bits)
    assert bool((_sq_error(x, fit_lo, fit_hi, bits) <= e_start * (1 + 1e-4) + ulp).all())


def test_warm_start_rejects_a_misshapen_start():
    with pytest.raises(ValueError, match="start must be uint8"):
        range_search(torch.zeros(3, 4), 2, 25, 0.6, torch.zeros(3, 2))


@pytest.mark.skipif(quantize_kernels() is None, reason="the native quantizer cannot be built here (no C++ compiler)")
@given(st.integers(1, 70), st.integers(1, 140), st.integers(1, 8), st.sampled_from([1e-4, 0.1, 30.0]),
       st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_native_codes_and_packing_equal_the_pytorch_definition(n, d, bits, spread, seed):
    """Same bytes from the one-pass kernel as from PyTorch's codes and NumPy's packing, rows that
    start inside a byte (odd ``d`` x ``bits``), constant rows and narrowed ranges included."""
    from recscale.checkpoint.quantize import quantize_packed

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * spread
    x[0] = 0.5  # a constant row
    lo, hi = greedy_range(x, min(bits, 8), 25, 0.6) if bits in (2, 3, 4, 8) else (x.amin(1), x.amax(1))
    s_t, b_t, c_t = quantize_packed(x, lo, hi, bits, native=False)
    s_n, b_n, c_n = quantize_packed(x, lo, hi, bits, native=True)
    assert torch.equal(s_t, s_n) and torch.equal(b_t, b_n)
    assert bytes(c_t) == bytes(c_n)


@pytest.mark.skipif(quantize_kernels() is None, reason="the native quantizer cannot be built here (no C++ compiler)")
@given(st.integers(1, 50), st.integers(1, 70), st.integers(1, 8), st.sampled_from([1e-6, 1e-4, 0.1, 30.0, 5e4]),
       st.booleans(), st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_fused_search_and_packing_equal_the_two_step_definition(n, d, bits, spread, warm, seed):
    """The one-pass search + scales + packing gives the bytes, scales and found ranges of the
    PyTorch search followed by PyTorch's codes and NumPy's packing: cold and warm rows mixed
    (groups packed out of row order), constant rows, odd ``d`` x ``bits``, fp16-subnormal scales
    and offsets past fp16's range."""
    from recscale.checkpoint.quantize import quantize_packed, search_packed

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * spread
    x[0] = 0.5  # a constant row
    if n > 2:
        x[2] = x[2] + 7e4  # its offset clamps to fp16's largest value
    start = None
    if warm:
        start = torch.randint(0, 30, (n, 2), generator=g, dtype=torch.uint8)
        start[torch.rand(n, generator=g) < 0.3] = NEVER_SEARCHED
    lo, hi, found_t = range_search(x, bits, 25, 0.6, start, native=False)
    s_t, b_t, c_t = quantize_packed(x, lo, hi, bits, native=False)
    found_n, s_n, b_n, c_n = search_packed(x, bits, 25, 0.6, start)
    assert torch.equal(found_t, found_n)
    assert torch.equal(s_t.view(torch.int16), s_n.view(torch.int16))
    assert torch.equal(b_t.view(torch.int16), b_n.view(torch.int16))
    assert bytes(c_t) == bytes(c_n)
    ranges = start.clone() if warm else None
    enc = Codec("adaptive", bits=bits).encode(x, ranges=ranges)
    assert enc == bytes(s_t.view(torch.uint8).numpy()) + bytes(b_t.view(torch.uint8).numpy()) + bytes(c_t)
    if warm:
        assert torch.equal(ranges, found_t)


def test_lossless_and_float_codecs():
    x = torch.randn(50, 8)
    assert torch.equal(Codec("none", "fp32").decode(Codec("none", "fp32").encode(x), 50, 8), x)
    h = x.half()
    assert torch.equal(Codec("none", "fp16").decode(Codec("none", "fp16").encode(h), 50, 8), h)
    for name in ("fp16", "bf16"):
        c = Codec(name)
        assert torch.allclose(c.decode(c.encode(x), 50, 8), x, rtol=1e-2, atol=1e-2)


def test_bits_from_expected_restores():
    assert [bits_for_restores(n) for n in (0, 1, 2, 3, 4, 20, 21, 100)] == [2, 2, 3, 3, 4, 4, 8, 8]
    assert CheckpointSettings(quantization="adaptive", expected_restores=2).effective_bits == 3
    assert CheckpointSettings(quantization="adaptive", bits=4, expected_restores=2).effective_bits == 4


# ---------------------------------------------------------------------- policies
def run_policy(settings: CheckpointSettings, fractions: list[float]) -> list[str]:
    p, kinds = Policy(settings), []
    for f in [1.0] + fractions:
        kind = p.decide(f)
        p.record(kind, f)
        kinds.append(kind)
    return kinds


def test_policies():
    s = [0.26, 0.35, 0.42, 0.47, 0.51, 0.55, 0.58, 0.60, 0.3]
    assert run_policy(CheckpointSettings(policy="full"), s) == ["full"] * 10
    assert run_policy(CheckpointSettings(policy="one_shot"), s) == ["full"] + ["differential"] * 9
    assert run_policy(CheckpointSettings(policy="incremental"), s) == ["full"] + ["incremental"] * 9
    assert run_policy(CheckpointSettings(policy="one_shot", full_every=3), s[:7]) == ["full"] + ["differential"] * 3 + ["full"] + ["differential"] * 3
    # Check-N-Run's intermittent rule: a new baseline at the first i with 1 + S_1 + ... + S_i <= (i + 1) S_i.
    kinds = run_policy(CheckpointSettings(policy="intermittent"), s)
    acc, expect = 1.0, None
    for i, x in enumerate(s, 1):
        acc += x
        if acc <= (i + 1) * x:
            expect = i
            break
    assert expect is not None and kinds.index("full", 1) == expect
    kinds = run_policy(CheckpointSettings(policy="intermittent", rebaseline="fraction", rebaseline_fraction=0.5), s)
    assert kinds.index("full", 1) == 5


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="checkpoint.bits"):
        CheckpointSettings(bits=5).validate()
    with pytest.raises(ValueError, match="checkpoint.dir"):
        CheckpointSettings(interval_steps=3).validate()


# ---------------------------------------------------------------------- damaged checkpoints
@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ck")
    summary, state, _ = run_training([f"checkpoint.dir='{root}'", "train.max_steps=8", "checkpoint.interval_steps=4"])
    return root, state


def damaged_copy(root: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(root, dst)
    return dst


def resume_error(ck: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        run_training([f"checkpoint.dir='{ck}'", "checkpoint.resume=latest"])
    return str(e.value)


def test_truncated_file_is_refused(written, tmp_path):
    ck = damaged_copy(written[0], tmp_path)
    data = ckpt_dir(ck, 8) / "rank00000.bin"
    data.write_bytes(data.read_bytes()[:-100])
    assert "truncated" in resume_error(ck)


# Rows in the baseline that the latest (differential) checkpoint needs; the latest's own state file.
@pytest.mark.parametrize("target", ["step0000000004/rank00000.bin", "step0000000008/rank00000.state"])
def test_flipped_byte_is_refused(written, tmp_path, target):
    ck = damaged_copy(written[0], tmp_path)
    f = ckpt_dir(ck, 8).parent / target
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))
    msg = resume_error(ck)
    assert "damaged" in msg and target in msg


def test_verify_finds_a_flipped_byte_in_a_data_file_by_its_chunk_checksums(written, tmp_path, capsys):
    """Data files carry no file hash: the crc32s of the chunks that tile them check every byte."""
    ck = damaged_copy(written[0], tmp_path)
    d = ckpt_dir(ck, 8)
    entry = next(f for f in json.loads((d / MANIFEST).read_text())["files"] if f["path"] == "rank00000.bin")
    assert entry["sha256"] == ""
    f = d / "rank00000.bin"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))
    assert main(["ckpt", "verify", str(d)]) == 2
    assert "checksum mismatch" in capsys.readouterr().err


def test_missing_manifest_is_refused(written, tmp_path):
    ck = damaged_copy(written[0], tmp_path)
    (ckpt_dir(ck, 8) / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        run_training([f"checkpoint.resume='{ckpt_dir(ck, 8)}'"])


def test_unknown_format_version_is_refused(written, tmp_path, capsys):
    ck = damaged_copy(written[0], tmp_path)
    m = ckpt_dir(ck, 8) / MANIFEST
    d = json.loads(m.read_text())
    d["version"] = 99
    m.write_text(json.dumps(d))
    assert "unknown checkpoint format version 99" in resume_error(ck)
    assert main(["ckpt", "verify", str(ckpt_dir(ck, 8))]) == 2
    assert "version 99" in capsys.readouterr().err


def test_damaged_manifest_is_refused(written, tmp_path):
    ck = damaged_copy(written[0], tmp_path)
    m = ckpt_dir(ck, 8) / MANIFEST
    m.write_text(m.read_text().replace('"step": 8', '"step": 9'))
    assert "manifest checksum mismatch" in resume_error(ck)


def test_mismatched_data_settings_are_refused(written, tmp_path):
    with pytest.raises(CheckpointError, match="batch_size"):
        run_training([f"checkpoint.resume='{written[0]}'", "train.batch_size=128"])


# ---------------------------------------------------------------------- command line
def test_ckpt_cli_list_inspect_verify_export(written, tmp_path, capsys):
    root, state = written
    assert main(["ckpt", "list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "step0000000004" in out and "differential" in out and "step0000000004 + step0000000008" in out
    assert main(["ckpt", "inspect", str(ckpt_dir(root, 8))]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "differential" and info["chain"] == ["step0000000004", "step0000000008"]
    assert main(["ckpt", "verify", str(root)]) == 0
    assert "intact" in capsys.readouterr().out
    out_file = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(root), "--out", str(out_file)]) == 0
    exported = torch.load(out_file)
    for name in ("t_s0", "t_s1", "t_s2"):
        assert torch.equal(exported[f"embeddings.{name}.weight"], state[f"{name}.weight"])
        assert torch.equal(exported[f"embeddings.{name}.sum_sq"], state[f"{name}.sum_sq"])
    dense = [k for k in state if not k.startswith("t_")]
    assert dense and all(torch.equal(exported[f"dense.{k}"], state[k]) for k in dense)


def test_full_checkpoints_leave_out_rows_at_their_initial_values(written, tmp_path):
    """Rows no update reached cost no bytes and restore exactly from the seed (the export and
    the bitwise-resume tests restore through them); with the setting off every row is held."""
    from recscale.checkpoint.restore import load_manifest
    from recscale.checkpoint.storage import LocalStorage

    root, state = written
    base = load_manifest(LocalStorage(ckpt_dir(root, 4).parent), "step0000000004")
    assert base.kind == "full" and base.initial_rows is not None and base.initial_rows["seed"] == 0
    held = sum(c.num_rows for c in base.chunks)
    total = sum(t.num_rows for t in base.tables)
    assert 0 < held < total
    assert any(bool((state[k] == 0).all(1).any()) for k in state if k.endswith("sum_sq"))  # rows never reached
    every = tmp_path / "every"
    run_training([f"checkpoint.dir='{every}'", "train.max_steps=4", "checkpoint.interval_steps=4",
                  "checkpoint.skip_initial_rows=false"])
    m = load_manifest(LocalStorage(ckpt_dir(every, 4).parent), "step0000000004")
    assert m.initial_rows is None and sum(c.num_rows for c in m.chunks) == total
    assert m.stats["bytes_written"] > base.stats["bytes_written"]


def test_full_checkpoint_after_a_resume_holds_the_rows_off_their_initial_values(written, tmp_path):
    """Full checkpoints take their rows from the modified-row flags, not from comparing every
    row with its initial value; after a resume the flags start from the restored rows, so the
    next full checkpoint holds exactly the rows an update reached, before or after the resume,
    and restores to the trained state."""
    from recscale.checkpoint.restore import load_chain, load_manifest
    from recscale.checkpoint.storage import LocalStorage

    ck = damaged_copy(written[0], tmp_path)
    _, state, _ = run_training([f"checkpoint.dir='{ck}'", "checkpoint.resume=latest", "train.max_steps=12",
                                "checkpoint.interval_steps=4"])
    d = ckpt_dir(ck, 12)
    m = load_manifest(LocalStorage(d.parent), d.name)
    assert m.kind == "full" and m.initial_rows is not None
    for t in m.tables:
        reached = int((state[f"{t.name}.sum_sq"] != 0).any(1).sum())
        assert sum(c.num_rows for c in m.chunks if c.table == t.name) == reached > 0
    assert len(load_chain(LocalStorage(d.parent), m)) == 1
    exported = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(d.parent), "--out", str(exported)]) == 0
    out = torch.load(exported)
    for t in m.tables:
        assert torch.equal(out[f"embeddings.{t.name}.weight"], state[f"{t.name}.weight"])
