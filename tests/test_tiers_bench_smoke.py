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


def _cgroups_writable() -> bool:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _cgroup import CgroupError, MemoryCgroup

    try:
        MemoryCgroup("recscale-probe", 64).remove()
    except (CgroupError, OSError):
        return False
    return True


needs_cgroup = pytest.mark.skipif(not _cgroups_writable(), reason="no writable cgroup memory controller (needs root)")


@needs_cgroup
def test_cgroup_child_inside_the_limit_and_oom_killed_past_it() -> None:
    from _cgroup import MemoryCgroup

    with MemoryCgroup("recscale-test", 256) as cg:
        proc = cg.popen([sys.executable, "-c", "x = bytearray(40 << 20)"])
        assert proc.wait() == 0
        usage = cg.usage()
        path = cg.path
    assert 40 << 20 <= usage.max_usage_bytes <= 256 << 20 and usage.oom_kills == 0
    assert not path.exists()  # removed afterwards
    with MemoryCgroup("recscale-test", 96) as cg:
        proc = cg.popen([sys.executable, "-c", "x = bytearray(400 << 20)"])
        assert proc.wait() != 0
        usage = cg.usage()
        path = cg.path
    assert usage.failcnt > 0 and usage.max_usage_bytes <= 96 << 20
    assert not path.exists()


@needs_cgroup
def test_tiers_benchmark_tier_runs_in_a_cgroup(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/tiers.py", "--quick", "--threads", "1", "--parts", "train", "--cgroup-mb", "auto",
         "--ssd-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished inside the limit" in proc.stdout
    data = json.loads(out.read_text())
    cg = data["cgroup"]
    assert cg["finished_inside"] and cg["oom_kills"] == 0 and 0 < cg["max_usage_mb"] <= cg["limit_mb"]
    assert cg["limit_mb"] >= cg["tier_budget_mb"] + cg["baseline_mb"]
    assert {"ram", "tier, prefetch", "tier, no prefetch"} == set(data["throughput"])
