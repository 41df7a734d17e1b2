"""Whole tables (weights or optimizer state) assembled from every rank's shards: for
checkpoints of a different layout, tests and tools. Collectives: every rank calls them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from recscale.embedding import TableBatchedEmbeddingBags
from recscale.sharding.context import ShardingContext, shard_table_name
from recscale.sharding.types import SHARDING_TYPES

Getter = Callable[[TableBatchedEmbeddingBags, str], torch.Tensor]


def assemble(context: ShardingContext, local: TableBatchedEmbeddingBags | None,
             replicas: TableBatchedEmbeddingBags | None, name: str, get: Getter,
             state_cols: int | None = None) -> torch.Tensor:
    """Table ``name`` whole from ``get(operator, shard table)`` of every shard (broadcast by its
    owner); ``state_cols``: the width of an optimizer state (None: the weights)."""
    table_plan = context.plan.table(name)
    t = context.by_name[name]
    if SHARDING_TYPES[table_plan.sharding_type].replicated:
        assert replicas is not None
        return get(replicas, name).clone()
    assert local is not None or all(s.rank != context.rank for s in table_plan.shards)
    elementwise = state_cols is None or state_cols == t.dim  # shaped like the weights
    width = t.dim if state_cols is None else state_cols
    full = torch.zeros(t.num_rows, width, device=context.device)
    for i, s in enumerate(table_plan.shards):
        shape = (s.num_rows, s.num_cols if elementwise else width)
        if s.rank == context.rank:
            assert local is not None
            part = get(local, shard_table_name(name, i)).float().contiguous()
        else:
            part = torch.zeros(shape, device=full.device)
        if context.groups.embedding is not None:
            torch.distributed.broadcast(part, s.rank, group=context.groups.embedding)
        if elementwise:
            full[s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols] = part
        else:  # one value per row (each column shard keeps its own; the last one wins here)
            full[s.row_offset : s.row_offset + s.num_rows] = part
    return full
