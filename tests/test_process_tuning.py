"""Sizing of training threads and loader workers from faked affinity masks and cgroup files,
and the OpenMP wait policy the CLI sets before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recscale.host_cpus import cgroup_cpu_quota, usable_cpus
from recscale.train.process_tuning import prefer_passive_openmp, size_threads, tuning_requested


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    _write(tmp_path / "cpu.max", "max 100000\n")
    _write(tmp_path / "job" / "cpu.max", "300000 100000\n")
    _write(tmp_path / "job" / "step" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota("0::/job/step\n", tmp_path) == 3.0
    _write(tmp_path / "job" / "step" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota("0::/job/step\n", tmp_path) == 1.5
    assert cgroup_cpu_quota("0::/elsewhere\n", tmp_path / "none") is None


def test_cgroup_v2_container_sees_its_cgroup_as_the_root(tmp_path: Path) -> None:
    # The listed path does not exist inside the container; the mount's root holds the limit.
    _write(tmp_path / "cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota("0::/kubepods/pod1/abc\n", tmp_path) == 2.0


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    d = tmp_path / "cpu,cpuacct" / "docker" / "x"
    _write(d / "cpu.cfs_quota_us", "50000\n")
    _write(d / "cpu.cfs_period_us", "100000\n")
    text = "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n"
    assert cgroup_cpu_quota(text, tmp_path) == 0.5
    _write(d / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(text, tmp_path) is None


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota() -> None:
    assert usable_cpus({0, 1, 2, 3}, None, read_cgroup=False).cpus == 4
    assert usable_cpus({0, 1, 2, 3}, 2.5, read_cgroup=False).cpus == 2  # rounded down
    assert usable_cpus({0, 1, 2, 3}, 0.5, read_cgroup=False).cpus == 1  # at least one
    capped = usable_cpus(set(range(64)), 8.0, read_cgroup=False)
    assert capped.cpus == 8 and "quota" in capped.reason
    assert usable_cpus({5}, 16.0, read_cgroup=False).cpus == 1


@pytest.mark.parametrize(
    "cpus,ranks,threads,workers,want",
    [
        (2, 1, 0, "auto", (2, 0)),  # small machines load in-process and train on every CPU
        (1, 1, 0, "auto", (1, 0)),
        (3, 1, 0, "auto", (2, 1)),
        (16, 1, 0, "auto", (15, 1)),
        (16, 4, 0, "auto", (3, 1)),  # ranks of one host split the CPUs
        (4, 2, 0, "auto", (2, 0)),
        (2, 4, 0, "auto", (1, 0)),  # more ranks than CPUs: one thread each
        (8, 1, 3, "auto", (3, 1)),  # what the user set is kept
        (8, 1, 0, 2, (6, 2)),
        (2, 1, 0, 1, (1, 1)),
    ],
)
def test_size_threads_never_oversubscribes_on_its_own(cpus, ranks, threads, workers, want) -> None:
    plan = size_threads(cpus, ranks, threads, workers)
    assert (plan.threads, plan.workers) == want
    assert "oversubscribed" not in plan.reason


def test_size_threads_names_an_oversubscription_the_user_asked_for() -> None:
    plan = size_threads(2, 1, 2, 1)
    assert (plan.threads, plan.workers) == (2, 1) and "oversubscribed" in plan.reason
    with pytest.raises(ValueError):
        size_threads(0, 1, 0, "auto")


def test_tuning_requested_reads_file_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\ntune_process = false\n")
    assert tuning_requested(None, []) is True
    assert tuning_requested(str(cfg), []) is False
    assert tuning_requested(str(cfg), ["train.tune_process=true"]) is True
    assert tuning_requested(None, ["train.tune_process = false"]) is False


def test_passive_openmp_only_before_torch_and_never_over_the_user() -> None:
    env: dict[str, str] = {}
    assert prefer_passive_openmp(env, loaded=set()) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    user = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert not prefer_passive_openmp(user, loaded=set()) and user["OMP_WAIT_POLICY"] == "ACTIVE"
    late: dict[str, str] = {}
    assert not prefer_passive_openmp(late, loaded={"torch"}) and not late


def test_cli_sets_the_wait_policy_before_torch_loads() -> None:
    code = (
        "import os; from recscale.cli import main; main(['train', '--config', 'missing.toml']); "
        "print(os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "PASSIVE", out.stderr
    off = subprocess.run([sys.executable, "-c", code.replace("'missing.toml'", "'missing.toml', '--set', 'train.tune_process=false'")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert off.stdout.strip().splitlines()[-1] == "None", off.stderr


def test_one_log_line_says_what_was_decided() -> None:
    from recscale.train.process_tuning import CpuBudget, ProcessTuning, ThreadPlan

    on = ProcessTuning(True, CpuBudget(3, "cgroup quota 3.5 CPUs"), ThreadPlan(2, 1, "3 CPUs per rank"), True)
    line = on.describe()
    assert "\n" not in line and "3 usable CPUs (cgroup quota 3.5 CPUs)" in line
    assert "2 training threads + 1 loader worker (" in line and "allocator unchanged" in line
    off = ProcessTuning(False, CpuBudget(2, ""), ThreadPlan(1, 0, "as configured"), True).describe()
    assert off.startswith("process tuning off (train.tune_process = false): 1 torch thread, 0 loader workers")
