"""What quantized checkpoints cost in accuracy: train on the real Criteo 10k sample
(``configs/criteo_10k.toml``), stop in the middle at a quantized checkpoint, resume from it, and
compare the final eval logloss and AUC with the uninterrupted run, per quantization and bit width.
``--steps`` restores at other steps as well (one figure is one draw; see
``checkpoint_sensitivity.py``), ``--set`` changes the config for every run (e.g. train.seed=1).

    python benchmarks/checkpoint_accuracy.py [--steps mid,40,120] [--set KEY=VALUE ...] [--json results/checkpoint_accuracy.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    add_train_config_args, apply_train_config_args, environment, format_table, train_quietly, write_json,
)

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["none", "fp16", "adaptive8", "uniform8", "adaptive4", "uniform4", "adaptive3", "uniform3", "adaptive2", "uniform2"]


def codec_sets(codec: str) -> list[str]:
    for prefix in ("adaptive", "uniform"):
        if codec.startswith(prefix):
            return [f"checkpoint.quantization={prefix}", f"checkpoint.bits={codec[len(prefix):]}"]
    return [f"checkpoint.quantization={codec}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_train_config_args(ap, ROOT / "configs" / "criteo_10k.toml")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--state", default="fp32", help="optimizer state precision in the checkpoint")
    ap.add_argument("--steps", default="mid", help="restore steps, comma-separated ('mid': the middle step)")
    args = ap.parse_args()
    apply_train_config_args(args)
    base = train_quietly(args.config, args.set)
    mid = base["steps"] // 2
    steps = [mid if k.strip() == "mid" else int(k) for k in args.steps.split(",")]
    rows, results = [], []
    for step in steps:
        for codec in args.codecs.split(","):
            with tempfile.TemporaryDirectory() as d:
                common = args.set + [f"checkpoint.dir='{d}'", f"checkpoint.optimizer_state={args.state}"] + codec_sets(codec)
                train_quietly(args.config, common + [f"train.max_steps={step}", f"checkpoint.interval_steps={step}"])
                res = train_quietly(args.config, common + ["checkpoint.resume=latest", "checkpoint.at_end=false"])
            rel = (res["eval_logloss"] - base["eval_logloss"]) / base["eval_logloss"]
            results.append({"codec": codec, "restore_step": step, "eval_logloss": res["eval_logloss"],
                            "eval_auc": res["eval_auc"], "logloss_rel_diff": rel})
            rows.append([codec, str(step), f"{res['eval_logloss']:.6f}", f"{100 * rel:+.4f}%", f"{res['eval_auc']:.5f}",
                         f"{res['eval_auc'] - base['eval_auc']:+.5f}"])
    print(f"uninterrupted: {base['steps']} steps, eval logloss {base['eval_logloss']:.6f}, auc {base['eval_auc']:.5f}; "
          f"restored from a checkpoint at step {', '.join(map(str, steps))} (optimizer state {args.state})")
    print(format_table(["checkpoint codec", "step", "eval logloss", "vs uninterrupted", "eval auc", "auc diff"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "config": args.config, "overrides": args.set, "middle_step": mid,
                               "uninterrupted": {k: base[k] for k in ("eval_logloss", "eval_auc", "steps")},
                               "state_precision": args.state, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
