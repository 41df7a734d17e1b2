"""The ``[tiers]`` section applied to a job: which tables go to the SSD tier, how large each
cache is, and what the tier did (for the summary and the progress bar)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recscale.embedding import SparseOptimizer, TableConfig
from recscale.embedding.tier_file import HEADER_BYTES
from recscale.embedding.tier_hooks import tier_stats
from recscale.embedding.tiered import StorageFactory, TierSettings, tiered_storage_factory
from recscale.planner.miss_curve import RowAccess
from recscale.train.config import Config, ConfigError, TiersConfig
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
                 data: DataSplits | None = None) -> StorageFactory | None:
    """The storage factory for ``TableBatchedEmbeddingBags``, None when no table is tiered
    (``data``: the job's data, whose id statistics size the caches; opened here when None)."""
    tiers = cfg.tiers
    if not tiers.enabled():
        return None
    if world_size > 1:
        raise ConfigError("config section [tiers]: the SSD tier runs in one process only so far; unset it for several ranks")
    placement = tier_placement(tiers, tables, optimizer, table_access(cfg, tables, data) if tiers.ram_budget_mb else None)
    if all(p == "ram" for p, _ in placement.values()):
        return None
    settings = TierSettings(tiers.ssd_dir, tiers.policy, tiers.lookahead_batches, tiers.io_threads)
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


def tier_summary(embeddings: torch.nn.Module, steps: int, train_seconds: float) -> dict[str, Any]:
    """``cache_hit_rate`` (unique-row lookups served by the cache), SSD MiB read and written per
    step and ``io_stall_fraction`` (share of training time spent waiting for rows); {} without
    a tier. Training lookups only: evaluation does not count."""
    st = tier_stats(embeddings)
    if st is None:
        return {}
    steps = max(steps, 1)
    return {
        "cache_hit_rate": st.hits / max(st.lookups, 1),
        "ssd_read_mb_per_step": st.read_bytes / 2**20 / steps,
        "ssd_write_mb_per_step": st.write_bytes / 2**20 / steps,
        "io_stall_fraction": st.stall_seconds / max(train_seconds, 1e-9),
        "prefetched_rows": st.prefetched_rows,
    }
