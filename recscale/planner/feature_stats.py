"""What the planner needs to know of each sparse feature of a dataset, read from its statistics.

``recscale data prepare`` writes ``stats.json`` (``recscale.data.stats``): per feature the mean
ids per sample (pooling), the distinct ids seen (cardinality), the ten hottest ids' counts and
the lookup share of the hottest 1% and 10% of ids. From those the planner takes each table's
pooling and estimates how many distinct rows a global batch touches (its ``unique_fraction``):
the ids are modelled as the ten hot ids with their own frequencies, then the rest of the top
1%, the next 9% and the other 90% each sharing their measured share evenly, and the expected
number of distinct ids among ``n`` draws is ``sum_i 1 - (1 - p_i)^n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.stats import FeatureCounts, read_stats


@dataclass(frozen=True)
class FeatureLoad:
    """One sparse feature's lookups, as measured on its data."""

    name: str
    pooling: float  # mean ids per sample
    cardinality: int  # distinct ids seen
    lookups: int  # ids looked up over the whole dataset
    top_counts: tuple[int, ...] = ()  # the hottest ids' counts, hottest first
    top_1pct_share: float = 0.0  # share of lookups that go to the hottest 1% of the distinct ids
    top_10pct_share: float = 0.0

    def _segments(self) -> list[tuple[float, float]]:
        """(ids, probability of each) pieces of the modelled id distribution."""
        total = max(self.lookups, 1)
        card = max(self.cardinality, len(self.top_counts), 1)
        out = [(1.0, c / total) for c in self.top_counts]
        done_ids, done_share = len(self.top_counts), sum(self.top_counts) / total
        points = [(max(1, round(card * 0.01)), self.top_1pct_share), (max(1, round(card * 0.10)), self.top_10pct_share),
                  (card, 1.0)]
        for k, share in points:
            if k <= done_ids:
                continue
            share = min(max(share, done_share), 1.0)
            n = k - done_ids
            out.append((float(n), (share - done_share) / n))
            done_ids, done_share = k, share
        return out

    def id_segments(self) -> list[tuple[float, float]]:
        """The modelled id distribution as (ids, probability of each) pieces, hottest first."""
        return self._segments()

    def unique_fraction(self, global_batch: int) -> float:
        """Expected distinct ids / ids of one global batch (1: no id repeats)."""
        n = global_batch * self.pooling
        if n <= 0:
            return 1.0
        distinct = sum(count * -np.expm1(n * np.log1p(-min(p, 1.0 - 1e-12))) for count, p in self._segments() if p > 0)
        return float(min(max(distinct / n, 1.0 / n), 1.0))


def loads_from_stats(doc: dict[str, Any]) -> dict[str, FeatureLoad]:
    """Each feature's load from a parsed ``stats.json`` (``recscale.data.stats.read_stats``)."""
    out = {}
    for name, f in doc["features"].items():
        pooling = float(f["mean_pooling"])
        lookups = int(round(pooling * int(doc["rows"])))
        out[name] = FeatureLoad(
            name, pooling, int(f["cardinality"]), lookups, tuple(int(c) for _, c in f.get("top_ids", [])),
            float(f.get("top_1pct_share", 0.0)), float(f.get("top_10pct_share", 0.0)),
        )
    return out


def loads_from_prepared(root: str | Path) -> dict[str, FeatureLoad]:
    """The loads recorded in a prepared directory's ``stats.json``."""
    path = Path(root) / "stats.json"
    try:
        return loads_from_stats(read_stats(path))
    except FileNotFoundError:
        raise ValueError(f"'{root}' has no stats.json; prepare it again with `recscale data prepare`") from None


def loads_from_ids(names: tuple[str, ...], ids: np.ndarray) -> dict[str, FeatureLoad]:
    """Loads of one-id-per-sample features from their ids (``[samples, features]``), counted the
    way ``recscale data prepare`` counts them."""
    out = {}
    for j, name in enumerate(names):
        col = ids[:, j]
        doc = FeatureCounts.of_block(col, np.ones(col.size, dtype=np.int64)).summary(1)
        out[name] = FeatureLoad(name, 1.0, int(doc["cardinality"]), int(col.size),
                                tuple(int(c) for _, c in doc["top_ids"]), doc["top_1pct_share"], doc["top_10pct_share"])
    return out
