"""Where embedding rows and their optimizer state live.

The table-batched operator never touches a weight buffer directly for updates; it asks a
``RowStorage`` to map row ids to lookup slots, to gather rows (weights and state, as float32)
and to scatter them back. ``DenseRowStorage`` keeps every row in one device buffer. A sharded
storage (only this rank's rows) or a tiered storage (a slow store behind a cache of hot rows,
where ``slots_for`` admits missing rows) implements the same four methods, so the model, the
optimizer definitions and the training loop do not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from recscale.host_memory import advise_huge_pages


class RowStorage(ABC):
    """Rows of one group of same-dim tables, addressed by group-global row id."""

    num_rows: int
    dim: int

    @property
    @abstractmethod
    def weight(self) -> torch.Tensor:
        """``[slots, dim]`` buffer that the forward lookup reads."""

    @abstractmethod
    def slots_for(self, rows: torch.Tensor) -> torch.Tensor:
        """Map row ids to slots of ``weight`` (identity for dense storage)."""

    @abstractmethod
    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """float32 copies of the weights and state of ``slots``."""

    @abstractmethod
    def scatter(self, slots: torch.Tensor, w: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Write updated rows back (rounded to the storage dtype)."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor, by name, for checkpoints and tests."""

    def add_rows(self, slots: torch.Tensor, delta: torch.Tensor, alpha: float = 1.0) -> None:
        """``rows[slots] += alpha * delta`` for unique slots (stateless optimizers)."""
        w, state = self.gather(slots)
        w.add_(delta, alpha=alpha)
        self.scatter(slots, w, state)


def _zeros(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """Optimizer state, on huge pages where the host offers them (it is read and written at
    the same random rows as the weights)."""
    out = torch.empty(rows, cols, dtype=torch.float32, device=device)
    advise_huge_pages(out)
    return out.zero_()


class DenseRowStorage(RowStorage):
    """All rows in one buffer on one device; optimizer state alongside, in float32."""

    def __init__(
        self,
        weight: torch.Tensor,
        state_columns: dict[str, int],
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [rows, dim], got shape {tuple(weight.shape)}")
        self.num_rows, self.dim = weight.shape
        self._weight = weight
        self._state = {name: _zeros(self.num_rows, cols, weight.device) for name, cols in state_columns.items()}

    @property
    def weight(self) -> torch.Tensor:
        return self._weight

    def slots_for(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def gather(self, slots):
        w = self._weight.index_select(0, slots)
        if w.dtype != torch.float32:
            w = w.float()
        return w, {k: v.index_select(0, slots) for k, v in self._state.items()}

    def scatter(self, slots, w, state):
        self._weight.index_copy_(0, slots, w.to(self._weight.dtype))
        for k, v in state.items():
            self._state[k].index_copy_(0, slots, v)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self._state

    def add_rows(self, slots, delta, alpha=1.0):
        if self._weight.dtype == torch.float32:
            self._weight.index_add_(0, slots, delta, alpha=alpha)
        else:
            super().add_rows(slots, delta, alpha)
