"""N ranks equal one process: every sharding type, alone and mixed, on gloo over 127.0.0.1."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_ranks
from recscale.comm.process_group import Topology, init_process_groups
from recscale.comm.shared_memory import shared_memory_group
from recscale.embedding import SGD, Adagrad, Adam, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sharding.collection import CommPrecision, ShardedEmbeddingCollection
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sparse import JaggedBatch

TABLES = [
    TableConfig("a", 40, 8, ("fa",)),
    TableConfig("b", 23, 8, ("fb1", "fb2"), pooling="mean"),  # two features share it
    TableConfig("c", 17, 6, ("fc",)),  # another dim: a second storage group
    TableConfig("d", 31, 8, ("fd",)),
    TableConfig("e", 12, 8, ("fe",)),
]
GLOBAL_BATCH = 12
STEPS = 20
SEED = 5


def global_batches(weighted: bool) -> list[JaggedBatch]:
    """Skewed ids (heavy duplication within and across ranks), multi-hot and empty bags."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        feats, wts = {}, {}
        for t in TABLES:
            for f in t.features:
                bags = []
                for _ in range(GLOBAL_BATCH):
                    n = int(torch.randint(0, 4, (1,), generator=gen))
                    hot = torch.randint(0, 3, (n,), generator=gen)
                    cold = torch.randint(0, t.num_rows, (n,), generator=gen)
                    pick = torch.rand(n, generator=gen) < 0.5
                    bags.append(torch.where(pick, hot, cold).tolist())
                feats[f] = bags
                wts[f] = [[0.5 + 0.25 * (i % 3) for i in range(len(b))] for b in bags]
        out.append(JaggedBatch.from_lists(feats, wts if weighted else None))
    return out


def upstream_grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    total = sum(t.dim * len(t.features) for t in TABLES)
    return [torch.randn(GLOBAL_BATCH, total, generator=gen) for _ in range(STEPS)]


def make_optimizer(name: str):
    return {"rowwise_adagrad": RowWiseAdagrad(lr=0.1), "adagrad": Adagrad(lr=0.1), "sgd": SGD(lr=0.1),
            "adam": Adam(lr=0.01)}[name]


def shares(world: int) -> list[int]:
    return [len(c) for c in torch.arange(GLOBAL_BATCH).tensor_split(world)]


@functools.cache  # one process's run per optimizer: most checks compare against the same one; callers only read
def reference(opt_name: str, weighted: bool):
    module = TableBatchedEmbeddingBags(TABLES, make_optimizer(opt_name), seed=SEED)
    outs = []
    for batch, grad in zip(global_batches(weighted), upstream_grads()):
        out = module(batch)
        outs.append(out.detach().clone())
        out.backward(grad)
    tables = {t.name: module.table_weight(t.name).float().clone() for t in TABLES}
    states = {t.name: {k: v.clone() for k, v in module.table_state(t.name).items()} for t in TABLES}
    return outs, tables, states


def sharded_worker(rank, world, ranks_per_host, default, overrides, opt_name, weighted, precision, shared_memory=True,
                   dp_reduction="auto"):
    topo = Topology(world, rank, ranks_per_host)
    groups = init_process_groups(topo, timeout_s=60, shared_memory=shared_memory)
    assert (shared_memory_group(groups.embedding) is not None) == shared_memory
    plan = default_plan(TABLES, topo, default, {k: TableSharding(*v) for k, v in overrides.items()})
    coll = ShardedEmbeddingCollection(TABLES, make_optimizer(opt_name), plan, groups, SEED, CommPrecision(*precision),
                                      dp_reduction=dp_reduction)
    sizes = shares(world)
    start = sum(sizes[:rank])
    outs = []
    for batch, grad in zip(global_batches(weighted), upstream_grads()):
        local = batch.split(sizes)[rank]
        out = coll(local)
        outs.append(out.detach().clone())
        out.backward(grad[start : start + sizes[rank]])
    tables = {t.name: coll.full_table(t.name) for t in TABLES}
    states = {t.name: coll.full_state(t.name) for t in TABLES}
    return {"outs": outs, "tables": tables, "states": states, "bytes": coll.stats.snapshot(), "plan": plan.to_dict()}


_RUNS: dict[tuple, list] = {}


def run_once(worker, world, *args) -> list:
    """``run_ranks(worker, world, *args)``, run once per module: several tests compare against the
    same distributed run (the fp32 baseline of a reduced-precision one, a plan's layout), and its
    ranks are deterministic, so a second run would only repeat the first. Callers only read."""
    key = (worker.__name__, world, repr(args))
    if key not in _RUNS:
        _RUNS[key] = run_ranks(worker, world, *args)
    return _RUNS[key]


def check(world, ranks_per_host, default, overrides=None, opt_name="rowwise_adagrad", weighted=True,
          precision=("fp32", "fp32"), rtol=1e-5, atol=1e-6, shared_memory=True, dp_reduction="auto"):
    ref_outs, ref_tables, ref_states = reference(opt_name, weighted)
    results = run_once(sharded_worker, world, ranks_per_host, default, overrides or {}, opt_name, weighted, precision,
                       shared_memory, dp_reduction)
    sizes = shares(world)
    for rank, res in enumerate(results):
        start = sum(sizes[:rank])
        for step, (got, want) in enumerate(zip(res["outs"], ref_outs)):
            torch.testing.assert_close(got, want[start : start + sizes[rank]], rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} step {step} output: {m}")
        for t in TABLES:
            torch.testing.assert_close(res["tables"][t.name], ref_tables[t.name], rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} table {t.name}: {m}")
            for k, v in ref_states[t.name].items():
                torch.testing.assert_close(res["states"][t.name][k], v, rtol=rtol, atol=atol,
                                           msg=lambda m: f"rank {rank} table {t.name} state {k}: {m}")
    return results


MIX = {"a": ("table_wise",), "b": ("row_wise",), "c": ("column_wise", 2), "d": ("table_row_wise",), "e": ("data_parallel",)}


# Every type at 2 ranks; at 4 ranks on two hosts, table-row-wise (the only type whose layout
# depends on the hosts), and every type in test_mix_of_all_five_types_equals_one_process[4].
@pytest.mark.parametrize("world,default", [(2, "table_wise"), (2, "row_wise"), (2, "table_row_wise"),
                                           (2, "data_parallel"), (4, "table_row_wise")])
def test_each_sharding_type_equals_one_process_rowwise_adagrad(world, default):
    check(world, 2 if world == 4 else world, default)


# At 4 ranks, with row-wise Adagrad (the state that needs every column shard): narrow shards.
@pytest.mark.parametrize("world,opt_name", [(2, "rowwise_adagrad"), (2, "adagrad"), (4, "rowwise_adagrad")])
def test_column_wise_equals_one_process(world, opt_name):
    # Row-wise state needs each row's mean square over all column shards; element-wise state
    # shards with the columns.
    check(world, world, "column_wise", opt_name=opt_name)


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam"])
def test_data_parallel_replicas_agree_bitwise_with_every_optimizer(opt_name):
    # Each replica sums every replica's row gradients in the same order, so the copies never drift.
    results = check(2, 2, "data_parallel", opt_name=opt_name)
    for t in TABLES:
        assert torch.equal(results[0]["tables"][t.name], results[1]["tables"][t.name]), t.name


# Each transport, and an odd world size (uneven shares of the batch) on the shared-memory one.
@pytest.mark.parametrize("world,shared_memory", [(2, False), (3, True)])
def test_data_parallel_dense_reduce_and_row_gather_give_the_same_bits(world, shared_memory):
    # Both sum each row's replica parts in rank order: the choice between them (by bytes) can
    # never change a result. Both also equal one process.
    runs = {how: check(world, world, "data_parallel", opt_name="adagrad", shared_memory=shared_memory, dp_reduction=how)
            for how in ("gather", "dense")}
    for rank in range(world):
        g, d = runs["gather"][rank], runs["dense"][rank]
        assert g["bytes"]["dp_grads"] > 0 and "dp_grads_reduce_scatter" not in g["bytes"]
        assert d["bytes"]["dp_grads_reduce_scatter"] > 0 and d["bytes"]["dp_grads_all_gather"] > 0
        assert "dp_grads" not in d["bytes"]
        for t in TABLES:
            assert torch.equal(g["tables"][t.name], d["tables"][t.name]), (rank, t.name)
            for k in g["states"][t.name]:
                assert torch.equal(g["states"][t.name][k], d["states"][t.name][k]), (rank, t.name, k)
        for a, b in zip(g["outs"], d["outs"]):
            assert torch.equal(a, b)


MIXED_DP = [TableConfig("big", 5000, 8, ("f_big",)), TableConfig("tiny", 4, 8, ("f_tiny",))]


def mixed_dp_worker(rank, world, how):
    topo = Topology(world, rank, world)
    groups = init_process_groups(topo, timeout_s=60)
    plan = default_plan(MIXED_DP, topo, "data_parallel", {})
    coll = ShardedEmbeddingCollection(MIXED_DP, RowWiseAdagrad(lr=0.1), plan, groups, SEED, dp_reduction=how)
    for batch, grad in mixed_dp_steps():
        local = batch.split(shares(world))[rank]
        start = sum(shares(world)[:rank])
        coll(local).backward(grad[start : start + local.batch_size])
    return {"tables": {t.name: coll.full_table(t.name) for t in MIXED_DP}, "bytes": coll.stats.snapshot()}


def mixed_dp_steps():
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        feats = {"f_big": [torch.randint(0, 5000, (2,), generator=gen).tolist() for _ in range(GLOBAL_BATCH)],
                 "f_tiny": [torch.randint(0, 4, (3,), generator=gen).tolist() for _ in range(GLOBAL_BATCH)]}
        yield JaggedBatch.from_lists(feats), torch.randn(GLOBAL_BATCH, 16, generator=gen)


def test_data_parallel_auto_reduces_small_tables_densely_and_gathers_big_ones():
    # One operator group holds both: the big table's few touched rows are gathered, the tiny
    # table (every row touched by every replica) is reduced densely; results equal one process.
    auto = run_ranks(mixed_dp_worker, 2, "auto")
    gather = run_ranks(mixed_dp_worker, 2, "gather")
    ref = TableBatchedEmbeddingBags(MIXED_DP, RowWiseAdagrad(lr=0.1), seed=SEED)
    for batch, grad in mixed_dp_steps():
        ref(batch).backward(grad)
    for a, g in zip(auto, gather):
        assert a["bytes"]["dp_grads_reduce_scatter"] > 0 and 0 < a["bytes"]["dp_grads"] < g["bytes"]["dp_grads"]
        for t in MIXED_DP:
            assert torch.equal(a["tables"][t.name], g["tables"][t.name]), t.name
            torch.testing.assert_close(a["tables"][t.name], ref.table_weight(t.name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_mix_of_all_five_types_equals_one_process(world):
    check(world, 2, "table_wise", MIX)


def test_mix_of_all_five_types_through_gloo_equals_one_process():
    # The process group's own all-to-alls (GPUs, other hosts), with the sizes exchanged first.
    check(4, 2, "table_wise", MIX, shared_memory=False)


def test_table_row_wise_on_two_hosts_of_two_ranks_stays_on_one_host():
    results = check(4, 2, "table_row_wise")  # its 4-rank run in test_each_sharding_type_equals_one_process
    for t in results[0]["plan"]["tables"]:
        assert len({s["rank"] // 2 for s in t["shards"]}) == 1


@pytest.mark.parametrize("fwd,bwd,tol,max_ratio", [("fp16", "fp16", 2e-3, 0.5), ("bf16", "bf16", 2e-2, 0.5),
                                                  ("int8", "int8", 3e-2, 0.4)])
def test_reduced_precision_stays_close_and_sends_fewer_bytes(fwd, bwd, tol, max_ratio):
    """16-bit rows are half of fp32's; int8 rows are a byte per column plus 8 (scale and bias),
    about a third here (every rank's rows are over 20 columns wide)."""
    # The fp32 run is test_each_sharding_type_equals_one_process's table-wise one at 2 ranks.
    full = run_once(sharded_worker, 2, 2, "table_wise", {}, "rowwise_adagrad", True, ("fp32", "fp32"), True, "auto")
    low = run_ranks(sharded_worker, 2, 2, "table_wise", {}, "rowwise_adagrad", True, (fwd, bwd))
    for t in TABLES:
        torch.testing.assert_close(low[0]["tables"][t.name], full[0]["tables"][t.name], rtol=0, atol=tol)
    for name in ("output_a2a", "grad_a2a"):
        ratio = low[0]["bytes"][name] / full[0]["bytes"][name]
        assert ratio <= max_ratio, (name, ratio)


def hierarchy_worker(rank, world, ranks_per_host, hierarchical, precision):
    topo = Topology(world, rank, ranks_per_host)
    groups = init_process_groups(topo, timeout_s=60)
    plan = default_plan(TABLES, topo, "table_row_wise", {})
    coll = ShardedEmbeddingCollection(TABLES, make_optimizer("rowwise_adagrad"), plan, groups, SEED,
                                      CommPrecision(*precision), hierarchical=hierarchical)
    sizes = shares(world)
    start = sum(sizes[:rank])
    outs = []
    for batch, grad in zip(global_batches(True), upstream_grads()):
        out = coll(batch.split(sizes)[rank])
        outs.append(out.detach().clone())
        out.backward(grad[start : start + sizes[rank]])
    return {"outs": outs, "tables": {t.name: coll.full_table(t.name) for t in TABLES},
            "hier": coll.output_dist.hierarchy is not None, "cross": dict(coll.stats.cross_host_bytes),
            "bytes": coll.stats.snapshot()}


def test_table_row_wise_on_two_hosts_crosses_hosts_once_per_host_not_once_per_rank():
    # ZionEX's TWRW: the host reduce-scatters its partial sums, so the outputs and their
    # gradients cross hosts R-fold less than sent flat; results equal the flat path's.
    hier = run_once(hierarchy_worker, 4, 2, True, ("fp32", "fp32"))
    flat = run_ranks(hierarchy_worker, 4, 2, False, ("fp32", "fp32"))
    for rank, (h, f) in enumerate(zip(hier, flat)):
        assert h["hier"] and not f["hier"]
        assert h["bytes"]["twrw_reduce_scatter"] > 0 and h["bytes"]["twrw_grad_all_gather"] > 0
        assert h["cross"]["twrw_reduce_scatter"] == 0 and h["cross"]["twrw_grad_all_gather"] == 0
        for name in ("output_a2a", "grad_a2a"):
            assert f["cross"][name] > 0
            assert h["cross"][name] * 2 == f["cross"][name], (rank, name, h["cross"][name], f["cross"][name])
        for got, want in zip(h["outs"], f["outs"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for t in TABLES:
            torch.testing.assert_close(h["tables"][t.name], f["tables"][t.name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fwd,bwd,tol", [("bf16", "fp16", 2e-2), ("int8", "int8", 3e-2)])
def test_table_row_wise_on_two_hosts_with_reduced_precision_stays_close(fwd, bwd, tol):
    full = run_once(hierarchy_worker, 4, 2, True, ("fp32", "fp32"))  # the hierarchical run of the test above
    low = run_ranks(hierarchy_worker, 4, 2, True, (fwd, bwd))
    for a, b in zip(low, full):
        assert a["hier"]
        for t in TABLES:
            torch.testing.assert_close(a["tables"][t.name], b["tables"][t.name], rtol=0, atol=tol)
        assert a["bytes"]["output_a2a"] < 0.6 * b["bytes"]["output_a2a"]
