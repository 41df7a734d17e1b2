"""Where a profiled training step's time goes (``breakdown``), and each worker's peak memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from recscale.data import Batch

if TYPE_CHECKING:
    from _e2e_systems import System

# --------------------------------------------------------------------------- time breakdown

_COMM = ("comm:", "c10d", "gloo", "all_to_all", "alltoall", "all2all", "allreduce", "all_reduce", "allgather",
         "all_gather", "record_param_comms", "wait_tensor", "_OutputDist", "_OutputSend", "_OutputRecv", "All2All", "ReduceScatter", "Awaitable")
# "FusedPooling": the torch and the native operators, forward and backward (the fused update).
_EMB = ("e2e.embeddings", "FusedPooling", "EmbeddingBag", "SplitLookup", "fbgemm", "embedding", "Embedding")
_MLP = ("e2e.mlp", "Addmm", "Mm", "Relu", "Threshold", "Bmm", "_TrianglePairs", "_NativeInteraction", "Linear", "Index", "Optimizer.step",
        "BinaryCrossEntropy", "binary_cross_entropy", "Mean", "Squeeze", "Cat", "View", "Transpose", "Unsqueeze", "Div", "Permute",
        "Addcmul", "MulBackward", "AddBackward", "ToCopyBackward", "_CrossLayers")  # DCNv2's fused cross layers


def _category(name: str) -> str | None:
    if any(p in name for p in _COMM):
        return "comm"
    if any(p in name for p in _EMB):
        return "embeddings"
    if name.startswith("e2e.data"):
        return "data"
    if any(p in name for p in _MLP):
        return "mlp"
    return None


def breakdown(system: "System", batches: list[Batch], steps: int) -> dict[str, float]:
    """Share of a profiled step's main-thread time in data, embeddings, MLPs, communication and
    other work. Each operator's own (self) time goes to the category of its outermost enclosing
    event that has one, except that communication anywhere wins (collectives inside an
    embedding module count as communication). Forward phases are marked by hooks on the
    system's modules; backward phases are named by autograd's nodes."""
    handles = []

    def mark(modules: list[nn.Module], label: str) -> None:
        for m in modules:
            ctx: list = []
            handles.append(m.register_forward_pre_hook(
                lambda _m, _i, ctx=ctx: ctx.append(torch.profiler.record_function(label).__enter__())))
            handles.append(m.register_forward_hook(lambda _m, _i, _o, ctx=ctx: ctx.pop().__exit__(None, None, None)))

    mark(system.embedding_modules(), "e2e.embeddings")
    mark(system.mlp_modules(), "e2e.mlp")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                with torch.profiler.record_function("e2e.data"):
                    inp = system.prepare(batches[i % len(batches)])
                system.step(inp)
    finally:
        for h in handles:
            h.remove()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    main = next((e.thread for e in events if e.name == "e2e.data"), None)
    totals = {"data": 0.0, "embeddings": 0.0, "mlp": 0.0, "comm": 0.0, "other": 0.0}
    for e in events:
        if e.thread != main:
            continue
        chain = []
        node = e
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        cats = [_category(n) for n in chain]
        if "comm" in cats:
            cat = "comm"
        else:
            outer = [c for c in reversed(cats) if c is not None]
            cat = outer[0] if outer else "other"
        totals[cat] += e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def peak_rss_bytes() -> int:
    """This process's peak resident set since the last ``reset_peak_rss`` (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def release_memory() -> None:
    """Hand the freed heap back to the OS (``malloc_trim``; the harness's allocator settings
    otherwise keep it), so the next model's peak RSS counts only its own memory."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
