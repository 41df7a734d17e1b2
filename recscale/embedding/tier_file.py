"""The file behind a tiered table shard: one fixed-size record per row, weights and state.

Layout: a 4096-byte header (JSON naming the table, its rows, dim, dtype, state columns, seed
and whether the file was closed cleanly), then blocks of ``block_bytes`` (a page, or the pages
one larger record needs) holding ``per_block`` record slots each, then the row-to-slot map. A
record is the row's weights in the storage dtype followed by each optimizer state row in
float32; no record straddles a block.

Rows move between slots. A row admitted to the RAM cache gives up its slot; a row written back
goes to a free slot of a block whose whole content is known because it was just read (the
reads that admit rows read whole blocks), and that block is written whole. So a write-back is
never a read-modify-write of a page: the device reads each block once, for the rows it admits,
and the kernel never has to read a page to complete a partial write. Slots are free while
their rows are cached, so the blocks a batch reads hold slots for its victims (a block's
generation says whether a copy read earlier is still its content). The map is written at
``close``; a file not closed cleanly is refused.

The page cache is kept from becoming a second, unbounded cache with ``posix_fadvise`` rather
than ``O_DIRECT``: direct I/O fails on tmpfs. The file is opened ``POSIX_FADV_RANDOM`` (no
read-ahead). The reads that admit rows drop each chunk's pages once the next chunk is read
(one call over the chunk's span), and request at most ``ADVISE_BLOCKS`` ahead; a write-back
is flushed (``fdatasync``) and its pages dropped when its job ends. Every other page a read
or write touches is counted, and once ``FLUSH_BYTES`` of them have been touched the file is
flushed and all its pages dropped (``DONTNEED``), so the page cache holds at most that much of
the file plus the I/O in flight.

Only the roomiest blocks a read brings in keep their images (``BlockRead``), in a pool of at
most ``pool_blocks`` per file: write-backs fill its blocks and patch the pooled images, which
so stay the blocks' content. RAM beyond the cache is then the pool, the records of the reads
in flight and a chunk of blocks per reading thread, whatever the batch.

Queue depth: before reading a set of blocks, the kernel is asked for many of them at once
(``POSIX_FADV_WILLNEED``, asynchronous), so the device sees them in flight together instead of
one read per thread.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

HEADER_BYTES = 4096
FORMAT = "recscale-tier-2"
PAGE = 4096
FLUSH_BYTES = 64 << 20
# Reads of fewer rows run on the calling thread: a pool round trip costs more than they do.
INLINE_ROWS = 32
# The pool of known block images of one file, unless set (``RowFile.set_pool_bytes``).
DEFAULT_POOL_BYTES = 16 << 20
# Blocks read into one scratch buffer at a time: a read's transient RAM, whatever its size.
CHUNK_BLOCKS = 256
# Blocks of one read requested from the kernel ahead of the one being read: the queue depth
# the device sees, and the most page cache a read brings in at once (8 MiB of 4 KiB blocks).
ADVISE_BLOCKS = 2048
_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


class TierError(RuntimeError):
    """A problem with the SSD tier; the message names the table and the fix."""


@dataclass(frozen=True)
class TierFileMeta:
    """What a tier file holds; a file whose header differs belongs to another table or run."""

    table: str
    num_rows: int
    row_offset: int
    dim: int
    dtype: str
    state: tuple[tuple[str, int], ...]
    seed: int

    @property
    def weight_bytes(self) -> int:
        return self.dim * _ELEMENT_BYTES[self.dtype]

    @property
    def record_bytes(self) -> int:
        return self.weight_bytes + 4 * sum(c for _, c in self.state)

    @property
    def per_block(self) -> int:
        return max(1, PAGE // self.record_bytes)

    @property
    def block_bytes(self) -> int:
        return -(-self.record_bytes // PAGE) * PAGE if self.record_bytes > PAGE else PAGE

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.per_block)

    @property
    def map_offset(self) -> int:
        return HEADER_BYTES + self.num_blocks * self.block_bytes

    @property
    def file_bytes(self) -> int:
        return self.map_offset + 8 * self.num_rows

    def header(self, clean: bool) -> bytes:
        body = {"format": FORMAT, **asdict(self), "record_bytes": self.record_bytes, "clean": clean}
        raw = json.dumps(body, sort_keys=True).encode()
        return raw + b" " * (HEADER_BYTES - len(raw))


def _check_dir(table: str, ssd_dir: Path) -> None:
    if not ssd_dir.is_dir():
        raise TierError(f"table '{table}': tiers.ssd_dir '{ssd_dir}' does not exist; create it or point tiers.ssd_dir at a directory")
    if not os.access(ssd_dir, os.W_OK | os.X_OK):
        raise TierError(f"table '{table}': tiers.ssd_dir '{ssd_dir}' is not writable; choose a writable directory")


@dataclass
class BlockRead:
    """Whole blocks read for some rows: planned on the training thread (``RowFile.plan``), run on
    any thread (``RowFile.read_blocks``). Of the blocks read, only the images of ``held`` are
    kept (the blocks with the most room for write-backs, enough for as many victims as rows
    read): the rest are dropped once their records are taken, so a read costs RAM for its
    records and a few blocks, not a block per row. ``gens`` are the held blocks' generations
    at planning: an image whose block was written since is not its content any more."""

    rows: np.ndarray
    slots: np.ndarray
    blocks: np.ndarray  # ascending, unique: every block read
    where: np.ndarray  # per row, its block's position in ``blocks``
    held: np.ndarray  # ascending: the blocks whose images go to the pool
    gens: np.ndarray  # per held block, its generation at planning
    pending: np.ndarray  # per held block, the rows read from it (free once admitted)
    done: bool = False  # its rows admitted or dropped: ``pending`` no longer counts


@dataclass
class WriteJob:
    """Writes of one write-back: whole blocks (offset, image), and records into blocks whose
    content was not known (each such block costs the device a read first: ``RowFile.rereads``)."""

    blocks: list
    records: list


class RowFile:
    """Reads and writes whole records of one table shard's tier file."""

    def __init__(self, path: Path, meta: TierFileMeta, fd: int, loc: np.ndarray | None = None) -> None:
        self.path, self.meta, self.fd = path, meta, fd
        self.record_bytes = meta.record_bytes
        self.per_block, self.block_bytes = meta.per_block, meta.block_bytes
        slots = meta.num_blocks * meta.per_block
        # Row -> slot (-1: cached) in int32 where the slots allow: 4 bytes a row, not 8.
        self.slot_dtype = slot_dtype(slots)
        self.loc = np.arange(meta.num_rows, dtype=self.slot_dtype) if loc is None else loc.astype(self.slot_dtype)
        self.free = np.ones(slots, dtype=bool)
        self.free[self.loc[self.loc >= 0]] = False
        # Writes of each block so far (compared for equality only: wrapping is harmless).
        self.block_gen = np.zeros(meta.num_blocks, dtype=np.int32)
        self.rereads = 0  # blocks written without their content known (the kernel reads them)
        # Images of blocks whose content is known (block -> image, and its generation then):
        # where write-backs go. At most ``pool_blocks`` (``DEFAULT_POOL_BYTES`` unless set).
        self.pool: dict[int, np.ndarray] = {}
        self.pool_gen: dict[int, int] = {}
        self.pool_blocks = max(1, DEFAULT_POOL_BYTES // meta.block_bytes)
        self.pending = np.zeros(meta.num_blocks, dtype=np.int32)  # rows read, not yet admitted, per block
        self._touched = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(cls, ssd_dir: str | Path, meta: TierFileMeta,
               init: Callable[[int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]],
               chunk_rows: int = 65_536) -> RowFile:
        """A fresh file filled by ``init(start, n)`` (weights, state), written to a temporary
        name and renamed: a half-built file is never left under the final name."""
        ssd_dir = Path(ssd_dir)
        _check_dir(meta.table, ssd_dir)
        path = ssd_dir / f"{meta.table}.{meta.row_offset}.tier"
        tmp = path.with_suffix(".tier.tmp")
        size = meta.file_bytes
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except PermissionError:
            raise TierError(f"table '{meta.table}': tiers.ssd_dir '{ssd_dir}' is not writable; choose a writable directory") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                free = shutil.disk_usage(ssd_dir).free
                raise TierError(
                    f"table '{meta.table}': tiers.ssd_dir '{ssd_dir}' has {free / 2**20:,.0f} MiB free but its tier "
                    f"file needs {size / 2**20:,.0f} MiB; free space, choose another ssd_dir or place the table in RAM"
                ) from None
            os.pwrite(fd, meta.header(clean=False), 0)
            per = meta.per_block
            chunk_rows = max(per, chunk_rows // per * per)
            for start in range(0, meta.num_rows, chunk_rows):
                n = min(chunk_rows, meta.num_rows - start)
                w, state = init(start, n)
                recs = encode(meta, w, state).numpy()
                nb = -(-n // per)
                packed = np.zeros((nb * per, meta.record_bytes), dtype=np.uint8)
                packed[:n] = recs
                data = np.zeros((nb, meta.block_bytes), dtype=np.uint8)
                data[:, : per * meta.record_bytes] = packed.reshape(nb, -1)
                off = HEADER_BYTES + start // per * meta.block_bytes
                _pwrite_all(fd, memoryview(data).cast("B"), off)
                os.fdatasync(fd)
                os.posix_fadvise(fd, off, data.nbytes, os.POSIX_FADV_DONTNEED)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return cls(path, meta, fd)

    @classmethod
    def open_existing(cls, ssd_dir: str | Path, meta: TierFileMeta) -> RowFile:
        """Reopen a file closed cleanly by ``close``; an error names what differs otherwise."""
        path = Path(ssd_dir) / f"{meta.table}.{meta.row_offset}.tier"
        _check_dir(meta.table, Path(ssd_dir))
        if not path.is_file():
            raise TierError(f"table '{meta.table}': no tier file '{path}'; start without reusing tier files")
        fd = os.open(path, os.O_RDWR)
        try:
            raw = os.pread(fd, HEADER_BYTES, 0)
            try:
                got = json.loads(raw.decode().strip())
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise TierError(f"table '{meta.table}': '{path}' is not a recscale tier file; delete it") from None
            want = json.loads(meta.header(clean=True).decode().strip())
            diff = sorted(k for k in want if k != "clean" and got.get(k) != want[k])
            if diff:
                shown = ", ".join(f"{k} {got.get(k)!r} (expected {want[k]!r})" for k in diff)
                raise TierError(
                    f"table '{meta.table}': tier file '{path}' belongs to another table shape or seed: {shown}; "
                    "delete it or point tiers.ssd_dir elsewhere"
                )
            if not got.get("clean"):
                raise TierError(
                    f"table '{meta.table}': tier file '{path}' was not closed cleanly (its rows mix several "
                    "steps); delete it and resume from a checkpoint"
                )
            loc = np.empty(meta.num_rows, dtype=np.int64)
            _pread_all(fd, memoryview(loc).cast("B"), meta.map_offset, meta.table, path)
            os.pwrite(fd, meta.header(clean=False), 0)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return cls(path, meta, fd, loc)

    def close(self) -> None:
        """Write the row-to-slot map, mark the file clean (every row current) and close it; call
        after writing every cached row back."""
        if self.fd < 0:
            return
        if bool((self.loc < 0).any()):
            raise TierError(f"table '{self.meta.table}': closing the tier file with rows still only in the cache; "
                            "write them back first")
        step = 1 << 20  # the map on disk is int64 whatever ``loc`` holds: converted a chunk at a time
        for start in range(0, self.loc.size, step):
            part = np.ascontiguousarray(self.loc[start : start + step], dtype=np.int64)
            _pwrite_all(self.fd, memoryview(part).cast("B"), self.meta.map_offset + 8 * start)
        os.fdatasync(self.fd)
        os.pwrite(self.fd, self.meta.header(clean=True), 0)
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fd)
        self.fd = -1

    def set_pool_bytes(self, nbytes: int) -> None:
        """Cap the pool of known block images at ``nbytes`` (at least one block)."""
        self.pool_blocks = max(1, int(nbytes) // self.block_bytes)
        with self._lock:
            self._prune_pool(self.pool_blocks)

    # ------------------------------------------------------------------ slots
    def offsets(self, slots: np.ndarray) -> np.ndarray:
        """File offsets of record ``slots``."""
        slots = slots.astype(np.int64)
        return HEADER_BYTES + slots // self.per_block * self.block_bytes + slots % self.per_block * self.record_bytes

    def _slots(self, rows: np.ndarray) -> np.ndarray:
        slots = self.loc[rows]
        if slots.size and int(slots.min()) < 0:
            raise TierError(f"table '{self.meta.table}': a row read from the tier file lives in the cache "
                            "(an internal error)")
        return slots

    def release(self, rows: np.ndarray) -> None:
        """``rows`` now live in the cache (their records already read): their slots are free."""
        slots = self.loc[rows]
        self.free[slots[slots >= 0]] = True
        self.loc[rows] = -1

    # ------------------------------------------------------------------ rows
    def read(self, rows: np.ndarray, out: np.ndarray, advise: bool = True) -> None:
        """Records of ``rows`` into ``out`` ``[n, record_bytes]``; records in adjacent slots are
        one read each, all their pages requested first (``advise``)."""
        slots = self._slots(rows)
        order = np.argsort(slots, kind="stable")
        slots = slots[order]
        if advise and rows.size > INLINE_ROWS:
            self._advise(slots // self.per_block)
        buf = out if np.array_equal(order, np.arange(order.size)) else np.empty_like(out)
        offs = self.offsets(slots)
        for a, b in _runs(slots):
            if (b - a) > 1 and offs[b - 1] - offs[a] != (b - a - 1) * self.record_bytes:  # crosses a block edge
                for i in range(a, b):
                    _pread_all(self.fd, memoryview(buf[i : i + 1]).cast("B"), int(offs[i]), self.meta.table, self.path)
                continue
            _pread_all(self.fd, memoryview(buf[a:b]).cast("B"), int(offs[a]), self.meta.table, self.path)
        if buf is not out:
            out[order] = buf
        self._count_blocks(np.unique(slots // self.per_block))

    def read_async(self, rows: np.ndarray, out: np.ndarray, pool: Executor | None, advise: bool = True) -> list:
        """Start reading ``rows`` into ``out`` on ``pool`` in chunks; the futures to wait for."""
        if pool is None or rows.size <= INLINE_ROWS:
            self.read(rows, out, advise)
            return []
        if advise:
            self._advise(np.unique(self._slots(rows) // self.per_block))
        chunk = max(INLINE_ROWS, rows.size // 16)
        return [pool.submit(self.read, rows[i : i + chunk], out[i : i + chunk], False) for i in range(0, rows.size, chunk)]

    def read_all(self, out: np.ndarray, chunk_blocks: int = 4096) -> None:
        """Every row's record into ``out`` ``[num_rows, record_bytes]`` in one sequential pass;
        rows living in the cache get zeros."""
        per, rec, bb = self.per_block, self.record_bytes, self.block_bytes
        flat = np.empty(self.meta.num_blocks * per, dtype=np.int64)  # slot -> row
        flat[:] = -1
        live = self.loc >= 0
        flat[self.loc[live]] = np.flatnonzero(live)
        out[~live] = 0
        for start in range(0, self.meta.num_blocks, chunk_blocks):
            nb = min(chunk_blocks, self.meta.num_blocks - start)
            buf = np.empty((nb, bb), dtype=np.uint8)
            _pread_all(self.fd, memoryview(buf).cast("B"), HEADER_BYTES + start * bb, self.meta.table, self.path)
            recs = buf[:, : per * rec].reshape(nb * per, rec)
            rows = flat[start * per : (start + nb) * per]
            have = rows >= 0
            out[rows[have]] = recs[have]
            self._count_blocks(np.arange(nb))

    def plan(self, rows: np.ndarray) -> BlockRead:
        """The whole-block read of ``rows`` (training thread: slots and generations as of now).
        Held for write-backs: the blocks with the most room (free slots now plus the slots of
        ``rows``, free once they are admitted), most first, until their room holds one victim
        per row read and a block more: every admission evicts at most as many rows as it
        reads, so the held images of its reads have room for all of its victims."""
        slots = self._slots(rows)
        blocks, where = np.unique(slots // self.per_block, return_inverse=True)
        where = where.reshape(-1)
        per = self.per_block
        room = self.free[(blocks[:, None] * per + np.arange(per)).reshape(-1)].reshape(-1, per).sum(1)
        mine = np.bincount(where, minlength=blocks.size)
        room += mine
        order = np.argsort(-room, kind="stable")
        need = rows.size + per
        take = np.sort(order[: int(np.searchsorted(np.cumsum(room[order]), need)) + 1])
        held = blocks[take]
        self.pending[held] += mine[take]
        return BlockRead(rows, slots, blocks, where, held, self.block_gen[held].copy(), mine[take].astype(np.int32))

    def read_blocks(self, plan: BlockRead, out: np.ndarray, advise: bool = True) -> None:
        """Run ``plan``: its blocks (adjacent blocks one read each, requested ``ADVISE_BLOCKS``
        ahead, at most ``CHUNK_BLOCKS`` in RAM at a time and their pages dropped a chunk later),
        its rows' records into ``out`` ``[n, record_bytes]``,
        the held blocks' images to the pool of known blocks (``_offer``)."""
        per, rec, bb = self.per_block, self.record_bytes, self.block_bytes
        n = plan.blocks.size
        by_block = np.argsort(plan.where, kind="stable")  # rows in block order
        row_at = np.searchsorted(plan.where[by_block], np.arange(n + 1))
        held_at = np.searchsorted(plan.blocks, plan.held)  # each held block's position in ``blocks``
        scratch = np.empty((min(CHUNK_BLOCKS, n), bb), dtype=np.uint8)
        asked = 0  # blocks requested ahead so far: at most ADVISE_BLOCKS beyond those read
        done: list[tuple[int, int]] = []  # (offset, bytes) of the runs read, their pages to drop
        # A chunk is CHUNK_BLOCKS blocks of the plan, adjacent or not: one pread per run of
        # adjacent blocks, then its records and held images taken at once (numpy per chunk,
        # not per block: the blocks of a random batch are mostly runs of one).
        for a in range(0, n, CHUNK_BLOCKS):
            b = min(n, a + CHUNK_BLOCKS)
            if advise and n > 1 and asked < min(n, b + ADVISE_BLOCKS):
                upto = min(n, b + ADVISE_BLOCKS)
                self._advise(plan.blocks[asked:upto])
                asked = upto
            # Read once: the previous chunk's pages go now, not at the next flush (the page cache
            # is RAM too), in one call over its span: a DONTNEED per block cost more than its
            # read. A chunk late: pages just read may still sit in a CPU's LRU batch, which
            # DONTNEED drains on every CPU before it can drop them.
            self._drop_span(done)
            blocks = plan.blocks[a:b]
            offs = (HEADER_BYTES + blocks.astype(np.int64) * bb).tolist()
            done = []
            for i, j in _runs(blocks):
                _pread_all(self.fd, memoryview(scratch[i:j]).cast("B"), offs[i], self.meta.table, self.path)
                done.append((offs[i], (j - i) * bb))
            buf = scratch[: b - a]
            sel = by_block[row_at[a] : row_at[b]]
            out[sel] = _records(buf, per, rec)[plan.where[sel] - a, plan.slots[sel] % per]
            h0, h1 = np.searchsorted(held_at, [a, b])
            for h in range(h0, h1):
                self._offer(int(plan.held[h]), int(plan.gens[h]), buf[held_at[h] - a])
        self._drop_span(done)
        self._count_blocks(plan.blocks)

    def _drop_span(self, runs: list[tuple[int, int]]) -> None:
        """Drop the pages from the first to the last of ``runs`` (offset, bytes; ascending)."""
        if runs:
            start = runs[0][0]
            os.posix_fadvise(self.fd, start, runs[-1][0] + runs[-1][1] - start, os.POSIX_FADV_DONTNEED)

    def place(self, rows: np.ndarray, data: np.ndarray) -> WriteJob:
        """Give ``rows`` (cached, to be written back) new slots and their records ``data``:
        free slots of the pooled blocks (content known: read, or written whole, and not
        written since), the roomiest first, each such block then written whole; the rest into
        other free slots. Old slots are freed. Training thread; run the job with ``write_job``
        (nothing in flight on this file)."""
        per, rec, bb = self.per_block, self.record_bytes, self.block_bytes
        with self._lock:
            self._prune_pool(0)
            blocks = np.fromiter(self.pool, dtype=np.int64, count=len(self.pool))
            room = self._room(blocks)
            blocks = blocks[np.argsort(-room, kind="stable")]
            cand = (blocks[:, None] * per + np.arange(per)).reshape(-1)
            cand = cand[self.free[cand]][: rows.size]
            slots = cand
            if cand.size < rows.size:  # not enough room in known blocks: write into others
                other = np.flatnonzero(self.free)
                other = other[~np.isin(other, cand)][: rows.size - cand.size]
                slots = np.concatenate([cand, other])
            self._assign(rows, slots)
            job = WriteJob([], [])
            placed = cand // per
            used = np.unique(placed)
            self.block_gen[used] += 1
            order = np.argsort(placed, kind="stable")
            edges = np.searchsorted(placed[order], used)
            for j, blk in enumerate(used.tolist()):
                i = order[edges[j] : edges[j + 1] if j + 1 < used.size else order.size]
                image = self.pool[blk]
                _records(image[None], per, rec)[0, cand[i] % per] = data[i]
                self.pool_gen[blk] = int(self.block_gen[blk])  # patched: the block's content again
                job.blocks.append((HEADER_BYTES + blk * bb, image))
            loose = slots[cand.size :]
            self.block_gen[np.unique(loose // per)] += 1
            job.records = [(int(o), data[cand.size + j]) for j, o in enumerate(self.offsets(loose).tolist())]
            self.rereads += int(np.unique(loose // per).size)
            self._prune_pool(self.pool_blocks // 2)  # room for the images of the next admissions
        return job

    def _room(self, blocks: np.ndarray) -> np.ndarray:
        """Free record slots of each of ``blocks``."""
        per = self.per_block
        return self.free[(blocks[:, None] * per + np.arange(per)).reshape(-1)].reshape(-1, per).sum(1)

    def plan_done(self, plan: BlockRead) -> None:
        """``plan``'s rows are admitted (their slots free now) or will not be: its blocks no
        longer count them as room to come. Training thread; once per plan, later calls no-ops."""
        if not plan.done:
            plan.done = True
            self.pending[plan.held] -= plan.pending

    def _offer(self, block: int, gen: int, image: np.ndarray) -> None:
        """Pool ``image``, read of ``block`` at generation ``gen``, if that is still the block's
        content, the pool has no current image of it and has room (any thread)."""
        with self._lock:
            if len(self.pool) >= self.pool_blocks or int(self.block_gen[block]) != gen:
                return
            if self.pool_gen.get(block) == gen:
                return
            self.pool[block] = image.copy()
            self.pool_gen[block] = gen

    def _prune_pool(self, keep: int) -> None:
        """Drop pooled images that are stale or of blocks with no room (free slots, or slots of
        rows read and about to be admitted); then all but the ``keep`` roomiest (``keep`` 0:
        no limit). Call with the lock held."""
        blocks = np.fromiter(self.pool, dtype=np.int64, count=len(self.pool))
        if blocks.size == 0:
            return
        gens = np.fromiter((self.pool_gen[b] for b in blocks.tolist()), dtype=np.int64, count=blocks.size)
        room = self._room(blocks) + self.pending[blocks]
        drop = (gens != self.block_gen[blocks]) | (room == 0)
        if keep and int((~drop).sum()) > keep:
            live = np.flatnonzero(~drop)
            drop[live[np.argsort(-room[live], kind="stable")[keep:]]] = True
        for b in blocks[drop].tolist():
            del self.pool[b], self.pool_gen[b]

    @property
    def pool_bytes(self) -> int:
        """RAM the pooled block images take now."""
        return len(self.pool) * self.block_bytes

    def _assign(self, rows: np.ndarray, slots: np.ndarray) -> None:
        old = self.loc[rows]
        self.free[slots] = False
        self.loc[rows] = slots
        self.free[old[old >= 0]] = True

    def write_job(self, job: WriteJob) -> None:
        """Write ``job``'s blocks whole and its loose records."""
        for off, image in job.blocks:
            _pwrite_all(self.fd, memoryview(image).cast("B"), off)
        for off, rec in job.records:
            _pwrite_all(self.fd, memoryview(np.ascontiguousarray(rec)).cast("B"), off)
        if job.blocks or job.records:
            # Written back once: flushed and dropped now, so the page cache holds no write-back's
            # dirty pages past its job (a memory cgroup cannot reclaim them before they are written).
            os.fdatasync(self.fd)
            bb = self.block_bytes
            blocks = np.unique([(o - HEADER_BYTES) // bb for o, _ in job.blocks + job.records])
            for a, b in _runs(blocks):
                os.posix_fadvise(self.fd, HEADER_BYTES + int(blocks[a]) * bb, (b - a) * bb, os.POSIX_FADV_DONTNEED)

    def write(self, rows: np.ndarray, data: np.ndarray, advise: bool = True) -> None:
        """Records of ``rows`` from ``data`` in place; a row living in the cache first gets a
        free slot. Each record is a partial write of its block (the kernel reads the block)."""
        cached = self.loc[rows] < 0
        if bool(cached.any()):
            self._assign(rows[cached], np.flatnonzero(self.free)[: int(cached.sum())])
        slots = self.loc[rows]
        for i, off in enumerate(self.offsets(slots).tolist()):
            _pwrite_all(self.fd, memoryview(np.ascontiguousarray(data[i])).cast("B"), off)
        blocks = np.unique(slots // self.per_block)
        self.block_gen[blocks] += 1
        self._count_blocks(blocks)

    def write_async(self, rows: np.ndarray, data: np.ndarray, pool: Executor | None) -> list:
        """Start writing ``rows`` from ``data`` in place on ``pool`` in chunks; the futures."""
        cached = self.loc[rows] < 0
        if bool(cached.any()):
            self._assign(rows[cached], np.flatnonzero(self.free)[: int(cached.sum())])
        if pool is None or rows.size <= INLINE_ROWS:
            self.write(rows, data)
            return []
        chunk = max(INLINE_ROWS, rows.size // 16)
        return [pool.submit(self.write, rows[i : i + chunk], data[i : i + chunk]) for i in range(0, rows.size, chunk)]

    def prefetch_pages(self, rows: np.ndarray) -> None:
        """Ask the kernel to read the blocks of ``rows`` now, all in flight at once."""
        self._advise(np.unique(self._slots(rows) // self.per_block))

    def _advise(self, blocks: np.ndarray) -> None:
        bb = self.block_bytes
        for a, b in _runs(blocks):
            os.posix_fadvise(self.fd, HEADER_BYTES + int(blocks[a]) * bb, (b - a) * bb, os.POSIX_FADV_WILLNEED)

    def _count_blocks(self, blocks: np.ndarray) -> None:
        with self._lock:
            self._touched += int(blocks.size) * self.block_bytes

    def drop_pages(self, force: bool = False) -> None:
        """Flush and drop the file's pages once ``FLUSH_BYTES`` of them may be cached (call
        between batches, with no write in flight)."""
        if force or self._touched >= FLUSH_BYTES:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self._touched = 0


def slot_dtype(n: int) -> type:
    """The integer type of slot or row numbers below ``n``: int32 where they fit."""
    return np.int32 if n < 2**31 else np.int64


def _records(images: np.ndarray, per: int, rec: int) -> np.ndarray:
    """``[blocks, per, rec]`` view of the record slots of block ``images`` ``[blocks, block_bytes]``
    (a view: indexing it reads or writes the images, with no per-byte index array)."""
    n = images.shape[0]
    return np.lib.stride_tricks.as_strided(images, (n, per, rec), (images.strides[0], rec, 1))


def _group(keys: np.ndarray, idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, positions) for each distinct key of ``keys``, ascending."""
    if keys.size == 0:
        return []
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    edges = [0, *(np.flatnonzero(np.diff(k)) + 1).tolist(), k.size]
    return [(int(k[a]), idx[order[a:b]]) for a, b in zip(edges[:-1], edges[1:])]


def _pread_all(fd: int, view: memoryview, off: int, table: str, path: Path) -> None:
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], off + got)
        if n <= 0:
            raise TierError(f"table '{table}': tier file '{path}' is shorter than its header says; delete it")
        got += n


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    done = 0
    while done < view.nbytes:
        try:
            done += os.pwrite(fd, view[done:], off + done)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise TierError(f"tier file write failed: no space left on the device (fd {fd}); free space on tiers.ssd_dir") from None
            raise


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) index ranges of ``rows`` whose values are consecutive."""
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    edges = [0, *breaks.tolist(), rows.size]
    return list(zip(edges[:-1], edges[1:]))


def encode(meta: TierFileMeta, w: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[n, record_bytes]`` uint8 records of weights ``w`` (storage dtype) and state rows."""
    parts = [w.contiguous().view(torch.uint8).view(w.shape[0], -1)]
    parts += [state[name].contiguous().view(torch.uint8).view(w.shape[0], -1) for name, _ in meta.state]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()


def decode(meta: TierFileMeta, data: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Inverse of ``encode``: weights (``dtype``) and float32 state rows."""
    wb = meta.weight_bytes
    w = data[:, :wb].contiguous().view(dtype)
    state, at = {}, wb
    for name, cols in meta.state:
        state[name] = data[:, at : at + 4 * cols].contiguous().view(torch.float32)
        at += 4 * cols
    return w, state
