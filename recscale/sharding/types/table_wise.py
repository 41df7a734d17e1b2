"""Table-wise: the whole table on the least-loaded rank; its ids all-to-all to that owner, its
pooled output comes back whole."""

from __future__ import annotations

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType, least_loaded, require_full_height


class TableWise(ShardingType):
    name = "table_wise"

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        return [[(0, num_rows, 0, dim)]]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        rank = least_loaded(loads)
        loads[rank] += table.num_rows * table.dim
        return (Shard(rank, 0, table.num_rows, 0, table.dim),)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_height(table_plan, table)
