"""Table-wise: the whole table on the least-loaded rank; its ids all-to-all to that owner."""

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard
from recscale.sharding.types._split import least_loaded


def make_shards(table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
    rank = least_loaded(loads)
    loads[rank] += table.num_rows * table.dim
    return (Shard(rank, 0, table.num_rows, 0, table.dim),)
