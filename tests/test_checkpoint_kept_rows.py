"""Adaptive rows unchanged since their last encoding are encoded on it again, without a search:
the codec writes such rows' bytes as before and searches the others as a plain encode would;
the manager keeps only rows the tracker says are unchanged, also across a checkpoint of another
codec, and a failed checkpoint still stops keeping the rows changed before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.manifest import CheckpointError
from recscale.checkpoint.quantize import Codec, RowRanges
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage
from recscale.embedding import TableBatchedEmbeddingBags
from ckpt_utils import train_skewed, two_tables

ROWS, DIM = 300, 16
UNIFORM2, ADAPTIVE2 = Codec("uniform", bits=2), Codec("adaptive", bits=2)


def _trained_rows(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) + torch.randn(n, 1, generator=g) * 0.1


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), d=st.integers(1, 40), bits=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 99),
       changed_share=st.floats(0.0, 1.0))
def test_kept_rows_write_their_bytes_again_and_the_others_search_as_a_plain_encode(n, d, bits, seed, changed_share):
    codec = Codec("adaptive", bits=bits)
    x = _trained_rows(n, d, seed)
    first = RowRanges.cold(n)
    buf = codec.encode_kept(x, first)
    assert buf == codec.encode(x, ranges=RowRanges.cold(n).found)  # nothing kept: the plain encode
    # Change some rows; the others are kept and must come out byte for byte as before.
    changed = torch.rand(n, generator=torch.Generator().manual_seed(seed + 1)) < changed_share
    y = x.clone()
    y[changed] = _trained_rows(int(changed.sum()), d, seed + 2)
    again = RowRanges(first.found.clone(), first.scale.clone(), first.bias.clone(), ~changed)
    out = codec.encode_kept(y, again)
    dec, ref = codec.decode(out, n, d), codec.decode(buf, n, d)
    assert torch.equal(dec[~changed], ref[~changed])
    # The changed rows: as a plain encode of them alone from the same starts.
    rows = torch.nonzero(changed).view(-1)
    if rows.numel():
        start = first.found.index_select(0, rows)
        alone = codec.encode(y[rows], ranges=start)
        assert torch.equal(dec[rows], codec.decode(alone, rows.numel(), d))
        assert torch.equal(again.found[rows], start)  # ``encode`` left its results in ``start``
    assert torch.equal(again.found[~changed], first.found[~changed])


def test_only_adaptive_keeps_rows():
    with pytest.raises(ValueError, match="only adaptive"):
        UNIFORM2.encode_kept(torch.zeros(2, 4), RowRanges.cold(2))


def _run(root: Path, codecs: list[Codec], policy: str = "one_shot", spy: list | None = None):
    """Two skewed training steps before each save, save ``k`` in ``codecs[k]``; the tables at each save."""
    emb = two_tables(ROWS, DIM)
    settings = CheckpointSettings(dir=str(root), policy=policy, quantization="uniform", bits=2,
                                  keep_last=0, async_write=False, at_end=False)
    manager = CheckpointManager(settings, LocalStorage(root), local_shards(emb), init_seed=0)
    if spy is not None:
        start = manager.ranges.start

        def spying(codec, key, num_rows, rows):
            found = start(codec, key, num_rows, rows)
            spy.append((len(at_save) - 1, key[0], rows.clone(), found.kept.clone()))
            return found
        manager.ranges.start = spying  # type: ignore[method-assign]
    at_save: list[dict[str, torch.Tensor]] = []
    for k, codec in enumerate(codecs):
        for step in (2 * k + 1, 2 * k + 2):
            train_skewed(emb, step, 64)
        at_save.append({t.name: emb.table_weight(t.name).detach().clone() for t in emb.tables})
        manager.save(2 * k + 2, b"", {"step": 2 * k + 2, "embedding_step": 2 * k + 2}, weight_codec=codec)
    return at_save, manager.finish(), manager


def test_rows_kept_are_exactly_those_unchanged_since_their_last_adaptive_encoding(tmp_path):
    # The uniform checkpoint in the middle writes no ranges, but the rows changed before it must
    # not be kept by the adaptive one after it.
    codecs = [ADAPTIVE2, UNIFORM2, ADAPTIVE2, ADAPTIVE2]
    spy: list = []
    at_save, reports, manager = _run(tmp_path, codecs, spy=spy)
    last_encoded: dict[str, torch.Tensor] = {}  # per table, the save index that last encoded each row
    kept_total = changed_seen = 0
    by_save: dict[int, list] = {}
    for save, table, rows, kept in spy:
        by_save.setdefault(save, []).append((table, rows, kept))
    for k, codec in enumerate(codecs):
        for table, rows, kept in by_save.get(k, []):
            last = last_encoded.setdefault(table, torch.full((ROWS,), -1))
            for r, keep in zip(rows.tolist(), kept.tolist()):
                prev = int(last[r])
                unchanged = prev >= 0 and all(torch.equal(at_save[j][table][r], at_save[prev][table][r])
                                              for j in range(prev, k + 1))
                # Kept only when unchanged; and here the tracker flags exactly the rows updated.
                assert keep == unchanged, (k, table, r)
                kept_total += keep
                changed_seen += (prev >= 0 and not unchanged and k >= 2)
            last[rows] = k
    assert kept_total > 0 and changed_seen > 0
    assert reports[1].phases.get("searched_rows") is None
    for r in (reports[0], reports[2], reports[3]):
        assert r.phases["kept_rows"] + r.phases["searched_rows"] == r.rows_written
    manager.restored()  # a restore: nothing kept any longer
    assert manager.ranges.kept_rows() == 0


def test_without_a_tracker_no_row_is_kept(tmp_path):
    spy: list = []
    _, reports, _ = _run(tmp_path, [ADAPTIVE2, ADAPTIVE2, ADAPTIVE2], policy="full", spy=spy)
    assert spy and not any(bool(kept.any()) for *_, kept in spy)
    assert all(r.phases["kept_rows"] == 0 for r in reports)


class _FailingStorage(LocalStorage):
    fail = False

    def make_dir(self, path: str) -> None:
        if self.fail and path.startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        super().make_dir(path)


def test_a_failed_checkpoint_still_stops_keeping_the_rows_changed_before_it(tmp_path):
    emb: TableBatchedEmbeddingBags = two_tables(ROWS, DIM)
    settings = CheckpointSettings(dir=str(tmp_path), policy="one_shot", quantization="adaptive", bits=2,
                                  keep_last=0, async_write=False, at_end=False)
    storage = _FailingStorage(tmp_path)
    manager = CheckpointManager(settings, storage, local_shards(emb), init_seed=0)
    train_skewed(emb, 1, 64)
    manager.save(1, b"", {"step": 1, "embedding_step": 1})
    kept_before = manager.ranges.kept_rows()
    before = {t.name: emb.table_weight(t.name).detach().clone() for t in emb.tables}
    train_skewed(emb, 2, 64)
    storage.fail = True  # the next checkpoint's directory cannot be made
    with pytest.raises(CheckpointError):
        manager.save(2, b"", {"step": 2, "embedding_step": 2})
    assert 0 < manager.ranges.kept_rows() < kept_before
    for s in local_shards(emb):
        moved = (emb.table_weight(s.table.name) != before[s.table.name]).any(1)
        assert bool(moved.any())
        assert not bool(manager.ranges._kept[(s.table.name, s.row_offset, s.col_offset)][moved].any())
