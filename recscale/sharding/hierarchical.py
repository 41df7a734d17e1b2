"""Hierarchical output distribution of table-row-wise tables (ZionEX's TWRW on several hosts).

A table-row-wise table lives on the ranks of one host, split by rows; every rank there holds a
partial pooled sum for every sample of the job. Sent flat, each of those R partial sums would
cross the slow cross-host links to its source. Instead, two stages:

  1. reduce-scatter inside the host: rank (h, k) sends rank (h, j) its partial sums for the
     samples of the sources whose local index is j (on every host); rank (h, j) adds the R
     partials (in rank order, as the flat path adds them at the source);
  2. rank (h, j) sends the finished sums to the sources of local index j, in the same
     all-to-all that carries the other shards' outputs.

Cross-host bytes per rank fall R-fold. Backward mirrors it: each source sends the gradient of a
host's table-row-wise block to the rank of that host with its own local index, which passes it
to every rank of the host (an all-gather inside the host). Both extra exchanges are
all-to-alls of the embedding group in which only ranks of one host send each other anything,
so they run on any backend and through shared memory. Used only when there are several hosts:
on one host the flat path already moves the fewest bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from recscale.comm.collectives import CommStats, all_to_all_async
from recscale.comm.process_group import Topology


@dataclass(frozen=True)
class HostBlock:
    """The table-row-wise features one host serves, in one order every rank agrees on."""

    features: tuple[tuple[str, int], ...]  # (feature, dim)

    @property
    def dim(self) -> int:
        return sum(d for _, d in self.features)


class TableRowWiseHierarchy:
    """Index maps and the two extra exchanges; one per ``ShardedEmbeddingCollection``."""

    def __init__(self, topology: Topology, blocks: list[HostBlock], my_local_cols: torch.Tensor) -> None:
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
