"""The distributed, resumable reader of prepared Parquet shards.

Every rank and every worker computes the same epoch plan from (dataset, seed, epoch) alone, so
no coordination is needed:

1. the row groups are put in a per-epoch order (shuffled by ``(seed, epoch)`` when shuffling);
2. rank ``r`` of ``W`` takes the ``r``-th contiguous ``1/W`` of that sample stream (so ranks
   read disjoint row groups; at most ``W - 1`` boundary groups are split between neighbours)
   and every sample of the epoch goes to exactly one rank;
3. within a rank, samples are shuffled inside consecutive windows of ``shuffle_window``
   samples (a window is one permutation, seeded by ``(seed, epoch, rank, window)``), which
   keeps every position addressable: batch ``i`` is a pure function of the plan;
4. batches are decoded in chunks (whole windows, about ``chunk_rows`` samples) by DataLoader
   worker processes, each collating straight into ``Batch``/``JaggedBatch``, ``prefetch``
   chunks ahead per worker.

Because a batch depends only on (plan, index), the reader's position is just ``(epoch,
next_batch)``: ``state_dict()`` saves it with a fingerprint of the dataset and the settings that
shape the plan, and ``load_state_dict()`` refuses a state from a different dataset or setup.
"""

from __future__ import annotations

import multiprocessing as mp

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from recscale.data.batch import Batch
from recscale.data.prepared import PreparedDataset, RowGroups
from recscale.sparse import JaggedBatch


class ReaderStateError(ValueError):
    """A saved reader state does not belong to this dataset or reader setup."""


def _share(total: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` near-equal consecutive parts of ``range(total)``."""
    base, extra = divmod(total, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


@dataclass(frozen=True)
class EpochPlan:
    """What one rank reads in one epoch: its slice of the ordered row groups and batch sizes."""

    groups: RowGroups  # this rank's (partial) row groups, in read order
    starts: np.ndarray  # int64, rank-stream position of each group's first sample
    num_rows: int
    batch_size: int  # this rank's share of the global batch
    num_batches: int  # equal on every rank
    window: int  # shuffle window in samples (0: no sample shuffle)
    seed_key: tuple[int, ...]  # (seed, epoch, rank)

    def batch_rows(self, i: int) -> tuple[int, int]:
        lo = min(i * self.batch_size, self.num_rows)
        return lo, min(lo + self.batch_size, self.num_rows)

    def source_positions(self, lo: int, hi: int) -> np.ndarray:
        """Rank-stream positions whose samples fill output positions ``[lo, hi)``."""
        pos = np.arange(lo, hi, dtype=np.int64)
        if self.window <= 1 or hi <= lo:
            return pos
        out = np.empty_like(pos)
        for w in range(lo // self.window, (hi - 1) // self.window + 1):
            w_lo, w_hi = w * self.window, min((w + 1) * self.window, self.num_rows)
            perm = np.random.default_rng([*self.seed_key, w, 0x51]).permutation(w_hi - w_lo) + w_lo
            a, b = max(lo, w_lo), min(hi, w_hi)
            out[a - lo : b - lo] = perm[a - w_lo : b - w_lo]
        return out


class _Decoder:
    """Reads rank-stream row ranges from the shards and collates batches (one per process)."""

    def __init__(self, dataset: PreparedDataset) -> None:
        self.dataset = dataset
        self.schema = dataset.schema
        self._files: dict[int, pq.ParquetFile] = {}
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        # Open files stay behind when the decoder is sent to a spawned worker process.
        return {**self.__dict__, "_files": {}, "_pid": -1}

    def _file(self, shard: int) -> pq.ParquetFile:
        if self._pid != os.getpid():  # file handles must not cross a fork
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            self._files[shard] = pq.ParquetFile(self.dataset.shard_files[shard], page_checksum_verification=True)
        return self._files[shard]

    def read(self, plan: EpochPlan, lo: int, hi: int) -> pa.Table:
        """Rank-stream rows ``[lo, hi)`` as one table."""
        g = plan.groups
        first = int(np.searchsorted(plan.starts, lo, side="right")) - 1
        parts = []
        i = max(first, 0)
        while i < len(g.rows) and plan.starts[i] < hi:
            a = max(lo - int(plan.starts[i]), 0)
            b = min(hi - int(plan.starts[i]), int(g.rows[i]))
            t = self._file(int(g.shard[i])).read_row_group(int(g.group[i]))
            parts.append(t.slice(int(g.skip[i]) + a, b - a))
            i += 1
        return pa.concat_tables(parts) if len(parts) != 1 else parts[0]

    def chunk(self, plan: EpochPlan, first: int, stop: int) -> PackedChunk:
        """Batches ``[first, stop)`` of the plan, decoded together into one packed chunk."""
        lo, _ = plan.batch_rows(first)
        _, hi = plan.batch_rows(stop - 1)
        bounds = [(a - lo, b - lo) for a, b in (plan.batch_rows(i) for i in range(first, stop))]
        s, k = self.schema, len(self.schema.sparse)
        if hi <= lo:
            return PackedChunk(
                s.sparse_names, torch.zeros((0, len(s.dense))), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                torch.zeros((k, 0), dtype=torch.int64), bounds, False,
            )
        src = plan.source_positions(lo, hi)
        s_lo, s_hi = int(src.min()), int(src.max()) + 1
        table = self.read(plan, s_lo, s_hi)
        if plan.window > 1:
            table = table.take(pa.array(src - s_lo))
        n = table.num_rows
        dense = np.empty((n, len(s.dense)), dtype=np.float32)
        for j, d in enumerate(s.dense):
            dense[:, j] = table.column(d.name).to_numpy()
        values, lengths = [], np.ones((k, n), dtype=np.int64)
        for j, f in enumerate(s.sparse):
            c = table.column(f.name).combine_chunks()
            if f.is_list:
                lengths[j] = np.asarray(pc.list_value_length(c).fill_null(0))
                values.append(np.asarray(pc.list_flatten(c), dtype=np.int64))
            else:
                values.append(np.asarray(c, dtype=np.int64))
        return PackedChunk(
            s.sparse_names,
            torch.from_numpy(dense),
            torch.from_numpy(table.column("label").to_numpy().astype(np.float32)),
            torch.from_numpy(np.concatenate(values)),
            torch.from_numpy(lengths),
            bounds,
            not any(f.is_list for f in s.sparse),
        )


@dataclass
class PackedChunk:
    """Consecutive batches in five flat tensors, so a worker hands over a whole chunk at once
    (a few shared-memory segments instead of four per batch); ``batches()`` slices it in the
    consumer. ``values`` is feature-major over the chunk's rows; ``lengths`` is ``[K, n]``."""

    keys: tuple[str, ...]
    dense: torch.Tensor
    labels: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    bounds: list[tuple[int, int]]
    one_hot: bool

    def batches(self) -> list[Batch]:
        k, n = self.lengths.shape
        if self.one_hot:
            ids = self.values.view(k, n)
            return [
                Batch(self.dense[a:b], JaggedBatch(self.keys, ids[:, a:b].reshape(-1), self.lengths[:, a:b].reshape(-1)), self.labels[a:b])
                for a, b in self.bounds
            ]
        ends = torch.cumsum(self.lengths.reshape(-1), 0).view(k, n)
        starts = ends - self.lengths
        out = []
        for a, b in self.bounds:
            if b > a:
                lo, hi = starts[:, a].tolist(), ends[:, b - 1].tolist()
                values = torch.cat([self.values[x:y] for x, y in zip(lo, hi)])
            else:
                values = self.values[:0]
            out.append(Batch(self.dense[a:b], JaggedBatch(self.keys, values, self.lengths[:, a:b].reshape(-1)), self.labels[a:b]))
        return out


class _Chunks(Dataset):
    """Map-style dataset whose item ``j`` is a list of consecutive batches (one worker task)."""

    def __init__(self, decoder: _Decoder, plan: EpochPlan, start: int, per_chunk: int) -> None:
        self.decoder, self.plan, self.start, self.per_chunk = decoder, plan, start, per_chunk
        # Chunk boundaries are aligned to the plan (not to ``start``) so a resumed run decodes
        # the same groups of samples as an uninterrupted one.
        self.first_chunk = start // per_chunk
        self.num_chunks = max(0, -(-plan.num_batches // per_chunk) - self.first_chunk)

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, j: int) -> PackedChunk:
        c = self.first_chunk + j
        first = max(c * self.per_chunk, self.start)
        stop = min((c + 1) * self.per_chunk, self.plan.num_batches)
        return self.decoder.chunk(self.plan, first, stop)


def _worker_context() -> Any:
    return mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


def _one_cpu_worker(_: int) -> None:
    """A loader worker is sized to one CPU (the trainer's threads have the others): pyarrow's
    decoding pool would otherwise start a thread per CPU next to them (torch already runs its
    workers single-threaded)."""
    pa.set_cpu_count(1)


class ShardedReader:
    """Batches of a prepared dataset for one rank; iterate it once per epoch.

    ``batch_size`` is the global batch (each rank yields its share, as ``ClickBatches`` does);
    ``rows`` restricts the reader to a row range of the dataset (file order), e.g. a held-out
    tail for evaluation.
    """

    def __init__(
        self,
        dataset: PreparedDataset,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        shuffle_window: int = 0,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        prefetch: int = 2,
        chunk_rows: int = 65_536,
        rows: tuple[int, int] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if batch_size < world_size:
            raise ValueError(f"batch_size {batch_size} is smaller than the world size {world_size}; every rank needs samples")
        if shuffle_window < 0 or prefetch < 1 or chunk_rows < 1 or num_workers < 0:
            raise ValueError("shuffle_window and num_workers must be >= 0, prefetch and chunk_rows >= 1")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.shuffle_window, self.seed, self.drop_last = shuffle, shuffle_window, seed, drop_last
        self.num_workers, self.prefetch, self.chunk_rows = num_workers, prefetch, chunk_rows
        self.rows = rows or (0, dataset.num_rows)
        self._groups = dataset.row_groups(*self.rows)
        self._decoder = _Decoder(dataset)
        self.epoch, self.next_batch = 0, 0

    # ------------------------------------------------------------------ plan
    @property
    def sparse_names(self) -> tuple[str, ...]:
        return self.dataset.sparse_names

    @property
    def num_samples(self) -> int:
        return self._groups.num_rows

    def plan(self, epoch: int) -> EpochPlan:
        g = self._groups
        order = np.arange(len(g.rows))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0x5A4D]).permutation(len(g.rows))
        rows = g.rows[order]
        begin = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        n = int(rows.sum())
        # Like ClickBatches: each rank takes its share of every global batch, so rank r reads
        # full * bs_r samples plus its share of the last, partial global batch.
        bs = [hi - lo for lo, hi in (_share(self.batch_size, self.world_size, r) for r in range(self.world_size))]
        full, rest = divmod(n, self.batch_size)
        if self.drop_last:
            rest = 0
        counts = [full * b + (hi - lo) for b, (lo, hi) in zip(bs, (_share(rest, self.world_size, r) for r in range(self.world_size)))]
        num_batches = full + (1 if rest else 0)
        ends = np.cumsum(counts)
        ranges = [(int(e - c), int(e)) for c, e in zip(counts, ends)]
        lo, hi = ranges[self.rank]
        # The (partial) groups overlapping [lo, hi) of the epoch stream.
        a = np.clip(lo - begin, 0, rows)
        b = np.clip(hi - begin, 0, rows)
        keep = b > a
        mine = RowGroups(g.shard[order][keep], g.group[order][keep], g.skip[order][keep] + a[keep], (b - a)[keep])
        starts = np.concatenate([[0], np.cumsum(mine.rows)[:-1]]).astype(np.int64)
        window = self.shuffle_window if self.shuffle else 0
        return EpochPlan(mine, starts, hi - lo, bs[self.rank], num_batches, window, (self.seed, epoch, self.rank))

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return self.plan(self.epoch).num_batches

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        self.epoch, self.next_batch = epoch, 0

    # ------------------------------------------------------------------ iteration
    def _per_chunk(self, plan: EpochPlan) -> int:
        target = max(self.chunk_rows, plan.window)
        per = max(1, target // max(plan.batch_size, 1))
        return per

    def loader(self, start_batch: int | None = None) -> Iterator[Batch]:
        """Batches of the current epoch from ``start_batch`` (default: the saved position)."""
        if start_batch is not None:
            self.next_batch = start_batch
        return iter(self)

    def __iter__(self) -> Iterator[Batch]:
        plan = self.plan(self.epoch)
        start = self.next_batch
        if not 0 <= start <= plan.num_batches:
            raise ReaderStateError(f"start batch {start} is outside epoch {self.epoch}'s {plan.num_batches} batches")
        chunks = _Chunks(self._decoder, plan, start, self._per_chunk(plan))
        if self.num_workers == 0:
            source: Any = (chunks[j] for j in range(len(chunks)))
        else:
            source = DataLoader(
                chunks,
                batch_size=None,
                shuffle=False,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch,
                persistent_workers=False,
                worker_init_fn=_one_cpu_worker,
                # Workers start from a clean process: a fork of one whose arrow or torch threads
                # hold a lock at that moment can hang in the child.
                multiprocessing_context=_worker_context(),
            )
        for chunk in source:
            for batch in chunk.batches():
                self.next_batch += 1
                yield batch
        self.epoch, self.next_batch = self.epoch + 1, 0

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset.fingerprint,
            "rows": list(self.rows),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def state_dict(self) -> dict[str, Any]:
        """The exact position: the next batch of this epoch, plus what the plan depends on.

        ``next_batch`` counts batches this reader has yielded; a consumer that fetches ahead
        (the training pipeline holds one batch in flight) saves the count it has trained on and
        resumes with ``loader(start_batch=...)`` instead, as the training loop does."""
        return {"epoch": self.epoch, "next_batch": self.next_batch, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.fingerprint()
        theirs = state.get("fingerprint", {})
        diff = [f"{k}: saved {theirs.get(k)!r}, now {v!r}" for k, v in mine.items() if theirs.get(k) != v]
        if diff:
            raise ReaderStateError(
                "the saved reader state belongs to a different dataset or reader setup ("
                + "; ".join(diff)
                + "); resume with the same data and settings, or start a new run"
            )
        epoch, nb = int(state["epoch"]), int(state["next_batch"])
        if nb < 0 or epoch < 0:
            raise ReaderStateError(f"saved reader position epoch {epoch}, batch {nb} is invalid")
        self.epoch, self.next_batch = epoch, nb
