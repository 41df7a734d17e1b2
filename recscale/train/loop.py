"""The training loop: one short function that builds the job's parts (``model_factory``, data,
checkpointing, process tuning), trains with the pipeline, evaluates (``evaluation``) and returns
the summary (``summary``). The same code runs one process or every rank of a torchrun job."""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from recscale.comm.collectives import CommStats, all_gather_object_check
from recscale.comm.dense_sync import DenseGradSync
from recscale.comm.process_group import ProcessGroups, destroy_process_groups, env_topology, init_process_groups
from recscale.embedding.tier_hooks import close_tiers
from recscale.train.checkpointing import Progress, TrainCheckpointing
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits, build_data, with_table_rows
from recscale.train.evaluation import evaluate
from recscale.train.guards import FiniteGuard
from recscale.train.lr_schedule import set_learning_rates
from recscale.train.model_factory import build_dense_optimizer, build_model, build_tables, choose_plan, pick_device
from recscale.train.pipeline import TrainPipeline, train_step
from recscale.train.process_tuning import ProcessTuning, tune_process
from recscale.train.replay import Replay, check_world_size, versions
from recscale.train.summary import runs_native_kernels
from recscale.train.tiers import tier_summary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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
    kernel_native = runs_native_kernels(model, groups)
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


def _progress(
    state: TrainState, epoch: int, next_batch: int, loss: torch.Tensor, n: int, evals: list, t0: float | None
) -> Progress:
    """The loop's position for a checkpoint (``t0``: start of the running timing span, if open)."""
    seconds = state.train_seconds + (time.perf_counter() - t0 if t0 is not None else 0.0)
    return Progress(state.step, state.samples, seconds, epoch, next_batch, float(loss), n, list(evals))
