"""Embedding tables sharded over ranks by a plan, with the same interface as the single-process
operator: ``forward(local batch) -> [local batch, sum of dims]``, optimizer fused into backward.

The collection composes the sharding types a plan uses (``types/``); it owns no type's logic.
One step, for every type but the replicated (data-parallel) one:
  1. input distribution (``input_dist.py``): each rank sends every other rank the ids of its own
     samples that the receiver's shards serve, routed by the types (row-split types send each
     id only to the shard holding its row);
  2. lookup: each rank pools the ids it received with one table-batched fused operator over all
     its shards (types may set shards apart in groups of their own: ``groups_apart``);
  3. output distribution (``output_dist.py``): each rank returns every source its shards'
     partial outputs, which the source places into its output (copied or summed), after any
     stage a type adds (``TypeRuntime.output_stage``);
  backward runs the same exchanges in reverse, calls each type's ``after_output_backward``, and
  each rank updates only the rows it owns.
Replicated tables are looked up by their type's own operator (``TypeRuntime.lookup``) on this
rank's batch while the outputs travel. One batch's state, from its input distribution to its
backward, lives in its ``StepContext``, not in the module.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from recscale.comm.codecs import get_codec
from recscale.comm.collectives import CommStats
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import SparseOptimizer, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.module import EmbeddingInput
from recscale.embedding.table_batched import init_rows
from recscale.embedding.tiered import TieredStorageFactory, TierShard
from recscale.sharding.assemble import assemble
from recscale.sharding.context import CommPrecision, ShardingContext, StepContext, shard_table_name
from recscale.sharding.input_dist import InputDist
from recscale.sharding.output_dist import OutputDist
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.sharding.replica_gradients import Reduction
from recscale.sharding.types import SHARDING_TYPES
from recscale.sparse import JaggedBatch, SparseInputError

__all__ = ["CommPrecision", "PendingOutput", "ShardedEmbeddingCollection", "StepContext", "shard_table_name"]


class PendingOutput:
    """A step's pooled outputs on their way home (``ShardedEmbeddingCollection.start_forward``)."""

    def __init__(self, coll: ShardedEmbeddingCollection, step: StepContext, token: torch.Tensor | None) -> None:
        self._coll, self.step, self._token = coll, step, token

    @property
    def global_batch_size(self) -> int:
        return self.step.global_batch_size

    def finish(self) -> torch.Tensor:
        coll = self._coll
        replicas = coll.dp
        if self._token is None:  # every table replicated: their output is the output
            assert replicas is not None
            return replicas(self.step.batch.select(replicas.feature_names))
        # The replicas pool their own samples while the outputs are still on their way.
        replica_out = replicas(self.step.batch.select(replicas.feature_names)) if replicas is not None else None
        return coll.output_dist.finish(self._token, self.step, replica_out)


class ShardedEmbeddingCollection(nn.Module):
    """``hierarchical=False`` keeps table-row-wise outputs on the flat path on several hosts
    too (same results up to summation order; for comparisons); ``dp_reduction`` forces how
    data-parallel replicas combine gradients (``gather`` or ``dense``; same bits either way).
    ``storage_factory`` puts this rank's shards of SSD-placed tables on the tier, each shard in
    a file of its own named by table, shard and rank (replicated tables stay in RAM)."""

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizer,
        plan: ShardingPlan,
        groups: ProcessGroups,
        seed: int = 0,
        precision: CommPrecision = CommPrecision(),
        stats: CommStats | None = None,
        kernel: str = "auto",
        hierarchical: bool = True,
        dp_reduction: Reduction = "auto",
        storage_factory: TieredStorageFactory | None = None,
    ) -> None:
        super().__init__()
        plan.validate(tables)
        if plan.world_size != groups.world_size:
            raise PlanError(f"the plan is for {plan.world_size} ranks but the job has {groups.world_size}; plan again for "
                            f"{groups.world_size} ranks (or start {plan.world_size})")
        self.tables = list(tables)
        self.optimizer = optimizer
        self.plan = plan
        self.groups = groups
        self.rank = groups.rank
        self.world = groups.world_size
        self.precision = precision
        self.stats = stats if stats is not None else CommStats()
        self.stats.ranks_per_host = groups.topology.ranks_per_host
        ctx = self.context = ShardingContext(list(tables), optimizer, plan, groups, seed, precision, self.stats, kernel,
                                             hierarchical, dp_reduction)
        for codec in (precision.forward, precision.backward):  # an unknown one fails here, not in the first step
            get_codec(codec)
        self.feature_names = ctx.feature_names
        self.feature_dims = ctx.feature_dims
        self.num_rows_by_feature = {f: t.num_rows for t in tables for f in t.features}
        self.total_dim = ctx.total_dim

        used = dict.fromkeys(table_plan.sharding_type for table_plan in plan.tables)
        runtimes = [rt for rt in (SHARDING_TYPES[name].runtime(ctx) for name in used) if rt is not None]
        row_stat_fns = [rt.row_stat_fn for rt in runtimes if rt.row_stat_fn is not None]

        def shard_init(local: TableConfig) -> torch.Tensor:
            t, s = ctx.shard_origin[local.name]
            return init_rows(t, seed, s.row_offset, s.num_rows, s.col_offset, s.num_cols)

        mine = ctx.shard_tables[self.rank]
        # Whether any rank has tiered shards: the same on every rank, so all pipeline alike.
        self.tiered = storage_factory is not None
        if storage_factory is not None:
            storage_factory = storage_factory.for_shards({
                t.name: TierShard(origin, s.row_offset, s.col_offset,
                                  f"{origin.name}.s{t.name.rsplit('#', 1)[1]}.r{self.rank}")
                for t in mine for origin, s in [ctx.shard_origin[t.name]]
            })
        self.local = (
            TableBatchedEmbeddingBags(
                mine, optimizer, seed, ctx.device, init_fn=shard_init,
                row_stat_fn=row_stat_fns[0] if row_stat_fns else None, kernel=kernel, row_stat_tables=ctx.apart_tables,
                storage_factory=storage_factory,
            )
            if mine
            else None
        )
        lookups = [rt.lookup for rt in runtimes if rt.lookup is not None]
        self.dp = lookups[0] if lookups else None
        replica_features = list(zip(self.dp.feature_names, self.dp.feature_dims)) if self.dp is not None else []
        # Every table replicated, pooled in output order: each rank looks up its own batch, so
        # there are no ids to exchange and the replicas' output is the output (no placing).
        self._replicated_only = (self.dp is not None and not any(ctx.local_dims)
                                 and list(self.dp.feature_names) == list(self.feature_names))
        self.input_dist = InputDist(ctx, self._replicated_only)
        self.output_dist = OutputDist(ctx, runtimes, replica_features)
        # Makes the output require grad on every rank, so every rank joins the backward collectives.
        self._anchor = nn.Parameter(torch.zeros(0, device=ctx.device))

    # ------------------------------------------------------------------ step
    def set_learning_rate(self, lr: float) -> None:
        """The rate of every fused update (sharded and replicated tables) from the next backward on."""
        self.optimizer = replace(self.optimizer, lr=lr)
        for part in (self.local, self.dp):
            if part is not None:
                part.set_learning_rate(lr)

    def validate(self, batch: JaggedBatch) -> None:
        missing = [f for f in self.feature_names if f not in batch.keys]
        if missing:
            raise SparseInputError(f"batch lacks features {missing} that the embedding tables expect")
        batch.validate(self.num_rows_by_feature)

    def start_input_dist(self, batch: JaggedBatch) -> StepContext:
        """Send this batch's ids to their owners now; ``forward(step)`` uses them later.

        The batch sizes, lengths, ids and weights travel while the caller computes the previous
        batch; through shared memory nothing here waits for another rank (through a process
        group's backend, small exchanges of message sizes do). Every rank must call this and
        ``forward`` in the same order, as for any collective."""
        return self.input_dist.start(batch)

    def forward(self, batch: JaggedBatch | EmbeddingInput) -> torch.Tensor:
        return self.start_forward(batch).finish()

    def start_forward(self, batch: JaggedBatch | EmbeddingInput) -> PendingOutput:
        """Pool this rank's shards and start sending the outputs home; ``finish()`` waits for
        them. Work the caller does in between (the bottom MLP, which needs no embeddings)
        overlaps the output all-to-all, and in backward the bottom MLP's gradients overlap the
        gradient all-to-all (autograd runs the later-created receiving node first)."""
        if isinstance(batch, StepContext):
            step = batch
        else:  # ids not sent yet (or sent for another module): send them now
            step = self.start_input_dist(batch if isinstance(batch, JaggedBatch) else batch.batch)
        received = step.wait()
        if self._replicated_only:
            return PendingOutput(self, step, None)
        if self.local is not None:
            pooled = self.local(received)
        else:
            pooled = torch.zeros(step.global_batch_size, 0, device=self.groups.device)
        return PendingOutput(self, step, self.output_dist.start(self._anchor, pooled, step))

    # ------------------------------------------------------------------ access (collective)
    def full_table(self, name: str) -> torch.Tensor:
        """The whole table assembled from every rank's shards (a collective: call on all ranks)."""
        return assemble(self.context, self.local, self.dp, name, lambda tbe, local: tbe.table_weight(local).float())

    def full_state(self, name: str) -> dict[str, torch.Tensor]:
        t = self.context.by_name[name]
        out = {}
        for key, cols in self.optimizer.state_columns(t.dim).items():
            out[key] = assemble(self.context, self.local, self.dp, name,
                                lambda tbe, local, key=key: tbe.table_state(local)[key], state_cols=cols)
        return out
