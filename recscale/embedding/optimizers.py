"""Sparse row optimizers, each defined exactly once.

Every optimizer sees only the unique rows a batch touched: their current weights, their
summed gradients and their state rows, all gathered as float32 ``[U, ...]`` tensors. It updates
them in place; the storage writes them back. No tensor of table size is ever created, and the
same definition serves dense, sharded and cached row storage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from recscale.embedding.storage import RowStorage


@dataclass(frozen=True)
class SparseOptimizer(ABC):
    """Base: learning rate plus the per-row state each optimizer keeps."""

    lr: float = 0.01

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"{self.name}: lr must be > 0, got {self.lr}")

    name = "base"

    @abstractmethod
    def state_columns(self, dim: int) -> dict[str, int]:
        """Name -> columns per row of each state tensor (float32)."""

    # True when the optimizer keeps one statistic per row over the whole row (row-wise
    # Adagrad): a column shard then needs the full row's mean square, passed as row_mean_sq.
    uses_row_mean_sq = False

    @abstractmethod
    def update(
        self, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: int,
        row_mean_sq: torch.Tensor | None = None,
    ) -> None:
        """Update gathered rows ``w`` in place from summed gradients ``g``; ``step`` counts from 1.
        ``row_mean_sq`` ([U]) overrides ``mean(g^2)`` per row where only some columns are here."""

    def apply(
        self, storage: RowStorage, rows: torch.Tensor, g: torch.Tensor, step: int,
        row_mean_sq: torch.Tensor | None = None,
    ) -> None:
        """Update unique ``rows`` of ``storage``: gather, ``update``, scatter back."""
        w, state = storage.gather(rows)
        self.update(w, g, state, step, row_mean_sq)
        storage.scatter(rows, w, state)


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    name = "sgd"

    def state_columns(self, dim: int) -> dict[str, int]:
        return {}

    def update(self, w, g, state, step, row_mean_sq=None):
        w.add_(g, alpha=-self.lr)

    def apply(self, storage, rows, g, step, row_mean_sq=None):
        # Stateless: add straight into the stored rows, no gather and scatter.
        storage.add_rows(rows, g, alpha=-self.lr)


@dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM's row-wise Adagrad: one accumulator per row, ``G += mean(g^2)``."""

    eps: float = 1e-8
    name = "rowwise_adagrad"
    uses_row_mean_sq = True

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"sum_sq": 1}

    def update(self, w, g, state, step, row_mean_sq=None):
        acc = state["sum_sq"]
        acc.add_(g.square().mean(dim=1, keepdim=True) if row_mean_sq is None else row_mean_sq.view(-1, 1))
        w.addcdiv_(g, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Element-wise Adagrad: one accumulator per weight."""

    eps: float = 1e-8
    name = "adagrad"

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"sum_sq": dim}

    def update(self, w, g, state, step, row_mean_sq=None):
        acc = state["sum_sq"]
        acc.addcmul_(g, g)
        w.addcdiv_(g, acc.sqrt().add_(self.eps), value=-self.lr)


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Lazy (sparse) Adam with bias correction by the global step, eps placed as FBGEMM's
    ``EmbOptimType.ADAM`` places it: added to ``sqrt(v / (1 - beta2^t))``. torch.optim.SparseAdam
    adds it to ``sqrt(v)`` before the correction (``eps / sqrt(1 - beta2^t)`` in these terms), so
    the two differ where ``v`` is near eps squared: early, and on rarely seen rows."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    name = "adam"

    def state_columns(self, dim: int) -> dict[str, int]:
        return {"exp_avg": dim, "exp_avg_sq": dim}

    def update(self, w, g, state, step, row_mean_sq=None):
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        bc1 = 1 - self.beta1**step
        bc2 = 1 - self.beta2**step
        denom = (v / bc2).sqrt_().add_(self.eps)
        w.addcdiv_(m, denom, value=-self.lr / bc1)


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.name: cls for cls in (SGD, RowWiseAdagrad, Adagrad, Adam)
}


def make_optimizer(name: str, **kwargs: float) -> SparseOptimizer:
    """Build an optimizer by name with a clear error for an unknown name or option."""
    if name not in OPTIMIZERS:
        raise ValueError(f"embedding optimizer '{name}' is unknown; choose one of {sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[name]
    allowed = {f for f in cls.__dataclass_fields__}
    extra = set(kwargs) - allowed
    if extra:
        raise ValueError(f"embedding optimizer '{name}' has no option(s) {sorted(extra)}; allowed: {sorted(allowed)}")
    return cls(**kwargs)
