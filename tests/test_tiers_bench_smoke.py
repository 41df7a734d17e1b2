"""Smoke test of benchmarks/tiers.py: it runs in --quick mode and writes its figures; offline
Belady bounds every policy's hit rate, and ``lookahead`` with a window covering the whole
trace makes Belady's choices. No timing assertions."""

from __future__ import annotations

import json
import signal
import subprocess
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


def test_tiers_benchmark_progress_and_bounded_length(tmp_path: Path) -> None:
    """Progress lines while a run trains; ``--duration-s`` ends the first tier run's timing early
    and the second times the same batches; the figures say how many steps were timed after how
    many untimed ones, and the JSON holds them."""
    out = tmp_path / "tiers.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/tiers.py", "--quick", "--threads", "1", "--parts", "train", "--steps", "400",
         "--warmup", "4", "--duration-s", "0.5", "--progress-s", "0", "--ssd-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "progress: tier, prefetch: step 1/400 (warm-up)" in proc.stdout
    assert "timed steps (warm-up)" in proc.stdout
    data = json.loads(out.read_text())
    first, second = data["throughput"]["tier, prefetch"], data["throughput"]["tier, no prefetch"]
    assert first["warmup_steps"] == second["warmup_steps"] == 4
    assert first["measured_steps"] >= 1 and second["measured_steps"] == first["measured_steps"]
    assert 0 < first["hit_rate"] <= 1 and first["peak_rss_mb"] > 0
    assert data["progress"]["tier, no prefetch"]["step"] >= 1


def test_tiers_benchmark_stopped_early_keeps_finished_parts(tmp_path: Path) -> None:
    """A run stopped (SIGTERM) after its first tier run has already written that run's figures."""
    out = tmp_path / "tiers.json"
    # Far more steps than 0.3 s trains (a step takes milliseconds), so the duration ends each run;
    # the trace is built and scanned whole before the first run, so it is kept short of that.
    args = [sys.executable, "benchmarks/tiers.py", "--quick", "--threads", "1", "--parts", "train", "--steps", "3000",
            "--warmup", "2", "--duration-s", "0.3", "--ssd-dir", str(tmp_path), "--json", str(out)]
    with subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            seen = []
            for line in proc.stdout:  # the second run trains 0.3 s of steps too: stop it there
                seen.append(line)
                if line.startswith("done: tier, prefetch"):
                    proc.send_signal(signal.SIGTERM)
                    break
            proc.wait(timeout=120)
        finally:
            proc_utils.kill_group(proc.pid)
    assert any(line.startswith("done: tier, prefetch") for line in seen), "".join(seen)
    data = json.loads(out.read_text())
    assert {"ram", "tier, prefetch"} <= set(data["throughput"])
    assert data["throughput"]["tier, prefetch"]["measured_steps"] >= 1
