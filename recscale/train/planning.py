"""A training config as planner input (table specs, workload, hardware) and the planner's plan
for a training job."""

from __future__ import annotations

from recscale.data.synthetic import unique_fraction
from recscale.embedding import TableConfig
from recscale.planner.cost_model import TableSpec, Workload
from recscale.planner.hardware import Hardware, resolve_hardware, this_machine
from recscale.planner.search import PlanResult, plan_tables
from recscale.train.config import Config, ConfigError

_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_WIRE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0}


def table_specs(cfg: Config) -> list[TableSpec]:
    """One spec per table, named as the trainer names them (``t_`` + feature)."""
    m, d = cfg.model, cfg.data
    if d.source == "synthetic":
        names = [f"s{i}" for i in range(len(m.table_rows))]
        pooling = list(d.pooling_factors or [1]) * (1 if len(d.pooling_factors) > 1 else len(names))
    else:
        names = [f"C{i + 1}" for i in range(26)]
        pooling = [1] * 26
    rows = m.rows_for(len(names))
    opt = cfg.embedding_optimizer.name
    per_row = 4.0 if opt == "rowwise_adagrad" else 0.0
    per_element = {"adagrad": 4.0, "adam": 8.0}.get(opt, 0.0)
    # Id skew: measured on a drawn global batch when the data is synthetic (its generator is
    # known), otherwise the planner's default of half the ids being distinct.
    skew = [None] * len(names)
    if d.source == "synthetic":
        skew = [unique_fraction(r, int(p), d.zipf_alpha, cfg.train.batch_size, cfg.train.seed) for r, p in zip(rows, pooling)]
    return [
        TableSpec(f"t_{n}", r, m.embedding_dim, float(p), 0.5 if u is None else u, _ELEMENT_BYTES[m.embedding_dtype],
                  per_row, per_element)
        for n, r, p, u in zip(names, rows, pooling, skew)
    ]


def workload(cfg: Config) -> Workload:
    dim = cfg.model.embedding_dim
    wire = {k: v + (8.0 / dim if k == "int8" else 0.0) for k, v in _WIRE_BYTES.items()}
    return Workload(cfg.train.batch_size, wire[cfg.comm.forward], wire[cfg.comm.backward])


def training_hardware(cfg: Config, world_size: int, ranks_per_host: int, gpu: bool) -> Hardware:
    """``sharding.topology`` (a preset or a calibrated file), else this machine's description."""
    if cfg.sharding.topology:
        try:
            return resolve_hardware(cfg.sharding.topology, world_size, ranks_per_host)
        except ValueError as e:
            raise ConfigError(f"config key 'sharding.topology': {e}") from None
    return this_machine(world_size, ranks_per_host, gpu)


def auto_plan(cfg: Config, tables: list[TableConfig], world_size: int, ranks_per_host: int, gpu: bool,
              hw: Hardware | None = None) -> tuple[PlanResult, Hardware]:
    """The cost-model planner's plan for a training job (``sharding.default = "auto"``) and the
    hardware description it costed (``hw`` when given, else ``training_hardware``)."""
    by_name = {s.name: s for s in table_specs(cfg)}
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
