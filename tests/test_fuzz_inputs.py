"""Fuzzing the files and values a user hands recscale: plan files, config values and checkpoint
manifests (random bytes, truncation, wrong types and values). The outcome is always a one-line
error of the input's error type or a correct result, never another exception.

Examples per test: RECSCALE_FUZZ_EXAMPLES (default 60, a few seconds each).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import tempfile
import types
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckpt_utils import ckpt_dir, run_training
from recscale.checkpoint.manifest import MANIFEST, CheckpointError
from recscale.checkpoint.tools import verify
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.train.config import Config, ConfigError, load_config

EXAMPLES = int(os.environ.get("RECSCALE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def assert_one_line(e: BaseException) -> None:
    event("refused with a one-line error")
    msg = str(e)
    assert msg and "\n" not in msg and len(msg) < 600, msg


def leaves(obj, path=()):
    """Every (path, value) in a JSON structure, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))


def mutate(doc, data) -> object:
    """Replace, delete, retype or nudge (an integer by a little) one place of a JSON document."""
    doc = copy.deepcopy(doc)
    places = [p for p, _ in leaves(doc) if p]
    path = data.draw(st.sampled_from(places))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    action = data.draw(st.sampled_from(["replace", "delete", "stringify", "nudge"]))
    value = parent[path[-1]]
    if action == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[path[-1]] = value + data.draw(st.sampled_from([-2, -1, 1, 2, 7]))
    elif action == "delete":
        del parent[path[-1]]
    elif action == "stringify":
        parent[path[-1]] = str(parent[path[-1]])
    else:
        parent[path[-1]] = data.draw(json_values)
    return doc


def raw_mutation(raw: bytes, data) -> bytes:
    how = data.draw(st.sampled_from(["truncate", "bytes", "flip"]))
    if how == "truncate":
        return raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    if how == "bytes":
        return data.draw(st.binary(max_size=200))
    i = data.draw(st.integers(0, len(raw) - 1))
    return raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1:]


# ---------------------------------------------------------------------- plan files
TABLES = [TableConfig("t_a", 100, 8, ("a",)), TableConfig("t_b", 50, 8, ("b",))]
PLAN = {"version": 1, "world_size": 2, "ranks_per_host": 2, "tables": [
    {"table": "t_a", "sharding_type": "row_wise", "shards": [
        {"rank": 0, "row_offset": 0, "num_rows": 60, "col_offset": 0, "num_cols": 8},
        {"rank": 1, "row_offset": 60, "num_rows": 40, "col_offset": 0, "num_cols": 8}]},
    {"table": "t_b", "sharding_type": "table_wise", "shards": [
        {"rank": 1, "row_offset": 0, "num_rows": 50, "col_offset": 0, "num_cols": 8}]},
]}


@FUZZ
@given(st.data())
def test_fuzzed_plan_files(data):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        if data.draw(st.booleans()):
            path.write_text(json.dumps(mutate(PLAN, data)))
        else:
            path.write_bytes(raw_mutation(json.dumps(PLAN).encode(), data))
        try:
            plan = ShardingPlan.load(path)
            plan.validate(TABLES)
        except PlanError as e:
            assert_one_line(e)
            return
    event("accepted")
    # Accepted: a well-typed plan that tiles every table exactly once, and round-trips.
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    assert all(isinstance(v, int) and not isinstance(v, bool) for t in plan.tables for s in t.shards
               for v in dataclasses.astuple(s))
    for t in plan.tables:
        cfg = next(c for c in TABLES if c.name == t.table)
        assert sum(s.num_rows * s.num_cols for s in t.shards) == cfg.num_rows * cfg.dim


# ---------------------------------------------------------------------- config values
def config_keys() -> list[tuple[str, str, object]]:
    out = []
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        sub = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((section.name, f.name, sub[f.name]))
    return out


KEYS = config_keys()
toml_values = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.integers(min_value=10**18, max_value=10**40).map(lambda v: str(v)),
    st.sampled_from(["nan", "inf", "-inf", "0", "-1", "0.0", "1e400", "9" * 5000]),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=12).map(json.dumps),
    st.lists(st.integers(-5, 10**6), max_size=4).map(str),
    st.just("{ a = 1 }"),
    st.just('["x", 1]'),
)


def conforms(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arm) for arm in typing.get_args(tp))
    if tp is float:
        return isinstance(value, float) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(tp):
        return True
    return isinstance(value, tp)


@FUZZ
@given(st.sampled_from(KEYS), toml_values)
def test_fuzzed_config_values(key, text):
    section, name, tp = key
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(f"[{section}]\n{name} = {text}\n")
        try:
            cfg = load_config(path)
        except ConfigError as e:
            assert_one_line(e)
            return
    event("accepted")
    assert conforms(getattr(getattr(cfg, section), name), tp), (section, name, text)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzzed_config_bytes(raw):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_bytes(raw)
        try:
            load_config(path)
        except ConfigError as e:
            assert_one_line(e)


# ---------------------------------------------------------------------- checkpoint manifests
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    run_training([f"checkpoint.dir='{root}'", "train.max_steps=8", "checkpoint.interval_steps=4",
                  "checkpoint.chunk_rows=256", "data.num_samples=2048"])
    return ckpt_dir(root, 8)


def rechecksummed(doc: dict) -> bytes:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    body["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return json.dumps(body).encode()


@FUZZ
@given(data=st.data())
def test_fuzzed_manifests(checkpoint, data):
    target = checkpoint.parent / data.draw(st.sampled_from(["step0000000004", "step0000000008"])) / MANIFEST
    original = target.read_bytes()
    doc = json.loads(original)
    how = data.draw(st.sampled_from(["typed", "typed", "typed", "raw", "unsigned"]))
    if how == "raw":
        raw = raw_mutation(original, data)
    else:
        mutated = mutate(doc, data)
        raw = rechecksummed(mutated) if how == "typed" and isinstance(mutated, dict) else json.dumps(mutated).encode()
    try:
        target.write_bytes(raw)
        try:
            verify(str(checkpoint))
            event("accepted")
        except CheckpointError as e:
            assert_one_line(e)
    finally:
        target.write_bytes(original)


# ---------------------------------------------------------------------- schema files
SCHEMA_DOC = {
    "label": "clicked", "header": False, "delimiter": ",", "label_threshold": None,
    "columns": ["clicked", "age", "price", "user", "items", "city"],
    "dense": ["age", {"name": "price", "log": True, "fill": 0.5}],
    "sparse": [{"name": "user", "kind": "int", "table_rows": 1000},
               {"name": "items", "kind": "int", "list_separator": "|", "table_rows": 500, "multi_hot": False},
               {"name": "city", "kind": "string", "transform": "vocab", "min_count": 5}],
    "sparse_defaults": {"table_rows": 100},
}
SPARSE_TYPES = {"name": str, "kind": str, "transform": str, "table_rows": int, "min_count": int,
                "list_separator": (str, type(None)), "multi_hot": bool}


def same(got, given) -> bool:
    """A value the schema holds is the one the file gave, of the same type (no conversion)."""
    if isinstance(given, bool) or isinstance(got, bool):
        return type(got) is type(given) and got == given
    return got == given and (isinstance(given, type(got)) or (isinstance(got, float) and isinstance(given, int)))


@FUZZ
@given(data=st.data())
def test_fuzzed_schema_files(data):
    from recscale.data.schema import SchemaError, load_schema

    suffix = data.draw(st.sampled_from([".json", ".toml"]))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"schema{suffix}"
        doc = mutate(SCHEMA_DOC, data) if data.draw(st.booleans()) else SCHEMA_DOC
        if suffix == ".json" and data.draw(st.booleans()):
            path.write_text(json.dumps(doc))
        elif suffix == ".json":
            path.write_bytes(raw_mutation(json.dumps(doc).encode(), data))
            doc = None
        else:
            path.write_bytes(data.draw(st.binary(max_size=200)) if data.draw(st.booleans()) else b'label = "y"\nsparse = ["u"]\n')
            doc = None
        try:
            schema = load_schema(path)
        except SchemaError as e:
            assert_one_line(e)
            return
    event("accepted")
    if not isinstance(doc, dict):
        return
    # Accepted from a document: every value it gave is in the schema as given.
    assert same(schema.label, doc["label"])
    assert same(schema.header, doc.get("header", False)) and same(schema.delimiter, doc.get("delimiter", ","))
    assert list(schema.columns) == list(doc.get("columns", []))
    for feat, item in zip(schema.dense, doc.get("dense", [])):
        item = {"name": item} if isinstance(item, str) else item
        assert all(same(getattr(feat, k), v) for k, v in item.items()), (feat, item)
    defaults = doc.get("sparse_defaults") or {}
    for feat, item in zip(schema.sparse, doc.get("sparse", [])):
        item = {**defaults, **({"name": item} if isinstance(item, str) else item)}
        assert all(same(getattr(feat, k), v) for k, v in item.items()), (feat, item)
        assert all(isinstance(getattr(feat, k), t) for k, t in SPARSE_TYPES.items())
        assert feat.table_rows >= 0 and feat.min_count >= 1
