"""Smoke run of the checkpoint benchmark with tiny sizes: the figures are produced and consistent
(a full fp32 checkpoint is the 1x reference, lossless restores are exact, 2-bit ones are not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_benchmark_smoke(tmp_path):
    out = tmp_path / "ckpt.json"
    subprocess.run(
        [sys.executable, "benchmarks/checkpoint.py", "--quick", "--tables", "2", "--rows", "3000", "--dim", "16",
         "--batch", "256", "--intervals", "3", "--json", str(out),
         "--settings", "full/none/state-fp32,intermittent/none/state-fp32,incremental/uniform2/state-fp16"],
        check=True, cwd=ROOT, timeout=120, capture_output=True,
    )
    d = json.loads(out.read_text())
    by = {r["setting"]: r for r in d["results"]}
    assert by["full/none/state-fp32"]["write_reduction"] == pytest.approx(1.0, rel=0.01)
    assert by["intermittent/none/state-fp32"]["restored_rel_l2_error"] == 0.0
    q = by["incremental/uniform2/state-fp16"]
    assert q["kinds"] == ["full", "incremental", "incremental"]
    assert q["write_reduction"] > 5 and 0 < q["restored_rel_l2_error"] < 1
