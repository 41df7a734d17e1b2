"""Exact resume and resharding: a run stopped at a checkpoint and resumed equals the
uninterrupted run bit for bit (same world size), or within 1e-6 on another world size and plan."""

from __future__ import annotations

import pytest
import torch

from ckpt_utils import ckpt_dir, rank_runs, run_training
from dist_utils import run_ranks
from recscale.sharding.plan import Shard, ShardingPlan, TablePlan

SUMMARY_KEYS = ("eval_auc", "eval_logloss", "train_logloss", "steps", "samples")


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close(a: dict, b: dict, rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30))
        assert err <= rel, (k, err)


@pytest.mark.parametrize("policy", ["intermittent", "incremental"])
def test_one_rank_resume_is_bitwise_identical(tmp_path, policy):
    ck = f"checkpoint.dir='{tmp_path}'"
    full, s_full, seq_full = run_training(["train.epochs=2"])
    # Checkpoints at steps 4, 8, 12 (a baseline and differentials or increments), stop at 14.
    first, _, seq1 = run_training(["train.epochs=2", "train.max_steps=14", ck, "checkpoint.interval_steps=4",
                                   f"checkpoint.policy={policy}", "checkpoint.at_end=false"])
    assert [c["kind"] for c in first["checkpoints"]][0] == "full"
    assert len(first["checkpoints"]) == 3 and first["checkpoints"][-1]["kind"] != "full"
    # Resume from the last one (step 12): steps 13 and 14 are trained again, as after a crash.
    resumed, s_res, seq2 = run_training(["train.epochs=2", ck, "checkpoint.resume=latest", "checkpoint.at_end=false"])
    assert resumed["resumed_from"].endswith("step0000000012")
    assert seq1[:12] + seq2 == seq_full  # the same samples in the same order, none twice
    for k in SUMMARY_KEYS:
        assert resumed[k] == full[k], k
    assert_same(s_res, s_full)


def test_resume_crossing_an_epoch_boundary_and_evals(tmp_path):
    ck = f"checkpoint.dir='{tmp_path}'"
    common = ["train.epochs=2", "train.eval_every_steps=10"]
    full, s_full, _ = run_training(common)
    run_training(common + ["train.max_steps=16", ck, "checkpoint.interval_steps=16"])  # 16 = end of epoch 0
    resumed, s_res, seq = run_training(common + [ck, "checkpoint.resume=latest"])
    assert len(seq) == 16
    assert resumed["evals"] == full["evals"]
    assert_same(s_res, s_full)


def test_two_rank_resume_is_bitwise_identical_and_resumes_on_one_rank(tmp_path):
    ck = [f"checkpoint.dir='{tmp_path}'", "sharding.default=row_wise"]
    runs = [
        ["sharding.default=row_wise"],
        # Checkpoints at 3 (baseline), 6 and 9 (differentials), then stop.
        ck + ["train.max_steps=9", "checkpoint.interval_steps=3", "checkpoint.at_end=false"],
        ck + ["checkpoint.resume=latest", "checkpoint.at_end=false"],
    ]
    results = run_ranks(rank_runs, 2, runs, timeout_s=180)
    for rank_result in results:
        (full, s_full, seq_full), (part, _, seq1), (resumed, s_res, seq2) = rank_result
        assert seq1 + seq2 == seq_full  # each rank's share of every batch, in order, none twice
        for k in SUMMARY_KEYS:
            assert resumed[k] == full[k], k
        assert_same(s_res, s_full)
        # Bytes per step of the steps each process trained: 9 + 7 of them make the 16 of the whole
        # run. (Input ids and lengths are counted when a batch is distributed, one step ahead: the
        # run stopped at 9 also distributed the 10th batch, so they are left out.)
        n, sent = full["steps"], full["comm_bytes_per_step"]
        assert part["steps"] == 9 and n == 16 and sent["dense_allreduce"] > 0 and sent["output_a2a"] > 0
        assert resumed["comm_bytes_per_step"]["dense_allreduce"] == sent["dense_allreduce"]  # the same every step
        for name in ("output_a2a", "grad_a2a", "dense_allreduce"):
            both = 9 * part["comm_bytes_per_step"][name] + (n - 9) * resumed["comm_bytes_per_step"][name]
            assert both == pytest.approx(n * sent[name], rel=1e-12), name
    (full2, s_full2, _), (_, s_part, _), _ = results[0]
    # On one rank: restored exactly (zero more steps: the 2-rank state at step 9, bit for bit) ...
    one = [f"checkpoint.resume='{ckpt_dir(tmp_path, 9)}'"]
    _, s_now, seq0 = run_training(one + ["train.max_steps=9"])
    assert seq0 == []
    assert_same(s_now, s_part)
    # ... and continuing equal to the 2-rank run within 1e-6.
    resumed, s_res, _ = run_training(one)
    assert resumed["restore_world_size"] == 2 and resumed["steps"] == full2["steps"]
    assert_close(s_res, s_full2)
    assert abs(resumed["eval_logloss"] - full2["eval_logloss"]) <= 1e-6 * full2["eval_logloss"]
    assert abs(resumed["train_logloss"] - full2["train_logloss"]) <= 1e-6 * full2["train_logloss"]


def test_one_rank_checkpoint_resumes_on_two_ranks_with_another_plan(tmp_path):
    full1, s_full1, _ = run_training([])
    run_training([f"checkpoint.dir='{tmp_path / 'ck'}'", "train.max_steps=8", "checkpoint.interval_steps=8"])
    # A different layout: column shards, uneven row shards (rank 1 first), a whole table.
    layout = ShardingPlan(2, 2, (
        TablePlan("t_s0", "column_wise", (Shard(0, 0, 1000, 0, 10), Shard(1, 0, 1000, 10, 6))),
        TablePlan("t_s1", "row_wise", (Shard(1, 0, 3100, 0, 16), Shard(0, 3100, 1900, 0, 16))),
        TablePlan("t_s2", "table_wise", (Shard(1, 0, 300, 0, 16),)),
    ))
    layout.save(tmp_path / "plan.json")
    plan = [f"sharding.plan='{tmp_path / 'plan.json'}'"]
    res = run_ranks(rank_runs, 2, [plan + [f"checkpoint.resume='{tmp_path / 'ck'}'"]], timeout_s=180)
    resumed, s_res, _ = res[0][0]
    assert resumed["restore_world_size"] == 1 and resumed["steps"] == full1["steps"]
    assert_close(s_res, s_full1)
    assert abs(resumed["eval_logloss"] - full1["eval_logloss"]) <= 1e-6 * full1["eval_logloss"]
