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
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPARSE_KINDS = ("hex", "int", "string")
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


def _dense(item: Any, i: int) -> DenseFeature:
    if isinstance(item, str):
        return DenseFeature(item)
    if not isinstance(item, dict) or "name" not in item:
        raise SchemaError(f"schema field 'dense[{i}]': expected a column name or a table with 'name'")
    unknown = set(item) - {"name", "fill", "log"}
    if unknown:
        raise SchemaError(f"schema field 'dense[{i}]': unknown key(s) {sorted(unknown)}; known: name, fill, log")
    return DenseFeature(str(item["name"]), float(item.get("fill", 0.0)), bool(item.get("log", True)))


def _sparse(item: Any, i: int, defaults: dict[str, Any]) -> SparseFeature:
    if isinstance(item, str):
        item = {"name": item}
    if not isinstance(item, dict) or "name" not in item:
        raise SchemaError(f"schema field 'sparse[{i}]': expected a column name or a table with 'name'")
    known = {"name", "kind", "transform", "table_rows", "min_count", "list_separator", "multi_hot"}
    unknown = set(item) - known
    if unknown:
        raise SchemaError(f"schema field 'sparse[{i}]': unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    merged = {**defaults, **item}
    try:
        return SparseFeature(
            name=str(merged["name"]),
            kind=str(merged.get("kind", "int")),
            transform=str(merged.get("transform", "hash")),
            table_rows=int(merged.get("table_rows", 0)),
            min_count=int(merged.get("min_count", 1)),
            list_separator=merged.get("list_separator"),
            multi_hot=bool(merged.get("multi_hot", False)),
        )
    except (TypeError, ValueError) as e:
        raise SchemaError(f"schema field 'sparse[{i}]': {e}") from None


def schema_from_dict(raw: dict[str, Any]) -> DataSchema:
    """Build and validate a schema from a parsed JSON/TOML document (or a manifest's copy)."""
    known = {"label", "dense", "sparse", "columns", "delimiter", "header", "label_threshold", "sparse_defaults"}
    unknown = set(raw) - known
    if unknown:
        raise SchemaError(f"schema: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    if "label" not in raw:
        raise SchemaError("schema field 'label': required (the name of the 0/1 click column)")
    defaults = raw.get("sparse_defaults", {}) or {}
    thr = raw.get("label_threshold")
    schema = DataSchema(
        label=str(raw["label"]),
        dense=tuple(_dense(d, i) for i, d in enumerate(raw.get("dense", []))),
        sparse=tuple(_sparse(s, i, defaults) for i, s in enumerate(raw.get("sparse", []))),
        columns=tuple(str(c) for c in raw.get("columns", [])),
        delimiter=str(raw.get("delimiter", ",")),
        header=bool(raw.get("header", False)),
        label_threshold=None if thr is None else float(thr),
    )
    schema.validate()
    return schema


def load_schema(path: str | Path) -> DataSchema:
    """Read a schema from a ``.json`` or ``.toml`` file."""
    p = Path(path)
    if not p.is_file():
        raise SchemaError(f"--schema: file '{p}' does not exist")
    try:
        raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise SchemaError(f"schema file '{p}' cannot be parsed: {e}") from None
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
