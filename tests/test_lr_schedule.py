"""The learning-rate schedule: its shape, its config errors, both optimizers following it on
one rank and on two, and exact resume in the middle of a decay."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recscale.train.loop as loop
from ckpt_utils import rank_runs, run_training
from dist_utils import run_ranks
from recscale.embedding import SGD, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch
from recscale.train.config import ConfigError, load_config
from recscale.train.lr_schedule import LRScheduleConfig

# The TINY run of ckpt_utils has 16 steps per epoch.
DECAY = ["lr_schedule.warmup_steps=3", "lr_schedule.decay_start_step=6", "lr_schedule.decay_power=2"]


def test_warmup_then_constant_then_decay_to_the_end():
    s = LRScheduleConfig(warmup_steps=4, decay_start_step=10)
    f = [s.factor(k, 20) for k in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4:11] == [1.0] * 7
    assert f[10:] == pytest.approx([1 - k / 10 for k in range(10)])
    assert f[-1] == pytest.approx(0.1)  # the last step still trains


@given(
    start=st.integers(0, 50), length=st.integers(0, 50), total=st.integers(1, 120),
    power=st.floats(0.25, 4.0), end=st.floats(0.0, 1.0),
)
@settings(max_examples=200, deadline=None)
def test_decay_is_monotone_and_ends_at_end_factor(start, length, total, power, end):
    s = LRScheduleConfig(decay_start_step=start, decay_steps=length, decay_power=power, end_factor=end)
    f = [s.factor(k, total) for k in range(start + max(length, total) + 5)]
    assert all(a >= b - 1e-12 for a, b in zip(f, f[1:]))
    assert f[start] == 1.0
    stop = start + (length or max(1, total - start))
    assert f[stop:] == pytest.approx([end] * len(f[stop:]))
    assert all(end - 1e-12 <= x <= 1.0 for x in f)


@pytest.mark.parametrize(
    "override, key",
    [
        ("lr_schedule.warmup_steps=-1", "lr_schedule.warmup_steps"),
        ("lr_schedule.decay_start_step=-2", "lr_schedule.decay_start_step"),
        ("lr_schedule.decay_power=0", "lr_schedule.decay_power"),
        ("lr_schedule.end_factor=1.5", "lr_schedule.end_factor"),
        ("lr_schedule.decay_step=4", "lr_schedule.decay_step"),  # a typo: 'did you mean'
    ],
)
def test_bad_schedule_is_a_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_decay_inside_the_warmup_is_refused():
    with pytest.raises(ConfigError, match="inside the warmup"):
        load_config(None, ["lr_schedule.warmup_steps=5", "lr_schedule.decay_start_step=2"])


def test_a_rate_that_reaches_zero_before_the_end_is_refused():
    with pytest.raises(ConfigError, match=r"decays to 0 at step 10 but the run has 16 steps; set decay_steps to 12"):
        run_training(["lr_schedule.decay_start_step=4", "lr_schedule.decay_steps=6"])


def test_set_learning_rate_changes_the_fused_update():
    t = TableConfig("t", 20, 4, ("f",))
    batch = JaggedBatch.from_lists({"f": [[0, 3], [3]]})
    moved = []
    for lr in (0.4, 0.1):
        emb = TableBatchedEmbeddingBags([t], SGD(lr=0.4), seed=0, kernel="torch")
        emb.set_learning_rate(lr)
        before = emb.table_weight("t").clone()
        emb(batch).sum().backward()
        moved.append(emb.table_weight("t") - before)
    assert torch.allclose(moved[0], 4 * moved[1])
    assert float(moved[1].abs().sum()) > 0


def _rates(overrides: list[str]) -> list[tuple[float, float]]:
    """(dense lr, embedding lr) at each training step of a TINY run."""
    seen: list[tuple[float, float]] = []
    orig = loop.train_step

    def step(model, batch, sparse, dense_opt, sync):
        seen.append((dense_opt.param_groups[0]["lr"], model.embeddings.optimizer.lr))
        return orig(model, batch, sparse, dense_opt, sync)

    loop.train_step = step
    try:
        run_training(overrides)
    finally:
        loop.train_step = orig
    return seen


def test_both_optimizers_follow_the_schedule():
    cfg = load_config(None, DECAY + ["embedding_optimizer.lr=0.05", "dense_optimizer.lr=0.01"])
    rates = _rates(DECAY + ["embedding_optimizer.lr=0.05", "dense_optimizer.lr=0.01"])
    assert len(rates) == 16
    for k, (dense, emb) in enumerate(rates):
        f = cfg.lr_schedule.factor(k, 16)
        assert dense == pytest.approx(0.01 * f) and emb == pytest.approx(0.05 * f), k
    assert rates[0][1] == pytest.approx(0.05 / 3) and rates[-1][1] == pytest.approx(0.05 / 100)


def test_resume_in_the_middle_of_the_decay_is_bitwise_identical(tmp_path):
    ck = f"checkpoint.dir='{tmp_path}'"
    full, s_full, seq_full = run_training(DECAY)
    plain, s_plain, _ = run_training([])
    assert full["eval_logloss"] != plain["eval_logloss"]  # the schedule changed training
    run_training(DECAY + ["train.max_steps=9", ck, "checkpoint.interval_steps=9"])
    resumed, s_res, seq = run_training(DECAY + [ck, "checkpoint.resume=latest"])
    assert seq == seq_full[9:]
    for k in ("eval_logloss", "train_logloss", "steps"):
        assert resumed[k] == full[k], k
    for k in s_full:
        assert torch.equal(s_res[k], s_full[k]), k


def test_two_ranks_follow_the_schedule_like_one():
    """Sharded and replicated tables (row-wise, data-parallel) get the rates a 1-rank run does."""
    one, s_one, _ = run_training(DECAY)
    runs = [DECAY + [f"sharding.default={kind}"] for kind in ("row_wise", "data_parallel")]
    for two, s_two, _ in run_ranks(rank_runs, 2, runs, timeout_s=180)[0]:
        assert two["steps"] == one["steps"] == 16
        for k in s_one:
            err = float((s_two[k].double() - s_one[k].double()).norm() / s_one[k].double().norm().clamp(min=1e-30))
            assert err <= 1e-6, (k, err)
