"""Data-parallel: a whole replica on every rank; lookups stay local, and the row gradients
of all ranks are combined before the same fused optimizer updates every replica alike."""

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard


def make_shards(table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
    for r in range(topology.world_size):
        loads[r] += table.num_rows * table.dim
    return tuple(Shard(r, 0, table.num_rows, 0, table.dim) for r in range(topology.world_size))
