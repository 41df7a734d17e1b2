"""Measure this machine for the planner: every constant of the cost model, from the real
operator and the real sharded collection.

Short stages (a few minutes in all). Stages 2 and 3 come first; then three rounds, each
timing every stage-1 probe and then every stage-4 probe, and each probe's median is kept: a
burst of load on a shared machine moves one round, and the constants of both stages come
from the same minutes:

1. *Compute* (one process, with the threads one of ``world_size`` local ranks gets): time full
   embedding steps of the sharded collection for probe models that stress one cost each (large
   tables: cold bytes; many tiny tables of one dim: per-shard and per-feature overhead; tiny tables
   of eight dims: per operator group; high pooling over few rows: per id apart from per row;
   one cache-resident table with wide rows and the same with narrow ones: bytes apart from
   every per-item cost; row-wise: bucketizing; data-parallel; column shards), at two batch
   sizes, and count what each step really did (ids, unique rows, bags, groups, bytes). The
   per-item constants (``id_s``, ``row_s``, ``bag_s``, ``route_id_s``, ``route_table_s``,
   ``column_stat_id_s``, ``column_stat_shard_s``, ``feature_s``, ``kernel_overhead_s``,
   ``group_s``, ``step_overhead_s``) and the bandwidth (``memory_bw``, with
   ``backward_factor``) are the non-negative least-squares fit of the cost model's own formula
   to those times (relative error weighted).
2. *Communication* (``world_size`` local processes): all-to-all of a small and a large message;
   latency per collective and bandwidth (bytes sent plus received per second, as the cost model
   counts both directions).
3. *Contention* (more than one rank): single-thread steps alone and as ``world_size`` copies
   side by side; the slowdown from sharing the host's memory system (``measure_contention``).
   And the cores' unsteadiness (``sync_jitter``, ``recscale.planner.jitter``): every core runs
   the same short chunks at once, and the slowest of them sets when ranks meet.
4. *Collection* (more than one rank): steps of the real sharded collection on ``world_size``
   local processes, fitted for what a collective costs inside a step and what data-parallel
   replicas pay per byte of row gradients they combine (``measure_collection``), net of the
   ranks' wait for the slowest (``fit_collection``).

The result is a ``Hardware`` JSON (``recscale calibrate --out FILE``) with the fit's residuals.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from recscale.comm.collectives import all_to_all
from recscale.comm.local_processes import free_port, start_local_processes
from recscale.comm.process_group import Topology
from recscale.comm.shared_memory import enable_shared_memory, shared_memory_wanted
from recscale.embedding import TableConfig
from recscale.host_cpus import usable_cpus
from recscale.planner.cost_model import TableSpec, Workload, cold_fraction, groups_per_rank
from recscale.planner.hardware import Hardware
from recscale.planner.jitter import measure_jitter, sync_wait_factor, synced_stretch
from recscale.planner.measure import (shard_loads, synthetic_batches, threads_per_rank, time_contention, time_plans,
                                      time_plans_cpu)
from recscale.sharding.default_plan import TableSharding, default_plan, single_rank_plan
from recscale.sharding.plan import ShardingPlan

# Probe models: (rows, dim, pooling) per table. Sizes are chosen so building them is quick.
PROBE_SETS: dict[str, list[tuple[int, int, float]]] = {
    "large": [(2_000_000, 64, 1), (400_000, 128, 4)],
    "mixed": [(200_000, 32, 8), (50_000, 16, 20), (100_000, 64, 2), (5_000, 128, 1)],
    "many_small": [(1_000, 16, 1)] * 32,
    "narrow": [(1_000_000, 8, 12)],
    # 200k ids over 1,000 rows: the per-id work apart from the per-row work (in the sets above
    # unique rows grow with ids, so a fit could trade one for the other)
    "hot_rows": [(1_000, 8, 50)],
    # eight tiny tables of eight dims: eight operator groups, against many_small's one
    "many_dims": [(100, 8 * (i + 1), 1) for i in range(8)],
    # The same ids, rows and bags over wide and over narrow rows, in one operator group and
    # small enough to stay in the cache: only the bytes moved differ. In the sets above bytes
    # grow with ids, unique rows, bags or cold rows (large tables are the only ones with many
    # bytes per id, and they are all cold), so on one thread, where the per-item work weighs
    # most, the fit could trade the byte term for the others and drop it.
    "wide": [(4_000, 256, 8)],
    "thin": [(4_000, 8, 8)],
    # Twelve mid-sized tables split in two columns (24 column shards in one operator group)
    # beside the same tables whole: only the column shards' row statistics differ. The sets above
    # have 2-8 column shards in as many groups, so a fit could put a step's fixed work on each
    # shard, and price a model of 26 split tables several times over.
    "columns": [(20_000, 16, 2)] * 12,
}
# Placements each probe set is timed in (default: every one of PROBE_TYPES). The byte pair needs
# no row or column split: it measures bytes, and the other sets measure the splits' work.
PROBE_SET_TYPES: dict[str, tuple[str, ...]] = {"wide": ("table_wise", "data_parallel"),
                                                "thin": ("table_wise", "data_parallel"),
                                                "columns": ("table_wise", "column_wise")}
PROBE_TYPES = ("table_wise", "row_wise", "data_parallel", "column_wise")
FIT_TERMS = ("bytes", "id_s", "row_s", "cold_byte_s", "bag_s", "kernel_overhead_s", "group_s", "route_id_s", "route_table_s",
             "column_stat_id_s", "column_stat_shard_s", "feature_s", "dist_id_s", "dist_value_s", "step_overhead_s")


def last_level_cache_bytes() -> float:
    """The largest CPU cache of this host (Linux sysfs), 0 where it cannot be read."""
    best = 0.0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, float(int(digits) * unit))
    return best


@dataclass(frozen=True)
class Probe:
    name: str
    terms: dict[str, float]  # the cost model's terms, counted from the probe's real batch
    measured_s: float


def probe_terms(plan: ShardingPlan, tables: list[TableSpec], batch, backward_factor: float,
                cache_bytes: float = 0.0) -> dict[str, float]:
    """The cost model's terms for one step of ``plan`` on ``batch``, counted from its ids
    (``cache_bytes``: the rank's share of the last-level cache, for ``cold_byte_s``)."""
    loads = shard_loads(plan, batch)
    by_dim = {t.name: t.dim for t in tables}
    by_name = {t.name: t for t in tables}
    rank_of_max: dict[int, dict[str, float]] = {}
    for sl in loads:
        r = rank_of_max.setdefault(sl.rank, dict.fromkeys(FIT_TERMS, 0.0))
        e, state = 4, 4  # fp32 rows, row-wise Adagrad
        row_bytes = sl.cols * e + state
        r["bytes"] += (sl.ids * sl.cols * e + sl.bags * sl.cols * 4) * (1 + backward_factor) + 2 * sl.unique * row_bytes
        r["id_s"] += sl.ids
        if sl.sharding_type == "data_parallel":  # second pass over every replica's unique rows
            r["id_s"] += sl.unique * plan.world_size
            r["bytes"] += sl.unique * plan.world_size * sl.cols * 8
        r["row_s"] += sl.unique
        r["cold_byte_s"] += 2 * sl.unique * row_bytes * cold_fraction(sl.rows * row_bytes, cache_bytes)
        r["bag_s"] += sl.bags
        r["kernel_overhead_s"] += 2
        r["route_id_s"] += sl.routed
        if sl.sharding_type == "column_wise" and sl.cols < by_dim[sl.table]:
            r["column_stat_id_s"] += sl.ids
            r["column_stat_shard_s"] += 1
        if sl.sharding_type != "data_parallel":  # the owner's side of the distribution
            r["dist_id_s"] += sl.ids
            r["dist_value_s"] += sl.bags * sl.cols
    for rank, n in groups_per_rank((sl.rank, by_name[sl.table], sl.sharding_type, sl.cols) for sl in loads).items():
        rank_of_max[rank]["group_s"] = float(n)
    terms = rank_of_max.setdefault(0, dict.fromkeys(FIT_TERMS, 0.0))
    kinds = plan.sharding_types()
    b_local = batch.batch_size / plan.world_size
    for name in batch.keys:  # the source's side: its own samples' ids and pooled values
        if kinds.get(name, "data_parallel") != "data_parallel":
            terms["dist_id_s"] += batch[name][0].numel() / plan.world_size
            terms["dist_value_s"] += b_local * by_dim[name]
    terms["feature_s"] = float(len(tables))
    terms["route_table_s"] = float(sum(table_plan.routes_by_row for table_plan in plan.tables))
    terms["step_overhead_s"] = 1.0
    return terms


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set)."""
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def fit(probes_by_backward_factor: dict[float, list[Probe]], fixed: dict[str, float] | None = None) -> tuple[dict[str, float], float, float]:
    """Constants (per FIT_TERMS), the backward factor and the median relative error of the best fit.
    ``fixed`` constants (measured by their own probe, e.g. the gather bandwidth) are not fitted:
    their part of each probe's time is taken off first, so they cannot trade off against the
    per-item terms that move with them."""
    fixed = fixed or {}
    free = [k for k in FIT_TERMS if k not in fixed]
    best = None
    for backward_factor, probes in probes_by_backward_factor.items():
        y = np.array([p.measured_s for p in probes])
        known = np.array([sum(v * p.terms[k] for k, v in fixed.items()) for p in probes])
        a = np.array([[p.terms[k] for k in free] for p in probes]) / y[:, None]
        scale = np.abs(a).max(0)
        scale[scale == 0] = 1.0
        coef = _nnls(a / scale, 1.0 - known / y) / scale
        rel = np.abs(a @ coef + known / y - 1.0)
        if best is None or rel.mean() < best[2]:
            best = ({**dict(zip(free, coef.tolist())), **fixed}, backward_factor, float(rel.mean()), float(np.median(rel)))
    assert best is not None
    return best[0], best[1], best[3]


def _compute_plan(set_name: str, kind: str) -> tuple[ShardingPlan, list[TableSpec]]:
    """A stage-1 probe: one probe set's tables on one rank, placed as ``kind`` (column shards: 2 per table)."""
    tables = [TableSpec(f"{set_name}{i}", r, d, p) for i, (r, d, p) in enumerate(PROBE_SETS[set_name])]
    cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
    overrides = {c.name: TableSharding("column_wise", 2) for c in cfgs} if kind == "column_wise" else None
    return default_plan(cfgs, Topology(1, 0, 1), "table_wise" if kind == "column_wise" else kind, overrides), tables


def compute_cases(batches: tuple[int, ...], quick: bool = False) -> list[tuple[str, ShardingPlan, list[TableSpec], list]]:
    """Stage 1's probes, each (name, plan, tables, batches): built the same way every time, so
    recorded times can be matched to them again by name."""
    cases = []
    for set_name in PROBE_SETS:
        if quick and set_name in ("large", "narrow"):
            continue
        for kind in PROBE_SET_TYPES.get(set_name, PROBE_TYPES):
            if set_name == "large" and kind == "data_parallel":
                continue  # same bytes as table-wise; skip to keep calibration short
            if set_name in ("many_small", "many_dims") and kind == "column_wise":
                continue  # planners never split tiny tables; their row-statistic
                # bookkeeping grows with shards x shards and would distort the fit
            plan, tables = _compute_plan(set_name, kind)
            for b in batches:
                cases.append((f"{set_name}/{kind}/B{b}", plan, tables, synthetic_batches(tables, b, 2, seed=b)))
    return cases


def measure_compute(world_size: int, batches: tuple[int, ...] = (1024, 4096), steps: int = 5,
                    progress=None, quick: bool = False, rounds: int = 3,
                    into: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Stage 1's measurements: each probe's step time in every round, by probe name, for one of
    ``world_size`` local ranks. Every probe is timed once per round over all probes, so a burst
    of load on a shared machine moves one round, not one probe's figure (and with it a constant).
    ``into``: the dict to add this call's rounds to (``measure`` fills one round at a time)."""
    threads = threads_per_rank(world_size)
    cases = compute_cases(batches, quick)
    times = into if into is not None else {}
    for name, *_ in cases:
        times.setdefault(name, [])
    for _ in range(rounds):
        _time_round(cases, times, steps, threads, progress, "")
    return times


def _by_plan(cases: list[tuple[str, ShardingPlan, list[TableSpec], list]]) -> list[list[tuple[str, ShardingPlan, list[TableSpec], list]]]:
    """Probes that differ only by batch size ("set/kind/B<batch>"), together: one build of their
    collection times them all."""
    jobs: dict[str, list] = {}
    for case in cases:
        jobs.setdefault(case[0].rsplit("/B", 1)[0], []).append(case)
    return list(jobs.values())


def _time_round(cases, times: dict[str, list[float]], steps: int, threads: int | None, progress, label: str,
                shared_memory: bool = True, cpu_times: dict[str, list[float]] | None = None) -> None:
    """One round of ``cases``: each plan built once for its batch sizes, and several ranks started
    once for the whole round (``time_plans``), each probe's time added to ``times`` (and its
    busiest rank's CPU time to ``cpu_times``, where given)."""
    jobs = _by_plan(cases)
    specs = [(job[0][1], job[0][2], [gb for *_, gb in job]) for job in jobs]
    if cpu_times is None:
        got = time_plans(specs, steps, threads=threads, shared_memory=shared_memory)
    else:
        timed = time_plans_cpu(specs, steps, threads=threads, shared_memory=shared_memory)
        got = [[t.seconds for t in job] for job in timed]
        for job, ts in zip(jobs, timed):
            for (name, *_), t in zip(job, ts):
                cpu_times.setdefault(name, []).append(t.cpu_s)
    for job, secs in zip(jobs, got):
        for (name, *_), t in zip(job, secs):
            times[name].append(t)
            if progress:
                progress(f"{label}round {len(times[name])}: {name}: {t * 1e3:.2f} ms")


def fit_compute(times: dict[str, list[float]], batches: tuple[int, ...], quick: bool = False,
                cache_bytes: float = 0.0) -> tuple[dict[str, float], float, float, list[Probe]]:
    """Stage 1's fit: the compute constants from each probe's median time, with its terms
    counted from its real batch (``cache_bytes``: the rank's share of the last-level cache).
    Probes ``times`` lacks are left out: a recording from before a probe existed fits again."""
    measured = [(name, plan, tables, gb[0], statistics.median(times[name]))
                for name, plan, tables, gb in compute_cases(batches, quick) if times.get(name)]
    # The backward pass moves what the forward moved once more (each id's row gradient is
    # formed from its bag's gradient and scattered): backward factor 1, not a free parameter.
    # (An isolated gather of uniformly random rows runs far slower than the skewed, partly
    # cache-resident gathers of real steps, so the byte term is fitted, not measured alone.)
    by_backward_factor = {1.0: [Probe(n, probe_terms(p, tb, g, 1.0, cache_bytes), t) for n, p, tb, g, t in measured]}
    coef, backward_factor, err = fit(by_backward_factor)
    return coef, backward_factor, err, by_backward_factor[backward_factor]


# Stage-1 probes of different kinds whose slowdown side by side gives ``contention``.
CONTENTION_PROBES = (("mixed", "table_wise"), ("large", "row_wise"), ("narrow", "column_wise"))


def measure_contention(world_size: int, batch: int = 4096, steps: int = 5, rounds: int = 3, progress=None,
                       quick: bool = False) -> float:
    """Stage 3: how much ranks of one host slow each other by sharing memory bandwidth and
    caches, measured, not fitted: single-thread embedding steps run alone, then as
    ``world_size`` independent copies at once (they never communicate, so nothing waits).
    Each probe's slowdown compares its least-disturbed times, the fastest round alone and the
    fastest side by side: a shared machine's noise only ever adds time, and it hurts copies
    that fill every core more than one that leaves a core spare, so a ratio of single rounds
    would read a noisy minute as contention.
    ``contention`` is the median slowdown over probes of several kinds, minus one, with more
    copies than cores counted per core (four copies on two cores taking turns is not contention).
    ``quick`` times one probe, still over ``rounds``: the copies build it once and its steps
    take milliseconds, so rounds cost a second or two, and one round's ratio alone is noise
    (on two shared cores single rounds read 0 to 0.6 quiet, near 1 and 2 under load)."""
    probes = CONTENTION_PROBES[:1] if quick else CONTENTION_PROBES
    cases = []
    for set_name, kind in probes:
        plan, tables = _compute_plan(set_name, kind)
        cases.append((f"{set_name}/{kind}/B{batch}", plan, tables, synthetic_batches(tables, batch, 2, seed=batch)))
    # the copies start once and build each probe once, for every round: alone, then side by side
    alone, together = time_contention([(plan, tables, gb) for _, plan, tables, gb in cases], world_size, steps, rounds)
    if progress:
        for (name, *_), a, t in zip(cases, alone, together):
            for r, (x, y) in enumerate(zip(a, t)):
                progress(f"round {r + 1}: {name}: {x * 1e3:.2f} ms alone, {y * 1e3:.2f} ms with {world_size} at once")
    # Copies beyond the cores take turns on them: that slowdown is the ranks' share of the cores
    # (what the simulator's ``cores.CoreShare`` charges), not the memory system's contention.
    turns = max(1.0, world_size / usable_cpus(read_cgroup=False).cpus)
    ratios = [min(t) / min(a) / turns for a, t in zip(alone, together)]
    return max(0.0, statistics.median(ratios) - 1.0)


def _a2a_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # The transport training uses: shared memory between ranks of one host unless turned off.
    group = dist.new_group(list(range(world)))
    if shared_memory_wanted():
        enable_shared_memory(group, 60.0)
    results = {}
    for nbytes in (256, 4 << 20):
        x = torch.zeros(nbytes * world // 4)
        splits = [x.numel() // world] * world
        all_to_all(x, splits, splits, group)
        times = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            all_to_all(x, splits, splits, group)
            times.append(time.perf_counter() - t0)
        results[nbytes] = statistics.median(times)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure_all_to_all(world: int = 2) -> dict[str, float]:
    """Per-collective latency and bandwidth counted as bytes sent plus received per second."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "a2a.pt")
        start_local_processes(_a2a_worker, (world, free_port(), out), world)
        r = torch.load(out)
    small, big = r[256], r[4 << 20]
    moved = 2 * (4 << 20) * (world - 1)  # each rank sends and receives nbytes per peer
    return {"intra_host_bw": moved / max(big - small, 1e-9), "latency_s": small}


def collection_cases(world_size: int, batches: tuple[int, ...], sets: tuple[str, ...]) -> list[tuple[str, ShardingPlan, list[TableSpec], list]]:
    """Stage 4's probes, each (name, plan, tables, batches), built the same way every time."""
    from recscale.planner.measure import unique_fractions

    topo = Topology(world_size, 0, world_size)
    cases = []
    for set_name in sets:
        raw = [TableSpec(f"{set_name}{i}", r, d, p) for i, (r, d, p) in enumerate(PROBE_SETS[set_name])]
        for batch in batches:
            gb = synthetic_batches(raw, batch, 2, seed=7 + batch)
            uf = unique_fractions(raw, gb[0])
            tables = [TableSpec(t.name, t.rows, t.dim, t.pooling, uf[t.name]) for t in raw]
            cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
            for kind in ("table_wise", "row_wise", "data_parallel", "column_wise", "on_rank_0"):
                if set_name == "many_small" and kind == "column_wise":
                    continue
                # on_rank_0: the other ranks idle, so no contention, only the exchanges
                plan = single_rank_plan(cfgs, topo) if kind == "on_rank_0" else default_plan(cfgs, topo, kind)
                cases.append((f"{set_name}/{kind}/B{batch}", plan, tables, gb))
    return cases


def measure_collection(world_size: int, batches: tuple[int, ...] = (1024, 4096), steps: int = 5,
                       progress=None, sets: tuple[str, ...] = ("mixed", "large", "many_small"),
                       rounds: int = 3, into: dict[str, list[float]] | None = None,
                       shared_memory: bool = True, cpu_into: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Stage 4's measurements (more than one rank): steps of the real collection on
    ``world_size`` local processes for balanced plans (table-wise, row-wise, data-parallel,
    column shards over every rank) and for every table on rank 0 (the others only exchange),
    each probe's time in every round, by name. ``fit_collection`` turns them into what a
    collective costs inside a step and what data-parallel replicas pay per byte. ``into``: the
    dict to add this call's rounds to (``measure`` fills one round at a time). ``shared_memory``
    off: the ranks exchange over gloo's TCP transport (stage 5), as ranks on different hosts do.
    ``cpu_into``: where to add each probe's CPU seconds (its busiest rank's process)."""
    cases = collection_cases(world_size, batches, sets)
    # Round-robin over the probes, as in stage 1: a burst of load lasting longer than one probe
    # moves one round of several probes, not every round of one.
    times = into if into is not None else {}
    for name, *_ in cases:
        times.setdefault(name, [])
    label = f"{world_size} ranks{'' if shared_memory else ' over TCP'}, "
    for _ in range(rounds):
        _time_round(cases, times, steps, None, progress, label, shared_memory, cpu_into)
    return times



def fit_collection(hw: Hardware, measured: list[tuple[ShardingPlan, list[TableSpec], int, float]],
                   bandwidth: float | None = None) -> dict[str, float]:
    """Stage 4's fit: latency, bandwidth and ``replica_byte_s`` from (plan, tables, global batch,
    measured seconds), given ``hw``'s compute constants and contention (relative error weighted).
    ``bandwidth`` given: the bytes are priced at it, not fitted (a fit of few probes can take
    a collective's fixed cost for a per-byte one).

    Each step is fitted as ``compute + latency x collectives + bytes / bandwidth + replica
    bytes x replica_byte_s``, with compute as stage 1 predicts it for one rank plus the measured
    ``hw.contention`` (``search.apply_contention``). Latency and bandwidth are what a collective
    costs inside a step, which on shared cores is more than an isolated all-to-all suggests (the
    ranks' threads must wake each other up). ``replica_byte_s`` is what data-parallel replicas
    pay per byte of row gradients they combine, beyond one rank's work: the copies, the second
    pass over every replica's rows, and the waits at the three collectives of each operator
    group, where each replica meets the others mid-backward (per byte rather than per row: wide
    rows measured dearer). (Fitting a contention factor here instead, as before, charged every
    plan for the waits these replicas do: column shards, whose ranks do the same work and rarely
    wait, came out 25-35% too slow and data-parallel plans 15-25% too fast.)

    The ranks meet at every collective and wait there for the slowest one, whose compute runs
    long by the cores' unsteadiness: the compute is stretched by ``synced_stretch`` at
    ``hw.sync_jitter`` first (``sync_wait_factor`` where the ranks are balanced; less where one
    rank has most of the work), so the collectives' figures are net of that wait and a
    simulator that adds it to the compute does not count it twice."""
    from recscale.planner.search import score_plan

    wait = sync_wait_factor(hw.sync_jitter, hw.ranks_per_host)
    bw = bandwidth or 1e30
    fast = replace(hw, intra_host_bw=bw, cross_host_bw=bw, latency_s=0.0, replica_latency_s=None, replica_byte_s=0.0)
    ys, rows_a = [], []
    for plan, tables, batch, meas in measured:
        workload = Workload(batch_size=batch)

        def extra(**k: float) -> float:  # what one unit of a term adds to the slowest rank
            return score_plan(plan, tables, replace(fast, **k), workload).max_rank_s - base

        computing = score_plan(plan, tables, fast, workload)  # every rank computing, no exchange
        base = computing.max_rank_s
        stretch = synced_stretch([r.time_s + computing.common_s for r in computing.ranks], hw.sync_jitter) if wait > 1 else 1.0
        ys.append((meas - stretch * base) / meas)
        exchange = extra(latency_s=1e-3, replica_latency_s=0.0)
        rows_a.append([exchange / 1e-3 / meas, extra(replica_latency_s=1e-3) / 1e-3 / meas,
                       0.0 if bandwidth else extra(intra_host_bw=1e9, cross_host_bw=1e9) * 1e9 / meas,
                       extra(replica_byte_s=1e-9) * 1e9 / meas])
    a = np.array(rows_a)
    scale = a.max(0)
    scale[scale == 0] = 1.0
    latency, replica_latency, per_byte, replica_byte = _nnls(a / scale, np.array(ys)) / scale
    fitted_bw = bandwidth or (float(1.0 / per_byte) if per_byte > 0 else 1e12)
    return {"latency_s": float(latency), "replica_latency_s": float(replica_latency),
            "intra_host_bw": fitted_bw, "replica_byte_s": float(replica_byte)}


def _rate(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.2f} GB/s" if seconds_per_byte > 0 else "no measurable cost"


def physical_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass
class Measurements:
    """Everything a calibration measures, kept apart from the constants fitted to it
    (``fit_hardware``), so a fit can be re-run and compared on the same measurements."""

    world_size: int
    quick: bool
    cache_bytes: float  # the host's last-level cache
    physical_memory_bytes: float
    compute: dict[str, list[float]]  # stage 1: probe name -> step seconds per round
    all_to_all: dict[str, float]  # stage 2: isolated latency and bandwidth
    contention: float = 0.0  # stage 3
    sync_jitter: float = 0.0  # stage 3 too: the cores' unsteadiness (0: one rank, not measured)
    collection: dict[str, list[float]] = field(default_factory=dict)  # stage 4: probe name -> seconds per round
    # stage 5: stage 4's probes with the ranks exchanging over TCP (empty: not measured)
    collection_tcp: dict[str, list[float]] = field(default_factory=dict)
    # stage 5's probes in CPU seconds (the busiest rank's process, user and system; empty: not
    # measured): what a collective over TCP takes from its rank's cores
    collection_tcp_cpu: dict[str, list[float]] = field(default_factory=dict)

    @property
    def batches(self) -> tuple[int, ...]:
        return (512, 2048) if self.quick else (1024, 4096)

    @property
    def complete(self) -> bool:
        """Whether every stage has at least one round: enough for ``fit_hardware``."""
        rounds = list(self.compute.values()) + (list(self.collection.values()) if self.world_size > 1 else [])
        return bool(self.compute) and bool(self.all_to_all) and (self.world_size == 1 or bool(self.collection)) and all(rounds)

    @property
    def collection_batches(self) -> tuple[int, ...]:
        # both batch sizes, quick too: at one size a collective's fixed cost and its per-byte
        # cost move together (so do the replicas' per-collective and per-byte costs), and the
        # fit keeps one and drops the other, which then prices any other size wrong
        return self.batches

    @property
    def collection_sets(self) -> tuple[str, ...]:
        return ("mixed",) if self.quick else ("mixed", "large", "many_small")


def measure(world_size: int = 2, progress=None, quick: bool = False,
            between_rounds: Callable[[Measurements], None] | None = None, rounds: int = 3) -> Measurements:
    """Run every calibration stage on this machine (``quick``: fewer, smaller probes and one
    round, for smoke tests; ``rounds``: more make each probe's median steadier on a noisy
    machine). ``between_rounds`` runs after each round of probes, given the measurements so far:
    a validation times its plans there, so that the constants and the plans see the same mix of
    machine states (a shared VM's speed drifts 1.5-2x over minutes); once every stage has a
    round (``Measurements.complete``), it can fit them and time the plan they choose too."""
    m = Measurements(world_size, quick, last_level_cache_bytes(), physical_memory_bytes(), {}, {})
    steps = 3 if quick else 5
    clock = _StageClock(progress)
    m.all_to_all = measure_all_to_all(world_size) if world_size > 1 else {"intra_host_bw": 1e12, "latency_s": 0.0}
    clock.done("all-to-all")
    if world_size > 1:
        m.contention = measure_contention(world_size, m.batches[-1], steps, progress=progress, quick=quick)
        clock.done("contention")
        # every core busy at once, as the simulator's own measurement (its wait on top of the
        # fitted collective costs must be the one they were fitted net of)
        m.sync_jitter = measure_jitter(os.cpu_count() or 1, **({"seconds": 8.0, "windows": 8} if quick else {}))
        clock.done("jitter")
    # Each round times stage 1's probes and then stage 4's: the compute constants and the
    # collectives fitted on top of them come from the same minutes, so a shared VM's speed drift
    # is not taken for collective costs.
    for r in range(1 if quick else rounds):
        measure_compute(world_size, m.batches, steps, progress=progress, quick=quick, rounds=1, into=m.compute)
        clock.done(f"round {r + 1}: compute probes")
        if world_size > 1:
            measure_collection(world_size, m.collection_batches, steps, progress=progress, sets=m.collection_sets,
                               rounds=1, into=m.collection)
            clock.done(f"round {r + 1}: collection probes")
            measure_collection(world_size, m.collection_batches, steps, progress=progress, sets=m.collection_sets,
                               rounds=1, into=m.collection_tcp, shared_memory=False, cpu_into=m.collection_tcp_cpu)
            clock.done(f"round {r + 1}: collection probes over TCP")
        if between_rounds is not None:
            between_rounds(m)
            clock.done(f"round {r + 1}: between rounds")
    return m


class _StageClock:
    """Says how long each stage of a calibration took (where the minutes go on a slow machine)."""

    def __init__(self, progress) -> None:
        self.progress, self.last, self.start = progress, time.monotonic(), time.monotonic()

    def done(self, stage: str) -> None:
        now = time.monotonic()
        if self.progress:
            self.progress(f"stage {stage}: {now - self.last:.1f} s (total {now - self.start:.1f} s)")
        self.last = now


def fit_hardware(m: Measurements, memory_fraction: float = 0.6, progress=None) -> Hardware:
    """This machine as a Hardware description for ``m.world_size`` local ranks, fitted to ``m``."""
    world_size = m.world_size
    cache = m.cache_bytes / world_size  # the ranks of a host share its cache
    coef, backward_factor, err, _ = fit_compute(m.compute, m.batches, m.quick, cache_bytes=cache)
    if progress:
        progress(f"compute fit: median error {100 * err:.1f}%, backward factor {backward_factor}")
    comm = m.all_to_all
    hw = Hardware(
        name=f"local-{world_size}",
        world_size=world_size,
        ranks_per_host=world_size,
        memory_bytes=m.physical_memory_bytes * memory_fraction / world_size,
        memory_bw=1.0 / coef["bytes"] if coef["bytes"] > 0 else 1e15,
        intra_host_bw=comm["intra_host_bw"],
        cross_host_bw=comm["intra_host_bw"],  # one host: no cross-host link measured
        latency_s=comm["latency_s"],
        kernel_overhead_s=coef["kernel_overhead_s"],
        group_s=coef["group_s"],
        column_stat_id_s=coef["column_stat_id_s"],
        column_stat_shard_s=coef["column_stat_shard_s"],
        backward_factor=backward_factor,
        id_s=coef["id_s"],
        row_s=coef["row_s"],
        cache_bytes=cache,
        cold_byte_s=coef["cold_byte_s"],
        bag_s=coef["bag_s"],
        route_id_s=coef["route_id_s"],
        route_table_s=coef["route_table_s"],
        feature_s=coef["feature_s"],
        dist_id_s=coef["dist_id_s"],
        dist_value_s=coef["dist_value_s"],
        step_overhead_s=coef["step_overhead_s"],
    )
    if world_size > 1:
        hw = replace(hw, contention=m.contention, sync_jitter=m.sync_jitter)
        cases = collection_cases(world_size, m.collection_batches, m.collection_sets)

        def steps(times: dict[str, list[float]]) -> list[tuple[ShardingPlan, list[TableSpec], int, float]]:
            return [(plan, tables, gb[0].batch_size, statistics.median(times[name])) for name, plan, tables, gb in cases]

        fitted = fit_collection(hw, steps(m.collection))
        if progress:
            progress(f"contention {m.contention:.2f} (compute x{1 + m.contention:.2f} while every rank is busy); "
                     f"cores' jitter {m.sync_jitter:.2f} (fitted net of a x{sync_wait_factor(m.sync_jitter, world_size):.2f} "
                     f"wait for the slowest rank); "
                     f"isolated all-to-all: {comm['latency_s'] * 1e6:.0f} us, {comm['intra_host_bw'] / 1e9:.2f} GB/s; "
                     f"in the collection: {fitted['latency_s'] * 1e6:.0f} us, {fitted['intra_host_bw'] / 1e9:.2f} GB/s, "
                     f"data-parallel replicas combine rows at {_rate(fitted['replica_byte_s'])}")
        # A collective inside a step costs at least what it costs alone; the fit, whose other
        # terms can absorb a small latency, may not go below the isolated measurement.
        hw = replace(hw, latency_s=max(fitted["latency_s"], comm["latency_s"]), intra_host_bw=fitted["intra_host_bw"],
                     cross_host_bw=fitted["intra_host_bw"], replica_byte_s=fitted["replica_byte_s"],
                     replica_latency_s=fitted["replica_latency_s"])
        if m.collection_tcp and all(m.collection_tcp.values()):
            tcp = fit_collection(hw, steps(m.collection_tcp))
            # the exchanges' bandwidth stays the shared-memory fit (between hosts the link's rate
            # prices the bytes); TCP changes what each collective and replica byte costs the ranks
            tcp_latency = max(tcp["latency_s"], hw.latency_s)
            hw = replace(hw, tcp_latency_s=tcp_latency, tcp_replica_latency_s=tcp["replica_latency_s"],
                         tcp_replica_byte_s=tcp["replica_byte_s"])
            if m.collection_tcp_cpu and all(m.collection_tcp_cpu.get(name) for name, *_ in cases):
                # the same fit on the probes' CPU time: no rank waits for another in it, so no
                # wait for the slowest to take out; the bytes cost the cores what they cost over
                # shared memory (copies either way)
                used = fit_collection(replace(hw, sync_jitter=0.0), steps(m.collection_tcp_cpu), bandwidth=hw.intra_host_bw)
                hw = replace(hw, tcp_call_s=min(used["latency_s"], tcp_latency))
            if progress:
                progress(f"over TCP: {tcp['latency_s'] * 1e6:.0f} us a collective (replica groups' "
                         f"{tcp['replica_latency_s'] * 1e6:.0f} us), replicas combine rows at {_rate(tcp['replica_byte_s'])}"
                         + (f"; its rank's cores spend {hw.tcp_call_s * 1e6:.0f} us of CPU on it" if hw.tcp_call_s is not None else ""))
    return hw
