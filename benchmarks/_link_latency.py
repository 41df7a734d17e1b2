"""Probe run on emulated hosts (``recscale cluster ... -- benchmarks/_link_latency.py OUT``) or
on one host (``torchrun``): the time one small gloo collective takes between the ranks (an
all-to-all, an all-gather and an all-reduce of a few bytes, in turn, median per collective),
which rank 0 writes to OUT in seconds. A gloo collective waits for the receiver's notice before
it sends, so even a few bytes cost round trips through the network stacks and wake-ups of the
ranks' threads. ``simulator_validation.py`` prices what the emulated link adds: its time across
the hosts less its time over loopback."""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROUNDS = 60


def main(out: str) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    w = dist.get_world_size()
    x, y = torch.zeros(w, dtype=torch.int64), torch.empty(w, dtype=torch.int64)
    parts = [torch.empty(1, dtype=torch.int64) for _ in range(w)]
    times = []
    for i in range(ROUNDS + 5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x, [1] * w, [1] * w)
        dist.all_gather(parts, x[:1])
        dist.all_reduce(x)
        if i >= 5:  # connections warm
            times.append((time.perf_counter() - t0) / 3)
    if dist.get_rank() == 0:
        Path(out).write_text(f"{statistics.median(times)!r}\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
