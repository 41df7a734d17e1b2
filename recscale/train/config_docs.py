"""Writes docs/configuration.md from the config dataclasses: every key, its type and default.

    python -m recscale.train.config_docs            # rewrite docs/configuration.md
    python -m recscale.train.config_docs --check    # exit 1 when the file is stale

Keys, types and defaults come from the dataclasses themselves. A key's meaning is its entry in
``MEANINGS`` below when it has one (user-facing wording, or a comment shared by several fields),
else the comment above the field (or on its line) in its dataclass. A key with neither is an
error, so a new field cannot reach the docs undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from recscale.train.config import Config

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

SECTION_NOTES: dict[str, str] = {
    "data": "Where samples come from and how they are loaded. Reading formats and `recscale data "
            "prepare` are described in [data.md](data.md).",
    "model": "The DLRM: bottom MLP, one embedding table per sparse feature, interaction, top MLP.",
    "embedding_optimizer": "The sparse optimizer, fused into the embedding backward: only rows a "
                           "batch touched are updated, each once, in a fixed order.",
    "dense_optimizer": "A standard `torch.optim` optimizer for the MLPs.",
    "lr_schedule": "Both optimizers' configured rates times a factor of the step: a linear warmup, "
                   "then 1, then a polynomial decay (the shape of MLPerf's DLRM reference). The "
                   "factor depends on the step alone, so a resumed run follows the same schedule. "
                   "Off by default.",
    "train": "The loop: batch size, length, evaluation, seed, device.",
    "sharding": "How embedding tables are placed when more than one rank runs; see "
                "[distributed.md](distributed.md).",
    "comm": "Wire precision of the collectives between ranks.",
    "dist": "Process groups and transports between ranks.",
    "checkpoint": "Check-N-Run checkpoints; see [checkpointing.md](checkpointing.md).",
    "tiers": "Tables larger than memory: a RAM cache of hot rows over a file per table on an SSD; "
             "see [tiers.md](tiers.md). Off by default. On several ranks each rank's shard of a "
             "tiered table has its own file and cache, and the budget and cache sizes apply per rank.",
}

MEANINGS: dict[str, str] = {
    "data.source": "`synthetic`, `criteo_tsv` (raw Criteo Kaggle/1TB TSV, plain or gzip), "
                   "`criteo_encoded_csv`, or `prepared` (a directory from `recscale data prepare`)",
    "data.train_path": "training file (file sources) or directory (`prepared`); relative paths are "
                       "resolved from the current directory",
    "data.eval_path": "evaluation file or directory; empty: the last `eval_fraction` of the "
                      "training data is held out",
    "data.num_workers": "data-loader worker processes (0: load in the training process)",
    "data.skip_bad_rows": "count and skip malformed rows instead of stopping with an error naming "
                          "the file and line",
    "data.shuffle": "shuffle training samples each epoch (deterministic from `train.seed`)",
    "data.num_samples": "synthetic: training samples",
    "data.eval_samples": "synthetic: evaluation samples (a disjoint part of the same stream)",
    "data.pooling_factors": "synthetic: mean ids per sample for each table (one value: all tables; "
                            "empty: one-hot)",
    "data.zipf_alpha": "synthetic: skew of the id distribution",
    "data.shuffle_window": "prepared: samples shuffled together within a window (0: only the "
                           "row-group order is shuffled)",
    "data.prefetch": "prepared: chunks of batches each loader worker decodes ahead",
    "data.verify_checksums": "prepared: check every shard's SHA-256 against the manifest when the "
                             "data is opened",
    "model.embedding_dim": "dimension of every embedding table",
    "model.pooling": "pooling of each bag of ids",
    "model.embedding_dtype": "row storage precision (updates are computed in fp32)",
    "model.embedding_kernel": "`auto`: native C++ on the CPU where it builds, else torch; "
                              "`native`: error if it cannot be built; `torch`: pure PyTorch. The "
                              "environment variable `RECSCALE_EMBEDDING_KERNEL` overrides it; see "
                              "[native-kernels.md](native-kernels.md)",
    "model.bottom_mlp": "bottom MLP layer sizes; must end with `embedding_dim`",
    "model.top_mlp": "top MLP layer sizes; must end with 1 (the logit)",
    "model.mlp_precision": "`bf16` (opt-in): the MLPs and the interaction run bf16 matmuls "
                           "(autocast) with fp32 master weights, gradients and optimizer state; "
                           "embeddings and the loss stay fp32. Faster on CPUs with AVX-512 BF16 or "
                           "AMX; elsewhere bf16 matmuls are emulated, and the trainer warns",
    "embedding_optimizer.name": "row-wise Adagrad follows FBGEMM's definition; each optimizer is "
                                "defined once in `recscale/embedding/optimizers.py`",
    "embedding_optimizer.lr": "learning rate",
    "embedding_optimizer.eps": "Adagrad and Adam epsilon",
    "embedding_optimizer.beta1": "Adam's first-moment decay",
    "embedding_optimizer.beta2": "Adam's second-moment decay",
    "dense_optimizer.name": "optimizer of the MLP weights",
    "dense_optimizer.lr": "learning rate",
    "dense_optimizer.weight_decay": "L2 weight decay",
    "dense_optimizer.initial_accumulator_value": "Adagrad's starting sum of squares (torch's "
                                                 "default 0: a weight's first gradient, however "
                                                 "small, moves it by a full `lr`)",
    "dense_optimizer.eps": "Adagrad and Adam epsilon",
    "train.batch_size": "samples per step: the global batch, each rank takes its share",
    "train.epochs": "passes over the training data",
    "train.eval_batch_size": "samples per evaluation batch",
    "train.seed": "seeds weights, shuffling and synthetic data (unless data.seed is set); equal seeds give bitwise-equal runs",
    "train.device": "`auto`: CUDA when present, except with tables on the SSD tier (CPU only)",
    "train.progress": "show the progress bar",
    "sharding.default": "`auto`: the cost-model planner chooses type and ranks per table (tables "
                        "listed in `[sharding.tables]` keep their type); otherwise the type of "
                        "every table without its own entry",
    "sharding.plan": "a plan JSON file (`recscale train --plan FILE` sets it); replaces planning",
    "sharding.tables": "per-table settings, e.g. `[sharding.tables.t_C3]` with `type = "
                       "\"row_wise\"` (tables are named `t_` + feature name)",
    "sharding.tables.NAME.type": "this table's sharding type",
    "tiers.tables": "per-table placement, e.g. `[tiers.tables.t_C3]` with `placement = \"ssd\"` "
                    "and `cache_rows = 100000`; tables not listed go to the SSD tier only when "
                    "`ram_budget_mb` cannot hold them",
    "tiers.tables.NAME.placement": "`ram`: the whole table in memory; `ssd`: its file behind a cache",
    "tiers.tables.NAME.cache_rows": "rows of this table's RAM cache, on each rank holding a shard of it "
                                    "(at most the shard's rows; 0: a share of `ram_budget_mb`, by table size)",
    "dist.shared_memory": "on CPU, when every rank runs on one x86 host, embedding exchanges copy "
                          "through `/dev/shm` instead of gloo's TCP loopback; "
                          "`RECSCALE_SHARED_MEMORY=0` also turns it off",
    "checkpoint.policy": "`full`: everything each time; `one_shot`: a baseline, then everything "
                         "changed since it; `incremental`: a baseline, then what changed in the "
                         "last interval; `intermittent`: one_shot plus a new baseline when "
                         "`rebaseline`'s rule fires (Check-N-Run's default)",
    "checkpoint.quantization": "embedding rows on write: `none` (exact, storage dtype), `fp16`, "
                               "`bf16`, `uniform` (asymmetric per row, fp16 scale and offset), "
                               "`adaptive` (uniform on a range found by a greedy search that "
                               "shrinks [min, max]), `mixed` (uniform with 2, 3, 4 or 8 bits per "
                               "row, `bits` on average over a checkpoint's rows; the most to rows "
                               "of largest range^2 x root of the Adagrad state, which cost the "
                               "most loss)",
    "checkpoint.interval_steps": "checkpoint every this many steps (0: off)",
    "checkpoint.interval_minutes": "checkpoint every this many minutes; rank 0's clock decides for "
                                   "all ranks (0: off)",
    "checkpoint.rebaseline_fraction": "threshold of the `fraction` rule",
    "checkpoint.bits": "`uniform`/`adaptive`/`mixed`: 8, 4, 3 or 2 bits per value; 0: from "
                       "`expected_restores` (<= 1: 2, <= 3: 3, <= 20: 4, else 8)",
    "checkpoint.expected_restores": "how many times the job expects to restore (quantization "
                                    "error accumulates per restore)",
    "checkpoint.adaptive_bins": "`adaptive`: the range search steps by (max - min) / bins",
    "checkpoint.adaptive_ratio": "`adaptive`: the search shrinks at most this share of the range",
    "checkpoint.resume": "a checkpoint directory, a run folder (its newest), a root or `latest` (the "
                         "newest run's newest checkpoint under `dir`); empty: start fresh. `--resume` sets it",
}


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the ``#`` lines right above it, or on its line."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:", s)
        if m and not s.startswith(("def ", "@")):
            trailing = s.split("  # ", 1)[1].strip() if "  # " in s else ""
            text = " ".join(pending + [trailing]).strip()
            if text:
                out[m.group(1)] = text
        pending = []
    return out


def type_text(tp: Any) -> str:
    """A type as a TOML user reads it."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{_toml(v)}`" for v in typing.get_args(tp))
    if origin is list:
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if origin is dict:
        return "table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(a) for a in typing.get_args(tp))
    names = {bool: "bool", int: "int", float: "float", str: "string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        if len(v) > 4 and len(set(map(repr, v))) == 1:
            return f"[{_toml(v[0])}] x {len(v)}"
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{}" if not v else "{...}"
    return repr(v)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _rows(cls: type, prefix: str, missing: list[str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}.{f.name}", hints[f.name]
        meaning = MEANINGS.get(key) or comments.get(f.name, "")
        if not meaning:
            missing.append(key)
        rows.append(f"| `{f.name}` | {type_text(tp)} | `{_toml(_default(f))}` | {_cell(meaning)} |")
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            nested.append((key, typing.get_args(tp)[1]))
    for key, sub in nested:  # a table of tables: one row per key of each entry
        for f in dataclasses.fields(sub):
            name = f"{key}.NAME.{f.name}"
            meaning = MEANINGS.get(name) or field_comments(sub).get(f.name, "")
            if not meaning:
                missing.append(name)
            sub_tp = typing.get_type_hints(sub)[f.name]
            key_text = name.split(".", 1)[1]
            rows.append(f"| `{key_text}` | {type_text(sub_tp)} | `{_toml(_default(f))}` | {_cell(meaning)} |")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").rstrip(".")


def render() -> str:
    """The whole of docs/configuration.md."""
    missing: list[str] = []
    out = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m recscale.train.config_docs` from the config dataclasses; "
        "edit those, not this file. -->",
        "",
        "A config is a TOML file with the sections below; every key is optional and has the default "
        "shown. `--set section.key=value` overrides any key (values are TOML: "
        "`--set model.top_mlp=[128,1]`; a bare word is a string). An unknown key, a wrong type or a bad "
        "value is a one-line error naming the key, with exit status 2.",
        "",
        "```bash",
        "recscale train --config configs/synthetic.toml --set train.batch_size=2048 --set data.num_workers=2",
        "```",
    ]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        out += ["", f"## `[{f.name}]`", ""]
        if f.name in SECTION_NOTES:
            out += [SECTION_NOTES[f.name], ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        out += _rows(hints[f.name], f.name, missing)
    if missing:
        raise SystemExit(
            "config keys without a description: " + ", ".join(missing)
            + "; add a comment above the field (or an entry in recscale/train/config_docs.py MEANINGS)"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recscale.train.config_docs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file differs from the generated text")
    p.add_argument("--out", type=Path, default=DOC_PATH)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python -m recscale.train.config_docs", file=sys.stderr)
            return 1
        return 0
    from recscale.atomic import write_text_atomic

    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
