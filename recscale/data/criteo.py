"""Readers for Criteo click logs: the raw Kaggle/1TB TSV and the pre-encoded CSV.

Both parse a whole (small) file into memory. A malformed row is an error naming the file and
line, or, with ``skip_bad_rows``, counted and skipped; it is never silently mis-parsed.
Large logs go through columnar preparation instead (a later layer).
"""

from __future__ import annotations

import gzip
import io
import math
import re
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from recscale.data.errors import DataFormatError, shown

# Raw keys stay below 2^62 (an id is an int64); Criteo's 8-digit hashes are far below it.
_RAW_KEYS = 1 << 62
NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = tuple(f"I{i + 1}" for i in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"C{i + 1}" for i in range(NUM_SPARSE))


@dataclass
class ClickData:
    """A click log in memory: one id per sparse feature per sample."""

    dense: np.ndarray  # float32 [N, num_dense]
    sparse: np.ndarray  # int64 [N, num_sparse]
    labels: np.ndarray  # float32 [N]
    dense_names: tuple[str, ...] = DENSE_NAMES
    sparse_names: tuple[str, ...] = SPARSE_NAMES
    skipped_rows: int = 0
    source: str = ""
    skipped_examples: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> ClickData:
        return ClickData(
            self.dense[start:stop],
            self.sparse[start:stop],
            self.labels[start:stop],
            self.dense_names,
            self.sparse_names,
            0,
            self.source,
        )


# The field grammar ``recscale data prepare`` uses (recscale.data.transforms), so both readers
# accept and refuse the same rows: Python's float() and int(x, 16) alone would also take
# "1_0", "0x1f", " 1f" or non-ASCII digits.
_WS = "[\t\n\f\r ]*"
_NUMBER = re.compile(rf"{_WS}[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?{_WS}", re.ASCII)
_BLANK = re.compile(_WS)
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_INT = re.compile(rf"{_WS}[-+]?[0-9]+{_WS}")


def _open_binary(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # type: ignore[return-value]


def _lines(path: Path, rows: _Rows) -> Iterator[tuple[int, str]]:
    """(1-based line, text) of each non-empty line. A line that is not UTF-8 text is a bad row;
    a truncated or damaged gzip stream is an error naming the file. A lone carriage return
    ends a line too (as in ``prepare``'s CSV parser)."""
    lineno = 0
    with _open_binary(path) as f:
        try:
            for lineno, raw in enumerate(f, start=1):
                for part in raw.rstrip(b"\r\n").split(b"\r"):
                    if not part:
                        continue
                    try:
                        yield lineno, part.decode("utf-8")
                    except UnicodeDecodeError as e:
                        rows.bad(lineno, f"the line is not UTF-8 text (byte 0x{part[e.start]:02x} at character "
                                         f"{e.start + 1}): is this a binary file?")
        except (EOFError, OSError, zlib.error) as e:
            raise DataFormatError(
                f"{path}: the gzip stream is truncated or damaged after line {lineno} ({e}); "
                "download or compress the file again"
            ) from None
    rows.lines = lineno


class _Rows:
    """Collects parsed rows and bad-row bookkeeping for one file."""

    def __init__(self, path: Path, skip_bad_rows: bool) -> None:
        self.path, self.skip = path, skip_bad_rows
        self.dense: list[list[float]] = []
        self.sparse: list[list[int]] = []
        self.labels: list[float] = []
        self.skipped = 0
        self.examples: list[str] = []
        self.lines = 0  # lines in the file (set when it was read to its end)

    def bad(self, lineno: int, problem: str) -> None:
        msg = f"{self.path.name}:{lineno}: {problem}"
        if not self.skip:
            raise DataFormatError(msg + " (set data.skip_bad_rows = true to skip such rows)")
        self.skipped += 1
        if len(self.examples) < 5:
            self.examples.append(msg)

    def result(self, num_dense: int, num_sparse: int) -> ClickData:
        if not self.labels:
            self._refuse_empty()
        return ClickData(
            dense=np.log1p(np.asarray(self.dense, dtype=np.float64).reshape(-1, num_dense)).astype(np.float32),
            sparse=np.asarray(self.sparse, dtype=np.int64).reshape(-1, num_sparse),
            labels=np.asarray(self.labels, dtype=np.float32),
            skipped_rows=self.skipped,
            source=str(self.path),
            skipped_examples=self.examples,
        )


    def _refuse_empty(self) -> None:
        p = self.path
        if self.skipped:
            raise DataFormatError(
                f"data file '{p}' has no valid rows: all {self.skipped:,} rows are bad and were skipped, "
                f"e.g. {self.examples[0]}"
            )
        if self.lines == 0:
            raise DataFormatError(f"data file '{p}' is empty; give a file with data rows")
        raise DataFormatError(f"data file '{p}' has no data rows (only {self.lines:,} empty lines)")


def _check_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file '{p}' does not exist")
    return p


def _check_table_rows(table_rows: Sequence[int] | None) -> None:
    if table_rows is not None and len(table_rows) != NUM_SPARSE:
        raise ValueError(f"table_rows: expected {NUM_SPARSE} row counts (C1..C26), got {len(table_rows)}")


def read_criteo_tsv(
    path: str | Path,
    table_rows: Sequence[int] | None,
    skip_bad_rows: bool = False,
    max_rows: int | None = None,
    has_label: bool = True,
) -> ClickData:
    """Raw Criteo TSV: label, I1..I13 integers, C1..C26 8-hex-digit hashes; empty = missing.

    Dense: missing -> 0, negatives clipped to 0, then log(1 + x). Categorical: missing -> id 0;
    otherwise ``1 + int(hex, 16) % (rows - 1)`` so id 0 stays reserved for "missing". With
    ``table_rows = None`` the ids are ``1 + int(hex, 16)`` (raw keys, for ``vocab_encode``).
    """
    p = _check_path(path)
    _check_table_rows(table_rows)
    mods = [max(int(r) - 1, 1) for r in table_rows] if table_rows is not None else [_RAW_KEYS] * NUM_SPARSE
    ncols = (1 if has_label else 0) + NUM_DENSE + NUM_SPARSE
    first_dense = 1 if has_label else 0
    rows = _Rows(p, skip_bad_rows)
    for lineno, line in _lines(p, rows):
        if max_rows is not None and len(rows.labels) >= max_rows:
            break
        cols = line.split("\t")
        if len(cols) != ncols:
            rows.bad(lineno, f"expected {ncols} tab-separated columns (label, 13 dense, 26 categorical), got {len(cols)}")
            continue
        label = 0.0
        if has_label:
            label = float(cols[0]) if _NUMBER.fullmatch(cols[0]) else -1.0
            if label not in (0.0, 1.0):
                rows.bad(lineno, f"label must be 0 or 1, got {shown(cols[0])}")
                continue
        dense = []
        problem = None
        for j in range(NUM_DENSE):
            text = cols[first_dense + j]
            if _BLANK.fullmatch(text):
                dense.append(0.0)
                continue
            v = float(text) if _NUMBER.fullmatch(text) else math.nan
            if not math.isfinite(v):
                problem = f"dense feature {DENSE_NAMES[j]} must be a finite number, got {shown(text)}"
                break
            dense.append(max(v, 0.0))
        if problem:
            rows.bad(lineno, problem)
            continue
        sparse = []
        for j in range(NUM_SPARSE):
            text = cols[first_dense + NUM_DENSE + j]
            if not text:
                sparse.append(0)
                continue
            if not _HEX.fullmatch(text):
                problem = (f"categorical feature {SPARSE_NAMES[j]} must be a hex value of 1 to 16 digits, "
                           f"got {shown(text)}")
                break
            h = int(text, 16)
            sparse.append(1 + h % mods[j] if table_rows is None or table_rows[j] > 1 else 0)
        if problem:
            rows.bad(lineno, problem)
            continue
        rows.dense.append(dense)
        rows.sparse.append(sparse)
        rows.labels.append(label)
    return rows.result(NUM_DENSE, NUM_SPARSE)


def vocab_encode(train: ClickData, others: Sequence[ClickData] = ()) -> list[int]:
    """Replace raw keys (``read_criteo_tsv(..., table_rows=None)``) by vocabulary ids, in place:
    each feature's distinct training values get ids 2.. in value order, values not seen in
    training id 1, missing stays 0 (as ``recscale data prepare``'s ``vocab`` transform does).
    Returns each feature's table rows (2 + its vocabulary)."""
    from recscale.data.transforms import vocab_ids

    rows = []
    for j in range(train.sparse.shape[1]):
        vocab = np.unique(train.sparse[:, j][train.sparse[:, j] > 0]).astype(np.uint64)
        for data in (train, *others):
            keys = data.sparse[:, j]
            data.sparse[:, j] = np.where(keys > 0, vocab_ids(keys.astype(np.uint64), vocab), 0)
        rows.append(2 + int(vocab.size))
    return rows


def read_encoded_csv(
    path: str | Path,
    table_rows: Sequence[int] | None = None,
    skip_bad_rows: bool = False,
) -> ClickData:
    """Pre-encoded Criteo CSV: 40 integers per row (label, 13 bucketised dense, 26 ids from 0).

    Dense values become log(1 + max(x, 0)). With ``table_rows``, an id outside its table is a
    bad row (named by file, line and feature).
    """
    p = _check_path(path)
    _check_table_rows(table_rows)
    ncols = 1 + NUM_DENSE + NUM_SPARSE
    if p.suffix != ".gz":
        fast = _encoded_fast(p, ncols)
        if fast is not None and _encoded_ids_ok(fast, table_rows):
            return ClickData(
                dense=np.log1p(np.maximum(fast[:, 1 : 1 + NUM_DENSE], 0)).astype(np.float32),
                sparse=np.ascontiguousarray(fast[:, 1 + NUM_DENSE :]),
                labels=fast[:, 0].astype(np.float32),
                source=str(p),
            )
    rows = _Rows(p, skip_bad_rows)
    for lineno, line in _lines(p, rows):
        cols = line.split(",")
        if len(cols) != ncols:
            rows.bad(lineno, f"expected {ncols} comma-separated columns (label, 13 dense, 26 categorical), got {len(cols)}")
            continue
        bad = next((c for c in cols if not _INT.fullmatch(c)), None)
        if bad is not None:
            rows.bad(lineno, f"every column must be an integer, got {shown(bad)}")
            continue
        values = [int(c) for c in cols]
        huge = next((c for c, v in zip(cols, values) if not -(1 << 63) <= v < 1 << 63), None)
        if huge is not None:
            rows.bad(lineno, f"{shown(huge)} is outside the 64-bit integer range")
            continue
        if values[0] not in (0, 1):
            rows.bad(lineno, f"label must be 0 or 1, got {values[0]}")
            continue
        ids = values[1 + NUM_DENSE :]
        if table_rows is None:
            out = [(j, v) for j, v in enumerate(ids) if v < 0]
            if out:
                j, v = out[0]
                rows.bad(lineno, f"categorical feature {SPARSE_NAMES[j]}: id {v} is negative (ids start at 0)")
                continue
        else:
            out = [(j, v) for j, v in enumerate(ids) if not 0 <= v < table_rows[j]]
            if out:
                j, v = out[0]
                rows.bad(
                    lineno,
                    f"categorical feature {SPARSE_NAMES[j]}: id {v} is outside its table of {table_rows[j]} rows "
                    f"(raise model.table_rows for {SPARSE_NAMES[j]})",
                )
                continue
        rows.labels.append(float(values[0]))
        rows.dense.append([float(max(v, 0)) for v in values[1 : 1 + NUM_DENSE]])
        rows.sparse.append(ids)
    return rows.result(NUM_DENSE, NUM_SPARSE)


def _encoded_fast(p: Path, ncols: int) -> np.ndarray | None:
    """Whole-file parse with NumPy; None when any row is malformed (then the slow path names it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file: the slow path says so
            # No comment character: a line starting with '#' is a bad row, not a skipped one.
            arr = np.loadtxt(p, delimiter=",", dtype=np.int64, ndmin=2, comments=None)
    except (ValueError, OverflowError):
        return None
    if arr.shape[1] != ncols or arr.size == 0:
        return None
    if not np.isin(arr[:, 0], (0, 1)).all():
        return None
    return arr


def _encoded_ids_ok(arr: np.ndarray, table_rows: Sequence[int] | None) -> bool:
    ids = arr[:, 1 + NUM_DENSE :]
    if table_rows is None:
        return bool((ids >= 0).all())
    return bool(((ids >= 0) & (ids < np.asarray(table_rows, dtype=np.int64))).all())
