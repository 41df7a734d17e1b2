"""One module per sharding type; each says where the shards of a table go.

How ids reach a shard and how its output returns is shared by all types (see
``recscale/sharding/collection.py``): every shard pools the ids of its row range into its
column range, and the source rank sums the partial outputs. Row-split types (row-wise,
table-row-wise) route each id to the one shard holding its row; the others send every id.
"""

from collections.abc import Callable

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard
from recscale.sharding.types import column_wise, data_parallel, row_wise, table_row_wise, table_wise

# (table, topology, per-rank load in bytes (updated in place), requested shard count) -> shards
ShardMaker = Callable[[TableConfig, Topology, list[float], int], tuple[Shard, ...]]

SHARD_MAKERS: dict[str, ShardMaker] = {
    "table_wise": table_wise.make_shards,
    "row_wise": row_wise.make_shards,
    "column_wise": column_wise.make_shards,
    "table_row_wise": table_row_wise.make_shards,
    "data_parallel": data_parallel.make_shards,
}
