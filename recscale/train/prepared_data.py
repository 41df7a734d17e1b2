"""``data.source = "prepared"``: train and eval readers over directories from ``recscale data prepare``."""

from __future__ import annotations

from pathlib import Path

from recscale.data.prepared import PreparedDataset
from recscale.data.sharded_reader import ShardedReader
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits


def _check_tables(cfg: Config, ds: PreparedDataset) -> list[int]:
    """Each feature's table rows: the manifest's with ``model.table_rows = "auto"``, else the
    configured ones, which must hold the ids the preparation produced."""
    need = ds.table_rows
    if cfg.model.table_rows == "auto":
        return [need[n] for n in ds.sparse_names]
    rows = cfg.model.rows_for(len(ds.sparse_names))
    small = [(n, r, need[n]) for n, r in zip(ds.sparse_names, rows) if r < need[n]]
    if small:
        detail = ", ".join(f"feature {n}: {r} < {want}" for n, r, want in small[:5])
        raise ConfigError(
            f"config key 'model.table_rows': too small for the prepared data in '{ds.root}' ({detail}); "
            f"set it to \"auto\" to take the sizes from its manifest ({[need[n] for n in ds.sparse_names]})"
        )
    return rows


def check_same_encoding(train: PreparedDataset, evaluation: PreparedDataset) -> None:
    """Train and eval data must encode every feature alike: the same columns, and for each
    sparse feature the same transform settings and vocabulary (by checksum), else an eval id
    would mean another value than in training."""
    where = f"'{evaluation.root}' and '{train.root}'"
    fix = f"prepare the eval data with `recscale data prepare --vocab-from {train.root}`"
    if evaluation.sparse_names != train.sparse_names or evaluation.dense_names != train.dense_names:
        a, b = set(train.sparse_names + train.dense_names), set(evaluation.sparse_names + evaluation.dense_names)
        diff = sorted(a ^ b) or ["(the same features in another order)"]
        raise ConfigError(f"config key 'data.eval_path': {where} have different features: {diff}; {fix}")
    vocab_a, vocab_b = vocab_checksums(train), vocab_checksums(evaluation)
    for a, b in zip(train.schema.sparse, evaluation.schema.sparse):
        if vocab_a.get(a.name) != vocab_b.get(a.name):
            raise ConfigError(
                f"config key 'data.eval_path': feature '{a.name}' has a different vocabulary in {where} "
                f"(its ids would mean other values than in training); {fix}"
            )
        if a != b:
            diff = ", ".join(f"{k} {getattr(b, k)!r} against {getattr(a, k)!r}" for k in a.__dataclass_fields__
                             if getattr(a, k) != getattr(b, k))
            raise ConfigError(f"config key 'data.eval_path': feature '{a.name}' is encoded differently in {where} ({diff}); {fix}")


def vocab_checksums(ds: PreparedDataset) -> dict[str, str]:
    """Feature name -> SHA-256 of its vocabulary file, as the manifest records it."""
    return {Path(v["file"]).stem: v["sha256"] for v in ds.manifest.get("vocab", [])}


def build_prepared(cfg: Config, rank: int = 0, world_size: int = 1) -> DataSplits:
    d, t = cfg.data, cfg.train
    train_ds = PreparedDataset.open(d.train_path, verify_checksums=d.verify_checksums)
    rows = _check_tables(cfg, train_ds)
    common = dict(rank=rank, world_size=world_size, num_workers=d.num_workers, prefetch=d.prefetch)
    n = train_ds.num_rows
    if d.eval_path:
        eval_ds = PreparedDataset.open(d.eval_path, verify_checksums=d.verify_checksums)
        check_same_encoding(train_ds, eval_ds)
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
    return DataSplits(train, evaluation, d.num_workers, train_ds.sparse_names, len(train_ds.dense_names), desc,
                      tuple(rows), stats_dir=str(train_ds.root))
