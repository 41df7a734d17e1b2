"""Row-wise: rows range-split over every rank.

Ids are bucketized by row range and rebased; each rank returns partial pooled sums, which the
source rank adds up (a reduce-scatter, written as all-to-all plus a local sum for gloo).
"""

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard
from recscale.sharding.types._split import even_split


def make_shards(table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
    shards = []
    for rank, (row, rows) in enumerate(even_split(table.num_rows, topology.world_size)):
        loads[rank] += rows * table.dim
        shards.append(Shard(rank, row, rows, 0, table.dim))
    return tuple(shards)
