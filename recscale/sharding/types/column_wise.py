"""Column-wise: the embedding dim split into column shards, each placed like a table.

Every shard receives all ids of the table; the source rank concatenates the shards' columns.
"""

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard
from recscale.sharding.types._split import even_split, least_loaded


def make_shards(table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
    parts = num_shards or min(topology.world_size, table.dim)
    shards, used = [], []
    for col, cols in even_split(table.dim, parts):
        free = [r for r in range(topology.world_size) if r not in used] or list(range(topology.world_size))
        rank = least_loaded(loads, free)
        used.append(rank)
        loads[rank] += table.num_rows * cols
        shards.append(Shard(rank, 0, table.num_rows, col, cols))
    return tuple(shards)
