"""One training batch as it leaves the data layer: dense features, jagged ids, labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recscale.sparse import JaggedBatch


@dataclass(frozen=True)
class Batch:
    """``dense`` float32 ``[B, num_dense]``; ``sparse`` jagged ids; ``labels`` float32 ``[B]``."""

    dense: torch.Tensor
    sparse: JaggedBatch
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())
