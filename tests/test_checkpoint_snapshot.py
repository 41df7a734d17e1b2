"""Snapshot buffers: copies and gathers equal their source, buffers come back only once a
checkpoint is written, and checkpoints taken through reused buffers restore bitwise."""

from __future__ import annotations

import threading

import torch

from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.snapshot import SnapshotBuffers
from recscale.checkpoint.storage import LocalStorage
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch


def test_copy_and_gather_equal_the_source_on_every_split():
    buffers = SnapshotBuffers(threads=3, min_parallel_bytes=0)
    src = torch.randn(1001, 7)
    held: list[torch.Tensor] = []
    assert torch.equal(buffers.copy(src, held), src)
    rows = torch.tensor([0, 5, 999, 1000, 17])
    assert torch.equal(buffers.gather(src, rows, held), src.index_select(0, rows))
    assert torch.equal(buffers.gather(src, torch.zeros(0, dtype=torch.long), held), src[:0])
    half = torch.randn(64, 3).to(torch.bfloat16)
    assert torch.equal(buffers.copy(half, held), half)
    buffers.close()


def test_a_buffer_is_reused_only_after_release():
    buffers = SnapshotBuffers(threads=1)
    src = torch.randn(100, 4)
    first: list[torch.Tensor] = []
    a = buffers.copy(src, first)
    second: list[torch.Tensor] = []
    b = buffers.copy(src + 1, second)
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, src)  # the first is still held
    buffers.release(first)
    third: list[torch.Tensor] = []
    c = buffers.gather(src, torch.arange(10), third)  # a prefix of the released buffer
    assert c.data_ptr() == a.data_ptr() and torch.equal(c, src[:10])
    buffers.close()


def _model() -> TableBatchedEmbeddingBags:
    tables = [TableConfig(f"t{i}", 500, 8, (f"f{i}",)) for i in range(3)]
    return TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=0)


def _train(emb: TableBatchedEmbeddingBags, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 500, (64, 3), generator=g)
    out = emb(JaggedBatch.from_dense_ids(["f0", "f1", "f2"], ids))
    out.sum().backward()


def _state(emb: TableBatchedEmbeddingBags) -> list[torch.Tensor]:
    out = []
    for t in emb.tables:
        out.append(emb.table_weight(t.name).clone())
        out += [v.clone() for v in emb.table_state(t.name).values()]
    return out


def test_checkpoints_through_reused_buffers_restore_bitwise(tmp_path, monkeypatch):
    """Full and differential checkpoints in turn, writes held back so that two are in flight:
    each restores to the state at its own step, although later snapshots reuse buffers."""
    emb = _model()
    settings = CheckpointSettings(dir=str(tmp_path), policy="intermittent", quantization="none", keep_last=0,
                                  async_write=True, max_in_flight=2, at_end=False)
    manager = CheckpointManager(settings, LocalStorage(tmp_path), local_shards(emb))
    gate = threading.Event()
    write = manager.writer._write
    monkeypatch.setattr(manager.writer, "_write", lambda job: (gate.wait(30), write(job))[1])
    expected = {}
    for step in range(1, 7):
        _train(emb, step)
        if step % 2 == 0:
            if step == 6:
                gate.set()
            manager.save(step, b"", {"step": step, "embedding_step": step})
            expected[step] = _state(emb)
    reports = manager.finish()
    assert [r.step for r in reports] == [2, 4, 6]
    storage = LocalStorage(tmp_path)
    for r in reports:
        fresh = _model()
        restore_shards(storage, load_chain(storage, load_manifest(storage, r.name)), local_shards(fresh))
        assert all(torch.equal(a, b) for a, b in zip(_state(fresh), expected[r.step])), r.name


def test_reserved_buffers_serve_the_first_snapshot():
    buffers = SnapshotBuffers(threads=2, min_parallel_bytes=0)
    src = torch.randn(300, 5)
    buffers.reserve([src])
    reserved = buffers._free[(src.dtype, (5,))][0]
    held: list[torch.Tensor] = []
    out = buffers.copy(src, held)
    assert out.data_ptr() == reserved.data_ptr() and torch.equal(out, src)
    buffers.close()
