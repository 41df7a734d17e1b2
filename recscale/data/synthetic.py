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
# Ids whose arithmetic runs in one go (their temporaries stay in the CPU's cache).
CHUNK_IDS = 16384


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
    return ranks_from_uniform(rng.random(n), num_rows, zipf_constant(num_rows, alpha), alpha)


def zipf_constant(num_rows: int, alpha: float) -> float:
    """The inverse-CDF constant of a table of ``num_rows`` (a Python float, as the formula was
    always computed)."""
    return math.log(num_rows + 1.0) if abs(alpha - 1.0) < 1e-9 else (num_rows + 1.0) ** (1.0 - alpha)


def ranks_from_uniform(u: np.ndarray, num_rows: int | np.ndarray, constant: float | np.ndarray, alpha: float) -> np.ndarray:
    """``zipf_ranks`` of the uniform draws ``u``; ``num_rows`` and ``constant`` (``zipf_constant``)
    are one table's or each draw's (several tables at once: the same arithmetic per element)."""
    if abs(alpha - 1.0) < 1e-9:
        r = np.exp(u * constant)
    else:
        r = (1.0 + u * (constant - 1.0)) ** (1.0 / (1.0 - alpha))
    return np.minimum(np.floor(r).astype(np.int64) - 1, np.asarray(num_rows, dtype=np.int64) - 1).clip(0)


def bag_lengths(rng: np.random.Generator, count: int, pooling: int) -> np.ndarray:
    """Ids per sample: one for single-id features, else uniform in [0, 2 x pooling]."""
    return np.ones(count, dtype=np.int64) if pooling == 1 else rng.integers(0, 2 * pooling + 1, size=count)


def scatter_ranks(ranks: np.ndarray, num_rows: int | np.ndarray, salt: np.uint64 | np.ndarray) -> np.ndarray:
    """Spread hot ranks over the table so hot rows are not simply 0, 1, 2, ... (a hash modulo
    the rows, which merges a few ranks); ``num_rows`` and ``salt`` per table or per rank."""
    return (_splitmix64(ranks.astype(np.uint64) + salt) % np.asarray(num_rows, dtype=np.uint64)).astype(np.int64)


def _runs(sizes: list[int], target: int) -> list[tuple[int, int]]:
    """Consecutive ranges ``[a, b)`` of ``sizes``, each closed once its sum reaches ``target``."""
    runs, a, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total >= target or i == len(sizes) - 1:
            runs.append((a, i + 1))
            a, total = i + 1, 0
    return runs


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
    return float(_distinct(rows, num_rows) / n)  # rows, not ranks: the scatter merges a few


def _distinct(rows: np.ndarray, num_rows: int) -> int:
    """How many distinct values ``rows`` (each in ``[0, num_rows)``) holds: a mark per row where
    the table is small enough for one byte a row (linear, not the sort ``np.unique`` pays),
    else by sorting."""
    if num_rows <= max(1 << 26, 8 * rows.size):
        seen = np.zeros(num_rows, dtype=bool)
        seen[rows] = True
        return int(np.count_nonzero(seen))
    return int(np.unique(rows).size)


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
        self._rows = np.array(cfg.table_rows, dtype=np.int64)
        self._zipf_constants = np.array([zipf_constant(r, cfg.zipf_alpha) for r in cfg.table_rows])
        self._sqrt_pooling = np.array([math.sqrt(pf) for pf in cfg.pooling_factors])
        self._cache: tuple[int, tuple] | None = None
        self._bias = self._calibrate_bias()

    def __len__(self) -> int:
        return self.cfg.num_samples

    def _effects(self, ids: np.ndarray, salts: np.ndarray) -> np.ndarray:
        """Planted effect of each (table, id), ``salts`` being each id's table salt: an
        approximately normal value from two hashes."""
        h = _splitmix64(ids.astype(np.uint64) ^ salts)
        u1, u2 = _unit(h), _unit(_splitmix64(h))
        return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)

    def _latent(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Samples [start, start + count) of the stream (seeded by ``start``): dense
        ``[count, num_dense]``, ids (key-major), lengths ``[tables, count]``, logits.

        Each table draws its bag lengths and then its ids' uniforms from the one generator, in
        table order; the arithmetic on them runs over runs of tables of about ``CHUNK_IDS`` ids
        (per table, the numpy calls on one-id features cost more than their arithmetic; over a
        whole multi-hot batch, the arrays outgrow the CPU's cache)."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, start])
        dense = np.log1p(rng.exponential(3.0, size=(count, cfg.num_dense))).astype(np.float32)
        logit = dense.astype(np.float64) @ self._dense_w
        lengths = np.empty((len(cfg.table_rows), count), dtype=np.int64)
        draws = []
        for t, pf in enumerate(cfg.pooling_factors):
            lengths[t] = bag_lengths(rng, count, pf)
            draws.append(rng.random(int(lengths[t].sum())))
        per_table = lengths.sum(1)
        ids, sums = [], np.empty(lengths.shape)
        for a, b in _runs(per_table.tolist(), CHUNK_IDS):
            # Each id's table constants (a table alone: scalars, cheaper than arrays).
            n = per_table[a:b]
            spread = (lambda v: v[a]) if b - a == 1 else (lambda v: np.repeat(v[a:b], n))  # noqa: E731
            rows, salts = spread(self._rows), spread(self._salt)
            run_ids = ranks_from_uniform(np.concatenate(draws[a:b]), rows, spread(self._zipf_constants), cfg.zipf_alpha)
            run_ids = scatter_ranks(run_ids, rows, salts)
            bag = np.repeat(np.arange((b - a) * count), lengths[a:b].reshape(-1))
            sums[a:b] = np.bincount(bag, self._effects(run_ids, salts), (b - a) * count).reshape(b - a, count)
            ids.append(run_ids)
        per_sample = self._effect_scale * (sums / self._sqrt_pooling[:, None])
        for t in range(len(per_sample)):  # table by table: the same order of additions as ever
            logit += per_sample[t]
        return dense, np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64), lengths, logit

    def _block(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Block ``index`` of BLOCK samples: dense, ids, lengths, each bag's start in the ids
        (``[tables, BLOCK + 1]``), logits, labels. A sample's content depends only on its
        global position, however requests split the stream."""
        if self._cache is not None and self._cache[0] == index:
            return self._cache[1]
        dense, ids, lengths, logit = self._latent(index * BLOCK, BLOCK)
        logit = logit + self._bias
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (np.random.default_rng([self.cfg.seed, index, 1]).random(BLOCK) < p).astype(np.float32)
        starts = np.zeros((lengths.shape[0], BLOCK + 1), dtype=np.int64)
        np.cumsum(lengths, axis=1, out=starts[:, 1:])
        starts += np.concatenate([[0], np.cumsum(lengths.sum(1))[:-1]])[:, None]
        block = (dense, ids, lengths, starts, logit, labels)
        self._cache = (index, block)
        return block

    def _range(self, start: int, count: int):
        """Pieces of the blocks covering global samples [start, start + count): dense, each
        table's ids, lengths ``[tables, n]``, logits, labels."""
        pieces = []
        pos, end = start, start + count
        while pos < end:
            index, lo = divmod(pos, BLOCK)
            hi = min(BLOCK, lo + end - pos)
            dense, ids, lengths, starts, logit, labels = self._block(index)
            per_table = [ids[a:b] for a, b in zip(starts[:, lo].tolist(), starts[:, hi].tolist())]
            pieces.append((dense[lo:hi], per_table, lengths[:, lo:hi], logit[lo:hi], labels[lo:hi]))
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
        if not pieces:
            sparse = JaggedBatch(self.sparse_names, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
            return Batch(torch.zeros(0, self.cfg.num_dense), sparse, torch.zeros(0))
        dense = np.concatenate([p[0] for p in pieces])
        labels = np.concatenate([p[4] for p in pieces])
        values = np.concatenate([p[1][t] for t in range(num_tables) for p in pieces])
        lengths = np.concatenate([p[2] for p in pieces], axis=1).reshape(-1)
        sparse = JaggedBatch(self.sparse_names, torch.from_numpy(values), torch.from_numpy(lengths))
        return Batch(torch.from_numpy(np.ascontiguousarray(dense)), sparse, torch.from_numpy(labels))
