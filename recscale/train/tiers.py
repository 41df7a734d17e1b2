"""The ``[tiers]`` section applied to a job: which tables go to the SSD tier, how large each
cache is, and what the tier did (for the summary and the progress bar)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from recscale.embedding import SparseOptimizer, TableConfig
from recscale.embedding.tier_file import HEADER_BYTES
from recscale.embedding.tier_hooks import tier_stats
from recscale.embedding.tiered import TieredStorageFactory, TierSettings, tiered_storage_factory
from recscale.planner.miss_curve import RowAccess
from recscale.train.config import Config, ConfigError, TierTableConfig, TiersConfig
from recscale.train.datasets import DataSplits
from recscale.train.tier_plan import plan_tiers, row_bytes, table_access

__all__ = ["row_bytes", "tier_factory", "tier_placement", "tier_summary"]


def tier_placement(tiers: TiersConfig, tables: list[TableConfig], optimizer: SparseOptimizer,
                   access: dict[str, RowAccess] | None = None) -> dict[str, tuple[str, int]]:
    """Table -> ("ram", 0) or ("ssd", cache rows), chosen on each table's miss-ratio curve
    (``access``: its id distribution; uniform without one) within ``tiers.ram_budget_mb``;
    listed tables keep their placement and cache (``recscale.train.tier_plan``)."""
    return plan_tiers(tiers, tables, optimizer, access).placement()


def tier_factory(cfg: Config, tables: list[TableConfig], optimizer: SparseOptimizer, world_size: int,
                 replicated: Collection[str] = (), data: DataSplits | None = None) -> TieredStorageFactory | None:
    """The storage factory for ``TableBatchedEmbeddingBags`` (or, on several ranks, for
    ``shard``: each rank's shards of an SSD table get their own files and caches), None when
    no table is tiered. ``replicated``: the data-parallel tables of the plan, held whole on
    every rank, which stay in RAM (an explicit SSD placement of one is an error).

    The budget and ``cache_rows`` apply per rank: each shard of a table caches at most the
    table's ``cache_rows`` rows (and at most its own rows), and the placement is made as if one
    rank held every table whole, so no rank's tier exceeds ``ram_budget_mb``. ``data``: the
    job's data, whose id statistics size the caches (opened here when None)."""
    tiers = cfg.tiers
    if not tiers.enabled():
        return None
    for name in sorted(replicated):
        if name in tiers.tables and tiers.tables[name].placement == "ssd":
            raise ConfigError(
                f"config key 'tiers.tables.{name}.placement': table '{name}' is data_parallel (a whole copy on every "
                f"rank), which the SSD tier does not hold; shard it another way (sharding.tables.{name}.type) or "
                "place it in RAM"
            )
    if replicated:  # they stay in RAM: counted against the budget like a table placed there
        kept = {name: TierTableConfig(placement="ram") for name in replicated if name not in tiers.tables}
        tiers = replace(tiers, tables={**tiers.tables, **kept})
    placement = tier_placement(tiers, tables, optimizer, table_access(cfg, tables, data) if tiers.ram_budget_mb else None)
    if all(p == "ram" for p, _ in placement.values()):
        return None
    settings = TierSettings(tiers.ssd_dir, tiers.policy, tiers.lookahead_batches, tiers.io_threads,
                            min(tiers.prefetch_batches, tiers.lookahead_batches))
    return tiered_storage_factory(placement, settings, cfg.train.seed)


def stale_tier_files(cfg: Config) -> str:
    """A line naming the tier files an earlier run left in ``tiers.ssd_dir`` (each is rebuilt
    from the initial rows, then from the checkpoint resumed from, never read: after a crash
    it mixes rows of several steps); "" when there are none."""
    if not cfg.tiers.enabled() or not cfg.tiers.ssd_dir or not Path(cfg.tiers.ssd_dir).is_dir():
        return ""
    found = []
    for p in sorted(Path(cfg.tiers.ssd_dir).glob("*.tier")):
        try:
            with p.open("rb") as f:
                clean = json.loads(f.read(HEADER_BYTES).decode().strip()).get("clean")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            clean = None
        how = "closed cleanly" if clean else "not closed cleanly" if clean is False else "unreadable"
        found.append(f"{p.name} ({how})")
    if not found:
        return ""
    return (f"tiers: rebuilding the tier files left in {cfg.tiers.ssd_dir} by an earlier run: {', '.join(found)}; "
            "a tier file is never reused: its rows come from the initial values and the checkpoint resumed from")


def tier_summary(embeddings: torch.nn.Module, steps: int, train_seconds: float, group: Any = None) -> dict[str, Any]:
    """``cache_hit_rate`` (unique-row lookups served by the cache), SSD MiB read and written per
    step and ``io_stall_fraction`` (share of training time spent waiting for rows); {} without
    a tier. Training lookups only: evaluation does not count.

    With ``group`` (several ranks; a collective, call on every rank of it) the figures are the
    job's: the hit rate over every rank's lookups, the MiB per step summed over ranks, the
    largest rank's stall fraction (a step waits for its slowest rank) and prefetched rows summed."""
    st = tier_stats(embeddings)
    stall = st.stall_seconds / max(train_seconds, 1e-9) if st is not None else 0.0
    if group is not None:
        own = [st.lookups, st.hits, st.read_bytes, st.write_bytes, st.prefetched_rows, 1] if st is not None else [0] * 6
        totals = torch.tensor(own, dtype=torch.float64)
        torch.distributed.all_reduce(totals, group=group)
        worst = torch.tensor([stall], dtype=torch.float64)
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=group)
        if not totals[5]:
            return {}
        lookups, hits, read, written, prefetched = (int(v) for v in totals[:5].tolist())
        stall = float(worst[0])
    elif st is None:
        return {}
    else:
        lookups, hits, read, written = st.lookups, st.hits, st.read_bytes, st.write_bytes
        prefetched = st.prefetched_rows
    steps = max(steps, 1)
    return {
        "cache_hit_rate": hits / max(lookups, 1),
        "ssd_read_mb_per_step": read / 2**20 / steps,
        "ssd_write_mb_per_step": written / 2**20 / steps,
        "io_stall_fraction": stall,
        "prefetched_rows": prefetched,
    }
