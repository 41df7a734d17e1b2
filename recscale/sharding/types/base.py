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
from typing import TYPE_CHECKING, ClassVar

import torch

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan

if TYPE_CHECKING:
    from recscale.sharding.context import ShardingContext, StepContext

# One shard as the planner sees it: (row_offset, num_rows, col_offset, num_cols).
Rect = tuple[int, int, int, int]


class TypeRuntime:
    """What a sharding type adds to a step beyond the shared exchanges; every hook is optional.

    ``after_output_backward`` runs on every rank, once per step, with the gradient of this
    rank's pooled shard outputs (before the operator's fused update reads it)."""

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


def least_loaded(loads: list[float], among: list[int] | None = None) -> int:
    ranks = among if among is not None else list(range(len(loads)))
    return min(ranks, key=lambda r: (loads[r], r))


def require_full_width(table_plan: TablePlan, table: TableConfig) -> None:
    if any(s.num_cols != table.dim for s in table_plan.shards):
        raise PlanError(f"table '{table.name}': {table_plan.sharding_type} shards must span every column")


def require_full_height(table_plan: TablePlan, table: TableConfig) -> None:
    if any(s.num_rows != table.num_rows for s in table_plan.shards):
        raise PlanError(f"table '{table.name}': {table_plan.sharding_type} shards must span every row")

