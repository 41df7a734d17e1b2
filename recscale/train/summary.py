"""The run's summary: what kernel ran, what reruns the run, the per-step communication, the
plain-text lines rank 0 prints, and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from recscale.atomic import write_text_atomic
from recscale.comm.collectives import CommStats
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import TableBatchedEmbeddingBags
from recscale.model import DLRM
from recscale.train.config import Config
from recscale.train.model_factory import PlanChoice
from recscale.train.replay import versions


def runs_native_kernels(model: DLRM, groups: ProcessGroups) -> bool:
    """Whether every embedding lookup of every rank runs the native kernels (not the torch ones)."""
    bags = [m for m in model.embeddings.modules() if isinstance(m, TableBatchedEmbeddingBags)]
    native = all(b.runs_native() for b in bags)
    if groups.world_size > 1:
        flag = torch.tensor([int(native)], device=groups.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=groups.dense)
        native = bool(flag.item())
    return native


def format_summary(summary: dict[str, Any]) -> str:
    return (
        f"eval: auc {summary['eval_auc']:.4f}  logloss {summary['eval_logloss']:.4f}  "
        f"ne {summary['eval_ne']:.4f}  calibration {summary['eval_calibration']:.3f}  "
        f"({summary['eval_num_samples']:,} samples)\n"
        f"train: {summary['steps']:,} steps, {summary['samples']:,} samples in {summary['train_seconds']:.1f} s "
        f"({summary['train_samples_per_sec']:,.0f} samples/s"
        + (f"; {summary['steady_samples_per_sec']:,.0f} after the first steps" if summary.get("steady_samples_per_sec") else "")
        + f"), world size {summary['world_size']}"
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


def comm_per_step(stats: CommStats, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes and seconds of each collective per step this process trained (a resumed run's
    counters start at the resume, so they are divided by its own steps)."""
    n = max(steps, 1)
    return {k: v / n for k, v in stats.snapshot().items()}, {k: v / n for k, v in stats.seconds.items()}


def run_info(cfg: Config, choice: PlanChoice | None, reproducible: bool, kernel_native: bool) -> dict[str, Any]:
    """What reruns this run (``recscale train --replay``: see ``recscale/train/replay.py``)."""
    return {
        "config": cfg.to_dict(),
        "plan": choice.plan.to_dict() if choice else None,
        "plan_digest": choice.plan.digest() if choice else None,
        "hardware": choice.hardware if choice else None,
        "plan_search": choice.search if choice else None,
        "reproducible": reproducible,
        "embedding_kernel": "native" if kernel_native else "torch",
        "embedding_kernel_native": kernel_native,
        "versions": versions(),
    }
