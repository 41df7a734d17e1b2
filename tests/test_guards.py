"""Guards and one-line errors: a diverging run stops naming the step and the last good
checkpoint; bad values and output paths are refused before any training, each with one line
naming the key or argument, exit status 2, no traceback."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import recscale.train.loop as loop
from ckpt_utils import TINY, ckpt_dir, run_dirs, run_training
from recscale.cli import main
from recscale.train.guards import NonFiniteError

CK = ["train.epochs=2", "checkpoint.interval_steps=4"]


def test_a_diverging_run_stops_with_the_step_and_the_last_good_checkpoint(tmp_path, capsys):
    ck = f"checkpoint.dir='{tmp_path}'"
    run_training(CK + [ck, "train.max_steps=4"])
    good = ckpt_dir(tmp_path, 4)
    # A learning rate that makes the next step's loss NaN, on a run resumed from step 4.
    with pytest.raises(NonFiniteError) as e:
        run_training(CK + [ck, "checkpoint.resume=latest", "embedding_optimizer.lr=1e30"])
    assert str(e.value).startswith("step 6: the training loss is nan; stopping the run.")
    assert f"Last good checkpoint: {good}" in str(e.value)
    args = ["train"] + [x for o in TINY + CK + [ck, "dense_optimizer.lr=1e30"] for x in ("--set", o)]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("recscale: error: step 2: the training loss is nan") and "\n" not in err


def test_a_non_finite_weight_stops_before_it_is_checkpointed(tmp_path, monkeypatch):
    orig = loop.train_step
    calls = []

    def poisoned(model, *a, **k):
        out = orig(model, *a, **k)
        calls.append(1)
        if len(calls) == 12:  # after step 12's update: a weight no loss has seen yet
            with torch.no_grad():
                next(p for k_, p in model.named_parameters() if not k_.startswith("embeddings."))[0] = float("inf")
        return out

    monkeypatch.setattr(loop, "train_step", poisoned)
    with pytest.raises(NonFiniteError, match=r"^step 12: dense parameter '.*' is not finite") as e:
        run_training(CK + [f"checkpoint.dir='{tmp_path}'"])
    assert f"Last good checkpoint: {ckpt_dir(tmp_path, 8)}" in str(e.value)
    (run,) = run_dirs(tmp_path)
    assert not (run / "step0000000012").exists()  # the diverged state was not checkpointed


def one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.startswith("recscale: error: ") and "\n" not in err and "Traceback" not in cap.err, err
    assert len(err) < 400, err
    return err


def sets(*items: str) -> list[str]:
    return [x for o in TINY + list(items) for x in ("--set", o)]


@pytest.mark.parametrize("item,expect", [
    ("embedding_optimizer.lr=nan", "'embedding_optimizer.lr'"),
    ("dense_optimizer.lr=inf", "'dense_optimizer.lr'"),
    ("data.pooling_factors=[-1]", "'data.pooling_factors'"),
    ("data.eval_samples=0", "'data.eval_samples'"),
    ("train.batch_size=" + "9" * 5000, "train.batch_size"),
    ("train.batch_size=-" + "9" * 4000, "'train.batch_size'"),
    ("data.zipf_alpha=" + "9" * 400 + ".5", "'data.zipf_alpha'"),
])
def test_bad_config_values_are_one_line_errors(item, expect, capsys):
    assert expect in one_line_error(["train"] + sets(item, "train.max_steps=1"), capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert "'train.device'" in one_line_error(["train"] + sets("train.device=cuda"), capsys)


@pytest.mark.parametrize("cuda", [False, True])
def test_ssd_tier_trains_on_the_cpu_and_refuses_cuda_with_the_fix(cuda):
    from recscale.train.config import ConfigError
    from recscale.train.model_factory import pick_device

    # The tier's cache and files live in host memory: "auto" stays on the CPU with tiers on.
    assert pick_device("auto", tiers=True, cuda_available=cuda).type == "cpu"
    assert pick_device("auto", tiers=False, cuda_available=cuda).type == ("cuda" if cuda else "cpu")
    with pytest.raises(ConfigError, match="'train.device'.*(SSD tier|no CUDA device)"):
        pick_device("cuda", tiers=True, cuda_available=cuda)


@pytest.mark.parametrize("args,expect", [
    (["--replica-error", "-5"], "--replica-error"),
    (["--world-size", "0"], "--world-size"),
    (["--ranks-per-host", "0"], "--ranks-per-host"),
    (["--time-budget", "-1"], "--time-budget"),
])
def test_bad_plan_arguments_are_one_line_errors(args, expect, capsys):
    assert expect in one_line_error(["plan"] + args, capsys)


def test_output_paths_are_checked_before_any_work(tmp_path, capsys, monkeypatch):
    def no_training(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(loop, "_train", no_training)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "--summary-json" in one_line_error(["train", "--summary-json", str(tmp_path)] + sets(), capsys)
    assert "is a file" in one_line_error(["train", "--summary-json", str(a_file / "s.json")] + sets(), capsys)
    assert "'checkpoint.dir'" in one_line_error(["train"] + sets(f"checkpoint.dir='{a_file}'"), capsys)
    assert "--out" in one_line_error(["plan", "--out", str(tmp_path)], capsys)
    assert "--report" in one_line_error(["plan", "--report", str(a_file / "r.html")], capsys)
    assert "--out" in one_line_error(["ckpt", "export", str(tmp_path), "--out", str(tmp_path)], capsys)
    assert "is a directory" in one_line_error(["train", "--config", str(tmp_path)], capsys)


def test_plan_and_topology_are_validated_on_one_process(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\x00\xff not json")
    assert "not valid JSON" in one_line_error(["train", "--plan", str(bad)] + sets(), capsys)
    shard = {"rank": "zero", "row_offset": 0, "num_rows": 1000, "col_offset": 0, "num_cols": 16}
    plan = {"version": 1, "world_size": 1, "ranks_per_host": 1,
            "tables": [{"table": "t_s0", "sharding_type": "table_wise", "shards": [shard]}]}
    bad.write_text(json.dumps(plan))
    assert "'rank' must be an integer" in one_line_error(["train", "--plan", str(bad)] + sets(), capsys)
    assert "sharding.topology" in one_line_error(["train"] + sets(f"sharding.topology='{bad}'"), capsys)


def test_output_json_is_readable_by_everyone(tmp_path):
    from recscale.atomic import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "s.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s.json").stat().st_mode) == 0o644
