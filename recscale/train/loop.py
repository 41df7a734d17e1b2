"""The single-process training loop: build, train, evaluate, summarise."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from recscale.data import Batch
from recscale.embedding import TableBatchedEmbeddingBags, TableConfig, make_optimizer
from recscale.model import DLRM
from recscale.train.config import Config, ConfigError
from recscale.train.datasets import DataSplits, build_data
from recscale.train.metrics import EvalMetrics, evaluate_predictions


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return torch.device(name)


def build_tables(cfg: Config, sparse_names: tuple[str, ...]) -> list[TableConfig]:
    """One table per sparse feature, rows from ``model.table_rows`` (one value = all)."""
    rows = cfg.model.table_rows
    if len(rows) == 1:
        rows = rows * len(sparse_names)
    if len(rows) != len(sparse_names):
        raise ConfigError(
            f"config key 'model.table_rows' has {len(rows)} values but the data has "
            f"{len(sparse_names)} sparse features; give one value per feature or a single value"
        )
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


def build_model(cfg: Config, sparse_names: tuple[str, ...], num_dense: int, device: torch.device) -> DLRM:
    eo = cfg.embedding_optimizer
    opt_kwargs: dict[str, float] = {"lr": eo.lr}
    if eo.name != "sgd":
        opt_kwargs["eps"] = eo.eps
    if eo.name == "adam":
        opt_kwargs.update(beta1=eo.beta1, beta2=eo.beta2)
    embeddings = TableBatchedEmbeddingBags(
        build_tables(cfg, sparse_names), make_optimizer(eo.name, **opt_kwargs), seed=cfg.train.seed, device=device
    )
    model = DLRM(embeddings, num_dense, cfg.model.bottom_mlp, cfg.model.top_mlp)
    return model.to(device)


def build_dense_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    d = cfg.dense_optimizer
    if d.name == "sgd":
        return torch.optim.SGD(params, lr=d.lr, weight_decay=d.weight_decay)
    if d.name == "adagrad":
        return torch.optim.Adagrad(params, lr=d.lr, weight_decay=d.weight_decay)
    return torch.optim.Adam(params, lr=d.lr, weight_decay=d.weight_decay)


@torch.no_grad()
def evaluate(model: DLRM, batches: Iterable[Batch], device: torch.device) -> EvalMetrics:
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in batches:
        batch = batch.to(device)
        logits.append(model(batch.dense, batch.sparse).float().cpu())
        labels.append(batch.labels.cpu())
    model.train(was_training)
    return evaluate_predictions(torch.cat(logits), torch.cat(labels))


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    train_seconds: float = 0.0


def train(cfg: Config, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train and evaluate as configured; returns the summary dict."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    device = pick_device(cfg.train.device)
    data: DataSplits = build_data(cfg)
    log(f"data: {data.description}")
    model = build_model(cfg, data.sparse_names, data.num_dense, device)
    dense_opt = build_dense_optimizer(cfg, model.dense_parameters())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    log(
        f"model: DLRM, {len(model.embeddings.tables)} tables, "
        f"{sum(t.num_rows for t in model.embeddings.tables):,} embedding rows x dim {cfg.model.embedding_dim}, "
        f"{sum(p.numel() for p in model.dense_parameters()):,} dense parameters, device {device}"
    )

    state = TrainState()
    evals: list[dict[str, float]] = []
    max_steps = cfg.train.max_steps or None
    total_steps = len(data.train) * cfg.train.epochs
    if max_steps:
        total_steps = min(total_steps, max_steps)
    bar = tqdm(total=total_steps, disable=not cfg.train.progress, unit="step", dynamic_ncols=True)
    running_loss, running_n = 0.0, 0
    done = False
    for epoch in range(cfg.train.epochs):
        data.train.set_epoch(epoch)
        t0 = time.perf_counter()
        for batch in data.train_loader():
            batch = batch.to(device, non_blocking=True)
            model.embeddings.validate(batch.sparse)
            logits = model(batch.dense, batch.sparse)
            loss = loss_fn(logits, batch.labels)
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # embedding rows are updated here, fused into backward
            dense_opt.step()
            state.step += 1
            state.samples += batch.batch_size
            running_loss += loss.item() * batch.batch_size
            running_n += batch.batch_size
            if state.step % 20 == 0 or state.step == total_steps:
                elapsed = state.train_seconds + time.perf_counter() - t0
                bar.set_postfix(loss=f"{running_loss / running_n:.4f}", samples_per_s=f"{state.samples / elapsed:,.0f}")
            bar.update(1)
            if cfg.train.eval_every_steps and state.step % cfg.train.eval_every_steps == 0:
                state.train_seconds += time.perf_counter() - t0
                m = evaluate(model, data.eval_loader(), device)
                evals.append({"step": state.step, **m.as_dict()})
                bar.write(f"step {state.step}: eval auc {m.auc:.4f}, logloss {m.logloss:.4f}, ne {m.ne:.4f}")
                t0 = time.perf_counter()
            if max_steps and state.step >= max_steps:
                done = True
                break
        state.train_seconds += time.perf_counter() - t0
        if done:
            break
    bar.close()

    final = evaluate(model, data.eval_loader(), device)
    summary: dict[str, Any] = {
        **final.as_dict(),
        "train_logloss": running_loss / max(running_n, 1),
        "train_samples_per_sec": state.samples / max(state.train_seconds, 1e-9),
        "train_seconds": state.train_seconds,
        "steps": state.step,
        "samples": state.samples,
        "world_size": 1,
        "device": str(device),
        "data": data.description,
        "evals": evals,
    }
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    return (
        f"eval: auc {summary['eval_auc']:.4f}  logloss {summary['eval_logloss']:.4f}  "
        f"ne {summary['eval_ne']:.4f}  calibration {summary['eval_calibration']:.3f}  "
        f"({summary['eval_num_samples']:,} samples)\n"
        f"train: {summary['steps']:,} steps, {summary['samples']:,} samples in {summary['train_seconds']:.1f} s "
        f"({summary['train_samples_per_sec']:,.0f} samples/s), world size {summary['world_size']}"
    )


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON to a temporary name, fsync, then rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
