"""The sharding step, the embedding-module interface the model takes, and a sharding type added
from outside the package (its own class and one registration)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from recscale.comm.process_group import Topology, init_process_groups
from recscale.embedding import SGD, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.module import EmbeddingModule
from recscale.model import DLRM
from recscale.sharding.collection import ShardedEmbeddingCollection
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import PlanError, Shard, ShardingPlan
from recscale.sharding.shard import shard
from recscale.sharding.types import SHARDING_TYPES, ShardingType
from recscale.sharding.types.base import even_split, require_full_height
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


class _HostColumnWise(ShardingType):
    """The worked example of docs/architecture.md: column shards on the ranks of one host."""

    name = "host_column_wise"

    def candidate_layouts(self, num_rows, dim, topology):
        parts = topology.ranks_per_host
        if parts < 2 or dim < 2 * parts:
            return []
        return [[(0, num_rows, col, cols) for col, cols in even_split(dim, parts)]]

    def make_shards(self, table, topology, loads, num_shards):
        host = min(range(topology.num_hosts), key=lambda h: (sum(loads[r] for r in topology.ranks_of_host(h)), h))
        shards = []
        for rank, (col, cols) in zip(topology.ranks_of_host(host), even_split(table.dim, topology.ranks_per_host)):
            loads[rank] += table.num_rows * cols
            shards.append(Shard(rank, 0, table.num_rows, col, cols))
        return tuple(shards)

    def check(self, table_plan, table, plan):
        super().check(table_plan, table, plan)
        require_full_height(table_plan, table)
        if len({s.rank // plan.ranks_per_host for s in table_plan.shards}) != 1:
            raise PlanError(f"table '{table.name}': host_column_wise shards must all be on one host")


def _new_type_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    SHARDING_TYPES[_HostColumnWise.name] = _HostColumnWise()  # the one registration
    groups = init_process_groups(Topology(world, rank, world), timeout_s=60)
    plan = default_plan(TABLES, groups.topology, "table_wise", {"a": TableSharding("host_column_wise")})
    plan = ShardingPlan.from_dict(plan.to_dict())  # plan files name it too
    coll = ShardedEmbeddingCollection(TABLES, SGD(lr=0.1), plan, groups, seed=3)
    _, sparse = _batch(slice(4 * rank, 4 * rank + 4))
    out = coll(sparse)
    out.backward(torch.ones_like(out))
    return out.detach(), coll.full_table("a"), [(s.rank, s.col_offset, s.num_cols) for s in plan.table("a").shards]


def test_a_type_added_in_its_own_file_and_registered_once_trains_like_one_process():
    ref = TableBatchedEmbeddingBags(TABLES, SGD(lr=0.1), seed=3)
    _, sparse = _batch(slice(0, 8))
    want = ref(sparse)
    want.backward(torch.ones_like(want))
    results = run_ranks(_new_type_worker, 2, timeout_s=120)
    assert results[0][2] == [(0, 0, 2), (1, 2, 2)]
    torch.testing.assert_close(torch.cat([r[0] for r in results]), want.detach(), rtol=1e-6, atol=1e-7)
    for _, table, _ in results:
        assert torch.equal(table, ref.table_weight("a"))
