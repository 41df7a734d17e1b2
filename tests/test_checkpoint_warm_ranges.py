"""The adaptive quantizer's range search across checkpoints: each row's search starts from its
last result (kept per shard by the manager), the checkpoints restore within about the cold
search's error, the same run writes the same bytes, and a restore or a lossless codec keeps
no such state."""

from __future__ import annotations

from pathlib import Path

import torch

from recscale.checkpoint import quantize
from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.quantize import NEVER_SEARCHED, Codec
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage
from recscale.embedding import TableBatchedEmbeddingBags
from ckpt_utils import train_skewed, two_tables

ROWS, DIM = 400, 32


def _model() -> TableBatchedEmbeddingBags:
    return two_tables(ROWS, DIM)


def _train(emb: TableBatchedEmbeddingBags, step: int) -> None:
    train_skewed(emb, step, 256)


def _run(root: Path, quantization: str, bits: int = 2, saves: int = 4):
    emb = _model()
    settings = CheckpointSettings(dir=str(root), policy="intermittent", quantization=quantization, bits=bits,
                                  keep_last=0, async_write=False, at_end=False)
    manager = CheckpointManager(settings, LocalStorage(root), local_shards(emb), init_seed=0)
    for step in range(1, 3 * saves + 1):
        _train(emb, step)
        if step % 3 == 0:
            manager.save(step, b"", {"step": step, "embedding_step": step})
    reports = manager.finish()
    return emb, manager, reports


def test_rows_are_searched_warm_after_their_first_checkpoint(tmp_path, monkeypatch):
    searches: list = []

    def spy(search):  # the two-step search and the fused native one, whichever runs
        def spying(x, bits, bins, ratio, start=None, *args):
            searches.append(0 if start is None else int((start[:, 0] != NEVER_SEARCHED).sum()))
            return search(x, bits, bins, ratio, start, *args)
        return spying

    monkeypatch.setattr(quantize, "range_search", spy(quantize.range_search))
    monkeypatch.setattr(quantize, "search_packed", spy(quantize.search_packed))
    emb, manager, reports = _run(tmp_path, "adaptive")
    assert len(reports) == 4 and searches[0] == 0  # the first checkpoint: every row cold
    assert sum(searches[2:]) > 0  # later ones start written rows where they ended
    for s in local_shards(emb):
        found = manager.ranges._rows[(s.table.name, s.row_offset, s.col_offset)]
        written = (emb.table_weight(s.table.name) != _model().table_weight(s.table.name)).any(1)
        assert bool((found[written, 0] != NEVER_SEARCHED).all())
        assert bool((found[~written, 0] == NEVER_SEARCHED).all())
    manager.restored()  # a restore: every row cold again
    assert manager.ranges.nbytes() == 0


def test_warm_checkpoints_restore_within_the_cold_search_error(tmp_path):
    emb, _, reports = _run(tmp_path, "adaptive")
    storage = LocalStorage(tmp_path)
    fresh = _model()
    restore_shards(storage, load_chain(storage, load_manifest(storage, reports[-1].name)), local_shards(fresh))
    codec = Codec("adaptive", bits=2)
    warm = cold = 0.0
    for t in emb.tables:
        x = emb.table_weight(t.name).detach()
        rows = torch.nonzero((x != _model().table_weight(t.name)).any(1)).view(-1)
        x = x[rows]
        warm += float((fresh.table_weight(t.name)[rows] - x).square().sum())
        cold += float((codec.decode(codec.encode(x), rows.numel(), DIM) - x).square().sum())
    assert cold > 0 and warm <= cold * 1.03, (warm, cold)


def test_the_same_run_writes_the_same_bytes_and_lossless_keeps_no_ranges(tmp_path):
    for q in ("adaptive", "none"):
        runs = []
        for k in range(2):
            _, manager, _ = _run(tmp_path / f"{q}{k}", q, saves=3)
            runs.append({p.relative_to(tmp_path / f"{q}{k}"): p.read_bytes()
                         for p in sorted((tmp_path / f"{q}{k}").rglob("*.bin"))})
            assert (manager.ranges.nbytes() > 0) == (q == "adaptive")
        assert runs[0] and runs[0] == runs[1]
