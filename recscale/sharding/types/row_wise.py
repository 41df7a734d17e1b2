"""Row-wise: rows range-split over every rank.

Ids are bucketized by row range and rebased; each rank returns partial pooled sums, which the
source rank adds up (a reduce-scatter, written as all-to-all plus a local sum for gloo).
"""

from __future__ import annotations

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType, even_split, require_full_width


class RowWise(ShardingType):
    name = "row_wise"
    routes_by_row = True

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        world = topology.world_size
        if num_rows < world or world < 2:
            return []
        return [[(row, rows, 0, dim) for row, rows in even_split(num_rows, world)]]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        shards = []
        for rank, (row, rows) in enumerate(even_split(table.num_rows, topology.world_size)):
            loads[rank] += rows * table.dim
            shards.append(Shard(rank, row, rows, 0, table.dim))
        return tuple(shards)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_width(table_plan, table)
