"""Helpers for checkpoint tests: run training while recording the sample sequence and the final
state (embedding tables, their optimizer state, dense parameters and optimizer state)."""

from __future__ import annotations

import hashlib

import torch

import recscale.train.loop as loop
from recscale.comm.process_group import Topology, init_process_groups
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch
from recscale.train.config import load_config

TINY = [
    "data.source=synthetic",
    "data.num_samples=4096",
    "data.eval_samples=1024",
    "data.pooling_factors=[1, 3, 2]",
    "data.num_workers=0",
    "model.table_rows=[1000, 5000, 300]",
    "train.batch_size=256",
    "train.progress=false",
    "dist.timeout_s=60",
]


def batch_digest(batch) -> str:
    h = hashlib.sha256()
    for t in (batch.dense, batch.sparse.values, batch.sparse.lengths, batch.labels):
        h.update(t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def model_state(model, world: int) -> dict[str, torch.Tensor]:
    """Whole tables and their optimizer state (assembled over ranks: a collective), dense params."""
    emb = model.embeddings
    out = {}
    for t in emb.tables:
        if world == 1:
            out[f"{t.name}.weight"] = emb.table_weight(t.name).float().clone()
            for k, v in emb.table_state(t.name).items():
                out[f"{t.name}.{k}"] = v.clone()
        else:
            out[f"{t.name}.weight"] = emb.full_table(t.name).clone()
            for k, v in emb.full_state(t.name).items():
                out[f"{t.name}.{k}"] = v.clone()
    for k, v in model.named_parameters():
        if not k.startswith("embeddings."):
            out[k] = v.detach().clone()
    return out


def run_training(overrides: list[str], groups=None) -> tuple[dict, dict, list[str]]:
    """Train once in this process (``groups``: an initialised multi-rank job). Returns the
    summary, the final state and the digests of the batches this rank trained on."""
    cfg = load_config(None, TINY + overrides)
    captured: dict = {}
    seen: list[str] = []
    orig_build, orig_step = loop.build_model, loop.train_step

    def build(*a, **k):
        captured["model"] = orig_build(*a, **k)
        return captured["model"]

    def step(model, batch, *a, **k):  # the batches trained (the pipeline also fetches one ahead)
        seen.append(batch_digest(batch))
        return orig_step(model, batch, *a, **k)

    loop.build_model, loop.train_step = build, step
    try:
        if groups is None:
            summary = loop.train(cfg, log=lambda _: None)
            world = 1
        else:
            summary = loop._train(cfg, groups, lambda _: None)
            world = groups.world_size
        state = model_state(captured["model"], world)
    finally:
        loop.build_model, loop.train_step = orig_build, orig_step
    return summary, state, seen


def rank_runs(rank: int, world: int, runs: list[list[str]]):
    """Worker for ``run_ranks``: several training runs in one process group."""
    groups = init_process_groups(Topology(world, rank, world), 60.0, device=torch.device("cpu"))
    return [run_training(o, groups) for o in runs]


def run_dirs(root) -> list:
    """The run folders under a checkpoint root, oldest first (by their recorded start)."""
    from recscale.checkpoint.lineage import list_runs
    from recscale.checkpoint.storage import LocalStorage

    return [root / r.run for r in list_runs(LocalStorage(root))]


def ckpt_dir(root, step: int):
    """The checkpoint of ``step`` of the newest run that has one, under a checkpoint root."""
    name = f"step{step:010d}"
    return next((d / name for d in reversed(run_dirs(root)) if (d / name).is_dir()), root / name)


def two_tables(rows: int, dim: int) -> TableBatchedEmbeddingBags:
    """Two row-wise Adagrad tables, the same for every call (seed 0)."""
    tables = [TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i in range(2)]
    return TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=0)


def train_skewed(emb: TableBatchedEmbeddingBags, step: int, batch: int) -> None:
    """One step of ``two_tables`` on skewed ids: hot rows change every interval, cold ones rarely."""
    rows = emb.tables[0].num_rows
    g = torch.Generator().manual_seed(step)
    ids = (torch.rand(batch, 2, generator=g) ** 3 * rows).long()
    out = emb(JaggedBatch.from_dense_ids(["f0", "f1"], ids))
    (out * torch.randn(out.shape, generator=g)).sum().backward()
