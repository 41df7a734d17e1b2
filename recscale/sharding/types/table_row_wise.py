"""Table-row-wise: row-wise inside one host (the least-loaded), table-wise across hosts.

Ids go only to the ranks of the owning host, bucketized by row range (as row-wise routes
them); partial sums come back from those ranks only, so the table's traffic never fans out over
every host.

Hierarchical output distribution (ZionEX's TWRW on several hosts). Every rank of the owning host
holds a partial pooled sum for every sample of the job. Sent flat, each of those R partial sums
would cross the slow cross-host links to its source. Instead, two stages:

  1. reduce-scatter inside the host: rank (h, k) sends rank (h, j) its partial sums for the
     samples of the sources whose local index is j (on every host); rank (h, j) adds the R
     partials (in rank order, as the flat path adds them at the source);
  2. rank (h, j) sends the finished sums to the sources of local index j, in the same
     all-to-all that carries the other shards' outputs.

Cross-host bytes per rank fall R-fold. Backward mirrors it: each source sends the gradient of a
host's table-row-wise block to the rank of that host with its own local index, which passes it
to every rank of the host (an all-gather inside the host). Both extra exchanges are
all-to-alls of the embedding group in which only ranks of one host send each other anything,
so they run on any backend and through shared memory. Used only when there are several hosts
and each such table has one shard on every rank of its host: on one host the flat path already
moves the fewest bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from recscale.comm.collectives import CommStats, all_to_all_async
from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, TypeRuntime, even_split, require_full_width, row_shards
from recscale.sharding.types.row_wise import RowWise

if TYPE_CHECKING:
    from recscale.sharding.context import ShardingContext


class TableRowWise(RowWise):
    """Routes ids as row-wise does; its own layout, checks and (several hosts) output stage."""

    name = "table_row_wise"

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        per_host = topology.ranks_per_host
        if topology.num_hosts < 2 or num_rows < per_host or per_host < 2:
            return []
        return [[(row, rows, 0, dim) for row, rows in even_split(num_rows, per_host)]]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        host = min(range(topology.num_hosts), key=lambda h: (sum(loads[r] for r in topology.ranks_of_host(h)), h))
        return row_shards(table, list(topology.ranks_of_host(host)), loads)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_width(table_plan, table)
        hosts = {s.rank // plan.ranks_per_host for s in table_plan.shards}
        if len(hosts) != 1:
            raise PlanError(f"table '{table.name}': table_row_wise shards must all be on one host, got hosts {sorted(hosts)}")

    def runtime(self, context: ShardingContext) -> TypeRuntime | None:
        hierarchy = _hierarchy(context) if context.hierarchical else None
        if hierarchy is None:
            return None
        runtime = TypeRuntime()
        runtime.output_stage = hierarchy
        return runtime


def _hierarchy(context: ShardingContext) -> TableRowWiseHierarchy | None:
    """The two-stage output path, when there are several hosts of several ranks and each
    table-row-wise table has one shard on every rank of its host (else None: the flat path; a
    host of one rank has no partial sums to reduce, and its stages would be exchanges with
    itself that still wait for every rank)."""
    topology = context.groups.topology
    plans = [table_plan for table_plan in context.plan.tables if table_plan.sharding_type == TableRowWise.name]
    if not plans or topology.num_hosts < 2 or topology.ranks_per_host < 2 or topology.world_size != context.world:
        return None
    blocks: list[list[tuple[str, int]]] = [[] for _ in range(topology.num_hosts)]
    for table_plan in plans:
        host = topology.host_of(table_plan.shards[0].rank)
        if sorted(s.rank for s in table_plan.shards) != topology.ranks_of_host(host):
            return None
        t = context.by_name[table_plan.table]
        blocks[host].extend((f, t.dim) for f in t.features)
    key_of = {sf.feature: sf.key for sf in context.served[context.rank] if sf.routes_by_row}
    mine = blocks[topology.host_of(context.rank)]
    cols = [context.local_col[key_of[f]] + c for f, d in mine for c in range(d)]
    return TableRowWiseHierarchy(
        topology, [HostBlock(tuple(b)) for b in blocks], torch.tensor(cols, dtype=torch.int64, device=context.device),
        frozenset(table_plan.table for table_plan in plans),
    )


@dataclass(frozen=True)
class HostBlock:
    """The table-row-wise features one host serves, in one order every rank agrees on."""

    features: tuple[tuple[str, int], ...]  # (feature, dim)

    @property
    def dim(self) -> int:
        return sum(d for _, d in self.features)


class TableRowWiseHierarchy:
    """Index maps and the two extra exchanges; one per ``ShardedEmbeddingCollection``."""

    def __init__(self, topology: Topology, blocks: list[HostBlock], my_local_cols: torch.Tensor,
                 tables: frozenset[str]) -> None:
        self.tables = tables  # the tables whose outputs take this path
        self.topology = topology
        self.blocks = blocks  # per host
        self.my_local_cols = my_local_cols  # my pooled-output columns of my host's block, in block order
        self.rank = topology.rank
        self.r = topology.ranks_per_host
        self.host = topology.host_of(self.rank)
        self.peers = set(topology.ranks_of_host(self.host))  # the only ranks the two stages exchange with

    def extra_cols(self, sender: int, receiver: int) -> int:
        """Block columns ``sender`` adds to its output for source ``receiver`` (stage 2)."""
        if sender % self.r != receiver % self.r:
            return 0
        return self.blocks[self.topology.host_of(sender)].dim

    def sources(self, local: int) -> list[int]:
        return [h * self.r + local for h in range(self.topology.num_hosts)]

    # ------------------------------------------------------------------ forward, stage 1
    def reduce_scatter(self, pooled: torch.Tensor, sizes: list[int], codec, group, stats: CommStats | None) -> torch.Tensor:
        """This rank's finished block sums for the sources of its own local index, in source
        order: ``[sum of their batch sizes, block dim]`` (a collective: every rank calls it)."""
        world, dim = self.topology.world_size, self.blocks[self.host].dim
        starts = list(accumulate(sizes, initial=0))
        width = codec.row_bytes(dim)
        part = pooled.index_select(1, self.my_local_cols) if dim else pooled.new_zeros(pooled.shape[0], 0)
        chunks, send = [], []
        for d in range(world):
            if dim and d in self.peers:
                rows = torch.cat([part[starts[s] : starts[s] + sizes[s]] for s in self.sources(d % self.r)])
                chunks.append(codec.encode(rows).reshape(-1))
                send.append(rows.shape[0] * width)
            else:
                send.append(0)
        mine = sum(sizes[s] for s in self.sources(self.rank % self.r))
        recv = [mine * width if dim and d in self.peers else 0 for d in range(world)]
        payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=pooled.device)
        got = all_to_all_async(payload, send, recv, group, stats, "twrw_reduce_scatter").wait()
        total = None
        for d, piece in enumerate(torch.split(got, recv)):
            if recv[d]:
                p = codec.decode(piece.view(mine, width), dim)
                total = p if total is None else total + p
        return total if total is not None else pooled.new_zeros(mine, dim)

    # ------------------------------------------------------------------ backward, stage 1
    def all_gather(self, grads: torch.Tensor, sizes: list[int], codec, group, stats: CommStats | None) -> torch.Tensor:
        """From this rank's block gradients of the sources of its local index (source order),
        every source's block gradient on every rank of the host: ``[sum(sizes), block dim]``."""
        world, dim = self.topology.world_size, self.blocks[self.host].dim
        width = codec.row_bytes(dim)
        mine = codec.encode(grads).reshape(-1) if dim else torch.zeros(0, dtype=torch.uint8, device=grads.device)
        send = [mine.numel() if dim and d in self.peers else 0 for d in range(world)]
        payload = torch.cat([mine] * sum(1 for n in send if n)) if dim else mine
        counts = [sum(sizes[s] for s in self.sources(d % self.r)) for d in range(world)]
        recv = [counts[d] * width if dim and d in self.peers else 0 for d in range(world)]
        got = all_to_all_async(payload, send, recv, group, stats, "twrw_grad_all_gather").wait()
        out = grads.new_zeros(sum(sizes), dim)
        if not dim:
            return out
        starts = list(accumulate(sizes, initial=0))
        for d, piece in enumerate(torch.split(got, recv)):
            if not recv[d]:
                continue
            block = codec.decode(piece.view(counts[d], width), dim)
            pos = 0
            for s in self.sources(d % self.r):
                out[starts[s] : starts[s] + sizes[s]] = block[pos : pos + sizes[s]]
                pos += sizes[s]
        return out
