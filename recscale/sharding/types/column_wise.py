"""Column-wise: the embedding dim split into column shards, each placed like a table.

Every shard receives all ids of the table; the source rank places each shard's columns. With an
optimizer that keeps one statistic per whole row (row-wise Adagrad), the shards of a table
exchange their columns' share of it in backward (``ColumnShardRowStat``), so that every shard
updates as the whole table would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recscale.comm.collectives import all_gather_rows
from recscale.comm.process_group import Topology
from recscale.embedding import SparseOptimizer, TableConfig
from recscale.embedding.table_batched import row_gradients
from recscale.sharding.context import shard_table_name
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType, TypeRuntime, even_split, least_loaded, require_full_height

if TYPE_CHECKING:
    from recscale.sharding.context import ShardingContext, StepContext


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

    def groups_apart(self, table_plan: TablePlan, optimizer: SparseOptimizer) -> bool:
        # Row-wise Adagrad's statistic spans the whole row, which no column shard holds alone.
        return optimizer.uses_row_mean_sq and len(table_plan.shards) > 1

    def runtime(self, context: ShardingContext) -> TypeRuntime | None:
        plans = [table_plan for table_plan in context.plan.tables
                 if table_plan.sharding_type == self.name and self.groups_apart(table_plan, context.optimizer)]
        return ColumnShardRowStat(context, plans) if plans else None


class ColumnShardRowStat(TypeRuntime):
    """Gives every column shard the full-row mean square gradient of each row it updates.

    All column shards of a table receive the same ids, so they touch the same rows in the same
    order. Each owner computes its columns' sum of squares per row; every rank joins one gather;
    each shard then sums the parts in shard order (so all shards agree) and divides by the
    table's dim. The statistics of the backward in progress are kept until the operator's update
    reads them (``row_stat_fn``) later in that same backward.
    """

    def __init__(self, context: ShardingContext, plans: list[TablePlan]) -> None:
        self.context = context
        self.plans = plans
        self.row_stat_fn = self.row_mean_sq
        self._row_mean_sq: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def after_output_backward(self, grad_pooled: torch.Tensor, step: StepContext) -> None:
        ctx = self.context
        me, group = ctx.rank, ctx.groups.embedding
        received = step.received
        counts, parts = [], []
        for table_plan in self.plans:
            t = ctx.by_name[table_plan.table]
            for i, s in enumerate(table_plan.shards):
                if s.rank != me:
                    continue
                keys = tuple(f"{f}#{i}" for f in t.features)
                sub = received.select(keys)
                bag_grads = torch.cat(
                    [grad_pooled[:, ctx.local_col[k] : ctx.local_col[k] + s.num_cols] for k in keys]
                )
                unique, summed = row_gradients(sub.values, sub.offsets(), bag_grads, sub.weights)
                self._row_mean_sq[shard_table_name(t.name, i)] = (unique, summed.new_empty(0))
                parts.append(summed.square().sum(1))
                counts.append(unique.numel())
        dev = grad_pooled.device
        all_counts = all_gather_rows(torch.tensor(counts, dtype=torch.int64, device=dev).view(-1, 1), group,
                                     name="cw_row_sq_counts")
        all_parts = all_gather_rows(
            (torch.cat(parts) if parts else torch.zeros(0, device=dev)).view(-1, 1), group, ctx.stats, "cw_row_sq"
        )
        # Position of each (table, shard) part in its owner's buffer.
        found: dict[tuple[str, int], torch.Tensor] = {}
        for r in range(ctx.world):
            cursor, n = 0, 0
            sizes = all_counts[r].view(-1).tolist()
            for table_plan in self.plans:
                for i, s in enumerate(table_plan.shards):
                    if s.rank == r:
                        found[(table_plan.table, i)] = all_parts[r][cursor : cursor + sizes[n], 0]
                        cursor += sizes[n]
                        n += 1
        for table_plan in self.plans:
            t = ctx.by_name[table_plan.table]
            for i, s in enumerate(table_plan.shards):
                if s.rank == me:
                    unique, _ = self._row_mean_sq[shard_table_name(t.name, i)]
                    total = found[(table_plan.table, 0)].clone()
                    for j in range(1, len(table_plan.shards)):
                        total += found[(table_plan.table, j)]
                    self._row_mean_sq[shard_table_name(t.name, i)] = (unique, total / t.dim)

    def row_mean_sq(self, group, unique: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
        """Per unique row of one operator group: its mean square gradient over the whole row."""
        msq = summed.square().mean(dim=1)
        # ``unique`` is ascending, so each table's rows are one slice of it (found by bisection:
        # a mask per table would cost rows x tables).
        named = [(t, off) for t, off in zip(group.tables, group.table_row_offsets) if t.name in self._row_mean_sq]
        if not named:
            return msq
        bounds = torch.tensor([[off, off + t.num_rows] for t, off in named], dtype=unique.dtype, device=unique.device)
        cuts = torch.searchsorted(unique, bounds.view(-1)).view(-1, 2).tolist()
        for (t, off), (lo, hi) in zip(named, cuts):
            rows, full = self._row_mean_sq[t.name]
            if hi - lo != rows.numel() or not torch.equal(unique[lo:hi] - off, rows):
                raise RuntimeError(f"column shard {t.name}: rows differ between lookup and update")
            msq[lo:hi] = full
        return msq
