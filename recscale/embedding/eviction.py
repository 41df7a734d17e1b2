"""Which cached rows make room for missing ones: ``lru``, ``lfu`` and ``lookahead``.

A policy ranks the cache slots of one table shard; the highest-ranked unpinned slots are
evicted. Each keeps its bookkeeping in tensors over the slots, so ranking a cache of a million
rows is a few vector operations, not a loop.

``lookahead`` uses what the training pipeline already knows: the rows of the next
``lookahead_batches`` batches. A row needed within that window is evicted only when nothing
else is left, and then the one needed farthest ahead goes first (Belady's choice within the
window). Rows not needed in the window go first, least often looked up first (by the batches
that looked each row up since the start, cached or not: on skewed ids that count predicts the
next use far better than recency does), ties least recently used first.
"""

from __future__ import annotations

from typing import Literal

import torch

PolicyName = Literal["lru", "lfu", "lookahead"]
POLICIES: tuple[str, ...] = ("lru", "lfu", "lookahead")

_TICK_BITS = 40  # a tick per batch: 2^40 batches is beyond any run
_FAR = 1 << 61  # above every in-window rank
_COUNT_CAP = (1 << 20) - 1  # use counts saturate here, which keeps every key inside int64


class EvictionPolicy:
    """Per-slot recency and frequency; ``rank`` orders the slots for eviction."""

    def __init__(self, name: str, slots: int) -> None:
        if name not in POLICIES:
            raise ValueError(f"tiers.policy: expected one of {list(POLICIES)}, got {name!r}")
        self.name = name
        # int32: a tick per batch and a use per batch stay far below 2^31 in any run.
        self.last_use = torch.zeros(slots, dtype=torch.int32)
        self.freq = torch.zeros(slots, dtype=torch.int32)

    def admitted(self, slots: torch.Tensor) -> None:
        """``slots`` now hold new rows: their history starts afresh."""
        self.freq[slots] = 0

    def used(self, slots: torch.Tensor, tick: int) -> None:
        """``slots`` serve the lookup of batch ``tick`` (unique slots)."""
        self.last_use.index_fill_(0, slots, tick)
        self.freq.index_add_(0, slots, torch.ones(slots.numel(), dtype=torch.int32))

    def rank(self, next_use: torch.Tensor | None, uses: torch.Tensor | None = None) -> torch.Tensor:
        """Eviction key per slot, larger = evict first. ``next_use``: for each slot the index of
        the next window batch that needs it, or -1 for none; ``uses``: for each slot the batches
        that looked its row up so far (both ``lookahead`` only)."""
        age = (1 << _TICK_BITS) - 1 - self.last_use.to(torch.int64)  # older: larger
        if self.name == "lru":
            return age
        if self.name == "lfu":
            rare = ((1 << 20) - 1 - self.freq.to(torch.int64).clamp(max=(1 << 20) - 1)) << _TICK_BITS
            return rare + age
        if next_use is None:
            return age
        in_window = next_use >= 0
        beyond = _FAR + age
        if uses is not None:
            beyond = beyond + ((_COUNT_CAP - uses.to(torch.int64).clamp(max=_COUNT_CAP)) << _TICK_BITS)
        return torch.where(in_window, (next_use << _TICK_BITS) + age, beyond)

    def victims(self, k: int, evictable: torch.Tensor, next_use: torch.Tensor | None,
                uses: torch.Tensor | None = None) -> torch.Tensor:
        """The ``k`` evictable slots ranked highest (ties: the lower slot), ascending."""
        key = self.rank(next_use, uses)
        key = torch.where(evictable, key, torch.full_like(key, -1))
        n = key.numel()
        if k <= 0:
            return torch.empty(0, dtype=torch.int64)
        if k >= n:
            return torch.arange(n, dtype=torch.int64)
        # A selection, not a sort: the k-th largest key splits the slots; every larger key
        # goes, then the lowest slots of those equal to it (what a stable sort would pick).
        # Linear in the slots, where sorting a cache of millions each batch is not.
        cut = torch.kthvalue(key, n - k + 1).values
        above = (key > cut).nonzero().view(-1)
        tied = (key == cut).nonzero().view(-1)[: k - above.numel()]
        return torch.cat([above, tied]).sort().values
