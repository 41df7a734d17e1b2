"""Synthetic click data shaped like production logs: Zipf-skewed multi-hot ids, learnable labels.

Nothing of table size is ever materialised (tables may have 10^8+ rows): ids come from a
truncated power law over ranks, scattered over the table by a fixed hash; each (feature, row)
has a planted effect derived from a hash of the pair; labels are drawn from a logistic model of
the dense features plus the planted effects. Batch ``i`` depends only on (seed, its first
sample), so any process or worker can make any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from recscale.data.batch import Batch
from recscale.sparse import JaggedBatch

# Samples are generated in blocks of this many, each from its own seed.
BLOCK = 1024


@dataclass(frozen=True)
class SyntheticConfig:
    num_samples: int
    table_rows: tuple[int, ...]
    pooling_factors: tuple[int, ...] = ()
    num_dense: int = 13
    zipf_alpha: float = 1.05
    seed: int = 0
    positive_rate: float = 0.25

    def __post_init__(self) -> None:
        if not self.table_rows or any(r <= 0 for r in self.table_rows):
            raise ValueError("table_rows: expected positive row counts, one per table")
        pf = self.pooling_factors or (1,) * len(self.table_rows)
        if len(pf) != len(self.table_rows):
            raise ValueError(f"pooling_factors: expected {len(self.table_rows)} values, got {len(pf)}")
        if any(p < 1 for p in pf):
            raise ValueError("pooling_factors: every mean pooling factor must be >= 1")
        object.__setattr__(self, "pooling_factors", tuple(pf))
        if self.num_samples < 0:
            raise ValueError("num_samples must be >= 0")
        if not 0 < self.positive_rate < 1:
            raise ValueError("positive_rate must be in (0, 1)")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fast, well-mixed 64-bit hash (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _unit(h: np.ndarray) -> np.ndarray:
    """uint64 hash -> float64 uniform in (0, 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def zipf_ranks(rng: np.random.Generator, n: int, num_rows: int, alpha: float) -> np.ndarray:
    """0-based ranks in [0, num_rows) with P(rank k) roughly proportional to (k + 1)^-alpha."""
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-9:
        r = np.exp(u * math.log(num_rows + 1.0))
    else:
        top = (num_rows + 1.0) ** (1.0 - alpha)
        r = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - alpha))
    return np.minimum(np.floor(r).astype(np.int64) - 1, num_rows - 1).clip(0)


def bag_lengths(rng: np.random.Generator, count: int, pooling: int) -> np.ndarray:
    """Ids per sample: one for single-id features, else uniform in [0, 2 x pooling]."""
    return np.ones(count, dtype=np.int64) if pooling == 1 else rng.integers(0, 2 * pooling + 1, size=count)


def scatter_ranks(ranks: np.ndarray, num_rows: int, salt: np.uint64) -> np.ndarray:
    """Spread hot ranks over the table so hot rows are not simply 0, 1, 2, ... (a hash modulo
    the rows, which merges a few ranks)."""
    return (_splitmix64(ranks.astype(np.uint64) + salt) % np.uint64(num_rows)).astype(np.int64)


def unique_fraction(num_rows: int, pooling: int, zipf_alpha: float, global_batch: int, seed: int = 0,
                    max_ids: int = 2_000_000) -> float | None:
    """Unique ids / ids of one table in one global batch of this generator, measured on a drawn
    batch (the planner's id-skew statistic when the data is synthetic); ``None`` when the batch
    would exceed ``max_ids`` ids."""
    rng = np.random.default_rng([seed, num_rows, pooling])
    n = int(bag_lengths(rng, global_batch, pooling).sum())
    if n == 0 or n > max_ids:
        return None if n else 1.0
    rows = scatter_ranks(zipf_ranks(rng, n, num_rows, zipf_alpha), num_rows, np.uint64(0x9E3779B9))
    return float(np.unique(rows).size / n)  # rows, not ranks: the scatter merges a few


class SyntheticClickData:
    """Deterministic synthetic click log of ``num_samples`` samples starting at ``offset``."""

    def __init__(self, cfg: SyntheticConfig, offset: int = 0) -> None:
        self.cfg = cfg
        self.offset = offset
        self.sparse_names = tuple(f"s{i}" for i in range(len(cfg.table_rows)))
        self.dense_names = tuple(f"d{i}" for i in range(cfg.num_dense))
        rng = np.random.default_rng([cfg.seed, 0x5EED])
        self._dense_w = rng.normal(0.0, 0.6 / math.sqrt(max(cfg.num_dense, 1)), cfg.num_dense)
        self._salt = rng.integers(1, 2**62, size=len(cfg.table_rows), dtype=np.int64).astype(np.uint64)
        self._effect_scale = 1.6 / math.sqrt(len(cfg.table_rows))
        self._cache: tuple[int, tuple] | None = None
        self._bias = self._calibrate_bias()

    def __len__(self) -> int:
        return self.cfg.num_samples

    def _effects(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Planted effect of each (table, id): an approximately normal value from two hashes."""
        h = _splitmix64(ids.astype(np.uint64) ^ self._salt[table])
        u1, u2 = _unit(h), _unit(_splitmix64(h))
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)

    def _latent(self, start: int, count: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Samples [start, start + count) of the stream (seeded by ``start``)."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, start])
        dense = np.log1p(rng.exponential(3.0, size=(count, cfg.num_dense))).astype(np.float32)
        logit = dense.astype(np.float64) @ self._dense_w
        values, lengths = [], []
        for t, (rows, pf) in enumerate(zip(cfg.table_rows, cfg.pooling_factors)):
            lens = bag_lengths(rng, count, pf)
            ids = scatter_ranks(zipf_ranks(rng, int(lens.sum()), rows, cfg.zipf_alpha), rows, self._salt[t])
            eff = self._effects(t, ids)
            bag = np.repeat(np.arange(count), lens)
            per_sample = np.bincount(bag, weights=eff, minlength=count) / math.sqrt(pf)
            logit += self._effect_scale * per_sample
            values.append(ids)
            lengths.append(lens)
        return dense, values, lengths, logit

    def _block(self, index: int) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray]:
        """Block ``index`` of BLOCK samples: dense, ids, lengths, logits, labels. A sample's
        content depends only on its global position, however requests split the stream."""
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1]
        dense, values, lengths, logit = self._latent(index * BLOCK, BLOCK)
        logit = logit + self._bias
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (np.random.default_rng([self.cfg.seed, index, 1]).random(BLOCK) < p).astype(np.float32)
        block = (dense, values, lengths, logit, labels)
        self._cache = (index, block)
        return block

    def _range(self, start: int, count: int):
        """Pieces of the blocks covering global samples [start, start + count)."""
        pieces = []
        pos, end = start, start + count
        while pos < end:
            index, lo = divmod(pos, BLOCK)
            hi = min(BLOCK, lo + end - pos)
            dense, values, lengths, logit, labels = self._block(index)
            ids, lens = [], []
            for v, l in zip(values, lengths):
                offs = np.concatenate([[0], np.cumsum(l)])
                ids.append(v[offs[lo] : offs[hi]])
                lens.append(l[lo:hi])
            pieces.append((dense[lo:hi], ids, lens, logit[lo:hi], labels[lo:hi]))
            pos += hi - lo
        return pieces

    def _calibrate_bias(self) -> float:
        """Bias that gives the configured positive rate (bisection on a fixed sample)."""
        _, _, _, logit = self._latent(2**62, 4096)  # a start no real batch uses
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            rate = float(np.mean(1.0 / (1.0 + np.exp(-(logit + mid)))))
            lo, hi = (mid, hi) if rate < self.cfg.positive_rate else (lo, mid)
        return (lo + hi) / 2

    def planted_logits(self, start: int, count: int) -> np.ndarray:
        """The true logits of samples [start, start + count) (for tests of learnability)."""
        return np.concatenate([p[3] for p in self._range(self.offset + start, count)] or [np.zeros(0)])

    def make_samples(self, start: int, count: int) -> Batch:
        """Samples [start, start + count) of this stream as a Batch."""
        if start < 0 or count < 0 or start + count > self.cfg.num_samples:
            raise IndexError(f"samples [{start}, {start + count}) outside [0, {self.cfg.num_samples})")
        pieces = self._range(self.offset + start, count)
        num_tables = len(self.cfg.table_rows)
        dense = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros((0, self.cfg.num_dense), np.float32)
        labels = np.concatenate([p[4] for p in pieces]) if pieces else np.zeros(0, np.float32)
        values = [np.concatenate([p[1][t] for p in pieces] or [np.zeros(0, np.int64)]) for t in range(num_tables)]
        lengths = [np.concatenate([p[2][t] for p in pieces] or [np.zeros(0, np.int64)]) for t in range(num_tables)]
        sparse = JaggedBatch(
            self.sparse_names,
            torch.from_numpy(np.concatenate(values)),
            torch.from_numpy(np.concatenate(lengths)),
        )
        return Batch(torch.from_numpy(np.ascontiguousarray(dense)), sparse, torch.from_numpy(labels))
