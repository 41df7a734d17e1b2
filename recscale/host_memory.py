"""How the training process uses host memory: freed buffers kept for the next step, and huge
pages under the embedding tables (``advise_huge_pages``, below).

Keep freed host memory in the training process instead of handing it back to the OS.

A training step allocates and frees the same large buffers every time (pooled embeddings, the
interaction's vectors and their gradients, all-to-all payloads: tens of MB each). glibc's malloc
serves blocks that large with ``mmap`` and returns them with ``munmap`` (or trims the heap top),
so every step faults each page in again and the kernel zeroes it. On a virtual machine a page
fault is expensive; at 2 ranks on 2 cores this churn cost 10-13% of the step
(``benchmarks/e2e.py``). Raising malloc's mmap and trim thresholds makes freed blocks stay in the
heap for the next step, which is what a steady training loop wants: its peak is reached every
step anyway. ``train.retain_host_memory = false`` leaves the allocator as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# mallopt parameters (malloc.h); values are C ints.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused after free; bigger ones (whole tables,
# usually allocated once) are still mapped and unmapped directly.
DEFAULT_LIMIT = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def retain_freed_memory(limit_bytes: int = DEFAULT_LIMIT) -> bool:
    """Make glibc keep freed blocks under ``limit_bytes`` for reuse (process-wide; calling it
    again sets the same thresholds again, or the new limit).

    Returns True when the setting is in effect, False where it does not apply (not Linux with
    glibc): then nothing changes."""
    if not 0 < limit_bytes < 2**31:
        raise ValueError(f"limit_bytes must be in (0, 2**31), got {limit_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim threshold first: past it free() would return the heap top to the OS anyway.
    if mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1 or mallopt(_M_MMAP_THRESHOLD, limit_bytes) != 1:
        return False
    return True


# glibc's own start values: blocks from 128 KiB up are mapped, and unmapped when freed.
RETURN_LIMIT = 128 << 10


def return_freed_memory(limit_bytes: int = RETURN_LIMIT) -> bool:
    """The opposite of ``retain_freed_memory``: blocks of ``limit_bytes`` and more are mapped
    and unmapped when freed, and the heap top above it is trimmed, with the thresholds fixed
    (glibc otherwise raises them after each large free, up to 32 MiB, so later blocks come
    from the heap, where freed ones stay resident and fragment). For a process held to a RAM
    budget (a memory cgroup counts resident pages): its resident memory is then what it
    uses, not its past peaks. Costs a page fault per page of each large block. Returns True
    when in effect, False where it does not apply (not Linux with glibc)."""
    if not 0 < limit_bytes < 2**31:
        raise ValueError(f"limit_bytes must be in (0, 2**31), got {limit_bytes}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        lib = _libc()
        mallopt, trim = lib.mallopt, lib.malloc_trim
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, limit_bytes) != 1 or mallopt(_M_TRIM_THRESHOLD, limit_bytes) != 1:
        return False
    trim(0)  # what is free in the heap now goes back too
    return True


# Transparent huge pages (Linux): an embedding table is read and written at random rows, so with
# 4 KiB pages nearly every row touched is also a TLB miss, and a page walk on a virtual machine
# (nested paging) costs several memory reads more. 2 MiB pages cover a 512 MiB table with 256
# TLB entries instead of 131,072.
_MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
    """Whether the kernel gives huge pages to memory that asks for them ("always" or "madvise")."""
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def advise_huge_pages(t: torch.Tensor, min_bytes: int = 8 * HUGE_PAGE_BYTES) -> bool:
    """Ask for huge pages under a large host tensor, before its pages are first written (pages
    already in memory keep their size). Only the 2 MiB-aligned interior is advised; values and
    results are unchanged. Returns True when the advice was taken, False where it does not apply
    (not Linux, not a CPU tensor, smaller than ``min_bytes``, huge pages off)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    nbytes = t.numel() * t.element_size()
    if nbytes < min_bytes or not huge_pages_available():
        return False
    start = (t.data_ptr() + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1)
    end = (t.data_ptr() + nbytes) & ~(HUGE_PAGE_BYTES - 1)
    if end <= start:
        return False
    try:
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0
