"""The native CPU dot-interaction kernel: building it once, loading it, falling back.

``csrc/interaction_cpu.cpp`` forms each sample's pair dot products while its vectors sit in
cache (one batched GEMM of tiny F x F Gram matrices runs far below the machine's matmul speed in
fp32), and its gradient in one pass. It is compiled with ``torch.utils.cpp_extension`` on first
use into ``~/.cache/recscale/kernels`` (``RECSCALE_KERNEL_CACHE`` overrides), in a folder named
by a hash of the source, flags, torch version and CPU, so nothing stale is ever loaded. When it
cannot be built (no compiler), one warning says so and the PyTorch formulation runs instead.
``RECSCALE_NATIVE_INTERACTION=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "interaction_cpu.cpp"
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
)
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _cache_root() -> Path:
    return Path(os.environ.get("RECSCALE_KERNEL_CACHE", Path.home() / ".cache" / "recscale" / "kernels"))


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join([ln for ln in f if ln.startswith(("model name", "flags"))][:2])
    except OSError:
        return platform.processor() or platform.machine()


def _build(flags: tuple[str, ...]) -> ModuleType:
    from torch.utils.cpp_extension import load

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), torch.__version__.encode(), _cpu_signature().encode()):
        h.update(part)
    name = f"recscale_interaction_{h.hexdigest()[:16]}"
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(SOURCE)], extra_cflags=list(flags), extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)


def interaction_kernels() -> ModuleType | None:
    """The compiled kernels, or None when switched off or impossible to build here."""
    global _module, _tried
    if os.environ.get("RECSCALE_NATIVE_INTERACTION", "1") == "0":
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            errors = []
            for flags in FLAG_SETS:
                try:
                    _module = _build(flags)
                    break
                except Exception as e:  # a compiler error, a missing compiler or ninja
                    errors.append(f"{' '.join(flags)}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
            if _module is None:
                warnings.warn(
                    "recscale: the native dot-interaction kernel could not be built, using the PyTorch one "
                    f"(same results, slower): {errors[-1]}", RuntimeWarning, stacklevel=2)
            _tried = True
    return _module
