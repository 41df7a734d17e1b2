"""Hit rates of the SSD tier's cache on a trace of batches, without the file: the tier's own
admission and eviction code driven through a stand-in file that does no I/O, and offline
Belady (every future batch known) as the bound.

Why a stand-in and not a model of the policies: the figures a benchmark or the planner quotes
must be the tier's, so the hit/victim decisions come from ``TieredRowStorage`` and
``EvictionPolicy`` themselves. What the stand-in leaves out (reading and writing records,
placing written-back rows in file slots) never feeds back into which rows are cached: records
only fill the cache slots the decisions chose. Rows are one column wide here, since the width
does not enter a decision either; so a trace over a table of millions of rows replays in
seconds, with no file of the whole table to create.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from recscale.embedding.config import TableConfig
from recscale.embedding.tier_file import BlockRead, RowFile, TierFileMeta, WriteJob
from recscale.embedding.tiered import TieredRowStorage, TierSettings

_NEVER = np.int64(1) << 40  # the next use of a row not needed again: beyond every batch


class NullRowFile(RowFile):
    """A ``RowFile`` that keeps no records: reads return zero records, writes vanish, every
    row keeps a slot (so only dirty victims count as written back). Its row bookkeeping is
    the base class's, untouched by I/O."""

    @classmethod
    def create(cls, ssd_dir: str | Path, meta: TierFileMeta,
               init: Callable[[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None,
               chunk_rows: int = 65_536) -> NullRowFile:
        """No file: ``init`` is never called (a replay does not need the rows' values)."""
        return cls(Path("/dev/null"), meta, -1)

    def plan(self, rows: np.ndarray) -> BlockRead:
        none = np.empty(0, dtype=np.int64)
        return BlockRead(rows, none, none, none, none, none, none)

    def read_blocks(self, plan: BlockRead, out: np.ndarray, advise: bool = True) -> None:
        out[:] = 0

    def plan_done(self, plan: BlockRead) -> None:
        pass

    def read(self, rows: np.ndarray, out: np.ndarray, advise: bool = True) -> None:
        out[:] = 0

    def read_all(self, out: np.ndarray, chunk_blocks: int = 4096) -> None:
        out[:] = 0

    def release(self, rows: np.ndarray) -> None:
        pass

    def place(self, rows: np.ndarray, data: np.ndarray) -> WriteJob:
        return WriteJob([], [])

    def write_job(self, job: WriteJob) -> None:
        pass

    def write(self, rows: np.ndarray, data: np.ndarray, advise: bool = True) -> None:
        pass

    def prefetch_pages(self, rows: np.ndarray) -> None:
        pass

    def drop_pages(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


def replay_hit_rate(num_rows: int, trace: Sequence[torch.Tensor], cache_rows: int, policy: str,
                    lookahead: int) -> float:
    """The hit rate (distinct rows per batch, as ``TierStats`` counts) of a tier cache of
    ``cache_rows`` rows over a table of ``num_rows`` rows, ``policy`` evicting, on ``trace``
    (the table rows each batch looks up), driven as the training pipeline drives it: batch i
    and the ``lookahead`` after it announced before batch i begins."""
    table = TableConfig("replay", num_rows, 1, ("replay",))
    st = TieredRowStorage([table], [0], 1, torch.float32, {"sum_sq": 1}, {table.name: ("ssd", cache_rows)},
                          TierSettings("", policy, lookahead, 0, 0), seed=0, file_factory=NullRowFile.create)
    ahead = 0
    with torch.enable_grad():  # lookups count as training lookups
        for i, rows in enumerate(trace):
            while lookahead and ahead < min(len(trace), i + 1 + lookahead):
                st.announce(trace[ahead])
                ahead += 1
            st.begin_batch()
            st.slots_for(rows)
    stats = st.stats
    st.close()
    return stats.hits / max(stats.lookups, 1)


def belady_hit_rate(batches: Sequence[np.ndarray], cache: int) -> float:
    """Offline Belady per batch: admit the batch's missing rows, evicting the cached rows whose
    next use is farthest in the future (never one of this batch). ``batches``: the distinct
    rows of each batch. Next uses come from one pass over the sorted trace; each batch picks
    its victims with a partial sort over the cached rows' next uses."""
    sizes = np.array([b.size for b in batches], dtype=np.int64)
    if sizes.sum() == 0:
        return 0.0
    rows = np.concatenate([np.asarray(b, dtype=np.int64).reshape(-1) for b in batches])
    _, dense = np.unique(rows, return_inverse=True)  # rows renumbered 0..distinct-1
    dense = dense.reshape(-1)
    distinct = int(dense.max()) + 1
    when = np.repeat(np.arange(len(batches), dtype=np.int64), sizes)
    order = np.lexsort((when, dense))  # by row, then batch
    nxt_sorted = np.full(rows.size, _NEVER, dtype=np.int64)
    same = dense[order][1:] == dense[order][:-1]
    nxt_sorted[:-1][same] = when[order][1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted  # per lookup, the batch that next needs its row

    cached = np.zeros(distinct, dtype=bool)
    current = np.zeros(distinct, dtype=bool)
    next_use = np.zeros(distinct, dtype=np.int64)
    held = np.empty(0, dtype=np.int64)  # the cached rows
    hits = 0
    start = 0
    for n in sizes.tolist():
        cur = dense[start : start + n]
        next_use[cur] = nxt[start : start + n]
        start += n
        hit = cached[cur]
        hits += int(hit.sum())
        missing = cur[~hit]
        over = held.size + missing.size - cache
        if over > 0:
            current[cur] = True
            cand = held[~current[held]]
            current[cur] = False
            if over < cand.size:
                cand = cand[np.argpartition(-next_use[cand], over - 1)[:over]]
            cached[cand] = False
            held = held[cached[held]]
        cached[missing] = True
        held = np.concatenate([held, missing])
    return hits / int(sizes.sum())
