"""Keep freed host memory in the training process instead of handing it back to the OS.

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
import sys

# mallopt parameters (malloc.h); values are C ints.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused after free; bigger ones (whole tables,
# usually allocated once) are still mapped and unmapped directly.
DEFAULT_LIMIT = 1 << 30


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
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim threshold first: past it free() would return the heap top to the OS anyway.
    if mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1 or mallopt(_M_MMAP_THRESHOLD, limit_bytes) != 1:
        return False
    return True
