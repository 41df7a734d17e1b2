"""What one shard costs the rank that holds it: lookup and update time, its part of each
collective, and memory. Costs add up per rank, so a plan's predicted step time (the embedding
part of a training step: input distribution, pooled lookup, output distribution, backward with
the fused update) is the largest per-rank sum plus what every rank pays alike.

Model (per step, global batch B, world W, R ranks per host), for a shard of ``rows x cols`` of a
table with ``rows_t`` rows, dim ``d``, pooling factor P and unique fraction u:
  ids routed to the shard   n = B P (x rows / rows_t for row-split types; B P / W for data-parallel)
  pooled bags produced      m = B (every source sample has a bag per shard), B / W data-parallel
  unique rows updated       U = min(rows, u n); data-parallel: the replica's own U from a Zipf
                            model of its B/W samples, and every row of the global batch updated
  bytes moved               (n max(cols e, min_row_read_bytes) + m cols 4)(1 + backward_factor)
                            + 2 U (cols e + state)
  compute                   bytes / memory_bw + n id_s + U row_s + m bag_s + 2 kernel_overhead_s
                            + 2 U row bytes cold_byte_s x the shard's share beyond the
                            rank's cache (``cold_fraction``: those rows come from DRAM, looked
                            up and then updated)
                            (+ B P / W route_id_s for row-split shards: the source bucketizes;
                            + n column_stat_id_s + column_stat_shard_s for column
                            shards of a row-wise optimizer;
                            data-parallel: + a second pass over the W U gathered row gradients,
                            and replica_byte_s per byte combined across replicas (W U rows of
                            cols x 4 + 8 bytes gathered, or a dense reduce's buffer in and out);
                            + n dist_id_s + m cols dist_value_s if not data-parallel: the
                            owner's side of the input and output distribution)
  communication             ids in (n x id bytes), pooled out (m cols x wire_fwd), gradients in
                            (m cols x wire_bwd), split between intra-host and cross-host links
                            by where the sources sit; table-row-wise on several hosts: pooled
                            outputs reduce-scattered inside the host first, so 1/R of them
                            cross hosts; data-parallel: gather of row gradients, or a dense
                            reduce-scatter + all-gather of the table's gradient where that moves
                            fewer bytes (``dense_is_cheaper``, the runtime's rule)
  memory                    rows cols (e + state per element) + rows x state per row
Every rank alike (``source_cost``): its own samples' ids out, pooled outputs in and gradients
out (link time for every shard as if it were on another rank: a row shard sends each source
a partial output of its own; plus dist_id_s per id and dist_value_s per pooled value for
tables that are not data-parallel), ``feature_s`` per feature, ``route_table_s`` per row-split
table (``routing_s``), ``latency_s`` per collective,
``group_s`` per data-parallel operator group (one per dim), ``step_overhead_s``. Per rank, on
top of its shards: ``group_s`` per operator group it runs (``group_key``: its shards' widths).
A shard's owner gets back the link time of its own samples' share of the shard (1/W of its
traffic), which never leaves the rank: so of two ranks, the one holding every table exchanges
only the other rank's samples, as it does.
The constants are hardware figures (``Hardware``): the GPU presets set only bandwidths, latency
and kernel overhead; ``recscale calibrate`` measures all of them on this machine.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from recscale.planner.hardware import Hardware
from recscale.sharding.types import SHARDING_TYPES
from recscale.sharding.replica_gradients import dense_is_cheaper


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
    # What one source rank exchanges with this shard per step (its samples' ids out, their
    # outputs in, gradients out); every rank pays it (``source_cost``), the owner gets it back.
    source_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def _link_time(nbytes: float, hw: Hardware) -> float:
    """Time for a rank to exchange ``nbytes`` with sources spread evenly over every rank."""
    w, r = hw.world_size, hw.ranks_per_host
    intra = (r - 1) / w
    cross = (w - r) / w
    return nbytes * (intra / hw.intra_host_bw + cross / hw.cross_host_bw)


def source_link_s(nbytes: float, hw: Hardware) -> float:
    """A source rank's link time for ``nbytes`` exchanged with shards on other ranks (spread
    evenly over them): what ``ShardCost.source_bytes`` costs every rank."""
    return _others_link_time(nbytes, hw)


def _others_link_time(nbytes: float, hw: Hardware) -> float:
    """Time for a rank to receive ``nbytes`` spread evenly over the *other* ranks."""
    w, r = hw.world_size, hw.ranks_per_host
    if w == 1:
        return 0.0
    return nbytes * ((r - 1) / (w - 1) / hw.intra_host_bw + (w - r) / (w - 1) / hw.cross_host_bw)


@functools.lru_cache(maxsize=4096)
def _zipf_ranks(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Row popularity ranks 1..rows as (representative rank, count) buckets: exact for the
    first 1024, then 512 log-spaced buckets (enough for sums over 10^8 rows to ~0.1%)."""
    head = np.arange(1, min(rows, 1024) + 1, dtype=np.float64)
    reps, counts = [head], [np.ones_like(head)]
    if rows > 1024:
        edges = np.unique(np.geomspace(1025, rows + 1, 513).round())
        reps.append(np.sqrt(edges[:-1] * (edges[1:] - 1)))
        counts.append(np.diff(edges))
    return np.concatenate(reps), np.concatenate(counts)


def _zipf_unique(rows: int, alpha: float, ids: float) -> float:
    reps, counts = _zipf_ranks(rows)
    w = reps**-alpha
    p = w / float((w * counts).sum())
    return float((counts * -np.expm1(-ids * p)).sum())


@functools.lru_cache(maxsize=65536)
def unique_rows(rows: int, unique_fraction: float, batch_ids: float, ids: float) -> float:
    """Distinct rows among ``ids`` lookups of a table of ``rows`` rows, given
    ``unique_fraction`` measured over ``batch_ids`` lookups (the global batch). Skewed ids repeat
    more the more ids there are, so a data-parallel replica's share of the batch (B/W samples)
    has a *higher* unique fraction than the global batch. Model: Zipf-distributed ids over the
    table's rows, with the exponent fitted so that the global batch has ``unique_fraction x
    batch_ids`` distinct rows."""
    if ids <= 0:
        return 0.0
    if batch_ids <= 0 or ids >= batch_ids:
        return min(float(rows), ids * unique_fraction)
    target = unique_fraction * batch_ids
    lo, hi = 0.0, 4.0  # distinct rows fall as the exponent grows
    if _zipf_unique(rows, lo, batch_ids) <= target:
        hi = lo
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _zipf_unique(rows, mid, batch_ids) > target:
            lo = mid
        else:
            hi = mid
    alpha = 0.5 * (lo + hi)
    # scale so the model reproduces the measured global-batch figure exactly
    return min(float(rows), _zipf_unique(rows, alpha, ids) * target / max(_zipf_unique(rows, alpha, batch_ids), 1e-9))


def cold_fraction(shard_bytes: float, cache_bytes: float) -> float:
    """The share of a shard's rows that cannot stay in the rank's share of the cache."""
    return max(0.0, 1.0 - cache_bytes / shard_bytes) if shard_bytes > 0 else 0.0


def group_key(t: TableSpec, sharding_type: str, cols: int) -> tuple[int, int, bool]:
    """The operator group a shard joins on its rank (``embedding.table_batched.group_tables``):
    shards of one width and element type share a buffer, so one lookup, backward and update;
    column shards of a row-wise optimizer get groups apart (their update needs the whole row)."""
    return cols, t.element_bytes, sharding_type == "column_wise" and cols < t.dim and t.state_bytes_per_row > 0


def groups_per_rank(shards: Iterable[tuple[int, TableSpec, str, int]]) -> dict[int, int]:
    """How many operator groups each rank runs for ``shards`` given as (rank, table, sharding
    type, columns): one per ``group_key``, and one per dim of its data-parallel tables."""
    keys: dict[int, set] = {}
    for rank, t, kind, cols in shards:
        keys.setdefault(rank, set()).add(("dp", t.dim) if kind == "data_parallel" else group_key(t, kind, cols))
    return {rank: len(k) for rank, k in keys.items()}


def shard_cost(t: TableSpec, sharding_type: str, rows: int, cols: int, hw: Hardware, wl: Workload) -> ShardCost:
    b, w = wl.batch_size, hw.world_size
    row_bytes = cols * (t.element_bytes + t.state_bytes_per_element) + t.state_bytes_per_row
    memory = rows * row_bytes
    routes = SHARDING_TYPES[sharding_type].routes_by_row
    if sharding_type == "data_parallel":
        n, m = b * t.pooling / w, b / w
    else:
        n, m = b * t.pooling * (rows / t.rows if routes else 1.0), float(b)
    unique = min(float(rows), n * t.unique_fraction)  # rows this shard's own ids touch
    updated = unique
    if sharding_type == "data_parallel":
        unique, updated = _replica_rows(t, hw, wl)
    read = max(cols * t.element_bytes, hw.min_row_read_bytes)
    nbytes = (n * read + m * cols * 4) * (1 + hw.backward_factor) + 2 * updated * row_bytes
    compute = nbytes / hw.memory_bw + n * hw.id_s + updated * hw.row_s + m * hw.bag_s + 2 * hw.kernel_overhead_s
    if hw.cold_byte_s:
        compute += (unique + updated) * row_bytes * cold_fraction(memory, hw.cache_bytes) * hw.cold_byte_s
    if sharding_type != "data_parallel":  # ordering the ids it receives, packing its outputs
        compute += n * hw.dist_id_s + m * cols * hw.dist_value_s
    if routes:
        compute += b * t.pooling / w * hw.route_id_s
    if sharding_type == "column_wise" and cols < t.dim and t.state_bytes_per_row > 0:
        compute += n * hw.column_stat_id_s + hw.column_stat_shard_s
    # One source's share: 1/W of the ids and outputs; every source gets a partial output from
    # each row shard, and from a hierarchical table-row-wise shard 1/R of its finished sums.
    hier = sharding_type == "table_row_wise" and hw.num_hosts > 1 and t.rows >= hw.ranks_per_host
    out_cols = cols / hw.ranks_per_host if hier else cols
    source = 0.0 if sharding_type == "data_parallel" else (n * wl.id_bytes + m * out_cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)) / w
    if sharding_type == "data_parallel" and _dense_rule(t, hw, unique):
        # ``replica_gradients.py``, dense reduce: the table's gradient plus a touched column,
        # reduce-scattered (an all-to-all, then a sum of W slices) and all-gathered; about six
        # passes over the buffer (zero, fill, pack, sum, gather, scan). One buffer serves all
        # such tables of a dim: no per-table kernels.
        buf = rows * (cols + 1) * 4.0
        comm = _others_link_time(2 * buf * (w - 1) / w, hw)
        compute += 6 * buf / hw.memory_bw + 2 * buf * hw.replica_byte_s
    elif sharding_type == "data_parallel":
        # ``replica_gradients.py``, gather: every rank gathers every replica's unique rows and
        # their gradients (int64 row + fp32 values), and sums them (a second sort and pooling
        # pass over the W x U gathered rows) before updating the union (``updated`` above).
        comm = _others_link_time(unique * (w - 1) * (cols * 4 + 8), hw)
        compute += unique * w * (hw.id_s + cols * 4 * 2 / hw.memory_bw + (cols * 4 + 8) * hw.replica_byte_s)
    elif hier:
        # Hierarchical (``sharding/types/table_row_wise.py``): the partial sums of all B samples are
        # reduce-scattered inside the host, then this rank's 1/R of the finished sums goes to
        # its sources, (H-1)/H of them on other hosts; gradients come back the same way. (A
        # table with fewer rows than the host has ranks cannot have a shard on each: flat.)
        r, h = hw.ranks_per_host, hw.num_hosts
        out = m * cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)
        comm = _link_time(n * wl.id_bytes, hw) + out * (r - 1) / r / hw.intra_host_bw + out / r * (h - 1) / h / hw.cross_host_bw
    else:
        traffic = n * wl.id_bytes + m * cols * (wl.fwd_wire_bytes + wl.bwd_wire_bytes)
        comm = _link_time(traffic, hw)
    # ``source_cost`` charges every rank its samples' exchange with every shard as if the shard
    # were elsewhere; the owner's own samples never leave it, so it gets that share back: of
    # two ranks, the one holding every table exchanges only the other rank's samples.
    comm -= _others_link_time(source, hw)
    return ShardCost(compute, comm, memory, source)


def _replica_rows(t: TableSpec, hw: Hardware, wl: Workload) -> tuple[float, float]:
    """A data-parallel replica's distinct rows (it sees B/W samples: more distinct rows per id
    than the global batch) and the rows every replica updates (any replica touched: the
    global batch's set)."""
    n = wl.batch_size * t.pooling / hw.world_size
    own = unique_rows(t.rows, t.unique_fraction, wl.batch_size * t.pooling, n)
    return own, min(float(t.rows), wl.batch_size * t.pooling * t.unique_fraction)


def dp_reduces_dense(t: TableSpec, hw: Hardware, wl: Workload) -> bool:
    """Whether the runtime's rule (``dense_is_cheaper``) reduces this data-parallel table's
    gradients densely, given W replicas of the predicted distinct rows each."""
    return _dense_rule(t, hw, _replica_rows(t, hw, wl)[0])


def _dense_rule(t: TableSpec, hw: Hardware, replica_rows: float) -> bool:
    return hw.world_size > 1 and dense_is_cheaper(t.rows, t.dim, replica_rows * hw.world_size)


def collective_count(distributed: bool, dp_groups: Iterable[tuple[bool, bool]], column_wise: bool, hierarchical: bool,
                     weighted: bool = False) -> int:
    """Collectives one step issues, from what decides them: batch sizes, lengths, ids,
    (weights), outputs, gradients if any table is ``distributed`` (only batch sizes when every
    table is data-parallel: each rank looks up its own samples); each operator group of
    data-parallel tables (one per dim; ``dp_groups`` gives whether any of its tables is
    gathered and whether any is reduced densely) adds a gather of per-table counts, gathers of
    row ids and of row gradients if gathered, and a reduce-scatter and an all-gather if dense;
    column shards of a row-wise optimizer state add two gathers of two collectives each;
    table-row-wise tables on several hosts add the reduce-scatter and the all-gather inside
    the host."""
    n = 5 + int(weighted) if distributed else 1
    return n + group_collectives(dp_groups) + 4 * int(column_wise) + 2 * int(hierarchical)


def group_collectives(dp_groups: Iterable[tuple[bool, bool]]) -> int:
    """The data-parallel operator groups' part of ``collective_count`` (they have their own
    latency, ``Hardware.replica_latency_s``)."""
    return sum(1 + 2 * int(gathered) + 2 * int(dense) for gathered, dense in dp_groups)


def dp_group_flags(kinds: dict[str, str], dims: dict[str, int], dense_dp: frozenset[str] = frozenset()) -> list[tuple[bool, bool]]:
    """Per dim of data-parallel tables: whether any is gathered, whether any is reduced densely."""
    groups: dict[int, tuple[bool, bool]] = {}
    for t, k in kinds.items():
        if k == "data_parallel":
            gathered, dense = groups.get(dims[t], (False, False))
            groups[dims[t]] = (gathered or t not in dense_dp, dense or t in dense_dp)
    return list(groups.values())


def collectives_per_step(kinds: dict[str, str], dims: dict[str, int], weighted: bool = False, hosts: int = 1,
                         dense_dp: frozenset[str] = frozenset(), ranks_per_host: int = 2) -> int:
    """``collective_count`` of a plan given as table -> sharding type (``dense_dp``: the
    data-parallel tables reduced densely); table-row-wise tables take the two-stage path only on
    several hosts of several ranks each."""
    distributed = not kinds or any(k != "data_parallel" for k in kinds.values())
    hierarchical = hosts > 1 and ranks_per_host > 1 and "table_row_wise" in kinds.values()
    return collective_count(distributed, dp_group_flags(kinds, dims, dense_dp), "column_wise" in kinds.values(),
                            hierarchical, weighted)


def collective_s(hw: Hardware, replica: bool = False) -> float:
    """The latency one collective adds to every rank (a log2(W)-step algorithm); ``replica``:
    one of a data-parallel operator group's."""
    latency = hw.replica_collective_latency_s if replica else hw.latency_s
    return latency * math.log2(max(hw.world_size, 2)) if hw.world_size > 1 else 0.0


def packing_s(t: TableSpec, hw: Hardware, wl: Workload) -> float:
    """A source rank's work to pack its samples' ids of a table that is not data-parallel
    and unpack their pooled outputs."""
    return wl.batch_size / hw.world_size * (t.pooling * hw.dist_id_s + t.dim * hw.dist_value_s)


def routing_s(sharding_type: str, hw: Hardware) -> float:
    """A source rank's fixed work per step to bucketize a table's ids by row range (row-split
    types only; the per-id part is in the shards' ``route_id_s``)."""
    return hw.route_table_s if SHARDING_TYPES[sharding_type].routes_by_row else 0.0


def source_cost(tables: list[TableSpec], hw: Hardware, wl: Workload, kinds: dict[str, str], source_bytes: float) -> float:
    """What every rank pays alike for its own samples: sending their ids and receiving their
    pooled outputs (and sending gradients back), per-feature work, one latency per collective.
    ``kinds`` maps table name to sharding type (data-parallel tables stay local);
    ``source_bytes`` is the sum of the plan's shards' ``ShardCost.source_bytes``."""
    packing = sum(packing_s(t, hw, wl) for t in tables if kinds.get(t.name) != "data_parallel")
    dense = frozenset(t.name for t in tables if kinds.get(t.name) == "data_parallel" and dp_reduces_dense(t, hw, wl))
    dims = {t.name: t.dim for t in tables}
    coll = collectives_per_step(kinds, dims, hosts=hw.num_hosts, dense_dp=dense, ranks_per_host=hw.ranks_per_host)
    dp_groups = dp_group_flags(kinds, dims, dense)
    replica = group_collectives(dp_groups)
    return (
        _others_link_time(source_bytes, hw)  # as if every shard were elsewhere; owners get their share back
        + (coll - replica) * collective_s(hw)
        + replica * collective_s(hw, replica=True)
        + len(dp_groups) * hw.group_s
        + len(tables) * hw.feature_s
        + sum(routing_s(kinds.get(t.name, "data_parallel"), hw) for t in tables)
        + packing
        + hw.step_overhead_s
    )


def replica_s(tables: list[TableSpec], hw: Hardware, wl: Workload, kinds: dict[str, str]) -> float:
    """What every rank spends on a plan's data-parallel tables: one replica's lookup, gradient
    combination and update of each, and their operator groups' collectives."""
    replicated = [t for t in tables if kinds.get(t.name) == "data_parallel"]
    if not replicated:
        return 0.0
    dense = frozenset(t.name for t in replicated if dp_reduces_dense(t, hw, wl))
    groups = dp_group_flags(kinds, {t.name: t.dim for t in tables}, dense)
    return (sum(shard_cost(t, "data_parallel", t.rows, t.dim, hw, wl).time_s for t in replicated)
            + group_collectives(groups) * collective_s(hw, replica=True) + len(groups) * hw.group_s)
