"""A simple default placement: a default type for every table, per-table overrides, and the
largest tables placed first on the least-loaded rank. (The cost-model planner is separate.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, ShardingTypeName, TablePlan
from recscale.sharding.types import SHARDING_TYPES


@dataclass(frozen=True)
class TableSharding:
    """A per-table choice: its type, and for column-wise the number of column shards (0 = auto)."""

    type: ShardingTypeName
    shards: int = 0


def default_plan(
    tables: list[TableConfig],
    topology: Topology,
    default: ShardingTypeName = "table_wise",
    overrides: Mapping[str, TableSharding] | None = None,
) -> ShardingPlan:
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {t.name for t in tables})
    if unknown:
        raise PlanError(f"sharding overrides name unknown tables {unknown}; known: {[t.name for t in tables]}")
    if default not in SHARDING_TYPES:
        raise PlanError(f"default sharding type {default!r} is unknown; expected one of {list(SHARDING_TYPES)}")
    loads = [0.0] * topology.world_size
    placed: dict[str, TablePlan] = {}
    for t in sorted(tables, key=lambda t: (-t.num_rows * t.dim, t.name)):
        choice = overrides.get(t.name, TableSharding(default))
        if choice.type == "column_wise" and choice.shards > t.dim:
            raise PlanError(f"table '{t.name}': {choice.shards} column shards exceed its dim {t.dim}")
        shards = SHARDING_TYPES[choice.type].make_shards(t, topology, loads, choice.shards)
        placed[t.name] = TablePlan(t.name, choice.type, shards)
    plan = ShardingPlan(topology.world_size, topology.ranks_per_host, tuple(placed[t.name] for t in tables))
    plan.validate(tables)
    return plan


def single_rank_plan(tables: list[TableConfig], topology: Topology, rank: int = 0) -> ShardingPlan:
    """Every table whole on one rank, the others idle (for measuring contention and exchanges)."""
    return ShardingPlan(
        topology.world_size,
        topology.ranks_per_host,
        tuple(TablePlan(t.name, "table_wise", (Shard(rank, 0, t.num_rows, 0, t.dim),)) for t in tables),
    )
