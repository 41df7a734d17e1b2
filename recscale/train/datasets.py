"""Turn the ``[data]`` config section into train and eval batch streams."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from recscale.data import (
    ClickBatches,
    ClickData,
    SyntheticClickData,
    SyntheticConfig,
    make_loader,
    read_criteo_tsv,
    read_encoded_csv,
    vocab_encode,
)
from recscale.data.sharded_reader import ShardedReader
from recscale.train.config import SYNTHETIC_TABLE_ROWS, Config, ConfigError


@dataclass
class DataSplits:
    train: ClickBatches | ShardedReader
    eval: ClickBatches | ShardedReader
    num_workers: int
    sparse_names: tuple[str, ...]
    num_dense: int
    description: str
    # Rows of each feature's table: model.table_rows, or with "auto" what the data needs.
    table_rows: tuple[int, ...] = ()
    # Where the planner reads each feature's load: a prepared directory's stats.json, or the
    # training ids of a file source ([samples, features]); neither for synthetic data.
    stats_dir: str = ""
    train_ids: np.ndarray | None = None

    def train_loader(self, start_batch: int = 0) -> torch.utils.data.DataLoader:
        """The current epoch's batches from ``start_batch`` on (a resumed run skips the rest)."""
        if isinstance(self.train, ShardedReader):
            return self.train.loader(start_batch)  # type: ignore[return-value]
        # A new loader per epoch, so worker processes see the dataset's current epoch.
        return make_loader(self.train, num_workers=self.num_workers, start_batch=start_batch)

    def eval_loader(self) -> torch.utils.data.DataLoader:
        if isinstance(self.eval, ShardedReader):
            self.eval.set_epoch(0)
            return self.eval.loader()  # type: ignore[return-value]
        return make_loader(self.eval, num_workers=self.num_workers)


def with_table_rows(cfg: Config, rows: tuple[int, ...], log: Callable[[str], None] | None = None) -> Config:
    """``cfg`` with ``model.table_rows`` as the data's sizes when it was "auto"."""
    if cfg.model.table_rows != "auto" or not rows:
        return cfg
    if log is not None:
        log(f"table rows from the data (model.table_rows = \"auto\"): {list(rows)}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, table_rows=list(rows)))


def _hold_out(data: ClickData, fraction: float) -> tuple[ClickData, ClickData]:
    """Last ``fraction`` of the rows for evaluation (file order, so no leakage by shuffling)."""
    n = len(data.labels)
    n_eval = max(1, int(round(n * fraction)))
    if n_eval >= n:
        raise ConfigError(f"config key 'data.eval_fraction': leaves no training rows out of {n}")
    cut = n - n_eval
    return data.slice(0, cut), data.slice(cut, n)


def build_data(cfg: Config, rank: int = 0, world_size: int = 1, num_workers: int | None = None) -> DataSplits:
    """Train and eval batches; with several ranks each rank builds only its share of every batch.
    ``num_workers``: loader worker processes (None: ``data.num_workers``, "auto" meaning none;
    the trainer passes what ``recscale.train.process_tuning`` sized)."""
    d, t = cfg.data, cfg.train
    if num_workers is None:
        num_workers = 0 if d.num_workers == "auto" else d.num_workers
    if d.source == "prepared":
        from recscale.train.prepared_data import build_prepared

        return build_prepared(cfg, rank, world_size, num_workers)
    if d.source == "synthetic":
        rows = list(SYNTHETIC_TABLE_ROWS) if cfg.model.table_rows == "auto" else cfg.model.table_rows
        pf = d.pooling_factors or [1]
        if len(pf) == 1:
            pf = pf * len(rows)
        base = dict(
            num_dense=13,
            table_rows=tuple(rows),
            pooling_factors=tuple(pf),
            zipf_alpha=d.zipf_alpha,
            seed=t.seed if d.seed < 0 else d.seed,
        )
        train_src = SyntheticClickData(SyntheticConfig(num_samples=d.num_samples, **base))
        # Evaluation samples come from a disjoint part of the same stream.
        eval_src = SyntheticClickData(SyntheticConfig(num_samples=d.eval_samples, **base), offset=d.num_samples)
        desc = (
            f"synthetic ({d.num_samples:,} train / {d.eval_samples:,} eval samples, "
            f"{len(rows)} tables, zipf alpha {d.zipf_alpha})"
        )
        names = train_src.sparse_names
        num_dense = 13
    else:
        reader = read_encoded_csv if d.source == "criteo_encoded_csv" else read_criteo_tsv
        auto = cfg.model.table_rows == "auto"
        given = None if auto else cfg.model.rows_for(26)
        train_src = reader(d.train_path, given, skip_bad_rows=d.skip_bad_rows)
        parsed = [train_src]
        if d.eval_path:
            eval_src = reader(d.eval_path, given, skip_bad_rows=d.skip_bad_rows)
            parsed.append(eval_src)
        else:
            train_src, eval_src = _hold_out(train_src, d.eval_fraction)
        if not auto:
            rows = given
        elif d.source == "criteo_tsv":  # a vocabulary of the training values, as `data prepare --vocab-min-count 1`
            rows = vocab_encode(train_src, [eval_src])
        else:  # encoded ids: every id of either file must have a row
            rows = [int(max(p.sparse[:, j].max(initial=0) for p in (train_src, eval_src))) + 1 for j in range(26)]
        # Counted on the files as read (a held-out split does not carry them).
        skipped = sum(p.skipped_rows for p in parsed)
        examples = [e for p in parsed for e in p.skipped_examples]
        desc = (
            f"{d.source} {d.train_path} ({len(train_src.labels):,} train rows, "
            f"{len(eval_src.labels):,} eval rows from {d.eval_path or 'a held-out tail'}"
            f"{f', {skipped} bad rows skipped, e.g. {examples[0]}' if skipped else ''}; "
            f"positive rate {float(np.mean(train_src.labels)):.3f})"
        )
        names = tuple(train_src.sparse_names)
        num_dense = train_src.dense.shape[1]
    train = ClickBatches(train_src, t.batch_size, d.shuffle, t.seed, drop_last=False, rank=rank, world_size=world_size,
                         fault_point=True)
    evaluation = ClickBatches(eval_src, t.eval_batch_size, False, t.seed, drop_last=False, rank=rank, world_size=world_size)
    ids = None if d.source == "synthetic" else train_src.sparse
    return DataSplits(train, evaluation, num_workers, tuple(names), num_dense, desc, tuple(rows), train_ids=ids)
