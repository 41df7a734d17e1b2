"""Benchmark: ``recscale explore`` on the two-buildings and zionex presets for the Criteo 1TB and
MLPerf DLRM-DCNv2 table sets: the best configuration found against each baseline (all
simulated), the best that still uses every rank, and the search's rate.

    python benchmarks/explore_scenarios.py [--time-budget 120] [--json out/explore.json] [--tables PATH]
        [--only mlperf_dlrm_dcnv2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from simulator_dcnv2 import TABLES, config_text  # noqa: E402

SETS = ("criteo_1tb", "mlperf_dlrm_dcnv2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=Path, default=TABLES, help="criteo_table_sizes.json")
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--only", action="append", choices=SETS, help="run only this table set (repeatable)")
    args = ap.parse_args(argv)
    if not args.tables.is_file():
        raise SystemExit(f"no table shapes at {args.tables}: pass --tables PATH")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which in args.only or SETS:
            cfg = Path(tmp) / f"{which}.toml"
            cfg.write_text(config_text(args.tables, which))
            for topo in ("two-buildings", "zionex"):
                out = Path(tmp) / f"{which}-{topo}.json"
                proc = subprocess.run([sys.executable, "-m", "recscale", "explore", "--config", str(cfg), "--topology", topo,
                                       "--time-budget", str(args.time_budget), "--out", str(out)],
                                      cwd=ROOT, capture_output=True, text=True, timeout=args.time_budget * 3 + 60)
                if proc.returncode != 0:
                    raise SystemExit(f"recscale explore failed:\n{proc.stderr[-2000:]}")
                d = json.loads(out.read_text())
                rows.append({"tables": which, "topology": topo, "best": d["candidates"][0]["name"],
                             "best_samples_per_s": d["candidates"][0]["predicted_samples_per_s"],
                             "speedup": d["speedup_over_baselines"],
                             "speedup_using_every_rank": d["speedup_over_baselines_using_every_rank"],
                             "baselines": {k: v.get("predicted_samples_per_s") for k, v in d["baselines"].items()},
                             "search": d["search"]})
    print(f"{'tables':18s} {'topology':14s} {'best/s':>12s} {'vs default':>10s} {'vs best base':>12s} "
          f"{'every rank: vs default':>22s} {'vs best base':>12s} {'cand/min':>9s} {'s':>5s}")
    for r in rows:
        best_base = min(r["speedup"].values())
        full = r["speedup_using_every_rank"]
        print(f"{r['tables']:18s} {r['topology']:14s} {r['best_samples_per_s']:12,.0f} "
              f"{100 * (r['speedup']['production-default'] - 1):+9.1f}% {100 * (best_base - 1):+11.1f}% "
              f"{100 * (full['production-default'] - 1):+21.1f}% {100 * (min(full.values()) - 1):+11.1f}% "
              f"{r['search']['candidates_per_minute']:9,.0f} {r['search']['seconds']:5.1f}")
    for r in rows:
        print(f"{r['tables']} on {r['topology']}: {r['best']}")
    if args.json:
        from _common import write_json

        write_json(args.json, {"runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
