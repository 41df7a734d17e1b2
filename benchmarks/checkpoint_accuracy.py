"""What quantized checkpoints cost in accuracy: stop a run at a quantized checkpoint, resume from
it, and compare the final eval logloss with the uninterrupted run, per quantization and bit width.

``--case synthetic`` (``configs/checkpoint_accuracy.toml``): a planted model, 1M samples, 1,024
steps. The data stays fixed while ``train.seed`` varies, and the seed-to-seed spread of the final
eval logloss (the sample standard deviation over ``--spread-seeds`` uninterrupted runs) is the
scale each codec's change is read against. Per codec and seed, one run writes checkpoints with
the given policy at ``--points`` equally spaced steps (1/4, 1/2, 3/4 of the run), and a resume
from each runs to the end. ``none`` (fp32 rows and state) must change nothing, bitwise.

``--case criteo`` (``configs/criteo_10k.toml``, 157 steps): one checkpoint at the middle step
(``--steps`` for others); one figure is one draw (see ``checkpoint_sensitivity.py``).

    python benchmarks/checkpoint_accuracy.py --case synthetic [--codecs none,adaptive3:fp32] [--jobs 2] [--json PATH]
    python benchmarks/checkpoint_accuracy.py --case criteo [--steps mid,40,120] [--set KEY=VALUE ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    add_train_config_args, apply_train_config_args, environment, format_table, train_quietly, write_json,
)

ROOT = Path(__file__).resolve().parents[1]
PER_CASE = "(per case)"  # --config default: configs/checkpoint_accuracy.toml or configs/criteo_10k.toml
CODECS = ["none", "fp16", "adaptive8", "uniform8", "adaptive4", "uniform4", "adaptive3", "uniform3", "adaptive2", "uniform2"]
SYNTHETIC_CODECS = ["none", "fp16", "uniform4", "adaptive4", "uniform3", "adaptive3", "uniform2", "adaptive2"]


def codec_sets(codec: str) -> list[str]:
    for prefix in ("adaptive", "uniform", "mixed"):
        if codec.startswith(prefix):
            return [f"checkpoint.quantization={prefix}", f"checkpoint.bits={codec[len(prefix):]}"]
    return [f"checkpoint.quantization={codec}"]


# ---------------------------------------------------------------------- synthetic case
def uninterrupted(config: str, overrides: list[str], seed: int) -> dict:
    res = train_quietly(config, overrides + [f"train.seed={seed}"])
    return {k: res[k] for k in ("eval_logloss", "eval_auc", "steps")}


def restores(config: str, overrides: list[str], codec: str, state: str, policy: str, seed: int,
             points: list[int]) -> list[dict]:
    """One run writing checkpoints at ``points`` (equally spaced), then a resume from each.
    ``codec`` may name its optimizer state precision after a colon (``adaptive3:fp32``)."""
    label = codec
    codec, _, own_state = codec.partition(":")
    state = "fp32" if codec == "none" else own_state or state  # none: the exact checkpoint
    common = overrides + [f"train.seed={seed}"]
    out = []
    with tempfile.TemporaryDirectory(prefix="recscale-acc-") as d:
        train_quietly(config, common + codec_sets(codec) + [
            f"checkpoint.dir='{d}/write'", f"checkpoint.interval_steps={points[0]}", f"train.max_steps={points[-1]}",
            f"checkpoint.policy={policy}", f"checkpoint.optimizer_state={state}", "checkpoint.keep_last=0",
            "checkpoint.at_end=false",
        ])
        for p in points:
            found = sorted(Path(d, "write").glob(f"*/step{p:010d}"))
            if len(found) != 1:
                raise RuntimeError(f"expected one checkpoint at step {p} under {d}/write, found {len(found)}")
            res = train_quietly(config, common + [
                f"checkpoint.dir='{d}/resume'", f"checkpoint.resume='{found[0]}'", "checkpoint.at_end=false",
            ])
            out.append({"codec": label, "state": state, "policy": policy, "seed": seed, "restore_step": p,
                        "eval_logloss": res["eval_logloss"], "eval_auc": res["eval_auc"]})
    return out


def synthetic(args) -> int:
    seeds = list(range(args.seeds))
    spread_seeds = list(range(max(args.spread_seeds, args.seeds)))
    codecs = args.codecs.split(",") if args.codecs else SYNTHETIC_CODECS
    state = args.state or "bf16"
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        base_f = {s: pool.submit(uninterrupted, args.config, args.set, s) for s in spread_seeds}
        steps = base_f[0].result()["steps"]
        points = [steps * (i + 1) // (args.points + 1) for i in range(args.points)]
        if any(p != points[0] * (i + 1) for i, p in enumerate(points)):
            raise SystemExit(f"{steps} steps do not split into {args.points + 1} equal parts; change --points")
        jobs = [pool.submit(restores, args.config, args.set, c, state, args.policy, s, points) for c in codecs for s in seeds]
        base = {s: f.result() for s, f in base_f.items()}
        results = [r for j in jobs for r in j.result()]
    ll = [base[s]["eval_logloss"] for s in spread_seeds]
    mean_ll = statistics.fmean(ll)
    spread = statistics.stdev(ll) / mean_ll if len(ll) > 1 else float("nan")
    for r in results:
        b = base[r["seed"]]
        r["logloss_rel_diff"] = (r["eval_logloss"] - b["eval_logloss"]) / b["eval_logloss"]
        r["bitwise_equal"] = r["eval_logloss"] == b["eval_logloss"] and r["eval_auc"] == b["eval_auc"]
    print(f"uninterrupted ({steps} steps), eval logloss per seed: "
          + ", ".join(f"{s}: {base[s]['eval_logloss']:.6f} (auc {base[s]['eval_auc']:.5f})" for s in spread_seeds))
    print(f"seed-to-seed spread (sample std / mean over {len(ll)} seeds): {100 * spread:.4f}%; "
          f"range {100 * (max(ll) - min(ll)) / mean_ll:.4f}%")
    print(f"restores at steps {', '.join(map(str, points))} x seeds {seeds}; policy {args.policy}, optimizer state {state} "
          "(none: fp32); change of the final eval logloss vs the same seed uninterrupted")
    rows, summary = [], []
    for c in codecs:
        mine = [r for r in results if r["codec"] == c]
        rel = [r["logloss_rel_diff"] for r in mine]
        mean, mean_abs, worst = statistics.fmean(rel), statistics.fmean(abs(x) for x in rel), max(abs(x) for x in rel)
        within = sum(abs(x) < spread for x in rel)
        summary.append({"codec": c, "mean_rel": mean, "mean_abs_rel": mean_abs, "max_abs_rel": worst,
                        "within_spread": within, "count": len(rel), "bitwise_equal": all(r["bitwise_equal"] for r in mine)})
        cells = [f"{100 * next(r['logloss_rel_diff'] for r in mine if r['seed'] == s and r['restore_step'] == p):+.4f}%"
                 for s in seeds for p in points]
        rows.append([c, *cells, f"{100 * mean:+.4f}%", f"{100 * mean_abs:.4f}%", f"{within}/{len(rel)}",
                     "yes" if summary[-1]["bitwise_equal"] else "no"])
    heads = [f"s{s}@{p}" for s in seeds for p in points]
    print(format_table(["codec", *heads, "mean", "mean |.|", "|.| < spread", "bitwise"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "case": "synthetic", "config": args.config,
                               "overrides": args.set, "points": points, "seeds": seeds, "policy": args.policy,
                               "state_precision": state, "uninterrupted": {str(s): base[s] for s in spread_seeds},
                               "spread_rel_std": spread, "summary": summary, "results": results})
    return 0


# ---------------------------------------------------------------------- Criteo case
def criteo(args) -> int:
    base = train_quietly(args.config, args.set)
    mid = base["steps"] // 2
    steps = [mid if k.strip() == "mid" else int(k) for k in args.steps.split(",")]
    state = args.state or "fp32"
    rows, results = [], []
    for step in steps:
        for codec in (args.codecs or ",".join(CODECS)).split(","):
            with tempfile.TemporaryDirectory() as d:
                common = args.set + [f"checkpoint.dir='{d}'", f"checkpoint.optimizer_state={state}"] + codec_sets(codec)
                train_quietly(args.config, common + [f"train.max_steps={step}", f"checkpoint.interval_steps={step}"])
                res = train_quietly(args.config, common + ["checkpoint.resume=latest", "checkpoint.at_end=false"])
            rel = (res["eval_logloss"] - base["eval_logloss"]) / base["eval_logloss"]
            results.append({"codec": codec, "restore_step": step, "eval_logloss": res["eval_logloss"],
                            "eval_auc": res["eval_auc"], "logloss_rel_diff": rel})
            rows.append([codec, str(step), f"{res['eval_logloss']:.6f}", f"{100 * rel:+.4f}%", f"{res['eval_auc']:.5f}",
                         f"{res['eval_auc'] - base['eval_auc']:+.5f}"])
    print(f"uninterrupted: {base['steps']} steps, eval logloss {base['eval_logloss']:.6f}, auc {base['eval_auc']:.5f}; "
          f"restored from a checkpoint at step {', '.join(map(str, steps))} (optimizer state {state})")
    print(format_table(["checkpoint codec", "step", "eval logloss", "vs uninterrupted", "eval auc", "auc diff"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "case": "criteo", "config": args.config, "overrides": args.set,
                               "middle_step": mid, "uninterrupted": {k: base[k] for k in ("eval_logloss", "eval_auc", "steps")},
                               "state_precision": state, "results": results})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=["criteo", "synthetic"], default="criteo")
    add_train_config_args(ap, Path(PER_CASE))
    ap.add_argument("--codecs", default="", help="comma-separated (default: every codec of the case)")
    ap.add_argument("--state", default="", help="optimizer state precision in the checkpoint (criteo: fp32, synthetic: bf16)")
    ap.add_argument("--steps", default="mid", help="criteo: restore steps, comma-separated ('mid': the middle step)")
    ap.add_argument("--policy", default="intermittent", help="synthetic: the checkpoint policy")
    ap.add_argument("--points", type=int, default=3, help="synthetic: restore points, equally spaced")
    ap.add_argument("--seeds", type=int, default=3, help="synthetic: training seeds restored at every point")
    ap.add_argument("--spread-seeds", type=int, default=5, help="synthetic: uninterrupted runs measuring the spread")
    ap.add_argument("--jobs", type=int, default=1, help="synthetic: runs at once, in processes")
    args = ap.parse_args()
    if args.config == PER_CASE:
        args.config = str(ROOT / "configs" / ("checkpoint_accuracy.toml" if args.case == "synthetic" else "criteo_10k.toml"))
    apply_train_config_args(args)
    return synthetic(args) if args.case == "synthetic" else criteo(args)


if __name__ == "__main__":
    sys.exit(main())
