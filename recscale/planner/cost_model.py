"""What one shard costs the rank that holds it: lookup and update time, its part of each
collective, and memory. Costs add up per rank, so a plan's predicted step time is the largest
per-rank sum plus what every rank pays alike (its own samples' ids and pooled outputs).

Model (per step, global batch B, world W, R ranks per host), for a shard of ``rows x cols`` of a
table with ``rows_t`` rows, dim ``d`` and pooling factor P:
  ids routed to the shard   n = B P (rows / rows_t for row-split types; B P / W for data-parallel)
  pooled rows produced      m = B, or B / W for data-parallel
  forward bytes             n cols e + m cols 4            (gather rows, write pooled sums)
  update bytes              2 U (cols e + state)           (U unique rows: read and write back)
  compute                   (fwd (1 + backward_factor) + update) / memory_bw + kernel overheads
  communication             ids in (n x 4), pooled out (m cols x wire_fwd), gradients in
                            (m cols x wire_bwd), each split between intra-host and cross-host
                            links by where the sources sit; data-parallel: gather of row grads
  memory                    rows cols (e + state per element) + rows x state per row
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from recscale.planner.hardware import Hardware


@dataclass(frozen=True)
class TableSpec:
    """A table as the planner sees it."""

    name: str
    rows: int
    dim: int
    pooling: float = 1.0  # mean ids per sample
    # Unique rows per lookup in a batch (1 = no repeats; skewed ids repeat, so fewer rows move).
    unique_fraction: float = 0.5
    element_bytes: int = 4
    state_bytes_per_row: float = 4.0  # row-wise Adagrad: one float per row
    state_bytes_per_element: float = 0.0  # Adagrad: 4, Adam: 8

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0 or self.pooling < 0:
            raise ValueError(f"table '{self.name}': rows and dim must be > 0 and pooling >= 0")

    @property
    def bytes(self) -> float:
        return self.rows * (self.dim * (self.element_bytes + self.state_bytes_per_element) + self.state_bytes_per_row)


@dataclass(frozen=True)
class Workload:
    batch_size: int  # global batch
    fwd_wire_bytes: float = 4.0  # per element of pooled outputs (fp32 4, fp16/bf16 2, int8 ~1)
    bwd_wire_bytes: float = 4.0
    id_bytes: float = 4.0  # int32 on the wire while every table has < 2^31 rows


@dataclass(frozen=True)
class ShardCost:
    compute_s: float
    comm_s: float
    memory_bytes: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def _link_time(nbytes: float, hw: Hardware) -> float:
    """Time for a rank to exchange ``nbytes`` with sources spread evenly over every rank."""
    w, r = hw.world_size, hw.ranks_per_host
    intra = (r - 1) / w
    cross = (w - r) / w
    return nbytes * (intra / hw.intra_host_bw + cross / hw.cross_host_bw)


def shard_cost(t: TableSpec, sharding_type: str, rows: int, cols: int, hw: Hardware, wl: Workload) -> ShardCost:
    b, w = wl.batch_size, hw.world_size
    memory = rows * (cols * (t.element_bytes + t.state_bytes_per_element) + t.state_bytes_per_row)
    if sharding_type == "data_parallel":
        n = b * t.pooling / w
        m = b / w
    else:
        share = rows / t.rows if sharding_type in ("row_wise", "table_row_wise") else 1.0
        n = b * t.pooling * share
        m = b if share == 1.0 else b * min(1.0, t.pooling * share)  # bags with an id in this shard
    unique = min(float(rows), n * t.unique_fraction)
    fwd = n * cols * t.element_bytes + m * cols * 4
    update = 2 * unique * (cols * (t.element_bytes + t.state_bytes_per_element) + t.state_bytes_per_row)
    compute = (fwd * (1 + hw.backward_factor) + update) / hw.memory_bw + 2 * hw.kernel_overhead_s
    if sharding_type == "data_parallel":
        # Every rank gathers every other rank's unique row gradients and applies them too.
        gathered = unique * (cols * 4 + 8) * (w - 1)
        comm = _link_time(gathered, hw) if w > 1 else 0.0
        compute += gathered / hw.memory_bw * 2
    else:
        traffic = n * wl.id_bytes + m * cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)
        comm = _link_time(traffic, hw)
    return ShardCost(compute, comm, memory)


def source_cost(tables: list[TableSpec], hw: Hardware, wl: Workload) -> float:
    """What every rank pays alike for its own samples: sending their ids and receiving their
    pooled outputs (and sending gradients back), plus one latency per collective."""
    b_local = wl.batch_size / hw.world_size
    nbytes = sum(b_local * t.pooling * wl.id_bytes + b_local * t.dim * (wl.fwd_wire_bytes + wl.bwd_wire_bytes) for t in tables)
    return _link_time(nbytes, hw) + 6 * hw.latency_s * math.log2(max(hw.world_size, 2))
