"""Table-row-wise: row-wise inside one host (the least-loaded), table-wise across hosts.

Ids go only to the ranks of the owning host, bucketized by row range; partial sums come back
from those ranks only, so the table's traffic never fans out over every host.
"""

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import Shard
from recscale.sharding.types._split import even_split


def make_shards(table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
    host = min(range(topology.num_hosts), key=lambda h: (sum(loads[r] for r in topology.ranks_of_host(h)), h))
    ranks = topology.ranks_of_host(host)
    shards = []
    for rank, (row, rows) in zip(ranks, even_split(table.num_rows, len(ranks))):
        loads[rank] += rows * table.dim
        shards.append(Shard(rank, row, rows, 0, table.dim))
    return tuple(shards)
