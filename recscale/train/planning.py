"""A training config as planner input: table specs and the workload."""

from __future__ import annotations

from recscale.planner.cost_model import TableSpec, Workload
from recscale.train.config import Config

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
    return [
        TableSpec(f"t_{n}", r, m.embedding_dim, float(p), 0.5, _ELEMENT_BYTES[m.embedding_dtype], per_row, per_element)
        for n, r, p in zip(names, rows, pooling)
    ]


def workload(cfg: Config) -> Workload:
    dim = cfg.model.embedding_dim
    wire = {k: v + (8.0 / dim if k == "int8" else 0.0) for k, v in _WIRE_BYTES.items()}
    return Workload(cfg.train.batch_size, wire[cfg.comm.forward], wire[cfg.comm.backward])
