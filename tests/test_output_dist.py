"""The output distribution's whole-feature fast path (dim-wide row copies) and its general path
(runs of columns copied or added, ``column_runs.py``) equal one process, alone and together;
column runs equal a scatter-add into zeros bitwise."""

from __future__ import annotations

import torch

from dist_utils import run_ranks
from recscale.comm.process_group import Topology, init_process_groups
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.sharding.collection import ShardedEmbeddingCollection
from recscale.sharding.column_runs import column_runs, place, take
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sparse import JaggedBatch

DIM = 4
TABLES = [TableConfig(n, rows, DIM, (f"f{n}",)) for n, rows in (("a", 30), ("b", 17), ("c", 25), ("d", 9))]
PLANS = {
    "table_wise": {},  # every owner copies; the output is never zeroed
    "mixed": {"b": ("row_wise",), "c": ("column_wise", 2)},  # owners with row/column shards scatter-add
    "with_dp": {"d": ("data_parallel",)},
}
BATCH, STEPS = 10, 4


def batches() -> list[tuple[JaggedBatch, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(TABLES) * BATCH,), generator=gen)
        vals = []
        for k, t in enumerate(TABLES):
            n = int(lengths[k * BATCH : (k + 1) * BATCH].sum())
            vals.append(torch.randint(0, t.num_rows, (n,), generator=gen))
        grad = torch.randn(BATCH, len(TABLES) * DIM, generator=gen)
        out.append((JaggedBatch(tuple(f"f{t.name}" for t in TABLES), torch.cat(vals), lengths), grad))
    return out


def _worker(rank: int, world: int) -> dict:
    groups = init_process_groups(Topology(world, rank, world), timeout_s=60)
    results = {}
    for name, overrides in PLANS.items():
        plan = default_plan(TABLES, groups.topology, "table_wise", {k: TableSharding(*v) for k, v in overrides.items()})
        coll = ShardedEmbeddingCollection(TABLES, RowWiseAdagrad(lr=0.1), plan, groups, seed=1)
        outs = []
        for batch, grad in batches():
            local = batch.split([BATCH // 2, BATCH - BATCH // 2])[rank]
            out = coll(local)
            outs.append(out.detach().clone())
            lo = 0 if rank == 0 else BATCH // 2
            out.backward(grad[lo : lo + local.batch_size])
        results[name] = (outs, {t.name: coll.full_table(t.name) for t in TABLES}, coll.output_dist.output_all_copied,
                         [s is not None for s in coll.output_dist.feature_slots])
    return results


def test_whole_feature_output_path_equals_one_process() -> None:
    ref = TableBatchedEmbeddingBags(TABLES, RowWiseAdagrad(lr=0.1), seed=1)
    ref_outs = []
    for batch, grad in batches():
        out = ref(batch)
        ref_outs.append(out.detach().clone())
        out.backward(grad)
    ref_tables = {t.name: ref.table_weight(t.name).clone() for t in TABLES}
    results = run_ranks(_worker, 2, timeout_s=120)
    for rank, res in enumerate(results):
        lo, hi = (0, BATCH // 2) if rank == 0 else (BATCH // 2, BATCH)
        for name, (outs, tables, all_copied, fast) in res.items():
            for got, want in zip(outs, ref_outs):
                torch.testing.assert_close(got, want[lo:hi], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
            for t in TABLES:
                torch.testing.assert_close(tables[t.name], ref_tables[t.name], rtol=1e-6, atol=1e-7)
            if name == "table_wise":
                assert all_copied and all(fast)
            if name == "mixed":
                assert not all(fast) and all_copied  # the general path ran here too; row shards' first part copies
            if name == "with_dp":
                assert all_copied and any(fast)  # the replicas' columns are copied in as well


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_column_runs_equal_a_scatter_add_into_zeros(data) -> None:
    # Blocks whose columns go anywhere in the output, overlapping (row shards' partial sums)
    # or not, in any order: copying the first writer's runs and adding the rest gives the
    # bits of index_add_ into zeros, and ``take`` is index_select.
    width = data.draw(st.integers(1, 24))
    blocks = data.draw(st.lists(st.lists(st.integers(0, width - 1), min_size=1, max_size=width, unique=True), min_size=1, max_size=4))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    values = [torch.randn(5, len(cols), generator=gen) for cols in blocks]
    want = torch.zeros(5, width)
    for cols, v in zip(blocks, values):
        want.index_add_(1, torch.tensor(cols), v)
    written = [False] * width
    runs = [column_runs(cols, written) for cols in blocks]
    got = torch.full((5, width), float("nan")) if all(written) else torch.zeros(5, width)
    for r, v in zip(runs, values):
        place(got, v, r)
    assert torch.equal(got, want)
    grad = torch.randn(5, width, generator=gen)
    for cols, r in zip(blocks, runs):
        assert torch.equal(take(grad, r), grad.index_select(1, torch.tensor(cols)))
