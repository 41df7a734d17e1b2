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

from pathlib import Path

from recscale.native_build import FlagSet, LazyKernel

SOURCE = Path(__file__).resolve().parent / "csrc" / "interaction_cpu.cpp"
FLAG_SETS: tuple[FlagSet, ...] = (
    FlagSet(("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
    FlagSet(("-O3", "-fopenmp"), ("-fopenmp",)),
)
# The compiled kernels, or None when switched off or impossible to build here.
interaction_kernels = LazyKernel("recscale_interaction", SOURCE, FLAG_SETS, "the native dot-interaction kernel",
                                 "RECSCALE_NATIVE_INTERACTION")
