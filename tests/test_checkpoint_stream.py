"""Data-file writes (direct, streamed, buffered): the bytes on disk are exactly the bytes
written, whatever the alignment, window and write sizes, with ``sync_file_range`` or direct
I/O or without them (missing or failing); checkpoints
written either way restore bitwise and are the same files; the writer reports where its
seconds went, and ``next_kind`` names the kind ``save`` then writes."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import zlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.checkpoint import checksum
from recscale.checkpoint import storage as storage_mod
from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import DirectWriter, LocalStorage, StreamingWriter
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch


def _aligned(n: int) -> memoryview:
    """``n`` random bytes at a page-aligned address (as direct I/O takes them)."""
    m = mmap.mmap(-1, max(n, 1))
    m.write(os.urandom(n))
    return memoryview(m)[:n]


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from([0, 1, 100, 4095, 4096, 8192, 12288, 20000]), st.booleans()),
                      max_size=12),
       window=st.integers(1, 9000), mode=st.sampled_from(["direct", "stream", "buffered"]),
       stage=st.sampled_from([4096, 8192, 1 << 20]))
def test_written_file_holds_exactly_what_was_written(tmp_path_factory, sizes, window, mode, stage):
    """Every way of writing, aligned buffers or not, any sizes: the same bytes on disk."""
    root = tmp_path_factory.mktemp("s")
    data = [_aligned(n) if aligned else os.urandom(n) for n, aligned in sizes]
    storage = LocalStorage(root, stream_window=window if mode == "stream" else 0, direct=mode == "direct")
    with mock.patch.object(storage_mod, "DIRECT_STAGE", stage), storage.open_write("d/f.bin") as f:
        for b in data:
            f.write(b)
        assert f.tell() == sum(n for n, _ in sizes)
    assert (root / "d" / "f.bin").read_bytes() == b"".join(bytes(b) for b in data)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 40000), st.sampled_from([0, 0, 1, 512, 4095])), max_size=10),
       depth=st.integers(1, 6), unit=st.sampled_from([4096, 8192, 12288, 1 << 20]),
       stage=st.sampled_from([4096, 8192, 20480]), extend=st.booleans())
def test_direct_writes_in_flight_at_any_depth_give_the_same_bytes(tmp_path_factory, sizes, depth, unit, stage, extend):
    """Several writes in flight at explicit offsets, large parts cut into units, staging in
    buffers copied on the I/O threads, the file extended ahead or not: the bytes written, in
    order, and nothing after them. ``sizes``: (length, shift from a page boundary)."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no direct I/O on this platform")
    path = tmp_path_factory.mktemp("d") / "f.bin"
    data = []
    for n, shift in sizes:
        m = _aligned(n + shift)
        data.append(m[shift:])
    fd = storage_mod._open_direct(path)
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    w = DirectWriter(fd, stage=stage, depth=depth, unit=unit)
    w.extend = w.extend and extend
    try:
        for b in data:
            assert w.write(b) == len(b)
        assert w.tell() == sum(len(b) for b in data)
        w.close()
    finally:
        w.release()
    assert len(w.stages) <= depth + 1
    assert path.read_bytes() == b"".join(bytes(b) for b in data)


def _refusing_pwrite(refuse: int):
    """``os.pwrite`` that refuses its first ``refuse`` calls (EINVAL) while the file is direct."""
    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if len(refused) < refuse and os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    return pwrite, refused


@pytest.mark.parametrize("depth", [1, 4])
def test_a_refused_direct_write_goes_on_through_the_page_cache(tmp_path, monkeypatch, depth):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no direct I/O on this platform")
    pwrite, refused = _refusing_pwrite(refuse=depth)
    data = [_aligned(8192), os.urandom(5000), _aligned(4096), _aligned(3 * 4096)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    w = DirectWriter(fd, stage=4096, depth=depth, unit=4096)
    monkeypatch.setattr(os, "pwrite", pwrite)
    for b in data:
        w.write(b)
    w.close()
    monkeypatch.undo()
    w.release()
    assert refused and not w.direct
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(b) for b in data)


def test_a_failed_write_on_the_io_thread_is_raised_to_the_writer(tmp_path, monkeypatch):
    """Writes run on I/O threads, several in flight: a full disk there surfaces at a later
    write or at ``close``, never lost, and the writer still closes its file."""
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    w = DirectWriter(fd, stage=4096, depth=3)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError) as err:
        for _ in range(6):
            w.write(os.urandom(4096))
        w.close()
    monkeypatch.undo()
    w.release()
    assert err.value.errno == errno.ENOSPC


def test_no_room_to_extend_the_file_is_a_full_disk(tmp_path, monkeypatch):
    """Extending the file ahead of the writes (fallocate) fails like a write on a full disk
    when not even the write itself fits; short of room for the extent ahead, it extends only as
    far as the write; a file system without fallocate just gets writes past the end."""
    def no_room(fd, mode, offset, length):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    def unsupported(fd, mode, offset, length):
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    monkeypatch.setattr(storage_mod, "_fallocate", no_room)
    w = DirectWriter(os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT), stage=4096)
    with pytest.raises(OSError) as err:
        w.write(_aligned(8192))
    w.release()
    assert err.value.errno == errno.ENOSPC

    asked = []

    def room_for_the_write_only(fd, mode, offset, length):
        asked.append(length)
        if length > 8192:
            ctypes.set_errno(errno.ENOSPC)
            return -1
        return 0

    monkeypatch.setattr(storage_mod, "_fallocate", room_for_the_write_only)
    w = DirectWriter(os.open(tmp_path / "c", os.O_WRONLY | os.O_CREAT), stage=4096)
    w.write(_aligned(8192))
    w.close()
    w.release()
    assert asked == [storage_mod.DIRECT_AHEAD + 8192, 8192] and (tmp_path / "c").stat().st_size == 8192

    monkeypatch.setattr(storage_mod, "_fallocate", unsupported)
    data = _aligned(3 * 4096)
    w = DirectWriter(os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT), stage=4096, unit=4096)
    w.write(data)
    w.close()
    w.release()
    assert not w.extend and (tmp_path / "b").read_bytes() == bytes(data)


def test_chunk_checksums_are_zlibs_crc32():
    """The crc32 of chunks (ISA-L's where installed) is zlib's, also continued across parts."""
    blobs = [b"", b"a", os.urandom(1000), os.urandom(70000)]
    for b in blobs:
        assert checksum.crc32(b) == zlib.crc32(b)
        assert checksum.crc32(memoryview(b)) == zlib.crc32(b)
    assert checksum.crc32(blobs[3], checksum.crc32(blobs[2])) == zlib.crc32(blobs[2] + blobs[3])


def test_a_file_system_without_direct_io_gets_page_cache_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_mod, "_open_direct", lambda path: None)
    with LocalStorage(tmp_path).open_write("f") as f:
        assert isinstance(f, StreamingWriter)
        f.write(b"abc")
    assert (tmp_path / "f").read_bytes() == b"abc"


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


@pytest.mark.parametrize("window,direct", [(0, False), (1000, False), (1 << 20, False), (0, True)])
def test_checkpoints_written_any_way_are_the_same_and_restore_bitwise(tmp_path, window, direct):
    emb = _model()
    s = CheckpointSettings(dir=str(tmp_path), policy="intermittent", chunk_rows=100, keep_last=0, at_end=False,
                           skip_initial_rows=False)
    storage = LocalStorage(tmp_path, stream_window=window, direct=direct)
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
    m2_storage = LocalStorage(again, stream_window=0, direct=False)
    emb2 = _model()
    m2 = CheckpointManager(CheckpointSettings(dir=str(again), policy="full", chunk_rows=100, at_end=False,
                                              skip_initial_rows=False), m2_storage, local_shards(emb2), init_seed=0)
    _train(emb2, 1, hot=700)
    m2.save(1, b"rank", {"step": 1})
    (r2,) = m2.finish()
    assert (again / r2.name / "rank00000.bin").read_bytes() == digest
