"""``simulate``: a config, a topology and a plan (given, or the one training would use) in, the
simulated steady-state step out."""

from __future__ import annotations

from recscale.embedding import TableConfig
from recscale.planner.cost_model import TableSpec
from recscale.planner.search import plan_tables
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import ShardingPlan
from recscale.comm.process_group import Topology
from recscale.sim.dense import DenseModel
from recscale.sim.step import StepInputs, StepResult, simulate_step
from recscale.sim.topology import ClusterTopology
from recscale.train.config import Config, ConfigError
from recscale.train.process_tuning import size_threads
from recscale.train.planning import table_specs, workload

_DENSE_WIRE = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
NUM_DENSE = 13  # Criteo's integer features; the synthetic data has as many


def training_plan(cfg: Config, topo: ClusterTopology, specs: list[TableSpec] | None = None) -> ShardingPlan:
    """The plan ``recscale train`` would use on this topology: the planner's (``sharding.default
    = "auto"``, costed on the topology's hardware), or the default placement of the configured
    type with per-table overrides. (A ``sharding.plan`` file is read by the caller.)"""
    specs = specs or table_specs(cfg)
    overrides = {k: TableSharding(v.type, v.shards) for k, v in cfg.sharding.tables.items()}
    if cfg.sharding.default == "auto" and not overrides:
        return plan_tables(specs, topo.hardware, workload(cfg)).plan
    tables = [TableConfig(t.name, t.rows, t.dim, (t.name[2:],)) for t in specs]
    kind = "table_wise" if cfg.sharding.default == "auto" else cfg.sharding.default
    return default_plan(tables, Topology(topo.world_size, 0, topo.ranks_per_host), kind, overrides)


def loads_in_process(cfg: Config, topo: ClusterTopology) -> bool:
    """Whether each rank builds its batches in its training thread (no loader worker), as the
    trainer sizes it: ``data.num_workers`` as set, or "auto" from the cores a host's ranks see
    (``shared_cores``, else ``cores_per_host``) as ``process_tuning.size_threads`` decides;
    hosts whose cores are not given are taken to have a core to spare for a worker."""
    workers = cfg.data.num_workers
    if workers == "auto":
        cores = topo.shared_cores or topo.cores_per_host
        if not cores:
            return False
        workers = size_threads(cores, topo.ranks_per_host, cfg.train.threads, "auto").workers
    return int(workers) == 0


def training_threads(cfg: Config, topo: ClusterTopology) -> int:
    """Training threads per rank as the trainer sizes them: ``train.threads`` as set, or "auto"
    (0) from the cores a host's ranks see (``process_tuning.size_threads``; a process on an
    emulated host sees the whole machine); where the topology does not give them, one (the
    thread count the dense calibration times)."""
    if cfg.train.threads > 0:
        return cfg.train.threads
    cores = topo.shared_cores or topo.cores_per_host
    if not cores:
        return 1
    return size_threads(cores, topo.ranks_per_host, 0, cfg.data.num_workers).threads


def simulate(cfg: Config, topo: ClusterTopology, plan: ShardingPlan | None = None) -> StepResult:
    specs = table_specs(cfg)
    if plan is None:
        plan = ShardingPlan.load(cfg.sharding.plan) if cfg.sharding.plan else training_plan(cfg, topo, specs)
    if plan.world_size != topo.world_size:
        raise ConfigError(f"--plan is for {plan.world_size} ranks, the topology '{topo.name}' has {topo.world_size} "
                          f"({topo.hosts} hosts x {topo.ranks_per_host}); pass --hosts/--ranks-per-host to match")
    tables = [TableConfig(t.name, t.rows, t.dim, (t.name[2:],)) for t in specs]
    plan.validate(tables)
    if topo.world_size == 1:
        # one process shards nothing, whatever the plan: every table is local and nothing is
        # distributed, which the cost model prices as a lone replica of each table
        plan = default_plan(tables, Topology(1, 0, 1), "data_parallel")
    m = cfg.model
    dense = DenseModel.of(NUM_DENSE, m.bottom_mlp, m.top_mlp, len(specs), m.embedding_dim)
    inputs = StepInputs(specs, workload(cfg), plan, dense, cfg.train.pipeline, _DENSE_WIRE[cfg.comm.dense],
                        cfg.checkpoint.interval_steps, loads_in_process(cfg, topo), training_threads(cfg, topo))
    return simulate_step(inputs, topo)
