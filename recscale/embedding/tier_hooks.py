"""What the training loop asks of a module's tiered groups: announce future batches, begin
one, check that a batch fits the caches, read the counters, close the tier files."""

from __future__ import annotations

import torch

from recscale.embedding.tiered import TieredRowStorage, TierStats, segment_span


def _operator(module: torch.nn.Module) -> torch.nn.Module:
    """The table-batched operator that holds ``module``'s rows here: the module itself, or a
    sharded collection's operator over this rank's shards (its ``local``)."""
    local = getattr(module, "local", None)
    return local if isinstance(getattr(local, "groups", None), list) else module


def uses_tiers(module: torch.nn.Module) -> bool:
    """Whether ``module`` has tables on the SSD tier on any rank (a sharded collection says
    so in ``tiered``: the same answer on every rank, so every rank pipelines alike)."""
    flag = getattr(module, "tiered", None)
    return bool(flag) if flag is not None else bool(tiered_storages(module))


def tiered_storages(module: torch.nn.Module) -> list[tuple[object, TieredRowStorage]]:
    """(group, storage) of every tiered group of a ``TableBatchedEmbeddingBags`` (of this
    rank's shards, for a sharded collection)."""
    module = _operator(module)
    groups = module.groups if isinstance(getattr(module, "groups", None), list) else []
    return [(g, g.storage) for g in groups if isinstance(getattr(g, "storage", None), TieredRowStorage)]


def _group_rows(g, batch) -> torch.Tensor:
    sub = batch.select(g.features)
    per_key = sub.lengths.view(len(g.features), sub.batch_size).sum(1)
    return sub.values.to(torch.int64) + torch.repeat_interleave(g.feature_row_offset, per_key, output_size=sub.values.numel())


def announce_batch(module: torch.nn.Module, batch) -> None:
    """Tell each tiered group of ``module`` the rows a future ``JaggedBatch`` looks up (for a
    sharded collection: the ids this rank received for its shards)."""
    for g, st in tiered_storages(module):
        st.announce(_group_rows(g, batch))


def fits_caches(module: torch.nn.Module, batch) -> bool:
    """Whether every cache of ``module`` can hold the distinct rows ``batch`` looks up."""
    for g, st in tiered_storages(module):
        uniq = torch.unique(_group_rows(g, batch))
        for seg in st.segments:
            lo, hi = segment_span(uniq, seg)
            if hi - lo > seg.slots:
                return False
    return True


def begin_batch(module: torch.nn.Module) -> None:
    """The oldest announced batch is about to train (see ``TieredRowStorage.begin_batch``)."""
    for _, st in tiered_storages(module):
        st.begin_batch()


def forget_announced(module: torch.nn.Module) -> None:
    """Drop the announced batches that will not run (see ``TieredRowStorage.forget_announced``)."""
    for _, st in tiered_storages(module):
        st.forget_announced()


def tier_stats(module: torch.nn.Module) -> TierStats | None:
    """The summed counters of every tiered group, None without one."""
    found = tiered_storages(module)
    if not found:
        return None
    total = TierStats()
    for _, st in found:
        total.add(st.stats)
    return total


def close_tiers(module: torch.nn.Module) -> None:
    """Write every dirty row back and mark the tier files clean; then stop the reader pools
    (shared by the groups of one module, so only once every group is closed)."""
    found = tiered_storages(module)
    for _, st in found:
        st.close(shutdown_pool=False)
    for pool in {id(st.pool): st.pool for _, st in found if st.pool is not None}.values():
        pool.shutdown(wait=True)
