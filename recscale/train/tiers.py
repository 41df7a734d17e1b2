"""The ``[tiers]`` section applied to a job: which tables go to the SSD tier, how large each
cache is, and what the tier did (for the summary and the progress bar)."""

from __future__ import annotations

from typing import Any

import torch

from recscale.embedding import SparseOptimizer, TableConfig
from recscale.embedding.tier_hooks import tier_stats
from recscale.embedding.tiered import StorageFactory, TierSettings, tiered_storage_factory
from recscale.train.config import Config, ConfigError, TiersConfig

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def row_bytes(table: TableConfig, optimizer: SparseOptimizer) -> int:
    """RAM one row takes: its weights plus its optimizer state."""
    return table.dim * _ELEMENT_BYTES[table.dtype] + 4 * sum(optimizer.state_columns(table.dim).values())


def tier_placement(tiers: TiersConfig, tables: list[TableConfig], optimizer: SparseOptimizer) -> dict[str, tuple[str, int]]:
    """Table -> ("ram", 0) or ("ssd", cache rows).

    Listed tables keep their placement. With a budget, unlisted tables move to the SSD tier,
    largest first, until the RAM-placed ones fit; what the budget leaves after them and the
    explicit caches is shared among the SSD tables without ``cache_rows``, by table size."""
    names = {t.name for t in tables}
    for name in tiers.tables:
        if name not in names:
            raise ConfigError(f"config key 'tiers.tables.{name}': no such table; tables are {', '.join(sorted(names))}")
    budget = tiers.ram_budget_mb * 2**20
    size = {t.name: t.num_rows * row_bytes(t, optimizer) for t in tables}
    place = {t.name: tiers.tables[t.name].placement if t.name in tiers.tables else "ram" for t in tables}
    if budget:
        in_ram = sum(size[t.name] for t in tables if place[t.name] == "ram")
        for t in sorted((t for t in tables if t.name not in tiers.tables), key=lambda t: (-size[t.name], t.name)):
            if in_ram <= budget:
                break
            place[t.name] = "ssd"
            in_ram -= size[t.name]
    out: dict[str, tuple[str, int]] = {}
    left = budget - sum(size[t.name] for t in tables if place[t.name] == "ram")
    shared = []
    for t in tables:
        if place[t.name] == "ram":
            out[t.name] = ("ram", 0)
            continue
        rows = tiers.tables[t.name].cache_rows if t.name in tiers.tables else 0
        if rows:
            out[t.name] = ("ssd", min(rows, t.num_rows))
            left -= out[t.name][1] * row_bytes(t, optimizer)
        else:
            shared.append(t)
    total = sum(t.num_rows for t in shared)
    for t in shared:
        rows = min(t.num_rows, int(max(left, 0) * t.num_rows / total) // row_bytes(t, optimizer)) if budget else 0
        if rows < 1:
            raise ConfigError(
                f"table '{t.name}' is on the SSD tier but no RAM is left for its cache; raise tiers.ram_budget_mb "
                f"or set tiers.tables.{t.name}.cache_rows"
            )
        out[t.name] = ("ssd", rows)
    return out


def tier_factory(cfg: Config, tables: list[TableConfig], optimizer: SparseOptimizer, world_size: int) -> StorageFactory | None:
    """The storage factory for ``TableBatchedEmbeddingBags``, None when no table is tiered."""
    tiers = cfg.tiers
    if not tiers.enabled():
        return None
    if world_size > 1:
        raise ConfigError("config section [tiers]: the SSD tier runs in one process only so far; unset it for several ranks")
    if cfg.checkpoint.enabled:
        raise ConfigError("config section [tiers]: checkpoints of tables on the SSD tier are not supported yet; "
                          "unset checkpoint.dir or the tier")
    placement = tier_placement(tiers, tables, optimizer)
    if all(p == "ram" for p, _ in placement.values()):
        return None
    settings = TierSettings(tiers.ssd_dir, tiers.policy, tiers.lookahead_batches, tiers.io_threads,
                            min(tiers.prefetch_batches, tiers.lookahead_batches))
    return tiered_storage_factory(placement, settings, cfg.train.seed)


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
