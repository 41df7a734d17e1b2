"""The sharding step: a model built for one process becomes one rank's part of a sharded model
(the role of TorchRec's DistributedModelParallel for the embeddings; the dense part is
replicated and its gradients all-reduced by ``recscale.comm.dense_sync``)."""

from __future__ import annotations

from recscale.comm.collectives import CommStats
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import TableBatchedEmbeddingBags
from recscale.embedding.tiered import TieredStorageFactory
from recscale.model import DLRM
from recscale.sharding.collection import CommPrecision, ShardedEmbeddingCollection
from recscale.sharding.plan import ShardingPlan
from recscale.sharding.replica_gradients import Reduction


def shard(model: DLRM, plan: ShardingPlan, groups: ProcessGroups, precision: CommPrecision = CommPrecision(),
          stats: CommStats | None = None, hierarchical: bool = True, dp_reduction: Reduction = "auto",
          storage_factory: TieredStorageFactory | None = None) -> DLRM:
    """Replace ``model``'s embedding operator by this rank's shards of it, as ``plan`` places
    them (same tables, optimizer, seed and kernel; same initial rows as one process would draw).
    Build the model's embeddings on the meta device when they will be sharded: then no rank
    ever holds every table. Every rank must call this with the same plan (and, for tables on
    the SSD tier, the same ``storage_factory``: each rank builds its own shards' files)."""
    unsharded = model.embeddings
    if not isinstance(unsharded, TableBatchedEmbeddingBags):
        raise TypeError(f"shard() takes a model whose embeddings are one process's TableBatchedEmbeddingBags, "
                        f"not {type(unsharded).__name__}")
    model.embeddings = ShardedEmbeddingCollection(
        unsharded.tables, unsharded.optimizer, plan, groups, unsharded.seed, precision, stats,
        kernel=unsharded.kernel, hierarchical=hierarchical, dp_reduction=dp_reduction, storage_factory=storage_factory,
    )
    return model
