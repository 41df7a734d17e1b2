"""What ``recscale simulate`` prints and writes: a summary, a JSON record and a Chrome/Perfetto
trace of the reported step (one process per rank, one thread per stream)."""

from __future__ import annotations

import json

from recscale.atomic import write_text_atomic
from recscale.sim.step import StepResult
from recscale.sim.topology import ClusterTopology


def to_dict(res: StepResult, topo: ClusterTopology) -> dict:
    t0 = res.window[0]
    mem = [sum(m.values()) for m in res.memory_bytes]
    return {
        "topology": {"name": topo.name, "hosts": topo.hosts, "ranks_per_host": topo.ranks_per_host,
                     "world_size": topo.world_size, "host_link_bytes_per_s": topo.host_link_bw,
                     "intra_host_bytes_per_s": topo.hardware.intra_host_bw,
                     "dense_flops_per_s": topo.compute.flops_per_s},
        "step_time_s": res.step_time_s,
        "samples_per_s": res.samples_per_s,
        "breakdown": res.breakdown,
        "critical_path": [{"op": op.name, "category": op.category, "step": op.step,
                           "ranks": list(op.ranks) if len(op.ranks) <= 8 else f"all {len(op.ranks)}",
                           "start_s": max(op.start, t0) - t0, "end_s": op.end - t0} for op in res.critical_path],
        "planner_embedding_step_s": res.plan_result.max_rank_s,
        "memory_bytes_per_rank": {"max": max(mem), "min": min(mem), "per_rank": res.memory_bytes},
        "busy_s_per_rank": res.busy_s,
        "plan": {t.table: t.sharding_type for t in res.plan_result.plan.tables},
    }


def trace(res: StepResult) -> dict:
    """Chrome trace events (microseconds) of every operation overlapping the reported step."""
    t0, t1 = res.window
    tids = {"compute": 1, "comm": 2, "load": 3, "dense": 4, "replica": 5}
    events: list[dict] = []
    ranks = len(res.busy_s)
    for r in range(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        for s, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": s}})
    for op in res.ops:
        lo, hi = max(op.start, t0), min(op.end, t1)
        if hi <= lo:
            continue
        for r in op.ranks:
            events.append({"ph": "X", "name": op.name, "cat": op.category, "pid": r, "tid": tids[op.stream],
                           "ts": (lo - t0) * 1e6, "dur": (hi - lo) * 1e6, "args": {"batch": op.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_json(path: str, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def summary(res: StepResult, topo: ClusterTopology) -> str:
    mem = [sum(m.values()) for m in res.memory_bytes]
    lines = [
        f"simulated step on '{topo.name}': {topo.hosts} host(s) x {topo.ranks_per_host} rank(s), host links "
        f"{topo.host_link_bw * 8 / 1e9:g} Gbit/s each way, global batch {round(res.samples_per_s * res.step_time_s):,}",
        f"step time {res.step_time_s * 1e3:.3f} ms, {res.samples_per_s:,.0f} samples/s "
        f"(the planner's embedding step alone: {res.plan_result.max_rank_s * 1e3:.3f} ms)",
        "critical path by category:",
    ]
    for cat, s in sorted(res.breakdown.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:30s} {s * 1e3:10.3f} ms  {100 * s / res.step_time_s:5.1f}%")
    chain = []
    for op in res.critical_path:
        if not chain or chain[-1] != op.name:
            chain.append(op.name)
    lines.append("critical path: " + " -> ".join(chain))
    lines.append(f"memory per rank: max {max(mem) / 1e9:.3f} GB, min {min(mem) / 1e9:.3f} GB")
    return "\n".join(lines)
