"""Batches through ``torch.utils.data``: map-style over batch indices, collated to ``Batch``.

A batch is built whole by one ``__getitem__`` call (the DataLoader runs with
``batch_size=None``), so worker processes produce ready jagged batches and the result does not
depend on how many workers there are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from recscale import faults
from recscale.data.batch import Batch
from recscale.data.criteo import ClickData
from recscale.data.synthetic import SyntheticClickData
from recscale.sparse import JaggedBatch


class ClickBatches(Dataset):
    """Fixed-size global batches of a click log, shuffled per epoch from (seed, epoch) when
    asked. With ``world_size > 1`` item ``i`` is this rank's share of global batch ``i`` (shares
    differ by at most one sample), so N ranks together see exactly the batches of one process."""

    def __init__(
        self,
        source: ClickData | SyntheticClickData,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        fault_point: bool = False,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        # Training batches: building one is a fault-injection point (``recscale.faults``), at the
        # step that trains it; evaluation batches are not.
        self.fault_point = fault_point
        self._order: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return len(self.source)

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(self.source.sparse_names)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of this epoch (call before making the epoch's loader)."""
        self.epoch = epoch
        self._order = None

    def __len__(self) -> int:
        n = self.num_samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _rank_share(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's consecutive part of samples [start, stop)."""
        base, extra = divmod(stop - start, self.world_size)
        lo = start + self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def _sample_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch, 0xC0FFEE])
            self._order = rng.permutation(self.num_samples)
        return self._order

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range [0, {len(self)})")
        if self.fault_point:
            faults.point("loader", self.epoch * len(self) + index + 1, worker=get_worker_info() is not None)
        src = self.source
        if isinstance(src, SyntheticClickData) and self.shuffle:
            # Shuffle whole batches of the stream: samples are i.i.d. already.
            index = int(np.random.default_rng([self.seed, self.epoch, 0xBA7C4]).permutation(len(self))[index])
        start = index * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        start, stop = self._rank_share(start, stop)
        if isinstance(src, SyntheticClickData):
            return src.make_samples(start, stop - start)
        rows = self._sample_order()[start:stop] if self.shuffle else slice(start, stop)
        return Batch(
            dense=torch.from_numpy(np.ascontiguousarray(src.dense[rows])),
            sparse=JaggedBatch.from_dense_ids(src.sparse_names, torch.from_numpy(np.ascontiguousarray(src.sparse[rows]))),
            labels=torch.from_numpy(np.ascontiguousarray(src.labels[rows])),
        )


def make_loader(
    dataset: ClickBatches, num_workers: int = 0, pin_memory: bool = False, start_batch: int = 0
) -> DataLoader:
    """A DataLoader over whole batches; workers prefetch two batches each.

    ``start_batch`` skips the first batches of the epoch without building them, so a run
    resumed from a checkpoint sees exactly the batches an uninterrupted run would."""
    if not 0 <= start_batch <= len(dataset):
        raise ValueError(f"start_batch {start_batch} is outside the epoch's {len(dataset)} batches")
    return DataLoader(
        dataset,
        batch_size=None,
        sampler=range(start_batch, len(dataset)) if start_batch else None,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers > 0 else None,
        persistent_workers=False,
    )
