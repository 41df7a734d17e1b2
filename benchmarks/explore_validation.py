"""Benchmark: does the explorer's choice hold for real? On two groups of emulated hosts joined by
one slower shaped link (``recscale cluster --groups 2``), ``recscale explore`` scores candidates
for a small synthetic DLRM; its top choice and the production-like default (optionally the best
other baseline too) are then trained on that emulated cluster in interleaved turns, and their
measured samples/s set against the predicted ones: the measured order against the predicted
order, the measured gain over the default against the predicted gain (median of the per-turn
ratios, with their spread).

The default scenario keeps both ends where the simulator prices well, the shaped links: every
rank is used (``--use-all-ranks``: a fixed world size, what a job that has the whole cluster
searches over), wires stay fp32 (``--max-auc-loss 0``: no measured accuracy loss allowed), so
the gain comes from the sharding plan alone (which tables are replicated, hence how many bytes
cross the slow link), and links of 20 Mbit/s in a group, 10 Mbit/s between the groups make both
runs link-bound (the table prints the share of the cross link's capacity each run used). The
predicted gain is moderate (about +70%), so 10 points apart is about 6% error at either end.
Each measurement is a short and a long run whose difference gives the steady step (setup,
first steps and evaluation cancel).

The explorer sees the emulated cluster as tiers: each group a "building" of hosts on
``--intra-mbit`` links, the groups joined by ``--cross-mbit``, every rank sharing this machine's
cores, the loader's cost per sample measured here. The command each candidate is trained with
is the one the explorer wrote (``--out``'s ``cluster_command``, its plan file from
``--plans-dir``), with only the step count and the summary file added. A second, unrestricted
search (every placement and wire precision) on the same cluster reports the explorer's rate
(candidates scored per minute) and whether it finished within its time budget.

    python benchmarks/explore_validation.py --quick --json out/explore-validation.json
    python benchmarks/explore_validation.py --turns 5 --json out/explore-validation.json

Needs root (network namespaces); run it alone on the machine: it times things.
``--predict-from JSON`` needs neither: it predicts a saved run's configurations again with
this simulator (the same cluster, model and plans as the explorer names them) and sets the
new predicted gain beside the measured one that file holds.

    python benchmarks/explore_validation.py --predict-from out/explore-validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.planner.hardware import cached_calibration  # noqa: E402
from recscale.sim.calibrate import measure_loader  # noqa: E402
from recscale.sim.explore import explore as explore_candidates  # noqa: E402
from recscale.sim.explore_report import _name as candidate_name  # noqa: E402
from recscale.sim.tiers import EMULATED_FRAMING, FRAMING_KEYS, cluster_from_dict, emulated_cluster  # noqa: E402
from recscale.train.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "synthetic.toml"
SHORT_STEPS = 3  # the short run of each measurement (see measure)
# 26 tables of 64-wide rows: the pooled embeddings (6.5 KB a sample in fp32) cross links; a top
# MLP of 256 gives every configuration the same dense all-reduce (0.4 MB), which keeps the gain
# moderate
MODEL = ("model.embedding_dim=64", "model.bottom_mlp=[64, 64]", "model.top_mlp=[256, 1]", "train.threads=1",
         "data.num_workers=0", "train.progress=false", "data.eval_samples=1024")


def explore(args: argparse.Namespace, tmp: Path, sets: list[str]) -> tuple[dict, dict, dict]:
    """The validated search, then an unrestricted one on the same tiers for the rate."""
    cfg = load_config(CONFIG, sets)
    cal = cached_calibration(2)
    cluster = emulated_cluster(args.hosts_per_group, args.ranks_per_host, args.intra_mbit, args.cross_mbit,
                               os.cpu_count() or 1, str(cal) if cal.is_file() else "local-cpu",
                               {"load_s_per_sample": measure_loader(cfg)})
    topo = tmp / "emulated.json"
    topo.write_text(json.dumps(cluster.to_dict()))
    out, full = tmp / "explore.json", tmp / "explore-full.json"
    base = [sys.executable, "-m", "recscale", "explore", "--config", str(CONFIG), "--topology", str(topo),
            "--time-budget", str(args.time_budget)] + [a for s in sets for a in ("--set", s)]
    for cmd in (base + ["--max-auc-loss", str(args.max_auc_loss), "--out", str(out), "--plans-dir", str(tmp / "plans")]
                + (["--use-all-ranks"] if args.use_all_ranks else []),
                base + ["--max-auc-loss", "0.002", "--out", str(full)]):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"recscale explore failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
        print("$ recscale " + " ".join(cmd[3:]) + "\n" + proc.stdout)
    return json.loads(out.read_text()), json.loads(full.read_text())["search"], cluster.to_dict()


def choose(d: dict, with_baseline: bool) -> dict[str, dict]:
    """The explorer's top choice, the production-like default, and (``with_baseline``) the best
    other baseline."""
    chosen = {"explorer top": d["candidates"][0], "production-default": d["baselines"]["production-default"]}
    if chosen["explorer top"]["plan_file"] == chosen["production-default"]["plan_file"]:
        raise SystemExit("the explorer's top choice is the default itself: nothing to validate in this scenario")
    if not with_baseline:
        return chosen
    others = [(k, v) for k, v in d["baselines"].items() if k != "production-default" and "unavailable" not in v]
    if others:
        k, v = max(others, key=lambda kv: kv[1]["predicted_samples_per_s"])
        if v["plan_file"] != chosen["explorer top"]["plan_file"]:
            chosen[f"best baseline ({k})"] = v
    return chosen


def run_once(entry: dict, batch: int, steps: int) -> dict:
    """Train ``entry`` for ``steps`` steps with the explorer's command."""
    cmd = list(entry["cluster_command"])
    assert cmd[:2] == ["recscale", "cluster"] and "train" in cmd, cmd
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        at = cmd.index("train") + 1
        cmd[at:at] = ["--summary-json", str(summary)]
        cmd += ["--set", f"train.max_steps={steps}", "--set", f"data.num_samples={batch * (steps + 2)}"]
        proc = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not summary.is_file():
            raise SystemExit(f"run failed ({entry['name']}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        s = json.loads(summary.read_text())
    m = re.search(r"between the groups carried ([\d,.]+) MB from group 0 and ([\d,.]+) MB", proc.stdout)
    cross = (float(m.group(1).replace(",", "")), float(m.group(2).replace(",", ""))) if m else (0.0, 0.0)
    return {"steps": steps, "train_seconds": s["train_seconds"], "samples_per_s": float(s["train_samples_per_sec"]),
            "cross_mb": cross, "comm_seconds_per_step": s.get("comm_seconds_per_step", {})}


def measure(entry: dict, batch: int, seconds: float, quick: bool) -> dict:
    """Steady-state samples/s of ``entry``: a short and a long run (about ``seconds`` of
    predicted time), the difference of their training times over the difference of their
    steps, so the first steps' setup (rank start skew, first allocations) and the setup and
    evaluation traffic on the links cancel; the cross link's bytes per step likewise."""
    short = SHORT_STEPS
    long = max(short + (4 if quick else 8), min(400, round(entry["predicted_samples_per_s"] * seconds / batch)))
    a, b = run_once(entry, batch, short), run_once(entry, batch, long)
    dt, dn = b["train_seconds"] - a["train_seconds"], long - short
    if dt <= 0:
        raise SystemExit(f"{entry['name']}: the long run took no longer than the short one; raise --seconds")
    cross = [(y - x) / dn for x, y in zip(a["cross_mb"], b["cross_mb"])]
    return {"samples_per_s": batch * dn / dt, "step_s": dt / dn, "steps": (short, long),
            "whole_run_samples_per_s": b["samples_per_s"], "cross_mb_per_step": max(cross),
            "cross_mb_per_step_each_way": cross, "comm_seconds_per_step": b["comm_seconds_per_step"]}


def _median_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(d.get(k, 0.0) for d in ds) for k in sorted({k for d in ds for k in d})}


def predict_from(path: str) -> dict:
    """The saved run's configurations predicted again: the explorer's search on the cluster
    the file describes (an emulated one: its links are framed as ``tc`` counts them), the
    candidates picked by the names the file records, their predicted step times and the
    predicted gain against the measured one."""
    saved = json.loads(Path(path).read_text())
    cluster_d = dict(saved["cluster"])
    if not any(k in cluster_d for k in FRAMING_KEYS):  # written before framing was recorded
        cluster_d.update(EMULATED_FRAMING)
    cluster = cluster_from_dict(cluster_d, cluster_d.get("name", "emulated"))
    cfg = load_config(ROOT / saved["config"], saved["sets"])
    e = explore_candidates(cfg, cluster, float(saved.get("search", {}).get("validated", {}).get("time_budget_s", 60.0)),
                           max_auc_loss=saved["max_auc_loss"], use_all_ranks=saved["use_all_ranks"])
    by_name = {candidate_name(e, s): s for s in e.scored}
    by_name.update({f"baseline: {k}": b for k, b in e.baselines.items() if not isinstance(b, str)})
    out: dict[str, dict] = {}
    for k, run in saved["runs"].items():
        s = by_name.get(run["name"])
        if s is None or s.result is None:
            raise SystemExit(f"{path}: the explorer no longer simulates '{run['name']}'; re-run the benchmark")
        out[k] = {"name": run["name"], "was_predicted_step_s": run["predicted_step_s"],
                  "predicted_step_s": s.result.step_time_s, "measured_step_s": run["measured_step_s"],
                  "predicted_breakdown_s": s.result.breakdown}
        print(f"{k:20s} predicted {s.result.step_time_s:.3f} s a step (was {run['predicted_step_s']:.3f}), "
              f"measured {run['measured_step_s']:.3f} s ({100 * (run['measured_step_s'] / s.result.step_time_s - 1):+.1f}%)")
        print("  predicted: " + ", ".join(f"{n} {v:.3f}" for n, v in sorted(s.result.breakdown.items(),
                                                                           key=lambda kv: -kv[1]) if v >= 1e-3))
    top, base = out["explorer top"], out["production-default"]
    gain_p = base["predicted_step_s"] / top["predicted_step_s"] - 1
    verdict = {"runs": out, "predicted_gain": gain_p, "was_predicted_gain": saved["predicted_gain"],
               "measured_gain": saved["measured_gain"], "gain_points_apart": 100 * (saved["measured_gain"] - gain_p),
               "within_10_points": abs(saved["measured_gain"] - gain_p) <= 0.10,
               "explorer_top_now": candidate_name(e, e.scored[0])}
    print(f"explorer top vs production-default: predicted gain {100 * gain_p:+.1f}% (was "
          f"{100 * saved['predicted_gain']:+.1f}%), measured {100 * saved['measured_gain']:+.1f}%: "
          f"{verdict['gain_points_apart']:+.1f} points apart (acceptance: within 10)")
    print(f"the explorer's top choice now: {verdict['explorer_top_now']}")
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one turn of short runs (a smoke run)")
    ap.add_argument("--turns", type=int, default=None, help="interleaved turns (default 5; quick 1)")
    ap.add_argument("--hosts-per-group", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--intra-mbit", type=float, default=20.0, help="each host's link inside its group")
    ap.add_argument("--cross-mbit", type=float, default=10.0,
                    help="the one link between the two groups (default: 1:4 oversubscribed, as two-buildings)")
    ap.add_argument("--batch-size", type=int, default=384, help="the global batch the explorer keeps fixed")
    ap.add_argument("--max-auc-loss", type=float, default=0.0,
                    help="passed to recscale explore (default 0: fp32 wires only; 0.002 lets int8 in)")
    ap.add_argument("--any-placement", dest="use_all_ranks", action="store_false",
                    help="let the explorer use fewer buildings or ranks per host (default: --use-all-ranks)")
    ap.add_argument("--with-baseline", action="store_true",
                    help="also train the best other baseline (the recscale planner's plan) each turn")
    ap.add_argument("--time-budget", type=float, default=60.0, help="each search's --time-budget, seconds")
    ap.add_argument("--seconds", type=float, default=None,
                    help="predicted training seconds of each long run (default 15; quick 6)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--predict-from", metavar="JSON",
                    help="predict a saved run (this script's --json) again, without emulated hosts or root")
    args = ap.parse_args(argv)
    if args.predict_from:
        verdict = predict_from(args.predict_from)
        if args.json:
            write_json(args.json, {"predicted_from": Path(args.predict_from).name, **verdict})
        return 0
    if os.geteuid() != 0:
        raise SystemExit("emulated hosts (recscale cluster) need root")
    turns = args.turns or (1 if args.quick else 5)
    seconds = args.seconds or (6.0 if args.quick else 15.0)
    sets = [*MODEL, f"train.batch_size={args.batch_size}"]
    with tempfile.TemporaryDirectory() as tmp:
        d, rate, cluster = explore(args, Path(tmp), sets)
        chosen = choose(d, args.with_baseline)
        measured: dict[str, list[dict]] = {k: [] for k in chosen}
        names = list(chosen)
        for turn in range(turns):
            for k in names[turn % len(names):] + names[: turn % len(names)]:
                r = measure(chosen[k], args.batch_size, seconds, args.quick)
                measured[k].append(r)
                print(f"turn {turn + 1}/{turns}  {k:20s} {r['samples_per_s']:8,.1f} samples/s  "
                      f"({r['step_s']:.3f} s a step "
                      f"over steps {r['steps'][0]}..{r['steps'][1]}; whole run {r['whole_run_samples_per_s']:,.1f}; "
                      f"cross link {r['cross_mb_per_step']:.3f} MB a step)", flush=True)
    rows, out = [], {}
    cross_bytes_s = args.cross_mbit * 1e6 / 8
    for k, e in chosen.items():
        sps = [r["samples_per_s"] for r in measured[k]]
        med = statistics.median(sps)
        busy = statistics.median(r["cross_mb_per_step"] * 1e6 / cross_bytes_s / r["step_s"] for r in measured[k])
        out[k] = {"name": e["name"], "launch": e["launch"], "command": e["cluster_command"],
                  "predicted_samples_per_s": e["predicted_samples_per_s"], "measured": measured[k],
                  "measured_median": med, "spread": (max(sps) - min(sps)) / med, "cross_link_busy": busy,
                  "cross_mb_per_step": statistics.median(r["cross_mb_per_step"] for r in measured[k]),
                  "predicted_breakdown_s": e["breakdown"],
                  "predicted_step_s": e["step_time_s"], "measured_step_s": args.batch_size / med,
                  "measured_comm_s_per_step": _median_dict([r["comm_seconds_per_step"] for r in measured[k]])}
        rows.append([k, e["name"][:70], f"{med:,.0f}", f"±{100 * out[k]['spread']:.0f}%",
                     f"{e['predicted_samples_per_s']:,.0f}", f"{100 * (e['predicted_samples_per_s'] - med) / med:+.1f}%",
                     f"{100 * busy:.0f}%"])
    print(format_table(["run", "configuration", "measured samples/s (median)", "spread", "predicted", "pred. error",
                        "cross link busy"], rows, 2))
    for k, o in out.items():  # where the time goes, predicted against measured (rank 0's collectives)
        print(f"\n{k}: step {o['predicted_step_s']:.3f} s predicted, {o['measured_step_s']:.3f} s measured")
        print("  predicted: " + ", ".join(f"{n} {v:.3f}" for n, v in sorted(o["predicted_breakdown_s"].items(),
                                                                           key=lambda kv: -kv[1]) if v >= 1e-3))
        print("  measured collectives: " + ", ".join(f"{n} {v:.3f}" for n, v in sorted(
            o["measured_comm_s_per_step"].items(), key=lambda kv: -kv[1]) if v >= 1e-3))
    top, base = out["explorer top"], out["production-default"]
    per_turn = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(top["measured"], base["measured"])]
    gain_m = statistics.median(per_turn) - 1
    gain_p = top["predicted_samples_per_s"] / base["predicted_samples_per_s"] - 1
    pred_order = sorted(out, key=lambda k: -out[k]["predicted_samples_per_s"])
    meas_order = sorted(out, key=lambda k: -out[k]["measured_median"])
    verdict = {"measured_gain": gain_m, "measured_gain_per_turn": [g - 1 for g in per_turn], "predicted_gain": gain_p,
               "gain_points_apart": 100 * (gain_m - gain_p), "predicted_order": pred_order, "measured_order": meas_order,
               "order_agrees": pred_order == meas_order,
               "gain_spread_points": 100 * (max(per_turn) - min(per_turn)),
               "within_10_points": abs(gain_m - gain_p) <= 0.10}
    search = {"validated": d["search"], "unrestricted": rate,
              "candidates_per_minute": rate["candidates_per_minute"],
              "rate_at_least_10000": rate["candidates_per_minute"] >= 1e4,
              "within_budget": bool(d["search"].get("within_budget") and rate.get("within_budget"))}
    print(f"\nexplorer top vs production-default: measured gain {100 * gain_m:+.1f}% (per turn "
          f"{', '.join(f'{100 * (g - 1):+.0f}%' for g in per_turn)}), predicted {100 * gain_p:+.1f}%; "
          f"{verdict['gain_points_apart']:+.1f} points apart (acceptance: within 10)")
    print(f"order predicted {pred_order}; measured {meas_order}: {'agrees' if verdict['order_agrees'] else 'DISAGREES'}")
    for name, x in (("validated search", d["search"]), ("unrestricted search", rate)):
        print(f"{name}: {x['candidates_scored']:,} candidates, {x['candidates_per_minute']:,.0f} per minute scored, "
              f"{x['simulated']} simulated, {x['seconds']:.1f} s of a {x['time_budget_s']:g} s budget "
              f"({'within' if x['within_budget'] else 'OVER'})")
    if args.json:
        write_json(args.json, {"environment": environment(), "quick": args.quick, "turns": turns, "cluster": cluster,
                               "intra_mbit": args.intra_mbit, "cross_mbit": args.cross_mbit, "batch_size": args.batch_size,
                               "config": str(CONFIG.relative_to(ROOT)), "sets": sets,
                               "use_all_ranks": args.use_all_ranks, "max_auc_loss": args.max_auc_loss,
                               "seconds_per_run": seconds, "runs": out, **verdict, "search": search})
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
