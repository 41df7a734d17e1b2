"""The interface every sharding type implements, and what types share.

A sharding type says where a table's shards go (``candidate_layouts`` for the planner,
``make_shards`` for the default placement), what makes a plan of its kind valid (``check``), and
how its shards take part in one step: whether ids reach a shard whole or routed by row range
(``routes_by_row``), whether the table is looked up where the batch is (``replicated``) and
what extra collectives its lookup and backward need (``runtime``: a ``TypeRuntime``). The
id exchange and the output exchange themselves are shared by every type (``input_dist.py``,
``output_dist.py``), so that one step runs one all-to-all per direction, whatever mix of types
a plan uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from recscale.comm.process_group import Topology
from recscale.embedding import SparseOptimizer, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.table_batched import RowStatFn
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan

if TYPE_CHECKING:
    from recscale.sharding.context import ShardingContext, StepContext

# One shard as the planner sees it: (row_offset, num_rows, col_offset, num_cols).
Rect = tuple[int, int, int, int]
# One feature's ids of a batch: values, per-sample lengths, per-id weights (None: all ones).
FeatureIds = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class OutputStage(Protocol):
    """A stage before the shared output exchange for some tables' shards: it pre-reduces their
    partial outputs among a group of ranks (``reduce_scatter``) so that one rank per group sends
    each source a finished block, and in backward spreads the block's gradient back
    (``all_gather``). ``table_row_wise.TableRowWiseHierarchy`` is the one implementation."""

    tables: frozenset[str]  # whose shards' outputs take this stage
    blocks: list  # per host: the block's (feature, dim) pairs, in ``features``
    my_local_cols: torch.Tensor  # this rank's operator columns of its block, in block order

    def extra_cols(self, sender: int, receiver: int) -> int:
        """Block columns ``sender`` adds to what it sends ``receiver``."""
        ...

    def reduce_scatter(self, pooled: torch.Tensor, sizes: list[int], codec, group, stats) -> torch.Tensor:
        ...

    def all_gather(self, grads: torch.Tensor, sizes: list[int], codec, group, stats) -> torch.Tensor:
        ...


class TypeRuntime:
    """What a sharding type adds to a step beyond the shared exchanges; every hook is optional.

    ``lookup``: an operator of its own, fed this rank's own batch (replicated tables).
    ``row_stat_fn``: what the shared operator's update reads for this type's shards, when
    ``groups_apart`` set them apart. ``output_stage``: a stage before the shared output
    exchange (and after the gradient exchange) for this type's shards
    (``table_row_wise.TableRowWiseHierarchy``). ``after_output_backward`` runs on every rank,
    once per step, with the gradient of this rank's pooled shard outputs, before the operator's
    fused update reads it."""

    lookup: TableBatchedEmbeddingBags | None = None
    row_stat_fn: RowStatFn | None = None
    output_stage: OutputStage | None = None

    def after_output_backward(self, grad_pooled: torch.Tensor, step: StepContext) -> None:
        return None


class ShardingType(ABC):
    """One way of splitting a table over ranks; one instance per type, in ``SHARDING_TYPES``."""

    name: ClassVar[str]
    # Row-split types send each id only to the shard whose row range holds it (rebased to it).
    routes_by_row: ClassVar[bool] = False
    # A whole copy on every rank, looked up where the batch is; no ids or outputs travel.
    replicated: ClassVar[bool] = False

    @abstractmethod
    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        """The splits of a ``num_rows x dim`` table that the planner weighs, in its order."""

    @abstractmethod
    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        """Place the table's shards (``loads``: bytes per rank so far, updated in place)."""

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        """Raise PlanError when ``table_plan`` is not a valid plan of this type (shards already
        lie inside the table and on existing ranks). Default: the shards tile the table once."""
        area = sum(s.num_rows * s.num_cols for s in table_plan.shards)
        if area != table.num_rows * table.dim:
            raise PlanError(f"table '{table.name}': shards cover {area} of {table.num_rows * table.dim} cells; "
                            "they must tile it once")

    def route_ids(self, table_plan: TablePlan, table: TableConfig, row_bounds: torch.Tensor,
                  ids: dict[str, FeatureIds], batch_size: int) -> dict[tuple[int, str], FeatureIds]:
        """Input distribution of a row-split type: per (shard row offset, feature) the ids in that
        shard's row range, rebased to it, in sample order, with per-sample counts and weights.
        ``row_bounds``: the shards' first rows and the table's row count. (Other types send
        every shard the table's ids whole and never call this.)"""
        raise NotImplementedError(f"{self.name} does not route ids by row")

    def groups_apart(self, table_plan: TablePlan, optimizer: SparseOptimizer) -> bool:
        """Whether this table's shards need operator groups of their own (their update reads
        something the other tables' fused update does not)."""
        return False

    def runtime(self, context: ShardingContext) -> TypeRuntime | None:
        """This type's part of a sharded collection's step; None when it adds nothing."""
        return None


def even_split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` (offset, size) ranges covering ``total``; sizes differ by at most one, none empty."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def row_shards(table: TableConfig, ranks: list[int], loads: list[float]) -> tuple[Shard, ...]:
    """Full-width shards of even row ranges, one per rank of ``ranks`` in order (``loads``:
    elements per rank so far, updated in place)."""
    shards = []
    for rank, (row, rows) in zip(ranks, even_split(table.num_rows, len(ranks))):
        loads[rank] += rows * table.dim
        shards.append(Shard(rank, row, rows, 0, table.dim))
    return tuple(shards)


def least_loaded(loads: list[float], among: list[int] | None = None) -> int:
    ranks = among if among is not None else list(range(len(loads)))
    return min(ranks, key=lambda r: (loads[r], r))


def require_full_width(table_plan: TablePlan, table: TableConfig) -> None:
    if any(s.num_cols != table.dim for s in table_plan.shards):
        raise PlanError(f"table '{table.name}': {table_plan.sharding_type} shards must span every column")


def require_full_height(table_plan: TablePlan, table: TableConfig) -> None:
    if any(s.num_rows != table.num_rows for s in table_plan.shards):
        raise PlanError(f"table '{table.name}': {table_plan.sharding_type} shards must span every row")

