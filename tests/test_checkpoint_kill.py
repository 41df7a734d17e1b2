"""Killing a training process while it writes a checkpoint (SIGKILL, a real subprocess) leaves no
half checkpoint visible and the previous checkpoint restorable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
