"""Benchmark: does the planner's cost model predict measured step times on this machine?

Calibrates this machine (``recscale calibrate``, or ``--topology FILE`` per world size), then
for a synthetic model (ten tables of 1k-2M rows, dims 16-128, pooling 1-20, Zipf ids hashed over
the rows) measures the *embedding step* (the part of a training step the planner decides: input
distribution, pooled lookup, output distribution, backward with the fused row-wise Adagrad
update) of several plans on 1 rank and on 2 ranks (gloo, one thread each), and prints each
plan's predicted and measured time (median over steps of the slowest rank), the error, and
whether the model ranks the plans of each world size in the measured order. Plans are timed
between the calibration's own rounds (``--repeats``, 5 by default; each round times every probe
of every stage); the planner's plan too, as the 2-rank measurements so far choose it.

    python benchmarks/planner_validation.py                 # calibrate, then validate (~18 min)
    python benchmarks/planner_validation.py --quick --json out/validation.json
    python benchmarks/planner_validation.py --topology-1 local1.json --topology-2 local2.json
    python benchmarks/planner_validation.py --refit out/validation.json   # seconds: no measuring

``--json`` keeps every raw measurement (the calibration's probes and the plans' rounds);
``--refit`` fits and scores them again with the current code, so a change to the cost model or
its fit is compared with the old one on the same measurements, not on a new draw of this VM's
noise (the planner's plan stays the one that was measured).

Run it alone on the machine (e.g. under ``flock -x /tmp/recscale-cpu.lock``): it times things.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.comm.process_group import Topology  # noqa: E402
from recscale.embedding import TableConfig  # noqa: E402
from recscale.planner.calibrate import Measurements, fit_hardware, measure  # noqa: E402
from recscale.planner.cost_model import TableSpec, Workload  # noqa: E402
from recscale.planner.hardware import resolve_hardware  # noqa: E402
from recscale.planner.measure import synthetic_batches, time_plan, unique_fractions  # noqa: E402
from recscale.planner.search import plan_tables, score_plan  # noqa: E402
from recscale.sharding.default_plan import TableSharding, default_plan, single_rank_plan  # noqa: E402
from recscale.sharding.plan import ShardingPlan  # noqa: E402

MODEL = [  # rows, dim, pooling
    (2_000_000, 64, 1), (1_000_000, 64, 4), (500_000, 32, 8), (200_000, 64, 2), (100_000, 128, 1),
    (50_000, 32, 20), (20_000, 64, 1), (10_000, 16, 5), (5_000, 64, 1), (1_000, 32, 10),
]


def model_tables(quick: bool) -> list[TableSpec]:
    scale = 10 if quick else 1
    return [TableSpec(f"t{i}", max(r // scale, 100), d, float(p)) for i, (r, d, p) in enumerate(MODEL)]


def with_statistics(tables: list[TableSpec], batch) -> list[TableSpec]:
    """The planner's input taken from data statistics: unique ids per lookup."""
    uf = unique_fractions(tables, batch)
    return [TableSpec(t.name, t.rows, t.dim, t.pooling, uf[t.name]) for t in tables]


def one_rank_plans(cfgs: list[TableConfig]) -> list[tuple[str, ShardingPlan]]:
    topo = Topology(1, 0, 1)
    big = {c.name: TableSharding("column_wise", 2) for c in cfgs if c.num_rows >= 100_000}
    return [
        ("1: table-wise", default_plan(cfgs, topo, "table_wise")),
        ("1: row-wise", default_plan(cfgs, topo, "row_wise")),
        ("1: column-wise x2 big", default_plan(cfgs, topo, "table_wise", big)),
        ("1: column-wise x2", default_plan(cfgs, topo, "table_wise", {c.name: TableSharding("column_wise", 2) for c in cfgs})),
        ("1: column-wise x4", default_plan(cfgs, topo, "table_wise", {c.name: TableSharding("column_wise", 4) for c in cfgs})),
    ]


def fixed_two_rank_plans(cfgs: list[TableConfig]) -> list[tuple[str, ShardingPlan]]:
    """The 2-rank plans that do not depend on the calibration (the planner's plan does)."""
    topo = Topology(2, 0, 2)
    return [
        ("2: all on rank 0", single_rank_plan(cfgs, topo)),
        ("2: row-wise", default_plan(cfgs, topo, "row_wise")),
        ("2: column-wise", default_plan(cfgs, topo, "column_wise")),
        ("2: data-parallel", default_plan(cfgs, topo, "data_parallel")),
        ("2: column-wise x4", default_plan(cfgs, topo, "table_wise", {c.name: TableSharding("column_wise", 4) for c in cfgs})),
    ]


def _recorded_measurements(recorded: dict, w: int) -> Measurements:
    m = dict(recorded["calibration_measurements"][str(w)])
    # Older recordings kept only the probe times: the rest is this machine's.
    hw = recorded["hardware"][str(w)]
    m.setdefault("world_size", w)
    m.setdefault("quick", recorded["args"]["quick"])
    m.setdefault("cache_bytes", hw["cache_bytes"] * w)
    m.setdefault("physical_memory_bytes", hw["memory_bytes"] * w / 0.6)
    return Measurements(**m)


def _rank_free(plan: ShardingPlan) -> tuple:
    """The plan with its ranks renamed in order of first use: plans that differ only in which
    of a host's identical ranks holds what compare equal."""
    names: dict[int, int] = {}
    return tuple((tp.table, tp.sharding_type, tuple((names.setdefault(s.rank, len(names)), s.row_offset, s.num_rows,
                                                     s.col_offset, s.num_cols) for s in tp.shards)) for tp in plan.tables)


def _recorded_rounds(recorded: dict, plan: str) -> list[float]:
    return [t / 1e3 for r in recorded["results"] if r["plan"] == plan for t in r["measured_rounds_ms"]]


def _order(records: list[dict], key: str) -> list[str]:
    return [r["plan"] for r in sorted(records, key=lambda r: r[key])]


def kendall_tau(a: list[str], b: list[str]) -> float:
    pos = {x: i for i, x in enumerate(b)}
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += 1 if pos[a[i]] < pos[a[j]] else -1
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--steps", type=int, default=9, help="timed steps per plan (the median is kept)")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of the calibration's probes and of every plan between them, or of every plan with "
                        "topology files (the median of each is kept)")
    p.add_argument("--topology-1", metavar="FILE", help="calibration for 1 rank (default: calibrate now)")
    p.add_argument("--topology-2", metavar="FILE", help="calibration for 2 ranks (default: calibrate now)")
    p.add_argument("--quick", action="store_true", help="tables 10x smaller, 3 steps (a smoke run)")
    p.add_argument("--refit", metavar="JSON", help="no measuring: fit and score again what a --json run recorded")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    recorded = None
    if args.refit:
        recorded = json.loads(Path(args.refit).read_text())
        if sorted(recorded.get("calibration_measurements", {})) != ["1", "2"]:
            raise SystemExit(f"{args.refit}: no calibration measurements for 1 and 2 ranks (--json records them only "
                             "when it calibrates: not with --topology files)")
        args.batch_size, args.quick = recorded["args"]["batch_size"], recorded["args"]["quick"]
    if args.quick:
        args.steps, args.repeats = 3, 1
    raw = model_tables(args.quick)
    batches = synthetic_batches(raw, args.batch_size, 4, seed=1)
    tables = with_statistics(raw, batches[0])
    cfgs = [TableConfig(t.name, t.rows, t.dim) for t in tables]
    wl = Workload(batch_size=args.batch_size)
    cases: list[tuple[int, str, ShardingPlan]] = [(1, n, pl) for n, pl in one_rank_plans(cfgs)]
    cases += [(2, n, pl) for n, pl in fixed_two_rank_plans(cfgs)]
    timings: dict[int, list[float]] = {i: [] for i in range(len(cases))}

    def time_round(world: int) -> None:
        for i, (w, _, plan) in enumerate(cases):
            if w == world:
                timings[i].append(time_plan(plan, tables, batches, args.steps))

    # The planner's plan as the 2-rank measurements so far choose it, timed in the same round as
    # the fixed plans: every plan, the planner's included, is then timed in the period whose
    # constants predict it (timed after the calibration alone, a drift of the machine's speed
    # would count against it).
    provisional: list[tuple[ShardingPlan, float]] = []

    def between_rounds(m: Measurements, w: int) -> None:
        time_round(w)
        if w == 2 and m.complete:
            plan = plan_tables(tables, fit_hardware(m), wl).plan
            provisional.append((plan, time_plan(plan, tables, batches, args.steps)))

    # A calibration made now times its plans after each of its own rounds of probes, so the
    # constants and the measured plans see the same mix of machine states (a shared VM's speed
    # drifts over minutes); with a topology file, plans are timed ``--repeats`` rounds
    # (the 2-rank ones with the planner's).
    hws, measurements = {}, {}
    for w, path in ((1, args.topology_1), (2, args.topology_2)):
        if recorded is not None:
            measurements[w] = _recorded_measurements(recorded, w)
            hws[w] = fit_hardware(measurements[w])
            for i, (cw, name, _) in enumerate(cases):
                if cw == w:
                    timings[i] = _recorded_rounds(recorded, name)
        elif path:
            hws[w] = resolve_hardware(path, w, w)
            if w == 1:
                for _ in range(args.repeats):
                    time_round(w)
        else:
            measurements[w] = measure(w, quick=args.quick, between_rounds=lambda m, w=w: between_rounds(m, w),
                                      rounds=args.repeats)
            hws[w] = fit_hardware(measurements[w])
    if recorded is not None:  # the plan that was measured, whatever the new fit would choose
        chosen = ShardingPlan.from_dict(recorded["planner_plan"])
        planner_is = None if recorded["planner_chose"] == "2: recscale planner" else recorded["planner_chose"]
    else:
        # After the last round the measurements are complete: its plan is the final fit's.
        chosen = provisional[-1][0] if provisional else plan_tables(tables, hws[2], wl).plan
        same = [name for w, name, plan in cases if w == 2 and _rank_free(plan) == _rank_free(chosen)]
        planner_is = same[0] if same else None
    chosen_key = _rank_free(chosen)
    final = [_rank_free(plan) == chosen_key for plan, _ in provisional]  # rounds that timed the final plan
    if planner_is:  # the same plan twice would only compare noise with noise
        print(f"the recscale planner chose the plan '{planner_is}'")
    else:
        cases.append((2, "2: recscale planner", chosen))
        i = len(cases) - 1
        if recorded is not None:
            timings[i] = _recorded_rounds(recorded, "2: recscale planner")
        elif provisional:
            timings[i] = [t for (_, t), is_final in zip(provisional, final) if is_final]
            print(f"the planner's plan was timed in {len(timings[i])} of the {len(provisional)} rounds of the 2-rank "
                  "calibration that it could follow")
            # Fewer rounds than the calibration has: every 2-rank plan gets more rounds after it,
            # so no plan's figure rests on one round of a slow minute.
            extra = len(provisional) - len(timings[i])
            if extra:
                print(f"(in the others, the measurements so far chose another plan): timing every 2-rank plan in {extra} "
                      "more round(s)")
            for _ in range(extra):
                time_round(2)
    if recorded is None and not provisional:  # a 2-rank topology file: every 2-rank plan, the planner's among them
        for _ in range(args.repeats):
            time_round(2)
    rows, records = [], []
    for i, (world, name, plan) in enumerate(cases):
        pred = score_plan(plan, tables, hws[world], wl).max_rank_s
        meas = statistics.median(timings[i])
        err = 100 * (pred - meas) / meas
        records.append({"world_size": world, "plan": name, "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3, "error_pct": err,
                        "measured_rounds_ms": [t * 1e3 for t in timings[i]]})
        rows.append([name, f"{pred * 1e3:.1f}", f"{meas * 1e3:.1f}", f"{err:+.1f}%",
                     " ".join(f"{t * 1e3:.1f}" for t in timings[i])])
    print(format_table(["plan", "predicted ms", "measured ms", "error", "rounds ms"], rows, right_align_from=1))
    summary = {}
    for world in (1, 2):
        rec = [r for r in records if r["world_size"] == world]
        pred_order, meas_order = _order(rec, "predicted_ms"), _order(rec, "measured_ms")
        within = sum(abs(r["error_pct"]) <= 20 for r in rec)
        tau = kendall_tau(pred_order, meas_order)
        summary[world] = {"within_20pct": within, "plans": len(rec), "max_abs_error_pct": max(abs(r["error_pct"]) for r in rec),
                          "same_order": pred_order == meas_order, "kendall_tau": tau,
                          "predicted_order": pred_order, "measured_order": meas_order}
        print(f"{world} rank(s): {within} of {len(rec)} within 20% (worst {summary[world]['max_abs_error_pct']:.1f}%); "
              f"same order: {pred_order == meas_order} (Kendall tau {tau:.2f})")
        print(f"  predicted order: {pred_order}\n  measured order:  {meas_order}")
    for w, hw in hws.items():
        print(f"constants, {w} rank(s): gathers {hw.memory_bw / 1e9:.2f} GB/s (backward x{hw.backward_factor}), "
              f"per id {hw.id_s * 1e9:.1f} ns, per unique row {hw.row_s * 1e9:.1f} ns "
              f"(+{hw.cold_byte_s * 1e12:.1f} ns per kB twice beyond {hw.cache_bytes / 2**20:.0f} MiB of cache), per bag {hw.bag_s * 1e9:.1f} ns, "
              f"per routed id {hw.route_id_s * 1e9:.1f} ns and row-split table {hw.route_table_s * 1e6:.0f} us, per column-stat id {hw.column_stat_id_s * 1e9:.1f} ns "
              f"and shard {hw.column_stat_shard_s * 1e6:.0f} us, "
              f"per shard {2 * hw.kernel_overhead_s * 1e6:.0f} us, per operator group {hw.group_s * 1e6:.0f} us, per feature {hw.feature_s * 1e6:.0f} us, "
              f"per distributed id {hw.dist_id_s * 1e9:.1f} ns and value {hw.dist_value_s * 1e9:.2f} ns, "
              f"per step {hw.step_overhead_s * 1e6:.0f} us, all-to-all {hw.intra_host_bw / 1e9:.2f} GB/s, "
              f"latency {hw.latency_s * 1e6:.0f} us (replica groups' {hw.replica_collective_latency_s * 1e6:.0f} us), replicas combine rows at "
              f"{1e-9 / hw.replica_byte_s if hw.replica_byte_s > 0 else float('inf'):.2f} GB/s, "
              f"contention {hw.contention:.2f}")
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), "results": records, "summary": summary,
                               "planner_chose": planner_is or "2: recscale planner", "planner_plan": chosen.to_dict(),
                               "planner_provisional": [{"ms": t * 1e3, "final": is_final, "plan": plan.to_dict()}
                                                       for (plan, t), is_final in zip(provisional, final)],
                               "hardware": {w: vars(hw) for w, hw in hws.items()},
                               "calibration_measurements": {w: asdict(m) for w, m in measurements.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
