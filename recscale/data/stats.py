"""Dataset statistics written by ``prepare`` (``stats.json``), in a format the planner can read.

Format ``recscale-data-stats/1``::

    {"format": "recscale-data-stats/1", "rows": N, "positive_rate": p,
     "dense": {name: {"mean": m, "missing_rate": r}},
     "features": {name: {"table_rows": R,          # rows of the feature's embedding table
                         "cardinality": C,          # distinct ids seen (estimate when not exact)
                         "cardinality_exact": bool,
                         "mean_pooling": f,         # mean ids per sample (pooling factor)
                         "max_pooling": m,
                         "missing_rate": r,         # share of samples with no id
                         "top_ids": [[id, count], ...],         # the 10 hottest ids
                         "top_1pct_share": s, "top_10pct_share": s,  # lookups to the hottest 1% / 10% of seen ids
                         "oov_lookups": n, "oov_rate": r}}}  # lookups of values outside the vocabulary (id 1)

Counts are exact while a feature has at most ``EXACT_DISTINCT`` distinct ids; past that the
hottest ids are kept (a heavy-hitter summary, so the top shares are close lower bounds) and the
cardinality is a k-minimum-values estimate (about 3% error), so memory stays bounded on any log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recscale.atomic import write_text_atomic

STATS_FORMAT = "recscale-data-stats/1"
EXACT_DISTINCT = 200_000
KMV_K = 1024
TOP_IDS = 10


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def merge_sorted_counts(
    a: np.ndarray, ca: np.ndarray, b: np.ndarray, cb: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sum two (sorted distinct keys, counts) tables. A stable sort of two sorted runs is a
    linear merge (timsort), so the main process keeps up with the workers on big logs."""
    keys = np.concatenate([a, b])
    counts = np.concatenate([ca, cb])
    order = np.argsort(keys, kind="stable")
    keys, counts = keys[order], counts[order]
    if keys.size == 0:
        return keys, counts.astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    return keys[starts], np.add.reduceat(counts, starts).astype(np.int64)


def _smallest(h: np.ndarray, k: int) -> np.ndarray:
    h = np.unique(h)
    return h[:k]


@dataclass
class FeatureCounts:
    """Per-feature counts of one block (made in a worker) or of the whole dataset (merged)."""

    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sketch: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    lookups: int = 0
    samples: int = 0
    missing: int = 0
    max_pooling: int = 0
    exact: bool = True
    oov: int = 0  # lookups of the out-of-vocabulary id (vocabulary features only)

    @staticmethod
    def of_block(ids: np.ndarray, lengths: np.ndarray, oov: int = 0) -> FeatureCounts:
        uniq, counts = np.unique(ids, return_counts=True)
        return FeatureCounts(
            ids=uniq,
            counts=counts.astype(np.int64),
            sketch=_smallest(_mix(uniq), KMV_K),
            lookups=int(ids.size),
            samples=int(lengths.size),
            missing=int((lengths == 0).sum()),
            max_pooling=int(lengths.max(initial=0)),
            oov=oov,
        )

    def merge(self, other: FeatureCounts) -> None:
        self.ids, self.counts = merge_sorted_counts(self.ids, self.counts, other.ids, other.counts)
        self.exact = self.exact and other.exact
        if self.ids.size > EXACT_DISTINCT:  # keep the hottest half: a heavy-hitter summary
            keep = np.sort(np.argpartition(-self.counts, EXACT_DISTINCT // 2)[: EXACT_DISTINCT // 2])
            self.ids, self.counts, self.exact = self.ids[keep], self.counts[keep], False
        self.sketch = _smallest(np.concatenate([self.sketch, other.sketch]), KMV_K)
        self.lookups += other.lookups
        self.samples += other.samples
        self.missing += other.missing
        self.max_pooling = max(self.max_pooling, other.max_pooling)
        self.oov += other.oov

    def cardinality(self) -> int:
        if self.exact or self.sketch.size < KMV_K:
            return int(self.ids.size) if self.exact else int(self.sketch.size)
        kth = float(self.sketch[KMV_K - 1]) / 2.0**64
        return int(round((KMV_K - 1) / kth))

    def summary(self, table_rows: int) -> dict[str, Any]:
        order = np.argsort(-self.counts, kind="stable")
        card = max(self.cardinality(), 1)
        total = max(self.lookups, 1)
        csum = np.cumsum(self.counts[order])

        def share(frac: float) -> float:
            k = max(1, int(round(card * frac)))
            return float(csum[min(k, csum.size) - 1] / total) if csum.size else 0.0

        return {
            "table_rows": int(table_rows),
            "cardinality": self.cardinality(),
            "cardinality_exact": self.exact,
            "mean_pooling": self.lookups / max(self.samples, 1),
            "max_pooling": self.max_pooling,
            "missing_rate": self.missing / max(self.samples, 1),
            "top_ids": [[int(self.ids[i]), int(self.counts[i])] for i in order[:TOP_IDS]],
            "top_1pct_share": share(0.01),
            "top_10pct_share": share(0.10),
            "oov_lookups": self.oov,
            "oov_rate": self.oov / total,
        }


@dataclass
class BlockStats:
    """Everything a worker reports about one block of rows."""

    rows: int = 0
    positives: float = 0.0
    dense_sum: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dense_missing: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    features: dict[str, FeatureCounts] = field(default_factory=dict)

    def merge(self, other: BlockStats) -> None:
        if self.rows == 0 and not self.features:
            self.dense_sum = other.dense_sum.copy()
            self.dense_missing = other.dense_missing.copy()
        else:
            self.dense_sum = self.dense_sum + other.dense_sum
            self.dense_missing = self.dense_missing + other.dense_missing
        self.rows += other.rows
        self.positives += other.positives
        for name, fc in other.features.items():
            if name in self.features:
                self.features[name].merge(fc)
            else:
                self.features[name] = fc


def stats_document(
    stats: BlockStats, dense_names: tuple[str, ...], table_rows: dict[str, int]
) -> dict[str, Any]:
    rows = max(stats.rows, 1)
    return {
        "format": STATS_FORMAT,
        "rows": stats.rows,
        "positive_rate": stats.positives / rows,
        "dense": {
            name: {"mean": float(stats.dense_sum[i] / rows), "missing_rate": float(stats.dense_missing[i] / rows)}
            for i, name in enumerate(dense_names)
        }
        if stats.dense_sum.size
        else {},
        "features": {name: stats.features[name].summary(table_rows[name]) for name in table_rows},
    }


def write_stats(path: str | Path, doc: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def read_stats(path: str | Path) -> dict[str, Any]:
    """Read a ``stats.json`` (for the planner: per-feature ``table_rows`` and ``mean_pooling``)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != STATS_FORMAT:
        raise ValueError(f"'{path}': not a recscale data statistics file (format {doc.get('format')!r}, expected {STATS_FORMAT!r})")
    return doc
