"""Vectorised column decoding and feature transforms for ``prepare`` (no per-row Python).

Raw categorical values become uint64 keys (hex parsed, integers reinterpreted, strings hashed
with FNV-1a over the string buffer), then ids: hashed to a table, looked up in a vocabulary, or
taken as they are. Every decoder returns a ``bad`` mask instead of raising, so the caller can
name the file and line of the first bad row, or count and drop the bad rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recscale.data.schema import DenseFeature, SparseFeature

_NIBBLE = np.full(256, -1, dtype=np.int16)
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _NIBBLE[_c] = 10 + _i
_NIBBLE_U8 = np.where(_NIBBLE < 0, 255, _NIBBLE).astype(np.uint8)
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_INT_RE = r"^\s*[-+]?\d+\s*$"
_FLOAT_RE = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$|^\s*$"


@dataclass
class RawSparse:
    """One sparse column of a block: uint64 keys, per-row lengths, bad rows.

    A one-id column keeps one key per row (``present`` False where the value is missing: it
    becomes id 0, the row reserved for "missing"); a list column drops missing items, so a
    missing list is an empty bag."""

    keys: np.ndarray  # uint64 [sum(lengths)]
    lengths: np.ndarray  # int64 [n]
    bad: np.ndarray  # bool [n]
    problem: str = ""
    present: np.ndarray | None = None  # bool [n], one-id columns only


def _string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int64 offsets [n + 1], uint8 data) of a string array, respecting its slice offset."""
    arr = arr.cast(pa.large_string()) if arr.type == pa.string() else arr
    if arr.null_count:
        arr = pc.fill_null(arr, "")
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return offsets, data


def _hex8(data: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exactly-8-digit hex strings (Criteo's case) at ``starts``: (uint64 values, bad mask).
    Nibbles are paired into bytes and read as big-endian uint32, a few passes over uint8 data."""
    nib = np.ascontiguousarray(_NIBBLE_U8[data[starts[:, None] + np.arange(8)]])
    bad = (nib.view(np.uint64).ravel() & np.uint64(0xF0F0F0F0F0F0F0F0)) != 0  # a 255 (non-hex) anywhere
    packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])
    return packed.view(">u4").ravel().astype(np.uint64), bad


def decode_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hex strings -> (uint64 values, present mask, bad mask). Empty = missing; more than 16
    digits or a non-hex character = bad."""
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    n = lengths.size
    values = np.zeros(n, dtype=np.uint64)
    bad = lengths > 16
    eight = lengths == 8
    if eight.all() and n:
        values, bad = _hex8(data, offsets[:-1])
    elif eight.any():
        rows = np.flatnonzero(eight)
        values[rows], bad[rows] = _hex8(data, offsets[:-1][rows])
    other = np.flatnonzero(~eight & (lengths > 0) & (lengths <= 16))
    if other.size:  # any other width: digit by digit over the rows that need it
        sub_off = offsets[:-1][other]
        sub_len = lengths[other]
        width = int(sub_len.max())
        pos = np.arange(width, dtype=np.int64)
        mask = pos[None, :] < sub_len[:, None]
        nib = _NIBBLE[data[np.where(mask, sub_off[:, None] + pos[None, :], 0)]]
        bad[other] = ((nib < 0) & mask).any(axis=1)
        nib = np.where(mask, nib, 0).astype(np.uint64)
        v = np.zeros(other.size, dtype=np.uint64)
        for j in range(width):
            v = np.where(mask[:, j], (v << np.uint64(4)) | nib[:, j], v)
        values[other] = v
    present = (lengths > 0) & ~bad
    values[~present] = 0
    return values, present, bad


def hash_strings(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Strings -> (uint64 FNV-1a hashes, present mask); empty or null = missing."""
    offsets, data = _string_buffers(arr)
    lengths = np.diff(offsets)
    h = np.full(lengths.size, _FNV_OFFSET, dtype=np.uint64)
    width = int(lengths.max(initial=0))
    if width:
        # Column by column over the byte matrix, in slabs so long strings stay cheap in memory.
        for start in range(0, width, 32):
            w = min(32, width - start)
            sub = offsets[:-1] + start
            sub_len = np.clip(lengths - start, 0, w)
            pos = np.arange(w, dtype=np.int64)
            mask = pos[None, :] < sub_len[:, None]
            idx = np.where(mask, sub[:, None] + pos[None, :], 0)
            b = data[idx].astype(np.uint64)
            with np.errstate(over="ignore"):
                for j in range(w):
                    h = np.where(mask[:, j], (h ^ b[:, j]) * _FNV_PRIME, h)
    return h, lengths > 0


def parse_ints(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int64 column or integer strings -> (int64 values, present mask, bad mask)."""
    if pa.types.is_integer(arr.type):
        present = ~np.asarray(arr.is_null(), dtype=bool)
        return np.asarray(pc.fill_null(arr, 0).cast(pa.int64()), dtype=np.int64), present, np.zeros(len(arr), bool)
    if pa.types.is_floating(arr.type):
        f = np.asarray(pc.fill_null(arr, 0.0), dtype=np.float64)
        present = ~np.asarray(arr.is_null(), dtype=bool)
        bad = present & ((f != np.round(f)) | ~np.isfinite(f))
        return np.where(bad, 0, f).astype(np.int64), present & ~bad, bad
    arr = pc.fill_null(arr.cast(pa.string()), "")
    empty = np.asarray(pc.equal(pc.utf8_length(arr), 0), dtype=bool)
    ok = np.array(pc.match_substring_regex(arr, _INT_RE), dtype=bool)
    long = ok & (np.asarray(pc.utf8_length(pc.utf8_trim_whitespace(arr))) > 18)
    for i in np.flatnonzero(long):  # rare: more digits than an int64 surely holds; check the range
        ok[i] = -(1 << 63) <= int(arr[int(i)].as_py()) < 1 << 63
    bad = ~ok & ~empty
    clean = pc.if_else(pa.array(ok), pc.utf8_trim_whitespace(arr), pa.scalar("0"))
    return np.asarray(clean.cast(pa.int64()), dtype=np.int64), ok, bad


def parse_floats(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A numeric column or numeric strings -> (float64 values, present mask, bad mask).
    Non-finite numbers are bad (a log transform or a loss would silently turn them into NaN)."""
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        arr = pc.fill_null(arr, "")
        ok = np.asarray(pc.match_substring_regex(arr, _FLOAT_RE), dtype=bool)
        arr = pc.if_else(pa.array(ok), pc.utf8_trim_whitespace(arr), pa.scalar(""))
        arr = pc.if_else(pc.equal(arr, ""), pa.scalar(None, pa.string()), arr)
        bad_text = ~ok
    else:
        bad_text = np.zeros(len(arr), bool)
    present = ~np.asarray(arr.is_null(), dtype=bool)
    f = np.asarray(pc.fill_null(arr.cast(pa.float64()), 0.0), dtype=np.float64)
    bad = bad_text | (present & ~np.isfinite(f))
    return np.where(bad, 0.0, f), present & ~bad, bad


def decode_scalar(arr: pa.Array, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One value per row -> (uint64 keys, present, bad)."""
    if kind == "hex":
        return decode_hex(arr)
    if kind == "int":
        v, present, bad = parse_ints(arr)
        return v.astype(np.uint64), present, bad
    if pa.types.is_integer(arr.type):
        arr = arr.cast(pa.string())
    h, present = hash_strings(arr)
    return h, present, np.zeros(len(arr), bool)


def decode_sparse(arr: pa.Array, feat: SparseFeature) -> RawSparse:
    """A sparse column (scalar, separator-joined text, or a list column) -> keys and lengths."""
    n = len(arr)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not feat.is_list and not pa.types.is_list(arr.type) and not pa.types.is_large_list(arr.type):
        keys, present, bad = decode_scalar(arr, feat.kind)
        problem = f"{feat.kind} value"
        return RawSparse(keys, np.ones(n, dtype=np.int64), bad, problem, present)
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        arr = pc.split_pattern(pc.fill_null(arr, ""), feat.list_separator or ",")
    elif not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        arr = pa.array(np.asarray(arr).reshape(-1, 1).tolist())  # a scalar column declared multi-hot
    arr = pc.fill_null(arr, pa.scalar([], arr.type)) if arr.null_count else arr
    parents = np.asarray(pc.list_parent_indices(arr), dtype=np.int64)
    flat = pc.list_flatten(arr)
    keys, present, bad_items = decode_scalar(flat, feat.kind)
    bad = np.zeros(n, bool)
    bad[parents[bad_items]] = True
    keep = present & ~bad[parents]
    lengths = np.bincount(parents[keep], minlength=n).astype(np.int64)
    return RawSparse(keys[keep], lengths, bad, f"{feat.kind} list item")


def transform_dense(values: np.ndarray, present: np.ndarray, feat: DenseFeature) -> np.ndarray:
    """Missing -> fill; with ``log``: negatives clipped to 0, then log(1 + x) (float64, then float32)."""
    v = np.where(present, values, feat.fill)
    if feat.log:
        v = np.log1p(np.maximum(v, 0.0))
    return v.astype(np.float32)


def hash_ids(keys: np.ndarray, table_rows: int) -> np.ndarray:
    """``1 + key mod (rows - 1)``, keeping id 0 for "missing" (as ``read_criteo_tsv`` does)."""
    if table_rows <= 1:
        return np.zeros(keys.size, dtype=np.int64)
    return (keys % np.uint64(table_rows - 1)).astype(np.int64) + 1


def vocab_ids(keys: np.ndarray, vocab: np.ndarray) -> np.ndarray:
    """Ids from a sorted uint64 vocabulary: ``2 + position`` when found, 1 (rare) otherwise."""
    if vocab.size == 0:
        return np.ones(keys.size, dtype=np.int64)
    pos = np.searchsorted(vocab, keys)
    pos_c = np.minimum(pos, vocab.size - 1)
    found = vocab[pos_c] == keys
    return np.where(found, pos_c + 2, 1).astype(np.int64)


def count_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct uint64 keys and their counts (the vocabulary pass)."""
    return np.unique(keys, return_counts=True)


def merge_counts(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Sum two (sorted keys, counts) tables (the vocabulary pass; exact, no pruning)."""
    from recscale.data.stats import merge_sorted_counts

    return merge_sorted_counts(a[0], a[1].astype(np.int64), b[0], b[1].astype(np.int64))
