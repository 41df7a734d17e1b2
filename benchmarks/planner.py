"""Benchmark: recscale's planner against Meta's greedy baselines and Karmarkar-Karp.

Plans the real Criteo 1TB and MLPerf DLRM-DCNv2 table sets (../shared/data/tables) and three
synthetic sets shaped like Meta's production models (hundreds of tables, dims 4-384, pooling
factors 1-100, rows 1e2-1e8, skewed) for 8, 16, 64 and 128 ranks of the ZionEX-like preset, and
scores every plan with the recscale cost model (predicted step time of the slowest rank).
TorchRec's EmbeddingShardingPlanner is not compared yet (its estimator is not wired in here).

    python benchmarks/planner.py              # every set and world size
    python benchmarks/planner.py --quick      # two sets, 8 and 16 ranks
    python benchmarks/planner.py --json out/planner.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.planner.cost_model import TableSpec, Workload  # noqa: E402
from recscale.planner.hardware import ZIONEX  # noqa: E402
from recscale.planner.search import BASELINES, baseline_plan, plan_tables  # noqa: E402
from recscale.sharding.plan import PlanError  # noqa: E402

TABLES_JSON = Path(__file__).resolve().parents[1].parent / "shared/data/tables/criteo_table_sizes.json"


def real_sets() -> dict[str, list[TableSpec]]:
    if not TABLES_JSON.is_file():
        return {}
    d = json.loads(TABLES_JSON.read_text())
    ml = d["mlperf_dlrm_dcnv2"]
    return {
        "criteo_1tb": [TableSpec(f"t{i}", r, 128, 1.0) for i, r in enumerate(d["criteo_1tb"]["rows"])],
        "mlperf_dcnv2": [
            TableSpec(f"t{i}", r, ml["embedding_dim"], float(p)) for i, (r, p) in enumerate(zip(ml["rows"], ml["pooling_factors"]))
        ],
    }


def production_like(n: int, seed: int, max_log_rows: float) -> list[TableSpec]:
    """Hundreds of tables with skewed sizes: log-uniform rows, dims 4-384, log-normal pooling."""
    rng = np.random.default_rng(seed)
    dims = [4, 8, 16, 32, 64, 128, 192, 256, 384]
    weights = np.array([1, 2, 3, 4, 4, 3, 2, 1, 1], dtype=float)
    out = []
    for i in range(n):
        rows = int(10 ** rng.uniform(2, max_log_rows))
        dim = int(rng.choice(dims, p=weights / weights.sum()))
        pooling = float(min(100, max(1, round(rng.lognormal(1.0, 1.2)))))
        out.append(TableSpec(f"t{i}", rows, dim, pooling, unique_fraction=float(rng.uniform(0.2, 0.8))))
    return out


def synthetic_sets() -> dict[str, list[TableSpec]]:
    # Largest rows chosen so each model fits 8 ZionEX ranks (320 GB) as TorchRec/Meta plans must.
    return {
        "prod_A_300": production_like(300, 1, 7.2),
        "prod_B_500": production_like(500, 2, 6.9),
        "prod_C_800": production_like(800, 3, 6.6),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="8,16,64,128")
    p.add_argument("--batch-size", type=int, default=65536, help="global batch (MLPerf DCNv2 uses 65536)")
    p.add_argument("--time-budget", type=float, default=20.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sets = {**real_sets(), **synthetic_sets()}
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.quick:
        sets = dict(list(sets.items())[:2]) if len(sets) > 1 else sets
        worlds, args.time_budget = [8, 16], 3.0
    wl = Workload(batch_size=args.batch_size)
    rows, records, gains = [], [], []
    for name, tables in sets.items():
        for w in worlds:
            hw = ZIONEX.with_world(w)
            ours = plan_tables(tables, hw, wl, time_budget_s=args.time_budget)
            base: dict[str, float] = {}
            for m in BASELINES:
                try:
                    base[m] = baseline_plan(m, tables, hw, wl).max_rank_s
                except PlanError:
                    base[m] = math.inf
            best_name = min(base, key=lambda k: base[k])
            best = base[best_name]
            gain = 100 * (1 - ours.max_rank_s / best) if math.isfinite(best) else math.nan
            if math.isfinite(gain):
                gains.append(gain)
            rows.append(
                [name, w, len(tables), f"{ours.max_rank_s * 1e3:.3f}", f"{ours.imbalance:.2f}"]
                + [f"{base[m] * 1e3:.3f}" if math.isfinite(base[m]) else "no fit" for m in BASELINES]
                + [best_name.replace("greedy_", ""), f"{gain:.1f}%", f"{ours.seconds:.1f}"]
            )
            records.append({
                "set": name, "world_size": w, "tables": len(tables), "recscale_ms": ours.max_rank_s * 1e3,
                "recscale_imbalance": ours.imbalance, "baselines_ms": {k: (v * 1e3 if math.isfinite(v) else None) for k, v in base.items()},
                "best_baseline": best_name, "gain_pct": gain, "plan_seconds": ours.seconds,
                "sharding_mix": {t: sum(1 for x in ours.plan.tables if x.sharding_type == t) for t in {x.sharding_type for x in ours.plan.tables}},
            })
    headers = ["set", "ranks", "tables", "recscale ms", "imbal"] + [m.replace("greedy_", "") + " ms" for m in BASELINES] + ["best baseline", "gain", "plan s"]
    print(format_table(headers, rows, right_align_from=1))
    mean_gain = sum(gains) / len(gains) if gains else math.nan
    print(f"predicted step time of the slowest rank (recscale cost model, ZionEX-like preset, global batch {args.batch_size}); "
          f"gain = reduction vs the best baseline; mean gain {mean_gain:.1f}%, min {min(gains):.1f}%")
    print("TorchRec's EmbeddingShardingPlanner: not compared (not wired into this benchmark yet)")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": records, "mean_gain_pct": mean_gain})
    return 0


if __name__ == "__main__":
    sys.exit(main())
