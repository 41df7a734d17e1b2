"""Benchmark: ``recscale simulate`` of MLPerf-sized DLRMs on ZionEX-like clusters, beside the
published reference point (TorchRec on 8 A100: DLRM on Criteo 1TB at about 1.67M samples/s).

Reads the real table shapes from ``../shared/data/tables/criteo_table_sizes.json`` (MLPerf
DLRM-DCNv2: 26 tables, rows capped at 40M, multi-hot pooling, dim 128, global batch 65,536; and
Criteo 1TB's one-hot row counts), writes each as a recscale config, and simulates:

- DLRM-DCNv2 shapes on 16 hosts x 8 GPUs (the acceptance case: it must finish in under 10 s);
- Criteo 1TB one-hot on 1 host x 8 GPUs (TorchRec's published setting, batch 65,536).

    python benchmarks/simulator_dcnv2.py [--json out/sim_dcnv2.json] [--tables PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT.parent / "shared" / "data" / "tables" / "criteo_table_sizes.json"
TORCHREC_8_A100 = 1.67e6  # samples/s, DLRM on Criteo 1TB


def config_text(tables_json: Path, which: str) -> str:
    """A recscale config of the shapes in ``tables_json``: ``mlperf_dlrm_dcnv2`` (multi-hot) or
    ``criteo_1tb`` (one-hot, with the DCNv2 entry's MLPs and batch)."""
    d = json.loads(tables_json.read_text())
    m = d["mlperf_dlrm_dcnv2"]
    rows = d[which]["rows"]
    pooling = m["pooling_factors"] if which == "mlperf_dlrm_dcnv2" else [1] * len(rows)
    return (f'[data]\nsource = "synthetic"\npooling_factors = {pooling}\n\n'
            f"[model]\nembedding_dim = {m['embedding_dim']}\ntable_rows = {rows}\n"
            f"bottom_mlp = {m['bottom_mlp'][1:]}\ntop_mlp = {m['top_mlp']}\n\n"
            f'[embedding_optimizer]\nname = "rowwise_adagrad"\n\n[train]\nbatch_size = {m["global_batch_size"]}\n')


def simulate(config: Path, hosts: int, ranks: int, out: Path) -> tuple[dict, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "recscale", "simulate", "--config", str(config), "--topology", "zionex",
                           "--hosts", str(hosts), "--ranks-per-host", str(ranks), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"recscale simulate failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text()), seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=Path, default=TABLES, help="criteo_table_sizes.json")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not args.tables.is_file():
        raise SystemExit(f"no table shapes at {args.tables}: pass --tables PATH")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which, hosts, ranks in (("mlperf_dlrm_dcnv2", 16, 8), ("criteo_1tb", 1, 8)):
            cfg = Path(tmp) / f"{which}.toml"
            cfg.write_text(config_text(args.tables, which))
            res, seconds = simulate(cfg, hosts, ranks, Path(tmp) / f"{which}.json")
            rows.append({"model": which, "hosts": hosts, "gpus_per_host": ranks, "wall_s": seconds,
                         "step_time_s": res["step_time_s"], "samples_per_s": res["samples_per_s"],
                         "samples_per_s_per_gpu": res["samples_per_s"] / (hosts * ranks), "breakdown": res["breakdown"]})
    print(f"{'model':20s} {'cluster':>8s} {'step ms':>9s} {'samples/s':>12s} {'per GPU':>9s} {'simulate s':>10s}")
    for r in rows:
        print(f"{r['model']:20s} {r['hosts']:>3d} x {r['gpus_per_host']:<2d} {r['step_time_s'] * 1e3:9.3f} "
              f"{r['samples_per_s']:12,.0f} {r['samples_per_s_per_gpu']:9,.0f} {r['wall_s']:10.1f}")
    print(f"{'TorchRec (published)':20s} {1:>3d} x {8:<2d} {'':9s} {TORCHREC_8_A100:12,.0f} {TORCHREC_8_A100 / 8:9,.0f}")
    for r in rows:
        top = sorted(r["breakdown"].items(), key=lambda kv: -kv[1])[:3]
        print(f"{r['model']}: critical path led by " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in top))
    if args.json:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _common import write_json

        write_json(args.json, {"runs": rows, "torchrec_8_a100_samples_per_s": TORCHREC_8_A100})
    return 0


if __name__ == "__main__":
    sys.exit(main())
