"""Smoke test of benchmarks/trainer_defaults.py --quick: `recscale train` on its defaults (alone and
beside a busy process) and the e2e.py harness worker run, and the table and JSON come out. No
timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_trainer_defaults_quick_runs_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "defaults.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/trainer_defaults.py", "--quick", "--cases", "criteo-1m",
         "--systems", "harness,train,train-busy", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("case"))
    for col in ("samples/s median (min-max)", "of harness", "vs TorchRec loop", "loaded / unloaded"):
        assert col in header
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"harness", "train", "train-busy"}
    assert all(r["samples_per_s"]["median"] > 0 for r in rows.values())
    assert rows["train"]["share_of_harness"] > 0 and rows["train-busy"]["loaded_over_unloaded"] > 0
    assert rows["harness"]["share_of_harness"] is None
