"""Row quantizers for embedding rows on write (Check-N-Run, section 5 of the paper).

Each codec turns a ``[n, d]`` block of rows into bytes and back. ``none`` keeps the storage
dtype bit for bit (exact resume); ``fp16``/``bf16`` round; ``uniform`` and ``adaptive`` store
per row an fp16 scale and offset plus ``bits``-bit codes packed densely (3 bits: 8 codes in 3
bytes). ``adaptive`` first narrows each row's [min, max] by a greedy search that moves one end
in steps of ``range / bins`` toward the other, whichever lowers the L2 error more, for at most
``ratio x bins`` steps, and keeps the best range seen (FBGEMM's ``param_search_greedy``); a row's
search ends early once a few moves in a row found nothing better, and at 2 bits it moves three
steps at a time and ends with a least-squares refit of the best range (``search_schedule``).
``mixed`` spends ``bits`` per value on average over all the rows a checkpoint writes, but per
row: each row gets 2, 3, 4 or 8 bits on its [min, max], the rows that matter most the most bits
(``allocate_widths``), with a 2-bit width tag per row from which a block's size follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recscale.checkpoint.native import quantize_kernels

_FLOATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Codec:
    """How a block of rows is stored. ``method``: none (``dtype`` raw), fp16, bf16, uniform, adaptive, mixed."""

    method: str
    dtype: str = "fp32"  # none: the storage dtype written as is
    bits: int = 8
    bins: int = 25
    ratio: float = 0.6

    @property
    def name(self) -> str:
        if self.method == "none":
            return self.dtype
        if self.method in ("fp16", "bf16"):
            return self.method
        return f"{self.method}{self.bits}"

    @property
    def lossless(self) -> bool:
        return self.method == "none"

    def to_dict(self) -> dict:
        return {"method": self.method, "dtype": self.dtype, "bits": self.bits, "bins": self.bins, "ratio": self.ratio}

    @staticmethod
    def from_dict(d: dict) -> Codec:
        return Codec(str(d["method"]), str(d["dtype"]), int(d["bits"]), int(d["bins"]), float(d["ratio"]))

    def nbytes(self, n: int, d: int) -> int:
        """Bytes of ``n`` rows of ``d`` values."""
        if self.method == "none":
            return n * d * torch.finfo(_FLOATS[self.dtype]).bits // 8
        if self.method in ("fp16", "bf16"):
            return n * d * 2
        if self.method == "mixed":
            raise ValueError("a mixed block's size depends on its width tags; use mixed_tags and nbytes_of")
        return n * 4 + _packed_bytes(n * d, self.bits)

    def nbytes_of(self, buf: bytes | memoryview, n: int, d: int) -> int:
        """Bytes the block of ``n`` rows of ``d`` values starting ``buf`` takes (``mixed``: read
        from its tags; ValueError when ``buf`` cannot hold them)."""
        return _mixed_nbytes(mixed_tags(buf, n), d) if self.method == "mixed" else self.nbytes(n, d)

    def encode_view(self, x: torch.Tensor) -> bytes | memoryview:
        """``encode``'s bytes without copying them where they already lie in ``x`` (``none`` in
        ``x``'s own dtype, contiguous, on the CPU): a model-sized full checkpoint then costs one
        pass less over its gigabytes. The view is valid while ``x`` is."""
        if self.method == "none" and x.dtype == _FLOATS[self.dtype] and x.device.type == "cpu" and x.is_contiguous():
            return memoryview(x.detach().view(torch.uint8).numpy().reshape(-1)) if x.numel() else b""
        return self.encode(x)

    def encode(self, x: torch.Tensor, tags: torch.Tensor | None = None, ranges: torch.Tensor | None = None) -> bytes:
        """``x``: ``[n, d]`` rows (any float dtype, CPU). ``tags`` (``mixed`` only): each row's
        width from ``allocate_widths`` over every row a checkpoint writes; None: allocated within
        this block by row range alone, at 3 bits on average. ``ranges`` (``adaptive`` only,
        ignored by the others): uint8 ``[n, 2]``, each row's last range search result
        (``range_search``'s ``start``, ``NEVER_SEARCHED`` for none), overwritten with this one's."""
        if self.method == "none":
            return tensor_bytes(x.to(_FLOATS[self.dtype]))
        if self.method in ("fp16", "bf16"):
            return tensor_bytes(x.to(_FLOATS[self.method]))
        x = x.float()
        if self.method == "mixed":
            return _encode_mixed(x, tags)
        if self.method == "adaptive":
            fused = search_packed(x, self.bits, self.bins, self.ratio, ranges)
            if fused is not None:
                found, scale, bias, codes = fused
                if ranges is not None:
                    ranges.copy_(found)
                return tensor_bytes(scale) + tensor_bytes(bias) + codes
            lo, hi, found = range_search(x, self.bits, self.bins, self.ratio, ranges)
            if ranges is not None:
                ranges.copy_(found)
        else:
            lo, hi = (x.amin(1), x.amax(1)) if x.numel() else (x.new_zeros(0), x.new_zeros(0))
        scale, bias, codes = quantize_packed(x, lo, hi, self.bits)
        return tensor_bytes(scale) + tensor_bytes(bias) + codes

    def encode_kept(self, x: torch.Tensor, rows: RowRanges) -> bytes:
        """``adaptive`` with each row's memory (``RowRanges``, updated in place): a row marked
        ``kept`` (values unchanged since its last encoding) is encoded on that encoding's scale
        and offset again, bytes for bytes, without a search; the others are searched from their
        ``found`` as ``encode(x, ranges=found)`` searches them, and leave their new results."""
        if self.method != "adaptive":
            raise ValueError(f"encode_kept: codec '{self.name}' keeps no ranges; only adaptive does")
        x = x.float()
        fused = search_packed(x, self.bits, self.bins, self.ratio, rows.found, rows)
        if fused is not None:
            found, scale, bias, codes = fused
            rows.found.copy_(found)
            rows.scale.copy_(scale.reshape(-1))
            rows.bias.copy_(bias.reshape(-1))
            return tensor_bytes(scale) + tensor_bytes(bias) + codes
        n = x.shape[0]
        stale = torch.nonzero(~rows.kept).view(-1)
        if stale.numel():
            part = x if stale.numel() == n else x.index_select(0, stale)
            lo, hi, found = range_search(part, self.bits, self.bins, self.ratio, rows.found.index_select(0, stale))
            scale, bias, _ = _scales(lo, hi, self.bits)
            rows.found[stale], rows.scale[stale], rows.bias[stale] = found, scale, bias
        codes = pack_on(x, rows.scale, rows.bias, self.bits)
        return tensor_bytes(rows.scale) + tensor_bytes(rows.bias) + codes

    def decode(self, buf: bytes | memoryview, n: int, d: int) -> torch.Tensor:
        """Rows as float32 ``[n, d]`` (``none``: in the stored dtype)."""
        if self.method == "none":
            return bytes_tensor(buf, _FLOATS[self.dtype], (n, d))
        if self.method in ("fp16", "bf16"):
            return bytes_tensor(buf, _FLOATS[self.method], (n, d)).float()
        if self.method == "mixed":
            return _decode_mixed(buf, n, d)
        scale = bytes_tensor(buf[: 2 * n], torch.float16, (n, 1)).float()
        bias = bytes_tensor(buf[2 * n : 4 * n], torch.float16, (n, 1)).float()
        q = unpack_bits(buf[4 * n :], self.bits, n * d).reshape(n, d)
        return torch.from_numpy(q.astype(np.float32)) * scale + bias


def _scales(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row the fp16 scale and offset of [lo, hi] (rounded first, so the decoder rebuilds
    exactly what the encoder measured) and the reciprocal of the scale (0 for a constant row:
    every code 0)."""
    levels = (1 << bits) - 1
    bias = lo.clamp(-_FP16_MAX, _FP16_MAX).half()
    scale = ((hi - bias.float()) / levels).clamp(0, _FP16_MAX).half()
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return scale, bias, inv


def _codes(x: torch.Tensor, bias: torch.Tensor, inv: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes for ``x`` per row (uint8, one per value) on float32 offsets ``bias`` and reciprocal
    scales ``inv`` (``_scales``): the definition the native ``pack_codes`` follows."""
    levels = (1 << bits) - 1
    return (x - bias.view(-1, 1)).mul_(inv.view(-1, 1)).round_().clamp_(0, levels).to(torch.uint8)


def quantize_packed(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
                    native: bool = True) -> tuple[torch.Tensor, torch.Tensor, bytes | memoryview]:
    """Per row the fp16 scale and offset of [lo, hi] and the codes on them, packed (``pack_on``).
    The native kernel (when built; the same bytes) computes and packs each row's codes in one
    pass, without the five full-size temporaries of the PyTorch and NumPy definition."""
    scale, bias, _ = _scales(lo, hi, bits)
    return scale, bias, pack_on(x, scale, bias, bits, native)


def pack_on(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int,
            native: bool = True) -> bytes | memoryview:
    """The packed codes of float32 rows ``x`` on given fp16 scales and offsets (one per row):
    the bytes ``quantize_packed`` writes for the range those came from."""
    s = scale.float().reshape(-1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # as ``_scales``
    b = bias.float().reshape(-1)
    kernels = quantize_kernels() if native else None
    if kernels is None or x.numel() == 0:
        return pack_bits(_codes(x, b, inv, bits).numpy(), bits)
    return memoryview(kernels.pack_codes(x.contiguous(), b.contiguous(), inv.contiguous(), bits).numpy())


def _scaled_sq_error(xs: torch.Tensor, a: torch.Tensor, levels: int, buf: torch.Tensor) -> torch.Tensor:
    """Per-row squared error, in units of the scale, of quantizing the rows of a transposed
    block (``xs``: values times ``1 / scale``, ``[d, n]``) on the range starting at ``a`` scales:
    codes ``round(clamp(xs - a, 0, levels))``. Each row's error is summed in float32 over its
    columns in order: an order the native kernel reproduces exactly."""
    t = xs - a.unsqueeze(0)
    torch.clamp(t, 0.0, float(levels), out=buf)
    buf.round_().sub_(t)
    buf.mul_(buf)
    acc = torch.zeros_like(a)  # 0 + e * e is e * e exactly
    for col in buf:
        acc.add_(col)
    return acc


def _scale(width: torch.Tensor, levels: int) -> torch.Tensor:
    return (width / levels).clamp_(min=1e-30)


_SEARCH_BLOCK = 1024  # rows per block of the range search: its temporaries stay in cache


@dataclass(frozen=True)
class SearchSchedule:
    """How the range search moves: ``move`` steps of ``range / bins`` per move, a row's search
    ending once ``patience`` moves in a row found nothing better, then ``refine`` rounds trying the
    best range moved by one step at either end, inward and outward, then ``cold_fits``
    least-squares refits of the best range (``_refit``). A warm search (from the row's last
    result) runs one such round per stride in ``warm``, moving that many steps, then ``fits``
    refits."""

    move: int
    patience: int
    refine: int
    warm: tuple[int, ...]
    fits: int = 0
    cold_fits: int = 0


def search_schedule(bits: int) -> SearchSchedule:
    """At 2 bits the best range of a trained embedding row lies deep inside [min, max] (a third
    or more clipped): triple moves find a range of lower error than single moves, with fewer
    error passes per row. From 3 bits on the best range is a step or two in, where single moves
    are needed, and a search that stops after 3 moves without gain changes the total error by
    under 0.2%.

    Each error tried is a pass over the row; a least-squares refit (``_refit``) is one pass too
    and lands off the grid of steps, nearer the best range than a round of four grid ranges
    does. Measured on the tables of ``benchmarks/checkpoint.py`` (dim 128, row-wise Adagrad, a
    quarter of the rows changing per interval, rows kept searched across three checkpoints,
    mean squared error against the former schedule's): at 2 bits the cold search ends with a
    refit instead of two refining rounds (8 passes fewer, 1% more error); the warm search, from
    a row's last result, runs one round of 3-step moves and a refit (3 passes fewer than 3-step
    then single-step rounds, 0.2-0.3% more error). From 3 bits the warm search runs one round of
    single steps and a refit (2 passes fewer than two rounds, 0.5-4% less error)."""
    if bits <= 2:
        return SearchSchedule(3, 2, 0, (3,), fits=1, cold_fits=1)
    return SearchSchedule(1, 3, 0, (1,), fits=1)


def greedy_range(
    x: torch.Tensor, bits: int, bins: int, ratio: float, native: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the [lo, hi] of lowest L2 error found by shrinking [min, max] greedily (at most
    ``ratio x bins`` steps, in moves and with early stops as ``search_schedule`` says): the cold
    search of ``range_search``."""
    lo, hi, _ = range_search(x, bits, bins, ratio, None, native)
    return lo, hi


NEVER_SEARCHED = 255  # a row's stored start (``range_search``) before its first search


@dataclass
class RowRanges:
    """What an adaptive encode of a block of ``n`` rows starts from and leaves, per row:
    ``found`` (uint8 ``[n, 2]``) the last range search's steps (``NEVER_SEARCHED`` before the
    first); ``scale`` and ``bias`` (fp16 ``[n]``) the last encoding's; ``kept`` (bool ``[n]``)
    whether the row's values are unchanged since that encoding. A kept row's search would start
    where its last one ended, on the same values: encoding it on the same scale again costs one
    pass instead of about seven at 2 bits, and writes the same bytes as before."""

    found: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    kept: torch.Tensor

    @staticmethod
    def cold(n: int) -> RowRanges:
        """``n`` rows never searched."""
        return RowRanges(torch.full((n, 2), NEVER_SEARCHED, dtype=torch.uint8), torch.zeros(n, dtype=torch.float16),
                         torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.bool))


def warm_starts(start: torch.Tensor, bins: int) -> torch.Tensor:
    """Which rows of ``start`` (uint8 ``[n, 2]``) ``range_search`` searches warm: searched before,
    and their range at least a step wide."""
    return (start[:, 0] != NEVER_SEARCHED) & (start[:, 0].long() + start[:, 1].long() < bins)


def range_search(
    x: torch.Tensor, bits: int, bins: int, ratio: float, start: torch.Tensor | None = None, native: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row the [lo, hi] to quantize on, and where it lies: ``found``, uint8 ``[n, 2]``, the
    steps of ``range / bins`` it lies in from the row's min and from its max.

    A row whose ``start`` (uint8 ``[n, 2]``, a former ``found``) is given and leaves the range at
    least a step wide is searched warm: its range ``start`` steps in is refined by moves at
    either end (a round per stride of ``search_schedule``'s ``warm``), then by least-squares
    refits (its ``fits``), which land off the grid of steps (``found``: the nearest steps).
    Between checkpoints a row's best range moves a few steps at most, so this finds a range of
    about the cold search's error with a third of its error passes or fewer. Other rows (``NEVER_SEARCHED``, or no
    ``start``) get the cold greedy search. The native kernel (when built; same results)
    searches sixteen rows at a time, one per vector lane, cold and warm rows in separate groups,
    on the calling thread; ``native=False`` runs the PyTorch definition."""
    n = x.shape[0]
    if start is not None and (start.dtype != torch.uint8 or tuple(start.shape) != (n, 2)):
        raise ValueError(f"range_search: start must be uint8 of shape ({n}, 2), got {start.dtype} {tuple(start.shape)}")
    if x.numel() == 0:
        return x.new_zeros(n), x.new_zeros(n), torch.zeros(n, 2, dtype=torch.uint8)
    levels, steps = (1 << bits) - 1, int(bins * ratio)
    plan = search_schedule(bits)
    kernels = quantize_kernels() if native else None
    if kernels is not None:
        s = torch.empty(0, 2, dtype=torch.uint8) if start is None else start.contiguous()
        return kernels.greedy_range(x.float().contiguous(), levels, bins, steps, plan.move, plan.patience, plan.refine,
                                    s, plan.warm, plan.fits, plan.cold_fits)
    x = x.float()
    warm = torch.zeros(n, dtype=torch.bool) if start is None else warm_starts(start, bins)
    lo, hi, found = x.new_empty(n), x.new_empty(n), torch.zeros(n, 2, dtype=torch.uint8)
    for rows, is_warm in ((torch.nonzero(~warm).view(-1), False), (torch.nonzero(warm).view(-1), True)):
        for a in range(0, rows.numel(), _SEARCH_BLOCK):
            r = rows[a : a + _SEARCH_BLOCK]
            s0 = start[r].float() if is_warm else None
            b_lo, b_hi, k_lo, k_hi = _search_block(x[r].contiguous(), levels, bins, steps, plan, s0)
            lo[r], hi[r] = b_lo, b_hi
            found[r] = torch.stack([k_lo, k_hi], 1).clamp(0, 254).to(torch.uint8)
    return lo, hi, found


def search_packed(
    x: torch.Tensor, bits: int, bins: int, ratio: float, start: torch.Tensor | None = None,
    kept: RowRanges | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, memoryview] | None:
    """``range_search`` then ``quantize_packed`` on its ranges in one native pass (each group of
    sixteen rows quantized and packed right after its search, while its rows are in cache, not
    read from memory a second time): ``(found, scale, bias, codes)``, the same values and bytes.
    ``kept`` (with ``start``): rows flagged there are packed on their ``scale`` and ``bias``
    (``pack_on``) and keep their start, without a search. None when the native kernel is not
    built (or there is nothing to search): the caller runs the steps, the definition."""
    kernels = quantize_kernels()
    n = x.shape[0]
    if kernels is None or x.numel() == 0 or not 1 <= bits <= 8:
        return None
    if start is not None and (start.dtype != torch.uint8 or tuple(start.shape) != (n, 2)):
        raise ValueError(f"range_search: start must be uint8 of shape ({n}, 2), got {start.dtype} {tuple(start.shape)}")
    plan = search_schedule(bits)
    s = torch.empty(0, 2, dtype=torch.uint8) if start is None else start.contiguous()
    none = torch.empty(0, dtype=torch.bool)
    k, ks, kb = (none, none.half(), none.half()) if kept is None or start is None else (
        kept.kept.contiguous(), kept.scale.contiguous(), kept.bias.contiguous())
    found, scale, bias, codes = kernels.search_pack(x.float().contiguous(), bits, bins, int(bins * ratio), plan.move,
                                                    plan.patience, plan.refine, s, plan.warm, plan.fits, plan.cold_fits,
                                                    k, ks, kb)
    return found, scale, bias, memoryview(codes.numpy())


def _pair_errors(xt: torch.Tensor, width: torch.Tensor, lo_a: torch.Tensor, lo_b: torch.Tensor, levels: int,
                 buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared errors of the ranges of width ``width`` starting at ``lo_a`` and at ``lo_b``."""
    s = _scale(width, levels)
    inv = 1.0 / s
    xs = xt * inv.unsqueeze(0)
    ss = s * s
    return _scaled_sq_error(xs, lo_a * inv, levels, buf) * ss, _scaled_sq_error(xs, lo_b * inv, levels, buf) * ss


def _refit(xt: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One least-squares refit of each row's range [lo, hi] (``xt``: the block transposed,
    ``[d, n]``). The row's codes on it, ``c = round(clamp(t, 0, levels))`` with ``t`` the values in
    units of the scale from ``lo``, are held, and the line ``t ~ alpha + beta * c`` of least
    squares gives the offset ``lo + s * alpha`` and scale ``s * beta`` of lowest error for those
    codes: a Lloyd step for an evenly spaced grid. The error never grows (the refit lowers it
    for the old codes, and each value's nearest code on the new range lowers it again), and
    from a range near the best one step lands about as close as a search of eight ranges.
    Sums of ``e = c - t``, ``c``, ``c * c`` and ``e * c`` per row in float32 over its columns in
    order (as the native kernel sums them); a row whose codes are all equal, or whose fit does
    not widen (``beta <= 0``), keeps its range."""
    s = _scale(hi - lo, levels)
    inv = 1.0 / s
    t = xt * inv.unsqueeze(0) - (lo * inv).unsqueeze(0)
    c = t.clamp(0.0, float(levels)).round_()
    e = c - t
    se, s1, s2, sec = (torch.zeros_like(lo) for _ in range(4))  # 0 + v is v exactly
    for ej, cj in zip(e, c):
        se.add_(ej)
        s1.add_(cj)
        s2.add_(cj * cj)
        sec.add_(ej * cj)
    nd = float(xt.shape[0])
    det = nd * s2 - s1 * s1
    beta = 1.0 - (nd * sec - s1 * se) / det
    alpha = ((s1 - se) - beta * s1) / nd
    ok = (det > 0) & (beta > 0)
    new_lo = torch.where(ok, lo + s * alpha, lo)
    return new_lo, torch.where(ok, new_lo + (s * beta) * float(levels), hi)


@dataclass
class _Best:
    """Per row the best range seen, its error, and its steps in from min and from max (floats)."""

    err: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    k_lo: torch.Tensor
    k_hi: torch.Tensor


def _refine_round(xt: torch.Tensor, step: torch.Tensor, b: _Best, levels: int, bins: int, m: int, bounded: bool,
                  buf: torch.Tensor) -> bool:
    """The best range moved by ``m`` steps at either end, inward and outward, where that is
    better; ``bounded``: inward only while the range keeps a step (k_lo + k_hi + m < bins).
    Returns whether any row found a better range."""
    base_lo, base_hi, kl, kh = b.lo, b.hi, b.k_lo, b.k_hi
    st = step * float(m)
    width = base_hi - base_lo
    in_lo, out_lo = base_lo + st, base_lo - st
    e_a, e_b = _pair_errors(xt, width - st, in_lo, base_lo, levels, buf)
    e_c, e_d = _pair_errors(xt, width + st, out_lo, base_lo, levels, buf)
    inward = (kl + kh + float(m) < float(bins)) if bounded else torch.ones_like(kl, dtype=torch.bool)
    any_better = torch.zeros_like(inward)
    for e, c_lo, c_hi, c_kl, c_kh, ok in ((e_a, in_lo, base_hi, kl + m, kh, inward),
                                          (e_b, base_lo, base_hi - st, kl, kh + m, inward),
                                          (e_c, out_lo, base_hi, kl - m, kh, None),
                                          (e_d, base_lo, base_hi + st, kl, kh - m, None)):
        better = e < b.err if ok is None else ok & (e < b.err)
        b.err = torch.where(better, e, b.err)
        b.lo = torch.where(better, c_lo, b.lo)
        b.hi = torch.where(better, c_hi, b.hi)
        b.k_lo = torch.where(better, c_kl, b.k_lo)
        b.k_hi = torch.where(better, c_kh, b.k_hi)
        any_better |= better
    return bool(any_better.any())


def _search_block(
    x: torch.Tensor, levels: int, bins: int, steps: int, plan: SearchSchedule, start: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The search of a block of rows, all cold (``start`` None) or all warm from ``start``
    (float ``[n, 2]``): best lo, hi and their steps in from min and max."""
    xt = x.t().contiguous()
    buf = torch.empty_like(xt)
    mn, mx = x.amin(1), x.amax(1)
    step = (mx - mn) / bins
    if start is None:
        b = _greedy_block(xt, mn, mx, step, levels, bins, steps, plan, buf)
        return _refit_best(xt, b, mn, mx, step, levels, plan.cold_fits)
    k_lo, k_hi = start[:, 0].contiguous(), start[:, 1].contiguous()
    lo, hi = mn + k_lo * step, mx - k_hi * step
    b = _Best(torch.zeros_like(lo), lo, hi, k_lo, k_hi)
    if plan.warm:
        s = _scale(hi - lo, levels)
        inv = 1.0 / s
        b.err = _scaled_sq_error(xt * inv.unsqueeze(0), lo * inv, levels, buf) * (s * s)
        last, moved = 0, True
        for m in plan.warm:
            if m == last and not moved:
                continue  # it would try the same ranges again
            moved, last = _refine_round(xt, step, b, levels, bins, m, True, buf), m
    return _refit_best(xt, b, mn, mx, step, levels, plan.fits)


def _refit_best(xt: torch.Tensor, b: _Best, mn: torch.Tensor, mx: torch.Tensor, step: torch.Tensor, levels: int,
                fits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fits`` refits of each row's best range, then its steps in from [min, max] rounded to
    whole steps (half to even; a constant row, whose step is 0, keeps its steps)."""
    if fits <= 0:
        return b.lo, b.hi, b.k_lo, b.k_hi
    lo, hi = b.lo, b.hi
    for _ in range(fits):
        lo, hi = _refit(xt, lo, hi, levels)
    moves = step > 0
    return (lo, hi, torch.where(moves, ((lo - mn) / step).round(), b.k_lo),
            torch.where(moves, ((mx - hi) / step).round(), b.k_hi))


def _greedy_block(
    xt: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, step: torch.Tensor, levels: int, bins: int, steps: int,
    plan: SearchSchedule, buf: torch.Tensor
) -> _Best:
    """The cold search of a transposed block ``xt`` from its rows' [min, max] = [lo, hi]."""
    stride = step * float(plan.move)
    s = _scale(hi - lo, levels)
    inv = 1.0 / s
    zero = torch.zeros_like(lo)
    b = _Best(_scaled_sq_error(xt * inv.unsqueeze(0), lo * inv, levels, buf) * (s * s), lo.clone(), hi.clone(),
              zero, zero)
    kl, kh = zero, zero
    bad = torch.zeros_like(lo, dtype=torch.int64)
    for _ in range(steps // plan.move):
        alive = bad < plan.patience
        if not bool(alive.any()):
            break
        # Both moves leave a range of width (hi - lo) - stride: one scale for the pair.
        cand_lo, cand_hi = lo + stride, hi - stride
        e_lo, e_hi = _pair_errors(xt, (hi - lo) - stride, cand_lo, lo, levels, buf)
        take_lo = e_lo < e_hi
        lo = torch.where(alive & take_lo, cand_lo, lo)
        hi = torch.where(alive & ~take_lo, cand_hi, hi)
        kl = torch.where(alive & take_lo, kl + plan.move, kl)
        kh = torch.where(alive & ~take_lo, kh + plan.move, kh)
        err = torch.where(e_hi < e_lo, e_hi, e_lo)
        better = alive & (err < b.err)
        b.err = torch.where(better, err, b.err)
        b.lo = torch.where(better, lo, b.lo)
        b.hi = torch.where(better, hi, b.hi)
        b.k_lo = torch.where(better, kl, b.k_lo)
        b.k_hi = torch.where(better, kh, b.k_hi)
        bad = torch.where(better, 0, torch.where(alive, bad + 1, bad))
    for _ in range(plan.refine):
        _refine_round(xt, step, b, levels, bins, 1, False, buf)
    return b


# ---------------------------------------------------------------------- mixed widths
WIDTHS = (2, 3, 4, 8)  # a row's 2-bit tag t means WIDTHS[t] bits per value
IMPORTANCE_STATES = ("sum_sq", "exp_avg_sq")  # optimizer state read as a row's weight, first found


def row_importance(state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Per row, the square root of the mean of its accumulated squared gradients (Adagrad's
    ``sum_sq``, Adam's ``exp_avg_sq``): how much loss an error in the row costs. A row's step
    gradient sums its samples in the batch, so the accumulated square grows with the square of
    how often the row is used; the root grows with it, as the row's share of the loss does (it
    measured better than the plain sum). None when the optimizer keeps no such state."""
    for name in IMPORTANCE_STATES:
        if name in state:
            return state[name].float().mean(1).sqrt()
    return None


def allocate_widths(ranges: torch.Tensor, importance: torch.Tensor | None, cols: torch.Tensor | int,
                    bits: int) -> torch.Tensor:
    """Per row a tag into ``WIDTHS``, spending at most ``bits`` per value over all the rows given
    (rows of any tables: ``cols`` per row, and ``ranges``, each row's max - min).

    A row's expected loss from rounding is about importance x cols x (range / levels)^2 / 12.
    Every row starts at 2 bits; each upgrade (2 to 3, 3 to 4, 4 to 8 bits) lowers that by a known
    amount for a known number of bits, less per bit at each later upgrade of the same row, so
    taking upgrades in order of gain per bit until the budget is spent is the greedy optimum and
    each row's taken upgrades are its first ones. Ties keep row order (a stable sort)."""
    n = ranges.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8)
    r = ranges.double().reshape(-1)
    w = r * r if importance is None else importance.double().clamp(min=0).reshape(-1) * r * r
    c = torch.as_tensor(cols, dtype=torch.int64).expand(n)
    levels = [float((1 << b) - 1) for b in WIDTHS]
    # the cols of a row's loss and of its cost cancel in the gain per bit
    gains = torch.cat([w * ((1 / levels[k] ** 2 - 1 / levels[k + 1] ** 2) / (WIDTHS[k + 1] - WIDTHS[k]))
                       for k in range(len(WIDTHS) - 1)])
    cost = torch.cat([c * (WIDTHS[k + 1] - WIDTHS[k]) for k in range(len(WIDTHS) - 1)])
    order = torch.sort(gains, descending=True, stable=True).indices
    spent = torch.cumsum(cost[order], 0)
    budget = int(c.sum()) * (bits - WIDTHS[0])
    take = int(torch.searchsorted(spent, torch.tensor([budget]), right=True))
    return torch.bincount(order[:take] % n, minlength=n).to(torch.uint8)


def _mixed_nbytes(tags: torch.Tensor, d: int) -> int:
    """Scales and offsets, tags, then each width's codes (each group padded to a byte)."""
    counts = torch.bincount(tags.long(), minlength=len(WIDTHS)).tolist()
    return 4 * tags.numel() + _packed_bytes(tags.numel(), 2) + sum(
        _packed_bytes(k * d, w) for k, w in zip(counts, WIDTHS))


def mixed_tags(buf: bytes | memoryview, n: int) -> torch.Tensor:
    """The width tags of a ``mixed`` block of ``n`` rows (ValueError if ``buf`` is too short)."""
    if len(buf) < 4 * n + _packed_bytes(n, 2):
        raise ValueError("sizes")
    return torch.from_numpy(unpack_bits(buf[4 * n : 4 * n + _packed_bytes(n, 2)], 2, n))


def _encode_mixed(x: torch.Tensor, tags: torch.Tensor | None) -> bytes:
    """Scales, offsets, tags, then each width's rows (in row order) packed together, widest first."""
    n = x.shape[0]
    if tags is None:
        tags = allocate_widths(x.amax(1) - x.amin(1), None, x.shape[1], 3) if n else torch.zeros(0, dtype=torch.uint8)
    scale, bias = torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.float16)
    groups = []
    for t in reversed(range(len(WIDTHS))):
        rows = torch.nonzero(tags == t).reshape(-1)
        if rows.numel():
            xs = x.index_select(0, rows)
            s, b, codes = quantize_packed(xs, xs.amin(1), xs.amax(1), WIDTHS[t])
            scale[rows], bias[rows] = s, b
            groups.append(codes)
    return tensor_bytes(scale) + tensor_bytes(bias) + pack_bits(tags.numpy(), 2) + b"".join(groups)


def _decode_mixed(buf: bytes | memoryview, n: int, d: int) -> torch.Tensor:
    tags = mixed_tags(buf, n)
    if len(buf) != _mixed_nbytes(tags, d):
        raise ValueError("sizes")
    scale = bytes_tensor(buf[: 2 * n], torch.float16, (n, 1)).float()
    bias = bytes_tensor(buf[2 * n : 4 * n], torch.float16, (n, 1)).float()
    pos = 4 * n + _packed_bytes(n, 2)
    q = torch.zeros(n, d)
    for t in reversed(range(len(WIDTHS))):
        rows = torch.nonzero(tags == t).reshape(-1)
        if rows.numel():
            size = _packed_bytes(rows.numel() * d, WIDTHS[t])
            codes = unpack_bits(buf[pos : pos + size], WIDTHS[t], rows.numel() * d)
            q[rows] = torch.from_numpy(codes.astype(np.float32)).reshape(-1, d)
            pos += size
    return q * scale + bias


# ---------------------------------------------------------------------- bytes
def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def bytes_tensor(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = np.frombuffer(buf, dtype=np.uint8).copy()
    if raw.size == 0:  # numpy gives an empty array stride 0, which torch cannot view as wider types
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _packed_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def pack_bits(q: np.ndarray, bits: int) -> bytes:
    """Pack uint8 codes < 2**bits densely, little-endian within each byte."""
    q = q.reshape(-1).astype(np.uint8)
    if bits == 8:
        return q.tobytes()
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-q.size) % per
        if pad:
            q = np.concatenate([q, np.zeros(pad, np.uint8)])
        q = q.reshape(-1, per)
        out = np.zeros(q.shape[0], np.uint8)
        for j in range(per):
            out |= q[:, j] << np.uint8(bits * j)
        return out.tobytes()
    bitplanes = ((q[:, None] >> np.arange(bits, dtype=np.uint8)) & 1).astype(np.uint8)
    return np.packbits(bitplanes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(buf: bytes | memoryview, bits: int, count: int) -> np.ndarray:
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw[:count].copy()
    if 8 % bits == 0:
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.stack([(raw >> np.uint8(bits * j)) & mask for j in range(per)], axis=1).reshape(-1)
        return out[:count]
    planes = np.unpackbits(raw, bitorder="little", count=count * bits).reshape(count, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(1).astype(np.uint8)


CODEC_METHODS = ("none", "fp16", "bf16", "uniform", "adaptive", "mixed")


def make_codec(method: str, storage_dtype: str, bits: int = 8, bins: int = 25, ratio: float = 0.6) -> Codec:
    if method not in CODEC_METHODS:
        raise ValueError(f"quantization '{method}' is unknown; choose none, fp16, bf16, uniform, adaptive or mixed")
    return Codec(method, storage_dtype, bits, bins, ratio)


def state_codec(precision: str) -> Codec:
    """Optimizer state: float32 kept, or rounded to fp16/bf16."""
    return Codec("none", precision) if precision == "fp32" else Codec(precision)
