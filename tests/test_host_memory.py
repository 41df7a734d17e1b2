"""``retain_freed_memory``: after it, a step's large buffers come back without page faults."""

from __future__ import annotations

import json
import sys

import pytest

from proc_utils import run

# Allocate and free a 48 MB buffer (above glibc's largest dynamic mmap threshold, 32 MB) again
# and again; count the minor page faults of the last rounds, once the heap has settled.
_PROBE = r"""
import json, resource, sys, torch
if sys.argv[1] == "1":
    from recscale.host_memory import retain_freed_memory
    assert retain_freed_memory()
    assert retain_freed_memory()  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    x = torch.ones(12 << 20)
    del x
before = faults()
for _ in range(5):
    x = torch.ones(12 << 20)
    del x
print(json.dumps({"faults": faults() - before}))
"""


def _faults(retain: bool) -> int:
    done = run([sys.executable, "-c", _PROBE, "1" if retain else "0"], timeout=120, capture_output=True, check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])["faults"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_freed_buffers_are_reused_without_page_faults():
    pages = 5 * (48 << 20) // 4096
    assert _faults(retain=False) > pages // 2  # unmapped on free, faulted in again
    assert _faults(retain=True) < pages // 20


def test_bad_limit_is_refused():
    from recscale.host_memory import retain_freed_memory

    with pytest.raises(ValueError, match="limit_bytes"):
        retain_freed_memory(0)



# Build an embedding module in a fresh process, as training does before it keeps freed memory
# (``retain_freed_memory``): only pages written after the advice become huge, so a heap that
# earlier work already touched (another test in this process) would hand back 4 KiB pages.
_HUGE_PROBE = r"""
import json, torch
from recscale.embedding import Adagrad, TableConfig
from recscale.embedding.table_batched import TableBatchedEmbeddingBags, init_rows
from recscale.host_memory import advise_huge_pages

def huge_kib(t):
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total

emb = TableBatchedEmbeddingBags([TableConfig("big", 200_000, 64), TableConfig("tiny", 10, 64)], Adagrad(lr=0.1))
storage = emb.groups[0].storage
weight, state = storage.weight, next(iter(storage._state.values()))
print(json.dumps({
    "small_advised": advise_huge_pages(torch.empty(1000)),
    "weight_share": huge_kib(weight) * 1024 / (weight.numel() * 4),
    "state_share": huge_kib(state) * 1024 / (state.numel() * 4),
    "values_same": bool(torch.equal(weight[:200_000], init_rows(TableConfig("big", 200_000, 64), 0))),
    "state_zero": int(torch.count_nonzero(state)) == 0,
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are a Linux feature")
def test_embedding_weights_and_state_sit_on_huge_pages_when_the_kernel_offers_them():
    from recscale.host_memory import huge_pages_available

    if not huge_pages_available():
        pytest.skip("transparent huge pages are off on this kernel")
    done = run([sys.executable, "-c", _HUGE_PROBE], timeout=120, capture_output=True, check=True)
    got = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert not got["small_advised"]  # below the size worth a huge page: left alone
    # 51 MB each: all but the unaligned ends (and pages the kernel could not make huge) are huge
    assert got["weight_share"] > 0.5 and got["state_share"] > 0.5, got
    assert got["values_same"] and got["state_zero"]  # the values are the same as without the advice


# A 20 MB block freed raises glibc's dynamic mmap threshold to 20 MB; 64 blocks of 1 MB then
# come from the heap, each followed by a small block still in use (so they cannot merge into
# the heap top and be trimmed): freed, they stay resident unless ``return_freed_memory`` fixed
# the threshold first.
_RETURN_PROBE = r"""
import json, sys, torch
if sys.argv[1] == "1":
    from recscale.host_memory import return_freed_memory
    assert return_freed_memory()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
x = torch.ones(5 << 20)
del x
blocks, pins = [], []
for _ in range(64):
    blocks.append(torch.ones(1 << 18))
    pins.append(bytearray(4096))
before = rss()
del blocks
print(json.dumps({"returned": before - rss()}))
"""


def _returned(fixed: bool) -> int:
    done = run([sys.executable, "-c", _RETURN_PROBE, "1" if fixed else "0"], timeout=120, capture_output=True,
               check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])["returned"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_return_freed_memory_gives_freed_blocks_back_to_the_os():
    assert _returned(fixed=False) < 16 << 20  # kept in the heap, resident
    assert _returned(fixed=True) > 48 << 20  # unmapped on free


def test_bad_return_limit_is_refused():
    from recscale.host_memory import return_freed_memory

    with pytest.raises(ValueError, match="limit_bytes"):
        return_freed_memory(0)
