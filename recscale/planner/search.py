"""Planning: choose a sharding option and ranks for every table to minimise the predicted step
time of the slowest rank under each rank's memory cap.

``plan_tables`` (the default): several greedy starts (tables largest first, each taking the
option (table-, column-, row-, table-row-wise or data-parallel) and ranks that give the smallest
resulting maximum, or the least work over all ranks), each improved by local search: re-place a
table of the slowest rank, or any table whose exchange costs every rank more than re-placing it
adds, while that lowers the slowest rank plus what every rank pays alike. ``baseline_plan``
gives the Meta baselines: table-wise only, greedy LPT by a proxy cost (size, dim, dim x
pooling, dim x pooling x log10(rows)), or Karmarkar-Karp differencing.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from recscale.planner.cost_model import (
    ShardCost,
    TableSpec,
    Workload,
    collective_count,
    collective_s,
    dp_reduces_dense,
    group_collectives,
    group_key,
    groups_per_rank,
    packing_s,
    replica_s,
    routing_s,
    shard_cost,
    source_cost,
    source_link_s,
)
from recscale.planner.hardware import Hardware
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan
from recscale.sharding.types import SHARDING_TYPES
from recscale.comm.process_group import Topology


@dataclass
class Placement:
    spec: TableSpec
    sharding_type: str
    shards: list[Shard]
    costs: list[ShardCost]

    @property
    def table(self) -> str:
        return self.spec.name


@dataclass
class RankLoad:
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0
    tables: list[str] = field(default_factory=list)
    contention_s: float = 0.0  # slowdown from other ranks of the host computing at the same time

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s + self.contention_s


@dataclass
class PlanResult:
    method: str
    plan: ShardingPlan
    ranks: list[RankLoad]
    common_s: float  # paid by every rank alike
    seconds: float = 0.0  # planning time
    note: str = ""  # a choice the planner made that the numbers alone do not show
    search_steps: int = 0  # re-placements the local search tried (deterministic)
    # The safety time limit stopped the search before its step budget: another run (another
    # machine, or this one under another load) may return another plan.
    cut_by_time_limit: bool = False

    @property
    def reproducible(self) -> bool:
        return not self.cut_by_time_limit

    def search_record(self) -> dict[str, object]:
        """What a plan file and a training summary say about the search that made the plan."""
        return {"method": self.method, "search_steps": self.search_steps, "reproducible": self.reproducible}

    @property
    def max_rank_s(self) -> float:
        return max(r.time_s for r in self.ranks) + self.common_s

    @property
    def imbalance(self) -> float:
        times = [r.time_s + self.common_s for r in self.ranks]
        return max(times) / (sum(times) / len(times))


class _Loads:
    """Per-rank times and memory of a partial plan, and what every rank pays alike for it (the
    exchanges, packing, one latency per collective): the search's objective is the slowest
    rank plus ``common``, the model's step time less terms no plan changes."""

    def __init__(self, hw: Hardware, wl: Workload, collectives: bool = True) -> None:
        self.hw, self.wl = hw, wl
        # Whether the objective counts collectives. The first column shard or data-parallel
        # group of a dim adds several to every rank, later ones none: a search that counts them
        # while moving one table at a time cannot reach plans whose fixed cost only many tables
        # repay, so the planner searches without them first, then with them (``plan_tables``).
        self.collectives = collectives
        self.time = [0.0] * hw.world_size
        self.mem = [0.0] * hw.world_size
        self.cap = hw.memory_bytes
        self.per_collective = collective_s(hw)
        self.per_replica_collective = collective_s(hw, replica=True)
        self.exchange = 0.0  # link time and packing of the placed tables
        # What decides the number of collectives: tables that are not data-parallel, column
        # shards, table-row-wise tables, and per dim the [gathered, dense] data-parallel tables.
        self.distributed = self.column_wise = self.table_row_wise = 0
        self.groups: dict[int, list[int]] = {}
        # Per rank, its shards per operator group (``group_key``): a rank pays ``group_s`` for
        # each group it runs, whatever the group holds, so it is in ``time`` once per group.
        self.rank_groups: list[dict[tuple[int, int, bool], int]] = [{} for _ in range(hw.world_size)]
        self._dense: dict[str, bool] = {}  # data-parallel tables whose gradients the runtime reduces densely
        # Options that keep every touched rank under ``floor`` (a lower bound on the final
        # slowest rank) are equally good for the maximum, so the cheapest in total wins:
        # tables are not split over ranks before the load requires it.
        self.floor = 0.0

    def fits(self, rank: int, nbytes: float) -> bool:
        return self.mem[rank] + nbytes <= self.cap

    @property
    def common(self) -> float:
        return self.exchange + self._latency()

    def apply(self, p: Placement, sign: float = 1.0) -> None:
        for s, c in zip(p.shards, p.costs):
            self.time[s.rank] += sign * c.time_s
            self.mem[s.rank] += sign * c.memory_bytes
            if p.sharding_type != "data_parallel":
                counts, key = self.rank_groups[s.rank], group_key(p.spec, p.sharding_type, s.num_cols)
                before = counts.get(key, 0)
                counts[key] = before + int(sign)
                if (before == 0) != (counts[key] == 0):  # a group opened or closed
                    self.time[s.rank] += sign * self.hw.group_s
        self.exchange += sign * self.exchange_of(p)
        self._count(p, int(sign))

    def added(self, p: Placement) -> tuple[float, float]:
        """What placing ``p`` (not placed yet) adds to every rank, and the work it adds over all
        ranks, what each pays alike included."""
        before = self._latency()
        self._count(p, 1)
        after = self._latency()
        self._count(p, -1)
        common = self.exchange_of(p) + after - before
        return common, sum(c.time_s for c in p.costs) + len(self.time) * common

    def exchange_of(self, p: Placement) -> float:
        """``p``'s link time, packing and routing, paid by every rank."""
        return _exchange_s(p.spec, p.sharding_type, p.costs, self.hw, self.wl)

    def new_groups_s(self, p: Placement) -> dict[int, float]:
        """Per rank, the ``group_s`` that placing ``p`` (not placed yet) adds: its shards that
        open a group there."""
        if p.sharding_type == "data_parallel" or not self.hw.group_s:
            return {}
        opened = {(s.rank, group_key(p.spec, p.sharding_type, s.num_cols)) for s in p.shards}
        out: dict[int, float] = {}
        for rank, key in opened:
            if not self.rank_groups[rank].get(key):
                out[rank] = out.get(rank, 0.0) + self.hw.group_s
        return out

    def _count(self, p: Placement, sign: int) -> None:
        if p.sharding_type == "data_parallel":
            dense = self._dense.get(p.table)
            if dense is None:
                dense = self._dense[p.table] = dp_reduces_dense(p.spec, self.hw, self.wl)
            self.groups.setdefault(p.spec.dim, [0, 0])[int(dense)] += sign
            return
        self.distributed += sign
        self.column_wise += sign * (p.sharding_type == "column_wise")
        self.table_row_wise += sign * (p.sharding_type == "table_row_wise")

    def _latency(self) -> float:
        """The fixed costs every rank pays: one latency per collective, ``group_s`` per
        data-parallel operator group."""
        if not self.collectives:
            return 0.0
        groups = [(g > 0, d > 0) for g, d in self.groups.values() if g or d]
        if not self.distributed and not groups:
            return 0.0
        n = collective_count(self.distributed > 0, groups, self.column_wise > 0,
                             self.hw.num_hosts > 1 and self.table_row_wise > 0)
        replica = group_collectives(groups)
        return (n - replica) * self.per_collective + replica * self.per_replica_collective + len(groups) * self.hw.group_s


def _exchange_s(t: TableSpec, sharding_type: str, costs: list[ShardCost], hw: Hardware, wl: Workload) -> float:
    """What an option of ``t`` costs every rank alike: link time (a row split sends every
    source a partial output per shard, which no single rank's load shows), packing, routing."""
    link = sum(c.source_bytes for c in costs) * source_link_s(1.0, hw)
    if sharding_type == "data_parallel":
        return link
    return link + packing_s(t, hw, wl) + routing_s(sharding_type, hw)


def option_work(t: TableSpec, hw: Hardware, wl: Workload) -> list[tuple[str, list[tuple[int, int, int, int]], float]]:
    """The planner's options for ``t`` as (type, [(row_offset, rows, col_offset, cols)], total
    work over all ranks): its shards' time plus W times what it adds to every rank's exchange.
    Balance cannot lower it: a plan's slowest rank plus what every rank pays alike is at least
    its tables' total work over W plus the fixed costs, whatever the placement."""
    out = []
    for kind, rects in _templates(t, hw):
        costs = _rect_costs(t, kind, rects, hw, wl)
        out.append((kind, rects, sum(c.time_s for c in costs) + hw.world_size * _exchange_s(t, kind, costs, hw, wl)))
    return out


def _templates(t: TableSpec, hw: Hardware) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
    """(type, [(row_offset, rows, col_offset, cols)]) options for one table: each sharding
    type's own candidate layouts."""
    topology = Topology(hw.world_size, 0, hw.ranks_per_host)
    return [(name, list(rects)) for name, kind in SHARDING_TYPES.items()
            for rects in kind.candidate_layouts(t.rows, t.dim, topology)]


def _rect_costs(t: TableSpec, kind: str, rects, hw: Hardware, wl: Workload) -> list[ShardCost]:
    """Each shard's cost, computed once per shard shape (W equal data-parallel replicas, even
    splits)."""
    by_shape: dict[tuple[int, int], ShardCost] = {}
    for _, rows, _, cols in rects:
        if (rows, cols) not in by_shape:
            by_shape[(rows, cols)] = shard_cost(t, kind, rows, cols, hw, wl)
    return [by_shape[(rows, cols)] for _, rows, _, cols in rects]


def _place(t: TableSpec, kind: str, rects, hw: Hardware, wl: Workload, loads: _Loads) -> Placement | None:
    """Place one option's shards on ranks (least loaded where they fit), or None."""
    costs = _rect_costs(t, kind, rects, hw, wl)
    w, r = hw.world_size, hw.ranks_per_host
    if kind == "row_wise":
        ranks = list(range(w))
    elif kind == "data_parallel":
        ranks = list(range(w))
    elif kind == "table_row_wise":
        best = None
        for h in range(hw.num_hosts):
            host = list(range(h * r, (h + 1) * r))
            if all(loads.fits(rk, c.memory_bytes) for rk, c in zip(host, costs)):
                worst = max(loads.time[rk] + c.time_s for rk, c in zip(host, costs))
                if best is None or worst < best[0]:
                    best = (worst, host)
        if best is None:
            return None
        ranks = best[1]
    else:  # table-wise, column-wise: each shard on a different rank, least loaded first
        order = sorted(range(w), key=lambda x: (loads.time[x], x))
        ranks, used = [], set()
        for c in costs:
            rk = next((x for x in order if x not in used and loads.fits(x, c.memory_bytes)), None)
            if rk is None:
                return None
            ranks.append(rk)
            used.add(rk)
    if not all(loads.fits(rk, c.memory_bytes) for rk, c in zip(ranks, costs)):
        return None
    shards = [Shard(rk, ro, rows, co, cols) for rk, (ro, rows, co, cols) in zip(ranks, rects)]
    return Placement(t, kind, shards, costs)


def _score(p: Placement, loads: _Loads, current_max: float) -> tuple[float, float]:
    """(the slowest rank after placing ``p``, plus what it adds to every rank; total work)."""
    touched: dict[int, float] = {}
    for s, c in zip(p.shards, p.costs):
        touched[s.rank] = touched.get(s.rank, loads.time[s.rank]) + c.time_s
    for rank, extra in loads.new_groups_s(p).items():
        touched[rank] += extra
    common, total = loads.added(p)
    return max(current_max, max(touched.values())) + common, total


def _best_option(t: TableSpec, hw: Hardware, wl: Workload, loads: _Loads, allowed: set[str] | None,
                 least_work: bool = False) -> Placement | None:
    current = max(max(loads.time), loads.floor)
    best, best_key = None, None
    for kind, rects in _templates(t, hw):
        if allowed is not None and kind not in allowed:
            continue
        p = _place(t, kind, rects, hw, wl, loads)
        if p is None:
            continue
        key = _score(p, loads, current)
        if least_work:
            key = (key[1], key[0])
        if best_key is None or key < best_key:
            best, best_key = p, key
    return best


def _no_fit_error(unplaced: list[TableSpec], hw: Hardware, loads: _Loads, all_tables: list[TableSpec] | None = None) -> PlanError:
    """Which tables do not fit and by how much, largest first."""
    cap = hw.memory_bytes * hw.world_size
    need = sum(t.bytes for t in (all_tables or unplaced))
    biggest = sorted(unplaced, key=lambda t: -t.bytes)
    free = max(hw.memory_bytes - m for m in loads.mem)
    shown = ", ".join(f"'{t.name}' {t.bytes / 1e9:.2f} GB" for t in biggest[:5])
    more = f" and {len(biggest) - 5} more" if len(biggest) > 5 else ""
    total = (
        f"the model needs {need / 1e9:.1f} GB but {hw.world_size} ranks hold {cap / 1e9:.1f} GB "
        f"({(need - cap) / 1e9:.1f} GB short); "
        if all_tables is not None and need > cap
        else ""
    )
    return PlanError(
        f"no plan fits {hw.world_size} ranks of {hw.memory_bytes / 1e9:.1f} GB: {total}could not place {shown}{more} "
        f"(at most {free / 1e9:.2f} GB free on any rank when they came up); add ranks or memory, or shrink those tables"
    )


def apply_contention(ranks: list[RankLoad], hw: Hardware) -> None:
    """Ranks sharing a host's cores slow each other only while both compute: rank r pays
    ``contention x min(c_r, c_o)`` averaged over the other ranks o of its host. A plan that
    leaves a rank idle thus runs its busy rank at single-rank speed, a balanced one pays the
    full factor (which is what the calibration measures)."""
    r = hw.ranks_per_host
    if hw.contention <= 0 or r < 2:
        return
    for host in range(hw.world_size // r):
        group = ranks[host * r : (host + 1) * r]
        for rl in group:
            overlap = sum(min(rl.compute_s, o.compute_s) for o in group if o is not rl) / (r - 1)
            rl.contention_s = hw.contention * overlap


def _result(method: str, placements: dict[str, Placement], tables: list[TableSpec], hw: Hardware, wl: Workload, t0: float) -> PlanResult:
    ranks = [RankLoad() for _ in range(hw.world_size)]
    for p in placements.values():
        for s, c in zip(p.shards, p.costs):
            rl = ranks[s.rank]
            rl.compute_s += c.compute_s
            rl.comm_s += c.comm_s
            rl.memory_bytes += c.memory_bytes
            if p.table not in rl.tables:
                rl.tables.append(p.table)
    if hw.group_s:  # each rank's operator groups (data-parallel ones are in ``source_cost``)
        sharded = [(s.rank, p.spec, p.sharding_type, s.num_cols)
                   for p in placements.values() if p.sharding_type != "data_parallel" for s in p.shards]
        for rank, n in groups_per_rank(sharded).items():
            ranks[rank].compute_s += n * hw.group_s
    apply_contention(ranks, hw)
    plan = ShardingPlan(
        hw.world_size,
        hw.ranks_per_host,
        tuple(TablePlan(t.name, placements[t.name].sharding_type, tuple(placements[t.name].shards)) for t in tables),  # type: ignore[arg-type]
    )
    kinds = {name: p.sharding_type for name, p in placements.items()}
    source_bytes = sum(c.source_bytes for p in placements.values() for c in p.costs)
    return PlanResult(method, plan, ranks, source_cost(tables, hw, wl, kinds, source_bytes), time.perf_counter() - t0)


def score_plan(plan: ShardingPlan, tables: list[TableSpec], hw: Hardware, wl: Workload, method: str = "given") -> PlanResult:
    """Any plan (a file, another planner's, a default placement) costed by the model."""
    by_name = {t.name: t for t in tables}
    placements = {}
    for tp in plan.tables:
        t = by_name[tp.table]
        costs = [shard_cost(t, tp.sharding_type, s.num_rows, s.num_cols, hw, wl) for s in tp.shards]
        placements[tp.table] = Placement(t, tp.sharding_type, list(tp.shards), costs)
    return _result(method, placements, tables, hw, wl, time.perf_counter())


# How much more than predicted the planner allows replicated tables to cost (see plan_tables).
REPLICA_ERROR = 0.2
# Re-placements the local search may try over all its starts: the plan is a function of the
# inputs alone, never of the machine's speed or load. Typical models (26 tables, 2-128 ranks)
# converge within 400-1,600 steps (a second or two here), and 200 tables on 8 ranks within
# 6,000; it binds on hundreds of tables on many ranks (1,000 on 128: about 1-2 ms a step).
SEARCH_STEPS = 10_000
# Wall-clock seconds after which the search stops whatever its budget: a safety stop only.
# A plan it cuts short says so (``PlanResult.cut_by_time_limit``) and is not reproducible.
TIME_LIMIT_S = 60.0


class _Budget:
    """The local search's allowance: ``steps`` re-placements (each a ``_best_option`` call),
    and a wall-clock deadline that only a search far beyond its usual size reaches."""

    def __init__(self, steps: int, deadline: float) -> None:
        self.left, self.deadline = steps, deadline
        self.used = 0
        self.cut = False

    def take(self, limit: int) -> bool:
        """One step, unless this phase has used ``limit`` or the deadline has passed."""
        if self.used >= limit or self.left <= 0:
            return False
        if time.perf_counter() > self.deadline:
            self.cut = True
            return False
        self.used += 1
        self.left -= 1
        return True


def plan_tables(
    tables: list[TableSpec], hw: Hardware, wl: Workload, allowed: set[str] | None = None,
    search_steps: int = SEARCH_STEPS, time_limit_s: float = TIME_LIMIT_S, replica_error: float = REPLICA_ERROR,
) -> PlanResult:
    """The default planner: several starts (greedy over every option with and without the
    average-load floor, greedy by least work, greedy table-wise, greedy without column shards,
    greedy without replicas, greedy table-row-wise on several hosts, every table data-parallel,
    and each baseline that fits), each improved by local search, first blind to the number of
    collectives, then counting them. Starting from every baseline means the result is never
    worse than any of them.

    The search tries at most ``search_steps`` re-placements in all: each start may use its
    share of what the earlier ones left, half before counting collectives, so the plan depends
    on the inputs alone (ties go to the first in a fixed order: tables by name, ranks by
    number). ``time_limit_s`` is a safety stop: if it ends the search first, the result says so
    (``cut_by_time_limit``; its plan may differ from run to run).

    Replicated (data-parallel) tables are where the model errs most, mostly on the fast side:
    measured against real steps (``benchmarks/planner_validation.py``), plans that replicate
    tables take longer than predicted. So of the plans the search
    produced, the planner returns the fastest with every replica's cost raised by
    ``replica_error`` (0.2: 20%); 0 takes the fastest prediction as it is. Replicas must then
    win by more than the model's error on them. (The baselines replicate nothing, so the
    result is still never worse than any of them.)"""
    if not 0.0 <= replica_error < 10.0:
        raise ValueError(
            f"replica_error must be in [0, 10), got {replica_error} (0.2: replicas may cost 20% more than predicted)"
        )
    if search_steps < 0 or not time_limit_s > 0:
        raise ValueError(f"search_steps must be >= 0 and time_limit_s > 0, got {search_steps} and {time_limit_s}")
    t0 = time.perf_counter()
    _check_names(tables)
    kinds = set(allowed) if allowed is not None else set(SHARDING_TYPES)
    # (start subset, floor, subset its local search may use, least work first)
    subsets: list[tuple[set[str], bool, set[str], bool]] = [(kinds, True, kinds, False), (kinds, False, kinds, False)]
    # Each table its option of least work over all ranks (what every rank pays alike for the
    # exchanges included), placed on the least-loaded ranks: replicating many small tables
    # costs each rank a little and saves every rank their exchange, a trade the max-first
    # greedy, table by table, never takes once the ranks are level.
    subsets.append((kinds, False, kinds, True))
    if "table_wise" in kinds:
        subsets.append(({"table_wise"}, False, kinds, False))
        # What these save every rank pays alike, which the per-rank search does not see, so
        # their search keeps to their subset: no column shards (no row-statistic gathers),
        # and on several hosts table-row-wise wherever it beats table-wise (tables with fewer
        # rows than a host has ranks: table-wise or data-parallel).
        if "column_wise" in kinds:
            subsets.append((kinds - {"column_wise"}, True, kinds - {"column_wise"}, False))
        if hw.num_hosts > 1 and "table_row_wise" in kinds:
            hier = {"table_row_wise", "table_wise", "data_parallel"} & kinds
            subsets.append((hier, False, hier, False))
    if "data_parallel" in kinds and hw.world_size > 1 and len(kinds) > 1:
        # Without replicas, searched without them too: a candidate that no replica can put at risk.
        plain = kinds - {"data_parallel"}
        subsets.append((plain, True, plain, False))
    if "data_parallel" in kinds and hw.world_size > 1:
        # Every table replicated, where it fits: no input or output exchange at all, which the
        # per-rank greedy cannot see table by table (the exchange is paid by every rank alike).
        subsets.append(({"data_parallel"}, False, kinds, False))
    starts: list[tuple[dict[str, Placement], set[str]]] = []
    no_fit: PlanError | None = None
    for subset, floor, search, least_work in subsets:
        try:
            starts.append((_greedy(tables, hw, wl, subset, floor=floor, least_work=least_work), search))
        except PlanError as e:
            no_fit = no_fit or e
    for method in BASELINES:
        try:
            starts.append((_baseline_placements(method, tables, hw, wl), kinds))
        except PlanError:
            continue
    if not starts:
        assert no_fit is not None
        raise no_fit
    budget = _Budget(search_steps, t0 + time_limit_s)
    candidates: list[PlanResult] = []
    for i, (placements, search) in enumerate(starts):
        loads = _Loads(hw, wl, collectives=False)
        for p in placements.values():
            loads.apply(p)
        share = budget.left // (len(starts) - i)
        results = [_result("recscale", dict(placements), tables, hw, wl, t0)]
        before = budget.used
        _local_search(tables, placements, loads, hw, wl, search, budget, before + share // 2)
        results.append(_result("recscale", dict(placements), tables, hw, wl, t0))
        loads.collectives = True
        _local_search(tables, placements, loads, hw, wl, search, budget, before + share)
        # Compare on the full step time (contention and per-plan constants included): a start
        # that a search made worse is kept as it was.
        results.append(_result("recscale", placements, tables, hw, wl, t0))
        candidates += results
    best = _allowing_for_replicas(candidates, tables, hw, wl, replica_error)
    best.seconds = time.perf_counter() - t0
    best.search_steps, best.cut_by_time_limit = budget.used, budget.cut
    return best


def _allowing_for_replicas(candidates: list[PlanResult], tables: list[TableSpec], hw: Hardware, wl: Workload,
                           replica_error: float) -> PlanResult:
    """The candidate with the fastest step if its replicas cost ``replica_error`` more than
    predicted (the first of equals: the search's order); its note names the fastest prediction
    when that is another plan."""
    fastest = min(candidates, key=lambda r: r.max_rank_s)

    def risk(r: PlanResult) -> float:
        return replica_error * replica_s(tables, hw, wl, r.plan.sharding_types())

    bound = fastest.max_rank_s + risk(fastest)
    chosen, chosen_score = fastest, bound
    for r in candidates:
        # A plan no faster than the chosen one's score cannot win, whatever its replicas.
        if r is not fastest and r.max_rank_s < chosen_score:
            score = r.max_rank_s + risk(r)
            if score < chosen_score:
                chosen, chosen_score = r, score
    if chosen is not fastest:
        n_fast = sum(tp.sharding_type == "data_parallel" for tp in fastest.plan.tables)
        n = sum(tp.sharding_type == "data_parallel" for tp in chosen.plan.tables)
        chosen.note = (
            f"a plan replicating {n_fast} table(s) predicted {100 * (1 - fastest.max_rank_s / chosen.max_rank_s):.1f}% "
            f"faster, but not if replicas cost {100 * replica_error:g}% more than predicted "
            f"(+{(bound - fastest.max_rank_s) * 1e3:.3f} ms): chose this plan ({n} replicated) instead"
        )
    return chosen


def _greedy(tables: list[TableSpec], hw: Hardware, wl: Workload, allowed: set[str] | None, floor: bool = False,
            least_work: bool = False) -> dict[str, Placement]:
    """Largest tables first, each with the option and ranks that keep the maximum lowest
    (with ``floor``: no lower than the average load of the cheapest options, then cheapest)."""
    loads = _Loads(hw, wl, collectives=False)
    if floor:
        loads.floor = _average_load_bound(tables, hw, wl, allowed)
    placements: dict[str, Placement] = {}
    tw = {t.name: shard_cost(t, "table_wise", t.rows, t.dim, hw, wl).time_s for t in tables}
    unplaced = []
    for t in sorted(tables, key=lambda t: (-tw[t.name], t.name)):
        p = _best_option(t, hw, wl, loads, allowed, least_work)
        if p is None:
            unplaced.append(t)
            continue
        loads.apply(p)
        placements[t.name] = p
    if unplaced:
        raise _no_fit_error(unplaced, hw, loads, tables)
    return placements


def _average_load_bound(tables: list[TableSpec], hw: Hardware, wl: Workload, allowed: set[str] | None) -> float:
    """Sum over tables of their cheapest option's total time, per rank: no plan's slowest rank
    can be faster."""
    total = 0.0
    for t in tables:
        costs = [
            sum(c.time_s for c in _rect_costs(t, kind, rects, hw, wl))
            for kind, rects in _templates(t, hw)
            if allowed is None or kind in allowed
        ]
        total += min(costs) if costs else 0.0
    return total / hw.world_size


def _local_search(tables, placements, loads: _Loads, hw, wl, allowed, budget: _Budget, limit: int) -> None:
    """Re-place the tables of the slowest rank while that lowers the maximum rank time (plus
    what every rank pays alike for the exchanges), until ``budget`` has used ``limit`` steps.
    Ties go to the lowest rank and, among equally loaded tables, the first name."""
    by_name = {t.name: t for t in tables}
    tabu: set[tuple[str, float]] = set()
    for _ in range(20 * len(tables) + 100):
        worst = max(range(hw.world_size), key=lambda r: loads.time[r])
        current = loads.time[worst] + loads.common
        names = sorted(
            {p.table for p in placements.values() for s in p.shards if s.rank == worst},
            key=lambda n: (-sum(c.time_s for s, c in zip(placements[n].shards, placements[n].costs) if s.rank == worst), n),
        )
        improved = False
        for name in names:
            if not budget.take(limit):
                return
            old = placements[name]
            loads.apply(old, -1.0)
            new = _best_option(by_name[name], hw, wl, loads, allowed)
            if new is not None:
                less_work = loads.added(new)[1] < loads.added(old)[1] * (1 - 1e-9)
                loads.apply(new)
                new_max = max(loads.time) + loads.common
                # Lower the maximum, or keep it and do less work in total (e.g. merge a split
                # table), which frees room for later moves when several ranks tie at the top.
                better = new_max < current - 1e-12 or (new_max <= current + 1e-12 and less_work)
                if better and (name, round(new_max, 15), round(sum(loads.time), 12)) not in tabu:
                    placements[name] = new
                    tabu.add((name, round(new_max, 15), round(sum(loads.time), 12)))
                    improved = True
                    break
                loads.apply(new, -1.0)
            loads.apply(old)
        if not improved and not _exchange_pass(by_name, placements, loads, hw, wl, allowed, budget, limit):
            return


def _exchange_pass(by_name, placements, loads: _Loads, hw, wl, allowed, budget: _Budget, limit: int) -> bool:
    """Re-place any table, those with the most exchange first, where that lowers the slowest
    rank plus what every rank pays alike: replicating a table that is not on the slowest rank
    can add less to it than the exchange it saves every rank, a move the search of the
    slowest rank's tables never tries."""
    improved = False
    for name in sorted(placements, key=lambda n: (-loads.exchange_of(placements[n]), n)):
        old = placements[name]
        if loads.exchange_of(old) <= 0.0 or not budget.take(limit):
            break
        current = max(loads.time) + loads.common
        loads.apply(old, -1.0)
        new = _best_option(by_name[name], hw, wl, loads, allowed)
        if new is not None:
            loads.apply(new)
            if max(loads.time) + loads.common < current - 1e-12:
                placements[name] = new
                improved = True
                continue
            loads.apply(new, -1.0)
        loads.apply(old)
    return improved


# ---------------------------------------------------------------------- baselines
PROXIES: dict[str, Callable[[TableSpec], float]] = {
    "greedy_size": lambda t: float(t.rows * t.dim),
    "greedy_dim": lambda t: float(t.dim),
    "greedy_dim_pooling": lambda t: t.dim * max(t.pooling, 1e-9),
    "greedy_dim_pooling_log_rows": lambda t: t.dim * max(t.pooling, 1e-9) * math.log10(max(t.rows, 10)),
}
BASELINES = (*PROXIES, "karmarkar_karp")


def baseline_plan(method: str, tables: list[TableSpec], hw: Hardware, wl: Workload) -> PlanResult:
    """Table-wise placement by a Meta baseline, scored by the cost model."""
    t0 = time.perf_counter()
    _check_names(tables)
    return _result(method, _baseline_placements(method, tables, hw, wl), tables, hw, wl, t0)


def _baseline_placements(method: str, tables: list[TableSpec], hw: Hardware, wl: Workload) -> dict[str, Placement]:
    loads = _Loads(hw, wl)
    if method in PROXIES:
        proxy = PROXIES[method]
        weight = [0.0] * hw.world_size
        ranks: dict[str, int] = {}
        for t in sorted(tables, key=lambda t: (-proxy(t), t.name)):
            cands = [r for r in range(hw.world_size) if loads.fits(r, t.bytes)]
            if not cands:
                raise _no_fit_error([t], hw, loads)
            r = min(cands, key=lambda x: (weight[x], x))
            weight[r] += proxy(t)
            loads.mem[r] += t.bytes
            ranks[t.name] = r
    elif method == "karmarkar_karp":
        cost = {t.name: shard_cost(t, "table_wise", t.rows, t.dim, hw, wl).time_s for t in tables}
        ranks = _karmarkar_karp(cost, hw.world_size)
        for t in tables:
            loads.mem[ranks[t.name]] += t.bytes
        over = [r for r in range(hw.world_size) if loads.mem[r] > hw.memory_bytes]
        if over:
            raise PlanError(f"karmarkar_karp: ranks {over} exceed {hw.memory_bytes / 1e9:.1f} GB (it ignores memory)")
    else:
        raise ValueError(f"unknown baseline '{method}'; choose one of {list(BASELINES)}")
    placements = {}
    for t in tables:
        c = shard_cost(t, "table_wise", t.rows, t.dim, hw, wl)
        placements[t.name] = Placement(t, "table_wise", [Shard(ranks[t.name], 0, t.rows, 0, t.dim)], [c])
    return placements


def _karmarkar_karp(weights: dict[str, float], k: int) -> dict[str, int]:
    """Multiway largest differencing: merge the two partitions with the largest spread,
    pairing heavy subsets with light ones, until one k-way partition remains."""
    heap = []
    for i, (name, w) in enumerate(sorted(weights.items())):
        subsets = [[name]] + [[] for _ in range(k - 1)]
        sums = [w] + [0.0] * (k - 1)
        heapq.heappush(heap, (-(max(sums) - min(sums)), i, sums, subsets))
    counter = len(heap)
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        o1 = sorted(range(k), key=lambda j: -s1[j])
        o2 = sorted(range(k), key=lambda j: s2[j])
        sums = [s1[a] + s2[b] for a, b in zip(o1, o2)]
        subsets = [p1[a] + p2[b] for a, b in zip(o1, o2)]
        low = min(sums)
        sums = [s - low for s in sums]
        counter += 1
        heapq.heappush(heap, (-(max(sums) - min(sums)), counter, sums, subsets))
    _, _, _, subsets = heap[0]
    return {name: r for r, names in enumerate(subsets) for name in names}


def _check_names(tables: list[TableSpec]) -> None:
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise PlanError("table names must be unique")
