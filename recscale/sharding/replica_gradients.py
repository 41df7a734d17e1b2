"""Combining data-parallel replicas' row gradients, so that every replica applies one update.

Two ways, chosen per table and step by which moves fewer bytes; every rank decides alike from
one small gather of per-table counts of the rows each replica touched (U_r):
  * **gather**: every replica's touched rows with their summed gradients, sum(U_r) rows. Cheap
    when a batch touches few rows of a big table.
  * **dense reduce**: the table's whole gradient plus a touched flag per row (N rows), reduce-
    scattered as an all-to-all in which each rank sums its slice in rank order, then all-
    gathered: 2 N rows cross the links. Cheap when the table is small next to sum(U_r); this is
    the dense all-reduce that other stacks use for every data-parallel table.
Either way each row's parts are summed in rank order, so both give the same bits and the
replicas never drift. The planner prices the same rule (``dense_is_cheaper``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from recscale.comm.collectives import CommStats, all_gather_concat, all_to_all_async

if TYPE_CHECKING:
    from recscale.embedding.table_batched import TableGroup

Reduction = Literal["auto", "gather", "dense"]
REDUCTIONS: tuple[str, ...] = ("auto", "gather", "dense")


def dense_is_cheaper(rows: int, dim: int, touched_rows: float) -> bool:
    """A dense reduce moves 2 N (dim + 1) floats, a gather sum(U_r) (dim + 2) (each row's int64 id
    weighs two floats): the rule the runtime applies and the planner prices."""
    return 2 * rows * (dim + 1) < touched_rows * (dim + 2)


class ReplicaGradients:
    """The ``grad_reducer`` of data-parallel tables: ``(group, unique, summed) -> (rows, grads)``,
    every replica's part combined, identical on every rank (each row once for dense tables,
    once per touching replica in rank order for gathered ones)."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats | None = None, reduction: Reduction = "auto") -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: unknown '{reduction}'; choose one of {list(REDUCTIONS)}")
        self.group, self.stats, self.reduction = group, stats, reduction
        self._bounds: dict[int, torch.Tensor] = {}

    def __call__(self, g: TableGroup, unique: torch.Tensor, summed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pg = self.group
        if pg is None:
            return unique, summed
        world = dist.get_world_size(pg)
        bounds = self._bounds.get(id(g))
        if bounds is None:
            bounds = torch.tensor([*g.table_row_offsets, g.num_rows], dtype=torch.int64, device=unique.device)
            self._bounds[id(g)] = bounds
        n_tables = len(g.tables)
        table_of = torch.searchsorted(bounds, unique, right=True) - 1
        counts = torch.bincount(table_of, minlength=n_tables).view(1, n_tables)
        per_rank = all_gather_concat(counts, pg, None, "dp_grads.counts", sizes=[1] * world).tolist()
        dense = [self._dense(t.num_rows, g.dim, sum(row[i] for row in per_rank)) for i, t in enumerate(g.tables)]
        if not any(dense):
            return self._gather(unique, summed, [sum(row) for row in per_rank])
        is_dense = torch.tensor(dense, dtype=torch.bool, device=unique.device)[table_of]
        parts_rows, parts_grads = [], []
        gathered_sizes = [sum(n for n, d in zip(row, dense) if not d) for row in per_rank]
        if any(gathered_sizes):
            keep = ~is_dense
            rows, grads = self._gather(unique[keep], summed[keep], gathered_sizes)
            parts_rows.append(rows)
            parts_grads.append(grads)
        rows, grads = self._dense_reduce(g, [i for i, d in enumerate(dense) if d], unique[is_dense], table_of[is_dense],
                                         summed[is_dense], world)
        parts_rows.append(rows)
        parts_grads.append(grads)
        return torch.cat(parts_rows), torch.cat(parts_grads)

    def _dense(self, rows: int, dim: int, touched: int) -> bool:
        if self.reduction != "auto":
            return self.reduction == "dense"
        return dense_is_cheaper(rows, dim, touched)

    def _gather(self, unique: torch.Tensor, summed: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every replica's rows in rank order: the row ids, then their gradients, each gathered
        straight into one contiguous tensor. (Two collectives rather than one packed buffer:
        packing, unpacking and making the strided gradients contiguous again cost three more
        passes over every replica's rows, which measured 3-4x a collective's latency.)"""
        rows = all_gather_concat(unique, self.group, self.stats, "dp_grads.rows", sizes=sizes)
        return rows, all_gather_concat(summed, self.group, self.stats, "dp_grads", sizes=sizes)

    def _dense_reduce(self, g: TableGroup, tables: list[int], unique: torch.Tensor, table_of: torch.Tensor,
                      summed: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense tables' rows, laid end to end, with a last column counting the replicas
        that touched each row; rank d sums slice d of every replica's buffer in rank order."""
        dev, dim = unique.device, summed.shape[1]
        # group row -> position in the end-to-end buffer: a shift per table (O(tables), not
        # O(group rows): the group may also hold big gathered tables)
        shift = torch.zeros(len(g.tables), dtype=torch.int64)
        row_ids, total = [], 0
        for i in tables:
            start, n = g.table_row_offsets[i], g.tables[i].num_rows
            row_ids.append(torch.arange(start, start + n, device=dev))
            shift[i] = total - start
            total += n
        pos = unique + shift.to(dev)[table_of]
        buf = torch.zeros(total, dim + 1, dtype=torch.float32, device=dev)
        buf[pos, :dim] = summed.float()
        buf[pos, dim] = 1.0
        base, extra = divmod(total, world)
        slice_rows = [base + (1 if r < extra else 0) for r in range(world)]
        me = dist.get_rank(self.group)
        pending = all_to_all_async(buf, slice_rows, [slice_rows[me]] * world, self.group, self.stats, "dp_grads_reduce_scatter")
        pieces = pending.wait().view(world, slice_rows[me], dim + 1)
        mine = pieces[0].clone()
        for r in range(1, world):
            mine += pieces[r]
        full = all_gather_concat(mine, self.group, self.stats, "dp_grads_all_gather", sizes=slice_rows)
        hit = torch.nonzero(full[:, dim] > 0).view(-1)
        rows = torch.cat(row_ids)[hit]
        return rows, full[hit, :dim].to(summed.dtype)
