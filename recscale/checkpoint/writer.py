"""Writing checkpoints: the in-memory snapshot (the only stall), then quantizing and writing in
the background, chunk by chunk and pipelined, then the commit.

Every rank writes ``rankNNNNN.bin`` (its chunks) and ``rankNNNNN.state`` into the checkpoint's
temporary directory, then a small part file listing them. Rank 0 waits for every rank's part,
merges them into ``manifest.json`` (written last, atomically) and renames the directory to its
final name: a reader sees the whole checkpoint or nothing, also when a process dies meanwhile.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from recscale import faults
from recscale.checkpoint.checksum import crc32
from recscale.checkpoint.manifest import BY_CHUNKS, MANIFEST, Chunk, CheckpointError, FileEntry, Manifest, tmp_name
from recscale.checkpoint.quantize import Codec, allocate_widths, row_importance, warm_starts
from recscale.checkpoint.range_memory import RangeMemory
from recscale.checkpoint.storage import Storage
from recscale.embedding import TableConfig
from recscale.embedding.table_batched import init_rows


@dataclass
class ShardSnapshot:
    """Copies of the rows of one table shard that a checkpoint holds."""

    table: str
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    rows: torch.Tensor | None  # sorted local row indices; None = every row of the shard
    weight: torch.Tensor  # [n, num_cols], storage dtype, CPU
    state: dict[str, torch.Tensor]  # name -> [n, cols] float32, CPU
    config: TableConfig  # the whole table (its initial rows are a function of it and the seed)


@dataclass
class WriteJob:
    manifest: Manifest  # everything but files, chunks and stats
    rank: int
    world_size: int
    shards: list[ShardSnapshot]
    rank_state: bytes
    weight_codec: Codec
    state_codec: Codec
    chunk_rows: int
    stall_s: float
    full_fp32_bytes: int  # what an unquantized full checkpoint of this rank's shards would take
    # Full checkpoints: leave out rows still at their initial values for this seed (None: keep all).
    init_seed: int | None = None
    # Called once the job no longer needs its snapshot (written or failed): buffers go back.
    on_done: Callable[[], None] | None = None
    # adaptive: each row's last range search, read as the next search's start and updated.
    ranges: RangeMemory | None = None
    # With a row tracker, per shard the rows updated since the last checkpoint (bool per local
    # row): cleared from ``ranges``' kept rows before anything of this job runs. None: untracked,
    # no row is kept.
    changed: dict[tuple[str, int, int], torch.Tensor] | None = None


@dataclass
class WriteReport:
    name: str
    kind: str
    step: int
    rank: int
    stall_s: float
    background_s: float
    bytes_written: int
    rows_written: int
    full_fp32_bytes: int
    committed: bool = False
    extra: dict = field(default_factory=dict)
    # Where the background seconds went (``write_rank``): encode (rows out of the snapshot,
    # encoding, crc32; its own thread), the writes, the closing fsync, the small files, commit.
    # ``adaptive`` also counts rows here: ``searched_rows`` range-searched, ``warm_rows`` of them
    # started from an earlier search's result, ``kept_rows`` unchanged and encoded as before.
    phases: dict = field(default_factory=dict)


def rank_file(rank: int, suffix: str) -> str:
    return f"rank{rank:05d}.{suffix}"


# ---------------------------------------------------------------------- chunk encoding
def off_initial(table: TableConfig, seed: int, first_row: int, col_offset: int, weight: torch.Tensor,
                state: dict[str, torch.Tensor]) -> np.ndarray:
    """Rows of a block (``weight``: the table's rows from ``first_row``, columns from
    ``col_offset``; ``state``: theirs) that differ from their initial values (bitwise) or have
    non-zero optimizer state: the rows a full checkpoint must hold."""
    init = init_rows(table, seed, first_row, weight.shape[0], col_offset, weight.shape[1])
    keep = (weight.cpu() != init.to(weight.dtype)).any(1)
    for t in state.values():
        keep |= (t.cpu() != 0).any(1)
    return np.flatnonzero(keep.numpy())


def initial_row_mask(sh: ShardSnapshot, seed: int, a: int, b: int) -> np.ndarray:
    """Local rows ``a..b`` of a whole-shard snapshot that a full checkpoint must hold."""
    return off_initial(sh.config, seed, sh.row_offset + a, sh.col_offset, sh.weight[a:b],
                       {k: t[a:b] for k, t in sh.state.items()})


@dataclass
class _Block:
    """One chunk to write: a shard's local rows ``a..b``, those of them it holds, how it names them."""

    sh: ShardSnapshot
    a: int
    b: int
    pick: torch.Tensor | None  # rows of sh.weight to take (None: the slice lo..hi)
    lo: int
    hi: int
    n: int
    selector: str
    ids: bytes

    def local_rows(self) -> torch.Tensor:
        """The shard's local indices of the rows this block holds, in order."""
        if self.pick is not None:
            return self.pick
        if self.sh.rows is not None:
            return self.sh.rows[self.lo : self.hi]
        return torch.arange(self.lo, self.hi)

    def rows(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sh = self.sh
        if self.pick is not None:
            return sh.weight.index_select(0, self.pick), {k: t.index_select(0, self.pick) for k, t in sh.state.items()}
        return sh.weight[self.lo : self.hi], {k: t[self.lo : self.hi] for k, t in sh.state.items()}


def plan_blocks(job: WriteJob) -> Iterator[_Block]:
    """Each shard cut into blocks of ``chunk_rows`` local rows, with the rows each one holds."""
    for sh in job.shards:
        if sh.rows is not None and sh.rows.numel() == 0:
            continue
        positions = None if sh.rows is None else sh.rows.numpy()
        for a in range(0, sh.num_rows, job.chunk_rows):
            b = min(a + job.chunk_rows, sh.num_rows)
            if positions is None and job.init_seed is None:
                lo, hi, local = a, b, None
            elif positions is None:  # a full snapshot: only rows no longer at their initial values
                local = initial_row_mask(sh, job.init_seed, a, b)
                lo, hi = a, b
            else:
                lo, hi = np.searchsorted(positions, [a, b])
                local = positions[lo:hi] - a
            n = (hi - lo) if local is None else len(local)
            if n == 0:
                continue
            if n == b - a:
                selector, ids = "range", b""
            elif (b - a + 7) // 8 < 4 * n:
                mask = np.zeros(b - a, dtype=np.uint8)
                mask[local] = 1
                selector, ids = "bitmap", np.packbits(mask, bitorder="little").tobytes()
            else:
                selector, ids = "ids", local.astype(np.int32).tobytes()
            pick = torch.from_numpy(local + a) if positions is None and local is not None and n < b - a else None
            yield _Block(sh, a, b, pick, int(lo), int(hi), int(n), selector, ids)


def width_tags(job: WriteJob, blocks: list[_Block]) -> list[torch.Tensor]:
    """``mixed``: every block's row widths, allocated over all the rows this rank writes at once,
    so the bits go to the rows that matter most whichever table holds them."""
    if not blocks:
        return []
    ranges, weights, cols = [], [], []
    for blk in blocks:
        w, state = blk.rows()
        ranges.append(w.amax(1).float() - w.amin(1).float())
        imp = row_importance(state)
        weights.append(torch.ones(blk.n) if imp is None else imp)
        cols.append(torch.full((blk.n,), blk.sh.num_cols, dtype=torch.int64))
    tags = allocate_widths(torch.cat(ranges), torch.cat(weights), torch.cat(cols), job.weight_codec.bits)
    return list(torch.split(tags, [blk.n for blk in blocks]))


def _encode_warm(job: WriteJob, blk: _Block, weight: torch.Tensor, ph: dict) -> bytes:
    """``adaptive``: a row unchanged since its last encoding is encoded on it again; the others'
    range search starts from their last result, and leaves its own. ``ph`` counts the rows kept,
    searched, and searched from a start."""
    codec, ranges = job.weight_codec, job.ranges
    assert ranges is not None
    key, rows = (blk.sh.table, blk.sh.row_offset, blk.sh.col_offset), blk.local_rows()
    found = ranges.start(codec, key, blk.sh.num_rows, rows)
    kept = int(found.kept.sum())
    ph["kept_rows"] = ph.get("kept_rows", 0) + kept
    ph["searched_rows"] = ph.get("searched_rows", 0) + int(found.found.shape[0]) - kept
    ph["warm_rows"] = ph.get("warm_rows", 0) + int((warm_starts(found.found, codec.bins) & ~found.kept).sum())
    w = codec.encode_kept(weight, found)
    ranges.store(key, rows, found, tracked=job.changed is not None)
    return w


def forget_changed(job: WriteJob) -> None:
    """Rows updated since the last checkpoint are no longer kept by ``job.ranges``: run before
    the job encodes anything (also when it then fails), and whatever its codec."""
    if job.ranges is not None and job.changed is not None:
        for key, mask in job.changed.items():
            job.ranges.changed(key, mask)


def encode_chunks(job: WriteJob, file: str, phases: dict | None = None, checksum: bool = True
                  ) -> Iterator[tuple[Chunk, list[bytes | memoryview]]]:
    """Each block encoded, as the parts its payload is made of in order (offsets filled later).
    ``mixed`` plans every block first: its widths are allocated over all of them; other codecs
    encode each block as it is planned. Lossless parts are views of the snapshot, not copies.
    ``phases`` (optional) accumulates ``encode_s`` (planning, rows, encoding) and ``crc_s``.
    ``checksum=False`` leaves each chunk's crc32 at 0 for the consumer to fill (``chunk_crc``)."""
    ph = phases if phases is not None else {}
    ph.setdefault("encode_s", 0.0)
    ph.setdefault("crc_s", 0.0)
    t = time.perf_counter()
    blocks: Iterator[_Block] | list[_Block] = plan_blocks(job)
    tags: Iterator[torch.Tensor | None] = itertools.repeat(None)
    if job.weight_codec.method == "mixed":
        blocks = list(blocks)
        tags = iter(width_tags(job, blocks))
    ph["encode_s"] += time.perf_counter() - t
    for blk, t in _timed(zip(blocks, tags), ph, "encode_s"):
        t0 = time.perf_counter()
        sh, ids = blk.sh, blk.ids
        weight, state = blk.rows()
        if t is not None:
            w = job.weight_codec.encode(weight, t)
        elif job.ranges is not None and job.weight_codec.method == "adaptive":
            w = _encode_warm(job, blk, weight, ph)
        else:
            w = job.weight_codec.encode_view(weight)
        parts: list[bytes | memoryview] = [ids, w]
        state_meta = []
        for name, st in state.items():
            sb = job.state_codec.encode_view(st)
            parts.append(sb)
            state_meta.append((name, st.shape[1], len(sb)))
        t1 = time.perf_counter()
        crc = chunk_crc(parts) if checksum else 0
        t2 = time.perf_counter()
        ph["encode_s"] += t1 - t0
        ph["crc_s"] += t2 - t1
        yield (
            Chunk(
                table=sh.table, file=file, offset=0, length=sum(len(part) for part in parts), crc32=crc,
                row_start=sh.row_offset + blk.a, row_stop=sh.row_offset + blk.b, selector=blk.selector,
                num_rows=blk.n, col_offset=sh.col_offset, num_cols=sh.num_cols,
                id_bytes=len(ids), weight_bytes=len(w), state=tuple(state_meta),
            ),
            parts,
        )


def chunk_crc(parts: list[bytes | memoryview]) -> int:
    """The crc32 of a chunk's payload, its parts in order."""
    crc = 0
    for part in parts:
        crc = crc32(part, crc)
    return crc


def _timed(items: Iterator, phases: dict, key: str) -> Iterator:
    """``items``, adding the seconds each ``next`` takes (planning the next block) to ``phases[key]``."""
    it = iter(items)
    while True:
        t = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            phases[key] += time.perf_counter() - t
            return
        phases[key] += time.perf_counter() - t
        yield x


def thread_times() -> tuple[float, float | None]:
    """The calling thread's (CPU seconds, seconds it was runnable but waiting for a CPU); the
    second is None where the OS does not say (Linux: ``/proc/thread-self/schedstat``). A
    background writer that waits long for a CPU is starved, not slow."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), None


def _add_thread_times(phases: dict, prefix: str, start: tuple[float, float | None]) -> None:
    cpu, wait = thread_times()
    phases[f"{prefix}_cpu_s"] = cpu - start[0]
    if wait is not None and start[1] is not None:
        phases[f"{prefix}_runqueue_s"] = wait - start[1]


def lower_thread_priority() -> None:
    """Run the calling background thread at the lowest CPU priority (Linux: per thread), so
    quantizing and writing use spare cycles and take as little as possible from training."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _pipelined(items: Iterator, depth: int = 4, phases: dict | None = None) -> Iterator:
    """Run ``items`` (quantization) in a helper thread, ``depth`` ahead of the consumer (writes).
    ``phases`` (optional) gets ``encode_ahead_wait_s``: the helper waiting for room (the writes
    are behind), and ``write_wait_s``: the consumer waiting for an item (the encoding is)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    ph = phases if phases is not None else {}
    ph.setdefault("encode_ahead_wait_s", 0.0)
    ph.setdefault("write_wait_s", 0.0)

    def produce() -> None:
        lower_thread_priority()
        start = thread_times()
        try:
            for it in items:
                t = time.perf_counter()
                q.put(it)
                ph["encode_ahead_wait_s"] += time.perf_counter() - t
        except BaseException as e:  # handed to the consumer
            q.put(e)
        _add_thread_times(ph, "encode_thread", start)
        q.put(done)

    t = threading.Thread(target=produce, name="ckpt-quantize", daemon=True)
    t.start()
    while True:
        t0 = time.perf_counter()
        it = q.get()
        ph["write_wait_s"] += time.perf_counter() - t0
        if it is done:
            break
        if isinstance(it, BaseException):
            t.join()
            raise it
        yield it
    t.join()


# ---------------------------------------------------------------------- one checkpoint
def write_rank(storage: Storage, job: WriteJob) -> WriteReport:
    """Quantize and write this rank's files, then its part file; rank 0 also commits."""
    t0 = time.perf_counter()
    name = job.manifest.name
    tmp = tmp_name(name)
    storage.make_dir(tmp)
    data_file = rank_file(job.rank, "bin")
    chunks: list[Chunk] = []
    rows = 0
    offset = 0
    phases: dict[str, float] = {"write_s": 0.0}
    start = thread_times()
    with storage.open_write(f"{tmp}/{data_file}") as f:
        # The crc32 runs here, not on the quantizing thread: at the lowest priority that thread
        # waits seconds for a CPU beside training, and a lossless chunk needs nothing else of it.
        # With the ISA-L crc32 this is a fraction of a second per gigabyte.
        for chunk, parts in _pipelined(encode_chunks(job, data_file, phases, checksum=False), phases=phases):
            tw = time.perf_counter()
            for part in parts:
                f.write(part)
            tc = time.perf_counter()
            crc = chunk_crc(parts)  # while the disk writes them (parts stay unchanged until close)
            phases["write_s"] += tc - tw
            phases["crc_s"] += time.perf_counter() - tc
            chunks.append(Chunk(**{**asdict(chunk), "offset": offset, "crc32": crc, "state": chunk.state}))
            offset += chunk.length
            rows += chunk.num_rows
            faults.point("checkpoint", job.manifest.step)
        faults.point("checkpoint", job.manifest.step)
        t_close = time.perf_counter()
    phases["fsync_s"] = time.perf_counter() - t_close  # the data file's closing fsync
    _add_thread_times(phases, "write_thread", start)
    t_small = time.perf_counter()
    state_file = rank_file(job.rank, "state")
    storage.write_atomic(f"{tmp}/{state_file}", job.rank_state)
    files = [
        FileEntry(data_file, offset, BY_CHUNKS),
        FileEntry(state_file, len(job.rank_state), hashlib.sha256(job.rank_state).hexdigest()),
    ]
    report = WriteReport(
        name, job.manifest.kind, job.manifest.step, job.rank, job.stall_s, 0.0,
        offset + len(job.rank_state), rows, job.full_fp32_bytes, phases=phases,
    )
    part = {
        "files": [asdict(x) for x in files],
        "chunks": [c.to_dict() for c in chunks],
        "report": asdict(report),
    }
    storage.write_atomic(f"{tmp}/{rank_file(job.rank, 'part.json')}", json.dumps(part).encode())
    phases["small_files_s"] = time.perf_counter() - t_small
    report.background_s = time.perf_counter() - t0
    return report


def commit(
    storage: Storage, manifest: Manifest, world_size: int, timeout_s: float, known: dict[str, Manifest] | None = None
) -> Manifest:
    """Rank 0: wait for every rank's part, write the manifest last, make the checkpoint visible.
    The manifest records the run and digest of every checkpoint its chain builds on (from
    ``known``, the ones this writer committed, else read back)."""
    tmp = tmp_name(manifest.name)
    deadline = time.monotonic() + timeout_s
    parts = []
    for r in range(world_size):
        path = f"{tmp}/{rank_file(r, 'part.json')}"
        while not storage.exists(path):
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {manifest.name}: rank {r} did not finish writing within {timeout_s:.0f} s "
                    "(checkpoint.commit_timeout_s); it stays uncommitted and invisible"
                )
            time.sleep(0.01)
        parts.append(json.loads(storage.read(path)))
    files, chunks, reports = [], [], []
    for p in parts:
        files += [FileEntry(**x) for x in p["files"]]
        chunks += [Chunk.from_dict(c) for c in p["chunks"]]
        reports.append(p["report"])
    manifest.files = files
    manifest.chunks = chunks
    manifest.stats = {
        "bytes_written": sum(x["bytes_written"] for x in reports),
        "rows_written": sum(x["rows_written"] for x in reports),
        "full_fp32_bytes": sum(x["full_fp32_bytes"] for x in reports),
        "stall_s_max": max(x["stall_s"] for x in reports),
    }
    manifest.created_unix = time.time()
    bases = [(known or {}).get(n) or load_base(storage, n) for n in manifest.chain[:-1]]
    manifest.links = [{"name": b.name, "run": b.run, "digest": b.digest} for b in bases]
    storage.write_atomic(f"{tmp}/{MANIFEST}", manifest.to_json())
    storage.commit(tmp, manifest.name)
    return manifest


def write_failure(what: str, where: str, e: OSError) -> str:
    """One line for a checkpoint write the file system refused, with what to do."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "no space left on the device" if full else (e.strerror or str(e))
    return (f"{what} could not be written in '{where}' ({reason}) and was not kept; the checkpoints "
            f"before it are intact; {'free space' if full else 'fix the folder'} (or set checkpoint.dir elsewhere) "
            "and resume from the last one with --resume")


def load_base(storage: Storage, name: str) -> Manifest:
    where = storage.describe(name)
    if storage.size(f"{name}/{MANIFEST}") is None:
        raise CheckpointError(f"{where}: the baseline this checkpoint builds on is gone; it cannot be committed")
    return Manifest.from_json(storage.read(f"{name}/{MANIFEST}"), where)


class CheckpointWriter:
    """Runs write jobs one after another in a background thread (or inline), at most
    ``max_in_flight`` queued or running; errors surface at the next submit or at ``wait``."""

    def __init__(
        self,
        storage: Storage,
        rank: int,
        world_size: int,
        async_write: bool = True,
        max_in_flight: int = 1,
        commit_timeout_s: float = 600.0,
        on_commit: Callable[[Manifest], None] | None = None,
    ) -> None:
        self.storage, self.rank, self.world_size = storage, rank, world_size
        self.async_write = async_write
        self.max_in_flight = max_in_flight
        self.commit_timeout_s = commit_timeout_s
        self.on_commit = on_commit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write") if async_write else None
        self._in_flight: list[Future] = []
        self.reports: list[WriteReport] = []
        self.committed: dict[str, Manifest] = {}  # rank 0: what it committed (the chains' links)

    def wait_for_slot(self) -> None:
        """Block until fewer than ``max_in_flight`` checkpoints are being written."""
        while len(self._in_flight) >= self.max_in_flight:
            self._collect(self._in_flight.pop(0))
        self._in_flight = [f for f in self._in_flight if not self._try_collect(f)]

    def idle(self) -> bool:
        """No checkpoint queued or being written (errors surface at the next submit or wait)."""
        return all(f.done() for f in self._in_flight)

    def submit(self, job: WriteJob) -> None:
        if self._pool is None:
            self.reports.append(self._run(job))
            return
        self._in_flight.append(self._pool.submit(self._run, job))

    def _run(self, job: WriteJob) -> WriteReport:
        # This thread mostly waits on the disk and keeps its normal priority: at the lowest one
        # each write's completion waits behind the training thread for a CPU, and the disk idles.
        # Quantizing, where the CPU goes, runs at the lowest priority (``_pipelined``).
        try:
            forget_changed(job)
            return self._write(job)
        except OSError as e:  # a full disk, most often: the checkpoint is dropped whole
            name = job.manifest.name
            if self.rank == 0:
                self.storage.delete_dir(tmp_name(name))
            raise CheckpointError(write_failure(f"checkpoint {name}", self.storage.describe(), e)) from None
        finally:
            if job.on_done is not None:
                job.on_done()

    def _write(self, job: WriteJob) -> WriteReport:
        report = write_rank(self.storage, job)
        if self.rank == 0:
            t0 = time.perf_counter()
            manifest = commit(self.storage, job.manifest, self.world_size, self.commit_timeout_s, self.committed)
            self.committed = {n: m for n, m in self.committed.items() if n in manifest.chain}
            self.committed[manifest.name] = manifest
            report.committed = True
            if self.on_commit is not None:
                self.on_commit(manifest)
            report.background_s += time.perf_counter() - t0
            report.phases["commit_s"] = time.perf_counter() - t0  # manifest, rename, retention
            report.extra = {
                **manifest.stats, "chain": list(manifest.chain),
                "changed_fraction": manifest.training.get("changed_fraction"),
            }
        return report

    def _try_collect(self, f: Future) -> bool:
        if not f.done():
            return False
        self._collect(f)
        return True

    def _collect(self, f: Future) -> None:
        try:
            self.reports.append(f.result())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"writing a checkpoint failed in the background: {type(e).__name__}: {e}") from e

    def wait(self) -> None:
        """Wait for every checkpoint in flight (raises the first background error)."""
        while self._in_flight:
            self._collect(self._in_flight.pop(0))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
