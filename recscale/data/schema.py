"""Schemas of tabular click data: which column is the label, which are dense, which are sparse.

A schema file (JSON or TOML) lets ``recscale data prepare`` turn any CSV or Parquet click or
rating log into training shards with no code; the Criteo TSV schema is built in. The resolved
schema (with each table's final row count) is stored in the prepared directory's manifest, so
the trainer and the planner read the shapes from there.

Example (JSON)::

    {"label": "clicked",
     "dense": ["age", {"name": "price", "log": true, "fill": 0}],
     "sparse": [{"name": "user", "kind": "int", "table_rows": 100000},
                {"name": "items", "kind": "int", "list_separator": "|", "table_rows": 50000},
                {"name": "city", "kind": "string", "transform": "vocab", "min_count": 5}]}
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPARSE_KINDS = ("hex", "int", "string")
MAX_TABLE_ROWS = 1 << 62  # ids are int64
TRANSFORMS = ("hash", "vocab", "identity")


class SchemaError(ValueError):
    """A schema file or schema option is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class DenseFeature:
    """A numeric column: missing -> ``fill``; negatives clipped to 0 and ``log(1 + x)`` when ``log``."""

    name: str
    fill: float = 0.0
    log: bool = True


@dataclass(frozen=True)
class SparseFeature:
    """A categorical column, one id per row or a list of ids (``list_separator`` in text files,
    a list column in Parquet).

    kind: how raw values read: ``hex`` (Criteo's 8-hex-digit hashes), ``int`` or ``string``.
    transform: ``hash`` (``1 + value mod (table_rows - 1)``; 0 = missing), ``vocab`` (values
    seen at least ``min_count`` times get ids 2.. in value order, rarer ones share id 1, as
    the MLPerf preprocessing does; 0 = missing) or ``identity`` (already ids in
    ``[0, table_rows)``).
    """

    name: str
    kind: str = "int"
    transform: str = "hash"
    table_rows: int = 0
    min_count: int = 1
    list_separator: str | None = None
    multi_hot: bool = False

    @property
    def is_list(self) -> bool:
        return self.multi_hot or self.list_separator is not None


@dataclass(frozen=True)
class DataSchema:
    """Columns of one dataset. ``columns`` names the file's columns in order when it has no
    header (text files); ``label_threshold`` turns a rating into a click (label = value >= it)."""

    label: str
    dense: tuple[DenseFeature, ...] = ()
    sparse: tuple[SparseFeature, ...] = ()
    columns: tuple[str, ...] = ()
    delimiter: str = ","
    header: bool = False
    label_threshold: float | None = None

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dense)

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sparse)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_table_rows(self, rows: dict[str, int]) -> DataSchema:
        return replace(self, sparse=tuple(replace(s, table_rows=rows.get(s.name, s.table_rows)) for s in self.sparse))

    def validate(self) -> None:
        names = [self.label, *self.dense_names, *self.sparse_names]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SchemaError(f"schema: column(s) {dup} are used more than once (label, dense and sparse must differ)")
        if not self.sparse:
            raise SchemaError("schema field 'sparse': at least one sparse feature is needed (a DLRM embeds them)")
        if self.columns:
            missing = [n for n in names if n not in self.columns]
            if missing:
                raise SchemaError(f"schema field 'columns': does not list {missing}, which the features use")
        if len(self.delimiter) != 1:
            raise SchemaError(f"schema field 'delimiter': expected one character, got {self.delimiter!r}")
        for s in self.sparse:
            where = f"schema sparse feature '{s.name}'"
            if s.kind not in SPARSE_KINDS:
                raise SchemaError(f"{where}: kind must be one of {list(SPARSE_KINDS)}, got {s.kind!r}")
            if s.transform not in TRANSFORMS:
                raise SchemaError(f"{where}: transform must be one of {list(TRANSFORMS)}, got {s.transform!r}")
            if s.transform in ("hash", "identity") and s.table_rows <= 0:
                raise SchemaError(
                    f"{where}: transform '{s.transform}' needs table_rows > 0 "
                    "(set it in the schema or pass --table-rows N, or use transform 'vocab': a table sized by the data)"
                )
            if s.transform == "identity" and s.kind != "int":
                raise SchemaError(f"{where}: transform 'identity' needs kind 'int' (ids are integers)")
            if not 0 <= s.table_rows < MAX_TABLE_ROWS:
                raise SchemaError(f"{where}: table_rows must be in [0, 2^62), got {_shown(s.table_rows)}")
            if s.min_count < 1:
                raise SchemaError(f"{where}: min_count must be >= 1, got {s.min_count}")


def criteo_schema(table_rows: int | list[int] = 0, has_label: bool = True) -> DataSchema:
    """The Criteo Kaggle/1TB TSV: label, I1..I13 integers, C1..C26 8-hex-digit hashes."""
    rows = [table_rows] * 26 if isinstance(table_rows, int) else list(table_rows)
    if len(rows) != 26:
        raise SchemaError(f"--table-rows: expected 1 or 26 values for the Criteo features C1..C26, got {len(rows)}")
    dense = tuple(DenseFeature(f"I{i + 1}") for i in range(13))
    sparse = tuple(SparseFeature(f"C{i + 1}", kind="hex", table_rows=r) for i, r in enumerate(rows))
    cols = (("label",) if has_label else ()) + tuple(d.name for d in dense) + tuple(s.name for s in sparse)
    return DataSchema(label="label", dense=dense, sparse=sparse, columns=cols, delimiter="\t", header=False)


def _typed(value: Any, kind: str, where: str) -> Any:
    """``value`` when it is of the schema type ``kind``, else a SchemaError naming ``where``:
    a value of another type is refused, never converted (``"yes"`` is no boolean, ``"age"``
    no list, ``3.7`` no row count)."""
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value),
        "list": isinstance(value, (list, tuple)),
        "table": isinstance(value, dict),
    }[kind]
    if not ok:
        expected = {"str": "a string", "bool": "true or false", "int": "an integer", "number": "a finite number",
                    "list": "a list", "table": "a table (an object)"}[kind]
        raise SchemaError(f"schema field '{where}': expected {expected}, got {_shown(value)}")
    return value


def _cut(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


def _shown(value: Any) -> str:
    r = json.dumps(value) if isinstance(value, (str, bool, int, float, type(None))) else repr(value)
    return r if len(r) <= 40 else f"{r[:28]}...{r[-6:]} ({len(r):,} characters)"


def _dense(item: Any, i: int) -> DenseFeature:
    where = f"dense[{i}]"
    if isinstance(item, str):
        return DenseFeature(item)
    if not isinstance(item, dict) or "name" not in item:
        raise SchemaError(f"schema field '{where}': expected a column name or a table with 'name', got {_shown(item)}")
    unknown = set(item) - {"name", "fill", "log"}
    if unknown:
        raise SchemaError(f"schema field '{where}': unknown key(s) {sorted(unknown)}; known: name, fill, log")
    return DenseFeature(
        _typed(item["name"], "str", f"{where}.name"),
        float(_typed(item.get("fill", 0.0), "number", f"{where}.fill")),
        _typed(item.get("log", True), "bool", f"{where}.log"),
    )


def _sparse(item: Any, i: int, defaults: dict[str, Any]) -> SparseFeature:
    where = f"sparse[{i}]"
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, dict) or "name" not in item:
        raise SchemaError(f"schema field '{where}': expected a column name or a table with 'name', got {_shown(item)}")
    known = {"name", "kind", "transform", "table_rows", "min_count", "list_separator", "multi_hot"}
    unknown = set(item) - known
    if unknown:
        raise SchemaError(f"schema field '{where}': unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    merged = {**defaults, **item}

    def field(key: str, kind: str, default: Any) -> Any:
        where_key = f"{where}.{key}" if key in item else f"sparse_defaults.{key}"
        return _typed(merged.get(key, default), kind, where_key)

    sep = merged.get("list_separator")
    if sep is not None and (not isinstance(sep, str) or not sep):
        raise SchemaError(f"schema field '{where}.list_separator': expected a non-empty string, got {_shown(sep)}")
    return SparseFeature(
        name=field("name", "str", None),
        kind=field("kind", "str", "int"),
        transform=field("transform", "str", "hash"),
        table_rows=field("table_rows", "int", 0),
        min_count=field("min_count", "int", 1),
        list_separator=sep,
        multi_hot=field("multi_hot", "bool", False),
    )


def schema_from_dict(raw: dict[str, Any]) -> DataSchema:
    """Build and validate a schema from a parsed JSON/TOML document (or a manifest's copy)."""
    known = {"label", "dense", "sparse", "columns", "delimiter", "header", "label_threshold", "sparse_defaults"}
    unknown = set(raw) - known
    if unknown:
        raise SchemaError(f"schema: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    if "label" not in raw:
        raise SchemaError("schema field 'label': required (the name of the 0/1 click column)")
    defaults = _typed(raw.get("sparse_defaults") or {}, "table", "sparse_defaults")
    unknown = set(defaults) - {"kind", "transform", "table_rows", "min_count", "list_separator", "multi_hot"}
    if unknown:
        raise SchemaError(f"schema field 'sparse_defaults': unknown key(s) {sorted(unknown)}")
    thr = raw.get("label_threshold")
    schema = DataSchema(
        label=_typed(raw["label"], "str", "label"),
        dense=tuple(_dense(d, i) for i, d in enumerate(_typed(raw.get("dense", []), "list", "dense"))),
        sparse=tuple(_sparse(s, i, defaults) for i, s in enumerate(_typed(raw.get("sparse", []), "list", "sparse"))),
        columns=tuple(_typed(c, "str", f"columns[{i}]")
                      for i, c in enumerate(_typed(raw.get("columns", []), "list", "columns"))),
        delimiter=_typed(raw.get("delimiter", ","), "str", "delimiter"),
        header=_typed(raw.get("header", False), "bool", "header"),
        label_threshold=None if thr is None else float(_typed(thr, "number", "label_threshold")),
    )
    schema.validate()
    return schema


def load_schema(path: str | Path) -> DataSchema:
    """Read a schema from a ``.json`` or ``.toml`` file."""
    p = Path(path)
    if p.is_dir():
        raise SchemaError(f"--schema: '{p}' is a directory; give a JSON or TOML schema file")
    if not p.is_file():
        raise SchemaError(f"--schema: file '{p}' does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
        raw = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except UnicodeDecodeError:
        raise SchemaError(f"schema file '{p}' is not UTF-8 text; give a JSON or TOML schema file") from None
    except (ValueError, RecursionError) as e:  # JSON and TOML decode errors are ValueErrors
        raise SchemaError(f"schema file '{p}' cannot be parsed: {_cut(str(e))}") from None
    if not isinstance(raw, dict):
        raise SchemaError(f"schema file '{p}': expected an object at the top level")
    return schema_from_dict(raw)


def override_sparse(schema: DataSchema, table_rows: int | None = None, min_count: int | None = None) -> DataSchema:
    """Apply ``--table-rows`` (hash every feature that has no size) or ``--vocab-min-count``
    (frequency-thresholded vocabulary for every hashed feature)."""
    out = []
    for s in schema.sparse:
        if min_count is not None and s.transform == "hash":
            s = replace(s, transform="vocab", min_count=min_count)
        if table_rows is not None and s.transform in ("hash", "identity") and s.table_rows <= 0:
            s = replace(s, table_rows=table_rows)
        out.append(s)
    schema = replace(schema, sparse=tuple(out))
    schema.validate()
    return schema


__all__ = [
    "DataSchema",
    "DenseFeature",
    "SchemaError",
    "SparseFeature",
    "criteo_schema",
    "load_schema",
    "override_sparse",
    "schema_from_dict",
]
