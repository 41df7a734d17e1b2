"""Data-parallel: a whole replica on every rank; lookups stay local, and the row gradients
of all ranks are combined (``replica_gradients.py``) before the same fused optimizer updates
every replica alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from recscale.comm.process_group import Topology
from recscale.embedding import TableBatchedEmbeddingBags, TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan
from recscale.sharding.replica_gradients import ReplicaGradients
from recscale.sharding.types.base import Rect, ShardingType, TypeRuntime

if TYPE_CHECKING:
    from recscale.sharding.context import ShardingContext


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

    def runtime(self, context: ShardingContext) -> TypeRuntime | None:
        """The replicas' own operator: it pools this rank's batch, and its update combines every
        replica's row gradients first, so that all replicas stay equal."""
        tables = [context.by_name[table_plan.table] for table_plan in context.plan.tables
                  if table_plan.sharding_type == self.name]
        if not tables:
            return None
        runtime = TypeRuntime()
        runtime.lookup = TableBatchedEmbeddingBags(
            tables, context.optimizer, context.seed, context.device, kernel=context.kernel,
            grad_reducer=ReplicaGradients(context.groups.embedding_grads, context.stats, context.replica_reduction),
        )
        return runtime
