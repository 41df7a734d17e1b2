"""Benchmark: training throughput on 1 process and on 2 ranks, and where the step time goes.

Runs ``recscale train`` on a synthetic Criteo-shaped config (26 tables with the Criteo Kaggle
row counts, capped; Zipf ids; a few multi-hot features) as one process and under ``torchrun``
with 2 ranks, for each requested sharding type, and prints samples/s, step time and the share
of the step each collective took on rank 0 (blocking wall time; bytes per step too).

    python benchmarks/scaling.py                   # table_wise and row_wise, 60 steps
    python benchmarks/scaling.py --quick           # tiny, a smoke run
    python benchmarks/scaling.py --sharding table_wise,data_parallel --json out/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
POOLING = [1, 1, 3, 1, 2, 1, 1, 1, 1, 4, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 5, 1, 1, 1, 1, 1]
COLLECTIVES = ("input_lengths", "input_ids", "input_weights", "output_a2a", "grad_a2a", "dp_grads", "dense_allreduce")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(args: argparse.Namespace, sharding: str) -> list[str]:
    cap = 10_000 if args.quick else args.row_cap
    rows = [min(r, cap) for r in CRITEO_ROWS]
    return [
        "data.source=synthetic",
        f"data.num_samples={args.batch_size * (args.steps + 2)}",
        f"data.eval_samples={args.batch_size}",
        f"data.pooling_factors={POOLING}",
        "data.num_workers=1",
        f"model.table_rows={rows}",
        f"model.embedding_dim={args.dim}",
        f"model.bottom_mlp=[128, {args.dim}]",
        "model.top_mlp=[128, 1]",
        f"train.batch_size={args.batch_size}",
        f"train.max_steps={args.steps}",
        "train.progress=false",
        f"sharding.default={sharding}",
        f"comm.forward={args.precision}",
        f"comm.backward={args.precision}",
    ]


def run(world: int, sharding: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "s.json"
        sets: list[str] = []
        for o in overrides(args, sharding):
            sets += ["--set", o]
        tail = ["-m", "recscale", "train", "--summary-json", str(summary)] + sets
        if world == 1:
            cmd = [sys.executable] + tail
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}"] + tail
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // world)))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"run failed (world {world}, {sharding}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return json.loads(summary.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sharding", default="table_wise,row_wise", help="comma-separated sharding types")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--row-cap", type=int, default=500_000)
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.steps, args.dim = 256, 4, 16
    results = []
    base = run(1, "table_wise", args)
    results.append(("1 process", "-", base))
    for sharding in args.sharding.split(","):
        results.append(("2 ranks", sharding, run(2, sharding, args)))
    rows, payload = [], []
    for label, sharding, s in results:
        step_ms = 1000 * s["train_seconds"] / max(s["steps"], 1)
        secs = s.get("comm_seconds_per_step", {})
        shares = {c: 100 * secs.get(c, 0.0) * 1000 / step_ms for c in COLLECTIVES}
        rows.append(
            [label, sharding, f"{s['train_samples_per_sec']:,.0f}", f"{step_ms:.1f}"]
            + [f"{shares[c]:.1f}%" if c in secs else "-" for c in COLLECTIVES]
            + [f"{sum(s.get('comm_bytes_per_step', {}).values()) / 1e6:.2f}"]
        )
        payload.append({
            "setup": label, "sharding": sharding, "samples_per_sec": s["train_samples_per_sec"], "step_ms": step_ms,
            "collective_share_pct": {c: v for c, v in shares.items() if c in secs},
            "bytes_per_step": s.get("comm_bytes_per_step", {}), "eval_auc": s["eval_auc"],
        })
    headers = ["setup", "sharding", "samples/s", "step ms"] + [f"{c} %" for c in COLLECTIVES] + ["MB sent/step"]
    print(format_table(headers, rows, right_align_from=2))
    print(f"global batch {args.batch_size}, {args.steps} steps, dim {args.dim}, wire {args.precision}; "
          "collective shares are rank 0's blocking wall time per step")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": payload})
    return 0


if __name__ == "__main__":
    sys.exit(main())
