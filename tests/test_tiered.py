"""Tables on the SSD tier train exactly as in RAM: weights and optimizer state bitwise equal
after hundreds of steps, for every optimizer, policy, cache size and row dtype; prefetched rows
never stale; bad settings are one-line errors; the tier file says whether it is complete."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recscale.embedding import SGD, Adagrad, Adam, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.tier_file import RowFile, TierError, TierFileMeta
from recscale.embedding.tier_hooks import announce_batch, begin_batch, close_tiers, tier_stats
from recscale.embedding.tiered import TierSettings, _Read, tiered_storage_factory
from recscale.sparse import JaggedBatch

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "adam": lambda: Adam(lr=0.05, beta1=0.9, beta2=0.99),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tables: one torch thread, so a loaded machine does not stall every small op."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batches(tables: list[TableConfig], n: int, batch_size: int, max_len: int, seed: int) -> list[JaggedBatch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = {}
        for t in tables:
            # skewed ids (a square of a uniform), so some rows are hot and some cold
            ids[t.features[0]] = [
                (torch.rand(int(torch.randint(0, max_len + 1, (), generator=gen)), generator=gen).square() * t.num_rows)
                .long().tolist()
                for _ in range(batch_size)
            ]
        out.append(JaggedBatch.from_lists(ids))
    return out


def _max_unique(tables, batches) -> dict[str, int]:
    """Per table, the most distinct rows one batch looks up (the smallest cache that works)."""
    return {t.name: max(1, max(int(torch.unique(b.select((t.features[0],)).values).numel()) for b in batches))
            for t in tables}


def _train(module, batches, lookahead: int, readout: torch.Tensor) -> list[torch.Tensor]:
    """Train like the pipeline drives it: rows of the next ``lookahead`` batches announced first."""
    outs = []
    ahead = 0
    for i, b in enumerate(batches):
        while ahead < min(len(batches), i + 1 + lookahead):
            announce_batch(module, batches[ahead])
            ahead += 1
        begin_batch(module)
        out = module(b)
        (out * readout[: out.shape[1]]).sum().backward()
        outs.append(out.detach())
    return outs


def _assert_same_tables(ram, tier, tables) -> None:
    for t in tables:
        assert torch.equal(ram.table_weight(t.name), tier.table_weight(t.name)), f"weights of {t.name}"
        for k, v in ram.table_state(t.name).items():
            assert torch.equal(v, tier.table_state(t.name)[k]), f"{k} of {t.name}"


@settings(max_examples=int(os.environ.get("RECSCALE_TIER_EXAMPLES", "6")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    rows=st.lists(st.integers(6, 60), min_size=1, max_size=3),
    dim=st.sampled_from([4, 8]),
    pooling=st.sampled_from(["sum", "mean"]),
    dtype=st.sampled_from(["fp32", "fp16", "bf16"]),
    opt=st.sampled_from(sorted(OPTIMIZERS)),
    policy=st.sampled_from(["lru", "lfu", "lookahead"]),
    lookahead=st.integers(0, 3),
    cache_share=st.floats(0.0, 1.0),
    ram_first=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_tiered_equals_ram_bitwise(tmp_path_factory, rows, dim, pooling, dtype, opt, policy, lookahead, cache_share,
                                   ram_first, seed):
    tables = [TableConfig(f"t{i}", r, dim, (f"f{i}",), pooling=pooling, dtype=dtype) for i, r in enumerate(rows)]
    batches = _batches(tables, 200, batch_size=4, max_len=3, seed=seed)
    low = _max_unique(tables, batches)
    placement = {t.name: ("ssd", low[t.name] + round(cache_share * (t.num_rows - low[t.name]))) for t in tables}
    if ram_first and len(tables) > 1:
        placement[tables[0].name] = ("ram", 0)  # a RAM table sharing the group with SSD ones
    readout = torch.randn(dim * len(tables), generator=torch.Generator().manual_seed(seed))
    ram = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=seed)
    factory = tiered_storage_factory(placement, TierSettings(str(tmp_path_factory.mktemp("tier")), policy, lookahead, 2), seed)
    tier = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=seed, storage_factory=factory)
    _assert_same_tables(ram, tier, tables)  # same initial rows
    outs_ram = _train(ram, batches, 0, readout)
    outs_tier = _train(tier, batches, lookahead, readout)
    for a, b in zip(outs_ram, outs_tier):
        assert torch.equal(a, b)
    _assert_same_tables(ram, tier, tables)
    with torch.no_grad():  # eval lookups after training
        assert torch.equal(ram(batches[0]), tier(batches[0]))
    stats = tier_stats(tier)
    assert stats is not None and stats.lookups > 0
    close_tiers(tier)


def _slow_in_background(monkeypatch, method: str, seconds: float) -> None:
    """``RowFile.<method>`` takes ``seconds`` off the main thread: prefetches (``read_blocks``)
    or write-backs (``write_job``) are still in flight when the next batch needs their rows."""
    real = getattr(RowFile, method)

    def slow(self, *args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        real(self, *args)

    monkeypatch.setattr(RowFile, method, slow)


@pytest.mark.parametrize("slow", ["reads", "writes"])
def test_row_updated_by_one_batch_and_needed_by_the_next_is_never_stale(tmp_path, monkeypatch, slow):
    """Batch 1's rows are announced (and read, slowly) before batch 0 updates the rows they
    share; batch 2 needs a row that batch 1 evicts after batch 0 updated it (its write-back,
    slowly, still running when the row is read again). Every copy the next batch sees must
    carry the update: the run equals the in-RAM one bitwise."""
    _slow_in_background(monkeypatch, "read_blocks" if slow == "reads" else "write_job", 0.02)
    t = TableConfig("t", 10, 4, ("f",))
    ids = [[[0, 1]], [[1, 2]], [[0, 3]], [[1, 0]], [[2, 3]], [[0, 1]]]
    batches = [JaggedBatch.from_lists({"f": b}) for b in ids]
    readout = torch.ones(4)
    ram = TableBatchedEmbeddingBags([t], SGD(lr=0.5), seed=1)
    factory = tiered_storage_factory({"t": ("ssd", 2)}, TierSettings(str(tmp_path), "lookahead", 2, 2), seed=1)
    tier = TableBatchedEmbeddingBags([t], SGD(lr=0.5), seed=1, storage_factory=factory)
    for a, b in zip(_train(ram, batches, 0, readout), _train(tier, batches, 2, readout)):
        assert torch.equal(a, b)
    _assert_same_tables(ram, tier, [t])
    stats = tier_stats(tier)
    assert stats.prefetched_rows > 0 and stats.write_bytes > 0  # prefetches were used, rows written back


def test_prefetched_copy_of_a_row_written_back_after_its_read_is_dropped(tmp_path):
    """A staged copy is used only if its row was not written back since the read was issued."""
    t = TableConfig("t", 8, 4, ("f",))
    factory = tiered_storage_factory({"t": ("ssd", 2)}, TierSettings(str(tmp_path), "lru", 2, 0), seed=0)
    m = TableBatchedEmbeddingBags([t], SGD(lr=1.0), seed=0, storage_factory=factory)
    st_ = m.groups[0].storage
    st_.announce(torch.tensor([5]))  # staged: row 5 as it is in the file now
    slots = st_.slots_for(torch.tensor([5]))  # admitted from the staged copy
    st_.add_rows(slots, torch.ones(1, 4))  # updated in the cache
    st_.slots_for(torch.tensor([0, 1]))  # evicted: written back
    # Re-stage by hand a copy read before the update (generation 0), as a buggy prefetch
    # would keep it; the next admission of row 5 must drop it and read the file.
    seg = st_.segments[0]
    seg.stage_key[5] = seg.next_read - 1
    old = np.zeros((1, seg.file.record_bytes), dtype=np.uint8)
    seg.reads[seg.next_read - 1] = _Read(0, torch.tensor([5]), torch.tensor([0], dtype=torch.int32), old, [])
    slot = st_.slots_for(torch.tensor([5]))
    want = TableBatchedEmbeddingBags([t], SGD(lr=1.0), seed=0).table_weight("t")[5] + 1
    assert torch.equal(st_.weight[slot[0]], want)
    assert st_.stats.stale_prefetches == 1


def test_cache_smaller_than_one_batch_names_the_table_and_fix(tmp_path):
    t = TableConfig("big", 20, 4, ("f",))
    factory = tiered_storage_factory({"big": ("ssd", 3)}, TierSettings(str(tmp_path)), seed=0)
    m = TableBatchedEmbeddingBags([t], SGD(), seed=0, storage_factory=factory)
    with pytest.raises(TierError, match=r"table 'big'.*4 distinct rows.*tiers.tables.big.cache_rows >= 4"):
        m(JaggedBatch.from_lists({"f": [[0, 1, 2, 3]]}))


def test_missing_and_full_ssd_dir(tmp_path, monkeypatch):
    t = TableConfig("t", 20, 4, ("f",))
    missing = tmp_path / "nope"
    with pytest.raises(TierError, match=r"table 't': tiers.ssd_dir '.*nope' does not exist"):
        TableBatchedEmbeddingBags([t], SGD(), storage_factory=tiered_storage_factory({"t": ("ssd", 4)}, TierSettings(str(missing)), 0))

    def full(fd, off, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TierError, match=r"table 't': .* MiB free but its tier file needs"):
        TableBatchedEmbeddingBags([t], SGD(), storage_factory=tiered_storage_factory({"t": ("ssd", 4)}, TierSettings(str(tmp_path)), 0))
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_ssd_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    t = TableConfig("t", 20, 4, ("f",))
    with pytest.raises(TierError, match="is not writable"):
        TableBatchedEmbeddingBags([t], SGD(), storage_factory=tiered_storage_factory({"t": ("ssd", 4)}, TierSettings(str(ro)), 0))


def test_tier_file_is_complete_only_after_close(tmp_path):
    """After ``close`` the file holds every row of the last step and reopens; a file left open
    (a crash) or from another shape or seed is refused with the reason."""
    t = TableConfig("t", 30, 4, ("f",))
    batches = _batches([t], 20, 3, 3, seed=4)
    factory = tiered_storage_factory({"t": ("ssd", 9)}, TierSettings(str(tmp_path), "lfu", 1, 2), seed=7)
    m = TableBatchedEmbeddingBags([t], Adam(lr=0.05), seed=7, storage_factory=factory)
    _train(m, batches, 1, torch.ones(4))
    meta = TierFileMeta("t", 30, 0, 4, "fp32", (("exp_avg", 4), ("exp_avg_sq", 4)), 7)
    with pytest.raises(TierError, match="not closed cleanly"):
        RowFile.open_existing(tmp_path, meta)
    want = m.table_weight("t")
    close_tiers(m)
    f = RowFile.open_existing(tmp_path, meta)
    buf = np.empty((30, f.record_bytes), dtype=np.uint8)
    f.read(np.arange(30), buf)
    assert torch.equal(torch.from_numpy(buf[:, :16].copy()).view(torch.float32), want)
    f.close()
    with pytest.raises(TierError, match=r"another table shape or seed: seed 7 \(expected 8\)"):
        RowFile.open_existing(tmp_path, TierFileMeta("t", 30, 0, 4, "fp32", meta.state, 8))


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(addr), size)
        return sum(v & 1 for v in vec)
    finally:
        os.close(fd)


def test_page_cache_holds_a_bounded_part_of_the_tier_file(tmp_path, monkeypatch):
    """Rows read and written back through the page cache are dropped every FLUSH_BYTES of
    touched pages: the file's resident pages stay under that bound (plus one batch)."""
    from recscale.embedding import tier_file

    bound = 1 << 20
    monkeypatch.setattr(tier_file, "FLUSH_BYTES", bound)
    t = TableConfig("t", 40_000, 16, ("f",))  # a 5 MiB file with Adagrad state
    batches = _batches([t], 60, batch_size=16, max_len=4, seed=5)
    factory = tiered_storage_factory({"t": ("ssd", 64)}, TierSettings(str(tmp_path), "lru", 2, 2), seed=0)
    m = TableBatchedEmbeddingBags([t], Adagrad(lr=0.1), storage_factory=factory)
    path = m.groups[0].storage.segments[0].file.path
    worst = 0
    for b in batches:
        announce_batch(m, b)
        begin_batch(m)
        m(b).sum().backward()
        worst = max(worst, _resident_pages(path))
    pages_per_batch = 2 * 16 * 4 * 2  # two pages per record, a read and a write of every id
    assert 0 < worst * 4096 <= bound + pages_per_batch * 4096, worst
    rows_read = tier_stats(m).read_bytes // m.groups[0].storage.segments[0].file.record_bytes
    assert rows_read * 4096 > 3 * bound  # the reads touched far more pages than the bound
    close_tiers(m)


def test_batched_record_io_round_trips_with_page_drops(tmp_path, monkeypatch):
    """Reads and writes of many records (their pages requested ahead, in chunks on a pool),
    with the file's pages flushed and dropped between them, return what was written."""
    from concurrent.futures import ThreadPoolExecutor

    from recscale.embedding import tier_file

    monkeypatch.setattr(tier_file, "FLUSH_BYTES", 1)  # a drop after every call
    meta = TierFileMeta("t", 3000, 0, 5, "fp32", (("sum", 1),), 0)
    f = RowFile.create(tmp_path, meta, lambda s, n: (torch.arange(s, s + n).float()[:, None].repeat(1, 5), {"sum": torch.zeros(n, 1)}))
    rng = np.random.default_rng(0)
    want = np.zeros((3000, f.record_bytes), dtype=np.uint8)
    f.read(np.arange(3000), want)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            rows = np.unique(rng.integers(0, 3000, 700))
            data = rng.integers(0, 256, (rows.size, f.record_bytes), dtype=np.uint8)
            for fut in f.write_async(rows, data, pool):
                fut.result()
            want[rows] = data
            f.drop_pages()
            got = np.empty_like(want)
            for fut in f.read_async(np.arange(3000), got, pool):
                fut.result()
            f.drop_pages()
            assert np.array_equal(got, want)
        f.close()


@pytest.mark.parametrize("dim,io_threads", [(16, 2), (5, 0), (1030, 2)])
def test_write_backs_write_whole_blocks_and_never_reread_a_page(tmp_path, monkeypatch, dim, io_threads):
    """Every write during training covers whole blocks whose content was read for the rows the
    batch admits: the kernel never reads a page to complete a write. Records of 68 and 24
    bytes (many to a page, the page's tail unused) and of 4124 bytes (two pages each)."""
    from recscale.embedding import tier_file

    writes: list[tuple[int, int]] = []
    real = tier_file._pwrite_all

    def counted(fd, view, off):
        writes.append((off, view.nbytes))
        real(fd, view, off)

    t = TableConfig("t", 3000, dim, ("f",))
    batches = _batches([t], 40, batch_size=24, max_len=6, seed=3)
    cache = max(_max_unique([t], batches)["t"], 150)
    settings = TierSettings(str(tmp_path), "lookahead", 4, io_threads, 2)  # window 4, prefetch 2
    factory = tiered_storage_factory({"t": ("ssd", cache)}, settings, seed=5)
    tier = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.1), seed=5, storage_factory=factory)
    ram = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.1), seed=5)
    f = tier.groups[0].storage.segments[0].file
    monkeypatch.setattr(tier_file, "_pwrite_all", counted)
    readout = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    _train(ram, batches, 0, readout)
    _train(tier, batches, 4, readout)
    tier.groups[0].storage._wait_writes(tier.groups[0].storage.segments[0])
    assert f.rereads == 0
    assert len(writes) > 20  # victims were written back
    bb = f.block_bytes
    assert all((off - tier_file.HEADER_BYTES) % bb == 0 and n % bb == 0 for off, n in writes), writes[:5]
    monkeypatch.setattr(tier_file, "_pwrite_all", real)
    _assert_same_tables(ram, tier, [t])
    close_tiers(tier)


def test_two_tiered_groups_share_one_reader_pool(tmp_path):
    """Tables of two dims (two groups, one pool) train exactly and close cleanly together."""
    tables = [TableConfig("a", 40, 4, ("fa",)), TableConfig("b", 100, 8, ("fb",), dtype="bf16")]
    batches = _batches(tables, 30, batch_size=4, max_len=3, seed=9)
    low = _max_unique(tables, batches)
    # b caches every row: closing writes back more rows than run inline, on the shared pool
    factory = tiered_storage_factory({"a": ("ssd", low["a"]), "b": ("ssd", 100)},
                                     TierSettings(str(tmp_path), "lookahead", 2, 2), seed=3)
    tier = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=3, storage_factory=factory)
    ram = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=3)
    readout = torch.randn(12, generator=torch.Generator().manual_seed(0))
    _train(ram, batches, 0, readout)
    _train(tier, batches, 2, readout)
    assert len(tier.groups) == 2
    close_tiers(tier)
    for t in tables:
        meta = tier.groups[[g.tables[0].name for g in tier.groups].index(t.name)].storage.segments[0].file.meta
        f = RowFile.open_existing(tmp_path, meta)  # both files complete and clean
        buf = np.empty((t.num_rows, f.record_bytes), dtype=np.uint8)
        f.read(np.arange(t.num_rows), buf)
        w = torch.from_numpy(buf[:, : meta.weight_bytes].copy()).view(t.torch_dtype)
        assert torch.equal(w, ram.table_weight(t.name))
        f.close()


def test_evaluation_batches_larger_than_a_cache_are_pooled_in_parts(tmp_path):
    t = TableConfig("t", 50, 4, ("f",))
    factory = tiered_storage_factory({"t": ("ssd", 4)}, TierSettings(str(tmp_path), "lru", 2, 0), seed=2)
    tier = TableBatchedEmbeddingBags([t], SGD(), seed=2, storage_factory=factory)
    ram = TableBatchedEmbeddingBags([t], SGD(), seed=2)
    batch = JaggedBatch.from_lists({"f": [[i, i + 10, 40] for i in range(10)]})  # 21 distinct rows
    with torch.no_grad():
        assert torch.equal(tier(batch), ram(batch))
        with pytest.raises(TierError, match="5 distinct rows"):  # one sample over the cache: an error
            tier(JaggedBatch.from_lists({"f": [[0, 1, 2, 3, 4]]}))


def test_batches_announced_but_not_run_are_forgotten(tmp_path):
    """A pipeline stopped early leaves announced batches behind; after ``forget_announced`` the
    next pipeline's window lines up with the batches it runs, and training stays exact."""
    from recscale.embedding.tier_hooks import forget_announced

    t = TableConfig("t", 40, 4, ("f",))
    batches = _batches([t], 30, batch_size=4, max_len=3, seed=11)
    factory = tiered_storage_factory({"t": ("ssd", _max_unique([t], batches)["t"])},
                                     TierSettings(str(tmp_path), "lookahead", 3, 2), seed=1)
    tier = TableBatchedEmbeddingBags([t], Adam(lr=0.05), seed=1, storage_factory=factory)
    ram = TableBatchedEmbeddingBags([t], Adam(lr=0.05), seed=1)
    readout = torch.ones(4)
    _train(ram, batches, 0, readout)
    _train(tier, batches[:20], 3, readout)
    for b in batches[20:23]:  # prepared by a pipeline that then stopped
        announce_batch(tier, b)
    forget_announced(tier)
    _train(tier, batches[20:], 3, readout)
    st_ = tier.groups[0].storage
    assert len(st_._window) == 0 and st_._announced == st_._seq == 30
    _assert_same_tables(ram, tier, [t])
