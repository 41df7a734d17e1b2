"""Table-row-wise: row-wise inside one host (the least-loaded), table-wise across hosts.

Ids go only to the ranks of the owning host, bucketized by row range; partial sums come back
from those ranks only, so the table's traffic never fans out over every host. On several hosts
its outputs take two stages (``hierarchical.py``): a reduce-scatter inside the host, then the
sums cross hosts once, not once per rank of the host.
"""

from __future__ import annotations

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan
from recscale.sharding.types.base import Rect, ShardingType, even_split, require_full_width


class TableRowWise(ShardingType):
    name = "table_row_wise"
    routes_by_row = True

    def candidate_layouts(self, num_rows: int, dim: int, topology: Topology) -> list[list[Rect]]:
        per_host = topology.ranks_per_host
        if topology.num_hosts < 2 or num_rows < per_host or per_host < 2:
            return []
        return [[(row, rows, 0, dim) for row, rows in even_split(num_rows, per_host)]]

    def make_shards(self, table: TableConfig, topology: Topology, loads: list[float], num_shards: int) -> tuple[Shard, ...]:
        host = min(range(topology.num_hosts), key=lambda h: (sum(loads[r] for r in topology.ranks_of_host(h)), h))
        ranks = topology.ranks_of_host(host)
        shards = []
        for rank, (row, rows) in zip(ranks, even_split(table.num_rows, len(ranks))):
            loads[rank] += rows * table.dim
            shards.append(Shard(rank, row, rows, 0, table.dim))
        return tuple(shards)

    def check(self, table_plan: TablePlan, table: TableConfig, plan: ShardingPlan) -> None:
        super().check(table_plan, table, plan)
        require_full_width(table_plan, table)
        hosts = {s.rank // plan.ranks_per_host for s in table_plan.shards}
        if len(hosts) != 1:
            raise PlanError(f"table '{table.name}': table_row_wise shards must all be on one host, got hosts {sorted(hosts)}")
