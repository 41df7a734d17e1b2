"""The planner takes each feature's name, pooling, size and skew from the data's statistics
(``stats.json`` of ``recscale data prepare``), not from built-in Criteo assumptions."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.cli import main
from recscale.data.stats import FeatureCounts
from recscale.planner.feature_stats import FeatureLoad, loads_from_ids
from recscale.planner.hardware import LOCAL_CPU
from recscale.planner.search import plan_tables, score_plan
from recscale.train.config import load_config
from recscale.train.planning import table_specs, workload

ROWS = 20_000
SCHEMA = {
    "label": "label", "header": True, "dense": ["x"],
    "sparse": [{"name": "a", "list_separator": "|", "table_rows": ROWS}]
    + [{"name": n, "table_rows": ROWS} for n in ("b", "c", "d")],
}


def _prepared(tmp_path: Path, name: str, pooling_a: int) -> Path:
    rng = np.random.default_rng(0)
    lines = ["label,x,a,b,c,d"]
    for r in range(1500):
        a = "|".join(str(v) for v in rng.integers(0, ROWS, pooling_a))
        b, c, d = rng.integers(0, ROWS, 3)
        lines.append(f"{r % 2},1.0,{a},{b},{c},{d}")
    (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    out = tmp_path / name
    assert main(["data", "prepare", "--input", str(tmp_path / f"{name}.csv"), "--format", "csv", "--schema",
                 str(tmp_path / "schema.json"), "--out", str(out), "--workers", "0", "--no-progress"]) == 0
    return out


def _cfg(root: Path):
    return load_config(None, ["data.source=prepared", f"data.train_path=\"{root}\"", "train.batch_size=4096",
                              "model.embedding_dim=64", "model.bottom_mlp=[64, 64]"])


def test_plan_follows_the_pooling_in_stats_json(tmp_path, capsys):
    """Feature a with 50 ids per sample (the others 1) costs 50x the lookups: the plan made from
    stats.json spreads it differently from the plan for uniform pooling, and the cost model
    predicts the data-aware plan faster on that data than the uniform-pooling plan."""
    hot, flat = _prepared(tmp_path, "hot", 50), _prepared(tmp_path, "flat", 1)
    hot_specs, flat_specs = table_specs(_cfg(hot)), table_specs(_cfg(flat))
    assert [(s.name, s.rows, s.pooling) for s in hot_specs] == [
        ("t_a", ROWS, 50.0), ("t_b", ROWS, 1.0), ("t_c", ROWS, 1.0), ("t_d", ROWS, 1.0)]
    assert all(s.pooling == 1.0 for s in flat_specs)
    # More ids per batch over the same rows: more of them repeat.
    assert hot_specs[0].unique_fraction < 0.5 * hot_specs[1].unique_fraction

    hw, wl = LOCAL_CPU.with_world(2, 2), workload(_cfg(hot))
    hot_plan = plan_tables(hot_specs, hw, wl)
    flat_plan = plan_tables(flat_specs, hw, wl)
    kind = {name: {t.table: t.sharding_type for t in r.plan.tables} for name, r in (("hot", hot_plan), ("flat", flat_plan))}
    assert kind["hot"]["t_a"] != kind["flat"]["t_a"]
    uniform_on_hot = score_plan(flat_plan.plan, hot_specs, hw, wl).max_rank_s
    assert hot_plan.max_rank_s < uniform_on_hot
    assert hot_plan.max_rank_s > flat_plan.max_rank_s  # the 50 ids per sample cost time

    assert main(["plan", "--data", str(hot), "--topology", "local-cpu", "--world-size", "2",
                 "--set", "model.embedding_dim=64", "--set", "model.bottom_mlp=[64, 64]"]) == 0
    out = capsys.readouterr().out
    assert "4 tables on 2 ranks" in out and "t_a" in out


def test_unique_fraction_from_statistics_matches_drawn_batches():
    """Skewed ids: the estimate from the summary stats.json keeps (ten hot ids, the top 1% and
    10% shares, the cardinality) is close to the distinct share of batches drawn alike."""
    rng = np.random.default_rng(0)
    n_ids = 50_000
    p = 1.0 / np.arange(1, n_ids + 1) ** 1.05
    p /= p.sum()
    sample = rng.choice(n_ids, 400_000, p=p)
    doc = FeatureCounts.of_block(sample, np.ones(sample.size, dtype=np.int64)).summary(n_ids)
    load = FeatureLoad("f", 1.0, doc["cardinality"], sample.size, tuple(c for _, c in doc["top_ids"]),
                       doc["top_1pct_share"], doc["top_10pct_share"])
    for batch in (1024, 16_384):
        measured = np.mean([np.unique(rng.choice(n_ids, batch, p=p)).size / batch for _ in range(5)])
        assert load.unique_fraction(batch) == pytest.approx(measured, rel=0.12), batch
    # Uniform ids over few values: almost every id of a big batch repeats.
    flat = loads_from_ids(("f",), rng.integers(0, 100, (10_000, 1)))["f"]
    assert flat.cardinality == 100 and flat.unique_fraction(4096) == pytest.approx(100 / 4096, rel=0.01)


def test_criteo_file_specs_come_from_its_ids(tmp_path):
    """A pre-encoded Criteo CSV: the file's feature names, its sizes (largest id + 1) and the
    skew of its own ids, not a fixed half of the ids distinct."""
    rng = np.random.default_rng(0)
    n = 600
    ids = rng.integers(0, 5000, (n, 26))
    ids[:, 0] = rng.integers(0, 3, n)  # C1: three values, every batch repeats them
    ids[:, 1] = np.arange(n)  # C2: every id once
    rows = np.concatenate([rng.integers(0, 2, (n, 1)), rng.integers(0, 9, (n, 13)), ids], axis=1)
    path = tmp_path / "enc.csv"
    np.savetxt(path, rows, fmt="%d", delimiter=",")
    cfg = load_config(None, ["data.source=criteo_encoded_csv", f"data.train_path=\"{path}\"", "data.eval_fraction=0.1",
                             "train.batch_size=256"])
    specs = table_specs(cfg)
    assert [s.name for s in specs] == [f"t_C{i + 1}" for i in range(26)]
    train_ids = ids[: n - 60]  # the held-out tail is not training data
    assert [s.rows for s in specs] == [int(v) + 1 for v in ids.max(axis=0)]
    assert all(s.pooling == 1.0 for s in specs)
    assert specs[0].unique_fraction == pytest.approx(3 / 256, rel=0.05)
    # 540 ids seen once each: a batch of 256 drawn alike repeats some of them
    assert specs[1].unique_fraction == pytest.approx(540 * (1 - (1 - 1 / 540) ** 256) / 256, rel=1e-3)
    expect = loads_from_ids(("C3",), train_ids[:, 2:3])["C3"].unique_fraction(256)
    assert specs[2].unique_fraction == pytest.approx(expect) and specs[2].unique_fraction != 0.5


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(0, 10**9), min_size=1, max_size=300))
def test_distinct_rows_counts_like_unique(num_rows, raw):
    """The marked count of distinct rows equals numpy's sorted count, small tables or large."""
    from recscale.data.synthetic import _distinct

    rows = np.array([x % num_rows for x in raw], dtype=np.int64)
    assert _distinct(rows, num_rows) == np.unique(rows).size
    big = np.array(raw, dtype=np.int64) + (1 << 27)  # past the marking bound: the sort counts
    assert _distinct(big, 1 << 31) == np.unique(big).size
