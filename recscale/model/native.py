"""The native CPU dot-interaction kernel: building it once, loading it, falling back.

``csrc/interaction_cpu.cpp`` forms each sample's pair dot products while its vectors sit in
cache (one batched GEMM of tiny F x F Gram matrices runs far below the machine's matmul speed in
fp32), and its gradient in one pass; it reads the dense row and the pooled embeddings in place
and writes the output (dense row, then pairs) and each input gradient once. It is compiled on first use and cached by
``recscale.native_build`` (once per machine, source, flags, torch version and torch
installation). When it
cannot be built (no compiler), one warning says so and the PyTorch formulation runs instead.
``RECSCALE_NATIVE_INTERACTION=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

from recscale import native_build
from recscale.native_build import FlagSet

SOURCE = Path(__file__).resolve().parent / "csrc" / "interaction_cpu.cpp"
FLAG_SETS: tuple[FlagSet, ...] = (
    FlagSet(("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
    FlagSet(("-O3", "-fopenmp"), ("-fopenmp",)),
)
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def interaction_kernels() -> ModuleType | None:
    """The compiled kernels, or None when switched off or impossible to build here."""
    global _module, _tried
    if os.environ.get("RECSCALE_NATIVE_INTERACTION", "1") == "0":
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = native_build.build("recscale_interaction", SOURCE, FLAG_SETS,
                                             what="the native dot-interaction kernel")
            except Exception as e:  # noqa: BLE001 - a compiler error, a missing compiler or ninja
                warnings.warn(
                    "recscale: the native dot-interaction kernel could not be built, using the PyTorch one "
                    f"(same results, slower): {e}", RuntimeWarning, stacklevel=2)
            _tried = True
    return _module
