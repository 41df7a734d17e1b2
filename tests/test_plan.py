"""Sharding plans: default placement, JSON round trip, and clear errors for bad plans."""

import json

import pytest

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.sharding.default_plan import TableSharding, default_plan
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan

TABLES = [TableConfig(f"t{i}", 10 * (i + 1), 8) for i in range(6)]
OVERRIDES = {
    "t1": TableSharding("column_wise", 3),
    "t2": TableSharding("row_wise"),
    "t3": TableSharding("table_row_wise"),
    "t4": TableSharding("data_parallel"),
}


def test_default_plan_covers_every_table_and_round_trips(tmp_path):
    plan = default_plan(TABLES, Topology(4, 0, 2), "table_wise", OVERRIDES)
    kinds = {t.table: t.sharding_type for t in plan.tables}
    assert kinds == {"t0": "table_wise", "t1": "column_wise", "t2": "row_wise", "t3": "table_row_wise",
                     "t4": "data_parallel", "t5": "table_wise"}
    cw = plan.table("t1")
    assert [s.num_cols for s in cw.shards] == [3, 3, 2] and len({s.rank for s in cw.shards}) == 3
    rw = plan.table("t2")
    assert [(s.row_offset, s.num_rows) for s in rw.shards] == [(0, 8), (8, 8), (16, 7), (23, 7)]
    assert len({s.rank // 2 for s in plan.table("t3").shards}) == 1
    path = tmp_path / "plan.json"
    plan.save(path)
    doc = json.loads(path.read_text())
    assert set(doc["tables"][0]["shards"][0]) == {"rank", "row_offset", "num_rows", "col_offset", "num_cols"}
    again = ShardingPlan.load(path)
    assert again == plan and again.digest() == plan.digest()


@pytest.mark.parametrize(
    "tables, fragment",
    [
        ((TablePlan("t0", "table_wise", (Shard(0, 0, 5, 0, 8),)),), "cover 40 of 80 cells"),
        ((TablePlan("t0", "table_wise", (Shard(7, 0, 10, 0, 8),)),), "outside world size 2"),
        ((TablePlan("t0", "row_wise", (Shard(0, 0, 5, 0, 8), Shard(1, 5, 5, 0, 4), Shard(1, 5, 5, 4, 4))),), "must span every column"),
        ((TablePlan("t0", "data_parallel", (Shard(0, 0, 10, 0, 8),)),), "whole copy on every rank"),
        ((TablePlan("t0", "table_row_wise", (Shard(0, 0, 5, 0, 8), Shard(1, 5, 5, 0, 8))),), "on one host"),
    ],
)
def test_bad_plans_name_the_table(tables, fragment):
    plan = ShardingPlan(2, 1, tables)
    with pytest.raises(PlanError) as e:
        plan.validate([TableConfig("t0", 10, 8)])
    assert "t0" in str(e.value) and fragment in str(e.value)


def test_plan_file_errors(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"version": 9, "tables": []}')
    with pytest.raises(PlanError, match="unknown plan version 9"):
        ShardingPlan.load(p)
    p.write_text("{nope")
    with pytest.raises(PlanError, match="not valid JSON"):
        ShardingPlan.load(p)
    with pytest.raises(PlanError, match="unknown tables"):
        default_plan(TABLES, Topology(2, 0, 1), "table_wise", {"zz": TableSharding("row_wise")})
    with pytest.raises(PlanError, match="exceed its dim 8"):
        default_plan(TABLES, Topology(2, 0, 1), "table_wise", {"t0": TableSharding("column_wise", 9)})


def test_plan_for_another_world_size_is_a_plan_error():
    import torch

    from recscale.comm.process_group import ProcessGroups
    from recscale.embedding import SGD
    from recscale.sharding.collection import ShardedEmbeddingCollection

    plan = default_plan(TABLES, Topology(2, 0, 2), "table_wise")
    one_rank = ProcessGroups(Topology(1, 0, 1), None, None, None, None, None, torch.device("cpu"), 10.0)
    with pytest.raises(PlanError, match="plan is for 2 ranks but the job has 1"):
        ShardedEmbeddingCollection(TABLES, SGD(lr=0.1), plan, one_rank)
