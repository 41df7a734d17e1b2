"""The native CPU kernel of the adaptive quantizer's range search: building it once, loading
it, falling back.

``csrc/quantize_cpu.cpp`` runs the greedy search of sixteen rows at once, one per vector lane, on
the calling thread with the GIL released, so the checkpoint writer's background thread quantizes
without a second OpenMP team taking cores from training. It is compiled on first use and cached
by ``recscale.native_build``. When it cannot be built, one warning says so and the PyTorch
definition in ``quantize.py`` runs instead (same results, slower).
``RECSCALE_NATIVE_QUANTIZE=0`` turns it off.
"""

from __future__ import annotations

from pathlib import Path

from recscale.native_build import FlagSet, LazyKernel

SOURCE = Path(__file__).resolve().parent / "csrc" / "quantize_cpu.cpp"
ENV_VAR = "RECSCALE_NATIVE_QUANTIZE"
# -ffp-contract=off: every rounding where the source puts it, as in the PyTorch definition.
# -mprefer-vector-width=512: the search's lanes fill one AVX-512 register where the CPU has them.
FLAG_SETS: tuple[FlagSet, ...] = (
    FlagSet(("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-trapping-math")),
    FlagSet(("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math")),
    FlagSet(("-O3", "-ffp-contract=off", "-fno-trapping-math")),
)
# The compiled kernel, or None when switched off or impossible to build here.
quantize_kernels = LazyKernel("recscale_quantize", SOURCE, FLAG_SETS, "the native checkpoint quantizer", ENV_VAR)
