"""Smoke test of benchmarks/tiers.py: it runs in --quick mode and writes its figures; offline
Belady bounds every policy's hit rate, and ``lookahead`` with a window covering the whole
trace makes Belady's choices. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_tiers_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/tiers.py", "--quick", "--threads", "1", "--window", "30", "--ssd-dir", str(tmp_path),
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lookahead" in proc.stdout and "belady" in proc.stdout and "queue depth 32" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["hit_rate"]) == 8
    for row in data["hit_rate"].values():
        for policy in ("lru", "lfu", "lookahead"):
            assert 0 < row[policy] <= row["belady"] + 1e-9, row
        assert row["lookahead"] == pytest.approx(row["belady"], abs=1e-12), row
    assert {"ram", "tier, prefetch", "tier, no prefetch"} == set(data["throughput"])
    assert data["disk"]["reads_per_s_qd1"] > 0
