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

from recscale.planner.cost_model import TableSpec, Workload, collective_count, collective_s  # noqa: E402
from recscale.planner.hardware import ZIONEX, Hardware  # noqa: E402
from recscale.planner.search import (  # noqa: E402
    BASELINES, SEARCH_STEPS, TIME_LIMIT_S, baseline_plan, option_work, plan_tables, score_plan,
)
from recscale.sharding.plan import PlanError, Shard, ShardingPlan, TablePlan  # noqa: E402
import _torchrec_planner  # noqa: E402

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


def two_scorer_bound(tables: list[TableSpec], hw: Hardware, wl: Workload, tr, best_model_s: float,
                     best_tr_s: float) -> dict[str, float | bool] | None:
    """The least TorchRec-estimator score of any plan no worse than ``best_model_s`` under the
    recscale model (plans made of the planner's options); above ``best_tr_s``, no plan is at
    least as good as every other plan under both scorers.

    Under either scorer a plan's slowest rank is at least its mean, which does not depend on
    placement: under the recscale model its tables' total work over W plus the fixed costs
    (``option_work``; per-rank operator groups and contention, which would make it depend on
    placement, are 0 in the presets this runs), under TorchRec's estimator the total of its
    shards' estimates over W. Relative to every table table-wise, option o of table t adds
    d(t, o) to the first total and e(t, o) to the second. A plan choosing options S with
    sum d <= W x (best_model_s - all-table-wise mean) [+ the collectives an all-replicated plan
    drops] has, for every lambda >= 0, sum e >= sum_t min(0, min_o e + lambda d) - lambda x that
    budget (Lagrangian duality), so the best lambda bounds its TorchRec score from below."""
    if hw.group_s or hw.contention or hw.world_size < 2:
        return None
    w = hw.world_size
    all_tw = ShardingPlan(w, hw.ranks_per_host, tuple(TablePlan(t.name, "table_wise", (Shard(0, 0, t.rows, 0, t.dim),)) for t in tables))
    r = score_plan(all_tw, tables, hw, wl)
    level = sum(x.time_s for x in r.ranks) / w + r.common_s
    model_work, options = [], []
    for t in tables:
        for kind, rects, work in option_work(t, hw, wl):
            model_work.append(work)
            options.append((t.name, kind, [Shard(i % w, ro, rows, co, cols) for i, (ro, rows, co, cols) in enumerate(rects)]))
    tr_work = [sum(x) for x in tr.option_seconds(options)]
    names = [name for name, _, _ in options]
    tw = {name: (m, x) for (name, kind, _), m, x in zip(options, model_work, tr_work) if kind == "table_wise"}
    d = np.array([m - tw[n][0] for n, m in zip(names, model_work)])
    e = np.array([x - tw[n][1] for n, x in zip(names, tr_work)])
    table_of = np.unique(np.array(names), return_inverse=True)[1]
    saved = (collective_count(True, [], False, False) - collective_count(False, [], False, False)) * collective_s(hw)
    budget = w * (best_model_s - level + saved)
    tr_level = sum(m_e[1] for m_e in tw.values())
    best, best_lam = -math.inf, 0.0
    for lam in [0.0, *np.geomspace(1e-4, 1e4, 400)]:
        per_table = np.zeros(len(tw))
        np.minimum.at(per_table, table_of, e + lam * d)  # table-wise is (0, 0): the min is <= 0
        bound = per_table.sum() - lam * budget
        if bound > best:
            best, best_lam = bound, lam
    least = (tr_level + best) / w
    return {
        "table_wise_mean_ms": level * 1e3, "torchrec_table_wise_mean_ms": tr_level / w * 1e3, "lambda": best_lam,
        "torchrec_bound_ms": least * 1e3, "conflict": bool(least > best_tr_s),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="8,16,64,128")
    p.add_argument("--batch-size", type=int, default=65536, help="global batch (MLPerf DCNv2 uses 65536)")
    p.add_argument("--search-steps", type=int, default=SEARCH_STEPS, help="re-placements the local search may try")
    p.add_argument("--time-budget", type=float, default=TIME_LIMIT_S, help="safety stop in seconds")
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
        worlds, args.search_steps = [8], 2000
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
    losses: list[tuple[str, int, float, bool]] = []  # worse under TorchRec's estimator: (set, ranks, gain, no plan matches both)
    for name, tables in sets.items():
        for w in worlds:
            hw = ZIONEX.with_world(w)
            ours = plan_tables(tables, hw, wl, search_steps=args.search_steps, time_limit_s=args.time_budget)
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
            bound = None
            if tr and math.isfinite(gain_m) and math.isfinite(gain_t):
                bound = two_scorer_bound(tables, hw, wl, tr, ours_model[best_m], tr_est[best_t])
                if bound is not None and gain_t < 0:
                    losses.append((name, w, gain_t, bound["conflict"]))
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
            if bound is not None and bound["conflict"]:
                print(f"  no plan matches both: every plan no worse than {best_m} under the recscale model scores at least "
                      f"{bound['torchrec_bound_ms']:.3f} ms under TorchRec's estimator, {best_t} {tr_est[best_t] * 1e3:.3f} ms "
                      "(two_scorer_bound)", flush=True)
            records.append({
                "set": name, "world_size": w, "tables": len(tables),
                "recscale_model_ms": {k: (v * 1e3 if v is not None else None) for k, v in ours_model.items()},
                "torchrec_estimator_ms": {k: (v * 1e3 if v is not None else None) for k, v in tr_est.items()},
                "gain_pct_recscale_model": gain_m, "best_other_recscale_model": best_m,
                "gain_pct_torchrec_estimator": gain_t if tr else None, "best_other_torchrec_estimator": best_t if tr else None,
                "recscale_imbalance": ours.imbalance, "plan_seconds": seconds, "recscale_search": ours.search_record(),
                "sharding_mix": {t: sum(1 for x in ours.plan.tables if x.sharding_type == t) for t in {x.sharding_type for x in ours.plan.tables}},
                "two_scorer_bound": bound,
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
    if losses:
        proven = [f"{n} x {w} ({g:.1f}%)" for n, w, g, c in losses if c]
        other = [f"{n} x {w} ({g:.1f}%)" for n, w, g, c in losses if not c]
        print(f"worse under TorchRec's estimator in {len(losses)} cases; where no plan is at least as good as every other "
              f"plan under both scorers: {', '.join(proven) or 'none'}; elsewhere: {', '.join(other) or 'none'}")
        summary["torchrec_estimator_losses"] = [{"set": n, "world_size": w, "gain_pct": g, "no_plan_matches_both": c}
                                                for n, w, g, c in losses]
    if not use_torchrec:
        print("TorchRec: not installed (pip install torchrec fbgemm-gpu-cpu) or --no-torchrec; compared with the baselines only")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": records, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
