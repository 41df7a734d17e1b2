"""Row storage for tables larger than memory: a RAM cache of hot rows over a file per table.

``TieredRowStorage`` serves one group of same-dim tables (as ``DenseRowStorage`` does). Its
``weight`` is a buffer of slots: the rows of tables placed in RAM at fixed slots, then one cache
of ``cache_rows`` slots per table placed on the SSD tier. ``slots_for`` admits the missing rows
of a lookup (evicting by the table's policy, writing dirty victims back first) and returns cache
slots, so both the torch and the native kernels pool and update cache slots exactly as they
would the whole table: results are bitwise those of the all-in-RAM run.

Prefetch: ``announce`` gives the rows of a future batch; once it is within the prefetch depth,
its rows neither cached nor already on their way are read by background threads into a staging
buffer, with the write-back generation of each row at the time the read was issued. Only the
training thread changes the cache. Victims go into free slots of whole blocks whose content an
admission just read (``tier_file``), so a write-back never makes the kernel re-read a page. A
write-back runs in the background while the batch trains; every read of the file (a prefetch,
on its reader thread; an admission; a whole-table read) and the next write-back first wait for
it, so a read issued later sees the written record (an admission reads only uncached rows,
never the victims being written, so it need not wait for its own write-back). A staged copy is
installed only if its row has not been written back since its read was issued, otherwise it is
dropped and the row read again. A row that the current batch updates is
cached (pinned) for that batch, so the next batch finds it in the cache, never a stale copy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from recscale.embedding.config import TableConfig
from recscale.embedding.eviction import EvictionPolicy
from recscale.embedding.storage import DenseRowStorage, RowStorage
from recscale.embedding.tier_file import (
    CHUNK_BLOCKS, DEFAULT_POOL_BYTES, FLUSH_BYTES, PAGE, BlockRead, RowFile, TierError, TierFileMeta, decode, encode,
)
from recscale.sparse import SparseInputError

Placement = Literal["ram", "ssd"]
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_FLUSH_ROWS = FLUSH_BYTES // PAGE  # rows written back per flush chunk: a page each at most


FileFactory = Callable[[str, TierFileMeta, Callable[[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]], RowFile]


@dataclass(frozen=True)
class TierSettings:
    """How the SSD tier runs: where its files live, the policy, how far ahead batches are
    announced (``lookahead_batches``: what eviction knows) and how many of them have their
    missing rows read ahead (``prefetch_batches``; None: every announced batch);
    ``block_pool_bytes``: RAM per SSD table for the images of blocks whose content is known,
    where write-backs go whole (``tier_file``)."""

    ssd_dir: str
    policy: str = "lookahead"
    lookahead_batches: int = 2
    io_threads: int = 8
    prefetch_batches: int | None = None
    block_pool_bytes: int = DEFAULT_POOL_BYTES  # per table: images of blocks write-backs may fill


@dataclass(frozen=True)
class TierRam:
    """RAM one SSD-placed table holds (bytes): its cache slots' rows and optimizer state
    (``cache``); the bookkeeping per cache slot (``slots``: its row, last use, use count, its
    row's use count, dirty flag, slot-to-row map) and per table row (``rows``: row-to-slot
    maps of the cache and the file, write-back generation, staged read, use count, the
    file's free-slot flags and per-block generations and pending counts); the pool of known
    block images (``pool``)."""

    cache: int
    slots: int
    rows: int
    pool: int

    @property
    def total(self) -> int:
        return self.cache + self.slots + self.rows + self.pool


def tier_ram(num_rows: int, cache_rows: int, record_bytes: int, policy: str = "lookahead",
             pool_bytes: int = DEFAULT_POOL_BYTES) -> TierRam:
    """What ``TieredRowStorage`` holds for one table of ``num_rows`` rows behind a cache of
    ``cache_rows`` slots (records of ``record_bytes``: weights and state); every array is
    int32 per row or slot (see ``__init__``). The reads in flight come on top: their records
    and a chunk of ``CHUNK_BLOCKS`` blocks per reading thread."""
    per = max(1, PAGE // record_bytes)
    blocks = -(-num_rows // per)
    look = 4 if policy == "lookahead" else 0
    per_slot = 4 + 4 + 4 + look + 1 + 4
    per_row = 4 + 4 + 4 + look + 4
    block_bytes = PAGE if record_bytes <= PAGE else -(-record_bytes // PAGE) * PAGE
    pool = min(max(1, pool_bytes // block_bytes), blocks) * block_bytes  # at most every block
    return TierRam(cache_rows * record_bytes, cache_rows * per_slot, num_rows * per_row + blocks * per + blocks * 8, pool)


@dataclass(frozen=True)
class TierStepRam:
    """RAM a training step's tier work holds at most, over ``tier_ram`` (bytes, all SSD tables
    together): the records of the reads in flight (the batches read ahead and the one
    training, every table, each distinct row missing at worst), their block plans and a chunk
    of blocks per reading thread (``reads``); the distinct rows of the announced batches
    (``window``); one table's admission at a time (``admission``: its records, decoded rows
    and state, the victims' copies and their encoding); the eviction ranks over one table's
    slots (``ranking``)."""

    reads: int
    window: int
    admission: int
    ranking: int

    @property
    def total(self) -> int:
        return self.reads + self.window + self.admission + self.ranking


# Per row read: its record and the plan's arrays (row, slot, position, block; int64).
_PLAN_BYTES = 32
# An admission holds about this many copies of its rows' records at once: the records read
# or staged, the decoded rows and state, the victims' rows and state and their encoding.
_ADMIT_COPIES = 5
# Eviction ranks hold about this many int64 arrays over a table's slots at once (ages, next
# use, use counts, the key, the selection's copy).
_RANK_ARRAYS = 8


def tier_step_ram(tables: int, distinct_rows: int, record_bytes: int, cache_rows: int, lookahead_batches: int = 2,
                  prefetch_batches: int | None = None, io_threads: int = 8) -> TierStepRam:
    """What a step holds beyond ``tier_ram`` on ``tables`` SSD tables behind caches of
    ``cache_rows`` slots, a batch looking up at most ``distinct_rows`` distinct rows of each
    (``TierSettings``' lookahead, prefetch and readers). It grows with the batch (distinct
    rows), the record size and the prefetch depth, not with the table: a budget for the tier
    must hold it besides the cache. ``prefetch_batches`` None: every announced batch is read.
    The ranks are counted as ``lookahead``'s, the policy that holds the most arrays."""
    ahead = lookahead_batches if prefetch_batches is None else min(prefetch_batches, lookahead_batches)
    # the batches read ahead and the one training (its reads are freed at the next batch)
    reads = (ahead + 1 if ahead else 0) * tables * distinct_rows * (record_bytes + _PLAN_BYTES)
    if ahead and io_threads:
        reads += io_threads * CHUNK_BLOCKS * PAGE
    window = lookahead_batches * tables * distinct_rows * 8  # announced for prefetch too, whatever the policy
    return TierStepRam(reads, window, _ADMIT_COPIES * distinct_rows * record_bytes, _RANK_ARRAYS * 8 * cache_rows)


@dataclass(frozen=True)
class TierShard:
    """Where a rank's shard table comes from: the whole table, the shard's first row and
    column in it, and the name its tier file goes by (table, shard and rank: two ranks never
    share a file). Its rows start as the whole table's would (``init_rows`` of the rectangle)."""

    table: TableConfig
    row_offset: int
    col_offset: int
    file_name: str


@dataclass
class TierStats:
    """Counters since the start (or ``reset``): unique-row lookups, those served by the cache,
    bytes read and written, rows installed from a prefetch, seconds spent waiting for rows."""

    lookups: int = 0
    hits: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    prefetched_rows: int = 0
    stale_prefetches: int = 0
    stall_seconds: float = 0.0

    def add(self, other: TierStats) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class _Read:
    """A prefetch in flight: rows, their generations at issue, the buffer the threads fill and
    the whole blocks they read (where write-backs may then go without reading them again)."""

    seq: int
    rows: torch.Tensor
    gens: torch.Tensor
    out: np.ndarray
    futures: list
    plan: BlockRead | None = None

    def wait(self) -> None:
        for f in self.futures:
            f.result()
        self.futures = []


@dataclass
class _Segment:
    """One SSD-placed table of the group: its file, cache slots and bookkeeping."""

    table: TableConfig
    row_start: int  # first group row
    base: int  # first slot
    slots: int
    file: RowFile
    policy: EvictionPolicy
    row_of_slot: torch.Tensor  # [slots] table-local row, -1 free (int32)
    gen: torch.Tensor  # [rows] write-backs of each row so far (int32, compared for equality)
    stage_key: torch.Tensor  # [rows] read id of a staged copy, -1 none (int32)
    uses: torch.Tensor  # [rows] training batches that looked each row up (lookahead only)
    slot_uses: torch.Tensor  # [slots] ``uses`` of each slot's row, kept current (no gather of the cache)
    used: int = 0
    reads: dict[int, _Read] = field(default_factory=dict)
    writes: list = field(default_factory=list)  # futures of the last write-back, still running
    next_read: int = 0


class TieredRowStorage(RowStorage):
    """Rows of RAM-placed tables at fixed slots, SSD-placed tables behind per-table caches."""

    native_slots = True  # the native kernels may run on ``weight`` with slot ids

    def __init__(
        self, tables: Sequence[TableConfig], offsets: Sequence[int], dim: int, dtype: torch.dtype,
        state_columns: dict[str, int], placement: dict[str, tuple[Placement, int]], settings: TierSettings,
        seed: int, pool: ThreadPoolExecutor | None = None, shards: dict[str, TierShard] | None = None,
        file_factory: FileFactory | None = None,
    ) -> None:
        """``shards``: for the shard tables of a sharded collection, their origin (initial rows,
        file name, the table named in errors); other tables are whole tables. ``file_factory``:
        how a table's file is made (default ``RowFile.create``; ``tier_sim`` passes a stand-in
        that does no I/O, to replay a trace through this cache and its eviction alone)."""
        from recscale.embedding.table_batched import init_rows  # the in-RAM run's initial rows

        shards = shards or {}
        make_file = file_factory or RowFile.create

        def first_rows(t: TableConfig, start: int, n: int) -> torch.Tensor:
            o = shards.get(t.name)
            if o is None:
                return init_rows(t, seed, start, n)
            return init_rows(o.table, seed, o.row_offset + start, n, o.col_offset, t.dim)

        self._config_name = {t.name: shards[t.name].table.name if t.name in shards else t.name for t in tables}

        self.num_rows = sum(t.num_rows for t in tables)
        self.dim, self.dtype = dim, dtype
        self.settings, self.pool = settings, pool
        self.stats = TierStats()
        self._state_names = tuple(state_columns)
        total = sum(t.num_rows if placement[t.name][0] == "ram" else placement[t.name][1] for t in tables)
        for t in tables:  # row and slot numbers are int32: 4 bytes a row of bookkeeping, not 8
            if placement[t.name][0] == "ssd" and t.num_rows >= 2**31:
                raise TierError(f"table '{self._config_name[t.name]}': {t.num_rows:,} rows, but a table on the SSD tier "
                                f"holds fewer than 2^31 rows; shard it by rows or place it in RAM")
        if self.num_rows >= 2**31 or total >= 2**31:
            raise TierError(f"tables {', '.join(repr(self._config_name[t.name]) for t in tables)}: a group of same-dim "
                            f"tables with an SSD-placed table holds fewer than 2^31 rows ({self.num_rows:,}) and slots "
                            f"({total:,}); shard the tables by rows or place some in RAM")
        weight = torch.zeros(total, dim, dtype=dtype)
        self._cache = DenseRowStorage(weight, state_columns)
        self._dirty = torch.zeros(total, dtype=torch.bool)
        self._map = torch.full((self.num_rows,), -1, dtype=torch.int32)  # group row -> slot
        self._fixed_slot_rows = torch.full((total,), -1, dtype=torch.int32)  # slot -> row of RAM-placed tables
        self.segments: list[_Segment] = []
        slot = 0
        for t, off in zip(tables, offsets):
            where, cache_rows = placement[t.name]
            if where == "ram":
                weight[slot : slot + t.num_rows] = first_rows(t, 0, t.num_rows)
                self._map[off : off + t.num_rows] = torch.arange(slot, slot + t.num_rows, dtype=torch.int32)
                self._fixed_slot_rows[slot : slot + t.num_rows] = torch.arange(off, off + t.num_rows, dtype=torch.int32)
                slot += t.num_rows
                continue
            o = shards.get(t.name)
            meta = TierFileMeta(o.file_name if o else t.name, t.num_rows, o.row_offset if o else 0, dim,
                                _DTYPE_NAMES[dtype], tuple(state_columns.items()), seed)

            def init(start: int, n: int, t: TableConfig = t) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                return first_rows(t, start, n), {k: torch.zeros(n, c) for k, c in state_columns.items()}

            self.segments.append(_Segment(
                t, off, slot, cache_rows, make_file(settings.ssd_dir, meta, init),
                EvictionPolicy(settings.policy, cache_rows), torch.full((cache_rows,), -1, dtype=torch.int32),
                torch.zeros(t.num_rows, dtype=torch.int32), torch.full((t.num_rows,), -1, dtype=torch.int32),
                torch.zeros(t.num_rows if settings.policy == "lookahead" else 0, dtype=torch.int32),
                torch.zeros(cache_rows if settings.policy == "lookahead" else 0, dtype=torch.int32),
            ))  # fmt: skip
            self.segments[-1].file.set_pool_bytes(settings.block_pool_bytes)
            slot += cache_rows
        self._tick = 0
        # Modified-row tracking for differential checkpoints (off: None). The kernels mark the
        # slots they update in ``_slot_flags``; a slot's flag moves to its row's in ``_row_flags``
        # before the slot takes another row, so a row written back still counts as changed.
        self._slot_flags: torch.Tensor | None = None
        self._row_flags: torch.Tensor | None = None
        self._seq = 0  # batches begun
        self._announced = 0
        self._issued = 0  # announced batches whose missing rows have been requested
        self._window: deque[torch.Tensor] = deque()  # unique group rows of announced batches

    # ------------------------------------------------------------------ RowStorage
    @property
    def weight(self) -> torch.Tensor:
        return self._cache.weight

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self._cache.state_tensors()

    def gather(self, slots):
        return self._cache.gather(slots)

    def scatter(self, slots, w, state):
        self._dirty[slots] = True
        self._cache.scatter(slots, w, state)

    def add_rows(self, slots, delta, alpha=1.0):
        self._dirty[slots] = True
        self._cache.add_rows(slots, delta, alpha)

    def slots_for(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache slots of ``rows`` (group rows, any shape), admitting missing ones first. Under
        autograd every returned slot is marked dirty: backward updates each row it looked up."""
        flat = rows.reshape(-1)
        if flat.numel() == 0:
            return flat.to(torch.int64).view(rows.shape)
        if int(flat.min()) < 0 or int(flat.max()) >= self.num_rows:
            raise SparseInputError(f"row ids must lie in [0, {self.num_rows}) of this table group")
        self._tick += 1
        uniq = torch.unique(flat)
        for seg in self.segments:
            lo, hi = segment_span(uniq, seg)
            if hi > lo:
                self._serve(seg, uniq[lo:hi] - seg.row_start, self.stats if torch.is_grad_enabled() else TierStats())
        slots = self._map[flat].to(torch.int64)
        if torch.is_grad_enabled():
            self._dirty[slots] = True
        return slots.view(rows.shape)

    def rows_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The group rows held at cached ``slots`` (for updates that need rows, not slots: the
        whole-row statistic of a column shard)."""
        rows = self._fixed_slot_rows[slots].to(torch.int64)
        for seg in self.segments:
            inside = (slots >= seg.base) & (slots < seg.base + seg.slots)
            rows[inside] = seg.row_of_slot[slots[inside] - seg.base].to(torch.int64) + seg.row_start
        return rows

    # ------------------------------------------------------------------ cache
    def _serve(self, seg: _Segment, rows: torch.Tensor, stats: TierStats) -> None:
        """Make the unique table rows ``rows`` resident (pinned for this call); ``stats`` counts
        the lookups and the wait (training lookups only: evaluation is not the step)."""
        n = rows.numel()
        if n > seg.slots:
            name = self._config_name[seg.table.name]
            where = "" if name == seg.table.name else f" (its shard {seg.file.meta.table})"
            raise TierError(
                f"table '{name}'{where}: a batch looks up {n} distinct rows but its cache holds "
                f"{seg.slots}; set tiers.tables.{name}.cache_rows >= {n} (or a larger "
                "tiers.ram_budget_mb), or place the table in RAM"
            )
        slots = self._map.index_select(0, rows + seg.row_start).to(torch.int64)
        missing = rows[slots < 0]
        stats.lookups += n
        stats.hits += n - missing.numel()
        if seg.uses.numel() and stats is self.stats:  # training lookups only, as the stats
            seg.uses.index_add_(0, rows, torch.ones(n, dtype=torch.int32))
            hit = slots >= 0
            seg.slot_uses[slots[hit] - seg.base] = seg.uses[rows[hit]]
        if missing.numel():
            t0 = time.perf_counter()
            self._admit(seg, missing, pinned=slots[slots >= 0] - seg.base)
            stats.stall_seconds += time.perf_counter() - t0
            slots = self._map.index_select(0, rows + seg.row_start).to(torch.int64)
        seg.policy.used(slots - seg.base, self._tick)

    def _admit(self, seg: _Segment, missing: torch.Tensor, pinned: torch.Tensor) -> None:
        self._wait_writes(seg)
        n, free = missing.numel(), seg.slots - seg.used
        target = torch.arange(seg.used, seg.used + min(n, free), dtype=torch.int64)
        victims = None
        if n > free:
            evictable = torch.zeros(seg.slots, dtype=torch.bool)
            evictable[: seg.used] = True
            evictable[pinned] = False
            next_use = uses = None
            if seg.policy.name == "lookahead":
                next_use = self._next_use(seg)
                uses = seg.slot_uses
            victims = seg.policy.victims(n - free, evictable, next_use, uses)
        seg.used = min(seg.slots, seg.used + n)
        records = self._fetch(seg, missing)
        seg.file.release(missing.numpy())  # now cached: their slots take the victims
        if victims is not None:
            # The victims go into free slots of blocks whose content is known (the file's pool:
            # blocks just read, or written whole since), each block written whole.
            self._write_back(seg, victims)
            # A victim's changed flag moves to its row before the slot takes another row.
            gone = seg.row_of_slot[victims].to(torch.int64) + seg.row_start
            self._fold_flags(victims + seg.base, gone)
            self._map[gone] = -1
            target = torch.cat([target, victims])
        w, state = decode(seg.file.meta, records, self.dtype)
        cache_slots = target + seg.base
        self._cache.scatter(cache_slots, w, state)
        self._dirty[cache_slots] = False
        seg.row_of_slot[target] = missing.to(torch.int32)
        if seg.slot_uses.numel():
            seg.slot_uses[target] = seg.uses[missing]
        self._map[missing + seg.row_start] = cache_slots.to(torch.int32)
        seg.policy.admitted(target)
        seg.file.drop_pages()

    def _write_back(self, seg: _Segment, victims: torch.Tensor) -> None:
        """Write the victims that are dirty or have no slot in the file (every row admitted since
        the last flush gave its slot up), into the file's known blocks where there is room."""
        cache_slots = victims + seg.base
        rows = seg.row_of_slot[victims].to(torch.int64)
        write = self._dirty[cache_slots] | torch.from_numpy(seg.file.loc[rows.clamp(min=0).numpy()] < 0)
        if not bool(write.any()):
            return
        cache_slots = cache_slots[write]
        rows = rows[write]
        order = torch.argsort(rows)
        rows, cache_slots = rows[order], cache_slots[order]
        w = self._cache.weight.index_select(0, cache_slots)  # storage dtype, not float32
        state = {k: v.index_select(0, cache_slots) for k, v in self._cache.state_tensors().items()}
        seg.gen[rows] += 1  # before the write: a read issued earlier is now known stale
        self._wait_writes(seg)
        job = seg.file.place(rows.numpy(), encode(seg.file.meta, w, state).numpy())
        if self.pool is None:
            seg.file.write_job(job)
        else:
            seg.writes = [self.pool.submit(seg.file.write_job, job)]
        self.stats.write_bytes += rows.numel() * seg.file.record_bytes
        self._dirty[cache_slots] = False

    def _wait_writes(self, seg: _Segment) -> None:
        """Wait for ``seg``'s write-back in flight: any read issued after this sees it."""
        if seg.writes:
            t0 = time.perf_counter()
            for f in seg.writes:
                f.result()
            seg.writes = []
            self.stats.stall_seconds += time.perf_counter() - t0

    def _fetch(self, seg: _Segment, rows: torch.Tensor) -> torch.Tensor:
        """``[n, record_bytes]`` records of ``rows`` (ascending): from valid staged copies, the
        rest read now (their roomiest blocks join the file's pool of known blocks)."""
        out = torch.empty(rows.numel(), seg.file.record_bytes, dtype=torch.uint8)
        key = seg.stage_key[rows]
        need = key < 0
        staged = (~need).nonzero().view(-1)
        if staged.numel():
            ids = key[staged]
            for rid in torch.unique(ids).tolist():
                read = seg.reads[rid]
                read.wait()
                if read.plan is not None:
                    seg.file.plan_done(read.plan)  # its rows' slots are free from now on
                at = staged[ids == rid]
                pos = torch.searchsorted(read.rows, rows[at])  # ``read.rows`` ascending
                valid = read.gens[pos] == seg.gen[rows[at]]
                out[at[valid]] = torch.from_numpy(read.out)[pos[valid]]
                need[at[~valid]] = True
                self.stats.prefetched_rows += int(valid.sum())
                self.stats.stale_prefetches += int((~valid).sum())
            seg.stage_key[rows] = -1
        idx = need.nonzero().view(-1)
        if idx.numel():
            buf = np.empty((idx.numel(), seg.file.record_bytes), dtype=np.uint8)
            plan = seg.file.plan(rows[idx].numpy())
            seg.file.read_blocks(plan, buf)
            seg.file.plan_done(plan)
            out[idx] = torch.from_numpy(buf)
        self.stats.read_bytes += rows.numel() * seg.file.record_bytes
        return out

    def _next_use(self, seg: _Segment) -> torch.Tensor:
        """Per cache slot, the first announced batch that needs its row (-1: none)."""
        # Uncached rows point at one slot past the end; index_select/index_fill_ rather than
        # advanced indexing: several times faster at a window of hundreds of thousands of rows.
        next_use = torch.full((seg.slots + 1,), -1, dtype=torch.int64)
        for j in reversed(range(len(self._window))):
            rows = self._window[j]
            lo, hi = segment_span(rows, seg)
            slots = self._map.index_select(0, rows[lo:hi]).to(torch.int64)
            next_use.index_fill_(0, torch.where(slots >= 0, slots - seg.base, seg.slots), j)
        return next_use[: seg.slots]

    # ------------------------------------------------------------------ prefetch
    def announce(self, rows: torch.Tensor) -> None:
        """The group rows of the batch after the last announced one: remembered for the
        lookahead policy; once it is within ``prefetch_batches`` of the batch training, its rows
        neither cached nor staged are read in the background."""
        self._window.append(torch.unique(rows.reshape(-1)))
        self._announced += 1
        self._issue_reads()

    def _issue_reads(self) -> None:
        """Start the reads of the announced batches that have come within the prefetch depth.
        Eviction may know batches further ahead than are read: announcing costs only the ids."""
        depth = self.settings.prefetch_batches
        while self._issued < self._announced and (depth is None or 0 < depth and self._issued < self._seq + 1 + depth):
            self._issued += 1
            uniq = self._window[self._issued - self._seq - 1]
            for seg in self.segments:
                self._prefetch(seg, uniq)

    def _prefetch(self, seg: _Segment, uniq: torch.Tensor) -> None:
        lo, hi = segment_span(uniq, seg)
        local = uniq[lo:hi] - seg.row_start
        local = local[(self._map[local + seg.row_start] < 0) & (seg.stage_key[local] < 0)]
        if local.numel() == 0:
            return
        rid = seg.next_read
        seg.next_read += 1
        out = np.empty((local.numel(), seg.file.record_bytes), dtype=np.uint8)
        read = _Read(self._issued, local, seg.gen[local].clone(), out, [], seg.file.plan(local.numpy()))
        if self.pool is None:  # no pool: write-backs ran inline, nothing is in flight
            seg.file.read_blocks(read.plan, out)
        else:  # the reader waits for the write-back in flight, not the training thread
            read.futures = [self.pool.submit(_read_after, seg.writes, seg.file, read.plan, out)]
        seg.reads[rid] = read
        seg.stage_key[local] = rid

    def begin_batch(self) -> None:
        """The next announced batch is about to run: it leaves the window, and staged copies of
        batches already run are dropped."""
        if self._window:
            self._window.popleft()
        self._seq += 1
        self._issued = max(self._issued, self._seq)  # a batch begun unread is not read now
        for seg in self.segments:
            for rid in [r for r, read in seg.reads.items() if read.seq < self._seq]:
                self._drop_read(seg, rid)
        self._issue_reads()

    def _drop_read(self, seg: _Segment, rid: int) -> None:
        """Forget read ``rid`` of ``seg``: its records, and the staged copies it still holds."""
        read = seg.reads.pop(rid)
        read.wait()
        if read.plan is not None:
            seg.file.plan_done(read.plan)
        still = seg.stage_key[read.rows] == rid
        seg.stage_key[read.rows[still]] = -1

    def forget_announced(self) -> None:
        """Batches announced but never to run (a pipeline stopped early) leave the window, and
        their staged copies are dropped."""
        self._window.clear()
        self._announced = self._issued = self._seq
        for seg in self.segments:
            for rid, read in seg.reads.items():
                read.wait()
                if read.plan is not None:
                    seg.file.plan_done(read.plan)
                still = seg.stage_key[read.rows] == rid
                seg.stage_key[read.rows[still]] = -1
            seg.reads.clear()

    # ------------------------------------------------------------------ whole rows, closing
    def read_rows(self, start: int, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of group rows ``[start, start + n)`` of one table (weights in the storage
        dtype, state float32): the file's records overlaid with the cached rows."""
        seg = next((s for s in self.segments if s.row_start == start), None)
        if seg is None:
            slots = self._map[start : start + n].to(torch.int64)
            return self.weight[slots].clone(), {k: v[slots].clone() for k, v in self.state_tensors().items()}
        self._wait_writes(seg)
        buf = np.empty((n, seg.file.record_bytes), dtype=np.uint8)
        seg.file.read_all(buf)  # rows living in the cache come back as zeros, overlaid below
        w, state = decode(seg.file.meta, torch.from_numpy(buf), self.dtype)
        cached = (seg.row_of_slot >= 0).nonzero().view(-1)
        rows, slots = seg.row_of_slot[cached].to(torch.int64), cached + seg.base
        w[rows] = self.weight[slots]
        for k, v in self.state_tensors().items():
            state[k][rows] = v[slots]
        return w, state

    # ------------------------------------------------------------------ checkpoints
    def track_changes(self, slot_flags: torch.Tensor | None) -> torch.Tensor | None:
        """Start tracking updated rows with ``slot_flags`` (uint8, one per slot of ``weight``: the
        flags the kernels set, ``TableGroup.touched``) or stop (None). Returns the per-row flags
        (uint8 ``[num_rows]``) that ``changed_rows`` keeps current; the caller clears them."""
        if slot_flags is not None and slot_flags.shape != (self.weight.shape[0],):
            raise ValueError(f"slot flags must be [{self.weight.shape[0]}] (one per cache slot), "
                             f"got {tuple(slot_flags.shape)}")
        self._slot_flags = slot_flags
        self._row_flags = None if slot_flags is None else torch.zeros(self.num_rows, dtype=torch.uint8)
        return self._row_flags

    def changed_rows(self) -> torch.Tensor:
        """Per group row, 1 if updated since its flag was last cleared: rows still cached and
        rows written back to the file since (their flags moved over on eviction)."""
        assert self._slot_flags is not None and self._row_flags is not None, "tracking is off"
        slot_rows = self._fixed_slot_rows.to(torch.int64)  # RAM-placed rows; then each cache's rows
        for seg in self.segments:
            held = seg.row_of_slot.to(torch.int64)
            slot_rows[seg.base : seg.base + seg.slots] = torch.where(held >= 0, held + seg.row_start, -1)
        slots = (slot_rows >= 0).nonzero().view(-1)
        self._fold_flags(slots, slot_rows[slots])
        return self._row_flags

    def _fold_flags(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Move the update flags of ``slots`` (holding group ``rows``) to those rows."""
        if self._slot_flags is None or self._row_flags is None or slots.numel() == 0:
            return
        hit = self._slot_flags[slots].bool()
        self._row_flags[rows[hit]] = 1
        self._slot_flags[slots] = 0

    def read_rows_at(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of group ``rows`` (ascending; weights in the storage dtype, state float32): each
        from its cache slot when cached, else from the file once the write-back in flight is
        done (the newest copy of a row is the one or the other). Costs the rows asked, not the
        table: a differential checkpoint reads only its changed rows."""
        rows = rows.to(torch.int64)
        w = torch.empty(rows.numel(), self.dim, dtype=self.dtype)
        state = {k: torch.empty(rows.numel(), v.shape[1]) for k, v in self.state_tensors().items()}
        slots = self._map[rows].to(torch.int64)
        cached = (slots >= 0).nonzero().view(-1)
        w[cached] = self.weight[slots[cached]]
        for k, v in self.state_tensors().items():
            state[k][cached] = v[slots[cached]]
        for seg in self.segments:
            lo, hi = segment_span(rows, seg)
            at = lo + (slots[lo:hi] < 0).nonzero().view(-1)
            if at.numel() == 0:
                continue
            self._wait_writes(seg)
            buf = np.empty((at.numel(), seg.file.record_bytes), dtype=np.uint8)
            seg.file.read((rows[at] - seg.row_start).numpy(), buf)
            fw, fstate = decode(seg.file.meta, torch.from_numpy(buf), self.dtype)
            w[at] = fw
            for k in state:
                state[k][at] = fstate[k]
            seg.file.drop_pages()
        return w, state

    def write_rows_at(self, rows: torch.Tensor, w: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Set group ``rows`` (ascending, unique) to ``w`` and ``state`` (a restore): cached rows in
        their slots (dirty, written back on eviction), the others in the file. Staged copies of
        those rows become stale (their generation moves on), so a prefetch never brings back
        what was there before."""
        rows = rows.to(torch.int64)
        slots = self._map[rows].to(torch.int64)
        cached = (slots >= 0).nonzero().view(-1)
        if cached.numel():
            self._cache.scatter(slots[cached], w[cached], {k: v[cached] for k, v in state.items()})
            self._dirty[slots[cached]] = True
        for seg in self.segments:
            lo, hi = segment_span(rows, seg)
            at = lo + (slots[lo:hi] < 0).nonzero().view(-1)
            if at.numel() == 0:
                continue
            local = rows[at] - seg.row_start
            seg.gen[local] += 1
            self._wait_writes(seg)
            data = encode(seg.file.meta, w[at].to(self.dtype), {k: v[at].float() for k, v in state.items()})
            seg.file.write(local.numpy(), data.numpy())
            self.stats.write_bytes += at.numel() * seg.file.record_bytes
            seg.file.drop_pages()

    def flush(self) -> None:
        """Write every dirty cached row back (they stay cached, now clean), a chunk at a time,
        each chunk's pages flushed and dropped once ``FLUSH_BYTES`` are touched: the page cache
        never holds a whole cache's dirty pages at once (a memory cgroup counts them, and
        cannot reclaim them before they are written)."""
        for seg in self.segments:
            for start in range(0, seg.used, _FLUSH_ROWS):
                self._write_back(seg, torch.arange(start, min(seg.used, start + _FLUSH_ROWS), dtype=torch.int64))
                self._wait_writes(seg)
                seg.file.drop_pages()

    def close(self, shutdown_pool: bool = True) -> None:
        """Flush and mark each file clean: it then holds every row of the last step."""
        self.flush()
        for seg in self.segments:
            for read in seg.reads.values():
                read.wait()
            seg.reads.clear()
            seg.file.close()
        if shutdown_pool and self.pool is not None:
            self.pool.shutdown(wait=True)

    def native_lookup(self, feature_offsets: torch.Tensor, bounds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Slot ids for ``values``, where each id's group row is ``values + feature_offsets``
        (per id); ``bounds`` (per id) the table sizes, checked first."""
        bad = (values < 0) | (values >= bounds)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            raise SparseInputError(f"id {int(values[pos])} is outside its table of {int(bounds[pos])} rows; "
                                   "ids must be in [0, rows) (hash or clip ids to the table size)")
        return self.slots_for(values.to(torch.int64) + feature_offsets)


def _read_after(writes: list, file: RowFile, plan: BlockRead, out: np.ndarray) -> None:
    """Read once ``writes`` are done. They were submitted to the same FIFO pool earlier, so they
    have all started before this runs: waiting for them cannot starve the pool."""
    for f in writes:
        f.result()
    file.read_blocks(plan, out)


def segment_span(sorted_rows: torch.Tensor, seg: _Segment) -> tuple[int, int]:
    """[lo, hi) positions of ``seg``'s rows in ascending group rows."""
    lo, hi = torch.searchsorted(sorted_rows, torch.tensor([seg.row_start, seg.row_start + seg.table.num_rows])).tolist()
    return lo, hi


StorageFactory = Callable[[list[TableConfig], list[int], int, torch.dtype, dict[str, int]], RowStorage | None]


class TieredStorageFactory:
    """For ``TableBatchedEmbeddingBags(storage_factory=...)``: a ``TieredRowStorage`` for each
    group with an SSD-placed table (tables missing from ``placement`` stay in RAM), None
    (dense storage) for the others. The groups share one pool of ``io_threads`` readers.

    ``for_shards`` gives the factory of one rank's shard tables: each shard of an SSD-placed
    table gets its own file and a cache of the table's ``cache_rows``, at most its own rows."""

    def __init__(self, placement: dict[str, tuple[Placement, int]], settings: TierSettings, seed: int,
                 shards: dict[str, TierShard] | None = None, pool: ThreadPoolExecutor | None = None) -> None:
        self.placement, self.settings, self.seed = placement, settings, seed
        self.shards = shards or {}
        self.pool = pool  # made with the first tiered group: a rank without one starts no threads

    def for_shards(self, shards: dict[str, TierShard]) -> TieredStorageFactory:
        """The factory for an operator whose tables are the shards named in ``shards``."""
        return TieredStorageFactory(self.placement, self.settings, self.seed, shards, self.pool)

    def _place(self, t: TableConfig) -> tuple[Placement, int]:
        o = self.shards.get(t.name)
        where, rows = self.placement.get(o.table.name if o else t.name, ("ram", 0))
        return where, min(rows, t.num_rows)

    def __call__(self, tables, offsets, dim, dtype, state_columns) -> RowStorage | None:
        full = {t.name: self._place(t) for t in tables}
        if not any(where == "ssd" for where, _ in full.values()):
            return None
        if self.pool is None and self.settings.io_threads:
            self.pool = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="recscale-tier")
        return TieredRowStorage(tables, offsets, dim, dtype, state_columns, full, self.settings, self.seed, self.pool,
                                self.shards)


def tiered_storage_factory(placement: dict[str, tuple[Placement, int]], settings: TierSettings,
                           seed: int) -> TieredStorageFactory:
    """The ``TieredStorageFactory`` of whole tables (see there)."""
    return TieredStorageFactory(placement, settings, seed)
