"""A codec per save (``CheckpointManager.save(..., weight_codec=...)``): each manifest names the
codec its rows were written in, so a chain whose checkpoints use different codecs restores every
row as the codec of the checkpoint that last wrote it gives it alone; adaptive range hints carry
over an interleaved uniform checkpoint, and the writer counts the rows searched warm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.quantize import Codec
from recscale.checkpoint.restore import load_chain, load_manifest, read_chunk, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage
from recscale.embedding import TableBatchedEmbeddingBags
from ckpt_utils import train_skewed, two_tables

ROWS, DIM = 300, 16
UNIFORM2, ADAPTIVE2 = Codec("uniform", bits=2), Codec("adaptive", bits=2)


def _model() -> TableBatchedEmbeddingBags:
    return two_tables(ROWS, DIM)


def _train(emb: TableBatchedEmbeddingBags, step: int) -> None:
    train_skewed(emb, step, 128)


def _run(root: Path, policy: str, codecs: list[Codec]):
    """Two training steps before each save, save ``k`` in ``codecs[k]``; the tables at each save."""
    emb = _model()
    settings = CheckpointSettings(dir=str(root), policy=policy, quantization="uniform", bits=2,
                                  keep_last=0, async_write=False, at_end=False)
    manager = CheckpointManager(settings, LocalStorage(root), local_shards(emb), init_seed=0)
    at_save = []
    for k, codec in enumerate(codecs):
        for step in (2 * k + 1, 2 * k + 2):
            _train(emb, step)
        at_save.append({t.name: emb.table_weight(t.name).detach().clone() for t in emb.tables})
        manager.save(2 * k + 2, b"", {"step": 2 * k + 2, "embedding_step": 2 * k + 2}, weight_codec=codec)
    return at_save, manager.finish()


def test_a_chain_of_mixed_codecs_restores_each_row_as_its_codec_alone_gives_it(tmp_path):
    codecs = [UNIFORM2, ADAPTIVE2, UNIFORM2]
    at_save, reports = _run(tmp_path, "incremental", codecs)
    storage = LocalStorage(tmp_path)
    chain = load_chain(storage, load_manifest(storage, reports[-1].name))
    assert [m.kind for m in chain] == ["full", "incremental", "incremental"]
    assert [Codec.from_dict(m.weight_codec) for m in chain] == codecs
    # Each row as the last checkpoint holding it stores it, encoded by that checkpoint's codec
    # alone (both codecs are row-wise; the one adaptive checkpoint searches every row cold).
    expected = {t.name: _model().table_weight(t.name).detach().clone() for t in _model().tables}
    for m, codec, tables in zip(chain, codecs, at_save):
        for c in m.chunks:
            rows = read_chunk(storage, m, c).rows
            x = tables[c.table][rows]
            expected[c.table][rows] = codec.decode(codec.encode(x), rows.numel(), DIM)
    fresh = _model()
    restore_shards(storage, chain, local_shards(fresh))
    for name, want in expected.items():
        assert torch.equal(fresh.table_weight(name), want), name
    assert any(not torch.equal(want, at_save[-1][name]) for name, want in expected.items())  # lossy indeed


def test_adaptive_hints_carry_over_a_uniform_checkpoint_and_warm_rows_are_counted(tmp_path):
    _, reports = _run(tmp_path, "one_shot", [ADAPTIVE2, UNIFORM2, ADAPTIVE2, ADAPTIVE2])
    first, uniform, later, last = (r.phases for r in reports)
    assert first["searched_rows"] == reports[0].rows_written and first["warm_rows"] == 0
    assert "searched_rows" not in uniform  # no range search, no hints touched
    # The differentials hold rows changed since the baseline, most of them searched by the first.
    assert later["searched_rows"] == reports[2].rows_written and 0 < later["warm_rows"] <= later["searched_rows"]
    assert last["warm_rows"] >= later["warm_rows"]


def test_an_unknown_codec_method_is_refused(tmp_path):
    emb = _model()
    settings = CheckpointSettings(dir=str(tmp_path), policy="full", keep_last=0, async_write=False, at_end=False)
    manager = CheckpointManager(settings, LocalStorage(tmp_path), local_shards(emb), init_seed=0)
    with pytest.raises(ValueError, match="weight_codec method 'int3'"):
        manager.save(1, b"", {"step": 1}, weight_codec=Codec("int3"))
    manager.finish()
