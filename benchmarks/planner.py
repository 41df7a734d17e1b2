"""Benchmark: recscale's planner against Meta's greedy baselines, Karmarkar-Karp and TorchRec.

Plans the real Criteo 1TB and MLPerf DLRM-DCNv2 table sets (../shared/data/tables) and three
synthetic sets shaped like Meta's production models (hundreds of tables, dims 4-384, pooling
factors 1-100, rows 1e2-1e8, skewed) for 8, 16, 64 and 128 ranks of the ZionEX-like preset, and
scores every plan with the recscale cost model (predicted step time of the slowest rank) and,
when torchrec is installed, also plans with TorchRec's EmbeddingShardingPlanner (same topology
constants, its plan converted into ours) and scores every plan with its EmbeddingPerfEstimator.

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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.planner.cost_model import TableSpec, Workload  # noqa: E402
from recscale.planner.hardware import ZIONEX  # noqa: E402
from recscale.planner.search import BASELINES, baseline_plan, plan_tables, score_plan  # noqa: E402
import _torchrec_planner  # noqa: E402
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


def _fmt(v: float | None) -> str:
    return "no fit" if v is None else f"{v * 1e3:.3f}"


def _gain(ours: float | None, others: dict[str, float | None]) -> tuple[str, float]:
    valid = {k: v for k, v in others.items() if v is not None}
    if ours is None or not valid:
        return "-", math.nan
    best = min(valid, key=lambda k: valid[k])
    return best, 100 * (1 - ours / valid[best])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="8,16,64,128")
    p.add_argument("--batch-size", type=int, default=65536, help="global batch (MLPerf DCNv2 uses 65536)")
    p.add_argument("--time-budget", type=float, default=20.0)
    p.add_argument("--no-torchrec", action="store_true", help="skip TorchRec even when it is installed")
    p.add_argument("--torchrec-timeout", type=int, default=60, help="seconds TorchRec's planner may search per case")
    p.add_argument("--sets", help="comma-separated subset of the table sets (default: all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sets = {**real_sets(), **synthetic_sets()}
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.sets:
        unknown = set(args.sets.split(",")) - set(sets)
        if unknown:
            p.error(f"--sets: unknown {sorted(unknown)}; choose from {sorted(sets)}")
        sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    if args.quick:
        sets = {k: v[:60] for k, v in list(sets.items())[:2]}
        worlds, args.time_budget = [8], 2.0
    use_torchrec = _torchrec_planner.available() and not args.no_torchrec
    if use_torchrec:
        import logging
        import warnings

        logging.disable(logging.WARNING)  # TorchRec logs a line per table
        warnings.filterwarnings("ignore")
    wl = Workload(batch_size=args.batch_size)
    methods = ["recscale", *BASELINES] + (["torchrec"] if use_torchrec else [])
    rows, records = [], []
    gains: dict[str, list[float]] = {"recscale model": [], "torchrec estimator": []}
    for name, tables in sets.items():
        for w in worlds:
            hw = ZIONEX.with_world(w)
            ours = plan_tables(tables, hw, wl, time_budget_s=args.time_budget)
            plans = {"recscale": ours.plan}
            seconds = {"recscale": ours.seconds}
            for m in BASELINES:
                try:
                    plans[m] = baseline_plan(m, tables, hw, wl).plan
                except PlanError:
                    plans[m] = None
            tr = None
            if use_torchrec:
                tr = _torchrec_planner.TorchRecPlanning(tables, hw, wl, args.torchrec_timeout)
                try:
                    plans["torchrec"], seconds["torchrec"] = tr.plan()
                except Exception as e:  # TorchRec raises its own planner errors when nothing fits
                    print(f"{name} x {w}: TorchRec's planner failed: {type(e).__name__}: {str(e)[:200]}")
                    plans["torchrec"] = None
            ours_model = {m: (score_plan(pl, tables, hw, wl).max_rank_s if pl is not None else None) for m, pl in plans.items()}
            ours_model["recscale"] = ours.max_rank_s
            tr_est = {m: (tr.score(pl) if pl is not None else None) for m, pl in plans.items()} if tr else {}
            best_m, gain_m = _gain(ours_model["recscale"], {k: v for k, v in ours_model.items() if k != "recscale"})
            best_t, gain_t = _gain(tr_est.get("recscale"), {k: v for k, v in tr_est.items() if k != "recscale"})
            if math.isfinite(gain_m):
                gains["recscale model"].append(gain_m)
            if math.isfinite(gain_t):
                gains["torchrec estimator"].append(gain_t)
            rows.append(
                [name, w, len(tables), "recscale model"] + [_fmt(ours_model.get(m)) for m in methods]
                + [best_m.replace("greedy_", ""), f"{gain_m:.1f}%", f"{ours.seconds:.1f}"]
            )
            if tr:
                rows.append(
                    ["", "", "", "torchrec estimator"] + [_fmt(tr_est.get(m)) for m in methods]
                    + [best_t.replace("greedy_", ""), f"{gain_t:.1f}%", f"{seconds.get('torchrec', math.nan):.1f}"]
                )
            print(f"{name} x {w}: gain {gain_m:.1f}% (recscale model), {gain_t:.1f}% (torchrec estimator); "
                  f"planned in {ours.seconds:.1f} s, torchrec {seconds.get('torchrec', math.nan):.1f} s", flush=True)
            records.append({
                "set": name, "world_size": w, "tables": len(tables),
                "recscale_model_ms": {k: (v * 1e3 if v is not None else None) for k, v in ours_model.items()},
                "torchrec_estimator_ms": {k: (v * 1e3 if v is not None else None) for k, v in tr_est.items()},
                "gain_pct_recscale_model": gain_m, "best_other_recscale_model": best_m,
                "gain_pct_torchrec_estimator": gain_t if tr else None, "best_other_torchrec_estimator": best_t if tr else None,
                "recscale_imbalance": ours.imbalance, "plan_seconds": seconds,
                "sharding_mix": {t: sum(1 for x in ours.plan.tables if x.sharding_type == t) for t in {x.sharding_type for x in ours.plan.tables}},
            })
    headers = ["set", "ranks", "tables", "scored by"] + [m.replace("greedy_", "") + " ms" for m in methods] + ["best other", "gain", "plan s"]
    print(format_table(headers, rows, right_align_from=1))
    print(f"predicted step time of the slowest rank (ZionEX-like preset, global batch {args.batch_size}); gain = reduction of "
          "the recscale plan's score vs the best other plan under the same scorer; plan s = planning seconds (recscale; torchrec)")
    summary = {}
    for scorer, g in gains.items():
        if g:
            summary[scorer] = {"mean_gain_pct": sum(g) / len(g), "min_gain_pct": min(g), "cases": len(g)}
            print(f"{scorer}: mean gain {sum(g) / len(g):.1f}%, min {min(g):.1f}% over {len(g)} cases")
    if not use_torchrec:
        print("TorchRec: not installed (pip install torchrec fbgemm-gpu-cpu) or --no-torchrec; compared with the baselines only")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": records, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
