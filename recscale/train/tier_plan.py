"""Which tables go to the SSD tier and how large each cache is, chosen on miss-ratio curves.

Each table's id distribution (the synthetic generator's Zipf law, or the prepared data's
``stats.json``) gives its predicted hit rate at every cache size (``recscale.planner.miss_curve``).
A miss costs ``miss_seconds``: the row is read, and, the step updating it, written back when
evicted. With ``tiers.ram_budget_mb``, every table not listed in ``[tiers.tables]`` starts with
the smallest cache that holds one batch's distinct rows; the budget left is then given out
greedily where it saves the most predicted I/O seconds per byte, along the upper concave hull
of each table's curve (so the marginal saving per byte ends up about equal across tables), a
table's last step being to hold all its rows in RAM. Tables still on the tier that then fit
whole in what is left go to RAM. Explicit ``placement`` and ``cache_rows`` win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from recscale.embedding import SparseOptimizer, TableConfig, make_optimizer
from recscale.planner.feature_stats import loads_from_ids, loads_from_prepared
from recscale.planner.miss_curve import RowAccess, segments_access, zipf_access
from recscale.train.config import Config, ConfigError, TiersConfig
from recscale.train.datasets import DataSplits

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

# A miss reads the row's record from the tier file, and the step updates the row, so its
# eviction writes it back: two random page accesses. The prefetch keeps many reads in flight,
# so the disk's random-access rate at queue depth 32 bounds it (at depth 1 it is several times
# lower); 200,000 4 KiB operations per second is a data-centre NVMe SSD's figure
# (benchmarks/tiers.py measures this disk's).
SSD_PAGE_OPS_PER_S = 200_000.0
PAGE_BYTES = 4096
_GRID = 40  # cache sizes evaluated per table, geometric from the smallest to the whole table


def row_bytes(table: TableConfig, optimizer: SparseOptimizer) -> int:
    """RAM one row takes: its weights plus its optimizer state."""
    return table.dim * _ELEMENT_BYTES[table.dtype] + 4 * sum(optimizer.state_columns(table.dim).values())


def miss_seconds(record_bytes: int) -> float:
    """Predicted disk time of one miss: a read and a later write-back of the row's pages."""
    return 2 * math.ceil(record_bytes / PAGE_BYTES) / SSD_PAGE_OPS_PER_S


@dataclass(frozen=True)
class TablePlacement:
    """One table's tier, cache and predictions (steady state: a long run)."""

    table: str
    tier: str  # "ram" or "ssd"
    cache_rows: int  # 0 for RAM
    ram_bytes: int
    predicted_hit_rate: float  # 1.0 for RAM
    lookups_per_batch: float  # distinct rows per batch
    io_seconds_per_step: float  # predicted disk time of its misses


@dataclass(frozen=True)
class TierPlan:
    tables: tuple[TablePlacement, ...]
    policy: str
    budget_bytes: int

    def placement(self) -> dict[str, tuple[str, int]]:
        return {t.table: (t.tier, t.cache_rows) for t in self.tables}

    def io_seconds_per_step(self) -> float:
        return sum(t.io_seconds_per_step for t in self.tables)

    def predicted_hit_rate(self) -> float:
        """Over the SSD-placed tables, weighted by their lookups (as ``cache_hit_rate``)."""
        ssd = [t for t in self.tables if t.tier == "ssd"]
        total = sum(t.lookups_per_batch for t in ssd)
        return sum(t.predicted_hit_rate * t.lookups_per_batch for t in ssd) / total if total else 1.0

    def table_text(self) -> str:
        """Per table: tier, cache rows, RAM, predicted hit rate and disk time; then totals."""
        header = f"{'table':<16} {'tier':>4} {'cache rows':>12} {'RAM MiB':>10} {'lookups/batch':>13} {'pred. hit':>9} {'disk ms/step':>12}"
        lines = [header, "-" * len(header)]
        for t in self.tables:
            cache = f"{t.cache_rows:,}" if t.tier == "ssd" else "-"
            hit = f"{t.predicted_hit_rate:.3f}" if t.tier == "ssd" else "-"
            lines.append(f"{t.table:<16} {t.tier:>4} {cache:>12} {t.ram_bytes / 2**20:>10.1f} {t.lookups_per_batch:>13.0f} "
                         f"{hit:>9} {t.io_seconds_per_step * 1e3:>12.3f}")
        used = sum(t.ram_bytes for t in self.tables)
        lines.append(f"RAM {used / 2**20:.1f} of {self.budget_bytes / 2**20:.0f} MiB; policy {self.policy}; predicted hit rate "
                     f"{self.predicted_hit_rate():.3f}; predicted disk time {self.io_seconds_per_step() * 1e3:.3f} ms/step "
                     f"at {SSD_PAGE_OPS_PER_S:,.0f} random 4 KiB accesses/s (steady state)")
        return "\n".join(lines)


def _uniform(table: TableConfig) -> RowAccess:
    return RowAccess(np.array([float(table.num_rows)]), np.array([1.0 / table.num_rows]), 256.0)


def plan_tiers(tiers: TiersConfig, tables: list[TableConfig], optimizer: SparseOptimizer,
               access: dict[str, RowAccess] | None = None) -> TierPlan:
    """The tier of every table and each SSD table's cache (see the module doc). ``access``:
    each table's id distribution; a table without one is taken as uniform."""
    names = {t.name for t in tables}
    for name in tiers.tables:
        if name not in names:
            raise ConfigError(f"config key 'tiers.tables.{name}': no such table; tables are {', '.join(sorted(names))}")
    access = access or {}
    budget = tiers.ram_budget_mb * 2**20
    by_name = {t.name: t for t in tables}
    acc = {t.name: access.get(t.name) or _uniform(t) for t in tables}
    rb = {t.name: row_bytes(t, optimizer) for t in tables}
    cost = {t.name: miss_seconds(rb[t.name]) for t in tables}
    choice: dict[str, tuple[str, int]] = {}
    free: list[str] = []  # sized here: may end in RAM
    ssd_only: list[str] = []  # listed on the SSD tier without cache_rows
    for t in tables:
        e = tiers.tables.get(t.name)
        if e is None:
            if budget:
                free.append(t.name)
            else:
                choice[t.name] = ("ram", 0)
        elif e.placement == "ram":
            choice[t.name] = ("ram", 0)
        elif e.cache_rows:
            choice[t.name] = ("ssd", min(e.cache_rows, t.num_rows))
        elif not budget:
            raise ConfigError(f"table '{t.name}' is on the SSD tier but no RAM is left for its cache; raise "
                              f"tiers.ram_budget_mb or set tiers.tables.{t.name}.cache_rows")
        else:
            ssd_only.append(t.name)

    def used(name: str, where: str, rows: int) -> int:
        return (by_name[name].num_rows if where == "ram" else rows) * rb[name]

    left = budget - sum(used(n, *c) for n, c in choice.items())
    sized = free + ssd_only
    start = {n: min(acc[n].min_cache_rows(), by_name[n].num_rows) for n in sized}
    need = sum(start[n] * rb[n] for n in sized)
    if sized and need > left:
        first = sized[0]
        raise ConfigError(
            f"table '{first}' is on the SSD tier but no RAM is left for its cache: the SSD tables' smallest caches "
            f"(one batch's distinct rows each) need {need / 2**20:.1f} MiB and {max(left, 0) / 2**20:.1f} MiB of the "
            f"{budget / 2**20:.0f} MiB budget is left after the RAM-placed tables and explicit caches; "
            f"raise tiers.ram_budget_mb or set tiers.tables.{first}.cache_rows"
        )
    left -= need
    segments = []
    for n in sized:
        segments += _hull_segments(n, acc[n], tiers.policy, start[n], by_name[n].num_rows, rb[n], cost[n], n in free)
    segments.sort(key=lambda s: (-s[0], s[1], s[2]))
    rows_of = {n: by_name[n].num_rows for n in sized}

    def saved(at: dict[str, int]) -> float:
        return sum(acc[n].lookups_per_batch() * cost[n] * (1.0 if at[n] > rows_of[n] else acc[n].hit_rate(tiers.policy, at[n]))
                   for n in sized)

    # Along the hulls by saving per byte. The first step that does not fit either takes the
    # budget left as a larger cache (and ends), or is skipped with its table's later steps while
    # the others go on; whichever the curves say saves more.
    best: tuple[float, dict[str, int], int] | None = None
    for skip in (False, True):
        at, left_now, blocked = dict(start), left, []
        for slope, n, _, c_to, dx in segments:
            if slope <= 0 or left_now <= 0:
                break
            if n in blocked:
                continue
            if dx <= left_now:
                at[n], left_now = c_to, left_now - dx
                continue
            if skip:
                blocked.append(n)
                continue
            grow = max(min(int(left_now // rb[n]), rows_of[n] - at[n]), 0)
            at[n], left_now = at[n] + grow, left_now - grow * rb[n]
            break
        for n in blocked:  # what the skipped steps leave: larger caches, in the order skipped
            grow = max(min(int(left_now // rb[n]), rows_of[n] - at[n]), 0)
            at[n], left_now = at[n] + grow, left_now - grow * rb[n]
        value = saved(at)
        if best is None or value > best[0] * (1 + 1e-12):
            best = (value, at, left_now)
    assert best is not None
    _, at, left = best
    # What is left moves whole tables to RAM, the cheapest first: no tier file, no I/O at all.
    for n in sorted(free, key=lambda n: ((by_name[n].num_rows - min(at[n], by_name[n].num_rows)) * rb[n], n)):
        extra = (by_name[n].num_rows - min(at[n], by_name[n].num_rows)) * rb[n]
        if at[n] <= by_name[n].num_rows and extra <= left:
            at[n], left = by_name[n].num_rows + 1, left - extra
    for n in sized:
        choice[n] = ("ram", 0) if at[n] > by_name[n].num_rows else ("ssd", at[n])
    out = []
    for t in tables:
        where, rows = choice[t.name]
        a = acc[t.name]
        hit = 1.0 if where == "ram" else a.hit_rate(tiers.policy, rows, 0, tiers.lookahead_batches)
        lookups = a.lookups_per_batch()
        out.append(TablePlacement(t.name, where, rows, used(t.name, where, rows), hit, lookups,
                                  0.0 if where == "ram" else lookups * (1 - hit) * cost[t.name]))
    return TierPlan(tuple(out), tiers.policy, budget)


def _hull_segments(name: str, acc: RowAccess, policy: str, c0: int, num_rows: int, rb: int, cost: float,
                   may_be_ram: bool) -> list[tuple[float, str, int, int, int]]:
    """(saved seconds per byte, table, order, cache rows after, bytes) of each step along the
    upper concave hull of the table's saving curve from ``c0`` (``num_rows + 1``: in RAM)."""
    lookups = acc.lookups_per_batch()
    seen = math.ceil(acc.seen_rows())  # where the steady-state curve reaches 1: a kink
    cs = sorted({c0, seen, *np.round(np.geomspace(max(c0, 1), num_rows, _GRID)).astype(int).tolist(), num_rows})
    cs = [c for c in cs if c0 <= c <= num_rows]
    pts = [(c * rb, lookups * acc.hit_rate(policy, c) * cost, c) for c in cs]
    if may_be_ram:
        pts.append((num_rows * rb + 1, lookups * cost, num_rows + 1))  # a byte more than the cache: RAM wins ties
    hull: list[tuple[float, float, int]] = []
    for p in pts:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:
            hull.pop()
        hull.append(p)
    return [((b[1] - a[1]) / (b[0] - a[0]), name, i, b[2], b[0] - a[0]) for i, (a, b) in enumerate(zip(hull, hull[1:]))]


def _cross(o, a, b) -> float:
    """> 0: ``a`` lies below the line from ``o`` to ``b`` (not on the upper hull)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def table_access(cfg: Config, tables: list[TableConfig], data: DataSplits | None = None) -> dict[str, RowAccess]:
    """Each table's id distribution and ids per batch: the synthetic generator's Zipf law and
    pooling, or the prepared data's ``stats.json`` (a Criteo file: its ids), ``data`` being the
    job's data when already built."""
    d, batch = cfg.data, cfg.train.batch_size
    feature = {t.name: t.features[0] if t.features else t.name.removeprefix("t_") for t in tables}
    if d.source == "synthetic":
        pf = list(d.pooling_factors or [1])

        def pooling(f: str) -> float:  # features are s0, s1, ...: one factor for all, or one each
            i = int(f[1:]) if f[1:].isdigit() else 0
            return float(pf[i] if len(pf) > 1 and i < len(pf) else pf[0])

        return {t.name: zipf_access(t.num_rows, d.zipf_alpha, batch * pooling(feature[t.name])) for t in tables}
    from recscale.train.datasets import build_data

    data = data if data is not None else build_data(cfg)
    try:
        loads = loads_from_prepared(data.stats_dir) if data.stats_dir else loads_from_ids(data.sparse_names, data.train_ids)
    except ValueError as e:
        raise ConfigError(f"config key 'data.train_path': {e}") from None
    out = {}
    for t in tables:
        load = loads.get(feature[t.name])
        if load is not None:
            out[t.name] = segments_access(load.id_segments(), t.num_rows, batch * load.pooling)
    return out


def config_tables(cfg: Config, data: DataSplits | None = None) -> tuple[list[TableConfig], SparseOptimizer]:
    """The job's tables and embedding optimizer as the trainer builds them (for planning
    without building the model)."""
    from recscale.train.planning import table_specs

    specs = table_specs(cfg, data)
    tables = [TableConfig(s.name, s.rows, cfg.model.embedding_dim, features=(s.name.removeprefix("t_"),),
                          dtype=cfg.model.embedding_dtype) for s in specs]
    return tables, make_optimizer(cfg.embedding_optimizer.name, lr=cfg.embedding_optimizer.lr)


def predicted_tier_summary(cfg: Config, embeddings: torch.nn.Module, data: DataSplits | None, steps: int) -> dict[str, float]:
    """``predicted_cache_hit_rate``: the miss-ratio curves' prediction of ``cache_hit_rate``
    for the caches the job runs with, over ``steps`` batches from empty caches; {} without a tier."""
    from recscale.embedding.tier_hooks import tiered_storages

    segs = [seg for _, st in tiered_storages(embeddings) for seg in st.segments]
    if not segs:
        return {}
    acc = table_access(cfg, [s.table for s in segs], data)
    hits = lookups = 0.0
    for s in segs:
        a = acc.get(s.table.name) or _uniform(s.table)
        n = a.lookups_per_batch()
        hits += n * a.hit_rate(cfg.tiers.policy, s.slots, max(steps, 1), cfg.tiers.lookahead_batches)
        lookups += n
    return {"predicted_cache_hit_rate": hits / lookups if lookups else 1.0}
