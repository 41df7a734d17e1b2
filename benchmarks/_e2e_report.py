"""What ``e2e.py`` measures about the machine (its roofline) and how it reports the race: the
ratios to the best TorchRec row and to plain PyTorch, and the printed table."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from _common import format_table
from _e2e_spec import ModelSpec
from _e2e_systems import BF16_SYSTEMS, TORCHREC_SYSTEMS

CATEGORIES = ("data", "embeddings", "mlp", "comm", "other")


# --------------------------------------------------------------------------- machine limits


def measure_machine(threads: int, quick: bool) -> dict[str, float]:
    """Streaming memory bandwidth (copy: bytes read + written) and square-matmul FLOP/s."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (16 if quick else 64) << 20  # floats
        a, b = torch.ones(n), torch.empty(n)
        b.copy_(a)
        best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
        out = {"mem_bw_gbs": 2 * n * 4 / best / 1e9}
        m = 1024 if quick else 2048
        out["fp32_gflops"] = _matmul_gflops(m, torch.float32, 5)
        # bf16 gets a small probe first: without bf16 instructions it runs at about 1 GFLOP/s,
        # and the full-size matmul would take minutes to say so.
        out["bf16_gflops"] = _matmul_gflops(256, torch.bfloat16, 5)  # best of 5: one timing can be a stall
        if out["bf16_gflops"] >= out["fp32_gflops"] / 10:
            out["bf16_gflops"] = _matmul_gflops(m, torch.bfloat16, 5)
        return out
    finally:
        torch.set_num_threads(old)


def _matmul_gflops(m: int, dtype: torch.dtype, repeats: int) -> float:
    x, y = torch.randn(m, m).to(dtype), torch.randn(m, m).to(dtype)
    x @ y
    best = min(_timed(lambda: x @ y) for _ in range(repeats))
    return 2 * m**3 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def roofline_samples_per_s(spec: ModelSpec, emb_bytes_per_sample: float, machine: dict[str, float], dtype: str) -> float:
    """The most samples/s this machine allows: a step can go no faster than its embedding bytes
    at full memory bandwidth or its matmul FLOPs at full matmul speed (whichever is slower)."""
    t_mem = emb_bytes_per_sample / (machine["mem_bw_gbs"] * 1e9)
    t_mlp = spec.mlp_flops_per_sample() / (machine[f"{dtype}_gflops"] * 1e9)
    return 1.0 / max(t_mem, t_mlp)


# --------------------------------------------------------------------------- ratios


def precision(system: str) -> str:
    return "bf16" if system in BF16_SYSTEMS else "fp32"


def add_ratios(rows: list[dict]) -> None:
    """Each row's ratio to the fastest TorchRec row and to plain PyTorch of the same config,
    setup and precision (bf16 rows against TorchRec and plain under autocast)."""
    for x in rows:
        x["vs_torchrec"] = x["vs_plain"] = x["torchrec_base"] = None
        if not x["samples_per_s"]:
            continue
        peers = [y for y in rows if y["config"] == x["config"] and y["setup"] == x["setup"] and y["samples_per_s"]
                 and precision(y["system"]) == precision(x["system"])]
        trec = [y for y in peers if y["system"] in TORCHREC_SYSTEMS]
        if trec:
            best = max(trec, key=lambda y: y["samples_per_s"]["median"])
            x["torchrec_base"] = best["system"]
            x["vs_torchrec"] = x["samples_per_s"]["median"] / best["samples_per_s"]["median"]
        plain = [y for y in peers if y["system"].startswith("plain")]
        if plain:
            x["vs_plain"] = x["samples_per_s"]["median"] / plain[0]["samples_per_s"]["median"]


def print_table(rows: list[dict], notes: list[str]) -> None:
    table = []
    for x in rows:
        s = x["samples_per_s"]
        if not s:
            table.append([x["config"], x["setup"], x["system"], "failed: " + (x["error"] or "?")[:60]] + [""] * 10)
            continue
        sh = x["time_shares"] or {}
        table.append([
            x["config"], x["setup"], x["system"],
            f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})",
            f"{x['vs_torchrec']:.2f}x" if x.get("vs_torchrec") else "-",
            f"{x['vs_plain']:.2f}x" if x.get("vs_plain") else "-",
            f"{x['peak_rss_bytes'] / 2**30:.2f}" if x.get("peak_rss_bytes") else "-",
        ] + [f"{100 * sh[c]:.0f}%" if c in sh else "-" for c in CATEGORIES]
          + [f"{100 * x['roofline_share']:.0f}%" if x.get("roofline_share") else "-"])
    headers = ["config", "setup", "system", "samples/s median (min-max)", "vs torchrec", "vs plain", "peak RSS GiB",
               *CATEGORIES, "of roofline"]
    print(format_table(headers, table, right_align_from=3))
    bases = sorted({(x["config"], x["setup"], precision(x["system"]), x["torchrec_base"]) for x in rows
                    if x.get("torchrec_base")})
    if bases:
        print("vs torchrec: against the fastest TorchRec row of the same precision: "
              + "; ".join(f"{c} {s} {p}: {b}" for c, s, p, b in bases))
    for n in notes:
        print(n)
