"""One block of input rows -> clean, transformed columns (runs in ``prepare``'s worker processes).

A block is a run of whole text lines (Criteo TSV or CSV, parsed by ``pyarrow.csv``) or a
Parquet record batch. Parsing is vectorised: a typed read first; only when pyarrow cannot
convert a column is the block re-read as strings and checked column by column, so a bad row is
found, named by file and line, and either reported or dropped, never mis-parsed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recscale.data.errors import DataFormatError, shown
from recscale.data.schema import DataSchema, SparseFeature
from recscale.data.transforms import (
    RawSparse,
    decode_sparse,
    hash_ids,
    parse_floats,
    transform_dense,
    vocab_ids,
)

SKIP_HINT = " (pass --skip-bad-rows to count and skip such rows)"
MAX_EXAMPLES = 5


@dataclass
class Block:
    """A unit of work: whole lines of a text file, or a Parquet record batch."""

    index: int
    file: str
    first_line: int  # 1-based line (text) or row (Parquet) of the first row
    data: bytes | pa.RecordBatch
    columns: tuple[str, ...] = ()  # the file's column names (text files)


@dataclass
class CleanBlock:
    """Transformed columns of the good rows of a block, plus what was dropped."""

    labels: np.ndarray  # float32 [n]
    dense: list[tuple[np.ndarray, np.ndarray]]  # per dense feature: (float32 values, present mask)
    sparse: dict[str, RawSparse]  # raw keys per sparse feature (good rows only)
    skipped: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return int(self.labels.size)


# ------------------------------------------------------------------------------------ text
def _read_text(block: Block, schema: DataSchema, typed: bool, invalid: list[int]) -> pa.Table:
    used = [schema.label, *schema.dense_names, *schema.sparse_names]
    types: dict[str, pa.DataType] = {n: pa.string() for n in used}
    if typed:
        types[schema.label] = pa.float64()
        for n in schema.dense_names:
            types[n] = pa.float64()
        for s in schema.sparse:
            if s.kind == "int" and not s.is_list:
                types[s.name] = pa.int64()

    def on_invalid(row: pacsv.InvalidRow) -> str:
        invalid.append(int(row.number) if row.number is not None else -1)
        return "skip"

    data = block.data
    assert isinstance(data, bytes)
    return pacsv.read_csv(
        pa.py_buffer(data),
        read_options=pacsv.ReadOptions(column_names=list(block.columns), use_threads=False, block_size=len(data) + 1),
        parse_options=pacsv.ParseOptions(
            delimiter=schema.delimiter,
            quote_char=False if schema.delimiter == "\t" else '"',
            invalid_row_handler=on_invalid,
        ),
        # Only an empty field is missing: "nan", "NULL" or "N/A" (pyarrow's default null words) in
        # a numeric column are bad values, as the Python readers say.
        convert_options=pacsv.ConvertOptions(column_types=types, include_columns=used, strings_can_be_null=False,
                                             null_values=[""]),
    )


def _text_row_lines(data: bytes, first_line: int, invalid: list[int]) -> np.ndarray:
    """Physical line number of each parsed row: pyarrow numbers non-empty lines from 1 and
    leaves out the ones its invalid-row handler skipped. Lines are counted by \n."""
    arr = np.frombuffer(data, dtype=np.uint8)
    breaks = np.flatnonzero((arr == 10) | (arr == 13))  # a lone \r ends a line too; \r\n leaves an empty one
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [arr.size]])
    newlines_before = np.concatenate([[0], np.cumsum(arr[breaks] == 10)])
    lines = newlines_before[ends > starts]
    if invalid:
        drop = np.asarray([i - 1 for i in invalid if i > 0], dtype=np.int64)
        lines = np.delete(lines, drop)
    return lines + first_line


# ------------------------------------------------------------------------------------ checks
@dataclass
class _Problems:
    """Per-row problems of a block, in column order, for the error message of the first one."""

    n: int
    checks: list[tuple[np.ndarray, Callable[[int], str]]] = field(default_factory=list)

    def add(self, mask: np.ndarray, message: Callable[[int], str]) -> None:
        if mask.any():
            self.checks.append((mask, message))

    def mask(self) -> np.ndarray:
        out = np.zeros(self.n, bool)
        for m, _ in self.checks:
            out |= m
        return out

    def message(self, row: int) -> str:
        return next(msg(row) for m, msg in self.checks if m[row])


def _text(col: pa.Array, row: int) -> str:
    return shown(col[row].as_py())


def _label_problem(schema: DataSchema, col: pa.Array, row: int, expected: str, is_number: bool) -> str:
    """The label error, with the fix: a header line read as data, or a rating or score that
    needs ``label_threshold`` to become a click."""
    value = col[row].as_py()
    text = f"label {schema.label!r} must be {expected}, got {shown(value)}"
    if isinstance(value, str) and value.strip() == schema.label and not schema.header:
        return text + '; the file starts with a header line: set "header": true in the schema'
    if is_number:
        return text + f'; for ratings or scores set "label_threshold" in the schema (label = 1 where the value is >= it, e.g. 4)'
    return text


def _sparse_ids_ok(feat: SparseFeature, raw: RawSparse) -> np.ndarray:
    """Rows whose ids fall outside the table (transform 'identity' only)."""
    if feat.transform != "identity" or raw.keys.size == 0:
        return np.zeros(raw.lengths.size, bool)
    rows_of = np.repeat(np.arange(raw.lengths.size), raw.lengths)
    out = raw.keys.astype(np.int64)
    bad_key = (out < 0) | (out >= feat.table_rows)
    bad = np.zeros(raw.lengths.size, bool)
    bad[rows_of[bad_key]] = True
    return bad


def _columns(table: pa.Table | pa.RecordBatch, schema: DataSchema) -> dict[str, pa.Array]:
    def col(name: str) -> pa.Array:
        c = table.column(name)
        return c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c

    return {n: col(n) for n in (schema.label, *schema.dense_names, *schema.sparse_names)}


def _drop_non_text_lines(block: Block) -> tuple[Block, list[tuple[int, str]]]:
    """``block`` with every line that is not UTF-8 text emptied (so line numbers stay), and
    (line, message) for each."""
    data = block.data
    assert isinstance(data, bytes)
    if data.isascii():
        return block, []
    try:
        data.decode("utf-8")
        return block, []
    except UnicodeDecodeError:
        pass
    lines = data.split(b"\n")
    dropped = []
    for k, line in enumerate(lines):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            at = block.first_line + k
            dropped.append((at, f"{block.file}:{at}: the line is not UTF-8 text (byte 0x{line[e.start]:02x} at "
                                f"character {e.start + 1}): is this a binary file?"))
            lines[k] = b""
    return Block(block.index, block.file, block.first_line, b"\n".join(lines), block.columns), dropped


def clean_block(block: Block, schema: DataSchema, skip_bad_rows: bool) -> CleanBlock:
    """Parse, check and keep the good rows of ``block``; raise on the first bad one unless skipping."""
    dropped: list[tuple[int, str]] = []
    if isinstance(block.data, bytes):
        block, dropped = _drop_non_text_lines(block)
    if dropped and not skip_bad_rows:
        # The first bad line is named: one before the first line that is not text, if any.
        line = dropped[0][0]
        data: bytes = block.data  # type: ignore[assignment]
        head = data[: sum(len(x) + 1 for x in data.split(b"\n")[: line - block.first_line])]
        _clean_block(Block(block.index, block.file, block.first_line, head, block.columns), schema, False)
        raise DataFormatError(dropped[0][1] + SKIP_HINT)
    clean = _clean_block(block, schema, skip_bad_rows)
    if dropped:
        clean.skipped += len(dropped)
        clean.examples = sorted([m for _, m in dropped] + clean.examples, key=_line_of)[:MAX_EXAMPLES]
    return clean


def _line_of(example: str) -> int:
    """The line number of a ``file:line: message`` example (for ordering)."""
    m = re.search(r":(\d+): ", example)
    return int(m.group(1)) if m else 0


def _clean_block(block: Block, schema: DataSchema, skip_bad_rows: bool) -> CleanBlock:
    is_text = isinstance(block.data, bytes)
    invalid: list[int] = []
    first_error: tuple[int, str] | None = None  # (line, message) of a row of the wrong width
    if is_text and not block.data.replace(b"\n", b"").replace(b"\r", b""):  # type: ignore[union-attr]
        # Only line ends (pyarrow calls that an empty file): no rows.
        table = pa.table({n: pa.array([], pa.string()) for n in (schema.label, *schema.dense_names, *schema.sparse_names)})
    elif is_text:
        try:
            table = _read_text(block, schema, typed=True, invalid=invalid)
        except pa.ArrowInvalid:
            invalid.clear()
            try:
                table = _read_text(block, schema, typed=False, invalid=invalid)
            except pa.ArrowInvalid as e:
                raise DataFormatError(f"{block.file}:{block.first_line}: the text from this line on cannot be read as "
                                      f"{schema.delimiter!r}-separated columns ({shown(str(e), 120)[1:-1]})") from None
        if invalid and not skip_bad_rows:
            lines = _text_row_lines(block.data, block.first_line, [])  # type: ignore[arg-type]
            at = int(lines[invalid[0] - 1]) if invalid[0] > 0 else block.first_line
            cols = len(block.columns)
            first_error = (at, f"{block.file}:{at}: expected {cols} columns separated by {schema.delimiter!r}")
    else:
        table = block.data
    cols = _columns(table, schema)  # type: ignore[arg-type]
    n = table.num_rows
    probs = _Problems(n)

    lab_col = cols[schema.label]
    lab, lab_present, lab_bad = parse_floats(lab_col)
    if schema.label_threshold is not None:
        labels = (lab >= schema.label_threshold).astype(np.float32)
        probs.add(lab_bad | ~lab_present, lambda r: _label_problem(schema, lab_col, r, "a number", False))
    else:
        labels = lab.astype(np.float32)
        probs.add(lab_bad | ~lab_present | ((lab != 0) & (lab != 1)),
                  lambda r: _label_problem(schema, lab_col, r, "0 or 1", bool(lab_present[r] and not lab_bad[r])))
    dense = []
    for d in schema.dense:
        values, present, bad = parse_floats(cols[d.name])
        probs.add(bad, lambda r, d=d: f"dense feature {d.name} must be a finite number, got {_text(cols[d.name], r)}")
        dense.append((values, present))
    sparse = {}
    for s in schema.sparse:
        raw = decode_sparse(cols[s.name], s)
        probs.add(raw.bad, lambda r, s=s, raw=raw: f"categorical feature {s.name} must be a valid {raw.problem}, got {_text(cols[s.name], r)}")
        probs.add(
            _sparse_ids_ok(s, raw) & ~raw.bad,
            lambda r, s=s: f"categorical feature {s.name}: {_text(cols[s.name], r)} is outside its table of {s.table_rows} rows (raise table_rows for {s.name})",
        )
        sparse[s.name] = raw

    bad = probs.mask()
    skipped = int(bad.sum()) + len(invalid)
    examples: list[str] = []
    if skipped:
        where = _Locator(block, is_text, invalid)
        bad_rows = np.flatnonzero(bad)
        if not skip_bad_rows:
            if bad_rows.size:
                r = int(bad_rows[0])
                line = where.line(r)
                if first_error is None or line < first_error[0]:
                    first_error = (line, f"{where(r)}: {probs.message(r)}")
            assert first_error is not None
            raise DataFormatError(first_error[1] + SKIP_HINT)
        found = [(int(r), f"{where(int(r))}: {probs.message(int(r))}") for r in bad_rows[:MAX_EXAMPLES]]
        if invalid:
            all_lines = _text_row_lines(block.data, block.first_line, [])  # type: ignore[arg-type]
            found += [
                (int(all_lines[k - 1]), f"{block.file}:{int(all_lines[k - 1])}: expected {len(block.columns)} columns")
                for k in invalid[:MAX_EXAMPLES]
                if k > 0
            ]
            if is_text:  # order by line: map parsed rows to their lines too
                rows_lines = _text_row_lines(block.data, block.first_line, invalid)  # type: ignore[arg-type]
                found = [(int(rows_lines[r]) if not m.endswith("columns") else r, m) for r, m in found]
        examples = [m for _, m in sorted(found)[:MAX_EXAMPLES]]
    keep = ~bad
    clean = CleanBlock(
        labels=labels[keep],
        dense=[(transform_dense(v, p, d)[keep], p[keep]) for (v, p), d in zip(dense, schema.dense)],
        sparse={name: _keep_rows(raw, keep) for name, raw in sparse.items()} if bad.any() else sparse,
        skipped=skipped,
        examples=examples,
    )
    return clean


class _Locator:
    """Where row ``r`` of a block is: ``file:line`` (text) or ``file: row N`` (Parquet)."""

    def __init__(self, block: Block, is_text: bool, invalid: list[int]) -> None:
        self.block, self.is_text = block, is_text
        data: bytes = block.data if is_text else b""  # type: ignore[assignment]
        self.lines = _text_row_lines(data, block.first_line, invalid) if is_text else None

    def line(self, r: int) -> int:
        return int(self.lines[r]) if self.lines is not None else self.block.first_line + r

    def __call__(self, r: int) -> str:
        return f"{self.block.file}:{self.line(r)}" if self.is_text else f"{self.block.file}: row {self.line(r)}"


def _keep_rows(raw: RawSparse, keep: np.ndarray) -> RawSparse:
    if raw.present is not None:
        return RawSparse(raw.keys[keep], raw.lengths[keep], raw.bad[keep], raw.problem, raw.present[keep])
    rows_of = np.repeat(np.arange(raw.lengths.size), raw.lengths)
    return RawSparse(raw.keys[keep[rows_of]], raw.lengths[keep], raw.bad[keep], raw.problem)


def sparse_ids(feat: SparseFeature, raw: RawSparse, vocab: np.ndarray | None) -> np.ndarray:
    """Raw keys -> int64 embedding row ids, per the feature's transform (missing -> 0)."""
    if feat.transform == "hash":
        ids = hash_ids(raw.keys, feat.table_rows)
    elif feat.transform == "vocab":
        assert vocab is not None, f"no vocabulary for feature {feat.name}"
        ids = vocab_ids(raw.keys, vocab)
    else:
        ids = raw.keys.astype(np.int64)
    if raw.present is not None:
        ids[~raw.present] = 0
    return ids


def vocab_keys(raw: RawSparse) -> np.ndarray:
    """The keys a vocabulary counts (missing values are not vocabulary entries)."""
    return raw.keys if raw.present is None else raw.keys[raw.present]
