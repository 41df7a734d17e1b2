"""The lookahead window reaches past the prefetch depth: eviction knows more batches than are
read ahead, which brings its hit rate to offline Belady's on a skewed trace, while only the
first ``prefetch_batches`` announced batches are read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recscale.embedding import SGD, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.tier_hooks import close_tiers
from recscale.embedding.tiered import TierSettings, tiered_storage_factory


def _trace(rows: int, batches: int, ids: int, seed: int) -> list[torch.Tensor]:
    """Zipf-like ids (rank ** -1.05 probabilities over a random permutation of the rows)."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -1.05
    perm = rng.permutation(rows)
    return [torch.from_numpy(perm[rng.choice(rows, ids, p=p / p.sum())]) for _ in range(batches)]


def _belady(trace: list[torch.Tensor], cache: int) -> float:
    """Offline Belady per batch (every future batch known), distinct rows per batch."""
    uniq = [set(torch.unique(b).tolist()) for b in trace]
    cached: set[int] = set()
    hits = lookups = 0
    for t, rows in enumerate(uniq):
        missing = rows - cached
        hits += len(rows) - len(missing)
        lookups += len(rows)
        over = len(cached) + len(missing) - cache
        if over > 0:
            def next_use(r: int) -> int:
                return next((j for j in range(t + 1, len(uniq)) if r in uniq[j]), 1 << 30)
            cand = sorted(cached - rows, key=lambda r: (-next_use(r), r))
            cached.difference_update(cand[:over])
        cached |= missing
    return hits / lookups


def _hit_rate(tmp_path, trace, cache: int, policy: str, window: int, prefetch: int | None) -> float:
    t = TableConfig("t", 600, 4, ("f",))
    settings = TierSettings(str(tmp_path), policy, window, 0, prefetch)
    factory = tiered_storage_factory({"t": ("ssd", cache)}, settings, 0)
    m = TableBatchedEmbeddingBags([t], SGD(), storage_factory=factory)
    st = m.groups[0].storage
    ahead = 0
    for i in range(len(trace)):
        while ahead < min(len(trace), i + 1 + window):
            st.announce(trace[ahead])
            ahead += 1
        st.begin_batch()
        st.slots_for(trace[i])
    rate = st.stats.hits / st.stats.lookups
    close_tiers(m)
    return rate


def test_a_window_past_the_prefetch_depth_reaches_belady(tmp_path):
    trace = _trace(600, 40, 60, seed=0)
    cache = 150  # a quarter of the rows
    belady = _belady(trace, cache)
    lru = _hit_rate(tmp_path, trace, cache, "lru", 0, None)
    short = _hit_rate(tmp_path, trace, cache, "lookahead", 1, 1)
    long = _hit_rate(tmp_path, trace, cache, "lookahead", 20, 1)  # reads only one batch ahead
    assert long >= belady - 0.01, (long, belady)
    assert long > short and long >= lru + 0.03, (long, short, lru)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_only_the_prefetch_depth_is_read_ahead(tmp_path, prefetch):
    trace = _trace(600, 12, 40, seed=1)
    t = TableConfig("t", 600, 4, ("f",))
    settings = TierSettings(str(tmp_path), "lookahead", 8, 0, prefetch)
    m = TableBatchedEmbeddingBags([t], SGD(), storage_factory=tiered_storage_factory({"t": ("ssd", 200)}, settings, 0))
    st = m.groups[0].storage
    for b in trace[:9]:  # the batch about to train and eight ahead
        st.announce(b)
    seg = st.segments[0]
    assert len(st._window) == 9
    assert st._issued == (0 if prefetch == 0 else 1 + prefetch)  # that batch and the depth
    assert seg.next_read <= st._issued  # a batch with nothing missing needs no read
    st.begin_batch()
    st.slots_for(trace[0])
    st.begin_batch()  # each batch begun brings one more announced batch within the depth
    assert st._issued == (2 if prefetch == 0 else 3 + prefetch)
    assert (seg.next_read == 0) == (prefetch == 0)
    close_tiers(m)
