"""The in-memory snapshot of a checkpoint: the one part of saving that stalls training.

A full snapshot of a model-sized state (26 tables x 1M rows x dim 64 with row-wise Adagrad: about
7 GB) copied into freshly allocated memory spends most of its time in page faults: every 4 KiB
page is faulted in and zeroed by the kernel before the copy writes it. ``SnapshotBuffers`` keeps
the host buffers of a written checkpoint for the next one (a steady run snapshots the same
shapes every time), asks for huge pages under new ones, and copies with every core this process
may use, since training waits for the copy anyway. A differential snapshot gathers its rows into
the same buffers (a prefix of a full one's). The buffers stay allocated between checkpoints:
the peak memory is the same as before (a snapshot exists while it is written); the memory is
just not handed back in between.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from recscale.host_cpus import usable_cpus
from recscale.host_memory import advise_huge_pages

# Below this a copy is not worth splitting over threads.
_PARALLEL_MIN_BYTES = 64 << 20


# Snapshot buffers start on a page: the writer's direct I/O then takes whole chunks straight
# from them (a chunk of rows is a multiple of a page for the usual shapes) without a staging copy.
_ALIGN = 4096


def _aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` whose first byte lies on a ``_ALIGN`` boundary."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % _ALIGN
    return raw[off : off + nbytes].view(dtype).view(shape)


class SnapshotBuffers:
    """Host buffers for snapshots, reused from one checkpoint to the next.

    ``take`` hands out buffers; ``release`` (from the writer thread, once a checkpoint is
    written) gives them back. Buffers are keyed by dtype and row shape and may be longer than
    asked: a snapshot gets a prefix view."""

    def __init__(self, threads: int | None = None, min_parallel_bytes: int = _PARALLEL_MIN_BYTES) -> None:
        self.threads = threads or usable_cpus(read_cgroup=False).cpus
        self.min_parallel_bytes = min_parallel_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-snapshot") if self.threads > 1 else None

    def _take(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a view of ``rows`` rows, the whole buffer it lies in)."""
        key = (like.dtype, tuple(like.shape[1:]))
        with self._lock:
            free = self._free.get(key, [])
            # Indices, not list.remove: tensors compare elementwise.
            fitting = [i for i, b in enumerate(free) if b.shape[0] >= rows]
            if fitting:
                buf = free.pop(min(fitting, key=lambda i: free[i].shape[0]))
            else:
                buf = None
                if free:  # too small for this snapshot: let the new buffer replace the largest
                    free.pop(max(range(len(free)), key=lambda i: free[i].shape[0]))
        if buf is None:
            buf = _aligned_empty((rows, *like.shape[1:]), like.dtype)
            advise_huge_pages(buf)  # before first touch: 2 MiB faults instead of 4 KiB ones
        return buf[:rows], buf

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Allocate and fault in a buffer for each of ``tensors`` now, so that the first
        checkpoint's snapshot copies into memory already mapped (a 7 GB state: 6-10 s of page
        faults and compaction otherwise, paid in the middle of training)."""
        held: list[torch.Tensor] = []
        for t in tensors:
            if t.dim() == 0 or t.device.type != "cpu":
                continue
            _, buf = self._take(t.shape[0], t)
            self._split(buf.shape[0], buf.numel() * buf.element_size(), lambda a, b, buf=buf: buf[a:b].zero_())
            held.append(buf)
        self.release(held)

    def release(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                self._free.setdefault((b.dtype, tuple(b.shape[1:])), []).append(b)

    def _split(self, n: int, nbytes: int, fn: Callable[[int, int], object]) -> None:
        if self._pool is None or nbytes < self.min_parallel_bytes or n < self.threads:
            fn(0, n)
            return
        bounds = [n * i // self.threads for i in range(self.threads + 1)]
        for f in [self._pool.submit(fn, a, b) for a, b in zip(bounds, bounds[1:])]:
            f.result()

    def copy(self, src: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
        """A host copy of ``src``; the buffer it uses is appended to ``held``."""
        src = src.detach()
        if src.dim() == 0:
            return src.to("cpu", copy=True)
        out, buf = self._take(src.shape[0], src)
        held.append(buf)
        if src.device.type != "cpu":
            out.copy_(src)
            return out
        self._split(src.shape[0], src.numel() * src.element_size(), lambda a, b: out[a:b].copy_(src[a:b]))
        return out

    def gather(self, src: torch.Tensor, rows: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
        """``src[rows]`` on the host; the buffer it uses is appended to ``held``."""
        src = src.detach()
        rows = rows.to(src.device)
        out, buf = self._take(rows.numel(), src)
        held.append(buf)
        if src.device.type != "cpu":
            out.copy_(src.index_select(0, rows))
            return out
        row_bytes = src[0].numel() * src.element_size() if src.shape[0] else 0
        self._split(rows.numel(), rows.numel() * row_bytes,
                    lambda a, b: torch.index_select(src, 0, rows[a:b], out=out[a:b]))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            self._free.clear()
