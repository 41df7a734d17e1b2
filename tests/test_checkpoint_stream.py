"""Streaming data-file writes: the bytes on disk are exactly the bytes written, whatever the
window and write sizes, with ``sync_file_range`` or without it (missing or failing); checkpoints
written either way restore bitwise and are the same files; the writer reports where its
seconds went, and ``next_kind`` names the kind ``save`` then writes."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.checkpoint import storage as storage_mod
from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage, StreamingWriter
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=12), window=st.integers(1, 9000), stream=st.booleans())
def test_streamed_file_holds_exactly_what_was_written(tmp_path_factory, sizes, window, stream):
    root = tmp_path_factory.mktemp("s")
    data = [os.urandom(n) for n in sizes]
    with LocalStorage(root, stream_window=window if stream else 0).open_write("d/f.bin") as f:
        for i, b in enumerate(data):
            f.write(memoryview(b) if i % 2 else b)
        assert f.tell() == sum(sizes)
    assert (root / "d" / "f.bin").read_bytes() == b"".join(data)


def test_without_or_with_a_failing_sync_file_range_it_is_a_plain_file(tmp_path, monkeypatch):
    data = os.urandom(100_000)
    monkeypatch.setattr(storage_mod, "_sync_file_range", None)
    with open(tmp_path / "a", "wb") as f:
        w = StreamingWriter(f, window=1000)
        assert not w.stream
        w.write(data)
        w.close()
    assert (tmp_path / "a").read_bytes() == data

    calls = []

    def failing(fd, offset, nbytes, flags):
        calls.append(flags)
        return -1

    monkeypatch.setattr(storage_mod, "_sync_file_range", failing)
    with open(tmp_path / "b", "wb") as f:
        w = StreamingWriter(f, window=1000)
        assert w.stream
        for i in range(0, len(data), 700):
            w.write(data[i : i + 700])
        w.close()
    assert len(calls) == 1 and not w.stream  # gave up after the first refusal
    assert (tmp_path / "b").read_bytes() == data


@pytest.mark.skipif(storage_mod._sync_file_range is None, reason="no sync_file_range on this platform")
def test_the_disk_gets_each_window_as_it_is_written(tmp_path):
    with open(tmp_path / "c", "wb") as f:
        w = StreamingWriter(f, window=4096)
        for _ in range(10):
            w.write(b"x" * 4096)
            assert w.started == w.written  # handed to the disk at once
            assert w.written - w.done <= 2 * 4096  # at most two windows not yet known written back
        w.close()
    assert (tmp_path / "c").stat().st_size == 40960


def _model() -> TableBatchedEmbeddingBags:
    tables = [TableConfig(f"t{i}", 700, 8, (f"f{i}",)) for i in range(3)]
    return TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=0)


def _train(emb: TableBatchedEmbeddingBags, step: int, hot: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, hot, (64, 3), generator=g)
    emb(JaggedBatch.from_dense_ids(["f0", "f1", "f2"], ids)).sum().backward()


@pytest.mark.parametrize("window", [0, 1000, 1 << 20])
def test_checkpoints_written_streamed_or_buffered_are_the_same_and_restore_bitwise(tmp_path, window):
    emb = _model()
    s = CheckpointSettings(dir=str(tmp_path), policy="intermittent", chunk_rows=100, keep_last=0, at_end=False,
                           skip_initial_rows=False)
    storage = LocalStorage(tmp_path, stream_window=window)
    m = CheckpointManager(s, storage, local_shards(emb), init_seed=0)
    kinds = []
    for step in range(1, 5):
        _train(emb, step, hot=700 if step in (1, 4) else 50)
        predicted = m.next_kind()
        m.save(step, b"rank", {"step": step})
        kinds.append("full" if len(m.chain) == 1 else "differential")
        assert predicted == kinds[-1]
    reports = m.finish()
    assert [r.kind for r in reports] == kinds and kinds[0] == "full"
    for r in reports:
        assert {"encode_s", "crc_s", "write_s", "fsync_s", "small_files_s", "commit_s", "write_thread_cpu_s",
                "encode_thread_cpu_s"} <= set(r.phases)
        assert all(v >= 0 for v in r.phases.values())
    fresh = _model()
    restore_shards(storage, load_chain(storage, load_manifest(storage, reports[-1].name)), local_shards(fresh))
    for t in emb.tables:
        assert torch.equal(emb.table_weight(t.name), fresh.table_weight(t.name))
        for k, v in emb.table_state(t.name).items():
            assert torch.equal(v, fresh.table_state(t.name)[k])
    # The data files do not depend on how they were written.
    digest = (tmp_path / reports[0].name / "rank00000.bin").read_bytes()
    again = tmp_path.parent / f"{tmp_path.name}-buffered"
    m2_storage = LocalStorage(again, stream_window=0)
    emb2 = _model()
    m2 = CheckpointManager(CheckpointSettings(dir=str(again), policy="full", chunk_rows=100, at_end=False,
                                              skip_initial_rows=False), m2_storage, local_shards(emb2), init_seed=0)
    _train(emb2, 1, hot=700)
    m2.save(1, b"rank", {"step": 1})
    (r2,) = m2.finish()
    assert (again / r2.name / "rank00000.bin").read_bytes() == digest
