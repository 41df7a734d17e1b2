"""The CPUs this process may really use: its affinity mask (``os.sched_getaffinity``: taskset, a
container's cpuset) capped by a cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``: a
container limited to 2 CPUs on a 64-core host gets 2). One place for training's thread sizing,
the planner's calibration and the checkpoint's copy threads."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    """CPUs this process may use, and what limits them (for the log)."""

    cpus: int
    reason: str


def cgroup_cpu_quota(proc_cgroup: str, cgroup_root: Path) -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its ancestors, or None
    when there is none. ``proc_cgroup``: the text of ``/proc/self/cgroup``."""
    quotas: list[float] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2, unified hierarchy: cpu.max = "QUOTA PERIOD" or "max PERIOD"
            for d in _ancestors(cgroup_root, path):
                fields = _read(d / "cpu.max").split()
                if len(fields) == 2 and fields[0] != "max":
                    quotas.append(_ratio(fields[0], fields[1]))
        elif "cpu" in controllers.split(","):  # cgroup v1: cfs quota -1 means none
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for d in _ancestors(cgroup_root / mount, path):
                    quota, period = _read(d / "cpu.cfs_quota_us").strip(), _read(d / "cpu.cfs_period_us").strip()
                    if quota and period and not quota.startswith("-"):
                        quotas.append(_ratio(quota, period))
    quotas = [q for q in quotas if q > 0]
    return min(quotas) if quotas else None


def _ancestors(root: Path, path: str) -> list[Path]:
    """The cgroup's directory and each parent up to the mount (a container often sees its own
    cgroup as the mount's root, where the listed path does not exist)."""
    parts = [p for p in path.strip().split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _ratio(quota: str, period: str) -> float:
    try:
        return int(quota) / int(period) if int(period) > 0 else 0.0
    except ValueError:
        return 0.0


def usable_cpus(affinity: set[int] | None = None, quota: float | None = None, *, read_cgroup: bool = True) -> CpuBudget:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded down,
    at least 1: threads beyond a quota are throttled in bursts, not slowed evenly)."""
    if affinity is None:
        affinity = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if quota is None and read_cgroup:
        quota = cgroup_cpu_quota(_read(Path("/proc/self/cgroup")), Path("/sys/fs/cgroup"))
    cpus, reason = max(1, len(affinity)), f"{len(affinity)} in the affinity mask"
    if quota is not None and max(1, math.floor(quota + 1e-6)) < cpus:
        cpus, reason = max(1, math.floor(quota + 1e-6)), f"cgroup quota {quota:g} CPUs ({len(affinity)} in the affinity mask)"
    return CpuBudget(cpus, reason)
