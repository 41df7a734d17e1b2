"""Miss-ratio curves against the tier's measured hit rates, and the placement and cache sizes
the planner chooses on them."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.data.synthetic import SyntheticClickData, SyntheticConfig
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.tier_hooks import close_tiers
from recscale.embedding.tiered import TierSettings, tiered_storage_factory
from recscale.planner.miss_curve import segments_access, zipf_access
from recscale.train.config import ConfigError, TiersConfig, TierTableConfig
from recscale.train.tier_plan import miss_seconds, plan_tiers, row_bytes

ROWS, POOLING, BATCH, STEPS, WINDOW = 8000, 2, 128, 60, 2


def measured_hit_rate(alpha: float, cache: int, policy: str, tmp_path) -> float:
    """The tier's own ``cache_hit_rate`` on the synthetic generator's ids, driven as the training
    pipeline drives it (the next ``WINDOW`` batches announced ahead)."""
    data = SyntheticClickData(SyntheticConfig(BATCH * STEPS, (ROWS,), (POOLING,), zipf_alpha=alpha, seed=3))
    table = TableConfig("t_s0", ROWS, 4, features=("s0",))
    fac = tiered_storage_factory({table.name: ("ssd", cache)}, TierSettings(str(tmp_path), policy, WINDOW, 0), seed=0)
    m = TableBatchedEmbeddingBags([table], RowWiseAdagrad(lr=0.01), storage_factory=fac)
    storage = m.groups[0].storage
    ids = [data.make_samples(i * BATCH, BATCH).sparse.values for i in range(STEPS)]
    ahead = 0
    with torch.enable_grad():  # training lookups: the ones the counters count
        for i in range(STEPS):
            while ahead < min(STEPS, i + 1 + WINDOW):
                storage.announce(ids[ahead])
                ahead += 1
            storage.begin_batch()
            storage.slots_for(ids[i])
    stats = storage.stats
    close_tiers(m)
    return stats.hits / stats.lookups


@pytest.mark.parametrize("alpha", [1.05, 0.8])
def test_predicted_hit_rate_is_within_two_points_of_the_tiers(tmp_path, alpha):
    access = zipf_access(ROWS, alpha, BATCH * POOLING)
    for share, policy in itertools.product((0.1, 0.25), ("lru", "lookahead", "lfu")):
        cache = int(share * ROWS)
        measured = measured_hit_rate(alpha, cache, policy, tmp_path)
        predicted = access.hit_rate(policy, cache, STEPS, WINDOW)
        assert abs(predicted - measured) <= 0.02, (alpha, share, policy, predicted, measured)


def test_curves_are_monotone_and_bounded():
    for alpha in (1.05, 0.8):
        access = zipf_access(50_000, alpha, 4096.0)
        for policy in ("lru", "lfu", "lookahead"):
            for steps in (0, 200):
                h = [access.hit_rate(policy, c, steps) for c in (500, 2000, 8000, 30000, 50_000)]
                assert all(0 <= a <= b + 1e-9 <= 1 + 1e-9 for a, b in zip(h, h[1:])), (policy, steps, h)
        # The c most frequent rows bound a cache that sees a couple of batches ahead; lru is below.
        for c in (1000, 10_000):
            assert access.hit_rate("lru", c) < access.hit_rate("lookahead", c)
    # Every row that is ever looked up fits: only first lookups miss.
    small = zipf_access(300, 1.05, 64.0)
    assert small.hit_rate("lru", 300) == pytest.approx(1.0)
    assert small.hit_rate("lookahead", 300, steps=50) < 1.0


def test_stats_segments_and_zipf_agree_on_the_same_distribution():
    """A table's measured (rows, probability) pieces give the curve the law itself gives."""
    z = zipf_access(20_000, 1.05, 512.0, scatter=False)
    pieces = [(float(r), float(p)) for r, p in zip(z.rows, z.prob)]
    s = segments_access(pieces[::-1], 20_000, 512.0)  # any order
    for c in (500, 5000):
        assert s.hit_rate("lru", c) == pytest.approx(z.hit_rate("lru", c), abs=1e-9)
        assert s.hit_rate("lookahead", c) == pytest.approx(z.hit_rate("lookahead", c), abs=1e-9)


TABLES = [
    TableConfig("hot", 20_000, 16),  # small and looked up a lot
    TableConfig("big", 400_000, 16),
    TableConfig("cold", 200_000, 16),
]
ACCESS = {  # ranks as rows: every row is looked up now and then
    "hot": zipf_access(20_000, 0.8, 8192.0, scatter=False),
    "big": zipf_access(400_000, 1.05, 4096.0, scatter=False),
    "cold": zipf_access(200_000, 1.2, 1024.0, scatter=False),
}
OPT = RowWiseAdagrad(lr=0.01)


@functools.lru_cache(maxsize=None)
def _seconds(name: str, rows: int, policy: str) -> float:
    a, t = ACCESS[name], next(t for t in TABLES if t.name == name)
    window = TiersConfig().lookahead_batches  # the planner's: the config's default
    return a.lookups_per_batch() * (1 - a.hit_rate(policy, rows, 0, window)) * miss_seconds(row_bytes(t, OPT))


def _predicted_seconds(placement: dict[str, tuple[str, int]], policy: str = "lookahead") -> float:
    return sum(_seconds(n, rows, policy) for n, (where, rows) in placement.items() if where == "ssd")


def _ram(placement: dict[str, tuple[str, int]]) -> int:
    return sum((t.num_rows if placement[t.name][0] == "ram" else placement[t.name][1]) * row_bytes(t, OPT) for t in TABLES)


@settings(max_examples=8, deadline=None)
@given(budget_mb=st.integers(4, 40), policy=st.sampled_from(["lru", "lookahead"]))
def test_plan_keeps_to_the_budget_and_beats_every_grid_split(budget_mb, policy):
    tiers = TiersConfig(ram_budget_mb=budget_mb, ssd_dir="/unused", policy=policy)
    plan = plan_tiers(tiers, TABLES, OPT, ACCESS)
    placement = plan.placement()
    assert _ram(placement) <= budget_mb * 2**20
    assert plan.io_seconds_per_step() == pytest.approx(_predicted_seconds(placement, policy), rel=1e-9)
    # Any split of the budget over the three tables on a grid of cache sizes does no better.
    budget = budget_mb * 2**20
    grids = {t.name: np.unique(np.geomspace(ACCESS[t.name].min_cache_rows(), t.num_rows, 12).astype(int)).tolist()
             for t in TABLES}
    best = float("inf")
    for combo in itertools.product(*(grids[t.name] for t in TABLES)):
        cand = {t.name: ("ssd", int(c)) if c < t.num_rows else ("ram", 0) for t, c in zip(TABLES, combo)}
        if _ram(cand) <= budget:
            best = min(best, _predicted_seconds(cand, policy))
    assert plan.io_seconds_per_step() <= best * 1.001 + 1e-12


def test_hot_small_tables_stay_in_ram_and_explicit_settings_win():
    tiers = TiersConfig(ram_budget_mb=12, ssd_dir="/unused")
    plan = {t.table: t for t in plan_tiers(tiers, TABLES, OPT, ACCESS).tables}
    assert plan["hot"].tier == "ram" and plan["big"].tier == "ssd" and plan["cold"].tier == "ssd"
    # The cache of the table with the flatter curve per byte gets the larger share.
    assert 0 < plan["cold"].cache_rows < plan["big"].cache_rows
    tiers = TiersConfig(ram_budget_mb=20, ssd_dir="/unused",
                        tables={"hot": TierTableConfig("ssd", 5000), "cold": TierTableConfig("ram")})
    placement = plan_tiers(tiers, TABLES, OPT, ACCESS).placement()
    assert placement["hot"] == ("ssd", 5000) and placement["cold"] == ("ram", 0) and placement["big"][0] == "ssd"
    # A budget that holds everything keeps everything in RAM.
    assert set(plan_tiers(TiersConfig(ram_budget_mb=1000, ssd_dir="/unused"), TABLES, OPT, ACCESS).placement().values()) == {("ram", 0)}


def test_a_budget_below_one_batch_per_cache_is_a_clear_error():
    with pytest.raises(ConfigError, match="no RAM is left for its cache.*tiers.ram_budget_mb"):
        plan_tiers(TiersConfig(ram_budget_mb=1, ssd_dir="/unused", tables={"hot": TierTableConfig("ram")}), TABLES, OPT, ACCESS)


def test_training_reports_the_predicted_hit_rate_beside_the_measured_one(tmp_path):
    from recscale.train.config import load_config
    from recscale.train.loop import train

    cfg = load_config(None, [
        "data.source=synthetic", "data.num_samples=9600", "data.eval_samples=128", "data.pooling_factors=[1, 2]",
        "data.zipf_alpha=0.9", "data.num_workers=0", "model.table_rows=[60000, 8000]", "model.embedding_dim=8",
        "model.bottom_mlp=[16, 8]", "train.batch_size=96", "train.progress=false", "train.threads=1",
        "tiers.ram_budget_mb=1", f"tiers.ssd_dir={tmp_path}", "tiers.io_threads=2",
    ])
    out = train(cfg, log=lambda _: None)
    assert out["steps"] == 100
    assert 0 < out["cache_hit_rate"] < 1
    assert abs(out["predicted_cache_hit_rate"] - out["cache_hit_rate"]) <= 0.02, out


def test_recscale_plan_shows_each_tables_tier_cache_and_predicted_hit_rate(tmp_path, capsys):
    from recscale.cli import main

    assert main(["plan", "--world-size", "1", "--search-steps", "10", "--set", "model.table_rows=[200000, 300]",
                 "--set", "data.pooling_factors=[1, 4]", "--set", "train.batch_size=512",
                 "--set", "tiers.ram_budget_mb=2", "--set", f"tiers.ssd_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    tier = out[out.index("tiers (one process; RAM budget 2 MiB)"):].splitlines()
    assert tier[1].split()[:3] == ["table", "tier", "cache"]
    rows = {line.split()[0]: line.split() for line in tier[3:5]}
    assert rows["t_s0"][1] == "ssd" and 0 < int(rows["t_s0"][2].replace(",", "")) < 200_000
    assert 0 < float(rows["t_s0"][5]) < 1
    # One batch looks up nearly every row it ever looks up: they all fit, in RAM or in its cache.
    assert rows["t_s1"][1] == "ram" or float(rows["t_s1"][5]) == 1.0
    assert "predicted hit rate" in tier[5]
