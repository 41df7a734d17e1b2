"""``data.source = "prepared"``: train and eval readers over directories from ``recscale data prepare``."""

from __future__ import annotations

from recscale.data.prepared import PreparedDataset
from recscale.data.sharded_reader import ShardedReader
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits


def _check_tables(cfg: Config, ds: PreparedDataset) -> None:
    """Every feature's table must hold the ids the preparation produced."""
    rows = cfg.model.rows_for(len(ds.sparse_names))
    need = ds.table_rows
    small = [(n, r, need[n]) for n, r in zip(ds.sparse_names, rows) if r < need[n]]
    if small:
        detail = ", ".join(f"{n}: {r} < {want}" for n, r, want in small[:5])
        raise ConfigError(
            f"config key 'model.table_rows': too small for the prepared data in '{ds.root}' ({detail}); "
            f"use the table sizes from its manifest: {[need[n] for n in ds.sparse_names]}"
        )


def build_prepared(cfg: Config, rank: int = 0, world_size: int = 1, num_workers: int = 0) -> DataSplits:
    d, t = cfg.data, cfg.train
    train_ds = PreparedDataset.open(d.train_path, verify_checksums=d.verify_checksums)
    _check_tables(cfg, train_ds)
    common = dict(rank=rank, world_size=world_size, num_workers=num_workers, prefetch=d.prefetch)
    n = train_ds.num_rows
    if d.eval_path:
        eval_ds = PreparedDataset.open(d.eval_path, verify_checksums=d.verify_checksums)
        if eval_ds.schema.sparse_names != train_ds.sparse_names or eval_ds.schema.dense_names != train_ds.dense_names:
            raise ConfigError(
                f"config key 'data.eval_path': '{d.eval_path}' has other features than '{d.train_path}' "
                "(prepare both with the same schema)"
            )
        _check_tables(cfg, eval_ds)
        train_rows, eval_rows, eval_from = (0, n), (0, eval_ds.num_rows), d.eval_path
    else:
        # The last eval_fraction of the rows, as for the file sources (file order: no leakage).
        n_eval = max(1, int(round(n * d.eval_fraction)))
        if n_eval >= n:
            raise ConfigError(f"config key 'data.eval_fraction': leaves no training rows out of {n}")
        eval_ds, train_rows, eval_rows, eval_from = train_ds, (0, n - n_eval), (n - n_eval, n), "a held-out tail"
    train = ShardedReader(
        train_ds, t.batch_size, shuffle=d.shuffle, shuffle_window=d.shuffle_window, seed=t.seed, rows=train_rows, **common
    )
    evaluation = ShardedReader(eval_ds, t.eval_batch_size, seed=t.seed, rows=eval_rows, **common)
    m = train_ds.manifest
    skipped = m.get("skipped_rows", 0)
    desc = (
        f"prepared {d.train_path} ({train.num_samples:,} train rows, {evaluation.num_samples:,} eval rows from "
        f"{eval_from}; {len(m['shards'])} shards, positive rate {m['positive_rate']:.3f}"
        f"{f', {skipped} bad rows skipped when prepared' if skipped else ''})"
    )
    return DataSplits(train, evaluation, num_workers, train_ds.sparse_names, len(train_ds.dense_names), desc)
