"""Benchmark: the embedding exchanges between ranks of one host, shared memory against gloo.

Times recscale's ``all_to_all`` and ``all_gather_rows`` (the collectives of the input, output,
gradient and data-parallel exchanges) on N local ranks, once through the shared-memory transport
(``recscale/comm/shared_memory.py``, what training uses between ranks of one host) and once
through gloo's TCP loopback (what TorchRec and plain PyTorch use on CPU), median of the calls.

    python benchmarks/collectives.py                 # 2 ranks, 10 KB to 13.6 MB
    python benchmarks/collectives.py --ranks 4 --json out/collectives.json
    python benchmarks/collectives.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.comm.collectives import all_gather_rows, all_to_all  # noqa: E402
from recscale.comm.local_processes import free_port  # noqa: E402
from recscale.comm.shared_memory import enable_shared_memory  # noqa: E402
from recscale.host_memory import retain_freed_memory  # noqa: E402


def _worker(rank: int, world: int, port: int, sizes_mb: list[float], calls: int, out: str) -> None:
    torch.set_num_threads(1)
    retain_freed_memory()  # as training does: freed buffers are reused, not faulted in again
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    shm, gloo = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    if not enable_shared_memory(shm, 120.0):
        raise SystemExit("shared memory is not available on this machine (x86 and a writable /dev/shm are needed)")
    rows = []
    for mb in sizes_mb:
        n = max(1, int(mb * 1e6 / 4 / world))  # float32 values per destination
        x = torch.randn(n * world)
        splits = [n] * world
        g = torch.randn(max(1, int(mb * 1e6 / 4 / 66)), 66)  # rows of a data-parallel gradient gather
        for transport, group in (("shared memory", shm), ("gloo", gloo)):
            times: dict[str, list[float]] = {"all_to_all": [], "all_gather": []}
            for i in range(calls + 2):
                dist.barrier()
                t0 = time.perf_counter()
                all_to_all(x, splits, splits, group)
                t1 = time.perf_counter()
                all_gather_rows(g, group)
                t2 = time.perf_counter()
                if i >= 2:  # warm-up: first touch of the buffers
                    times["all_to_all"].append(t1 - t0)
                    times["all_gather"].append(t2 - t1)
            rows.append({"mb": mb, "transport": transport,
                         **{k: statistics.median(v) * 1e3 for k, v in times.items()}})
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes-mb", default="0.01,1,13.6", help="bytes each rank sends in all, MB (comma-separated)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per size and transport")
    ap.add_argument("--quick", action="store_true", help="small sizes, few calls")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    sizes = [0.01, 0.5] if args.quick else [float(s) for s in args.sizes_mb.split(",")]
    calls = 3 if args.quick else args.calls
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        mp.start_processes(_worker, args=(args.ranks, free_port(), sizes, calls, out), nprocs=args.ranks,
                           start_method="spawn")
        rows = torch.load(out)
    by = {(r["mb"], r["transport"]): r for r in rows}
    table = []
    for mb in sizes:
        s, g = by[(mb, "shared memory")], by[(mb, "gloo")]
        table.append([f"{mb:g}", f"{s['all_to_all']:.2f}", f"{g['all_to_all']:.2f}", f"{g['all_to_all'] / s['all_to_all']:.1f}x",
                      f"{s['all_gather']:.2f}", f"{g['all_gather']:.2f}", f"{g['all_gather'] / s['all_gather']:.1f}x"])
    print(f"{args.ranks} ranks on one host, median of {calls} calls (ms)")
    print(format_table(["MB sent per rank", "a2a shm", "a2a gloo", "speed-up", "gather shm", "gather gloo", "speed-up"], table))
    if args.json:
        write_json(args.json, {"benchmark": "collectives", "environment": environment(), "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
