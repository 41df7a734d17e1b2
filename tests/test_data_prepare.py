"""``recscale data prepare``: equivalence with the direct readers, bad rows, damaged directories,
statistics, vocabularies, and a non-Criteo schema with a multi-hot column trained end to end."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recscale.cli import main
from recscale.data import ClickBatches, DataFormatError, read_criteo_tsv
from recscale.data.prepare import PrepareOptions, build_schema, prepare
from recscale.data.prepared import PreparedDataError, PreparedDataset
from recscale.data.schema import SchemaError, criteo_schema, schema_from_dict
from recscale.data.sharded_reader import ShardedReader
from recscale.train.config import ConfigError, load_config
from recscale.train.loop import train

CRITEO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo"
TSV900 = CRITEO / "kaggle_dac_sample_900.tsv"
needs_criteo = pytest.mark.skipif(not TSV900.is_file(), reason="../shared/data/criteo is not present")


def _prep(inputs, out, schema=None, fmt="criteo-tsv", **kw):
    opts = dict(workers=0, block_bytes=40_000, row_group_rows=100, progress=False)
    opts.update(kw)
    return prepare(
        PrepareOptions(inputs=tuple(str(i) for i in inputs), fmt=fmt, schema=schema or criteo_schema(1000), out=str(out), **opts),
        log=lambda _: None,
    )


def _same_batch(a, b):
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values, b.sparse.values)
        and torch.equal(a.sparse.lengths, b.sparse.lengths)
        and a.sparse.keys == b.sparse.keys
    )


@needs_criteo
@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_batches_equal_reading_the_tsv(tmp_path, workers):
    r = _prep([TSV900], tmp_path / "p", workers=workers)
    assert r.rows == 900 and r.skipped_rows == 0 and r.shards > 1  # several shards and row groups
    ds = PreparedDataset.open(tmp_path / "p")
    ref = ClickBatches(read_criteo_tsv(TSV900, [1000] * 26), 64)
    for reader_workers in (0, 2):
        got = list(ShardedReader(ds, 64, num_workers=reader_workers, chunk_rows=128))
        assert len(got) == len(ref)
        assert all(_same_batch(g, ref[i]) for i, g in enumerate(got))


@needs_criteo
def test_training_on_prepared_equals_training_on_tsv(tmp_path):
    _prep([TSV900], tmp_path / "p")
    common = ["model.table_rows=1000", "train.batch_size=64", "data.shuffle=false", "train.progress=false", "data.num_workers=0"]
    direct = train(load_config(None, common + ["data.source=criteo_tsv", f"data.train_path={TSV900}"]), log=lambda _: None)
    prepared = train(load_config(None, common + ["data.source=prepared", f"data.train_path={tmp_path / 'p'}"]), log=lambda _: None)
    for key in ("eval_auc", "eval_logloss", "train_logloss", "steps", "samples", "eval_num_samples"):
        assert direct[key] == prepared[key], key


@needs_criteo
def test_gzip_input_and_stats(tmp_path):
    gz = tmp_path / "s.tsv.gz"
    gz.write_bytes(gzip.compress(TSV900.read_bytes()))
    _prep([TSV900], tmp_path / "plain")
    _prep([gz], tmp_path / "gz", block_bytes=10_000_000)
    a = pa.concat_tables(pq.read_table(f) for f in PreparedDataset.open(tmp_path / "plain").shard_files)
    b = pa.concat_tables(pq.read_table(f) for f in PreparedDataset.open(tmp_path / "gz").shard_files)
    assert a.equals(b)
    stats = json.loads((tmp_path / "gz" / "stats.json").read_text())
    d = read_criteo_tsv(TSV900, [1000] * 26)
    assert stats["rows"] == 900 and stats["positive_rate"] == pytest.approx(float(d.labels.mean()))
    for j, name in enumerate(d.sparse_names):
        f = stats["features"][name]
        ids, counts = np.unique(d.sparse[:, j], return_counts=True)
        assert f["cardinality"] == ids.size and f["cardinality_exact"] and f["mean_pooling"] == 1.0
        assert f["top_ids"][0] == [int(ids[np.argmax(counts)]), int(counts.max())]
        assert f["missing_rate"] == pytest.approx(float((d.sparse[:, j] == 0).mean()))


def _tsv_row(label="1", dense="5", cat="68fd1e64"):
    return "\t".join([label] + [dense] * 13 + [cat] * 26)


@pytest.mark.parametrize(
    "bad,problem",
    [
        ("\t".join(["1"] + ["5"] * 13 + ["68fd1e64"] * 25), "expected 40 columns"),
        (_tsv_row(dense="abc"), "dense feature I1 must be a finite number, got 'abc'"),
        (_tsv_row(cat="zz12"), "categorical feature C1 must be a valid hex value, got 'zz12'"),
        (_tsv_row(label="2"), "label 'label' must be 0 or 1"),
    ],
)
def test_bad_row_is_named_or_skipped_and_counted(tmp_path, bad, problem):
    good = [_tsv_row(label=str(i % 2), dense=str(i)) for i in range(9)]
    lines = good[:3] + ["", bad] + good[3:]  # an empty line shifts the line number: line 5 is bad
    f = tmp_path / "d.tsv"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"d.tsv:5: {problem}"):
        _prep([f], tmp_path / "a")
    r = _prep([f], tmp_path / "b", skip_bad_rows=True, workers=1)
    assert r.rows == 9 and r.skipped_rows == 1 and "d.tsv:5" in r.skipped_examples[0]
    ref = read_criteo_tsv(f, [1000] * 26, skip_bad_rows=True)
    got = next(iter(ShardedReader(PreparedDataset.open(tmp_path / "b"), 64)))
    assert torch.equal(got.dense, torch.from_numpy(ref.dense)) and torch.equal(got.labels, torch.from_numpy(ref.labels))
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["skipped_rows"] == 1


@needs_criteo
def test_missing_or_damaged_directory_is_refused(tmp_path):
    _prep([TSV900], tmp_path / "p")
    shards = sorted((tmp_path / "p").glob("part-*.parquet"))
    with pytest.raises(FileExistsError, match="--overwrite"):
        _prep([TSV900], tmp_path / "p")
    data = bytearray(shards[1].read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    shards[1].write_bytes(bytes(data))
    with pytest.raises(PreparedDataError, match=rf"{shards[1].name}' is damaged: its SHA-256"):
        PreparedDataset.open(tmp_path / "p")
    shards[2].unlink()
    with pytest.raises(PreparedDataError, match=rf"{shards[1].name}|{shards[2].name}"):
        PreparedDataset.open(tmp_path / "p", verify_checksums=False)
    (tmp_path / "p" / "manifest.json").unlink()
    with pytest.raises(PreparedDataError, match="did not finish"):
        PreparedDataset.open(tmp_path / "p")
    with pytest.raises(ConfigError, match="data.train_path"):
        load_config(None, ["data.source=prepared", f"data.train_path={tmp_path / 'nope'}"])
    assert main(["train", "--set", "data.source=prepared", "--set", f"data.train_path={tmp_path / 'p'}"]) == 2


# ------------------------------------------------------------------ a generic, non-Criteo dataset
GENERIC_SCHEMA = {
    "label": "clicked",
    "header": True,
    "dense": ["age", {"name": "price", "log": True, "fill": 1.0}],
    "sparse": [
        {"name": "user", "kind": "int", "table_rows": 500},
        {"name": "items", "kind": "int", "list_separator": "|", "table_rows": 300},
        {"name": "city", "kind": "string", "transform": "vocab", "min_count": 3},
    ],
}


def _generic_rows(n, seed=0):
    """A learnable click log: the label depends on the user, the items and the city."""
    rng = np.random.default_rng(seed)
    users = rng.zipf(1.3, n) % 400
    n_items = rng.integers(0, 6, n)
    items = [rng.zipf(1.2, k) % 250 for k in n_items]
    cities = rng.choice(["paris", "lyon", "nice"], n, p=[0.5, 0.3, 0.2])
    cities[n // 2] = "rare-town"  # below the vocabulary's min_count
    age = rng.integers(18, 80, n)
    price = np.where(rng.random(n) < 0.1, np.nan, rng.exponential(20, n))
    score = (users % 7 == 0) * 2.0 + np.array([(it % 5 == 0).sum() for it in items]) - (cities == "lyon") * 1.0 - 0.8
    clicked = (rng.random(n) < 1 / (1 + np.exp(-score))).astype(int)
    return clicked, age, price, users, items, cities


def _write_generic_csv(path, n, seed=0):
    clicked, age, price, users, items, cities = _generic_rows(n, seed)
    lines = ["clicked,age,price,user,items,city"]
    for i in range(n):
        p = "" if np.isnan(price[i]) else f"{price[i]:.3f}"
        lines.append(f"{clicked[i]},{age[i]},{p},{users[i]},{'|'.join(map(str, items[i]))},{cities[i]}")
    path.write_text("\n".join(lines) + "\n")
    return items


def test_generic_schema_with_multi_hot_trains_end_to_end(tmp_path, capsys):
    items = _write_generic_csv(tmp_path / "train.csv", 6000)
    (tmp_path / "schema.json").write_text(json.dumps(GENERIC_SCHEMA))
    assert main(["data", "prepare", "--input", str(tmp_path / "train.csv"), "--format", "csv", "--schema",
                 str(tmp_path / "schema.json"), "--out", str(tmp_path / "p"), "--workers", "1", "--no-progress",
                 "--block-mb", "0.05", "--row-group-rows", "500"]) == 0
    assert "prepared 6,000 rows" in capsys.readouterr().out
    ds = PreparedDataset.open(tmp_path / "p")
    assert ds.table_rows == {"user": 500, "items": 300, "city": 2 + 3}  # paris, lyon, nice; the rare town -> 1
    stats = json.loads((tmp_path / "p" / "stats.json").read_text())
    lens = np.array([len(x) for x in items])
    assert stats["features"]["items"]["mean_pooling"] == pytest.approx(lens.mean())
    assert stats["features"]["items"]["max_pooling"] == lens.max()
    assert stats["features"]["items"]["missing_rate"] == pytest.approx((lens == 0).mean())
    b = next(iter(ShardedReader(ds, 16)))
    assert b.sparse.keys == ("user", "items", "city") and b.dense.shape == (16, 2)
    assert b.sparse.lengths[16:32].tolist() == lens[:16].tolist()
    whole = next(iter(ShardedReader(ds, 6000)))
    city = whole.sparse.values[-6000:].numpy()
    cities = _generic_rows(6000)[5]
    assert city[3000] == 1 and set(np.delete(city, 3000).tolist()) == {2, 3, 4}  # the rare town shares id 1
    assert len({(c, i) for c, i in zip(cities.tolist(), city.tolist())}) == 4  # one id per city
    summary = tmp_path / "s.json"
    assert main(["train", "--set", "data.source=prepared", "--set", f"data.train_path={tmp_path / 'p'}",
                 "--set", "model.table_rows=[500, 300, 5]", "--set", "train.batch_size=128", "--set", "train.epochs=3",
                 "--set", "train.progress=false", "--set", "data.num_workers=0", "--set", "data.shuffle_window=1000",
                 "--summary-json", str(summary)]) == 0
    s = json.loads(summary.read_text())
    assert s["steps"] == 3 * (-(-5400 // 128)) and s["eval_num_samples"] == 600
    assert s["eval_auc"] > 0.65, s  # learned from the sparse features


def test_parquet_input_with_list_column_equals_csv(tmp_path):
    _write_generic_csv(tmp_path / "t.csv", 700, seed=1)
    clicked, age, price, users, items, cities = _generic_rows(700, seed=1)
    table = pa.table({
        "clicked": clicked, "age": age.astype(float), "price": pa.array([None if np.isnan(p) else float(f"{p:.3f}") for p in price]), "user": users,
        "items": pa.array([list(map(int, x)) for x in items], pa.list_(pa.int64())), "city": cities,
    })
    pq.write_table(table, tmp_path / "t.parquet")
    schema = schema_from_dict(GENERIC_SCHEMA)
    _prep([tmp_path / "t.csv"], tmp_path / "a", schema=schema, fmt="csv", workers=1)
    pschema = schema_from_dict({**GENERIC_SCHEMA, "header": False, "sparse": [
        GENERIC_SCHEMA["sparse"][0], {"name": "items", "kind": "int", "multi_hot": True, "table_rows": 300},
        GENERIC_SCHEMA["sparse"][2]]})
    _prep([tmp_path / "t.parquet"], tmp_path / "b", schema=pschema, fmt="parquet", block_bytes=256 * 300)
    ra = list(ShardedReader(PreparedDataset.open(tmp_path / "a"), 100))
    rb = list(ShardedReader(PreparedDataset.open(tmp_path / "b"), 100))
    assert len(ra) == len(rb) == 7 and all(_same_batch(x, y) for x, y in zip(ra, rb))


def test_schema_errors_name_the_field(tmp_path):
    with pytest.raises(SchemaError, match="sparse feature 'x': transform 'hash' needs table_rows"):
        schema_from_dict({"label": "y", "sparse": ["x"]})
    with pytest.raises(SchemaError, match="kind must be one of"):
        schema_from_dict({"label": "y", "sparse": [{"name": "x", "kind": "float", "table_rows": 3}]})
    with pytest.raises(SchemaError, match="--table-rows N"):
        build_schema("criteo-tsv", None, None, None)
    with pytest.raises(SchemaError, match="--schema: required"):
        build_schema("csv", None, [10], None)
    (tmp_path / "d.csv").write_text("a,b\n1,2\n")
    (tmp_path / "s.json").write_text(json.dumps({"label": "a", "header": True, "sparse": [{"name": "zz", "table_rows": 5}]}))
    assert main(["data", "prepare", "--input", str(tmp_path / "d.csv"), "--format", "csv", "--schema",
                 str(tmp_path / "s.json"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2


@needs_criteo
def test_vocabulary_with_frequency_threshold(tmp_path):
    schema = build_schema("criteo-tsv", None, None, 5)
    r = _prep([TSV900], tmp_path / "v", schema=schema, workers=2)
    d = read_criteo_tsv(TSV900, [2**40] * 26)  # ids = 1 + hash mod (2^40 - 1) = 1 + hash: raw values, 0 = missing
    ds = PreparedDataset.open(tmp_path / "v")
    got = next(iter(ShardedReader(ds, 900)))
    for j, name in enumerate(d.sparse_names):
        raw = d.sparse[:, j]
        vals, counts = np.unique(raw[raw != 0], return_counts=True)
        vocab = np.sort(vals[counts >= 5])
        assert r.table_rows[name] == 2 + vocab.size
        pos = np.searchsorted(vocab, raw)
        found = (pos < vocab.size) & (vocab[np.minimum(pos, max(vocab.size - 1, 0))] == raw) if vocab.size else raw < 0
        want = np.where(raw == 0, 0, np.where(found, pos + 2, 1))
        assert got.sparse.values[j * 900 : (j + 1) * 900].tolist() == want.tolist(), name


@needs_criteo
def test_train_loader_starts_mid_epoch(tmp_path):
    """The checkpoint contract: an epoch started at batch i yields exactly batches i.. of an
    uninterrupted epoch, for prepared directories and for the file sources."""
    from recscale.train.datasets import build_data

    _prep([TSV900], tmp_path / "p")
    common = ["model.table_rows=1000", "train.batch_size=64", "data.num_workers=0", "data.shuffle_window=128"]
    for source in (["data.source=prepared", f"data.train_path={tmp_path / 'p'}"],
                   ["data.source=criteo_tsv", f"data.train_path={TSV900}"]):
        data = build_data(load_config(None, common + source))
        data.train.set_epoch(1)
        whole = list(data.train_loader())
        data.train.set_epoch(1)
        part = list(data.train_loader(start_batch=5))
        assert len(part) == len(whole) - 5 and all(_same_batch(a, b) for a, b in zip(part, whole[5:]))


def test_a_failed_prepare_leaves_nothing_and_a_rerun_needs_no_overwrite(tmp_path):
    """prepare writes into a hidden sibling folder and renames it into place at the end: a bad
    row late in the input (after several shards were written) leaves no trace at --out."""
    good = [_tsv_row(label=str(i % 2), dense=str(i)) for i in range(300)]
    f = tmp_path / "d.tsv"
    f.write_text("\n".join(good + [_tsv_row(label="7")]) + "\n")
    out = tmp_path / "p"
    with pytest.raises(DataFormatError, match="d.tsv:301: label 'label' must be 0 or 1"):
        _prep([f], out, block_bytes=4_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.tsv"]
    with pytest.raises(DataFormatError, match="d.tsv:301"):
        _prep([f], out, block_bytes=4_000, workers=2)  # the error crosses the process boundary whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.tsv"]
    r = _prep([f], out, block_bytes=4_000, skip_bad_rows=True)  # the same --out, no --overwrite
    assert r.rows == 300 and r.shards > 5 and PreparedDataset.open(out).num_rows == 300
    f.write_text("\n".join(good[:100]) + "\n")
    assert _prep([f], out, overwrite=True).rows == 100  # replaced whole; the old folder is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.tsv", "p"]
    assert PreparedDataset.open(out).num_rows == 100
