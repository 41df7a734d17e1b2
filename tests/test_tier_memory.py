"""The tier's RAM beyond the cache is bounded: reads keep only a few block images, in a pool
capped in bytes; row bookkeeping is int32, and a table too large for it is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.tier_file import CHUNK_BLOCKS, TierError
from recscale.embedding.tiered import TierSettings, TieredRowStorage, tier_ram, tier_step_ram, tiered_storage_factory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tiered import _assert_same_tables, _batches, _max_unique, _train  # noqa: E402


def test_a_small_block_pool_keeps_its_cap_and_the_run_exact(tmp_path, monkeypatch):
    """A pool of 4 blocks: never more images held, the write-backs still whole blocks where
    the pool has room, and the run bitwise the all-in-RAM one."""
    from recscale.embedding import tier_file

    held: list[int] = []
    plain = tier_file.RowFile.place

    def place(self, rows, data):
        held.append(len(self.pool))
        return plain(self, rows, data)

    monkeypatch.setattr(tier_file.RowFile, "place", place)
    t = TableConfig("t", 3000, 16, ("f",))
    batches = _batches([t], 24, batch_size=24, max_len=6, seed=4)
    cache = max(_max_unique([t], batches)["t"], 150)
    settings = TierSettings(str(tmp_path), "lookahead", 4, 2, 2, block_pool_bytes=4 * 4096)
    tier = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.1), seed=5,
                                     storage_factory=tiered_storage_factory({"t": ("ssd", cache)}, settings, seed=5))
    ram = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.1), seed=5)
    readout = torch.randn(16, generator=torch.Generator().manual_seed(1))
    _train(ram, batches, 0, readout)
    _train(tier, batches, 4, readout)
    f = tier.groups[0].storage.segments[0].file
    assert held and max(held) <= 4 and f.pool_blocks == 4 and len(f.pool) <= 4
    assert f.loc.dtype.itemsize == 4 and tier.groups[0].storage.segments[0].row_of_slot.dtype == torch.int32
    _assert_same_tables(ram, tier, [t])


def test_a_table_of_2_pow_31_rows_on_the_tier_is_refused_by_name(tmp_path):
    t = TableConfig("huge", 2**31, 4, ("f",))
    with pytest.raises(TierError, match=r"table 'huge'.*2\^31 rows"):
        TieredRowStorage([t], [0], 4, torch.float32, {}, {"huge": ("ssd", 16)}, TierSettings(str(tmp_path)), seed=0)


def test_tier_ram_counts_int32_bookkeeping_and_the_pool():
    r = tier_ram(4_000_000, 1_000_000, 260)
    assert r.cache == 260_000_000 and r.slots == 21 * 1_000_000
    assert r.pool == 16 << 20
    assert 20 * 4_000_000 < r.rows < 22 * 4_000_000  # 20 bytes a row; the file's slot flags, block counters
    assert tier_ram(100, 10, 260).pool == 7 * 4096  # never more than the table's blocks


def test_the_step_holds_no_more_reads_and_announced_rows_than_tier_step_ram_says(tmp_path, monkeypatch):
    """At every admission (the step's peak: reads of the batches ahead and of this one in
    flight), the records and plans of the reads held and the announced rows stay within
    ``tier_step_ram``'s ``reads`` and ``window``, for two tables behind one group."""
    from recscale.embedding import tiered

    seen: list[tuple[int, int]] = []
    plain = tiered.TieredRowStorage._admit

    def admit(self, seg, missing, pinned):
        reads = sum(r.out.nbytes + sum(getattr(r.plan, k).nbytes for k in ("rows", "slots", "blocks", "where"))
                    for s in self.segments for r in s.reads.values())
        seen.append((reads, sum(w.numel() * w.element_size() for w in self._window)))
        return plain(self, seg, missing, pinned)

    monkeypatch.setattr(tiered.TieredRowStorage, "_admit", admit)
    tables = [TableConfig("a", 3000, 16, ("fa",)), TableConfig("b", 3000, 16, ("fb",))]
    batches = _batches(tables, 20, batch_size=32, max_len=8, seed=2)
    low = max(_max_unique(tables, batches).values())
    cache = low + low // 2  # small: most rows of each batch are read
    settings = TierSettings(str(tmp_path), "lookahead", 4, 2, 2, block_pool_bytes=8 * 4096)
    m = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=5, storage_factory=tiered_storage_factory(
        {"a": ("ssd", cache), "b": ("ssd", cache)}, settings, seed=5))
    _train(m, batches, 4, torch.ones(32))
    bound = tier_step_ram(2, low, 16 * 4 + 4, cache, 4, 2, 2)
    assert seen and max(r for r, _ in seen) > 0
    records = bound.reads - 2 * CHUNK_BLOCKS * 4096  # less the readers' scratch chunks (not seen here)
    assert all(r <= records and w <= bound.window for r, w in seen), (max(seen), bound)
    assert bound.admission == 5 * low * 68 and bound.ranking == 64 * cache
    # no prefetch: nothing read ahead, only the window is held
    assert tier_step_ram(2, low, 68, cache, 4, 0, 2).reads == 0
