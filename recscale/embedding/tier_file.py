"""The file behind a tiered table shard: one fixed-size record per row, weights and state.

Layout: a 4096-byte header (JSON naming the table, its rows, dim, dtype, state columns, seed
and whether the file was closed cleanly), then ``num_rows`` records of ``record_bytes`` each:
the row's weights in the storage dtype followed by each optimizer state row in float32. A row
is one read and one write.

The page cache is kept from becoming a second, unbounded cache with ``posix_fadvise`` rather
than ``O_DIRECT``: direct I/O needs block-aligned records (a 768-byte row would be padded to
4 KiB) and fails on tmpfs. The file is opened ``POSIX_FADV_RANDOM`` (no read-ahead); every page
a read or write touches is counted, and once ``FLUSH_BYTES`` of pages have been touched the file
is flushed (``fdatasync``) and all its pages dropped (``DONTNEED``), so the page cache holds at
most that much of the file plus the I/O in flight.

Queue depth: before reading or writing a set of records, ``prefetch_pages`` asks the kernel for
all their pages at once (``POSIX_FADV_WILLNEED``, asynchronous), so the device sees the whole
set in flight instead of one read per thread. A write-back needs this most: a record smaller
than a page is a read-modify-write of its page, and buffered writes to one file hold its inode
lock, so without the pages already cached the writes would run one device read at a time.
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
FORMAT = "recscale-tier-1"
FLUSH_BYTES = 64 << 20
# Reads of fewer rows run on the calling thread: a pool round trip costs more than they do.
INLINE_ROWS = 32
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

    def header(self, clean: bool) -> bytes:
        body = {"format": FORMAT, **asdict(self), "record_bytes": self.record_bytes, "clean": clean}
        raw = json.dumps(body, sort_keys=True).encode()
        return raw + b" " * (HEADER_BYTES - len(raw))


def _check_dir(table: str, ssd_dir: Path) -> None:
    if not ssd_dir.is_dir():
        raise TierError(f"table '{table}': tiers.ssd_dir '{ssd_dir}' does not exist; create it or point tiers.ssd_dir at a directory")
    if not os.access(ssd_dir, os.W_OK | os.X_OK):
        raise TierError(f"table '{table}': tiers.ssd_dir '{ssd_dir}' is not writable; choose a writable directory")


class RowFile:
    """Reads and writes whole records of one table shard's tier file."""

    def __init__(self, path: Path, meta: TierFileMeta, fd: int) -> None:
        self.path, self.meta, self.fd = path, meta, fd
        self.record_bytes = meta.record_bytes
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
        size = HEADER_BYTES + meta.num_rows * meta.record_bytes
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
            for start in range(0, meta.num_rows, chunk_rows):
                n = min(chunk_rows, meta.num_rows - start)
                w, state = init(start, n)
                data = encode(meta, w, state).numpy()
                off = HEADER_BYTES + start * meta.record_bytes
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
            os.pwrite(fd, meta.header(clean=False), 0)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return cls(path, meta, fd)

    def close(self) -> None:
        """Mark the file clean (every row current) and close it; call after writing back."""
        if self.fd < 0:
            return
        os.fdatasync(self.fd)
        os.pwrite(self.fd, self.meta.header(clean=True), 0)
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(self.fd)
        self.fd = -1

    # ------------------------------------------------------------------ rows
    def read(self, rows: np.ndarray, out: np.ndarray, advise: bool = True) -> None:
        """Records of ``rows`` (ascending) into ``out`` ``[n, record_bytes]``; runs of adjacent
        rows are one read each, all their pages requested first (``advise``)."""
        rec = self.record_bytes
        if advise and rows.size > INLINE_ROWS:
            self.prefetch_pages(rows)
        for a, b in _runs(rows):
            off = HEADER_BYTES + int(rows[a]) * rec
            view = memoryview(out[a:b]).cast("B")
            got = 0
            while got < view.nbytes:
                n = os.preadv(self.fd, [view[got:]], off + got)
                if n <= 0:
                    raise TierError(f"table '{self.meta.table}': tier file '{self.path}' is shorter than its header says; delete it")
                got += n
        self._count(rows)

    def read_async(self, rows: np.ndarray, out: np.ndarray, pool: Executor | None, advise: bool = True) -> list:
        """Start reading ``rows`` into ``out`` on ``pool`` in chunks; the futures to wait for.
        ``advise=False``: the caller has already requested their pages."""
        if pool is None or rows.size <= INLINE_ROWS:
            self.read(rows, out, advise)
            return []
        if advise:
            self.prefetch_pages(rows)
        chunk = max(INLINE_ROWS, rows.size // 16)
        return [pool.submit(self.read, rows[i : i + chunk], out[i : i + chunk], False) for i in range(0, rows.size, chunk)]

    def write(self, rows: np.ndarray, data: np.ndarray, advise: bool = True) -> None:
        """Records of ``rows`` (ascending) from ``data``; the pages they partly cover are
        requested first (``advise``), all at once."""
        rec = self.record_bytes
        if advise and rows.size > INLINE_ROWS:
            self.prefetch_pages(rows)
        for a, b in _runs(rows):
            _pwrite_all(self.fd, memoryview(data[a:b]).cast("B"), HEADER_BYTES + int(rows[a]) * rec)
        self._count(rows)

    def write_async(self, rows: np.ndarray, data: np.ndarray, pool: Executor | None, background: bool = False) -> list:
        """Start writing ``rows`` from ``data`` on ``pool`` in chunks; the futures to wait for.
        ``background``: even a few rows go to the pool, and each chunk requests its own pages
        there, so the calling thread spends nothing on them."""
        if pool is None or (rows.size <= INLINE_ROWS and not background):
            self.write(rows, data)
            return []
        if rows.size <= INLINE_ROWS:
            return [pool.submit(self.write, rows, data)]
        if not background:
            self.prefetch_pages(rows)
        chunk = max(INLINE_ROWS, rows.size // 16)
        return [pool.submit(self.write, rows[i : i + chunk], data[i : i + chunk], background) for i in range(0, rows.size, chunk)]

    def prefetch_pages(self, rows: np.ndarray) -> None:
        """Ask the kernel to read the pages of ``rows`` (ascending) now, all in flight at once;
        a later read or sub-page write of them then waits on these reads, not its own."""
        rec = self.record_bytes
        for a, b in _runs(rows):
            off = HEADER_BYTES + int(rows[a]) * rec
            os.posix_fadvise(self.fd, off, (b - a) * rec, os.POSIX_FADV_WILLNEED)

    def _count(self, rows: np.ndarray) -> None:
        """Count the pages the records of ``rows`` span (a record may straddle two)."""
        off = HEADER_BYTES + rows.astype(np.int64) * self.record_bytes
        pages = int(((off + self.record_bytes - 1) // 4096 - off // 4096 + 1).sum())
        with self._lock:
            self._touched += pages * 4096

    def drop_pages(self, force: bool = False) -> None:
        """Flush and drop the file's pages once ``FLUSH_BYTES`` of them may be cached (call
        between batches, with no write in flight)."""
        if force or self._touched >= FLUSH_BYTES:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self._touched = 0


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
