"""TorchRec's sharding planner and its cost estimator, for comparing planners (optional).

``TorchRecPlanning`` builds, for one table set and one recscale ``Hardware``, the same
topology in TorchRec's terms (world size, ranks per host, HBM cap, HBM bandwidth, intra- and
cross-host bandwidth; TorchRec counts bytes per millisecond), then

* ``plan()``: runs ``EmbeddingShardingPlanner`` (HBM only: fused or dense kernels, our five
  sharding types) and converts its plan into a recscale ``ShardingPlan``;
* ``score(plan)``: costs any recscale plan with TorchRec's own ``EmbeddingPerfEstimator``: each
  table's shards become the ``ShardingOption`` of that sharding type with our shard sizes,
  offsets and ranks, the estimator fills every shard's perf, and the score is the slowest
  rank's sum of shard perf (what TorchRec's partitioner balances and its stats report);
* ``option_seconds(options)``: any table options' estimated time per shard (the bound in
  ``planner.py`` on what plans can score under both estimators).

torchrec is a benchmark-only dependency: ``available()`` says whether it can be imported.
"""

from __future__ import annotations

import copy
import importlib.util
import time

from recscale.planner.cost_model import TableSpec, Workload
from recscale.planner.hardware import Hardware
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan

OUR_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def available() -> bool:
    return importlib.util.find_spec("torchrec") is not None and importlib.util.find_spec("fbgemm_gpu") is not None


class TorchRecPlanning:
    def __init__(self, tables: list[TableSpec], hw: Hardware, wl: Workload, timeout_s: int | None = 60) -> None:
        """``timeout_s`` stops TorchRec's proposal search (it keeps its best plan so far); its
        default grid search takes minutes for hundreds of tables on 128 ranks."""
        import torch
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
        from torchrec.distributed.planner.types import Topology
        from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
        from torchrec.distributed.planner.types import ParameterConstraints
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.tables = tables
        self.timeout_s = timeout_s
        self.hw = hw
        self.world = hw.world_size
        self.topology = Topology(
            world_size=hw.world_size,
            local_world_size=hw.ranks_per_host,
            compute_device="cuda",
            hbm_cap=int(hw.memory_bytes),
            hbm_mem_bw=hw.memory_bw / 1000,
            intra_host_bw=hw.intra_host_bw / 1000,
            inter_host_bw=hw.cross_host_bw / 1000,
            bwd_compute_multiplier=hw.backward_factor,
        )
        self.batch_size = max(1, wl.batch_size // hw.world_size)  # TorchRec's batch is per rank
        self.constraints = {
            t.name: ParameterConstraints(
                sharding_types=list(OUR_TYPES), compute_kernels=["fused", "dense"], pooling_factors=[max(t.pooling, 1e-3)]
            )
            for t in tables
        }
        configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.name]) for t in tables]
        self.module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.sharders = [EmbeddingBagCollectionSharder()]
        self.enumerator = EmbeddingEnumerator(
            topology=self.topology,
            batch_size=self.batch_size,
            constraints=self.constraints,
            estimator=[
                EmbeddingPerfEstimator(topology=self.topology, constraints=self.constraints),
                EmbeddingStorageEstimator(topology=self.topology, constraints=self.constraints),
            ],
        )
        self._options: dict[tuple[str, str], object] | None = None

    # ------------------------------------------------------------------ TorchRec's plan
    def plan(self) -> tuple[ShardingPlan, float]:
        """TorchRec's plan as a recscale plan, and the seconds TorchRec took."""
        from torchrec.distributed.planner import EmbeddingShardingPlanner

        planner = EmbeddingShardingPlanner(
            topology=self.topology, batch_size=self.batch_size, constraints=self.constraints, debug=False,
            timeout_seconds=self.timeout_s,
        )
        t0 = time.perf_counter()
        planner.plan(self.module, self.sharders)
        seconds = time.perf_counter() - t0
        best = planner._best_plan  # the chosen sharding options, each shard with its rank
        if best is None:
            raise RuntimeError("TorchRec's planner found no plan")
        return self._to_ours(best), seconds

    def _to_ours(self, options) -> ShardingPlan:
        by_name = {}
        for so in options:
            if so.sharding_type not in OUR_TYPES:
                raise RuntimeError(f"TorchRec chose {so.sharding_type} for {so.name}, which recscale does not run")
            shards = tuple(
                Shard(int(s.rank), int(s.offset[0]), int(s.size[0]), int(s.offset[1]), int(s.size[1]))
                for s in sorted(so.shards, key=lambda s: (s.offset[0], s.offset[1], s.rank))
            )
            if so.sharding_type == "data_parallel":
                t = next(x for x in self.tables if x.name == so.name)
                shards = tuple(Shard(r, 0, t.rows, 0, t.dim) for r in range(self.world))
            by_name[so.name] = TablePlan(so.name, so.sharding_type, shards)
        return ShardingPlan(self.world, self.hw.ranks_per_host, tuple(by_name[t.name] for t in self.tables))

    # ------------------------------------------------------------------ TorchRec's estimator
    def _base_options(self) -> dict[tuple[str, str], object]:
        if self._options is None:
            opts = self.enumerator.enumerate(self.module, self.sharders)
            self._options = {}
            for so in opts:
                self._options.setdefault((so.name, so.sharding_type), so)
        return self._options

    def _estimate(self, plan: ShardingPlan) -> list:
        """TorchRec's sharding options for ``plan``, each shard's perf filled by its estimator."""
        from torchrec.distributed.planner.types import Shard as TRShard

        base = self._base_options()
        chosen = []
        for tp in plan.tables:
            key = (tp.table, tp.sharding_type)
            if key not in base:
                raise RuntimeError(f"TorchRec enumerates no {tp.sharding_type} option for {tp.table}")
            so = copy.copy(base[key])
            so.shards = [TRShard(size=[s.num_rows, s.num_cols], offset=[s.row_offset, s.col_offset], rank=s.rank) for s in tp.shards]
            chosen.append(so)
        self.enumerator.populate_estimates(chosen)
        return chosen

    def score(self, plan: ShardingPlan) -> float:
        """The slowest rank's total of TorchRec-estimated shard time, in seconds."""
        per_rank = [0.0] * self.world
        for so in self._estimate(plan):
            for s in so.shards:
                per_rank[s.rank] += s.perf.total
        return max(per_rank) / 1000  # TorchRec's perf is in milliseconds

    def option_seconds(self, options: list[tuple[str, str, list[Shard]]]) -> list[list[float]]:
        """Each (table, sharding type, shards) option's estimated time per shard. The estimator
        never reads a shard's rank (only sizes, offsets and the topology), so the numbers hold
        wherever the shards sit."""
        plan = ShardingPlan(self.world, self.hw.ranks_per_host, tuple(TablePlan(t, k, tuple(sh)) for t, k, sh in options))
        return [[s.perf.total / 1000 for s in so.shards] for so in self._estimate(plan)]


# ---------------------------------------------------------------------- planning a training run
def training_plan(model, pooling: dict[str, float], batch_size: int, table_wise_only: bool = False):
    """TorchRec's plan for ``model``'s ``EmbeddingBagCollection`` on this process group's CPU
    ranks, as a TorchRec user would make it: ``EmbeddingShardingPlanner`` told each table's mean
    pooling factor (``pooling``, by table name) and the per-rank ``batch_size``, choosing among
    every sharding type and compute kernel TorchRec's sharder offers on CPU (the fused FBGEMM
    kernel, or the dense one that data-parallel tables need); ``table_wise_only``: table-wise
    with the fused kernel. Returns the plan and a summary of its choices, for the report."""
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    world = dist.get_world_size()
    sharder = EmbeddingBagCollectionSharder()
    if table_wise_only:
        types, kernels = [ShardingType.TABLE_WISE.value], [EmbeddingComputeKernel.FUSED.value]
    else:
        types = list(sharder.sharding_types("cpu"))
        kernels = sorted({k for t in types for k in sharder.compute_kernels(t, "cpu")})
    constraints = {
        name: ParameterConstraints(sharding_types=types, compute_kernels=kernels, pooling_factors=[max(p, 1e-3)])
        for name, p in pooling.items()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
        batch_size=batch_size, constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    chosen: dict[str, int] = {}
    for params in plan.plan.values():
        for ps in params.values():  # type: ignore[attr-defined]
            key = f"{ps.sharding_type}/{ps.compute_kernel}"
            chosen[key] = chosen.get(key, 0) + 1
    return plan, {"offered_sharding_types": types, "offered_kernels": kernels, "chosen": chosen}
