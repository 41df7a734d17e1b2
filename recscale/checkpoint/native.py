"""The native CPU kernel of the adaptive quantizer's range search: building it once, loading
it, falling back.

``csrc/quantize_cpu.cpp`` runs each row's greedy search while the row sits in cache, on the
calling thread with the GIL released, so the checkpoint writer's background thread quantizes
without a second OpenMP team taking cores from training. It is compiled on first use and cached
by ``recscale.native_build``. When it cannot be built, one warning says so and the PyTorch
definition in ``quantize.py`` runs instead (same results, slower).
``RECSCALE_NATIVE_QUANTIZE=0`` turns it off.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType

from recscale import native_build
from recscale.native_build import FlagSet

SOURCE = Path(__file__).resolve().parent / "csrc" / "quantize_cpu.cpp"
ENV_VAR = "RECSCALE_NATIVE_QUANTIZE"
# -ffp-contract=off: every rounding where the source puts it, as in the PyTorch definition.
FLAG_SETS: tuple[FlagSet, ...] = (
    FlagSet(("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math")),
    FlagSet(("-O3", "-ffp-contract=off", "-fno-trapping-math")),
)
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def quantize_kernels() -> ModuleType | None:
    """The compiled kernel, or None when switched off or impossible to build here."""
    global _module, _tried
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = native_build.build("recscale_quantize", SOURCE, FLAG_SETS,
                                             what="the native checkpoint quantizer")
            except Exception as e:  # noqa: BLE001 - a compiler error, a missing compiler or ninja
                warnings.warn(
                    "recscale: the native checkpoint quantizer could not be built, using the PyTorch one "
                    f"(same results, slower): {e}", RuntimeWarning, stacklevel=2)
            _tried = True
    return _module
