"""What quantized checkpoints cost in accuracy: train on the real Criteo 10k sample
(``configs/criteo_10k.toml``), stop in the middle at a quantized checkpoint, resume from it, and
compare the final eval logloss and AUC with the uninterrupted run, per quantization and bit width.

    python benchmarks/checkpoint_accuracy.py [--json results/checkpoint_accuracy.json]
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
    args = ap.parse_args()
    apply_train_config_args(args)
    base = train_quietly(args.config, [])
    mid = base["steps"] // 2
    rows, results = [], []
    for codec in args.codecs.split(","):
        with tempfile.TemporaryDirectory() as d:
            common = [f"checkpoint.dir='{d}'", f"checkpoint.optimizer_state={args.state}"] + codec_sets(codec)
            train_quietly(args.config, common + [f"train.max_steps={mid}", f"checkpoint.interval_steps={mid}"])
            res = train_quietly(args.config, common + ["checkpoint.resume=latest", "checkpoint.at_end=false"])
        rel = (res["eval_logloss"] - base["eval_logloss"]) / base["eval_logloss"]
        results.append({"codec": codec, "eval_logloss": res["eval_logloss"], "eval_auc": res["eval_auc"], "logloss_rel_diff": rel})
        rows.append([codec, f"{res['eval_logloss']:.6f}", f"{100 * rel:+.4f}%", f"{res['eval_auc']:.5f}",
                     f"{res['eval_auc'] - base['eval_auc']:+.5f}"])
    print(f"uninterrupted: {base['steps']} steps, eval logloss {base['eval_logloss']:.6f}, auc {base['eval_auc']:.5f}; "
          f"restored from a checkpoint at step {mid} (optimizer state {args.state})")
    print(format_table(["checkpoint codec", "eval logloss", "vs uninterrupted", "eval auc", "auc diff"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "config": args.config, "middle_step": mid,
                               "uninterrupted": {k: base[k] for k in ("eval_logloss", "eval_auc", "steps")},
                               "state_precision": args.state, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
