"""The embedding shards this rank holds, described in whole-table coordinates.

A single-process ``TableBatchedEmbeddingBags`` holds every table whole; a
``ShardedEmbeddingCollection`` holds this rank's plan shards (row and/or column ranges, named
``table#i`` in its local operator) plus whole replicas of data-parallel tables. Checkpoints are
written and read in whole-table coordinates, which is what lets a restore use any other plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recscale.embedding import TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.module import EmbeddingModule
from recscale.embedding.table_batched import TableGroup
from recscale.embedding.tiered import TieredRowStorage


@dataclass(frozen=True)
class LocalShard:
    module: TableBatchedEmbeddingBags
    local_name: str  # the table's name inside ``module``
    table: TableConfig  # the whole table
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    writer: bool  # this rank writes it (a data-parallel table is written by rank 0 only)

    def group(self) -> tuple[TableGroup, int]:
        """The module's row group holding this shard and the shard's first row in it."""
        for g in self.module.groups:
            for t, off in zip(g.tables, g.table_row_offsets):
                if t.name == self.local_name:
                    return g, off
        raise KeyError(self.local_name)

    def tiered(self) -> tuple[TieredRowStorage, int] | None:
        """(the tiered storage, the shard's first group row in it) when the shard's rows live
        behind a cache over the SSD tier; None when they are all in memory."""
        g, off = self.group()
        return (g.storage, off) if isinstance(g.storage, TieredRowStorage) else None

    def read_rows(self, local: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copies of the shard's rows ``local`` (ascending local indices; None: every row): the
        weights in the storage dtype and every optimizer state tensor."""
        tier = self.tiered()
        if tier is not None:
            st, off = tier
            if local is None:
                return st.read_rows(off, self.num_rows)
            return st.read_rows_at(local + off)
        w, state = self.module.table_weight(self.local_name), self.module.table_state(self.local_name)
        if local is None:
            return w.clone(), {k: v.clone() for k, v in state.items()}
        local = local.to(w.device)
        return w.index_select(0, local), {k: v.index_select(0, local) for k, v in state.items()}

    @property
    def cells(self) -> int:
        return self.num_rows * self.num_cols


def row_state_names(module: TableBatchedEmbeddingBags, dim: int) -> set[str]:
    """State tensors kept once per row over the whole row (row-wise Adagrad), not per element."""
    return {k for k, c in module.optimizer.state_columns(dim).items() if c != dim}


def local_shards(embeddings: EmbeddingModule, rank: int = 0) -> list[LocalShard]:
    """Every embedding shard on this rank, for either kind of embedding module."""
    if isinstance(embeddings, TableBatchedEmbeddingBags):
        return [LocalShard(embeddings, t.name, t, 0, t.num_rows, 0, t.dim, True) for t in embeddings.tables]
    from recscale.sharding.collection import ShardedEmbeddingCollection, shard_table_name

    if not isinstance(embeddings, ShardedEmbeddingCollection):
        raise TypeError(f"cannot checkpoint embeddings of type {type(embeddings).__name__}")
    by_name = {t.name: t for t in embeddings.tables}
    out: list[LocalShard] = []
    for tp in embeddings.plan.tables:
        t = by_name[tp.table]
        if tp.sharding_type == "data_parallel":
            assert embeddings.dp is not None
            out.append(LocalShard(embeddings.dp, t.name, t, 0, t.num_rows, 0, t.dim, rank == 0))
            continue
        for i, s in enumerate(tp.shards):
            if s.rank == rank:
                assert embeddings.local is not None
                out.append(
                    LocalShard(embeddings.local, shard_table_name(t.name, i), t, s.row_offset, s.num_rows,
                               s.col_offset, s.num_cols, True)
                )
    return out


def embedding_modules(shards: list[LocalShard]) -> list[TableBatchedEmbeddingBags]:
    seen: dict[int, TableBatchedEmbeddingBags] = {}
    for s in shards:
        seen.setdefault(id(s.module), s.module)
    return list(seen.values())
