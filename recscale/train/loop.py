"""The training loop: one short function that builds the job's parts (``model_factory``, data,
checkpointing, process tuning), trains with the pipeline, evaluates (``evaluation``) and returns
the summary (``summary``). The same code runs one process or every rank of a torchrun job."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from recscale.comm.collectives import CommStats, all_gather_object_check
from recscale.comm.dense_sync import DenseGradSync
from recscale.comm.process_group import (ProcessGroups, destroy_process_groups, env_topology, finish_process_groups,
                                         init_process_groups)
from recscale.embedding.tier_hooks import close_tiers
from recscale.model import DLRM
from recscale.train.checkpointing import TrainCheckpointing
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits, build_data, with_table_rows
from recscale.train.evaluation import evaluate
from recscale.train.guards import FiniteGuard
from recscale.train.lr_schedule import LearningRates
from recscale.train.model_factory import build_dense_optimizer, build_model, build_tables, choose_plan, pick_device
from recscale.train.pipeline import TrainPipeline, train_step
from recscale.train.progress import ProgressBar, TrainState
from recscale.train.process_tuning import ProcessTuning, tune_process
from recscale.train.replay import Replay, check_world_size
from recscale.train.summary import comm_per_step, run_info, runs_native_kernels
from recscale.train.tier_plan import predicted_tier_summary
from recscale.train.tiers import stale_tier_files, tier_summary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def config_digest(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()


def train(cfg: Config, log: Callable[[str], None] = print, replay: Replay | None = None) -> dict[str, Any]:
    """Train and evaluate as configured (one process, or every rank of a torchrun job);
    ``replay``: rerun a recorded run (its config is ``cfg``) on its recorded plan."""
    topology = env_topology(cfg.dist.ranks_per_host)
    if replay is not None:
        check_world_size(replay, topology.world_size)  # before any rank waits for another
    tuning = _tune(cfg, topology.ranks_per_host)
    device = pick_device(cfg.train.device, tiers=cfg.tiers.enabled())
    groups = init_process_groups(topology, cfg.dist.timeout_s, device=device, shared_memory=cfg.dist.shared_memory)
    try:
        summary = _train(cfg, groups, log if groups.rank == 0 else (lambda _: None), replay, tuning)
    except BaseException:
        if groups.world_size > 1:
            destroy_process_groups()
        raise
    if groups.world_size > 1:
        del groups  # so that finishing frees the groups
        finish_process_groups()
    return summary


def _tune(cfg: Config, ranks_per_host: int) -> ProcessTuning:
    t = cfg.train
    return tune_process(t.threads, cfg.data.num_workers, ranks_per_host, t.tune_process, t.retain_host_memory)


def _train(cfg: Config, groups: ProcessGroups, log: Callable[[str], None], replay: Replay | None = None,
           tuning: ProcessTuning | None = None) -> dict[str, Any]:
    if tuning is None:
        tuning = _tune(cfg, groups.topology.ranks_per_host)
    seed_everything(cfg.train.seed)
    device, world, rank = groups.device, groups.world_size, groups.rank
    if world > 1:
        all_gather_object_check(config_digest(cfg), groups.dense, "configs")
    data: DataSplits = build_data(cfg, rank, world, tuning.plan.workers)
    log(f"data: {data.description}")
    cfg = with_table_rows(cfg, data.table_rows, log)
    stats = CommStats()
    choice = choose_plan(cfg, build_tables(cfg, data.sparse_names), groups, replay, data) if world > 1 else None
    if stale := stale_tier_files(cfg):
        log(stale)
    model = build_model(cfg, data.sparse_names, data.num_dense, device, groups, stats, choice.plan if choice else None, data)
    kernel_native = runs_native_kernels(model, groups)
    dense_params = model.dense_parameters()
    dense_opt = build_dense_optimizer(cfg, dense_params)
    sync = DenseGradSync(dense_params, groups.dense, cfg.comm.dense, cfg.comm.loss_scale, stats)
    tuning.after_build()  # after the build: its one-off temporaries go back to the OS
    log(tuning.describe())
    log(describe_model(model, cfg, dense_params, device, world, kernel_native))
    # Reproducible unless the planner's safety time limit cut its search short.
    reproducible = choice is None or choice.search is None or bool(choice.search.get("reproducible", True))
    if not reproducible:
        log("warning: the planner's time limit cut its search short: this plan (and run) is not reproducible")
    if replay is not None:
        log(f"replaying {replay.path}" + (f" on its plan {choice.plan.digest()[:12]}" if choice else ""))
    eval_group = groups.dense if world > 1 else None

    ckpt = TrainCheckpointing(cfg, model, dense_opt, data, groups, log)
    state = TrainState.from_progress(ckpt.restore(), device)
    guard = FiniteGuard([(k, p) for k, p in model.named_parameters() if not k.startswith("embeddings.")],
                        groups.dense if world > 1 else None)
    # The schedule's length is the epochs' (train.max_steps stops a run early, it does not shorten it).
    schedule_steps = len(data.train) * cfg.train.epochs
    max_steps = cfg.train.max_steps or None
    total_steps = min(schedule_steps, max_steps) if max_steps else schedule_steps
    lrs = LearningRates(cfg.lr_schedule, schedule_steps, dense_opt, model.embeddings,
                        cfg.dense_optimizer.lr, cfg.embedding_optimizer.lr)
    if cfg.lr_schedule.enabled:
        try:
            cfg.lr_schedule.check_length(schedule_steps)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log(cfg.lr_schedule.describe(schedule_steps))
    bar = ProgressBar(total_steps, state, show=cfg.train.progress, rank=rank)
    done = bool(max_steps and state.step >= max_steps)
    resumed_at = (state.epoch, state.next_batch)
    for epoch in range(resumed_at[0], cfg.train.epochs if not done else resumed_at[0]):
        data.train.set_epoch(epoch)
        state.epoch = epoch
        state.resume()
        first = resumed_at[1] if epoch == resumed_at[0] else 0  # a resumed run skips what it trained
        batches = data.train_loader(first)
        if max_steps:  # the pipeline prepares batches ahead: none past the last step (its ids would travel for nothing)
            batches = itertools.islice(batches, max(0, max_steps - state.step))
        pipeline = TrainPipeline(batches, model.embeddings, device, cfg.train.pipeline, cfg.tiers.lookahead_batches)
        for state.next_batch, (batch, sparse) in enumerate(pipeline, start=first + 1):
            lrs.before_step(state.step)
            # Embedding rows are updated inside backward, fused into it.
            loss_sum = train_step(model, batch, sparse, dense_opt, sync)
            state.record(loss_sum, batch.batch_size, sparse.global_batch_size)
            guard.observe(state.step, loss_sum)
            if bar.due(state.step):
                guard.check(state.step, False, ckpt.last_checkpoint)  # where the loop syncs anyway
                tiers = tier_summary(model.embeddings, state.step, state.elapsed())
                bar.show(state, lrs.factor, {k: v for k, v in tiers.items() if k != "prefetched_rows"})
            bar.update()
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                state.pause()
                m = evaluate(model, data.eval_loader(), device, eval_group)
                state.evals.append({"step": state.step, **m.as_dict()})
                bar.write(f"step {state.step}: eval auc {m.auc:.4f}, logloss {m.logloss:.4f}, ne {m.ne:.4f}")
                state.resume()
            ckpt.after_step(state.step, state.position, lambda: guard.check(state.step, True, ckpt.last_checkpoint))
            if max_steps and state.step >= max_steps:
                done = True
                break
        pipeline.close()
        state.pause()
        if done:
            break
    bar.close()
    guard.check(state.step, True, ckpt.last_checkpoint)
    ckpt_summary = ckpt.finish(state.position())
    if world > 1:
        state.loss_over_ranks(groups.dense)
    comm_bytes, comm_seconds = comm_per_step(stats, state.steps_this_process)

    final = evaluate(model, data.eval_loader(), device, eval_group)
    summary: dict[str, Any] = {
        **final.as_dict(),
        "train_logloss": state.mean_loss(),
        "train_samples_per_sec": state.samples / max(state.train_seconds, 1e-9),
        "train_seconds": state.train_seconds,
        "steady_samples_per_sec": state.steady_samples_per_sec(),
        "steps": state.step,
        "samples": state.samples,
        "world_size": world,
        "rank": rank,
        "comm_bytes_per_step": comm_bytes,
        "comm_seconds_per_step": comm_seconds,
        "comm_precision": {"forward": cfg.comm.forward, "backward": cfg.comm.backward, "dense": cfg.comm.dense},
        "device": str(device),
        "data": data.description,
        "evals": state.evals,
        **ckpt_summary,
        **run_info(cfg, choice, reproducible, kernel_native),
        **tier_summary(model.embeddings, state.step, state.train_seconds,
                       groups.dense if world > 1 and cfg.tiers.enabled() else None),
        **predicted_tier_summary(cfg, model.embeddings, data, state.steps_this_process),
    }
    close_tiers(model.embeddings)  # every row written back: the tier files are complete
    return summary


def describe_model(model: DLRM, cfg: Config, dense_params: list[torch.nn.Parameter], device: torch.device,
                   world: int, kernel_native: bool) -> str:
    tables = model.embeddings.tables
    return (
        f"model: DLRM, {len(tables)} tables, {sum(t.num_rows for t in tables):,} embedding rows x dim "
        f"{cfg.model.embedding_dim}, {sum(p.numel() for p in dense_params):,} dense parameters, device {device}, "
        f"world size {world}, embedding kernel {'native' if kernel_native else 'torch'}"
    )
