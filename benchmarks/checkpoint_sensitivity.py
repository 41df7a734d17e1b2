"""How sensitive the final eval logloss of ``configs/criteo_10k.toml`` is to perturbing the
training state in the middle: the scale against which the accuracy cost of a quantized
checkpoint (``checkpoint_accuracy.py``) must be read.

Trains uninterrupted, writes a lossless checkpoint at the middle step, then resumes from it many
times, each time perturbing the restored state before training on (relative Gaussian noise of a
given size, or rounding, applied to the embedding rows (all, or only the rows updated so far, or
only the rows still at their initial values), their optimizer state, the dense parameters or the
dense optimizer state), and reports each final eval logloss against the uninterrupted run. With
``--codec-steps`` it also restores at several middle steps through 8-bit quantization of the
updated rows, of the rows themselves and of their change since initialisation, against noise of
1e-6 and 1e-5, to show how much of a single figure is chance.

    python benchmarks/checkpoint_sensitivity.py [--quick] [--set KEY=VALUE ...] [--json results/checkpoint_sensitivity.json]  # ~5 min
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (  # noqa: E402
    add_train_config_args, apply_train_config_args, environment, format_table, train_quietly, write_json,
)

from recscale.checkpoint.quantize import make_codec  # noqa: E402
from recscale.embedding.table_batched import init_rows  # noqa: E402
from recscale.train import checkpointing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Perturb = Callable[[checkpointing.TrainCheckpointing], None]
_PERTURB: list[Perturb | None] = [None]
_restore = checkpointing.TrainCheckpointing.restore


def _restore_then_perturb(self):  # type: ignore[no-untyped-def]
    """The real restore, then the experiment's perturbation of what it restored."""
    progress = _restore(self)
    if _PERTURB[0] is not None:
        with torch.no_grad():
            _PERTURB[0](self)
    return progress


checkpointing.TrainCheckpointing.restore = _restore_then_perturb  # type: ignore[method-assign]


def rows_of(ck: checkpointing.TrainCheckpointing, which: str):
    """Per table: (weight view, state views, initial rows, mask of the rows ``which`` selects)."""
    seed = int(ck.fingerprint["seed"])  # train.seed: the initial rows are a function of it
    for s in ck.shards:
        w = s.module.table_weight(s.local_name)
        init = init_rows(s.table, seed, s.row_offset, s.num_rows, s.col_offset, s.num_cols)
        updated = (w != init).any(1)
        mask = {"all": torch.ones_like(updated), "updated": updated, "initial": ~updated}[which]
        yield w, s.module.table_state(s.local_name), init, mask


def noise(part: str, which: str, eps: float, seed: int) -> Perturb:
    def f(ck: checkpointing.TrainCheckpointing) -> None:
        g = torch.Generator().manual_seed(seed)

        def mul(t: torch.Tensor, mask: torch.Tensor | None = None) -> None:
            n = torch.randn(t.shape, generator=g) * eps
            if mask is not None:
                n[~mask] = 0
            t.mul_(1 + n)

        if part == "emb":
            for w, _, _, mask in rows_of(ck, which):
                mul(w, mask)
        elif part == "emb-state":
            for _, st, _, _ in rows_of(ck, "all"):
                for t in st.values():
                    mul(t)
        elif part == "dense":
            for k, p in ck.model.named_parameters():
                if not k.startswith("embeddings."):
                    mul(p.data)
        else:
            for st in ck.dense_opt.state.values():
                for t in st.values():
                    if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0:
                        mul(t)
    return f


def rounding(dtype: torch.dtype, which: str) -> Perturb:
    def f(ck: checkpointing.TrainCheckpointing) -> None:
        for w, _, _, mask in rows_of(ck, which):
            w[mask] = w[mask].to(dtype).float()
    return f


RMS: dict[str, float] = {}


def quantize_updated(bits: int, delta: bool) -> Perturb:
    """8-bit per-row quantization of the updated rows (of their change since init: ``delta``)."""
    codec = make_codec("uniform", "fp32", bits)

    def f(ck: checkpointing.TrainCheckpointing) -> None:
        num = den = 0.0
        for w, _, init, mask in rows_of(ck, "updated"):
            if not bool(mask.any()):
                continue
            x = w[mask]
            ref = init[mask] if delta else torch.zeros_like(x)
            y = codec.decode(codec.encode(x - ref), x.shape[0], x.shape[1]) + ref
            num += float((y - x).double().square().sum())
            den += float(x.double().square().sum())
            w[mask] = y
        RMS["last"] = (num / den) ** 0.5
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_train_config_args(ap, ROOT / "configs" / "criteo_10k.toml")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: the lossless restore and one noise size, no 1- and 2-thread floor")
    ap.add_argument("--seeds", type=int, default=2, help="noise draws per size")
    ap.add_argument("--codec-steps", default="40,60,70,78,90,100,120",
                    help="restore steps for the 8-bit codec comparison ('' to skip)")
    args = ap.parse_args()
    apply_train_config_args(args)

    def summary(overrides: list[str]) -> dict:
        return train_quietly(args.config, args.set + overrides)

    def run(overrides: list[str]) -> float:
        return summary(overrides)["eval_logloss"]

    first = summary([])
    base = first["eval_logloss"]
    # The run-to-run floor (the same run on 1 and 2 threads) is two more full runs: the full
    # study's scale, left out of a smoke run.
    floor = None if args.quick else (run(["train.threads=1"]), run(["train.threads=2"]))
    results: list[dict] = []

    def experiment(label: str, mid: int, d: str, perturb: Perturb | None) -> None:
        _PERTURB[0] = perturb
        RMS.clear()
        ll = run([f"checkpoint.dir='{d}'", "checkpoint.resume=latest", "checkpoint.at_end=false"])
        _PERTURB[0] = None
        results.append({"experiment": label, "restore_step": mid, "eval_logloss": ll,
                        "logloss_rel_diff": (ll - base) / base, "quant_rel_rms_error": RMS.get("last")})

    # Every checkpoint goes under one folder, removed when the script ends (also on an error).
    work = tempfile.TemporaryDirectory(prefix="recscale-sens-")

    def checkpoint_at(mid: int) -> str:
        d = tempfile.mkdtemp(prefix="ckpt-", dir=work.name)
        run([f"checkpoint.dir='{d}'", f"train.max_steps={mid}", f"checkpoint.interval_steps={mid}"])
        return d

    mid = first["steps"] // 2
    d = checkpoint_at(mid)
    experiment("lossless restore", mid, d, None)
    sizes = [1e-6] if args.quick else [1e-7, 1e-6, 1e-5, 1e-4, 1e-3]
    seeds = range(1 if args.quick else args.seeds)
    for eps in sizes:
        for s in seeds:
            for part, which in ([("emb", "all")] if args.quick else
                                [("emb", "all"), ("emb", "updated"), ("emb", "initial"), ("emb-state", "all"),
                                 ("dense", "all"), ("dense-opt", "all")]):
                name = part if part != "emb" else f"emb rows ({which})"
                experiment(f"noise {eps:g} on {name}, draw {s}", mid, d, noise(part, which, eps, s))
    if not args.quick:
        for dt, dn in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            for which in ("updated", "initial"):
                experiment(f"{dn} rounding of emb rows ({which})", mid, d, rounding(dt, which))
        for k in [int(x) for x in args.codec_steps.split(",") if x]:
            dk = checkpoint_at(k)
            experiment("uint8 updated rows", k, dk, quantize_updated(8, False))
            experiment("uint8 updated rows, change since init", k, dk, quantize_updated(8, True))
            experiment("noise 1e-6 on emb rows (updated)", k, dk, noise("emb", "updated", 1e-6, 0))
            experiment("noise 1e-5 on emb rows (updated)", k, dk, noise("emb", "updated", 1e-5, 0))

    print(f"uninterrupted: eval logloss {base!r}, AUC {first['eval_auc']:.5f}"
          + (f"; the same run with 1 and 2 threads: {floor[0]!r}, {floor[1]!r}" if floor else ""))
    rows = [[r["experiment"], str(r["restore_step"]), f"{r['eval_logloss']:.6f}", f"{100 * r['logloss_rel_diff']:+.4f}%",
             f"{r['quant_rel_rms_error']:.2e}" if r["quant_rel_rms_error"] is not None else ""] for r in results]
    print(format_table(["perturbation at the restore", "step", "eval logloss", "vs uninterrupted", "rel rms err"], rows))
    if args.json:
        write_json(args.json, {"environment": environment(), "config": args.config, "overrides": args.set,
                               "uninterrupted": base, "uninterrupted_auc": first["eval_auc"],
                               "threads_1_2": list(floor) if floor else None, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
