"""What the model asks of its embedding module, one process or sharded over ranks.

A step hands the module a batch's ids (``start_input_dist``), possibly a batch ahead so the ids
travel meanwhile; ``start_forward`` pools them and ``finish`` returns ``[B, sum of feature
dims]`` in ``feature_names`` order, so the caller can compute in between (the bottom MLP).
``global_batch_size`` is the step's samples over every rank, which the loss averages over.
The single-process operator (``TableBatchedEmbeddingBags``) has nothing to send: its input is
ready at once and its output when ``start_forward`` returns. The sharded one lives in
``recscale.sharding``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from recscale.sparse import JaggedBatch


class EmbeddingInput(Protocol):
    """One batch's ids as the module takes them: ready, or on their way to their owners."""

    @property
    def batch(self) -> JaggedBatch:
        """This rank's own batch."""
        ...

    def wait(self) -> JaggedBatch:
        """The ids this rank pools (waits for them once)."""
        ...

    @property
    def global_batch_size(self) -> int:
        ...


class PooledOutput(Protocol):
    """A step's pooled embeddings, possibly still on their way."""

    @property
    def global_batch_size(self) -> int:
        ...

    def finish(self) -> torch.Tensor:
        """``[local batch, sum of feature dims]`` (waits for it)."""
        ...


@runtime_checkable
class EmbeddingModule(Protocol):
    """The embedding module ``DLRM`` takes (an ``nn.Module`` that updates its rows itself in
    backward)."""

    feature_names: tuple[str, ...]
    feature_dims: tuple[int, ...]

    def validate(self, batch: JaggedBatch) -> None:
        """Raise SparseInputError naming the feature when ``batch`` does not fit the tables."""
        ...

    def start_input_dist(self, batch: JaggedBatch) -> EmbeddingInput:
        ...

    def start_forward(self, batch: JaggedBatch | EmbeddingInput) -> PooledOutput:
        ...

    def set_learning_rate(self, lr: float) -> None:
        ...

    def __call__(self, batch: JaggedBatch | EmbeddingInput) -> torch.Tensor:
        ...


@dataclass(frozen=True)
class LocalInput:
    """A batch for a module that pools it where it is: nothing to wait for."""

    batch: JaggedBatch

    def wait(self) -> JaggedBatch:
        return self.batch

    @property
    def global_batch_size(self) -> int:
        return self.batch.batch_size


@dataclass(frozen=True)
class ReadyOutput:
    """Pooled embeddings already computed."""

    pooled: torch.Tensor
    global_batch_size: int

    def finish(self) -> torch.Tensor:
        return self.pooled
