"""Each row's last adaptive range search result, kept from one checkpoint to the next.

The adaptive quantizer's cold search walks each row's clipping range in from [min, max]: about
ten passes over the row at 2 bits. Between checkpoints a trained row's best range moves little,
so starting from where the last search ended and refining it (``range_search``'s warm start)
finds a range of about the same error for a third of the passes. A row's result is
two bytes, the steps of ``range / bins`` its range lies in from its min and from its max, in a
uint8 ``[rows, 2]`` array per table shard written: 2 bytes per row of the shard.

Only hints live here: a row's range is chosen from its own values and its hint, so a wrong or
missing hint costs a little error or a cold search, never a wrong checkpoint, and the lossless
codecs never read it. Results depend only on the rows and the hints, so they are deterministic
for a run's sequence of checkpoints. The writer thread reads and writes it, one checkpoint at a
time; ``forget`` (after a restore, or a change of codec) starts every row cold again.
"""

from __future__ import annotations

import torch

from recscale.checkpoint.quantize import NEVER_SEARCHED, Codec

ShardKey = tuple[str, int, int]  # (table, first row, first column) of a shard


class RangeMemory:
    """Per table shard, per local row, the last range search result (``NEVER_SEARCHED`` before
    the first), for one codec: a different codec's steps mean something else."""

    def __init__(self) -> None:
        self._rows: dict[ShardKey, torch.Tensor] = {}
        self._codec: tuple | None = None

    def forget(self) -> None:
        """Every row cold again (dropped whole: a writer holding an old array updates that one)."""
        self._rows = {}

    def start(self, codec: Codec, key: ShardKey, num_rows: int, rows: torch.Tensor) -> torch.Tensor:
        """The stored results of local ``rows`` of a shard of ``num_rows`` rows, a copy to pass
        to ``Codec.encode`` and then to ``store``."""
        ident = (codec.bits, codec.bins, codec.ratio)
        if ident != self._codec:
            self.forget()
            self._codec = ident
        table = self._rows.get(key)
        if table is None or table.shape[0] != num_rows:
            table = self._rows[key] = torch.full((num_rows, 2), NEVER_SEARCHED, dtype=torch.uint8)
        return table.index_select(0, rows)

    def store(self, key: ShardKey, rows: torch.Tensor, found: torch.Tensor) -> None:
        table = self._rows.get(key)
        if table is not None:
            table.index_copy_(0, rows, found)

    def nbytes(self) -> int:
        return sum(t.numel() for t in self._rows.values())
