"""Row-wise: rows range-split over every rank.

Ids are bucketized by row range and rebased; each rank returns partial pooled sums, which the
source rank adds up (a reduce-scatter, written as all-to-all plus a local sum for gloo).
"""

from __future__ import annotations

import torch

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig, native
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import FeatureIds, Rect, ShardingType, even_split, require_full_width, row_shards


class RowWise(ShardingType):
    name = "row_wise"
    routes_by_row = True

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        world = topology.world_size
        if num_rows < world or world < 2:
            return []
        return [[(row, rows, 0, dim) for row, rows in even_split(num_rows, world)]]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        return row_shards(table, list(range(topology.world_size)), loads)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_width(table_plan, table)

    def route_ids(self, table_plan: TablePlan, table: TableConfig, row_bounds: torch.Tensor,
                  ids: dict[str, FeatureIds], batch_size: int) -> dict[tuple[int, str], FeatureIds]:
        routed = {}
        b, n_shards = batch_size, len(table_plan.shards)
        for f in table.features:
            if f not in ids:
                continue
            vals, lens, w = ids[f]
            shard_of = torch.searchsorted(row_bounds, vals, right=True) - 1
            sample_of = torch.repeat_interleave(torch.arange(b, device=vals.device), lens, output_size=vals.numel())
            counts = torch.bincount(shard_of * b + sample_of, minlength=n_shards * b).view(n_shards, b)
            order = native.stable_argsort(shard_of)
            sorted_vals = vals[order] - row_bounds[shard_of[order]]
            sorted_w = None if w is None else w[order]
            per_shard = counts.sum(1).tolist()
            start = 0
            for i, s in enumerate(table_plan.shards):
                n = per_shard[i]
                routed[(s.row_offset, f)] = (
                    sorted_vals[start : start + n],
                    counts[i],
                    None if sorted_w is None else sorted_w[start : start + n],
                )
                start += n
        return routed
