"""The sharding step and the embedding-module interface the model takes."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from recscale.comm.process_group import Topology, init_process_groups
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.module import EmbeddingModule
from recscale.model import DLRM
from recscale.sharding.collection import ShardedEmbeddingCollection
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.shard import shard
from recscale.sparse import JaggedBatch

TABLES = [TableConfig("a", 50, 4, ("fa",)), TableConfig("b", 30, 4, ("fb",), pooling="mean")]


def _model(device: str) -> DLRM:
    torch.manual_seed(0)
    emb = TableBatchedEmbeddingBags(TABLES, RowWiseAdagrad(lr=0.1), seed=3, device=device)
    return DLRM(emb, 3, [8, 4], [8, 1])


def _batch(rows: slice) -> tuple[torch.Tensor, JaggedBatch]:
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(8, 3, generator=gen)
    ids = {"fa": [[i % 50, (7 * i) % 50] for i in range(8)], "fb": [[(3 * i) % 30] for i in range(8)]}
    batch = JaggedBatch.from_lists(ids)
    sizes = [rows.start, rows.stop - rows.start, 8 - rows.stop]
    return dense[rows], batch.split(sizes)[1]


def test_meta_embeddings_describe_tables_without_rows():
    model = _model("meta")
    assert isinstance(model.embeddings, EmbeddingModule)
    assert model.embeddings.feature_names == ("fa", "fb")
    assert all(g.storage.weight.device.type == "meta" for g in model.embeddings.groups)


def _shard_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = init_process_groups(Topology(world, rank, world), timeout_s=60)
    plan = default_plan(TABLES, groups.topology, "table_wise", {"b": TableSharding("row_wise")})
    model = shard(_model("meta"), plan, groups)
    assert isinstance(model.embeddings, ShardedEmbeddingCollection) and isinstance(model.embeddings, EmbeddingModule)
    dense, sparse = _batch(slice(4 * rank, 4 * rank + 4))
    step = model.embeddings.start_input_dist(sparse)
    logits = model(dense, step)
    assert step.global_batch_size == 8
    return logits.detach(), model.embeddings.full_table("b")


def test_sharded_model_equals_one_process():
    ref = _model("cpu")
    dense, sparse = _batch(slice(0, 8))
    want = ref(dense, ref.embeddings.start_input_dist(sparse)).detach()
    results = run_ranks(_shard_worker, 2, timeout_s=120)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), want, rtol=1e-6, atol=1e-7)
    for _, table in results:
        assert torch.equal(table, ref.embeddings.table_weight("b"))


def test_shard_takes_a_one_process_model_only():
    groups = init_process_groups(Topology(1, 0, 1), device=torch.device("cpu"))
    plan = default_plan(TABLES, groups.topology, "table_wise")
    model = shard(_model("meta"), plan, groups)
    with pytest.raises(TypeError, match="TableBatchedEmbeddingBags"):
        shard(model, plan, groups)
