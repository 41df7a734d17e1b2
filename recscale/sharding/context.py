"""What the parts of a sharded collection share: the facts built once from the plan
(``ShardingContext``, the same on every rank) and one batch's state from its input
distribution to its backward (``StepContext``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from recscale.comm.codecs import get_codec
from recscale.comm.collectives import CommStats
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import SparseOptimizer, TableConfig
from recscale.embedding.table_batched import output_feature_order
from recscale.sharding.plan import Shard, ShardingPlan
from recscale.sharding.replica_gradients import Reduction
from recscale.sparse import JaggedBatch


@dataclass(frozen=True)
class CommPrecision:
    """Wire precision per collective; ``loss_scale`` multiplies fp16 gradients on the wire."""

    forward: str = "fp32"
    backward: str = "fp32"
    loss_scale: float = 1024.0


@dataclass(frozen=True)
class ShardFeature:
    """One feature as served by one shard: what a rank pools for that feature."""

    key: str  # local feature name on the owner, e.g. "C1#0"
    feature: str
    table: str
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    routes_by_row: bool


def shard_table_name(table: str, index: int) -> str:
    """The name of a table's ``index``-th shard in its owner's operator."""
    return f"{table}#{index}"


@dataclass
class ShardingContext:
    """The plan turned into index maps every part of a step reads (every rank computes them
    for every rank), and the options the collection was built with."""

    tables: list[TableConfig]
    optimizer: SparseOptimizer
    plan: ShardingPlan
    groups: ProcessGroups
    seed: int
    precision: CommPrecision
    stats: CommStats
    kernel: str
    hierarchical: bool
    replica_reduction: Reduction
    by_name: dict[str, TableConfig] = field(init=False)
    feature_names: tuple[str, ...] = field(init=False)
    feature_dims: tuple[int, ...] = field(init=False)
    feature_col: dict[str, int] = field(init=False)  # first output column of each feature
    total_dim: int = field(init=False)
    shard_tables: list[list[TableConfig]] = field(init=False)  # per rank: its shards as operator tables
    shard_origin: dict[str, tuple[TableConfig, Shard]] = field(init=False)  # shard table -> (table, shard)
    apart_tables: frozenset[str] = field(init=False)  # shard tables in operator groups of their own
    served: list[list[ShardFeature]] = field(init=False)  # per rank, in its operator's output order
    local_col: dict[str, int] = field(init=False)  # this rank's operator column of each served key

    def __post_init__(self) -> None:
        from recscale.sharding.types import SHARDING_TYPES

        self.by_name = {t.name: t for t in self.tables}
        table_of_feature = {f: t for t in self.tables for f in t.features}
        self.feature_names = output_feature_order(self.tables)
        self.feature_dims = tuple(table_of_feature[f].dim for f in self.feature_names)
        self.feature_col, col = {}, 0
        for f, d in zip(self.feature_names, self.feature_dims):
            self.feature_col[f] = col
            col += d
        self.total_dim = col
        kind_of = {table_plan.table: SHARDING_TYPES[table_plan.sharding_type] for table_plan in self.plan.tables}
        self.shard_tables = [[] for _ in range(self.world)]
        self.shard_origin = {}
        apart = set()
        for table_plan in self.plan.tables:
            kind = kind_of[table_plan.table]
            if kind.replicated:
                continue
            t = self.by_name[table_plan.table]
            for i, s in enumerate(table_plan.shards):
                name = shard_table_name(t.name, i)
                self.shard_tables[s.rank].append(TableConfig(
                    name, s.num_rows, s.num_cols, tuple(f"{f}#{i}" for f in t.features), "sum", None, t.dtype))
                self.shard_origin[name] = (t, s)
                if kind.groups_apart(table_plan, self.optimizer):
                    apart.add(name)
        self.apart_tables = frozenset(apart)
        self.served = []
        for r in range(self.world):
            served = []
            for key in output_feature_order(self.shard_tables[r], self.apart_tables):
                feature, index = key.rsplit("#", 1)
                t, s = self.shard_origin[shard_table_name(table_of_feature[feature].name, int(index))]
                served.append(ShardFeature(key, feature, t.name, s.row_offset, s.num_rows, s.col_offset, s.num_cols,
                                           kind_of[t.name].routes_by_row))
            self.served.append(served)
        self.local_col, col = {}, 0
        for shard_feature in self.served[self.rank]:
            self.local_col[shard_feature.key] = col
            col += shard_feature.num_cols

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world(self) -> int:
        return self.groups.world_size

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def local_dims(self) -> list[int]:
        """Columns of each rank's operator output."""
        return [sum(sf.num_cols for sf in served) for served in self.served]

    @property
    def forward_codec(self):
        return get_codec(self.precision.forward)

    @property
    def backward_codec(self):
        return get_codec(self.precision.backward)


@dataclass
class StepContext:
    """One batch from ``start_input_dist`` to the end of its backward: this rank's own batch,
    the ids its shards received and every rank's batch size (once they arrive), and the
    output and gradient exchanges in flight."""

    batch: JaggedBatch
    _finish: Callable[[], tuple[JaggedBatch, list[int]]] = field(repr=False)
    _received: tuple[JaggedBatch, list[int]] | None = field(default=None, repr=False)
    output: object = field(default=None, repr=False)  # the output all-to-all in flight
    grad: object = field(default=None, repr=False)  # the gradient all-to-all in flight

    def wait(self) -> JaggedBatch:
        """The ids this rank's shards serve, ordered for its operator (waits once)."""
        if self._received is None:
            self._received = self._finish()
        return self._received[0]

    @property
    def received(self) -> JaggedBatch:
        return self.wait()

    @property
    def sizes(self) -> list[int]:
        """Every rank's batch size (they travel with the ids)."""
        self.wait()
        assert self._received is not None
        return self._received[1]

    @property
    def global_batch_size(self) -> int:
        """The samples of this step over every rank (what the loss is averaged over)."""
        return sum(self.sizes)
