"""Data-parallel: a whole replica on every rank; lookups stay local, and the row gradients
of all ranks are combined (``replica_gradients.py``) before the same fused optimizer updates
every replica alike."""

from __future__ import annotations

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType


class DataParallel(ShardingType):
    name = "data_parallel"
    replicated = True

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        if topology.world_size < 2:
            return []
        return [[(0, num_rows, 0, dim)] * topology.world_size]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        for r in range(topology.world_size):
            loads[r] += table.num_rows * table.dim
        return tuple(Shard(r, 0, table.num_rows, 0, table.dim) for r in range(topology.world_size))

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        if sorted(s.rank for s in table_plan.shards) != list(range(plan.world_size)) or any(
            (s.num_rows, s.num_cols) != (table.num_rows, table.dim) for s in table_plan.shards
        ):
            raise PlanError(f"table '{table.name}': data_parallel needs a whole copy on every rank")
