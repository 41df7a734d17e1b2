"""Smoke run of the checkpoint benchmark with tiny sizes: the figures are produced and consistent
(a full fp32 checkpoint of every row is the 1x reference; full checkpoints that leave out rows
never updated write less and still restore exactly, as lossless differentials do; 2-bit ones
do not restore exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    full = by["full/none/state-fp32"]
    assert full["restored_rel_l2_error"] == 0.0
    assert all(b < full["full_fp32_reference_bytes"] for b in full["bytes_written"])
    assert full["write_reduction"] > 1.0
    assert by["intermittent/none/state-fp32"]["restored_rel_l2_error"] == 0.0
    q = by["incremental/uniform2/state-fp16"]
    assert q["kinds"] == ["full", "incremental", "incremental"]
    assert q["write_reduction"] > 5 and 0 < q["restored_rel_l2_error"] < 1
