"""``recscale explore``: a joint search over where a job's ranks sit (buildings, ranks per host,
hence the per-rank batch within the fixed global batch), the sharding plan (with and without
awareness of the slowest link tier), wire precisions and pipelining, scored by the simulator.

Scoring is two-stage. Every candidate is scored by an analytic model built from pieces cached
per (placement, plan): the cost model's per-rank embedding time, the dense compute, and each
collective's busiest-link time per wire byte, which scale linearly with precision; this scores
tens of thousands of candidates a minute. The best ones by that score, and the baselines, are
then run through the full event simulation, whose figures are the ones reported and ranked.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from recscale.embedding import TableConfig
from recscale.comm.process_group import Topology
from recscale.planner.cost_model import TableSpec, Workload, collective_s
from recscale.planner.search import plan_tables, score_plan
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import ShardingPlan
from recscale.sim import traffic
from recscale.sim.api import NUM_DENSE, _DENSE_WIRE
from recscale.sim.dense import DenseModel, bucket_groups
from recscale.sim.step import (StepInputs, StepResult, _volumes, gradient_links, replica_links, step_hardware,
                                simulate_step)
from recscale.sim.tiers import TieredCluster
from recscale.sim.topology import ClusterTopology
from recscale.train.config import Config
from recscale.train.planning import _WIRE_BYTES, table_specs, wire_bytes

# Accuracy of a wire precision applied to the forward and backward all-to-alls and the dense
# all-reduce together (int8: bf16 for the dense sums), DLRM on configs/criteo_10k.toml, 2 ranks,
# row-wise sharding, one epoch, seed 0; measured 2026-11-25 with `torchrun --nproc_per_node=2 -m
# recscale train --config configs/criteo_10k.toml --set sharding.default=row_wise --set
# comm.forward=P --set comm.backward=P --set comm.dense=P` (docs/explorer.md). One seed: the
# differences (<= 0.0006 AUC) are within run-to-run noise. Values: eval (logloss, AUC).
MEASURED_ACCURACY: dict[str, tuple[float, float]] = {
    "fp32": (0.5110, 0.7117),
    "fp16": (0.5111, 0.7114),
    "bf16": (0.5114, 0.7111),
    "int8": (0.5111, 0.7114),
}
FP32_REFERENCE = "fp32"
WIRES = ("fp32", "bf16", "fp16", "int8")
DENSE_WIRES = ("fp32", "bf16", "fp16")


def accuracy_cost(precisions: tuple[str, ...]) -> tuple[float, float] | None:
    """(eval logloss increase, AUC loss) against fp32: the worst measured among the precisions a
    candidate uses, or None when one was not measured (such candidates are left out)."""
    if any(p not in MEASURED_ACCURACY for p in precisions):
        return None
    ll0, auc0 = MEASURED_ACCURACY[FP32_REFERENCE]
    return (max(MEASURED_ACCURACY[p][0] - ll0 for p in precisions),
            max(auc0 - MEASURED_ACCURACY[p][1] for p in precisions))


@dataclass(frozen=True)
class Placement:
    """The job on the first ``buildings`` buildings with ``ranks_per_host`` ranks per host."""

    buildings: int
    ranks_per_host: int


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    plan_name: str
    forward: str
    backward: str
    dense: str
    pipeline: bool

    def overrides(self) -> list[str]:
        return [f"comm.forward={self.forward}", f"comm.backward={self.backward}", f"comm.dense={self.dense}",
                f"train.pipeline={'true' if self.pipeline else 'false'}"]


@dataclass
class Pieces:
    """What a (placement, plan) costs, independent of precision and pipelining."""

    plan: ShardingPlan
    topo: ClusterTopology
    fits: bool
    emb_f: float
    emb_b: float
    pack: float
    unpack: float
    bottom_f: float
    top_f: float
    optim: float
    ids_s: float
    out_per_byte: float  # busiest link's time per wire byte per element
    grad_per_byte: float
    allreduce_per_byte: float
    replica_s: float
    lat: float
    distributed: bool


def _link_s(topo: ClusterTopology, links: dict) -> float:
    bw = traffic.bandwidths(topo)
    return max((v / bw[k[0]] for k, v in traffic.on_wire(topo, links).items() if v > 0), default=0.0)


def pieces(specs: list[TableSpec], cfg: Config, topo: ClusterTopology, plan: ShardingPlan) -> Pieces:
    hw, w = step_hardware(topo), topo.world_size
    unit = Workload(cfg.train.batch_size, 1.0, 1.0)
    res = score_plan(plan, specs, hw, Workload(cfg.train.batch_size))
    fits = all(r.memory_bytes <= hw.memory_bytes for r in res.ranks)
    emb = max(r.compute_s + r.contention_s for r in res.ranks)
    bf = hw.backward_factor
    kinds = plan.sharding_types()
    sharded = [t for t in specs if kinds[t.name] != "data_parallel"]
    local = cfg.train.batch_size / w
    m = cfg.model
    d = DenseModel.of(NUM_DENSE, m.bottom_mlp, m.top_mlp, len(specs), m.embedding_dim)
    c = topo.compute
    inp = StepInputs(specs, unit, plan, d, True)
    ids_v, out_v, grad_v, hier_v, cw_v = _volumes(inp, topo)
    out = _link_s(topo, traffic.merge(traffic.all_to_all(topo, out_v, toward_dest=False), traffic.intra_host(topo, hier_v)))
    grad = _link_s(topo, gradient_links(topo, grad_v, hier_v, cw_v))
    ar = sum(_link_s(topo, traffic.ring_all_reduce(topo, p)) for p, _ in bucket_groups(d.top_params, d.bottom_params))
    rep = _link_s(topo, replica_links(inp, topo))
    lat = collective_s(hw)
    if topo.hosts > 1:
        lat += topo.host_link_latency_s + sum(t.latency_s for t in topo.tiers if t.hosts_per_group < topo.hosts)
    b = int(local)
    params = d.bottom_params + d.top_params
    return Pieces(plan, topo, fits, emb / (1 + bf), emb * bf / (1 + bf),
                  local * sum(t.pooling * hw.dist_id_s for t in sharded), local * sum(t.dim * hw.dist_value_s for t in sharded),
                  d.time_s(d.bottom_flops(b), d.bottom_values(b), d.bottom_ops, c),
                  d.time_s(d.top_flops(b), d.top_values(b), d.top_ops, c),
                  params * 16 / hw.memory_bw + 2 * d.tensors * c.op_overhead_s + hw.step_overhead_s,
                  _link_s(topo, traffic.all_to_all(topo, ids_v)), out, grad, ar, rep, lat, bool(sharded))


def analytic_step_s(p: Pieces, c: Candidate) -> float:
    """A fast estimate of the simulated step: the forward/backward chain with the overlaps the
    simulator models, bounded below by the busiest link's total traffic."""
    fw, bw, dw = _WIRE_BYTES[c.forward], _WIRE_BYTES[c.backward], _DENSE_WIRE[c.dense]
    out = p.out_per_byte * fw if p.distributed else 0.0
    grad = p.grad_per_byte * bw if p.distributed else 0.0
    ar = p.allreduce_per_byte * dw
    ids = 0.0 if c.pipeline else p.ids_s + 3 * p.lat
    chain = (p.pack + ids + p.emb_f + max(out + 2 * p.lat, p.bottom_f) + p.unpack + 3 * p.top_f
             + max(grad + p.lat + p.emb_b, 2 * p.bottom_f + ar) + p.replica_s + p.optim)
    link = p.ids_s + out + grad + ar + p.replica_s
    return max(chain, link)


def plan_variants(specs: list[TableSpec], cfg: Config, topo: ClusterTopology) -> dict[str, ShardingPlan]:
    """Named plans for one placement: the greedy table-wise default, the planner costed on the
    host link (no tier awareness) and on the slowest tier's per-rank share, and families that
    replicate the small tables and shard the rest one way (row-split tables reduce inside a host
    before crossing it, so fewer bytes reach the slow link)."""
    families = family_plans(specs, cfg, topo)
    return {"greedy-table-wise": families.pop("greedy-table-wise"), **planner_plans(specs, cfg, topo), **families}


EARLY_PLANS = 4  # plans of each placement fully simulated before the rest in analytic order
PLANNER_PLANS = ("planner", "planner-int8-wire", "planner-tier-aware")


def planner_plans(specs: list[TableSpec], cfg: Config, topo: ClusterTopology,
                  names: tuple[str, ...] = PLANNER_PLANS) -> dict[str, ShardingPlan]:
    """The planner's plans of one placement (of ``names``): costed on the host link (no tier
    awareness, as its users run it) at fp32 all-to-alls and at int8 ones (what ``recscale
    train`` plans with ``comm.forward`` and ``comm.backward`` int8: cheaper exchanges favour
    whole tables over split ones), and, where a tier splits the placement, on the slowest
    tier's per-rank share. These cost seconds each on a large world, the rest milliseconds."""
    r = topo.ranks_per_host
    wl = Workload(cfg.train.batch_size)
    out = {}
    if "planner" in names:
        out["planner"] = plan_tables(specs, topo.hardware, wl).plan
    if "planner-int8-wire" in names:
        int8 = wire_bytes("int8", cfg.model.embedding_dim)  # as train plans it
        out["planner-int8-wire"] = plan_tables(specs, topo.hardware, Workload(cfg.train.batch_size, int8, int8)).plan
    if "planner-tier-aware" in names and topo.tiers:
        from dataclasses import replace

        per_rank = min(t.bandwidth / (t.hosts_per_group * r) for t in topo.tiers)
        slow = replace(topo.hardware, cross_host_bw=min(per_rank, topo.hardware.cross_host_bw))
        out["planner-tier-aware"] = plan_tables(specs, slow, wl).plan
    return out


def family_plans(specs: list[TableSpec], cfg: Config, topo: ClusterTopology) -> dict[str, ShardingPlan]:
    """The greedy table-wise default and the families that replicate the small tables and shard
    the rest one way, for one placement."""
    w, r = topo.world_size, topo.ranks_per_host
    tables = [TableConfig(t.name, t.rows, t.dim, (t.name[2:],)) for t in specs]
    flat = Topology(w, 0, r)
    out = {"greedy-table-wise": default_plan(tables, flat, "table_wise")}
    sizes = sorted({t.rows * t.dim for t in specs})
    cuts = sorted({0, *(sizes[int(q * (len(sizes) - 1))] for q in (0.25, 0.5, 0.75))})
    for kind, cut in itertools.product(("table_wise", "row_wise", "table_row_wise", "column_wise"), cuts):
        over = {t.name: TableSharding("data_parallel") for t in specs if t.rows * t.dim <= cut}
        if kind == "column_wise":
            over.update({t.name: TableSharding("column_wise", min(t.dim // 4 or 1, w)) for t in specs if t.name not in over})
        try:
            out[f"{kind}+replicate<={cut}"] = default_plan(tables, flat, kind, over)
        except ValueError:
            continue
    return out


@dataclass
class Scored:
    candidate: Candidate
    analytic_s: float
    result: StepResult | None = None
    accuracy: tuple[float, float] = (0.0, 0.0)


@dataclass
class Exploration:
    cluster: TieredCluster
    scored: list[Scored]  # fully simulated, best first
    baselines: dict[str, Scored | str]  # a string: why the baseline is absent
    plans: dict[tuple[Placement, str], ShardingPlan]
    analytic_count: int
    analytic_seconds: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    time_budget_s: float | None = None

    @property
    def within_budget(self) -> bool:
        """Whether the search, full simulations included, finished inside its time budget."""
        return self.time_budget_s is None or self.seconds <= self.time_budget_s

    @property
    def candidates_per_minute(self) -> float:
        return self.analytic_count / self.analytic_seconds * 60 if self.analytic_seconds > 0 else 0.0


def _simulate(specs: list[TableSpec], cfg: Config, p: Pieces, c: Candidate) -> StepResult:
    dim = cfg.model.embedding_dim
    wl = Workload(cfg.train.batch_size, wire_bytes(c.forward, dim), wire_bytes(c.backward, dim))
    m = cfg.model
    d = DenseModel.of(NUM_DENSE, m.bottom_mlp, m.top_mlp, len(specs), m.embedding_dim)
    return simulate_step(StepInputs(specs, wl, p.plan, d, c.pipeline, _DENSE_WIRE[c.dense], cfg.checkpoint.interval_steps), p.topo)


def explore(cfg: Config, cluster: TieredCluster, time_budget_s: float = 120.0, top_k: int = 24,
            max_auc_loss: float = 0.002, use_all_ranks: bool = False) -> Exploration:
    """Rank candidates for ``cfg`` on ``cluster`` within about ``time_budget_s``. With
    ``use_all_ranks`` every candidate runs on every rank of the cluster (the world size is
    fixed: what a job that has the whole cluster pays for searches over); otherwise fewer
    buildings and fewer ranks per host are candidates too."""
    t0 = time.perf_counter()
    specs = table_specs(cfg)
    notes: list[str] = []
    if use_all_ranks:
        placements = [Placement(cluster.buildings, cluster.ranks_per_host)]
    else:
        placements = [Placement(b, r) for b in range(cluster.buildings, 0, -1)
                      for r in sorted({cluster.ranks_per_host, max(1, cluster.ranks_per_host // 2)}, reverse=True)]
    precisions = []
    for f, b, dn in itertools.product(WIRES, WIRES, DENSE_WIRES):
        acc = accuracy_cost((f, b, dn))
        if acc is not None and acc[1] <= max_auc_loss:
            precisions.append((f, b, dn, acc))
    cache: dict[tuple[Placement, str], Pieces] = {}
    topos: dict[Placement, ClusterTopology] = {}
    for pl in placements:
        sub = cluster.shrink(pl.buildings, pl.ranks_per_host)
        if cfg.train.batch_size % sub.world_size:
            notes.append(f"{pl}: global batch {cfg.train.batch_size} does not split over {sub.world_size} ranks")
            continue
        topos[pl] = sub.topology()

    def add(pl: Placement, plans: dict[str, ShardingPlan]) -> None:
        for name, plan in plans.items():
            if (pl, name) in cache:
                continue
            p = pieces(specs, cfg, topos[pl], plan)
            if p.fits:
                cache[(pl, name)] = p

    def plans_spent() -> bool:
        return time.perf_counter() - t0 > time_budget_s * 0.3

    # The planner costs seconds a plan on a large world, the other plans milliseconds: the
    # baselines' plans first, then every placement's cheap plans, then the planner's on the
    # placements whose cheap plans score best, so a spent budget drops the least promising.
    all_ranks = Placement(cluster.buildings, cluster.ranks_per_host)
    families = {}
    if all_ranks in topos:
        families[all_ranks] = family_plans(specs, cfg, topos[all_ranks])
        add(all_ranks, {"greedy-table-wise": families[all_ranks]["greedy-table-wise"]})
        add(all_ranks, planner_plans(specs, cfg, topos[all_ranks], ("planner",)))
    for pl in topos:
        if plans_spent():
            notes.append(f"placements from {pl} on not explored: the time budget's share for plans ran out")
            break
        add(pl, families.get(pl) or family_plans(specs, cfg, topos[pl]))

    def promise(pl: Placement) -> float:
        return min((analytic_step_s(p, Candidate(pl, name, f, b, dn, pipe)) for (q, name), p in cache.items() if q == pl
                    for f, b, dn, _ in precisions for pipe in (True, False)), default=float("inf"))

    for pl in sorted(topos, key=promise):
        if plans_spent():
            notes.append(f"{pl}: the planner's plans not made: the time budget's share for plans ran out")
            continue
        todo = tuple(n for n in PLANNER_PLANS if (pl, n) not in cache)
        add(pl, planner_plans(specs, cfg, topos[pl], todo))
    ta = time.perf_counter()
    ranked: list[Scored] = []
    pieces_seconds = ta - t0
    for (pl, name), p in cache.items():
        for f, b, dn, acc in precisions:
            for pipe in (True, False):
                c = Candidate(pl, name, f, b, dn, pipe)
                ranked.append(Scored(c, analytic_step_s(p, c), accuracy=acc))
    analytic_seconds = time.perf_counter() - ta + pieces_seconds  # the cached pieces count too
    ranked.sort(key=lambda s: s.analytic_s)
    full = cluster.shrink(cluster.buildings, cluster.ranks_per_host)
    baselines: dict[str, Scored | str] = {}
    fp32 = ("fp32", "fp32", "fp32")
    for bname, plan_name, wires in (("production-default", "greedy-table-wise", fp32),
                                    ("recscale-planner", "planner", (cfg.comm.forward, cfg.comm.backward, cfg.comm.dense))):
        p = cache.get((all_ranks, plan_name))
        if p is None:
            baselines[bname] = f"the {plan_name} plan does not fit {full.world_size} ranks' memory"
            continue
        c = Candidate(all_ranks, plan_name, *wires, cfg.train.pipeline)
        baselines[bname] = Scored(c, analytic_step_s(p, c), _simulate(specs, cfg, p, c))
    baselines["torchrec-planner"] = _torchrec_note()
    scored: list[Scored] = []
    seen: set[tuple] = set()
    # the best of every placement first: what the job gains by using fewer buildings or ranks
    # per host shows next to the best that uses them all
    # (four plans each: the analytic score orders placements well, plans within one less so;
    # the planner's int8-wire plan often scores first there and simulates behind the greedy one)
    firsts: dict[Placement, list[Scored]] = {}
    for s in ranked:
        group = firsts.setdefault(s.candidate.placement, [])
        if len(group) < EARLY_PLANS and all(g.candidate.plan_name != s.candidate.plan_name for g in group):
            group.append(s)
    early = [s for group in firsts.values() for s in group]
    ids = {id(s) for s in early}
    order = early + [s for s in ranked if id(s) not in ids]
    for s in order:
        if len(scored) >= top_k + len(early) or (scored and time.perf_counter() - t0 > time_budget_s * 0.8):
            break
        key = (s.candidate.placement, s.candidate.plan_name, s.candidate.pipeline)
        if key in seen and len(scored) >= len(early) + top_k // 2:
            continue  # keep the simulated set varied: precision alone rarely reorders plans
        seen.add(key)
        s.result = _simulate(specs, cfg, cache[(s.candidate.placement, s.candidate.plan_name)], s.candidate)
        scored.append(s)
    for b in baselines.values():  # a baseline is a candidate too: the best is never worse than it
        if isinstance(b, Scored) and not any(x.candidate == b.candidate for x in scored):
            scored.append(b)
    scored.sort(key=lambda s: -s.result.samples_per_s)  # type: ignore[union-attr]
    plans = {k: v.plan for k, v in cache.items()}
    return Exploration(cluster, scored, baselines, plans, len(ranked), analytic_seconds, time.perf_counter() - t0,
                       notes, time_budget_s)


def _torchrec_note() -> str:
    import importlib.util

    if importlib.util.find_spec("torchrec") is None:
        return "not installed (torchrec is an optional dependency); no TorchRec planner baseline"
    return "installed, but its planner is not wired into the explorer yet"
