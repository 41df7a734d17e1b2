"""A training config as planner input (table specs, workload, hardware) and the planner's plan
for a training job."""

from __future__ import annotations

from recscale.data.synthetic import unique_fraction
from recscale.embedding import TableConfig
from recscale.planner.cost_model import TableSpec, Workload
from recscale.planner.feature_stats import loads_from_ids, loads_from_prepared
from recscale.planner.hardware import Hardware, resolve_hardware, this_machine
from recscale.planner.search import PlanResult, plan_tables
from recscale.train.config import SYNTHETIC_TABLE_ROWS, Config, ConfigError
from recscale.train.datasets import DataSplits, build_data

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_WIRE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0}


def table_specs(cfg: Config, data: DataSplits | None = None) -> list[TableSpec]:
    """One spec per table, named as the trainer names them (``t_`` + feature), with each
    feature's pooling and id skew taken from the data: the synthetic generator's settings, a
    prepared directory's ``stats.json``, or the ids of a Criteo file (``data``: the job's data
    when already built, else it is opened here)."""
    m, d = cfg.model, cfg.data
    if d.source == "synthetic":
        rows = list(SYNTHETIC_TABLE_ROWS) if m.table_rows == "auto" else list(m.table_rows)
        names = [f"s{i}" for i in range(len(rows))]
        pooling = [float(p) for p in list(d.pooling_factors or [1]) * (1 if len(d.pooling_factors) > 1 else len(names))]
        # Id skew measured on a drawn global batch (the generator is known).
        skew = [unique_fraction(r, int(p), d.zipf_alpha, cfg.train.batch_size, cfg.train.seed) for r, p in zip(rows, pooling)]
    else:
        data = data if data is not None else build_data(cfg)
        names, rows = list(data.sparse_names), list(data.table_rows)
        try:
            loads = loads_from_prepared(data.stats_dir) if data.stats_dir else loads_from_ids(data.sparse_names, data.train_ids)
        except ValueError as e:
            raise ConfigError(f"config key 'data.train_path': {e}") from None
        missing = [n for n in names if n not in loads]
        if missing:
            raise ConfigError(f"config key 'data.train_path': its stats.json has no feature {missing[0]!r}; prepare it again")
        pooling = [loads[n].pooling for n in names]
        skew = [loads[n].unique_fraction(cfg.train.batch_size) for n in names]
    opt = cfg.embedding_optimizer.name
    per_row = 4.0 if opt == "rowwise_adagrad" else 0.0
    per_element = {"adagrad": 4.0, "adam": 8.0}.get(opt, 0.0)
    return [
        TableSpec(f"t_{n}", r, m.embedding_dim, float(p), 0.5 if u is None else u, _ELEMENT_BYTES[m.embedding_dtype],
                  per_row, per_element)
        for n, r, p, u in zip(names, rows, pooling, skew)
    ]


def wire_bytes(precision: str, dim: int) -> float:
    """Bytes per pooled element on the wire at ``precision``: int8 rows carry a scale and an
    offset (8 bytes) per row of ``dim`` elements."""
    return _WIRE_BYTES[precision] + (8.0 / dim if precision == "int8" else 0.0)


def workload(cfg: Config) -> Workload:
    dim = cfg.model.embedding_dim
    return Workload(cfg.train.batch_size, wire_bytes(cfg.comm.forward, dim), wire_bytes(cfg.comm.backward, dim))


def training_hardware(cfg: Config, world_size: int, ranks_per_host: int, gpu: bool) -> Hardware:
    """``sharding.topology`` (a preset or a calibrated file), else this machine's description."""
    if cfg.sharding.topology:
        try:
            return resolve_hardware(cfg.sharding.topology, world_size, ranks_per_host)
        except ValueError as e:
            raise ConfigError(f"config key 'sharding.topology': {e}") from None
    return this_machine(world_size, ranks_per_host, gpu)


def auto_plan(cfg: Config, tables: list[TableConfig], world_size: int, ranks_per_host: int, gpu: bool,
              hw: Hardware | None = None, data: DataSplits | None = None) -> tuple[PlanResult, Hardware]:
    """The cost-model planner's plan for a training job (``sharding.default = "auto"``) and the
    hardware description it costed (``hw`` when given, else ``training_hardware``)."""
    by_name = {s.name: s for s in table_specs(cfg, data)}
    specs = []
    for t in tables:
        s = by_name.get(t.name)
        specs.append(TableSpec(t.name, t.num_rows, t.dim, s.pooling if s else 1.0, s.unique_fraction if s else 0.5,
                               s.element_bytes if s else 4, s.state_bytes_per_row if s else 4.0,
                               s.state_bytes_per_element if s else 0.0))
    hw = hw or training_hardware(cfg, world_size, ranks_per_host, gpu)
    return plan_tables(specs, hw, workload(cfg)), hw


def check_one_process_inputs(cfg: Config, tables: list[TableConfig]) -> None:
    """One process shards nothing, but a plan file or topology it was given must still be
    valid: a bad file is an error, not silently ignored."""
    from recscale.sharding.plan import ShardingPlan

    if cfg.sharding.plan:
        plan = ShardingPlan.load(cfg.sharding.plan)
        if plan.world_size != 1:
            raise ConfigError(
                f"config key 'sharding.plan': '{cfg.sharding.plan}' is for {plan.world_size} ranks, the job has 1 "
                "(run it under torchrun with that many ranks, or leave the plan out)"
            )
        plan.validate(tables)
    if cfg.sharding.topology:
        training_hardware(cfg, 1, 1, gpu=False)
