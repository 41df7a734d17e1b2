"""Building and loading recscale's C++ CPU kernels, once per machine, safely across processes.

Each kernel source is compiled with ``torch.utils.cpp_extension`` on first use and cached under
``~/.cache/recscale/kernels`` (``RECSCALE_KERNEL_CACHE`` overrides), in a folder named by a hash
of the source, the compiler flags, torch's and Python's versions and (for ``-march=native``) the
CPU, so branches, machines and torch versions never load each other's builds.

Several processes (the ranks of one job, the tests) may ask for the same build at once. torch
guards a build folder with a plain ``lock`` file that a killed builder leaves behind, after which
every later load waits for it forever. We therefore hold an OS file lock (``flock``), which the
kernel releases when its holder dies, around the whole build, and remove torch's lock file once
we hold ours: it can only be stale then. The compiler runs in a child process. Waiting for
another builder and compiling share one limit (``RECSCALE_KERNEL_BUILD_TIMEOUT`` seconds, 600
by default, per flag set); past it the build counts as failed and the callers run their pure-PyTorch kernels,
so a job never hangs on a compiler.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

try:  # POSIX only; elsewhere builds are not serialised across processes
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

TIMEOUT_ENV = "RECSCALE_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


class NativeBuildError(RuntimeError):
    """No flag set built the kernel; the message lists why, per flag set."""


@dataclass(frozen=True)
class FlagSet:
    """Compiler and linker flags of one build attempt."""

    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()


def cache_root() -> Path:
    root = os.environ.get("RECSCALE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "recscale" / "kernels"


def cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX-512 BF16 or AMX); where its flags
    cannot be read, yes (no false alarm)."""
    signature = cpu_signature()
    return "flags" not in signature or any(f in signature.split() for f in ("avx512_bf16", "amx_bf16"))


def build_name(prefix: str, source: Path, flags: FlagSet) -> str:
    h = hashlib.sha256()
    # torch's installation path too: the build files it writes name that environment's include
    # and library folders, so two environments sharing one cache would otherwise silently
    # rebuild every time the other one had loaded the kernels.
    for part in (source.read_bytes(), " ".join(flags.cflags).encode(), " ".join(flags.ldflags).encode(),
                 torch.__version__.encode(), sys.version.encode(), os.path.dirname(torch.__file__).encode()):
        h.update(part)
    if "-march=native" in flags.cflags:
        h.update(cpu_signature().encode())
    return f"{prefix}_{h.hexdigest()[:16]}"


def ensure_ninja() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency)
    puts it in the environment's bin folder, which is not on PATH unless the venv is active."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    for d in candidates:
        if os.path.exists(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def build_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"environment variable {TIMEOUT_ENV} is {raw!r}; give a number of seconds") from None


@contextmanager
def build_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive across processes; released by the OS if the holder dies."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has been building in {path.parent} for over {timeout_s:.0f} s "
                        f"(raise {TIMEOUT_ENV} to wait longer)"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile_in_child(name: str, source: Path, flags: FlagSet, build_dir: Path, timeout_s: float) -> None:
    """Compile in a child process, in its own session, so a compile that outlives ``timeout_s``
    is killed with everything it started (ninja, the compiler) and cannot hang the caller."""
    code = (
        "import sys\nfrom torch.utils.cpp_extension import load\n"
        f"load({name!r}, [{str(source)!r}], extra_cflags={list(flags.cflags)!r}, "
        f"extra_ldflags={list(flags.ldflags)!r}, build_directory={str(build_dir)!r}, verbose=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"compiling took over {timeout_s:.0f} s (raise {TIMEOUT_ENV} to wait longer)") from None
    if proc.returncode != 0:
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        raise RuntimeError((errors or lines or [f"exit status {proc.returncode}"])[-1])


def build(prefix: str, source: Path, flag_sets: Sequence[FlagSet], *, what: str) -> ModuleType:
    """The compiled extension of ``source``, from the first flag set that builds."""
    from torch.utils import cpp_extension

    ensure_ninja()
    errors = []
    timeout_s = build_timeout_s()
    for flags in flag_sets:
        name = build_name(prefix, source, flags)
        build_dir = cache_root() / name
        deadline = time.monotonic() + timeout_s
        try:
            with build_lock(cache_root() / f"{name}.lock", timeout_s):
                build_dir.mkdir(parents=True, exist_ok=True)
                (build_dir / "lock").unlink(missing_ok=True)  # torch's own; stale while we hold ours
                if not any(build_dir.glob(f"{name}*.so")):
                    print(f"recscale: compiling {what} ({' '.join(flags.cflags)}), once per machine and environment ...",
                          file=sys.stderr, flush=True)
                    t0 = time.monotonic()
                    _compile_in_child(name, source, flags, build_dir, deadline - time.monotonic())
                    print(f"recscale: compiled {what} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                return cpp_extension.load(
                    name, [str(source)], extra_cflags=list(flags.cflags), extra_ldflags=list(flags.ldflags),
                    build_directory=str(build_dir), verbose=False,
                )
        except Exception as e:  # noqa: BLE001 - any failure means: try the next flags, then fall back
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            errors.append(f"{' '.join(flags.cflags)}: {type(e).__name__}: {last}")
            if isinstance(e, TimeoutError):  # other flags would not be faster: give up at once
                break
    raise NativeBuildError("; ".join(errors))


class LazyKernel:
    """A kernel built on first call and kept: ``None`` when ``env_var`` is "0" or the build fails
    (said once, in a warning; the caller then runs its PyTorch twin, same results, slower)."""

    def __init__(self, prefix: str, source: Path, flag_sets: Sequence[FlagSet], what: str, env_var: str) -> None:
        self.prefix, self.source, self.flag_sets, self.what, self.env_var = prefix, source, flag_sets, what, env_var
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False

    def __call__(self) -> ModuleType | None:
        if os.environ.get(self.env_var, "1") == "0":
            return None
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                try:
                    self._module = build(self.prefix, self.source, self.flag_sets, what=self.what)
                except Exception as e:  # noqa: BLE001 - a compiler error, a missing compiler or ninja
                    warnings.warn(f"recscale: {self.what} could not be built, using the PyTorch one "
                                  f"(same results, slower): {e}", RuntimeWarning, stacklevel=2)
                self._tried = True
        return self._module
