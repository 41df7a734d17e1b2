"""Each row's last adaptive range search result, kept from one checkpoint to the next.

The adaptive quantizer's cold search walks each row's clipping range in from [min, max]: about
ten passes over the row at 2 bits. Between checkpoints a trained row's best range moves little,
so starting from where the last search ended and refining it (``range_search``'s warm start)
finds a range of about the same error for a third of the passes. A row's result is
two bytes, the steps of ``range / bins`` its range lies in from its min and from its max, in a
uint8 ``[rows, 2]`` array per table shard written: 2 bytes per row of the shard.

A row whose values have not changed since its last encoding (the row tracker's flags say so:
``changed`` clears the rows updated since the last checkpoint, whatever that checkpoint's codec)
is encoded on the same fp16 scale and offset again, with no search at all: a full checkpoint
rewrites mostly such rows, and a differential the rows changed in earlier intervals. That keeps 4
more bytes per row (the scale and offset) and a flag.

Only hints live here: a row's range is chosen from its own values and its hint, so a wrong or
missing hint costs a little error or a cold search, never a wrong checkpoint, and the lossless
codecs never read it. A kept row is the exception that needs the tracker: only a row known
unchanged is kept, so rows are kept only when the writer is told which rows changed (``tracked``),
and the flags are cleared before any encoding of the checkpoint that follows. Results depend only
on the rows, the hints and the changed rows, so they are deterministic for a run's sequence of
checkpoints. The writer thread reads and writes it, one checkpoint at a time; ``forget`` (after a
restore, or a change of codec) starts every row cold again.
"""

from __future__ import annotations

import torch

from recscale.checkpoint.quantize import NEVER_SEARCHED, Codec, RowRanges

ShardKey = tuple[str, int, int]  # (table, first row, first column) of a shard


class RangeMemory:
    """Per table shard, per local row, the last range search result (``NEVER_SEARCHED`` before
    the first), the last encoding's scale and offset and whether the row is unchanged since, for
    one codec: a different codec's steps mean something else."""

    def __init__(self) -> None:
        self._rows: dict[ShardKey, torch.Tensor] = {}
        self._scales: dict[ShardKey, torch.Tensor] = {}  # [rows, 2] fp16: scale, offset
        self._kept: dict[ShardKey, torch.Tensor] = {}
        self._codec: tuple | None = None

    def forget(self) -> None:
        """Every row cold again (dropped whole: a writer holding an old array updates that one)."""
        self._rows, self._scales, self._kept = {}, {}, {}

    def start(self, codec: Codec, key: ShardKey, num_rows: int, rows: torch.Tensor) -> RowRanges:
        """The memory of local ``rows`` of a shard of ``num_rows`` rows, copies to pass to
        ``Codec.encode_kept`` and then to ``store``."""
        ident = (codec.bits, codec.bins, codec.ratio)
        if ident != self._codec:
            self.forget()
            self._codec = ident
        table = self._rows.get(key)
        if table is None or table.shape[0] != num_rows:
            table = self._rows[key] = torch.full((num_rows, 2), NEVER_SEARCHED, dtype=torch.uint8)
            self._scales[key] = torch.zeros(num_rows, 2, dtype=torch.float16)
            self._kept[key] = torch.zeros(num_rows, dtype=torch.bool)
        sb = self._scales[key].index_select(0, rows)
        return RowRanges(table.index_select(0, rows), sb[:, 0].clone(), sb[:, 1].clone(),
                         self._kept[key].index_select(0, rows))

    def store(self, key: ShardKey, rows: torch.Tensor, found: RowRanges, tracked: bool) -> None:
        """Keep ``found`` for local ``rows``; ``tracked``: the next checkpoint's ``changed`` will
        name the rows updated meanwhile, so these may be kept until then."""
        table = self._rows.get(key)
        if table is not None:
            table.index_copy_(0, rows, found.found)
            self._scales[key].index_copy_(0, rows, torch.stack([found.scale, found.bias], 1))
            self._kept[key].index_fill_(0, rows, tracked)

    def changed(self, key: ShardKey, mask: torch.Tensor) -> None:
        """Rows of a shard (``mask``: bool per local row, on the CPU) updated since the last
        checkpoint: no longer kept."""
        kept = self._kept.get(key)
        if kept is not None and kept.shape[0] == mask.shape[0]:
            kept &= ~mask

    def kept_rows(self) -> int:
        return sum(int(k.sum()) for k in self._kept.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self._rows, self._scales, self._kept) for t in d.values())
