"""Where checkpoint bytes go: a small interface so object stores can plug in; local files first.

Paths are '/'-separated and relative to the storage root. A checkpoint is written under a
temporary name and made visible by ``commit`` (an atomic rename on a filesystem; an object store
would write the manifest last and treat its presence as the commit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)


class Storage(ABC):
    """The operations the checkpoint writer, reader and retention need, nothing more."""

    @abstractmethod
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """Context manager yielding a binary stream; the file is durable (fsynced) on exit."""

    @abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old content or ``data``, never part of it."""

    @abstractmethod
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes from ``offset`` (to the end when None)."""

    @abstractmethod
    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""

    @abstractmethod
    def list_dirs(self, path: str = "") -> list[str]:
        """Names of the entries directly under ``path`` that are directories."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def commit(self, tmp_dir: str, final_dir: str) -> None:
        """Make ``tmp_dir`` visible as ``final_dir`` in one step; an existing ``final_dir`` is
        never replaced (FileExistsError)."""

    @abstractmethod
    def delete_dir(self, path: str) -> None:
        """Remove a directory and everything in it (missing is fine)."""

    @abstractmethod
    def make_dir(self, path: str) -> None: ...

    def describe(self, path: str = "") -> str:
        return path


class LocalStorage(Storage):
    """A directory on a local or shared (network) filesystem. Data files (``open_write``) are
    written with ``direct`` I/O where the file system takes it (``DirectWriter``: no copy into
    the page cache); else, or with ``direct=False``, through the page cache, handed to the disk
    every ``stream_window`` bytes as they are written (``StreamingWriter``; 0: left to the
    kernel, with one fsync at the end)."""

    def __init__(self, root: str | os.PathLike[str], stream_window: int | None = None, direct: bool = True) -> None:
        self.root = Path(root)
        self.stream_window = STREAM_WINDOW if stream_window is None else int(stream_window)
        self.direct = direct and hasattr(os, "O_DIRECT")

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def describe(self, path: str = "") -> str:
        return str(self._p(path))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        p = self._p(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_direct(p) if self.direct else None
        if fd is not None:
            direct = DirectWriter(fd)
            try:
                yield direct  # type: ignore[misc]
                direct.close()
            finally:
                direct.release()
            return
        with open(p, "wb") as f:
            stream = StreamingWriter(f, self.stream_window or 1, stream=self.stream_window > 0)
            yield stream  # type: ignore[misc]
            stream.close()

    def write_atomic(self, path: str, data: bytes) -> None:
        p = self._p(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(p.parent)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self._p(path), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def size(self, path: str) -> int | None:
        try:
            return self._p(path).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def list_dirs(self, path: str = "") -> list[str]:
        p = self._p(path)
        if not p.is_dir():
            return []
        return sorted(e.name for e in p.iterdir() if e.is_dir())

    def commit(self, tmp_dir: str, final_dir: str) -> None:
        src, dst = self._p(tmp_dir), self._p(final_dir)
        # A checkpoint directory is never replaced: another checkpoint may name it as its base.
        # (rename() would replace an empty directory silently, so check first; one writer per run folder.)
        if dst.exists():
            raise FileExistsError(f"{dst} already exists; a checkpoint directory is never overwritten")
        os.rename(src, dst)
        _fsync_dir(dst.parent)

    def delete_dir(self, path: str) -> None:
        # A folder that cannot be removed costs disk space, not correctness: say so, go on.
        def report(_func, name, exc_info) -> None:
            log.warning("checkpoint storage: could not delete %s: %s", name, exc_info[1])

        if self._p(path).exists():
            shutil.rmtree(self._p(path), onerror=report)

    def make_dir(self, path: str) -> None:
        self._p(path).mkdir(parents=True, exist_ok=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: fsync the directory that holds it (where the OS allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        log.warning("checkpoint storage: cannot open folder %s to make a rename durable: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on folders; the rename itself happened
        log.warning("checkpoint storage: fsync of folder %s failed, a crash now may undo its last rename: %s", path, e)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- streaming writes
# Linux sync_file_range flags (linux/fs.h).
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _libc_function(name: str, argtypes: list):
    """libc's function ``name`` returning an int, or None where libc has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


# libc's ``sync_file_range`` (Linux), or None where there is none.
_sync_file_range = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])

# Bytes handed to the disk at a time. Large enough for sequential requests, small enough that
# the disk starts within a fraction of a second and little is dirty at any time.
STREAM_WINDOW = 64 << 20


class StreamingWriter:
    """A file written front to back that keeps the disk busy from its first window on.

    Left alone, the kernel starts writing a file's pages back only once a tenth or so of the
    memory is dirty, then throttles the writer in bursts, and the closing fsync writes what is
    left; a checkpoint of gigabytes spends seconds with an idle disk and the rest in stop-and-go.
    Here each ``window`` written is handed to the disk at once (``sync_file_range``, Linux), the
    window before it is waited for (so at most two windows are dirty: the writer goes at the
    disk's pace), and written windows leave the page cache (a checkpoint is not read back soon;
    the cache keeps what training reads). ``close`` still fsyncs: durability is that fsync's, as
    before. Without ``sync_file_range`` (or where it fails) this is a plain buffered file."""

    def __init__(self, f: BinaryIO, window: int = STREAM_WINDOW, stream: bool | None = None) -> None:
        self.f = f
        self.window = max(int(window), 1)
        self.stream = _sync_file_range is not None if stream is None else (stream and _sync_file_range is not None)
        self.written = 0  # bytes handed to f
        self.started = 0  # bytes handed to the disk (sync_file_range WRITE issued)
        self.done = 0  # bytes known written back and dropped from the cache

    def write(self, data: bytes | memoryview) -> int:
        n = self.f.write(data)
        self.written += n
        if self.stream and self.written - self.started >= self.window:
            self._advance()
        return n

    def fileno(self) -> int:
        return self.f.fileno()

    def tell(self) -> int:
        return self.written

    def _advance(self) -> None:
        self.f.flush()
        fd = self.f.fileno()
        # Wait for what was started before (the disk has had a window's time for it) ...
        if self.started > self.done and not self._range(fd, self.done, self.started - self.done,
                                                        _WAIT_BEFORE | _WRITE | _WAIT_AFTER):
            return
        if self.started > self.done:
            _drop_cache(fd, self.done, self.started - self.done)
            self.done = self.started
        # ... then hand the new bytes to the disk without waiting.
        if self._range(fd, self.started, self.written - self.started, _WRITE):
            self.started = self.written

    def _range(self, fd: int, offset: int, nbytes: int, flags: int) -> bool:
        assert _sync_file_range is not None
        if _sync_file_range(fd, offset, nbytes, flags) == 0:
            return True
        e = ctypes.get_errno()
        log.info("checkpoint storage: sync_file_range unavailable (%s); plain buffered writes", os.strerror(e))
        self.stream = False
        return False

    def close(self) -> None:
        """Everything written is durable (fsync) once this returns."""
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.stream and self.written > self.done:
            _drop_cache(self.f.fileno(), self.done, self.written - self.done)


def _drop_cache(fd: int, offset: int, nbytes: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


# ---------------------------------------------------------------------- direct writes
# Alignment of direct I/O (addresses, lengths, offsets): a multiple of every common logical
# block size (512 B, 4 KiB).
DIRECT_ALIGN = 4096
# Staging for the bytes that are not aligned: copied here and written a full buffer at a time.
DIRECT_STAGE = 16 << 20
# The largest single write: aligned parts longer than this are cut, so that several writes of
# one large part are in flight at once.
DIRECT_UNIT = 16 << 20
# Writes in flight at once, each on its own I/O thread.
DIRECT_DEPTH = 4
# The file is extended (fallocate) this far ahead of the writes: on ext4 a direct write that
# extends the file holds the inode lock until the disk is done, so writes past the end would
# run one at a time; inside the file they run side by side.
DIRECT_AHEAD = 256 << 20


def _open_direct(path: Path) -> int | None:
    """``path`` opened for writing with O_DIRECT, or None where the file system refuses it."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)  # type: ignore[attr-defined]
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: no direct I/O here (tmpfs, some FUSE); anything else is real
            raise
        log.info("checkpoint storage: %s does not take direct I/O; writing through the page cache", path.parent)
        return None


def _address(mv: memoryview) -> int:
    import numpy as np  # read-only buffers too (ctypes.from_buffer needs writable ones)

    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


# libc's ``fallocate`` (Linux; mode 0 allocates blocks and extends the file), or None. Not
# ``os.posix_fallocate``: where the file system has no fallocate, glibc emulates it by writing
# zeros, a second write of the whole file.
_fallocate = _libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


class _Stage:
    """A page-aligned staging buffer and the parts to copy into it (on the I/O thread)."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, size)  # page-aligned
        self.view = memoryview(self.mem)
        self.parts: list[tuple[int, memoryview | bytes]] = []  # (offset in the buffer, bytes)

    def close(self) -> None:
        try:
            self.view.release()
            self.mem.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass


class DirectWriter:
    """A file written front to back with direct I/O: the disk reads the bytes from the caller's
    buffers, with no copy into the page cache and no write-back later. Against a buffered file
    this takes a tenth of the CPU per byte, and a checkpoint writer runs on spare cycles.

    Aligned parts (address and length multiples of ``DIRECT_ALIGN``, at an aligned file offset:
    a lossless chunk's rows and state, as snapshots lie in memory) go to the disk as they are,
    in writes of at most ``unit`` bytes; other bytes are gathered into page-aligned staging
    buffers, copied there by the I/O thread that writes the buffer once it is full. Up to
    ``depth`` writes are in flight at once, each on its own I/O thread at its own file offset
    (``pwrite``): the disk's queue stays full while any one thread waits for a CPU, and the
    caller's thread only hands out work. The file is extended ahead of the writes (see
    ``DIRECT_AHEAD``). ``close`` writes the last partial block padded, truncates the file to its
    length and fsyncs: the file is byte for byte what was written. Should the file system refuse
    a direct write (EINVAL), the file goes on through the page cache from where it is. Parts
    must stay unchanged until ``close``: the writer keeps a reference, not a copy."""

    def __init__(self, fd: int, stage: int | None = None, depth: int | None = None, unit: int | None = None) -> None:
        self.fd = fd
        stage = DIRECT_STAGE if stage is None else stage
        unit = DIRECT_UNIT if unit is None else unit
        self.stage_size = max(DIRECT_ALIGN, stage // DIRECT_ALIGN * DIRECT_ALIGN)
        self.unit = max(DIRECT_ALIGN, unit // DIRECT_ALIGN * DIRECT_ALIGN)
        self.depth = max(1, DIRECT_DEPTH if depth is None else depth)
        self.stages: list[_Stage] = []  # every staging buffer made (at most depth + 1)
        self.free: deque[_Stage] = deque()  # those not being filled or written
        self.cur: _Stage | None = None  # the staging buffer being filled
        self.fill = 0  # bytes in it; it starts at file offset written - fill (aligned)
        self.written = 0  # bytes accepted
        self.allocated = 0  # the file's length as extended ahead of the writes
        self.extend = _fallocate is not None
        self.direct = True
        self.lock = threading.Lock()
        self.pending: deque[Future] = deque()
        self.pool = ThreadPoolExecutor(self.depth, thread_name_prefix="ckpt-direct-io")

    def write(self, data: bytes | memoryview) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            if self.fill == 0 and len(mv) >= DIRECT_ALIGN and _address(mv) % DIRECT_ALIGN == 0:
                k = len(mv) // DIRECT_ALIGN * DIRECT_ALIGN
                for a in range(0, k, self.unit):
                    b = min(a + self.unit, k)
                    self._submit(self.written + a, mv[a:b], None)
                self.written += k
                mv = mv[k:]
                continue
            if self.cur is None:
                self.cur = self.free.popleft() if self.free else self._new_stage()
            k = min(len(mv), self.stage_size - self.fill)
            self.cur.parts.append((self.fill, mv[:k]))
            self.fill += k
            self.written += k
            mv = mv[k:]
            if self.fill == self.stage_size:
                self._submit_stage(self.stage_size)
        return n

    def _new_stage(self) -> _Stage:
        s = _Stage(self.stage_size)
        self.stages.append(s)
        return s

    def _submit_stage(self, length: int) -> None:
        stage, start = self.cur, self.written - self.fill
        assert stage is not None
        self.cur, self.fill = None, 0
        self._submit(start, stage.view[:length], stage)

    def _submit(self, offset: int, mv: memoryview, stage: _Stage | None) -> None:
        while self.pending and (len(self.pending) >= self.depth or self.pending[0].done()):
            self.pending.popleft().result()  # raises a write's error here
        self._extend_to(offset + len(mv))
        self.pending.append(self.pool.submit(self._write_at, offset, mv, stage))

    def _extend_to(self, end: int) -> None:
        if not self.extend or end <= self.allocated:
            return
        assert _fallocate is not None
        # Ahead by DIRECT_AHEAD; short of room for that, just as far as the write needs.
        for new in ((end + DIRECT_AHEAD) // DIRECT_ALIGN * DIRECT_ALIGN, end):
            if _fallocate(self.fd, 0, self.allocated, new - self.allocated) == 0:
                self.allocated = new
                return
            e = ctypes.get_errno()
            if e != errno.ENOSPC:
                self.extend = False  # not on this file system: writes past the end, one at a time
                return
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _write_at(self, offset: int, mv: memoryview, stage: _Stage | None) -> None:
        try:
            if stage is not None:
                for at, part in stage.parts:
                    stage.view[at : at + len(part)] = part
            retried = False
            while len(mv):
                try:
                    k = os.pwrite(self.fd, mv, offset)
                except OSError as e:
                    if e.errno != errno.EINVAL or retried:
                        raise
                    self._stop_direct()
                    retried = True
                    continue
                mv, offset = mv[k:], offset + k
        finally:
            if stage is not None:
                stage.parts.clear()
                self.free.append(stage)

    def _stop_direct(self) -> None:
        with self.lock:
            if not self.direct:
                return
            log.info("checkpoint storage: a direct write was refused; writing on through the page cache")
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)  # type: ignore[attr-defined]
            self.direct = False

    def fileno(self) -> int:
        return self.fd

    def tell(self) -> int:
        return self.written

    def close(self) -> None:
        """Everything written is durable (fsync) once this returns."""
        if self.fill:
            padded = (self.fill + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN
            assert self.cur is not None
            self.cur.parts.append((self.fill, bytes(padded - self.fill)))
            self._submit_stage(padded)
        while self.pending:
            self.pending.popleft().result()
        if self.allocated > self.written or self.written % DIRECT_ALIGN:
            os.ftruncate(self.fd, self.written)
        os.fsync(self.fd)

    def release(self) -> None:
        """Waits for any write still queued (after an error, say), then closes the file."""
        for f in self.pending:
            f.exception()
        self.pending.clear()
        self.pool.shutdown(wait=True)
        os.close(self.fd)
        for s in self.stages:
            s.close()
