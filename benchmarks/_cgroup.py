"""Run a child process inside a memory cgroup that counts the page cache (Linux, root).

A benchmark that claims "the tier kept to its RAM budget" must run where overstepping it
fails: a memory cgroup charges a process for its anonymous memory and for the page cache it
brings in (file reads and writes), and its OOM killer ends the process past the limit. The
cgroup is made under this process's own one (cgroup v1 memory controller, or v2 where that is
what the host mounts), the child is placed in it before it runs a line of its own, and the
cgroup is removed afterwards: on success, failure and Ctrl-C alike.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """The memory cgroup could not be made; the message says why and what to do."""


@dataclass
class CgroupUsage:
    """What the cgroup saw: its limit, the most it was charged, how often it hit the limit
    (reclaim included: page cache dropped to stay inside counts too) and OOM kills."""

    limit_bytes: int
    max_usage_bytes: int
    failcnt: int
    oom_kills: int


def _own_path(controller: str | None) -> str:
    """This process's cgroup path for ``controller`` (v1) or the unified hierarchy (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path.lstrip("/")
    return ""


def _v2_has_memory() -> bool:
    controllers = V2_ROOT / "cgroup.controllers"
    return controllers.exists() and "memory" in controllers.read_text().split()


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _read_keyed(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except OSError:
        pass
    return 0


class MemoryCgroup:
    """A fresh memory cgroup of ``limit_mb`` MiB (None: no limit yet, ``set_limit`` later).

        with MemoryCgroup("bench", 2560) as cg:
            proc = cg.popen([sys.executable, "child.py"])
            ...
            usage = cg.usage()
    """

    def __init__(self, name: str, limit_mb: int | None) -> None:
        if os.name != "posix" or not Path("/proc/self/cgroup").exists():
            raise CgroupError("--cgroup-mb needs Linux cgroups; run without it")
        if (V1_ROOT / "memory.limit_in_bytes").exists() or (V1_ROOT / "cgroup.procs").exists():
            self.v2 = False
            base = V1_ROOT / _own_path("memory")
        elif _v2_has_memory():
            self.v2 = True
            base = V2_ROOT / _own_path(None)
        else:
            raise CgroupError("--cgroup-mb: no cgroup memory controller is mounted (neither v1 at "
                              f"{V1_ROOT} nor v2 at {V2_ROOT}); run without it")
        self.path = base / f"{name}-{os.getpid()}"
        try:
            self.path.mkdir()
        except PermissionError:
            raise CgroupError(f"--cgroup-mb: cannot create {self.path} (needs root); "
                              "run as root or without it") from None
        except OSError as e:
            raise CgroupError(f"--cgroup-mb: cannot create {self.path}: {e.strerror}; run without it") from None
        self.procs: list[subprocess.Popen] = []
        self.limit_bytes = 0
        try:
            if self.v2 and not (self.path / "memory.max").exists():
                raise CgroupError(f"--cgroup-mb: {base} does not delegate the memory controller to its children "
                                  "(cgroup.subtree_control); run without it")
            if self.v2 and (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")  # past the limit: reclaim or OOM, not swap
            if limit_mb is not None:
                self.set_limit(limit_mb)
        except BaseException:
            self.remove()
            raise

    def set_limit(self, limit_mb: int) -> None:
        """Limit the charge (anonymous memory and page cache) to ``limit_mb`` MiB."""
        self.limit_bytes = limit_mb << 20
        name = "memory.max" if self.v2 else "memory.limit_in_bytes"
        try:
            (self.path / name).write_text(str(self.limit_bytes))
        except OSError as e:
            raise CgroupError(f"--cgroup-mb: cannot set {name} to {limit_mb} MiB: {e.strerror} (is the child "
                              "already using more?); raise --cgroup-mb") from None

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Start ``args`` inside the cgroup: the child joins it before it execs, so every page it
        touches is charged here."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.Popen(args, preexec_fn=join, **kwargs)
        self.procs.append(proc)
        return proc

    def usage(self) -> CgroupUsage:
        if self.v2:
            return CgroupUsage(self.limit_bytes, _read_int(self.path / "memory.peak"),
                               _read_keyed(self.path / "memory.events", "max"),
                               _read_keyed(self.path / "memory.events", "oom_kill"))
        return CgroupUsage(self.limit_bytes, _read_int(self.path / "memory.max_usage_in_bytes"),
                           _read_int(self.path / "memory.failcnt"),
                           _read_keyed(self.path / "memory.oom_control", "oom_kill"))

    def current_bytes(self) -> int:
        return _read_int(self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes"))

    def remove(self) -> None:
        """End the children still running and remove the cgroup (its charges go to the parent)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for _ in range(50):  # a killed child leaves the cgroup a moment after it is reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        raise CgroupError(f"could not remove the cgroup {self.path}; remove it with rmdir")

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
