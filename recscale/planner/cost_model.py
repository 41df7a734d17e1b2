"""What one shard costs the rank that holds it: lookup and update time, its part of each
collective, and memory. Costs add up per rank, so a plan's predicted step time (the embedding
part of a training step: input distribution, pooled lookup, output distribution, backward with
the fused update) is the largest per-rank sum plus what every rank pays alike.

Model (per step, global batch B, world W, R ranks per host), for a shard of ``rows x cols`` of a
table with ``rows_t`` rows, dim ``d``, pooling factor P and unique fraction u:
  ids routed to the shard   n = B P (x rows / rows_t for row-split types; B P / W for data-parallel)
  pooled bags produced      m = B (every source sample has a bag per shard), B / W data-parallel
  unique rows updated       U = min(rows, u n)
  bytes moved               (n cols e + m cols 4)(1 + backward_factor) + 2 U (cols e + state)
  compute                   bytes / memory_bw + n id_s + U row_s + m bag_s + 2 kernel_overhead_s
                            (+ B P / W route_id_s for row-split shards: the source bucketizes;
                            + n column_stat_id_s for column shards of a row-wise optimizer;
                            data-parallel: + a second pass over the W U gathered row gradients)
  communication             ids in (n x id bytes), pooled out (m cols x wire_fwd), gradients in
                            (m cols x wire_bwd), split between intra-host and cross-host links
                            by where the sources sit; data-parallel: gather of row gradients
  memory                    rows cols (e + state per element) + rows x state per row
Every rank alike (``source_cost``): its own samples' ids out, pooled outputs in and gradients
out, ``feature_s`` per feature, ``latency_s`` per collective, ``step_overhead_s``.
The constants are hardware figures (``Hardware``): the GPU presets set only bandwidths, latency
and kernel overhead; ``recscale calibrate`` measures all of them on this machine.
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


def _others_link_time(nbytes: float, hw: Hardware) -> float:
    """Time for a rank to receive ``nbytes`` spread evenly over the *other* ranks."""
    w, r = hw.world_size, hw.ranks_per_host
    if w == 1:
        return 0.0
    return nbytes * ((r - 1) / (w - 1) / hw.intra_host_bw + (w - r) / (w - 1) / hw.cross_host_bw)


def shard_cost(t: TableSpec, sharding_type: str, rows: int, cols: int, hw: Hardware, wl: Workload) -> ShardCost:
    b, w = wl.batch_size, hw.world_size
    row_bytes = cols * (t.element_bytes + t.state_bytes_per_element) + t.state_bytes_per_row
    memory = rows * row_bytes
    routes = sharding_type in ("row_wise", "table_row_wise")
    if sharding_type == "data_parallel":
        n, m = b * t.pooling / w, b / w
    else:
        n, m = b * t.pooling * (rows / t.rows if routes else 1.0), float(b)
    unique = min(float(rows), n * t.unique_fraction)
    nbytes = (n * cols * t.element_bytes + m * cols * 4) * (1 + hw.backward_factor) + 2 * unique * row_bytes
    compute = nbytes / hw.memory_bw + n * hw.id_s + unique * hw.row_s + m * hw.bag_s + 2 * hw.kernel_overhead_s
    if routes:
        compute += b * t.pooling / w * hw.route_id_s
    if sharding_type == "column_wise" and cols < t.dim and t.state_bytes_per_row > 0:
        compute += n * hw.column_stat_id_s
    if sharding_type == "data_parallel":
        # Every rank gathers every rank's unique row gradients (its own included), sums them
        # (a second sort and pooling pass over W U rows) and updates the other ranks' rows too.
        others = unique * (w - 1)
        comm = _others_link_time(others * (cols * 4 + 8), hw)
        compute += unique * w * (hw.id_s + cols * 4 * 2 / hw.memory_bw) + others * (hw.row_s + 2 * row_bytes / hw.memory_bw)
    else:
        traffic = n * wl.id_bytes + m * cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)
        comm = _link_time(traffic, hw)
    return ShardCost(compute, comm, memory)


def collectives_per_step(kinds: dict[str, str], dims: dict[str, int], weighted: bool = False) -> int:
    """Collectives one step issues: batch sizes, lengths, ids, (weights), outputs, gradients;
    each operator group of data-parallel tables (one per dim) adds two gathers of two
    collectives each (sizes, then rows or gradients); column shards of a row-wise optimizer
    state add two such gathers per step."""
    n = 5 + int(weighted)
    n += 4 * len({dims[t] for t, k in kinds.items() if k == "data_parallel"})
    if "column_wise" in kinds.values():
        n += 4
    return n


def source_cost(tables: list[TableSpec], hw: Hardware, wl: Workload, kinds: dict[str, str] | None = None) -> float:
    """What every rank pays alike for its own samples: sending their ids and receiving their
    pooled outputs (and sending gradients back), per-feature work, one latency per collective.
    ``kinds`` maps table name to sharding type (data-parallel tables stay local)."""
    kinds = kinds or {}
    b_local = wl.batch_size / hw.world_size
    nbytes = sum(
        b_local * t.pooling * wl.id_bytes + b_local * t.dim * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)
        for t in tables
        if kinds.get(t.name) != "data_parallel"
    )
    coll = collectives_per_step(kinds, {t.name: t.dim for t in tables}) if hw.world_size > 1 else 0
    return (
        _link_time(nbytes, hw)
        + coll * hw.latency_s * math.log2(max(hw.world_size, 2))
        + len(tables) * hw.feature_s
        + hw.step_overhead_s
    )
