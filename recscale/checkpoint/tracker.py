"""Modified-row tracking: which rows changed since the last checkpoint, since the baseline, and
since the rows were initialised.

The table-batched backward sets ``TableGroup.touched[row] = 1`` for every row it updates (one
byte per row, only while a tracker is attached). At each checkpoint the tracker reads those
flags, folds them into the since-baseline and since-initialisation flags and clears them, as the
policy requires. The since-initialisation flags let a full checkpoint that leaves out rows still
at their initial values copy and write only the others, without regenerating every initial row
to compare.

A group on the SSD tier (``TieredRowStorage``) updates cache slots, not rows: its ``touched``
has one flag per slot, and the storage moves a slot's flag to its row whenever the slot takes
another row, so rows written back to the tier file since the last checkpoint still count.
"""

from __future__ import annotations

import torch

from recscale.checkpoint.shards import LocalShard, embedding_modules
from recscale.embedding.tiered import TieredRowStorage

_SCAN_ROWS = 65536  # rows compared with their initial values at a time after a restore


class RowTracker:
    def __init__(self, shards: list[LocalShard]) -> None:
        self.shards = shards
        self._since_base: dict[int, torch.Tensor] = {}
        self._since_init: dict[int, torch.Tensor] = {}
        for m in embedding_modules(shards):
            for g in m.groups:
                if isinstance(g.storage, TieredRowStorage):
                    g.touched = torch.zeros(g.storage.weight.shape[0], dtype=torch.uint8)
                    flags = g.storage.track_changes(g.touched)
                else:
                    g.touched = flags = torch.zeros(g.storage.num_rows, dtype=torch.uint8,
                                                    device=g.storage.weight.device)
                self._since_base[id(g)] = torch.zeros_like(flags)
                self._since_init[id(g)] = torch.zeros_like(flags)

    @staticmethod
    def _flags(g) -> torch.Tensor:
        """The group's per-row flags: rows updated since they were last cleared."""
        assert g.touched is not None, "tracking is off"
        return g.storage.changed_rows() if isinstance(g.storage, TieredRowStorage) else g.touched

    def detach(self) -> None:
        """Stop tracking (backward no longer marks rows)."""
        for m in embedding_modules(self.shards):
            for g in m.groups:
                g.touched = None
                if isinstance(g.storage, TieredRowStorage):
                    g.storage.track_changes(None)

    def shard_mask(self, shard: LocalShard, kind: str) -> torch.Tensor | None:
        """Rows of ``shard`` (local indices) to write for a checkpoint of ``kind``; None = all."""
        if kind == "full":
            return None
        g, off = shard.group()
        touched = self._flags(g)[off : off + shard.num_rows]
        if kind == "incremental":
            return touched.bool()
        return (touched | self._since_base[id(g)][off : off + shard.num_rows]).bool()

    def changed_this_interval(self, shard: LocalShard) -> torch.Tensor:
        """Rows of ``shard`` updated since the last checkpoint: a bool copy on the CPU (``advance``
        clears the flags it is taken from)."""
        g, off = shard.group()
        return self._flags(g)[off : off + shard.num_rows].to("cpu", torch.bool, copy=True)

    def changed_since_init(self, shard: LocalShard) -> torch.Tensor:
        """Rows of ``shard`` updated since initialisation (or restored to other values): a
        superset of the rows that differ from their initial values, so a full checkpoint that
        leaves out the rest restores exactly."""
        g, off = shard.group()
        sl = slice(off, off + shard.num_rows)
        return (self._flags(g)[sl] | self._since_init[id(g)][sl]).bool()

    def mark_off_initial(self, seed: int) -> None:
        """After a restore: flag every row that differs from its initial values for ``seed`` or
        has optimizer state (one pass over the tables, block by block)."""
        from recscale.checkpoint.writer import off_initial  # the writer's definition of "initial"

        for s in self.shards:
            g, off = s.group()
            flags = self._since_init[id(g)]
            for a in range(0, s.num_rows, _SCAN_ROWS):
                b = min(a + _SCAN_ROWS, s.num_rows)
                w, states = s.read_rows(torch.arange(a, b))
                rows = off_initial(s.table, seed, s.row_offset + a, s.col_offset, w, states)
                if rows.size:
                    flags[off + a + torch.from_numpy(rows).to(flags.device)] = 1

    def changed_cells(self, kind: str) -> tuple[int, int]:
        """(cells a checkpoint of ``kind`` would hold, all cells) over the shards this rank writes."""
        changed = total = 0
        for s in self.shards:
            if not s.writer:
                continue
            mask = self.shard_mask(s, kind)
            changed += s.cells if mask is None else int(mask.sum()) * s.num_cols
            total += s.cells
        return changed, total

    def advance(self, kind: str) -> None:
        """After a checkpoint of ``kind``: a baseline clears the since-baseline set; otherwise
        the interval's changes join it; either way they join the since-initialisation set and
        the interval starts afresh."""
        for m in embedding_modules(self.shards):
            for g in m.groups:
                flags = self._flags(g)
                base = self._since_base[id(g)]
                if kind == "full":
                    base.zero_()
                else:
                    base.bitwise_or_(flags)
                self._since_init[id(g)].bitwise_or_(flags)
                flags.zero_()
