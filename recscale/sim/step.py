"""A training step as operations of every rank, costed by the planner's cost model, run through
the event simulation for a few steps; the steady-state step is what ``simulate`` reports.

Per step and rank, in program order: load the batch (the loader's own stream), pack its ids,
the ids all-to-all (with the pipeline: batch i+1's, issued before batch i+2 loads, so it runs
during batch i), the sharded tables' lookups (the planner's per-rank compute, forward share),
the output all-to-all (asynchronous: the bottom MLP runs meanwhile, then the data-parallel
replicas pool their own samples), unpacking, interaction and top MLP, their backward, the
gradient all-to-all (asynchronous), the replicas' gradient exchange and update (autograd
reaches them before the bottom MLP: they pooled after it), the bottom MLP's backward, the
dense all-reduce buckets as their gradients are there, the sharded tables' backward and fused
update once the gradients arrived (the rest of the per-rank compute), the dense optimizer and
checkpoint stalls. The all-to-alls, the dense all-reduce and the replica exchange each have a
stream (a process group) of their own, so their bytes share the links they meet on; every
collective's bytes are framed as the topology's network carries them (``traffic.on_wire``).

On CPU ranks four costs of a real step come on top, each priced from the calibration: a rank
without a loader worker, or whose host's cores its training threads already fill, builds its
batches in its training thread; ranks that share a machine slow each other's compute
(``contention``) and divide its cores (``cores.CoreShare``: the MLPs' arithmetic spreads over
the cores a rank's threads get); each collective costs the thread that calls it its latency,
also when its bytes travel in the background (over TCP, an asynchronous one the CPU time the
calibration measured for it, ``tcp_call_s``); and the bytes a collective moves between ranks
of one host are copied by those ranks' own threads (through shared memory, or the loopback's
socket copies), at the calibrated intra-host rate, on both ends: CPU time of the step, not a
link that runs beside it (the planner's cost model charges them the same way)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from recscale.planner.cost_model import (TableSpec, Workload, collective_s, dp_group_flags, dp_reduces_dense,
                                         group_collectives, routing_s, shard_cost, unique_rows)
from recscale.planner.hardware import Hardware
from recscale.planner.jitter import sync_wait_factor, synced_stretch
from recscale.planner.search import PlanResult, score_plan
from recscale.sharding.plan import ShardingPlan
from recscale.sim import traffic
from recscale.sim.dense import DenseModel, bucket_groups
from recscale.sim.engine import Op, Simulation
from recscale.sim.topology import ClusterTopology

STEPS = 5  # simulated; the third (index 2) is reported: warm pipeline, later batches to send and load
MEASURED = 2


@dataclass(frozen=True)
class StepInputs:
    tables: list[TableSpec]
    workload: Workload
    plan: ShardingPlan
    dense: DenseModel
    pipeline: bool
    dense_wire_bytes: float = 4.0
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    # The trainer loads batches in its own thread (no loader worker process): the load is on
    # every rank's compute stream, not beside it.
    load_in_process: bool = False
    threads: int = 1  # training threads per rank (``train.threads`` as the trainer sizes it)


@dataclass
class StepResult:
    step_time_s: float
    samples_per_s: float
    breakdown: dict[str, float]  # the critical path's time per category; sums to step_time_s
    critical_path: list[Op]
    ops: list[Op]  # every operation of the simulation
    window: tuple[float, float]  # the reported step's span
    plan_result: PlanResult
    memory_bytes: list[dict[str, float]] = field(default_factory=list)
    busy_s: list[dict[str, float]] = field(default_factory=list)  # per rank, per category, in the window


_LENGTH_BYTES = 8.0  # the input distribution sends each bag's length as int64


def _volumes(inp: StepInputs, topo: ClusterTopology) -> tuple[list[float], ...]:
    """Per owner rank: bytes one source exchanges with it (ids with their bags' lengths,
    outputs, gradients), the hierarchical table-row-wise shards' reduce-scatter inside the host,
    and what the owner of column-wise shards sends every rank in backward (each unique row's
    squared gradient sum, fp32, for the row-wise optimizer state all column shards share)."""
    w, r, h = topo.world_size, topo.ranks_per_host, topo.hosts
    wl = inp.workload
    ids, out, grad, hier, cw = ([0.0] * w for _ in range(5))
    by_name = {t.name: t for t in inp.tables}
    for tp in inp.plan.tables:
        t = by_name[tp.table]
        if tp.sharding_type == "data_parallel":
            continue
        n_all = wl.batch_size * t.pooling
        for s in tp.shards:
            n = n_all * (s.num_rows / t.rows if tp.routes_by_row else 1.0)
            hierarchical = tp.sharding_type == "table_row_wise" and h > 1 and t.rows >= r
            cols = s.num_cols / r if hierarchical else s.num_cols
            ids[s.rank] += (n * wl.id_bytes + wl.batch_size * _LENGTH_BYTES) / w
            out[s.rank] += wl.batch_size * cols * wl.fwd_wire_bytes / w
            grad[s.rank] += wl.batch_size * cols * wl.bwd_wire_bytes / w
            if hierarchical:
                hier[s.rank] += wl.batch_size * s.num_cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes) * (r - 1) / r / 2
            if tp.sharding_type == "column_wise":
                cw[s.rank] += unique_rows(t.rows, t.unique_fraction, n_all, n_all) * 4.0
    return ids, out, grad, hier, cw


def gradient_links(topo: ClusterTopology, grad_v: list[float], hier_v: list[float], cw_v: list[float]) -> dict:
    """The backward's exchanges: gradients to the owners, the hierarchical shards' step inside
    the host, and the column-wise owners' row statistics to every rank (an all-gather around
    the ring, every part padded to the largest)."""
    part = max(cw_v) if cw_v else 0.0
    cw = traffic.ring_all_gather(topo, part) if part > 0 else {}
    return traffic.merge(traffic.all_to_all(topo, grad_v), traffic.intra_host(topo, hier_v), cw,
                         serial_connections(topo, grad_v, part))


def replica_links(inp: StepInputs, topo: ClusterTopology) -> dict:
    """The bytes on each link that combine the data-parallel tables' gradients, as the runtime
    sends them (``recscale/sharding/replica_gradients.py``): a gathered table's replicas each
    all-gather their distinct rows' ids and gradients, around the ring; a densely reduced one
    reduce-scatters its whole gradient (one slice to each rank straight) and all-gathers the
    summed slices (around the ring)."""
    hw, wl, w = topo.hardware, inp.workload, topo.world_size
    gathered = dense_slice = 0.0
    for t in inp.tables:
        if inp.plan.table(t.name).sharding_type != "data_parallel" or w == 1:
            continue
        if dp_reduces_dense(t, hw, wl):
            dense_slice += t.rows * (t.dim + 1) * 4.0 / w
        else:
            ids = wl.batch_size * t.pooling
            gathered += unique_rows(t.rows, t.unique_fraction, ids, ids / w) * (t.dim * 4 + 8)
    if w == 1 or gathered + dense_slice == 0:
        return {}
    return traffic.merge(traffic.uniform(topo, dense_slice), traffic.ring_all_gather(topo, gathered + dense_slice),
                         serial_connections(topo, [dense_slice] * w, gathered + dense_slice))


def over_tcp(topo: ClusterTopology) -> bool:
    """Whether collectives between hosts run over gloo's TCP connections: CPU ranks (gloo) on
    several hosts. GPU ranks (NCCL) post their receives ahead and send both ways at once."""
    return topo.hosts > 1 and topo.compute.flops_per_s < 1e12


def step_hardware(topo: ClusterTopology) -> Hardware:
    """The hardware a step is priced on: over TCP (``over_tcp``), with the calibration's
    collective costs over TCP where it measured them; else the topology's own."""
    return topo.hardware.over_tcp() if over_tcp(topo) else topo.hardware


def serial_connections(topo: ClusterTopology, per_dest: list[float], ring_part: float = 0.0) -> dict:
    """Over TCP, the connections' bytes that go one direction after the other
    (``traffic.connections``); nothing elsewhere."""
    return traffic.connections(topo, per_dest, ring_part) if over_tcp(topo) else {}


def contention_factor(topo: ClusterTopology) -> float:
    """How much slower a rank computes beside the other ranks of its machine (shared memory
    bandwidth and caches): 1 + the calibration's ``contention``, measured with every rank of
    a host busy, where several ranks share a host or emulated hosts share one machine's cores.
    The planner charges it to the embeddings; it holds for all of a step's compute (MLPs, the
    loader, packing, the optimizer) alike."""
    together = topo.ranks_per_host > 1 or (topo.shared_cores > 0 and topo.world_size > 1)
    return 1.0 + topo.hardware.contention if together else 1.0


def simulate_step(inp: StepInputs, topo: ClusterTopology) -> StepResult:
    hw, wl, w = step_hardware(topo), inp.workload, topo.world_size
    if inp.plan.world_size != w:
        raise ValueError(f"the plan is for {inp.plan.world_size} ranks, the topology has {w}")
    result = score_plan(inp.plan, inp.tables, hw, wl)
    kinds = inp.plan.sharding_types()
    sharded = [t for t in inp.tables if kinds[t.name] != "data_parallel"]
    local = wl.batch_size / w
    c = topo.compute
    bf = hw.backward_factor
    # ranks that meet at every collective wait for the slowest: their compute takes the
    # expected maximum over them, beyond the mean the constants give
    wait = sync_wait_factor(c.sync_jitter, w)
    share = contention_factor(topo) * wait
    cores = topo.core_share(inp.threads)
    stretch = topo.compute_stretch * share
    if hw.ranks_per_host > 1:  # the planner prices the embeddings' contention itself
        emb = [(rl.compute_s + rl.contention_s) * topo.compute_stretch for rl in result.ranks]
    else:
        emb = [rl.compute_s * topo.compute_stretch * contention_factor(topo) for rl in result.ranks]
    # the ranks' lookups end at the outputs' exchange: the slowest waits for the others only as
    # much as they can be later than it (``synced_stretch``; balanced ranks: ``wait``)
    emb_wait = synced_stretch(emb, c.sync_jitter) if w > 1 else 1.0
    emb = [e * emb_wait for e in emb]
    # The replicas' share of each rank's embedding work runs at another point of the step
    # (after the bottom MLP's forward, and before its backward): split it off.
    replica = sum(shard_cost(t, "data_parallel", t.rows, t.dim, hw, wl).compute_s
                  for t in inp.tables if kinds[t.name] == "data_parallel")
    emb_dp = [e * min(1.0, replica / rl.compute_s) if rl.compute_s > 0 else 0.0 for e, rl in zip(emb, result.ranks)]
    emb = [e - d for e, d in zip(emb, emb_dp)]
    pack = stretch * (local * sum(t.pooling * hw.dist_id_s for t in sharded) + len(inp.tables) * hw.feature_s
            + sum(routing_s(kinds[t.name], hw) for t in inp.tables))
    unpack = stretch * local * sum(t.dim * hw.dist_value_s for t in sharded)
    dims = {t.name: t.dim for t in inp.tables}
    dense_dp = frozenset(t.name for t in inp.tables if kinds[t.name] == "data_parallel" and dp_reduces_dense(t, hw, wl))
    dp_groups = dp_group_flags(kinds, dims, dense_dp)
    overhead = hw.step_overhead_s + len(dp_groups) * hw.group_s
    ids_v, out_v, grad_v, hier_v, cw_v = _volumes(inp, topo)
    hierarchical = any(hier_v)
    column = "column_wise" in kinds.values()
    # one one-way delay between hosts, and across each tier's groups, on every collective
    away = (topo.host_link_latency_s + sum(t.latency_s for t in topo.tiers if t.hosts_per_group < topo.hosts)
            if topo.hosts > 1 else 0.0)
    lat = collective_s(hw) + away
    # What an asynchronous collective takes from its rank's cores: over TCP the calibration's
    # measured CPU time, on the rank's share of the cores (the link's delay and the wait for
    # the peers are not the rank's work); elsewhere its latency.
    tcp_call = over_tcp(topo) and hw.tcp_call_s is not None
    call_lat = collective_s(replace(hw, latency_s=hw.tcp_call_s)) * topo.compute_stretch if tcp_call else lat
    distributed = bool(sharded)
    cpu = c.flops_per_s < 1e12  # a CPU rank's main thread waits in a synchronous collective
    d = inp.dense
    b = int(local)
    # the loop's own work, and where ranks meet at every collective what that costs a step
    # beyond the parts priced (measured as wall time on the machine's shared cores: unstretched)
    loop_s = stretch * c.loop_s + ((c.tcp_loop_s if over_tcp(topo) else c.shm_loop_s) if w > 1 else 0.0)
    # the dense calibration timed one thread: the arithmetic spreads over the rank's cores, the
    # per-operator cost does not (on a CPU; a GPU's rate is its own)
    # (below one core, ranks outnumbering cores, both stretch alike)
    par = cores.parallel if cpu else 1.0 / topo.compute_stretch
    bottom_f = share * d.time_s(d.bottom_flops(b) / par, d.bottom_values(b) / par, 0, c) + stretch * d.bottom_ops * c.op_overhead_s
    top_f = share * d.time_s(d.top_flops(b) / par, d.top_values(b) / par, 0, c) + stretch * d.top_ops * c.op_overhead_s
    params = d.bottom_params + d.top_params
    optim = stretch * (params * 16 / hw.memory_bw + 2 * d.tensors * c.op_overhead_s + overhead)
    ckpt = 0.0
    if inp.checkpoint_every > 0:
        state = max(rl.memory_bytes for rl in result.ranks) + params * 8
        ckpt = state / topo.checkpoint_bw / inp.checkpoint_every
    # A loader worker is a process of its own: on spare cores it runs beside its rank; where
    # the ranks already take every core, or the rank loads in its own thread, it takes their time.
    crowded = inp.load_in_process or cores.spare_cores < 1
    load_stream, load_s = ("compute", stretch * local * c.load_s_per_sample) if crowded else ("load", share * local * c.load_s_per_sample)
    sim = Simulation(traffic.bandwidths(topo), traffic.link_ends(topo), topo.send_buffer_bytes, traffic.bursts(topo))
    all_ranks = tuple(range(w))
    loads: dict[int, list[int]] = {}
    ids_op: dict[int, int] = {}

    def per_rank(name: str, cat: str, k: int, dur: list[float] | float, deps) -> list[int]:
        return [sim.add(Op(name, cat, k, (r,), "compute", dur[r] if isinstance(dur, list) else dur,
                           deps=deps(r))) for r in all_ranks]

    def collective(name: str, cat: str, k: int, links, latency: float, deps: list[int], blocking: bool,
                   stream: str = "comm", ring: bool = False, calls: int = 1) -> int:
        copies = [0.0] * w
        if cpu and w > 1:
            # Bytes between ranks of one host are copied by the two ranks' own threads, the
            # sender's and the receiver's: CPU time at the calibrated rate (sent plus received
            # per second), not a link beside the compute.
            copies = [(links.get(("intra_out", r), 0.0) + links.get(("intra_in", r), 0.0)) / hw.intra_host_bw
                      * topo.compute_stretch for r in all_ranks]
            links = {key: v for key, v in links.items() if not key[0].startswith("intra_")}
        links = traffic.on_wire(topo, links)
        op = sim.add(Op(name, cat, k, all_ranks, stream, latency if w > 1 else 0.0, links, deps, blocking, together=ring))
        if cpu and w > 1:
            # A CPU rank's own thread issues the collective and does its part (packing, the
            # synchronisation) while the bytes between hosts travel on their own; a blocking
            # call has held the thread for its latency already. ``calls``: collectives in it.
            call = [(0.0 if blocking else calls * call_lat) + copies[r] for r in all_ranks]
            if any(x > 0 for x in call):
                per_rank(f"{name} call", cat, k, call, (lambda r: [op]) if blocking else (lambda r: []))
        return op

    def load(k: int) -> None:
        loads[k] = [sim.add(Op("load batch", "data loading", k, (r,), load_stream, load_s)) for r in all_ranks]

    def send(k: int) -> None:
        packs = per_rank("pack ids", "input distribution", k, pack, lambda r: [loads[k][r]])
        n = 3 if distributed else 1  # batch sizes, lengths, ids (only batch sizes when all replicated)
        links = traffic.merge(traffic.all_to_all(topo, ids_v), serial_connections(topo, ids_v))
        ids_op[k] = collective("ids all-to-all", "input distribution", k, links, n * lat,
                               packs, blocking=cpu and not inp.pipeline, calls=n)

    step_end: list[float] = []
    for k in range(STEPS):
        if not inp.pipeline:
            load(k)
            send(k)
        else:  # batch k+1 (loaded the step before) sends its ids, then batch k+2 loads meanwhile
            if k == 0:
                load(0)
                send(0)
                load(1)
            if k + 1 < STEPS:
                send(k + 1)
            if k + 2 < STEPS:
                load(k + 2)
        # In program order (``DLRM.forward``): the sharded lookups, the outputs sent off, the
        # bottom MLP, the replicas' lookups, then the wait for the outputs.
        look = per_rank("embedding lookup", "embedding lookup", k, [e / (1 + bf) for e in emb], lambda r: [ids_op[k]])
        out = None
        if distributed:
            links = traffic.merge(traffic.all_to_all(topo, out_v, toward_dest=False), traffic.intra_host(topo, hier_v),
                                  serial_connections(topo, out_v))
            out = collective("output all-to-all", "output distribution", k, links, (1 + hierarchical) * lat, look, False,
                             calls=1 + hierarchical)
        bottom = per_rank("bottom MLP forward", "MLP + interaction", k, bottom_f, lambda r: [loads[k][r]])
        before_top = bottom
        if dp_groups:
            before_top = per_rank("replica lookup", "embedding lookup", k, [e / (1 + bf) for e in emb_dp],
                                  lambda r: [bottom[r], look[r]])
        if out is not None:
            before_top = per_rank("unpack outputs", "output distribution", k, unpack, lambda r: [out, before_top[r]])
        top = per_rank("interaction + top MLP forward", "MLP + interaction", k, top_f,
                       lambda r: [before_top[r], look[r]])
        top_b = per_rank("interaction + top MLP backward", "MLP + interaction", k, 2 * top_f, lambda r: [top[r]])
        # The dense gradients' buckets (the last layers' first) go out on the dense group, the
        # gradient all-to-all on the embedding group: separate connections (gloo) or streams
        # (NCCL), so they are on the links at once.
        dense_buckets = bucket_groups(d.top_params, d.bottom_params)

        def all_reduce(params: int, deps: list[int]) -> int:
            links = traffic.ring_all_reduce(topo, params * inp.dense_wire_bytes)
            return collective("dense all-reduce", "dense all-reduce", k, links, lat, deps, False, "dense", ring=True)

        reduces = [all_reduce(p, top_b) for p, needs_bottom in dense_buckets if not needs_bottom]
        grad_dep = top_b
        if distributed:
            links = gradient_links(topo, grad_v, hier_v, cw_v)
            n = 1 + hierarchical + 4 * column
            # issued asynchronously as the interaction's backward ends; the embeddings' backward
            # waits for it after the bottom MLP's backward has launched the last buckets
            grad_dep = [collective("gradient all-to-all", "gradient distribution", k, links, n * lat, top_b, False,
                                   calls=n)]
        tail = top_b
        if dp_groups:
            # The replicas pool after the bottom MLP's forward (while the outputs travel), so
            # autograd reaches their backward, its exchange and their update, before the bottom
            # MLP's: a CPU rank's thread waits in the exchange, and the last dense buckets
            # launch only once the replicas are updated.
            rep = collective("replica gradient exchange", "replica gradients", k, replica_links(inp, topo),
                             group_collectives(dp_groups) * (collective_s(hw, replica=True) + away), top_b, cpu,
                             "replica", ring=True)
            tail = per_rank("replica backward + update", "embedding backward + update", k,
                            [e * bf / (1 + bf) for e in emb_dp], lambda r: [rep, top_b[r]])
        bottom_b = per_rank("bottom MLP backward", "MLP + interaction", k, 2 * bottom_f, lambda r: [tail[r]])
        reduces += [all_reduce(p, bottom_b) for p, needs_bottom in dense_buckets if needs_bottom]
        upd = per_rank("embedding backward + update", "embedding backward + update", k, [e * bf / (1 + bf) for e in emb],
                       lambda r: grad_dep if len(grad_dep) == 1 else [grad_dep[r]])
        opt = per_rank("dense optimizer", "dense optimizer", k, optim, lambda r: [upd[r], tail[r], *reduces, bottom_b[r]])
        if loop_s:  # the training loop's own work, whatever the batch
            opt = per_rank("training loop", "training loop", k, loop_s, lambda r: [opt[r]])
        if ckpt:
            opt = per_rank("checkpoint stall", "checkpoint", k, ckpt, lambda r: [opt[r]])
        step_end.append(max(sim.ops[i].end for i in opt))
    last = max((i for i, op in enumerate(sim.ops) if op.step == MEASURED), key=lambda i: sim.ops[i].end)
    t0, t1 = step_end[MEASURED - 1], step_end[MEASURED]
    path, spent = sim.critical_path(last, t0)
    step = t1 - t0
    busy: list[dict[str, float]] = [{} for _ in range(w)]
    for op in sim.ops:
        for r in op.ranks:
            lo, hi = max(op.start, t0), min(op.end_for(r), t1)
            if hi > lo:
                busy[r][op.category] = busy[r].get(op.category, 0.0) + hi - lo
    memory = [{"embeddings": rl.memory_bytes, "dense": params * 4.0 * 3} for rl in result.ranks]
    return StepResult(step, wl.batch_size / step if step > 0 else float("inf"), spent, [sim.ops[i] for i in path],
                      sim.ops, (t0, t1), result, memory, busy)
