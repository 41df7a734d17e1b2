"""The native CPU embedding kernels: building, loading and choosing them.

``csrc/embedding_cpu.cpp`` (C++, SIMD over the embedding dim, threads from torch's own OpenMP
pool) is compiled on first use and cached by ``recscale.native_build`` (once per machine, source, flags,
torch version and torch installation; safe when several ranks ask at once). ``-march=native`` is tried first and
dropped if the compiler rejects it. When nothing builds (no C++ compiler, say), one warning says why and the
pure-PyTorch kernels run instead: same results, slower.

Which kernel runs is chosen by ``model.embedding_kernel`` (``auto``, ``native``, ``torch``) or,
overriding it, the environment variable ``RECSCALE_EMBEDDING_KERNEL``.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Literal, cast

import torch

from recscale import native_build
from recscale.embedding.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad, SparseOptimizer
from recscale.native_build import FlagSet

KernelChoice = Literal["auto", "native", "torch"]
KERNEL_CHOICES: tuple[str, ...] = ("auto", "native", "torch")
ENV_VAR = "RECSCALE_EMBEDDING_KERNEL"

SOURCE = Path(__file__).resolve().parent / "csrc" / "embedding_cpu.cpp"
# (compiler flags, linker flags), tried in order; the first set that builds wins. ATen's
# parallel_for is an inline OpenMP region, so the kernels need -fopenmp to run on several
# threads; the libgomp.so.1 they link is the one torch has already loaded (same soname), so
# there is one thread pool, sized by torch.set_num_threads. The last set (no OpenMP runtime)
# runs on one thread. -ffp-contract=off keeps every rounding where the source puts it (FMAs are
# explicit), so results match the torch kernels op for op.
FLAG_SETS: tuple[FlagSet, ...] = (
    FlagSet(("-O3", "-march=native", "-ffp-contract=off", "-fopenmp"), ("-fopenmp",)),
    FlagSet(("-O3", "-ffp-contract=off", "-fopenmp"), ("-fopenmp",)),
    FlagSet(("-O3", "-ffp-contract=off", "-fopenmp-simd")),
)

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
_failure: str | None = None


class NativeKernelUnavailable(RuntimeError):
    """``embedding_kernel = "native"`` was asked for but the kernels cannot be built here."""


def resolve_choice(configured: str) -> KernelChoice:
    """The kernel choice in force: the environment variable wins over the configured value."""
    env = os.environ.get(ENV_VAR, "").strip().lower()
    choice = env or configured
    if choice not in KERNEL_CHOICES:
        where = f"environment variable {ENV_VAR}" if env else "model.embedding_kernel"
        raise ValueError(f"{where} is {choice!r}; choose one of {list(KERNEL_CHOICES)}")
    return cast(KernelChoice, choice)


def _build() -> ModuleType:
    return native_build.build("recscale_embedding", SOURCE, FLAG_SETS, what="the native embedding kernels")


def load() -> ModuleType | None:
    """The compiled kernels, building them on first use; None (after one warning) if they cannot
    be built on this machine."""
    global _module, _tried, _failure
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = _build()
            except Exception as e:  # noqa: BLE001
                _failure = str(e)
                warnings.warn(
                    f"recscale: native embedding kernels unavailable ({_failure}); using the slower torch kernels",
                    RuntimeWarning,
                    stacklevel=2,
                )
            _tried = True
    return _module


def stable_argsort(keys: torch.Tensor) -> torch.Tensor:
    """``torch.argsort(keys, stable=True)`` for non-negative int64 ids, by the native parallel
    radix sort when the kernels are already loaded and ``keys`` is a CPU tensor (torch sorts small
    inputs by comparison and large ones by a slower radix sort). Same result either way: a stable
    order is unique."""
    mod = _module
    if mod is not None and keys.device.type == "cpu" and keys.dtype == torch.int64 and keys.numel() > 0:
        return mod.stable_argsort(keys.contiguous().view(-1))
    return torch.argsort(keys, stable=True)


def failure() -> str | None:
    """Why the native kernels could not be built (None if they were, or were never tried)."""
    return _failure


def require() -> ModuleType:
    """The compiled kernels, or a clear error saying why they are unavailable and what to do."""
    mod = load()
    if mod is None:
        raise NativeKernelUnavailable(
            f"model.embedding_kernel = 'native' but the native kernels cannot be built here ({_failure}); "
            "install a C++ compiler (g++ or clang++) and the 'ninja' package, or use 'auto' or 'torch'"
        )
    return mod


# Kernel ids of the optimizers the native backward applies itself (see update_row in the C++).
_NATIVE_KINDS = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2, "adam": 3}


def optimizer_args(opt: SparseOptimizer, step: int) -> tuple[int, list[float]] | None:
    """(kernel id, hyperparameters) for the native update that mirrors ``opt``'s definition in
    optimizers.py, or None when ``opt`` is not one of those exact classes (a subclass may change
    the math, so it runs in Python on natively summed gradients). ``step`` counts from 1."""
    if type(opt) is SGD:
        return _NATIVE_KINDS["sgd"], [-opt.lr]
    if type(opt) is RowWiseAdagrad:
        return _NATIVE_KINDS["rowwise_adagrad"], [-opt.lr, opt.eps]
    if type(opt) is Adagrad:
        return _NATIVE_KINDS["adagrad"], [-opt.lr, opt.eps]
    if type(opt) is Adam:
        bc1 = 1 - opt.beta1**step
        bc2 = 1 - opt.beta2**step
        return _NATIVE_KINDS["adam"], [opt.beta1, 1 - opt.beta1, opt.beta2, 1 - opt.beta2, bc2, -opt.lr / bc1, opt.eps]
    return None
