"""What a training job builds from its config: the device, the tables, the sharding plan, the
model (sharded on several ranks) and the dense optimizer. The loop calls these; benchmarks and
tests build the same model through them."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from recscale.comm.collectives import CommStats, all_gather_object_check
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import TableBatchedEmbeddingBags, TableConfig, make_optimizer
from recscale.model import DLRM
from recscale.model.native import interaction_kernels
from recscale.native_build import cpu_multiplies_bf16
from recscale.sharding.collection import CommPrecision
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.sharding.shard import shard
from recscale.sharding.types import SHARDING_TYPES
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits
from recscale.train.replay import Replay
from recscale.train.tiers import tier_factory


def pick_device(name: str, tiers: bool = False, cuda_available: bool | None = None) -> torch.device:
    """The training device for ``train.device``. ``tiers``: tables on the SSD tier, whose cache
    and files live in host memory and which serves CPU training only, so "auto" stays on the CPU
    and "cuda" is refused with the fix rather than failing inside the first batch."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "auto":
        return torch.device("cuda" if cuda and not tiers else "cpu")
    if name == "cuda" and not cuda:
        raise ConfigError("config key 'train.device': 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    if name == "cuda" and tiers:
        raise ConfigError("config key 'train.device': 'cuda' with tables on the SSD tier, which serves CPU training "
                          "only; set train.device = 'cpu' (or 'auto'), or keep every table in memory "
                          "(tiers.ram_budget_mb = 0 and no tiers.tables placement 'ssd')")
    return torch.device(name)


def build_tables(cfg: Config, sparse_names: tuple[str, ...]) -> list[TableConfig]:
    """One table per sparse feature, rows from ``model.table_rows`` (one value = all)."""
    rows = cfg.model.rows_for(len(sparse_names))
    return [
        TableConfig(
            name=f"t_{name}",
            num_rows=r,
            dim=cfg.model.embedding_dim,
            features=(name,),
            pooling=cfg.model.pooling,
            dtype=cfg.model.embedding_dtype,
        )
        for name, r in zip(sparse_names, rows)
    ]


@dataclass(frozen=True)
class PlanChoice:
    """The plan a job runs, and for a planned one the hardware description it was costed on
    and the search's record (``PlanResult.search_record``); None when not planned."""

    plan: ShardingPlan
    hardware: dict[str, Any] | None = None
    search: dict[str, Any] | None = None


def build_plan(cfg: Config, tables: list[TableConfig], groups: ProcessGroups, data: DataSplits | None = None) -> ShardingPlan:
    return choose_plan(cfg, tables, groups, data=data).plan


def choose_plan(cfg: Config, tables: list[TableConfig], groups: ProcessGroups, replay: Replay | None = None,
                data: DataSplits | None = None) -> PlanChoice:
    """A replay's recorded plan; else the plan file when given; else with ``sharding.default =
    "auto"`` (the default) and no per-table overrides the cost-model planner's plan (made on
    rank 0, sent to every rank, so all ranks run the same plan); else the default placement with
    per-table overrides."""
    if replay is not None and replay.plan is not None:
        replay.plan.validate(tables)
        return PlanChoice(replay.plan, replay.hardware, replay.plan_search)
    if cfg.sharding.plan:
        plan = ShardingPlan.load(cfg.sharding.plan)
        if plan.world_size != groups.world_size:
            raise ConfigError(
                f"config key 'sharding.plan': '{cfg.sharding.plan}' is for {plan.world_size} ranks, "
                f"the job has {groups.world_size}"
            )
        plan.validate(tables)
        return PlanChoice(plan)
    overrides = {k: TableSharding(v.type, v.shards) for k, v in cfg.sharding.tables.items()}
    if cfg.sharding.default == "auto" and not overrides:
        return _planned(cfg, tables, groups, data)
    default = "table_wise" if cfg.sharding.default == "auto" else cfg.sharding.default
    return PlanChoice(default_plan(tables, groups.topology, default, overrides))


def _planned(cfg: Config, tables: list[TableConfig], groups: ProcessGroups, data: DataSplits | None) -> PlanChoice:
    from recscale.train.planning import auto_plan

    topo = groups.topology
    box: list[object] = [None]
    if topo.rank == 0:
        try:
            result, hw = auto_plan(cfg, tables, topo.world_size, topo.ranks_per_host, groups.device.type == "cuda",
                                  data=data)
            box[0] = (result.plan.to_dict(), asdict(hw), result.search_record())
        except PlanError as e:
            box[0] = f"sharding.default = 'auto': {e}"
    if groups.dense is not None:
        torch.distributed.broadcast_object_list(box, src=0, group=groups.dense)
    if isinstance(box[0], str):
        raise PlanError(box[0])
    plan_dict, hardware, search = box[0]  # type: ignore[misc]
    plan = ShardingPlan.from_dict(plan_dict)
    plan.validate(tables)
    return PlanChoice(plan, hardware, search)


def build_model(
    cfg: Config,
    sparse_names: tuple[str, ...],
    num_dense: int,
    device: torch.device,
    groups: ProcessGroups | None = None,
    stats: CommStats | None = None,
    plan: ShardingPlan | None = None,
    data: DataSplits | None = None,
) -> DLRM:
    """The model; on several ranks its tables are sharded by ``plan`` (default: ``build_plan``)."""
    eo = cfg.embedding_optimizer
    opt_kwargs: dict[str, float] = {"lr": eo.lr}
    if eo.name != "sgd":
        opt_kwargs["eps"] = eo.eps
    if eo.name == "adam":
        opt_kwargs.update(beta1=eo.beta1, beta2=eo.beta2)
    optimizer = make_optimizer(eo.name, **opt_kwargs)
    tables = build_tables(cfg, sparse_names)
    sharded = groups is not None and groups.world_size > 1
    if not sharded:
        from recscale.train.planning import check_one_process_inputs

        check_one_process_inputs(cfg, tables)
    # To be sharded, the tables are only described here (meta device): no rank holds them all;
    # each rank's shards get their tier storage when sharded, below.
    tiers = None if sharded else tier_factory(cfg, tables, optimizer, 1, data=data)
    embeddings = TableBatchedEmbeddingBags(tables, optimizer, seed=cfg.train.seed,
                                           device="meta" if sharded else device, kernel=cfg.model.embedding_kernel,
                                           storage_factory=tiers)
    m = cfg.model
    model = DLRM(embeddings, num_dense, m.bottom_mlp, m.top_mlp, m.mlp_precision, m.interaction, m.dcn_layers, m.dcn_low_rank)
    if sharded:
        assert groups is not None
        plan = plan or build_plan(cfg, tables, groups, data)
        all_gather_object_check(plan.digest(), groups.dense, "sharding plans")
        precision = CommPrecision(cfg.comm.forward, cfg.comm.backward, cfg.comm.loss_scale)
        replicated = {tp.table for tp in plan.tables if SHARDING_TYPES[tp.sharding_type].replicated}
        tiers = tier_factory(cfg, tables, optimizer, groups.world_size, replicated, data)
        model = shard(model, plan, groups, precision, stats, storage_factory=tiers)
    if cfg.model.mlp_precision == "bf16" and device.type == "cpu" and not cpu_multiplies_bf16():
        warnings.warn(
            "model.mlp_precision = 'bf16' on a CPU without AVX-512 BF16 or AMX: its bf16 matmuls are emulated "
            "and run many times slower than fp32 (a CI machine: 1 against 174 GFLOP/s); set it to 'fp32' here",
            stacklevel=2,
        )
    if device.type == "cpu" and getattr(model.interaction, "native", False):
        interaction_kernels()  # a first-use compile happens now, not inside the first (timed) step
    return model.to(device)


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    d = cfg.dense_optimizer
    if d.name == "sgd":
        return torch.optim.SGD(params, lr=d.lr, weight_decay=d.weight_decay)
    # On CPU torch's fused Adagrad and Adam update each parameter in one pass instead of four
    # (a 16M-parameter DCNv2 dense part: 13 against 34-42 ms a step on one core); same formula.
    fused = bool(params) and all(p.device.type == "cpu" and p.dtype.is_floating_point for p in params) or None
    if d.name == "adagrad":
        return torch.optim.Adagrad(
            params, lr=d.lr, weight_decay=d.weight_decay,
            initial_accumulator_value=d.initial_accumulator_value, eps=d.eps, fused=fused,
        )
    return torch.optim.Adam(params, lr=d.lr, weight_decay=d.weight_decay, fused=fused)
