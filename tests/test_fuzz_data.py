"""Fuzzing the data readers against a reference: the Criteo TSV (``read_criteo_tsv`` and
``recscale data prepare``, plain and gzip), the encoded Criteo CSV and a CSV read through a
schema. Each input is random rows of good and bad fields, then sometimes damaged bytes, binary
junk or a cut. A small parser written from the format's definition says which rows are good and
what they hold; every reader must return exactly those rows, or (not skipping bad rows) stop with
a one-line error naming the first bad line. Never another exception, never a row taken wrongly,
and a failed ``prepare`` leaves nothing behind.

Examples per test: RECSCALE_FUZZ_EXAMPLES (default 60).
"""

from __future__ import annotations

import gzip
import math
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from recscale.data import DataFormatError, read_criteo_tsv, read_encoded_csv
from recscale.data.blocks import Block, clean_block
from recscale.data.prepare import PrepareOptions, prepare
from recscale.data.prepared import PreparedDataset
from recscale.data.schema import SchemaError, criteo_schema, schema_from_dict

EXAMPLES = int(os.environ.get("RECSCALE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
ROWS = 1000  # table rows of every Criteo feature

# ---------------------------------------------------------------------- the reference
WS = "[\t\n\f\r ]*"
NUMBER = re.compile(rf"{WS}[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?{WS}")
INTEGER = re.compile(rf"{WS}[-+]?[0-9]+{WS}")
HEX = re.compile("[0-9a-fA-F]{1,16}")


def text_lines(raw: bytes):
    """(line number, bytes) of each non-empty line: lines end at \\n, \\r\\n or \\r; the number
    counts \\n."""
    for k, line in enumerate(raw.split(b"\n"), start=1):
        for part in line.split(b"\r"):
            if part:
                yield k, part


def number(text: str) -> float | None:
    """A finite decimal number, else None."""
    if not NUMBER.fullmatch(text):
        return None
    v = float(text)
    return v if math.isfinite(v) else None


def split_lines(raw: bytes, sep: str, width: int):
    """(line number, its fields) per line; fields None where the line is not UTF-8 or has another
    number of fields than ``width`` (a bad row in every format)."""
    for k, part in text_lines(raw):
        try:
            cols = part.decode("utf-8").split(sep)
        except UnicodeDecodeError:
            yield k, None
            continue
        yield k, (cols if len(cols) == width else None)


def reference_tsv(raw: bytes):
    """(first bad line or None, bad count, good rows as (label, 13 dense, 26 ids))."""
    bad, good = [], []
    for k, cols in split_lines(raw, "\t", 40):
        if cols is None:
            bad.append(k)
            continue
        label = number(cols[0])
        dense = [0.0 if re.fullmatch(WS, c) else number(c) for c in cols[1:14]]
        cats = cols[14:]
        if label not in (0.0, 1.0) or None in dense or not all(c == "" or HEX.fullmatch(c) for c in cats):
            bad.append(k)
            continue
        ids = [1 + int(c, 16) % (ROWS - 1) if c else 0 for c in cats]
        good.append((label, [max(v, 0.0) for v in dense], ids))
    return (bad[0] if bad else None), len(bad), good


def reference_encoded(raw: bytes, table_rows: int | None):
    bad, good = [], []
    for k, cols in split_lines(raw, ",", 40):
        if cols is None or not all(INTEGER.fullmatch(c) for c in cols):
            bad.append(k)
            continue
        v = [int(c) for c in cols]
        ids = v[14:]
        if (v[0] not in (0, 1) or not all(-(1 << 63) <= x < 1 << 63 for x in v)
                or not all(0 <= i < (table_rows or 1 << 63) for i in ids)):
            bad.append(k)
            continue
        good.append((float(v[0]), [float(max(x, 0)) for x in v[1:14]], ids))
    return (bad[0] if bad else None), len(bad), good


def arrays(good):
    labels = np.array([g[0] for g in good], np.float32)
    dense = np.log1p(np.array([g[1] for g in good], np.float64).reshape(-1, 13)).astype(np.float32)
    ids = np.array([g[2] for g in good], np.int64).reshape(-1, 26)
    return labels, dense, ids


def check_outcome(get, first_bad: int | None, good, skip: bool, gz_cut: bool) -> tuple | None:
    """Run a reader: an error exactly when the reference expects one (naming the first bad
    line when there is one), else its arrays (returned, for comparison)."""
    expect_error = gz_cut or (first_bad is not None and not skip) or not good
    try:
        got = get()
    except (DataFormatError, SchemaError) as e:
        msg = str(e)
        assert "\n" not in msg and len(msg) < 400, msg
        assert expect_error, f"refused a valid input: {msg}"
        if first_bad is not None and not skip and not gz_cut:
            assert f":{first_bad}:" in msg, (first_bad, msg)
        event("refused with a one-line error")
        return None
    assert not expect_error, ("accepted an input the reference refuses", first_bad, len(good))
    event("accepted")
    return got


# ---------------------------------------------------------------------- generated inputs
labels = st.sampled_from(["0", "1", "1.0", " 1", "1e0", "+0", "2", "-1", "nan", "", "x", "0x1", "١", "0.5"])
dense_fields = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.sampled_from(["", " ", "1.5", "-3", "nan", "NaN", "inf", "-inf", "1e400", "1_0", "0x10", "NULL", "N/A", "+7",
                     ".5", "5.", "9" * 400, "٣", " 4 ", "1e5", "-0", "1,5", '"3"']),
    st.text(max_size=4),
)
hex_fields = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
    st.integers(0, 2**64 - 1).map(lambda v: f"{v:X}"),
    st.sampled_from(["", " ", "0x1f", "zz", "g1", "1_f", "-1f", "F" * 17, " 68fd1e64", "NULL"]),
    st.text(alphabet="0123456789abcdefxyz \r", max_size=10),
)


@st.composite
def tsv_row(draw) -> bytes:
    cols = [draw(labels)] + [draw(dense_fields) for _ in range(13)] + [draw(hex_fields) for _ in range(26)]
    cut = draw(st.sampled_from([40] * 8 + [39, 41, 1]))
    cols = cols[:cut] if cut <= 40 else cols + ["0"]
    return "\t".join(cols).encode()


@st.composite
def good_tsv_row(draw) -> bytes:
    cols = ([draw(st.sampled_from(["0", "1"]))] + [str(draw(st.integers(-2, 500))) for _ in range(13)]
            + [f"{draw(st.integers(0, 2**32 - 1)):08x}" for _ in range(26)])
    return "\t".join(cols).encode()


@st.composite
def damaged(draw, rows) -> bytes:
    """Rows joined by newlines, then maybe binary junk lines, blank lines or damaged bytes."""
    lines = draw(st.lists(st.one_of(rows, rows, rows, st.binary(max_size=30), st.sampled_from([b"", b"  ", b"\r"])),
                          min_size=0, max_size=8))
    raw = draw(st.sampled_from([b"\n", b"\r\n"])).join(lines) + draw(st.sampled_from([b"\n", b""]))
    how = draw(st.sampled_from(["none", "none", "cut", "flip", "junk"]))
    if how == "cut" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif how == "junk":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=8)) + raw[i:]
    return raw


def write_input(d: Path, raw: bytes, data, suffix: str) -> tuple[Path, bool]:
    """The input file, sometimes gzip-compressed and then sometimes cut (a truncated download)."""
    if data.draw(st.booleans()):
        return _write(d / f"in{suffix}", raw), False
    packed = gzip.compress(raw, mtime=0)
    cut = data.draw(st.booleans())
    if cut:
        packed = packed[: data.draw(st.integers(1, len(packed) - 1))]
    return _write(d / f"in{suffix}.gz", packed), cut


def _write(p: Path, raw: bytes) -> Path:
    p.write_bytes(raw)
    return p


# ---------------------------------------------------------------------- Criteo TSV
@FUZZ
@given(st.data())
def test_fuzzed_criteo_tsv(data):
    """``read_criteo_tsv`` and ``recscale data prepare`` both return exactly the reference's rows."""
    raw = data.draw(damaged(st.one_of(tsv_row(), good_tsv_row())))
    skip = data.draw(st.booleans())
    first_bad, _, good = reference_tsv(raw)
    with tempfile.TemporaryDirectory() as t:
        d = Path(t)
        path, gz_cut = write_input(d, raw, data, ".tsv")
        want = arrays(good)

        def python_reader():
            c = read_criteo_tsv(path, [ROWS] * 26, skip_bad_rows=skip)
            return c.labels, c.dense, c.sparse

        got = check_outcome(python_reader, first_bad, good, skip, gz_cut)
        if got is not None:
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), "read_criteo_tsv differs from the reference"

        out = d / "prepared"
        block = data.draw(st.sampled_from([64, 300, 1 << 20]))

        def prepared():
            prepare(PrepareOptions(inputs=(str(path),), fmt="criteo-tsv", schema=criteo_schema(ROWS), out=str(out),
                                   workers=0, block_bytes=block, row_group_rows=7, skip_bad_rows=skip, progress=False),
                    log=lambda _: None)
            t = pa.concat_tables(pq.read_table(f) for f in PreparedDataset.open(out).shard_files)
            return (t["label"].to_numpy().astype(np.float32),
                    np.stack([t[f"I{i}"].to_numpy() for i in range(1, 14)], 1).reshape(-1, 13),
                    np.stack([t[f"C{i}"].to_numpy() for i in range(1, 27)], 1).reshape(-1, 26).astype(np.int64))

        got = check_outcome(prepared, first_bad, good, skip, gz_cut)
        if got is None:
            assert sorted(p.name for p in d.iterdir()) == sorted([path.name]), "a failed prepare left files behind"
        else:
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), "prepare differs from the reference"


# ---------------------------------------------------------------------- encoded Criteo CSV
int_fields = st.one_of(
    st.integers(0, 1000).map(str),
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", " 3", "4 ", "+5", "1.0", "1e3", "1_000", "0x10", "#7", "nan", "٣", '"4"', "-0"]),
)


@st.composite
def encoded_row(draw) -> bytes:
    cols = [draw(st.sampled_from(["0", "1", "1", "2", " 1", "-1"]))] + [
        draw(st.one_of(st.integers(0, 900).map(str), st.integers(0, 900).map(str), int_fields)) for _ in range(39)]
    cut = draw(st.sampled_from([40] * 8 + [39, 41]))
    cols = cols[:cut] if cut <= 40 else cols + ["0"]
    return ",".join(cols).encode()


@st.composite
def good_encoded_row(draw) -> bytes:
    return ",".join([draw(st.sampled_from(["0", "1"]))] + [str(draw(st.integers(0, 900))) for _ in range(39)]).encode()


@FUZZ
@given(st.data())
def test_fuzzed_encoded_csv(data):
    raw = data.draw(damaged(st.one_of(encoded_row(), good_encoded_row())))
    skip = data.draw(st.booleans())
    table_rows = data.draw(st.sampled_from([None, 1000, 500]))
    first_bad, _, good = reference_encoded(raw, table_rows)
    with tempfile.TemporaryDirectory() as t:
        path, gz_cut = write_input(Path(t), raw, data, ".csv")

        def reader():
            c = read_encoded_csv(path, None if table_rows is None else [table_rows] * 26, skip_bad_rows=skip)
            return c.labels, c.dense, c.sparse

        got = check_outcome(reader, first_bad, good, skip, gz_cut)
    if got is not None:
        assert all(np.array_equal(a, b) for a, b in zip(got, arrays(good))), "read_encoded_csv differs from the reference"


# ---------------------------------------------------------------------- a CSV read through a schema
SCHEMA = schema_from_dict({
    "label": "y", "columns": ["y", "age", "user", "city", "items"],
    "dense": [{"name": "age", "log": False, "fill": -1.0}],
    "sparse": [{"name": "user", "kind": "int", "transform": "identity", "table_rows": 100},
               {"name": "city", "kind": "string", "table_rows": 50},
               {"name": "items", "kind": "int", "list_separator": "|", "table_rows": 30}],
})
csv_fields = st.one_of(st.integers(-3, 120).map(str), st.sampled_from(["", " ", "1.5", "nan", "x", "a|b", "3|4|", "|",
                                                                       "7| 8", "1e2", "9" * 30]), st.text(max_size=4))


@st.composite
def csv_row(draw) -> bytes:
    n = draw(st.sampled_from([5] * 6 + [4, 6]))
    return ",".join(draw(csv_fields) for _ in range(n)).encode()


def reference_csv(raw: bytes):
    """As ``reference_tsv`` for SCHEMA (rows with a quote character are left to the CSV parser)."""
    bad, good = [], []
    for k, cols in split_lines(raw, ",", 5):
        if cols is None:
            bad.append(k)
            continue
        y, age, user, city, items = cols
        label = number(y)
        a = -1.0 if re.fullmatch(WS, age) else number(age)
        u_ok = user == "" or (INTEGER.fullmatch(user) and 0 <= int(user) < 100)
        parts = [p for p in items.split("|") if p != ""]
        i_ok = all(INTEGER.fullmatch(p) and -(1 << 63) <= int(p) < 1 << 63 for p in parts)
        if label not in (0.0, 1.0) or a is None or not u_ok or not i_ok:
            bad.append(k)
            continue
        good.append((label, a, int(user) if user else 0, city, [int(p) for p in parts]))
    return (bad[0] if bad else None), good


@FUZZ
@given(st.data())
def test_fuzzed_schema_csv(data):
    raw = data.draw(damaged(csv_row()))
    skip = data.draw(st.booleans())
    block = Block(0, "in.csv", 1, raw, SCHEMA.columns)
    quoted = b'"' in raw
    first_bad, good = reference_csv(raw)
    try:
        clean = clean_block(block, SCHEMA, skip)
    except (DataFormatError, SchemaError) as e:
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)
        assert quoted or (first_bad is not None and not skip), f"refused a valid block: {e}"
        if not quoted:
            assert f"in.csv:{first_bad}:" in str(e)
        event("refused with a one-line error")
        return
    event("accepted")
    if quoted:
        return  # the CSV parser's quoting rules are its own; the outcome was an answer, not a crash
    assert first_bad is None or skip, "accepted a block with a bad row"
    assert clean.rows == len(good)
    assert np.array_equal(clean.labels, np.array([g[0] for g in good], np.float32))
    assert np.array_equal(clean.dense[0][0], np.array([g[1] for g in good], np.float32))
    user = clean.sparse["user"]
    assert np.array_equal(np.where(user.present, user.keys.astype(np.int64), 0), [g[2] for g in good])
    items = clean.sparse["items"]
    assert items.lengths.tolist() == [len(g[4]) for g in good]
    assert items.keys.astype(np.int64).tolist() == [x for g in good for x in g[4]]


@pytest.mark.parametrize("raw", [b"", b"\n\n", b"\xff\xfe\x00", b"1,2,3,4,5\n"])
def test_schema_csv_edge_blocks(raw):
    """Blocks the generator reaches rarely, checked every run."""
    try:
        clean_block(Block(0, "in.csv", 1, raw, SCHEMA.columns), SCHEMA, True)
    except DataFormatError as e:
        assert "\n" not in str(e)
