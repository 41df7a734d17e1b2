"""The file-less replay of the tier (``tier_sim``) gives the tier's own hit rates: equal to a
real tier's, file and prefetch included, trained on the same trace, for every policy and
window; the numpy offline Belady equals its plain definition on any trace; the fast victim
selection equals a full stable sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.eviction import EvictionPolicy
from recscale.embedding.tier_hooks import announce_batch, begin_batch, close_tiers, tier_stats
from recscale.embedding.tier_sim import belady_hit_rate, replay_hit_rate
from recscale.embedding.tiered import TierSettings, tiered_storage_factory
from recscale.sparse import JaggedBatch
from test_tiered import _one_thread  # noqa: F401  (autouse: one torch thread for tiny tables)


def _trace(rows: int, n: int, ids: int, seed: int) -> list[torch.Tensor]:
    """Skewed ids: a power of a uniform, so some rows are hot and most cold."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(ids, generator=gen) ** 3 * rows).long() for _ in range(n)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lookahead"])
@pytest.mark.parametrize("window", [0, 3])
def test_replay_equals_the_real_tier(tmp_path, policy, window):
    rows, trace = 600, _trace(600, 30, 96, seed=window)
    low = max(int(torch.unique(t).numel()) for t in trace)
    table = TableConfig("t", rows, 4, ("f",))
    for cache in (low, low + 40, 3 * low):
        fac = tiered_storage_factory({"t": ("ssd", cache)}, TierSettings(str(tmp_path), policy, window, 2, 1), seed=0)
        m = TableBatchedEmbeddingBags([table], RowWiseAdagrad(lr=0.1), storage_factory=fac)
        batches = [JaggedBatch(("f",), ids, torch.full((8,), 12, dtype=torch.int64)) for ids in trace]
        ahead = 0
        for i, b in enumerate(batches):  # trained, as the pipeline drives it
            while window and ahead < min(len(batches), i + 1 + window):
                announce_batch(m, batches[ahead])
                ahead += 1
            begin_batch(m)
            m(b).sum().backward()
        stats = tier_stats(m)
        close_tiers(m)
        real = stats.hits / stats.lookups
        assert replay_hit_rate(rows, trace, cache, policy, window) == real, (policy, window, cache)
        assert 0 < real < 1


def _belady_reference(batches: list[np.ndarray], cache: int) -> float:
    """The plain definition: sets, and every cached row sorted by its next use."""
    nxt: dict[int, list[int]] = {}
    for t in range(len(batches) - 1, -1, -1):
        for r in batches[t].tolist():
            nxt.setdefault(r, []).append(t)
    cached: set[int] = set()
    hits = lookups = 0
    for rows in batches:
        rows_l = rows.tolist()
        for r in rows_l:
            nxt[r].pop()
        missing = [r for r in rows_l if r not in cached]
        lookups += len(rows_l)
        hits += len(rows_l) - len(missing)
        over = len(cached) + len(missing) - cache
        if over > 0:
            cur = set(rows_l)
            cand = [r for r in cached if r not in cur]
            far = sorted(cand, key=lambda r: (nxt[r][-1] if nxt[r] else 1 << 40), reverse=True)[:over]
            cached.difference_update(far)
        cached.update(missing)
    return hits / max(lookups, 1)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 200), n=st.integers(1, 25), per=st.integers(1, 40), extra=st.integers(0, 120),
       seed=st.integers(0, 2**31 - 1))
def test_numpy_belady_equals_its_definition(rows, n, per, extra, seed):
    rng = np.random.default_rng(seed)
    batches = [np.unique((rng.random(per) ** 2 * rows).astype(np.int64)) for _ in range(n)]
    cache = max(b.size for b in batches) + extra
    assert belady_hit_rate(batches, cache) == pytest.approx(_belady_reference(batches, cache), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(slots=st.integers(1, 300), k=st.integers(0, 320), span=st.integers(1, 50),
       policy=st.sampled_from(["lru", "lfu", "lookahead"]), seed=st.integers(0, 2**31 - 1))
def test_victims_equal_a_stable_sort(slots, k, span, policy, seed):
    gen = torch.Generator().manual_seed(seed)
    pol = EvictionPolicy(policy, slots)
    pol.last_use = torch.randint(0, span, (slots,), generator=gen)  # few distinct values: many ties
    pol.freq = torch.randint(0, span, (slots,), generator=gen)
    evictable = torch.rand(slots, generator=gen) < 0.8
    next_use = torch.randint(-1, 3, (slots,), generator=gen)
    uses = torch.randint(0, span, (slots,), generator=gen, dtype=torch.int32)
    key = pol.rank(next_use, uses)
    key = torch.where(evictable, key, torch.full_like(key, -1))
    want = torch.sort(key, descending=True, stable=True).indices[:k].sort().values
    assert torch.equal(pol.victims(k, evictable, next_use, uses), want)
