"""Elastic restart (``checkpoint.auto_resume``): a job restarted by torchrun after a rank died
resumes by itself from the newest valid checkpoint and ends equal, bit for bit, to the
uninterrupted run; with no checkpoint it starts fresh; it resumes on another number of ranks.
And the fault-injection hook (``recscale.faults``) that kills the ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import proc_utils
from ckpt_utils import TINY, rank_runs, run_dirs, run_training
from dist_utils import run_ranks
from recscale.faults import Fault, FaultSpecError, parse

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# 16 steps of 256 samples; a checkpoint every 4 steps (differentials after the first).
# Synchronous checkpoint writes: each kill finds the previous checkpoint committed.
ELASTIC = TINY + ["checkpoint.interval_steps=4", "checkpoint.auto_resume=true", "checkpoint.async_write=false",
                  "dist.timeout_s=30", "train.threads=1", "sharding.default=row_wise"]
SUMMARY_KEYS = ("steps", "samples", "eval_auc", "eval_logloss", "train_logloss", "evals")


def sets(items: list[str]) -> list[str]:
    return [x for o in items for x in ("--set", o)]


def torchrun_job(tmp: Path, name: str, fault: str = "", restarts: int = 0) -> tuple[dict, dict, str]:
    """A 2-rank torchrun job through ``benchmarks/_train_digest.py``: (summary, digests, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RECSCALE_FAULT", None)
    if fault:
        env["RECSCALE_FAULT"] = fault
    digests, summary = tmp / f"{name}-digests", tmp / f"{name}.json"
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}", "--monitor-interval=0.2",
                      "benchmarks/_train_digest.py", str(digests), "train", "--summary-json", str(summary)]
    cmd += sets(ELASTIC + [f"checkpoint.dir='{tmp / name}'"])
    out = proc_utils.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    ranks = {p.stem: json.loads(p.read_text()) for p in sorted(digests.glob("rank*.json"))}
    return json.loads(summary.read_text()), ranks, text


def _digest_module():
    spec = importlib.util.spec_from_file_location("_train_digest", ROOT / "benchmarks" / "_train_digest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uninterrupted_worker(rank, world, overrides):
    """The same job without a fault, in a forked process group (quicker than another torchrun)."""
    import torch

    import recscale.train.loop as loop
    from recscale.comm.process_group import Topology, init_process_groups
    from recscale.train.config import load_config

    captured = {}
    build_model, build_opt = loop.build_model, loop.build_dense_optimizer
    loop.build_model = lambda *a, **k: captured.setdefault("model", build_model(*a, **k))
    loop.build_dense_optimizer = lambda *a, **k: captured.setdefault("opt", build_opt(*a, **k))
    groups = init_process_groups(Topology(world, rank, world), 60.0, device=torch.device("cpu"))
    summary = loop._train(load_config(None, overrides), groups, lambda _: None)
    return summary, _digest_module().state_digest(captured["model"], captured["opt"])


def test_a_rank_killed_twice_under_torchrun_restarts_and_ends_bitwise_equal(tmp_path):
    ref_runs = run_ranks(_uninterrupted_worker, 2, ELASTIC + [f"checkpoint.dir='{tmp_path / 'ref'}'"], timeout_s=180)
    ref = ref_runs[0][0]
    ref_digests = {f"rank{r}": {"digest": d} for r, (_, d) in enumerate(ref_runs)}
    # Rank 1 dies after step 6 (last checkpoint: 4) and, on the first restart, after step 11
    # (last checkpoint: 8, or 4 when 8 was still being written); the second restart finishes.
    got, digests, out = torchrun_job(tmp_path, "elastic", "rank=1,at=step,step=6;11,restarts=0;1", restarts=3)
    assert "checkpoint.auto_resume (first attempt): no checkpoint under" in out
    assert "checkpoint.auto_resume (restart 1 of this job): resuming from the newest valid checkpoint" in out
    assert "checkpoint.auto_resume (restart 2 of this job): resuming from the newest valid checkpoint" in out
    assert [d["attempt"] for d in digests.values()] == [2, 2]
    assert {k: d["digest"] for k, d in digests.items()} == {k: d["digest"] for k, d in ref_digests.items()}
    assert digests["rank0"]["digest"] != digests["rank1"]["digest"]  # each rank's own shards
    for k in SUMMARY_KEYS:
        assert got[k] == ref[k], k
    assert got["samples"] == 4096 and got["steps"] == 16  # each sample counted once
    assert got["resumed_from"].endswith(("step0000000008", "step0000000004"))


def test_auto_resume_starts_fresh_then_continues_on_another_world_size(tmp_path):
    ck = [f"checkpoint.dir='{tmp_path}'", "checkpoint.auto_resume=true", "checkpoint.interval_steps=4",
          "sharding.default=row_wise"]
    (first,) = run_ranks(rank_runs, 2, [ck + ["train.max_steps=8", "checkpoint.at_end=false"]], timeout_s=180)[0]
    assert "resumed_from" not in first[0] and first[0]["steps"] == 8  # nothing to resume: a fresh start
    (run,) = run_dirs(tmp_path)
    resumed, _, seq = run_training(ck + ["train.max_steps=12"])  # one process now
    assert resumed["resumed_from"] == str(run / "step0000000008") and resumed["restore_world_size"] == 2
    assert resumed["steps"] == 12 and resumed["samples"] == 12 * 256 and len(seq) == 4


def test_a_restart_resumes_the_configured_checkpoint_until_the_job_writes_its_own(tmp_path, monkeypatch):
    """Branching from an older checkpoint: a restart before the job's first checkpoint goes back
    to the configured one, not to the other branch's newer checkpoints."""
    base = [f"checkpoint.dir='{tmp_path}'", "checkpoint.interval_steps=4", "checkpoint.at_end=false"]
    run_training(base + ["train.max_steps=12"])
    (run_a,) = run_dirs(tmp_path)
    branch = base + ["checkpoint.auto_resume=true", f"checkpoint.resume='{run_a / 'step0000000004'}'"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    s, _, _ = run_training(branch + ["train.max_steps=6"])  # no checkpoint of its own before it stops
    assert s["resumed_from"] == str(run_a / "step0000000004")
    s, _, _ = run_training(branch + ["train.max_steps=9"])
    assert s["resumed_from"] == str(run_a / "step0000000004")
    run_b = run_dirs(tmp_path)[-1]
    assert (run_b / "step0000000008").is_dir()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    s, _, _ = run_training(branch + ["train.max_steps=10"])  # now it has one: the newest wins
    assert s["resumed_from"] == str(run_b / "step0000000008")


def test_auto_resume_needs_a_directory():
    from recscale.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="checkpoint.auto_resume"):
        load_config(None, ["checkpoint.auto_resume=true"])


def test_fault_specs():
    assert parse("rank=1,step=6;11,at=step,restarts=0;1") == Fault(1, (6, 11), "step", (0, 1))
    assert parse("rank=0, step=3, at=loader").step_on(0) == 3 and parse("rank=0,step=3,at=loader").step_on(1) is None
    assert Fault(1, (6, 11), "step", (0, 1)).step_on(1) == 11
    for bad, match in (("rank=1,step=3", "missing at"), ("rank=1,step=3,at=later", "not one of"),
                       ("rank=x,step=3,at=step", "integers"), ("rank=1,step=3;4;5,at=step,restarts=0;1", "one per"),
                       ("rank=1,step=3,at=step,when=now", "cannot read")):
        with pytest.raises(FaultSpecError, match=match):
            parse(bad)
