"""Smoke runs of the checkpoint benchmarks with tiny sizes (figures are not checked, only that
they are produced and consistent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRITEO = ROOT.parent / "shared" / "data" / "criteo" / "criteo_10k_encoded_train.csv"


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


@pytest.mark.skipif(not CRITEO.is_file(), reason="../shared/data/criteo is not present")
def test_checkpoint_accuracy_on_criteo_10k(tmp_path):
    """Lossless: the same final logloss; 8 bits: close (0.12% measured; see benchmarks/README)."""
    out = tmp_path / "acc.json"
    subprocess.run(
        [sys.executable, "benchmarks/checkpoint_accuracy.py", "--codecs", "none,adaptive8", "--json", str(out)],
        check=True, cwd=ROOT, timeout=300, capture_output=True,
    )
    d = {r["codec"]: r for r in json.loads(out.read_text())["results"]}
    assert d["none"]["logloss_rel_diff"] == 0.0
    assert abs(d["adaptive8"]["logloss_rel_diff"]) <= 5e-3, d
