"""Column-wise: the embedding dim split into column shards, each placed like a table.

Every shard receives all ids of the table; the source rank places each shard's columns. With an
optimizer that keeps one statistic per whole row (row-wise Adagrad), the shards of a table
exchange their columns' share of it in backward (``column_row_stat.py``), so that every shard
updates as the whole table would.
"""

from __future__ import annotations

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType, TypeRuntime, even_split, least_loaded, require_full_height


class ColumnWise(ShardingType):
    name = "column_wise"

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        # Powers of two up to the world size, no shard narrower than 4 columns.
        out, parts = [], 2
        while parts <= min(topology.world_size, dim // 4 if dim >= 8 else 1):
            out.append([(0, num_rows, col, cols) for col, cols in even_split(dim, parts)])
            parts *= 2
        return out

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        parts = num_shards or min(topology.world_size, table.dim)
        shards, used = [], []
        for col, cols in even_split(table.dim, parts):
            free = [r for r in range(topology.world_size) if r not in used] or list(range(topology.world_size))
            rank = least_loaded(loads, free)
            used.append(rank)
            loads[rank] += table.num_rows * cols
            shards.append(Shard(rank, 0, table.num_rows, col, cols))
        return tuple(shards)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_height(table_plan, table)
