"""Time real embedding steps of a plan on this machine, for calibration and validation.

A *step* here is the embedding part of a training step, exactly as training runs it: the
sharded collection's input distribution, pooled lookup, output distribution and backward with
the fused optimizer update. Inputs are realistic: per table a fixed pooling factor, ids drawn
from a Zipf law and hashed over the rows (as real hashed categorical features are), so hot rows
spread over row ranges. One rank runs in this process; N ranks run as N local processes (gloo
on CPU), each with ``cores / N`` threads, and a step lasts as long as its slowest rank. Freed
host memory stays in the process, as in training (``recscale.host_memory``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recscale.comm.local_processes import free_port, local_context, start_local_processes
from recscale.comm.process_group import Topology, init_process_groups
from recscale.data.synthetic import zipf_ranks
from recscale.embedding import RowWiseAdagrad, TableConfig
from recscale.host_memory import retain_freed_memory
from recscale.planner.cost_model import TableSpec
from recscale.sharding.collection import ShardedEmbeddingCollection
from recscale.sharding.plan import ShardingPlan
from recscale.sparse import JaggedBatch

ZIPF_ALPHA = 1.05


@dataclass(frozen=True)
class ShardLoad:
    """What one shard actually did in a step (counted from the ids, not modelled)."""

    rank: int
    table: str
    sharding_type: str
    rows: int
    cols: int
    ids: int  # ids it looked up
    unique: int  # unique rows it updated
    bags: int  # pooled bags it produced
    routed: int  # ids its table's sources bucketized by row (row-split types), per rank


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def synthetic_batches(tables: list[TableSpec], batch: int, count: int, seed: int = 0) -> list[JaggedBatch]:
    """``count`` global batches: per table ``pooling`` ids per sample, Zipf-skewed, hashed."""
    rng = np.random.default_rng(seed)
    perms = [np.random.default_rng([seed, i]).permutation(t.rows) for i, t in enumerate(tables)]
    out = []
    for _ in range(count):
        vals, lens = [], []
        for t, perm in zip(tables, perms):
            p = int(round(t.pooling))
            lens.append(np.full(batch, p, dtype=np.int64))
            vals.append(perm[zipf_ranks(rng, batch * p, t.rows, ZIPF_ALPHA)])
        out.append(JaggedBatch(
            tuple(t.name for t in tables), torch.from_numpy(np.concatenate(vals)), torch.from_numpy(np.concatenate(lens))
        ))
    return out


def unique_fractions(tables: list[TableSpec], batch: JaggedBatch) -> dict[str, float]:
    """Data statistics for the planner: unique ids / ids per table in one global batch."""
    out = {}
    for t in tables:
        vals, _ = batch[t.name]
        out[t.name] = float(torch.unique(vals).numel() / max(vals.numel(), 1))
    return out


def shard_loads(plan: ShardingPlan, batch: JaggedBatch) -> list[ShardLoad]:
    """Per shard, the ids, unique rows and bags it handles for ``batch`` (a global batch)."""
    out = []
    b, w = batch.batch_size, plan.world_size
    for table_plan in plan.tables:
        vals, _ = batch[table_plan.table]
        for s in table_plan.shards:
            if table_plan.sharding_type == "data_parallel":
                local = vals.view(b, -1)[s.rank * b // w : (s.rank + 1) * b // w].reshape(-1) if vals.numel() % b == 0 else vals
                n, u, m = local.numel(), int(torch.unique(local).numel()), b // w
            else:
                mine = vals[(vals >= s.row_offset) & (vals < s.row_offset + s.num_rows)] if table_plan.routes_by_row else vals
                n, u, m = mine.numel(), int(torch.unique(mine).numel()), b
            routed = vals.numel() // w if table_plan.routes_by_row else 0
            out.append(ShardLoad(s.rank, table_plan.table, table_plan.sharding_type, s.num_rows, s.num_cols, n, u, m, routed))
    return out


def _build(plan: ShardingPlan, tables: list[TableSpec], groups) -> ShardedEmbeddingCollection:
    cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
    coll = ShardedEmbeddingCollection(cfgs, RowWiseAdagrad(lr=0.01), plan, groups)
    retain_freed_memory()  # as `recscale train` does once the model is built: no page faults per step
    return coll


def _time_steps(coll: ShardedEmbeddingCollection, rank: int, world: int, batches: list[JaggedBatch], steps: int,
                groups, after_warm_up: Callable[[], object] | None = None,
                cpu: list[float] | None = None) -> list[float]:
    """This rank's wall seconds per step after two warm-up steps; ``cpu``, where given, gets
    the CPU seconds (user and system, every thread of the process: gloo's and the kernel's
    network work on its behalf too) each of those steps took."""
    b = batches[0].batch_size
    sizes = [len(c) for c in torch.arange(b).tensor_split(world)]
    locals_ = [g.split(sizes)[rank] if world > 1 else g for g in batches]
    times, cpus = [], []
    for i in range(steps + 2):  # two warm-up steps
        if i == 2 and after_warm_up is not None:
            after_warm_up()
        local = locals_[i % len(locals_)]
        if groups.embedding is not None:
            torch.distributed.barrier(groups.embedding)
        t0, c0 = time.perf_counter(), time.process_time()
        out = coll(local)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    if cpu is not None:
        cpu.extend(cpus[2:])
    return times[2:]


def _job_times(rank: int, world: int, jobs, steps: int, groups) -> list[list[tuple[list[float], list[float]]]]:
    """Per job, per batch set: this rank's step times and their CPU times, on one build of the
    job's collection."""
    out = []
    for plan_dict, tables, batch_sets in jobs:
        coll = _build(ShardingPlan.from_dict(plan_dict), tables, groups)
        sets = []
        for gb in batch_sets:
            cpu: list[float] = []
            sets.append((_time_steps(coll, rank, world, gb, steps, groups, cpu=cpu), cpu))
        out.append(sets)
        del coll
    return out


def _worker(rank, world, port, jobs, steps, out_dir, shared_memory=True) -> None:
    torch.set_num_threads(threads_per_rank(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    groups = init_process_groups(Topology(world, rank, world), timeout_s=120, shared_memory=shared_memory)
    try:
        torch.save(_job_times(rank, world, jobs, steps, groups), Path(out_dir) / f"r{rank}.pt")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _contention_worker(index: int, jobs, steps, rounds, start, out_dir) -> None:
    torch.set_num_threads(1)
    groups = init_process_groups(Topology(1, 0, 1), device=torch.device("cpu"))
    alone, together = [], []
    for plan_dict, tables, batches in jobs:
        coll = _build(ShardingPlan.from_dict(plan_dict), tables, groups)
        alone.append([])
        together.append([])
        for _ in range(rounds):
            start.wait()
            if index == 0:  # the other copies wait at the barrier, asleep: this one runs alone
                alone[-1].append(_time_steps(coll, 0, 1, batches, steps, groups))
            start.wait()
            together[-1].append(_time_steps(coll, 0, 1, batches, steps, groups, start.wait))
        del coll
    torch.save((alone, together), Path(out_dir) / f"c{index}.pt")


def time_contention(jobs: list[tuple[ShardingPlan, list[TableSpec], list[JaggedBatch]]], copies: int, steps: int = 7,
                    rounds: int = 3) -> tuple[list[list[float]], list[list[float]]]:
    """Per job, per round: the median step time of one rank's work (a 1-rank plan, one thread)
    alone, and while ``copies`` independent processes run it at once, one per core (what sharing
    the host's memory bandwidth and caches costs, without any waiting for each other: they never
    communicate), alone and together in turn. The copies start once and build each job's
    collection once for all its rounds: a large table's build costs several seconds per
    process, its steps a few milliseconds."""
    start = local_context().Barrier(copies)
    with tempfile.TemporaryDirectory() as tmp:
        start_local_processes(_contention_worker, ([(p.to_dict(), t, b) for p, t, b in jobs], steps, rounds, start, tmp),
                              copies)
        per_copy = [torch.load(Path(tmp) / f"c{i}.pt") for i in range(copies)]
    alone = [[statistics.median(ts) for ts in job] for job in per_copy[0][0]]
    together = [[statistics.median(t for pc in per_copy for t in pc[1][j][r]) for r in range(rounds)]
                for j in range(len(jobs))]
    return alone, together


def time_plan(plan: ShardingPlan, tables: list[TableSpec], batches: list[JaggedBatch], steps: int = 7,
              threads: int | None = None) -> float:
    """Median over steps of the slowest rank's step time, in seconds. One rank runs in this
    process (with ``threads``, default all cores), more as local processes."""
    return time_plans([(plan, tables, [batches])], steps, threads)[0][0]


Job = tuple[ShardingPlan, list[TableSpec], list[list[JaggedBatch]]]  # a plan, its tables, batch sets to time it on


@dataclass(frozen=True)
class PlanTiming:
    """One plan on one batch set: the median over steps of the slowest rank's wall seconds, and
    of the busiest rank's CPU seconds (its process's threads, user and system)."""

    seconds: float
    cpu_s: float


def time_plans(jobs: list[Job], steps: int = 7, threads: int | None = None, shared_memory: bool = True) -> list[list[float]]:
    """``time_plan`` of many plans of one world size: per job, per batch set, the median over
    steps of the slowest rank's step time. Each job's collection is built once for all its batch
    sets, and several ranks are started once for all jobs (a process start and a large table's
    build cost seconds each, far more than the steps timed on them). ``shared_memory`` off: the
    ranks exchange over gloo's TCP transport, as ranks on different hosts do."""
    return [[t.seconds for t in job] for job in time_plans_cpu(jobs, steps, threads, shared_memory)]


def time_plans_cpu(jobs: list[Job], steps: int = 7, threads: int | None = None,
                   shared_memory: bool = True) -> list[list[PlanTiming]]:
    """``time_plans`` with each probe's CPU time beside its wall time (``PlanTiming``)."""
    if not jobs:
        return []
    world = jobs[0][0].world_size
    if any(plan.world_size != world for plan, _, _ in jobs):
        raise ValueError("time_plans: every plan must be for the same number of ranks")
    if world == 1:
        before = torch.get_num_threads()
        torch.set_num_threads(threads or threads_per_rank(1))
        try:
            groups = init_process_groups(Topology(1, 0, 1), device=torch.device("cpu"))
            per_rank = [_job_times(0, 1, [(p.to_dict(), t, b) for p, t, b in jobs], steps, groups)]
        finally:
            torch.set_num_threads(before)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            args = (world, free_port(), [(p.to_dict(), t, b) for p, t, b in jobs], steps, tmp, shared_memory)
            start_local_processes(_worker, args, world)
            per_rank = [torch.load(Path(tmp) / f"r{r}.pt") for r in range(world)]
    return [[PlanTiming(statistics.median(max(ts) for ts in zip(*(pr[j][k][0] for pr in per_rank))),
                        statistics.median(max(cs) for cs in zip(*(pr[j][k][1] for pr in per_rank))))
             for k in range(len(job[2]))] for j, job in enumerate(jobs)]
