"""Benchmark: does the planner's cost model predict measured step times on this machine?

Calibrates this machine (``recscale calibrate``), then for a synthetic model (tables of varied
rows, dims and pooling factors, Zipf ids) measures the embedding step (input distribution,
pooled lookup, output distribution, backward with the fused update) of several plans on 1 and 2
ranks (gloo), and prints each plan's predicted and measured time of the slowest rank, the error,
and whether the model ranks the plans in the measured order.

    python benchmarks/planner_validation.py
    python benchmarks/planner_validation.py --quick --json out/validation.json
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.comm.process_group import Topology, init_process_groups  # noqa: E402
from recscale.data.synthetic import zipf_ranks  # noqa: E402
from recscale.embedding import RowWiseAdagrad, TableConfig  # noqa: E402
from recscale.planner.calibrate import calibrate  # noqa: E402
from recscale.planner.cost_model import TableSpec, Workload  # noqa: E402
from recscale.planner.search import Placement, _result, baseline_plan, plan_tables  # noqa: E402
from recscale.planner.cost_model import shard_cost  # noqa: E402
from recscale.sharding.collection import ShardedEmbeddingCollection  # noqa: E402
from recscale.sharding.default_plan import default_plan  # noqa: E402
from recscale.sharding.plan import ShardingPlan  # noqa: E402
from recscale.sparse import JaggedBatch  # noqa: E402

import numpy as np  # noqa: E402

MODEL = [  # rows, dim, pooling
    (2_000_000, 64, 1), (1_000_000, 64, 4), (500_000, 32, 8), (200_000, 64, 2), (100_000, 128, 1),
    (50_000, 32, 20), (20_000, 64, 1), (10_000, 16, 5), (5_000, 64, 1), (1_000, 32, 10),
]


def specs(quick: bool) -> list[TableSpec]:
    scale = 10 if quick else 1
    return [TableSpec(f"t{i}", max(r // scale, 100), d, float(p), 0.5) for i, (r, d, p) in enumerate(MODEL)]


def batches(tables: list[TableSpec], batch: int, n: int, seed: int = 0) -> list[JaggedBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        vals, lens = [], []
        for t in tables:
            ln = np.full(batch, int(t.pooling), dtype=np.int64)
            vals.append(zipf_ranks(rng, int(ln.sum()), t.rows, 1.05))
            lens.append(ln)
        out.append(JaggedBatch(tuple(t.name for t in tables), torch.from_numpy(np.concatenate(vals)), torch.from_numpy(np.concatenate(lens))))
    return out


def _worker(rank, world, port, plan_dict, tables, batch, steps, out_dir):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    groups = init_process_groups(Topology(world, rank, world), timeout_s=120)
    cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
    plan = ShardingPlan.from_dict(plan_dict)
    coll = ShardedEmbeddingCollection(cfgs, RowWiseAdagrad(lr=0.01), plan, groups)
    global_batches = batches(tables, batch, 4)
    sizes = [len(c) for c in torch.arange(batch).tensor_split(world)]
    times = []
    for i in range(steps + 2):
        local = global_batches[i % 4].split(sizes)[rank]
        if groups.embedding is not None:
            torch.distributed.barrier(groups.embedding)
        t0 = time.perf_counter()
        out = coll(local)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - t0)
    torch.save(times[2:], Path(out_dir) / f"r{rank}.pt")
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None


def measure(plan: ShardingPlan, tables, batch, steps) -> float:
    world = plan.world_size
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, plan.to_dict(), tables, batch, steps, tmp), nprocs=world, start_method="spawn")
        per_rank = [torch.load(Path(tmp) / f"r{r}.pt") for r in range(world)]
    # The step ends when the slowest rank ends: median over steps of the max over ranks.
    return statistics.median(max(ts) for ts in zip(*per_rank))


def predicted(plan: ShardingPlan, tables, hw, wl) -> float:
    by = {t.name: t for t in tables}
    placements = {}
    for tp in plan.tables:
        t = by[tp.table]
        costs = [shard_cost(t, tp.sharding_type, s.num_rows, s.num_cols, hw, wl) for s in tp.shards]
        placements[tp.table] = Placement(tp.table, tp.sharding_type, list(tp.shards), costs)
    return _result("given", placements, tables, hw, wl, time.perf_counter()).max_rank_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.steps = 512, 3
    tables = specs(args.quick)
    cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
    wl = Workload(batch_size=args.batch_size)
    hw2 = calibrate(2)
    hw1 = hw2.with_world(1, 1)
    cases = [("1 rank", default_plan(cfgs, Topology(1, 0, 1), "table_wise"), hw1)]
    topo = Topology(2, 0, 2)
    cases += [
        ("2: planner", plan_tables(tables, hw2, wl).plan, hw2),
        ("2: greedy size", baseline_plan("greedy_size", tables, hw2, wl).plan, hw2),
        ("2: row-wise", default_plan(cfgs, topo, "row_wise"), hw2),
        ("2: column-wise", default_plan(cfgs, topo, "column_wise"), hw2),
        ("2: data-parallel", default_plan(cfgs, topo, "data_parallel"), hw2),
        ("2: all on rank 0", ShardingPlan(2, 2, tuple(
            type(tp)(tp.table, "table_wise", (type(tp.shards[0])(0, 0, t.rows, 0, t.dim),))
            for tp, t in zip(default_plan(cfgs, topo, "table_wise").tables, tables)
        )), hw2),
    ]
    rows, records = [], []
    for name, plan, hw in cases:
        pred = predicted(plan, tables, hw, wl)
        meas = measure(plan, tables, args.batch_size, args.steps)
        err = 100 * (pred - meas) / meas
        rows.append([name, f"{pred * 1e3:.1f}", f"{meas * 1e3:.1f}", f"{err:+.0f}%"])
        records.append({"case": name, "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3, "error_pct": err})
    print(format_table(["plan", "predicted ms", "measured ms", "error"], rows))
    two = [r for r in records if r["case"].startswith("2:")]
    order_pred = [r["case"] for r in sorted(two, key=lambda r: r["predicted_ms"])]
    order_meas = [r["case"] for r in sorted(two, key=lambda r: r["measured_ms"])]
    within = sum(abs(r["error_pct"]) <= 20 for r in records)
    print(f"within 20%: {within} of {len(records)}; 2-rank order predicted {order_pred}")
    print(f"{'':29s} measured  {order_meas}; same order: {order_pred == order_meas}")
    print(f"calibrated: gathers {hw2.memory_bw / 1e9:.2f} GB/s, backward x{hw2.backward_factor:.2f}, "
          f"overhead {hw2.kernel_overhead_s * 1e6:.0f} us, all-to-all {hw2.intra_host_bw / 1e9:.2f} GB/s, latency {hw2.latency_s * 1e6:.0f} us")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": records,
                               "same_order": order_pred == order_meas, "within_20pct": within})
    return 0


if __name__ == "__main__":
    sys.exit(main())
