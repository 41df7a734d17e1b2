"""The sharding types, one module each, registered here (the only place that lists them).

Each type (``base.ShardingType``) says where its shards go, what makes its plans valid, and
what its shards need beyond the exchanges every type shares. The order is the planner's order
of options for a table.
"""

from recscale.sharding.types.base import Rect, ShardingType, TypeRuntime
from recscale.sharding.types.column_wise import ColumnWise
from recscale.sharding.types.data_parallel import DataParallel
from recscale.sharding.types.row_wise import RowWise
from recscale.sharding.types.table_row_wise import TableRowWise
from recscale.sharding.types.table_wise import TableWise

SHARDING_TYPES: dict[str, ShardingType] = {
    kind.name: kind for kind in (TableWise(), ColumnWise(), RowWise(), TableRowWise(), DataParallel())
}


__all__ = ["Rect", "SHARDING_TYPES", "ShardingType", "TypeRuntime"]
