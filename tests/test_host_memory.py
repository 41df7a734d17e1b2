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
