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


def _huge_kib(t) -> int:
    """AnonHugePages (KiB) of the mappings that hold ``t``'s bytes (/proc/self/smaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are a Linux feature")
def test_embedding_weights_and_state_sit_on_huge_pages_when_the_kernel_offers_them():
    import torch

    from recscale.embedding import Adagrad, TableConfig
    from recscale.embedding.table_batched import TableBatchedEmbeddingBags
    from recscale.host_memory import advise_huge_pages, huge_pages_available

    if not huge_pages_available():
        pytest.skip("transparent huge pages are off on this kernel")
    small = torch.empty(1000)
    assert not advise_huge_pages(small)  # below the size worth a huge page: left alone
    emb = TableBatchedEmbeddingBags([TableConfig("big", 200_000, 64), TableConfig("tiny", 10, 64)], Adagrad(lr=0.1))
    storage = emb.groups[0].storage
    weight, state = storage.weight, next(iter(storage._state.values()))
    # 51 MB each: all but the unaligned ends (and pages the kernel could not make huge) are huge
    assert _huge_kib(weight) * 1024 > 0.5 * weight.numel() * 4
    assert _huge_kib(state) * 1024 > 0.5 * state.numel() * 4
    # the values are the same as without the advice
    from recscale.embedding.table_batched import init_rows

    assert torch.equal(weight[:200_000], init_rows(TableConfig("big", 200_000, 64), 0))
    assert torch.count_nonzero(state) == 0
