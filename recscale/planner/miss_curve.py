"""Miss-ratio curves: the hit rate of a RAM cache of ``c`` rows of one table on the SSD tier,
predicted from the table's id distribution.

The tier counts one lookup per distinct row per batch (``cache_hit_rate``), so the reference
stream is a sequence of batches, and under an independent-reference model row ``i`` appears in
a batch with probability ``q_i = 1 - (1 - p_i)^n``, where ``p_i`` is the share of ids that land
on it and ``n`` the ids one batch looks up. The distribution is kept as groups of rows of about
equal ``p`` (a few hundred groups whatever the table's size), hottest first.

Two models, one per kind of policy:

* ``lru``: the characteristic-time (Che) approximation at batch granularity. The cache holds
  the distinct rows of the last ``T`` batches, ``T`` solving ``sum_i 1 - (1 - q_i)^T = c``; a
  lookup of row ``i`` hits with probability ``1 - (1 - q_i)^T``. ``lfu`` (counts since a row's
  admission, which restart at every admission) is predicted with the same curve.
* ``lookahead`` (evicts the rows looked up least often so far, and never those the next ``W``
  batches need) and ``lfu``: the cache holds the rows with the highest counts, the count of
  row ``i`` over ``t`` batches being binomial ``(t, q_i)`` (a count threshold, solved as ``T``
  is above). A row looked up by the last batch is there too (that batch pinned it), and with
  ``lookahead`` so is one looked up by any of the ``W`` batches before (the window protected
  it since), so a lookup hits with probability ``1 - (1 - h_i) (1 - q_i)^(W + 1)``, ``h_i`` its
  chance to be counted in on the counts before those batches. Those recent rows take slots
  from the counted ones (the last batch's, and the window's that are needed again); when they
  alone overflow the cache, the window protects only part of them. Over a long run this tends
  to the hit rate of the most frequent rows. ``lfu``'s counts restart at each admission; the
  same model without a window fits it as well on Zipf ids.

On small synthetic runs (8,000 rows, 256 ids per batch, caches of 10 and 25%, Zipf 1.05 and
0.8, 60 batches from an empty cache) every prediction comes within 1 point of the tier's
measured hit rate; with a cache barely above one batch's distinct rows and a window of 4,
``lookahead`` is predicted up to about 3 points high.

``steps`` > 0 predicts the mean over a run of that many batches from an empty cache (what the
training summary measures), 0 the steady state (what the planner sizes caches on).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from recscale.data.synthetic import scatter_ranks, zipf_constant

GROUPS = 384  # groups of rows of about equal probability
HOT_ROWS = 64  # the hottest rows are kept one per group
EXACT_ROWS = 1 << 22  # up to this many rows, synthetic ids are hashed to rows exactly as generated
_COUNT_STEPS = 2048  # batches beyond which the lookahead model's counts are taken as settled
_SCATTER_SALT = np.uint64(0x9E3779B9)  # any salt: the merge statistics do not depend on it


@dataclass(frozen=True)
class RowAccess:
    """One table's id distribution (groups of rows, hottest first) and ids per batch."""

    rows: np.ndarray  # float64 [G]: rows in each group
    prob: np.ndarray  # float64 [G]: share of ids that land on one row of the group
    ids_per_batch: float
    q: np.ndarray = field(init=False, repr=False)  # probability a batch looks one row up

    def __post_init__(self) -> None:
        if self.rows.shape != self.prob.shape:
            raise ValueError("rows and prob: one value per group each")
        n = max(float(self.ids_per_batch), 0.0)
        q = -np.expm1(n * np.log1p(-np.minimum(self.prob, 1.0 - 1e-15)))
        object.__setattr__(self, "q", q)

    @property
    def num_rows(self) -> int:
        return int(round(float(self.rows.sum())))

    def lookups_per_batch(self) -> float:
        """Expected distinct rows one batch looks up (the tier's lookups per batch)."""
        return float((self.rows * self.q).sum())

    def seen_rows(self) -> float:
        """Rows ever looked up (rows no id lands on never take a cache slot)."""
        return float(self.rows[self.q > 0].sum())

    def min_cache_rows(self) -> int:
        """A cache that holds the distinct rows of nearly every batch (mean plus six standard
        deviations: a batch with more is an error of the tier)."""
        u = self.lookups_per_batch()
        var = float((self.rows * self.q * (1 - self.q)).sum())
        return int(min(self.num_rows, math.ceil(u + 6 * math.sqrt(var) + 16)))

    def hit_rate(self, policy: str, cache_rows: int, steps: int = 0, lookahead: int = 2) -> float:
        """Predicted share of lookups served by a cache of ``cache_rows`` rows under ``policy``;
        over a run of ``steps`` batches from an empty cache, or in the steady state (0)."""
        if self.lookups_per_batch() <= 0:
            return 1.0
        if policy == "lru":
            return self._lru(cache_rows, steps)
        if policy in ("lookahead", "lfu"):
            # A row is there if counted in, or looked up by the last batch (pinned then) or, with
            # lookahead, by one of the ``lookahead`` batches before it (protected since).
            return self._frequent(cache_rows, steps, 1 + lookahead if policy == "lookahead" else 1)
        raise ValueError(f"policy: expected one of lru, lfu, lookahead, got {policy!r}")

    # ------------------------------------------------------------------ models
    def _distinct(self, t: float) -> float:
        """Expected distinct rows looked up by ``t`` batches."""
        return float((self.rows * -np.expm1(t * np.log1p(-np.minimum(self.q, 1.0 - 1e-15)))).sum())

    def _characteristic_time(self, c: float) -> float:
        """Batches whose distinct rows fill ``c`` slots (inf: every row ever looked up fits)."""
        if c >= self.seen_rows() - 1e-9:
            return math.inf
        lo, hi = 0.0, 1.0
        while self._distinct(hi) < c:
            lo, hi = hi, hi * 2
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._distinct(mid) < c else (lo, mid)
        return (lo + hi) / 2

    def _lru(self, c: int, steps: int) -> float:
        T = self._characteristic_time(float(c))
        w = self.rows * self.q
        keep = 1.0 - np.minimum(self.q, 1.0 - 1e-15)
        if steps <= 0:
            return 1.0 if math.isinf(T) else float((w * -np.expm1(T * np.log(keep))).sum() / w.sum())
        # Batch t (0-based) finds the rows of batches max(0, t - T) .. t - 1: the mean over the
        # run of 1 - (1 - q)^min(t, T), summed in closed form (a geometric series).
        k = float(steps) if math.isinf(T) else float(min(steps, math.ceil(T)))
        q = np.maximum(self.q, 1e-300)
        miss = -np.expm1(k * np.log(keep)) / q  # sum over t < k of (1 - q)^t
        if not math.isinf(T):
            miss = miss + (steps - k) * np.exp(T * np.log(keep))
        return float(1.0 - (w * miss).sum() / (w.sum() * steps))

    def _frequent(self, c: int, steps: int, window: int) -> float:
        if steps <= 0:  # the most frequent rows, beside one batch's
            before = np.cumsum(self.rows) - self.rows
            return self._with_batch(c, window, lambda ce: np.clip(ce - before, 0, self.rows) / np.maximum(self.rows, 1e-300))
        ts = np.unique(np.round(np.geomspace(1, max(steps - 1, 1), 40)).astype(np.int64)) if steps > 1 else np.zeros(0, np.int64)
        hs = np.array([self._frequent_at(c, int(t), window) for t in ts])
        # Mean over t = 0 .. steps - 1 of h(t), h(0) = 0, linear between the points.
        tt = np.concatenate([[0], ts]).astype(np.float64)
        hh = np.concatenate([[0.0], hs])
        grid = np.arange(steps, dtype=np.float64)
        return float(np.interp(grid, tt, hh).mean())

    def _frequent_at(self, c: int, t: int, window: int) -> float:
        """Hit rate of batch ``t``: the cache holds the rows with the highest counts over
        batches 0 .. t - window - 1 (of those looked up at all; ties shared), then the window."""
        window = min(window, t)
        t = min(t - window, _COUNT_STEPS)
        if t == 0:
            return self._with_batch(c, window, lambda ce: np.zeros_like(self.q))
        k = np.arange(t + 1, dtype=np.float64)
        lg = np.vectorize(math.lgamma)
        log_choose = lg(t + 1.0) - lg(k + 1.0) - lg(t - k + 1.0)
        q = np.clip(self.q, 1e-300, 1.0 - 1e-15)[:, None]
        pmf = np.exp(log_choose[None, :] + k[None, :] * np.log(q) + (t - k)[None, :] * np.log1p(-q))
        pmf[self.q <= 0] = 0.0
        at_least = np.cumsum(pmf[:, ::-1], axis=1)[:, ::-1]  # [G, t + 1]: P(count >= k)
        rows_at_least = (self.rows[:, None] * at_least).sum(0)  # expected rows with count >= k

        def by_count(ce: float) -> np.ndarray:  # P(cached) of a row of each group, ce slots by count
            if rows_at_least[1] <= ce:
                return at_least[:, 1]
            kk = int(np.argmax(rows_at_least <= ce)) if (rows_at_least <= ce).any() else t + 1
            above = at_least[:, kk] if kk <= t else np.zeros_like(self.q)
            n_above = rows_at_least[kk] if kk <= t else 0.0
            edge = at_least[:, kk - 1] - above
            return above + (ce - n_above) / max(rows_at_least[kk - 1] - n_above, 1e-12) * edge

        return self._with_batch(c, window, by_count)

    def _with_batch(self, c: int, window: int, cached) -> float:
        """Hit rate when ``cached(ce)`` gives each group's chance of being among the ``ce`` rows
        kept by count. A row looked up within the last ``window`` batches stays for its next
        use within the window (the lookahead protects it). The cache also holds the current
        batch's rows (pinned) and the protected ones, so ``ce`` solves occupancy = ``c``; when
        even ``ce = 0`` overflows, the window protects only part of its rows (an effective
        window below ``window``)."""
        keep = 1.0 - self.q

        def occupancy(ce: float, win: float) -> float:
            log_keep = np.log(np.maximum(keep, 1e-300))
            # Beside the current batch: rows of the batches before it that the window needs.
            kept = np.expm1(max(win - 1.0, 0.0) * log_keep) ** 2
            return float((self.rows * (1.0 - (1.0 - cached(ce)) * keep * (1.0 - kept))).sum())

        win = float(window)
        if win > 1 and occupancy(0.0, win) > c:  # no room for the whole window: shrink it
            lo, hi = 1.0, win
            for _ in range(40):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if occupancy(0.0, mid) < c else (lo, mid)
            win, ce = lo, 0.0
        else:
            lo, hi = 0.0, float(c)
            if occupancy(hi, win) > c:
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if occupancy(mid, win) < c else (lo, mid)
                ce = lo
            else:
                ce = hi
        hit = 1.0 - (1.0 - cached(ce)) * keep**win
        w = self.rows * self.q
        return float((w * hit).sum() / w.sum())


def _grouped(prob_desc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, probability of each) groups of row probabilities (descending): the hottest rows
    one per group, then geometric; rows never looked up (probability 0) in a group of their own."""
    zeros = int((prob_desc <= 0).sum())
    prob_desc = prob_desc[: prob_desc.size - zeros]
    n = prob_desc.size
    edges = np.unique(np.concatenate([np.arange(min(n, HOT_ROWS) + 1),
                                      np.round(np.geomspace(max(min(n, HOT_ROWS), 1), max(n, 1), GROUPS))])).astype(np.int64)
    edges = edges[edges <= n]
    sums = np.add.reduceat(prob_desc, edges[:-1]) if n else np.zeros(0)
    rows = np.diff(edges).astype(np.float64)
    prob = sums / np.maximum(rows, 1)
    if zeros:
        rows, prob = np.append(rows, float(zeros)), np.append(prob, 0.0)
    return rows, prob


def zipf_access(num_rows: int, alpha: float, ids_per_batch: float, scatter: bool = True) -> RowAccess:
    """The synthetic generator's distribution (``recscale.data.synthetic``): ranks from its
    truncated power law, hashed onto rows (which merges a few ranks) when ``scatter`` and the
    table has at most ``EXACT_ROWS`` rows; otherwise ranks are rows (a bijection)."""
    if num_rows <= 0:
        raise ValueError(f"num_rows: expected > 0, got {num_rows}")
    rows, prob = _zipf_groups(int(num_rows), float(alpha), bool(scatter))
    return RowAccess(rows, prob, ids_per_batch)


@functools.lru_cache(maxsize=64)  # tables of one shape share it; a large one takes a second
def _zipf_groups(num_rows: int, alpha: float, scatter: bool) -> tuple[np.ndarray, np.ndarray]:
    const = zipf_constant(num_rows, alpha)

    def cdf(x: np.ndarray) -> np.ndarray:  # P(rank < x - 1): the generator's inverse CDF, inverted
        if abs(alpha - 1.0) < 1e-9:
            return np.log(x) / const
        return (x ** (1.0 - alpha) - 1.0) / (const - 1.0)

    if num_rows <= EXACT_ROWS:
        ranks = np.arange(num_rows, dtype=np.float64)
        p = np.diff(cdf(np.concatenate([ranks + 1.0, [num_rows + 1.0]])))
        p[-1] += max(0.0, 1.0 - float(cdf(np.array([num_rows + 1.0]))[0]))
        if scatter:
            p = np.bincount(scatter_ranks(np.arange(num_rows), num_rows, _SCATTER_SALT), weights=p, minlength=num_rows)
        return _grouped(np.sort(p)[::-1])
    # Larger tables: groups of consecutive ranks, their probability from the CDF directly.
    edges = np.unique(np.concatenate([np.arange(HOT_ROWS + 1), np.round(np.geomspace(HOT_ROWS, num_rows, GROUPS))])).astype(np.float64)
    mass = np.diff(cdf(edges + 1.0))
    rows = np.diff(edges)
    return rows, mass / rows


def segments_access(segments: list[tuple[float, float]], num_rows: int, ids_per_batch: float) -> RowAccess:
    """From (rows, probability of each) pieces of a measured distribution (the data's
    ``stats.json``: ``FeatureLoad.id_segments``); rows of the table no piece covers are never
    looked up."""
    rows = np.array([r for r, _ in segments] or [0.0], dtype=np.float64)
    prob = np.array([p for _, p in segments] or [0.0], dtype=np.float64)
    order = np.argsort(-prob, kind="stable")
    rows, prob = rows[order], prob[order]
    rest = max(float(num_rows) - float(rows.sum()), 0.0)
    if rest > 0:
        rows, prob = np.append(rows, rest), np.append(prob, 0.0)
    return RowAccess(rows, prob, ids_per_batch)
