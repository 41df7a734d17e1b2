"""Killing a training process while it writes a checkpoint (SIGKILL, a real subprocess) leaves no
half checkpoint visible and the previous checkpoint restorable."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from recscale.checkpoint.manifest import MANIFEST
from recscale.checkpoint.tools import verify

import proc_utils

ROOT = Path(__file__).resolve().parents[1]
BIG = [  # large enough that writing a checkpoint takes a while
    "data.source=synthetic", "data.num_samples=200000", "data.eval_samples=1024", "data.num_workers=0",
    "model.table_rows=[1500000, 1500000, 300]", "train.batch_size=256", "train.progress=false",
    "checkpoint.policy=full", "checkpoint.interval_steps=2", "checkpoint.keep_last=0",
]


def sets(items: list[str]) -> list[str]:
    return [x for o in items for x in ("--set", o)]


def test_kill_during_checkpoint_write_leaves_previous_restorable(tmp_path):
    ck = tmp_path / "ck"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "recscale", "train"] + sets(BIG + [f"checkpoint.dir='{ck}'"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_while = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            runs = list(ck.glob("run-*")) if ck.is_dir() else []
            entries = os.listdir(runs[0]) if len(runs) == 1 else []
            committed = [e for e in entries if e.startswith("step")]
            writing = [e for e in entries if e.startswith(".tmp-")]
            if committed and writing:
                os.kill(proc.pid, signal.SIGKILL)
                killed_while = writing[0]
                break
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert killed_while is not None, "the training process never got to a second checkpoint"
    (run,) = ck.glob("run-*")
    entries = os.listdir(run)
    visible = sorted(e for e in entries if not e.startswith(".") and e != "run.json")
    assert visible and all(e.startswith("step") for e in visible)
    # The half-written one is not visible under its name; everything visible is whole.
    assert killed_while.removeprefix(".tmp-") not in visible
    for name in visible:
        assert (run / name / MANIFEST).is_file()
        verify(str(run / name))
    latest = visible[-1]
    step = int(latest.removeprefix("step"))
    out = proc_utils.run(
        [sys.executable, "-m", "recscale", "train", "--resume", "latest"]
        + sets(BIG + [f"checkpoint.dir='{ck}'", f"train.max_steps={step + 1}", "checkpoint.at_end=false"]),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert f"resumed from {run / latest}" in out.stdout
    assert not list(ck.glob("run-*/.tmp-*"))  # leftovers cleaned on start


TIERED = [  # tables on the SSD tier behind caches far smaller than them, checkpoints every 10 steps
    "data.source=synthetic", "data.num_samples=1600", "data.eval_samples=128", "data.num_workers=0",
    "data.pooling_factors=[1, 3, 2]", "model.table_rows=[300, 900, 60]", "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]", "train.batch_size=16", "train.progress=false", "train.threads=1",
    "embedding_optimizer.name=rowwise_adagrad", "tiers.policy=lookahead", "tiers.lookahead_batches=2",
    "tiers.io_threads=2", 'tiers.tables={ t_s0 = { placement = "ssd", cache_rows = 24 }, '
    't_s1 = { placement = "ssd", cache_rows = 64 } }',
    "checkpoint.policy=incremental", "checkpoint.interval_steps=10", "checkpoint.keep_last=0",
]


def test_kill_of_a_run_on_the_ssd_tier_then_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    """SIGKILL at an arbitrary step (the tier files are left half written, not clean), then
    --resume: the resumed run rebuilds the tier files from the checkpoint and ends bitwise where
    the uninterrupted run ends."""
    from recscale.checkpoint.lineage import resolve
    from recscale.checkpoint.restore import load_manifest
    from recscale.checkpoint.tools import assemble
    from recscale.train.config import load_config
    from recscale.train.loop import train

    for d in ("ssd_a", "ssd_b"):
        (tmp_path / d).mkdir()
    opts_a = TIERED + [f"tiers.ssd_dir={tmp_path / 'ssd_a'}", f"checkpoint.dir={tmp_path / 'a'}"]
    whole = train(load_config(None, opts_a), log=lambda _: None)
    ck, opts = tmp_path / "b", TIERED + [f"tiers.ssd_dir={tmp_path / 'ssd_b'}", f"checkpoint.dir={tmp_path / 'b'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "recscale", "train"] + sets(opts), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    killed_after = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            done = sorted(e for r in ck.glob("run-*") for e in os.listdir(r) if e.startswith("step"))
            if len(done) >= 2:  # mid-run: between or during checkpoints, whatever the step is doing
                time.sleep(random.uniform(0, 0.3))
                os.kill(proc.pid, signal.SIGKILL)
                killed_after = done[-1]
                break
            time.sleep(0.005)
    finally:
        proc_utils.kill_group(proc.pid)
        proc.wait(timeout=30)
    assert killed_after is not None and proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    header = (tmp_path / "ssd_b" / "t_s1.0.tier").read_bytes()[:4096]
    assert b'"clean": false' in header  # the crash left the tier file unusable, as documented
    out = proc_utils.run([sys.executable, "-m", "recscale", "train", "--resume", "latest",
                          "--summary-json", str(tmp_path / "summary.json")] + sets(opts),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "tiers: rebuilding the tier files" in out.stdout and "t_s1.0.tier (not closed cleanly)" in out.stdout
    assert "resumed from" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    for k in ("eval_auc", "eval_logloss", "train_logloss", "steps", "samples"):
        assert summary[k] == whole[k], k
    states = []
    for root in (tmp_path / "a", ck):
        storage, name = resolve(str(root))
        states.append(assemble(storage, load_manifest(storage, name)))
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
