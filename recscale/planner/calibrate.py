"""Measure this machine for the planner: row-gather bandwidth, backward + fused update cost,
per-kernel overhead, and all-to-all bandwidth and latency between local ranks (gloo or NCCL).

Each measurement is short (a few seconds in all) and uses the same operator and collectives as
training, so the planner's constants describe what training will actually see.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.planner.hardware import Hardware
from recscale.sparse import JaggedBatch


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_lookup(rows: int = 2_000_000, dim: int = 64, ids: int = 262_144, repeats: int = 7) -> dict[str, float]:
    """Forward gather bandwidth, backward+update / forward ratio, and per-call overhead."""
    gen = torch.Generator().manual_seed(0)
    op = TableBatchedEmbeddingBags([TableConfig("t", rows, dim)], RowWiseAdagrad(lr=0.01))
    batch = JaggedBatch(("t",), torch.randint(0, rows, (ids,), generator=gen), torch.ones(ids, dtype=torch.int64))
    grad = torch.randn(ids, dim, generator=gen)

    def fwd():
        with torch.no_grad():
            op(batch)

    def step():
        op(batch).backward(grad)

    t_fwd = _median_time(fwd, repeats)
    t_step = _median_time(step, repeats)
    tiny = JaggedBatch(("t",), torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64))
    tiny_grad = torch.zeros(8, dim)
    t_tiny = _median_time(lambda: op(tiny).backward(tiny_grad), 50)
    fwd_bytes = ids * dim * 4 * 2  # rows read + pooled rows written
    return {
        "memory_bw": fwd_bytes / t_fwd,
        "backward_factor": max((t_step - t_fwd) / t_fwd, 0.5),
        "kernel_overhead_s": t_tiny / 2,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _a2a_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for nbytes in (256, 8 << 20):
        x = torch.zeros(nbytes * world // 4)
        y = torch.empty_like(x)
        t = _median_time(lambda: dist.all_to_all_single(y, x), 9)
        results[nbytes] = t
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure_all_to_all(world: int = 2) -> dict[str, float]:
    """Per-rank all-to-all bandwidth (bytes sent to other ranks / time) and latency."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "a2a.pt")
        mp.start_processes(_a2a_worker, args=(world, _free_port(), out), nprocs=world, start_method="spawn")
        r = torch.load(out)
    small, big = r[256], r[8 << 20]
    sent = (8 << 20) * (world - 1)  # each rank sends nbytes to every other rank
    return {"intra_host_bw": sent / max(big - small, 1e-9), "latency_s": small}


def physical_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(world_size: int = 2, memory_fraction: float = 0.6) -> Hardware:
    """This machine as a Hardware description for ``world_size`` local ranks."""
    lookup = measure_lookup()
    comm = measure_all_to_all(world_size) if world_size > 1 else {"intra_host_bw": 1e12, "latency_s": 0.0}
    return Hardware(
        name="local",
        world_size=world_size,
        ranks_per_host=world_size,
        memory_bytes=physical_memory_bytes() * memory_fraction / world_size,
        memory_bw=lookup["memory_bw"],
        intra_host_bw=comm["intra_host_bw"],
        cross_host_bw=comm["intra_host_bw"],  # one host: no cross-host link measured
        latency_s=comm["latency_s"],
        kernel_overhead_s=lookup["kernel_overhead_s"],
        backward_factor=lookup["backward_factor"],
    )
