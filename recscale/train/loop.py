"""The single-process training loop: build, train, evaluate, summarise."""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from recscale.atomic import write_text_atomic
from recscale.comm.collectives import CommStats, all_gather_object_check, all_gather_rows
from recscale.comm.dense_sync import DenseGradSync
from recscale.comm.process_group import ProcessGroups, destroy_process_groups, env_topology, init_process_groups
from recscale.data import Batch
from recscale.embedding import TableBatchedEmbeddingBags, TableConfig, make_optimizer
from recscale.embedding.tier_hooks import close_tiers
from recscale.model import DLRM
from recscale.model.native import interaction_kernels
from recscale.native_build import cpu_multiplies_bf16
from recscale.sharding.collection import CommPrecision
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.sharding.shard import shard
from recscale.train.checkpointing import Progress, TrainCheckpointing
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits, build_data, with_table_rows
from recscale.train.guards import FiniteGuard
from recscale.train.lr_schedule import set_learning_rates
from recscale.train.metrics import EvalMetrics, evaluate_predictions
from recscale.train.pipeline import TrainPipeline, train_step
from recscale.train.replay import Replay, check_world_size, versions
from recscale.train.process_tuning import ProcessTuning, tune_process
from recscale.train.tiers import tier_factory, tier_summary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'train.device': 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
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
    # To be sharded, the tables are only described here (meta device): no rank holds them all.
    # Tables on the SSD tier run in one process only: tier_factory refuses them on several ranks.
    tiers = tier_factory(cfg, tables, optimizer, groups.world_size if sharded and groups else 1)
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
        model = shard(model, plan, groups, precision, stats)
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
    if d.name == "adagrad":
        return torch.optim.Adagrad(
            params, lr=d.lr, weight_decay=d.weight_decay,
            initial_accumulator_value=d.initial_accumulator_value, eps=d.eps,
        )
    return torch.optim.Adam(params, lr=d.lr, weight_decay=d.weight_decay)


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch], device: torch.device, group=None) -> EvalMetrics:
    """Metrics over every rank's predictions (gathered when ``group`` is given)."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in batches:
        batch = batch.to(device)
        logits.append(model(batch.dense, batch.sparse).float())
        labels.append(batch.labels.float())
    model.train(was_training)
    pred, lab = torch.cat(logits), torch.cat(labels)
    if group is not None:
        pair = torch.stack([pred, lab], dim=1)
        pair = torch.cat(all_gather_rows(pair, group, name="eval_gather"))
        pred, lab = pair[:, 0], pair[:, 1]
    return evaluate_predictions(pred.cpu(), lab.cpu())


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    train_seconds: float = 0.0


def config_digest(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()


def train(cfg: Config, log: Callable[[str], None] = print, replay: Replay | None = None) -> dict[str, Any]:
    """Train and evaluate as configured (one process, or every rank of a torchrun job);
    ``replay``: rerun a recorded run (its config is ``cfg``) on its recorded plan."""
    topology = env_topology(cfg.dist.ranks_per_host)
    if replay is not None:
        check_world_size(replay, topology.world_size)  # before any rank waits for another
    tuning = _tune(cfg, topology.ranks_per_host)
    device = pick_device(cfg.train.device)
    groups = init_process_groups(topology, cfg.dist.timeout_s, device=device, shared_memory=cfg.dist.shared_memory)
    try:
        return _train(cfg, groups, log if groups.rank == 0 else (lambda _: None), replay, tuning)
    finally:
        if groups.world_size > 1:
            destroy_process_groups()


def _tune(cfg: Config, ranks_per_host: int) -> ProcessTuning:
    t = cfg.train
    return tune_process(t.threads, cfg.data.num_workers, ranks_per_host, t.tune_process, t.retain_host_memory)


def _train(cfg: Config, groups: ProcessGroups, log: Callable[[str], None], replay: Replay | None = None,
           tuning: ProcessTuning | None = None) -> dict[str, Any]:
    if tuning is None:
        tuning = _tune(cfg, groups.topology.ranks_per_host)
    seed_everything(cfg.train.seed)
    device = groups.device
    world, rank = groups.world_size, groups.rank
    if world > 1:
        all_gather_object_check(config_digest(cfg), groups.dense, "configs")
    data: DataSplits = build_data(cfg, rank, world, tuning.plan.workers)
    log(f"data: {data.description}")
    cfg = with_table_rows(cfg, data.table_rows, log)
    stats = CommStats()
    choice = choose_plan(cfg, build_tables(cfg, data.sparse_names), groups, replay, data) if world > 1 else None
    model = build_model(cfg, data.sparse_names, data.num_dense, device, groups, stats, choice.plan if choice else None, data)
    kernel_native = _runs_native_kernels(model, groups)
    dense_params = model.dense_parameters()
    dense_opt = build_dense_optimizer(cfg, dense_params)
    sync = DenseGradSync(dense_params, groups.dense, cfg.comm.dense, cfg.comm.loss_scale, stats)
    tuning.after_build()  # after the build: its one-off temporaries go back to the OS
    log(tuning.describe())
    log(
        f"model: DLRM, {len(model.embeddings.tables)} tables, "
        f"{sum(t.num_rows for t in model.embeddings.tables):,} embedding rows x dim {cfg.model.embedding_dim}, "
        f"{sum(p.numel() for p in dense_params):,} dense parameters, device {device}, world size {world}, "
        f"embedding kernel {'native' if kernel_native else 'torch'}"
    )
    # Reproducible unless the planner's safety time limit cut its search short.
    reproducible = choice is None or choice.search is None or bool(choice.search.get("reproducible", True))
    if not reproducible:
        log("warning: the planner's time limit cut its search short: this plan (and run) is not reproducible")
    if replay is not None:
        log(f"replaying {replay.path}" + (f" on its plan {choice.plan.digest()[:12]}" if choice else ""))
    eval_group = groups.dense if world > 1 else None

    ckpt = TrainCheckpointing(cfg, model, dense_opt, data, groups, log)
    start = ckpt.restore()
    dense_named = [(k, p) for k, p in model.named_parameters() if not k.startswith("embeddings.")]
    guard = FiniteGuard(dense_named, groups.dense if world > 1 else None)
    state = TrainState(start.step, start.samples, start.train_seconds)
    evals: list[dict[str, float]] = start.evals
    max_steps = cfg.train.max_steps or None
    # The schedule's length is the epochs' (train.max_steps stops a run early, it does not shorten it).
    schedule_steps = len(data.train) * cfg.train.epochs
    total_steps = min(schedule_steps, max_steps) if max_steps else schedule_steps
    schedule = cfg.lr_schedule
    if schedule.enabled:
        try:
            schedule.check_length(schedule_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log(schedule.describe(schedule_steps))
    lr_factor = None
    bar = tqdm(total=total_steps, initial=state.step, disable=not cfg.train.progress or rank != 0, unit="step", dynamic_ncols=True)
    # A tensor: no host sync per step.
    running_loss = torch.tensor(start.running_loss, dtype=torch.float64, device=device)
    running_n = start.running_n
    done = bool(max_steps and state.step >= max_steps)
    epoch, next_batch = start.epoch, start.next_batch
    for epoch in range(start.epoch, cfg.train.epochs if not done else start.epoch):
        data.train.set_epoch(epoch)
        t0 = time.perf_counter()
        first = start.next_batch if epoch == start.epoch else 0  # a resumed run skips what it trained
        pipeline = TrainPipeline(data.train_loader(first), model.embeddings, device, cfg.train.pipeline,
                                 cfg.tiers.lookahead_batches)
        for next_batch, (batch, sparse) in enumerate(pipeline, start=first + 1):
            f = schedule.factor(state.step, schedule_steps) if schedule.enabled else None
            if f is not None and f != lr_factor:
                lr_factor = f
                set_learning_rates(dense_opt, model.embeddings, cfg.dense_optimizer.lr * f, cfg.embedding_optimizer.lr * f)
            # Embedding rows are updated inside backward, fused into it.
            loss_sum = train_step(model, batch, sparse, dense_opt, sync)
            state.step += 1
            state.samples += sparse.global_batch_size
            running_loss += loss_sum
            running_n += batch.batch_size
            guard.observe(state.step, loss_sum)
            if state.step % 20 == 0 or state.step == total_steps:
                guard.check(state.step, False, ckpt.last_checkpoint)  # where the loop syncs anyway
                elapsed = state.train_seconds + time.perf_counter() - t0
                extra = {"lr_factor": f"{lr_factor:.3g}"} if lr_factor is not None else {}
                extra.update({k: f"{v:.3g}" for k, v in tier_summary(model.embeddings, state.step, elapsed).items() if k != "prefetched_rows"})
                bar.set_postfix(loss=f"{float(running_loss) / max(running_n, 1):.4f}", samples_per_s=f"{state.samples / elapsed:,.0f}", **extra)
            bar.update(1)
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                state.train_seconds += time.perf_counter() - t0
                m = evaluate(model, data.eval_loader(), device, eval_group)
                evals.append({"step": state.step, **m.as_dict()})
                if rank == 0:
                    bar.write(f"step {state.step}: eval auc {m.auc:.4f}, logloss {m.logloss:.4f}, ne {m.ne:.4f}")
                t0 = time.perf_counter()
            ckpt.after_step(state.step, lambda: _progress(state, epoch, next_batch, running_loss, running_n, evals, t0),
                            lambda: guard.check(state.step, True, ckpt.last_checkpoint))
            if max_steps and state.step >= max_steps:
                done = True
                break
        pipeline.close()
        state.train_seconds += time.perf_counter() - t0
        if done:
            break
    bar.close()
    guard.check(state.step, True, ckpt.last_checkpoint)
    ckpt_summary = ckpt.finish(_progress(state, epoch, next_batch, running_loss, running_n, evals, None))
    if world > 1:  # the training loss over every rank's samples
        totals = torch.tensor([float(running_loss), float(running_n)], dtype=torch.float64)
        torch.distributed.all_reduce(totals, group=groups.dense)
        running_loss, running_n = totals[0], int(totals[1])
    comm_bytes = {k: v / max(state.step, 1) for k, v in stats.snapshot().items()}
    comm_seconds = {k: v / max(state.step, 1) for k, v in stats.seconds.items()}

    final = evaluate(model, data.eval_loader(), device, eval_group)
    summary: dict[str, Any] = {
        **final.as_dict(),
        "train_logloss": float(running_loss) / max(running_n, 1),
        "train_samples_per_sec": state.samples / max(state.train_seconds, 1e-9),
        "train_seconds": state.train_seconds,
        "steps": state.step,
        "samples": state.samples,
        "world_size": world,
        "rank": rank,
        "comm_bytes_per_step": comm_bytes,
        "comm_seconds_per_step": comm_seconds,
        "comm_precision": {"forward": cfg.comm.forward, "backward": cfg.comm.backward, "dense": cfg.comm.dense},
        "device": str(device),
        "data": data.description,
        "evals": evals,
        **ckpt_summary,
        # What reruns this run (``recscale train --replay``): see recscale/train/replay.py.
        "config": cfg.to_dict(),
        "plan": choice.plan.to_dict() if choice else None,
        "plan_digest": choice.plan.digest() if choice else None,
        "hardware": choice.hardware if choice else None,
        "plan_search": choice.search if choice else None,
        "reproducible": reproducible,
        "embedding_kernel": "native" if kernel_native else "torch",
        "embedding_kernel_native": kernel_native,
        "versions": versions(),
        **tier_summary(model.embeddings, state.step, state.train_seconds),
    }
    close_tiers(model.embeddings)  # every row written back: the tier files are complete
    return summary


def _runs_native_kernels(model: DLRM, groups: ProcessGroups) -> bool:
    """Whether every embedding lookup of every rank runs the native kernels (not the torch ones)."""
    bags = [m for m in model.embeddings.modules() if isinstance(m, TableBatchedEmbeddingBags)]
    native = all(b.runs_native() for b in bags)
    if groups.world_size > 1:
        flag = torch.tensor([int(native)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=groups.dense)
        native = bool(flag.item())
    return native


def _progress(
    state: TrainState, epoch: int, next_batch: int, loss: torch.Tensor, n: int, evals: list, t0: float | None
) -> Progress:
    """The loop's position for a checkpoint (``t0``: start of the running timing span, if open)."""
    seconds = state.train_seconds + (time.perf_counter() - t0 if t0 is not None else 0.0)
    return Progress(state.step, state.samples, seconds, epoch, next_batch, float(loss), n, list(evals))


def format_summary(summary: dict[str, Any]) -> str:
    return (
        f"eval: auc {summary['eval_auc']:.4f}  logloss {summary['eval_logloss']:.4f}  "
        f"ne {summary['eval_ne']:.4f}  calibration {summary['eval_calibration']:.3f}  "
        f"({summary['eval_num_samples']:,} samples)\n"
        f"train: {summary['steps']:,} steps, {summary['samples']:,} samples in {summary['train_seconds']:.1f} s "
        f"({summary['train_samples_per_sec']:,.0f} samples/s), world size {summary['world_size']}"
        + (
            "\ncomm bytes sent per step by rank 0: "
            + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(summary["comm_bytes_per_step"].items()))
            if summary.get("comm_bytes_per_step")
            else ""
        )
    )


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """The summary as JSON, never half-written."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
