"""Benchmark: recscale's fused table-batched embedding operator against plain PyTorch.

Times, per training iteration, the pooled lookup (forward), the backward pass with the
embedding update (backward+update) and both together (total) of

  * recscale   ``TableBatchedEmbeddingBags``: one operator for all tables, the sparse
                optimizer fused into ``loss.backward()``, native C++ kernels (``auto``: the
                torch kernels if the native ones cannot be built here, said in the notes);
  * recscale_torch  the same operator on its pure-PyTorch kernels (``kernel="torch"``);
  * plain      one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, outputs
                concatenated, sparse gradients applied by a ``torch.optim`` optimizer
                (``SGD``; ``Adagrad`` for both Adagrad variants, since torch has no row-wise
                Adagrad; ``SparseAdam`` for adam);
  * fbgemm     FBGEMM's CPU table-batched operator (``SplitTableBatchedEmbeddingBagsCodegen``,
                host memory, exact row-wise Adagrad / SGD), only when ``fbgemm_gpu`` imports.

Configs: ``criteo`` (26 one-hot features, Criteo Kaggle row counts capped at 1M, dim 64) and
``multi-hot`` (MLPerf DLRM-DCNv2 pooling factors, 214 ids per sample, rows capped at 500k,
dim 128). Ids follow a Zipf-like power law, fixed seed, several batches cycled.

    python benchmarks/embedding_op.py                     # criteo, row-wise Adagrad
    python benchmarks/embedding_op.py --config all --json results/embedding_op.json
    python benchmarks/embedding_op.py --quick             # a few seconds, smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # recscale from this checkout when not installed
from _common import environment, fmt_ms, format_table, set_threads, time_phases, write_json, zipf_ids  # noqa: E402

from recscale.embedding import native  # noqa: E402
from recscale.embedding.config import TableConfig  # noqa: E402
from recscale.embedding.optimizers import make_optimizer  # noqa: E402
from recscale.embedding.table_batched import TableBatchedEmbeddingBags  # noqa: E402
from recscale.sparse import JaggedBatch  # noqa: E402

TABLES_JSON = Path(__file__).resolve().parents[1].parent / "shared/data/tables/criteo_table_sizes.json"

# Built-in copies, used when the shared JSON is absent (same numbers, same sources).
CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
MLPERF_DCNV2_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
MLPERF_DCNV2_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]

OPTIMIZER_CHOICES = ("sgd", "rowwise_adagrad", "adagrad", "adam")
LR = 0.01
EPS = 1e-8
SEED = 1234
NUM_BATCHES = 4  # distinct id batches cycled through


@dataclass
class BenchConfig:
    name: str
    rows: list[int]  # after capping
    pooling: list[int]  # ids per sample of each feature
    dim: int
    batch_size: int
    row_cap: int
    source: str


def load_table_json() -> tuple[dict[str, Any] | None, str]:
    try:
        with open(TABLES_JSON) as f:
            return json.load(f), str(TABLES_JSON)
    except (OSError, ValueError):
        return None, "built-in copy (shared JSON not found)"


def make_config(name: str, batch_size: int | None, quick: bool) -> BenchConfig:
    data, source = load_table_json()
    if name == "criteo":
        rows = data["criteo_kaggle_dac"]["rows"] if data else CRITEO_KAGGLE_ROWS
        pooling, dim, cap, default_b = [1] * len(rows), 64, 1_000_000, 2048
    elif name == "multi-hot":
        d = data["mlperf_dlrm_dcnv2"] if data else None
        rows = d["rows"] if d else MLPERF_DCNV2_ROWS
        pooling = list(d["pooling_factors"]) if d else MLPERF_DCNV2_POOLING
        dim, cap, default_b = (int(d.get("embedding_dim", 128)) if d else 128), 500_000, 2048
    else:
        raise ValueError(f"unknown config {name!r}")
    if quick:
        cap, default_b = 10_000, 256
    b = batch_size if batch_size is not None else default_b
    return BenchConfig(name, [min(int(r), cap) for r in rows], pooling, dim, b, cap, source)


def make_batches(cfg: BenchConfig, n: int) -> list[JaggedBatch]:
    """``n`` distinct key-major jagged batches with fixed pooling factors and Zipf ids."""
    rng = np.random.default_rng(SEED)
    keys = tuple(f"f{k}" for k in range(len(cfg.rows)))
    out = []
    for _ in range(n):
        vals = [
            zipf_ids(rows, cfg.batch_size * pf, rng, salt=k) for k, (rows, pf) in enumerate(zip(cfg.rows, cfg.pooling))
        ]
        lengths = np.repeat(np.asarray(cfg.pooling, dtype=np.int64), cfg.batch_size)
        out.append(JaggedBatch(keys, torch.from_numpy(np.concatenate(vals)), torch.from_numpy(lengths)))
    return out


# --------------------------------------------------------------------------- implementations


def bench_recscale(cfg, batches, grads, opt_name, iters, warmup, kernel="auto"):
    tables = [TableConfig(f"t{k}", rows, cfg.dim, features=(f"f{k}",)) for k, rows in enumerate(cfg.rows)]
    opt = make_optimizer(opt_name, lr=LR, **({} if opt_name == "sgd" else {"eps": EPS}))
    model = TableBatchedEmbeddingBags(tables, opt, seed=SEED, kernel=kernel)
    n = len(batches)

    def forward(i):
        return model(batches[i % n])

    def backward(i, out):
        out.backward(grads[i % n])

    used = "native" if model._native_kernels(model.groups[0]) is not None else "torch"
    if kernel == "auto" and used == "torch":
        used += f" (native unavailable: {native.failure()})"
    return time_phases(forward, backward, iters, warmup), f"TableBatchedEmbeddingBags, {used} kernels, {opt.name} fused"


def bench_recscale_torch(cfg, batches, grads, opt_name, iters, warmup):
    return bench_recscale(cfg, batches, grads, opt_name, iters, warmup, kernel="torch")


def bench_plain(cfg, batches, grads, opt_name, iters, warmup):
    bags = nn.ModuleList()
    for rows in cfg.rows:
        bag = nn.EmbeddingBag(rows, cfg.dim, mode="sum", sparse=True)
        a = 1.0 / rows**0.5
        with torch.no_grad():
            bag.weight.uniform_(-a, a)
        bags.append(bag)
    params = list(bags.parameters())
    if opt_name == "sgd":
        opt, desc = torch.optim.SGD(params, lr=LR), "torch.optim.SGD"
    elif opt_name in ("rowwise_adagrad", "adagrad"):
        opt = torch.optim.Adagrad(params, lr=LR, eps=EPS)
        desc = "torch.optim.Adagrad (element-wise" + ("; torch has no row-wise Adagrad)" if opt_name != "adagrad" else ")")
    else:
        opt, desc = torch.optim.SparseAdam(params, lr=LR, eps=EPS), "torch.optim.SparseAdam"
    # Per-table (ids, offsets) split from the jagged batches ahead of time, outside the
    # timed region (this favours the baseline: recscale is handed the raw jagged batch).
    split = []
    for jb in batches:
        per = []
        for k in jb.keys:
            vals, lens = jb[k]
            offs = torch.zeros(lens.numel(), dtype=torch.int64)
            torch.cumsum(lens[:-1], 0, out=offs[1:])
            per.append((vals.contiguous(), offs))
        split.append(per)
    n = len(batches)

    def forward(i):
        return torch.cat([bag(v, o) for bag, (v, o) in zip(bags, split[i % n])], dim=1)

    def backward(i, out):
        out.backward(grads[i % n])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return time_phases(forward, backward, iters, warmup), f"{len(bags)} x nn.EmbeddingBag(sparse) + {desc}"


def bench_fbgemm(cfg, batches, grads, opt_name, iters, warmup):
    """FBGEMM CPU operator; raises on absence or API mismatch (caller reports it)."""
    import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe

    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice, EmbeddingLocation
    except ImportError:
        ComputeDevice, EmbeddingLocation = tbe.ComputeDevice, tbe.EmbeddingLocation
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType

    kinds = {"rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD, "sgd": OptimType.EXACT_SGD}
    if opt_name not in kinds:
        raise RuntimeError(f"no FBGEMM CPU optimizer for {opt_name} in this benchmark")
    specs = [(rows, cfg.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in cfg.rows]
    kw = {} if opt_name == "sgd" else {"eps": EPS}
    emb = tbe.SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=kinds[opt_name], learning_rate=LR, **kw)
    # Same key-major layout as JaggedBatch: all ids of table 0, then table 1, ...
    inputs = [(jb.values, jb.offsets()) for jb in batches]
    n = len(batches)

    def forward(i):
        return emb(*inputs[i % n])

    def backward(i, out):
        out.backward(grads[i % n])

    return time_phases(forward, backward, iters, warmup), f"SplitTableBatchedEmbeddingBagsCodegen CPU, {opt_name}"


# --------------------------------------------------------------------------- driver


def run_config(cfg: BenchConfig, opt_name: str, iters: int, warmup: int, fbgemm: bool) -> dict[str, Any]:
    batches = make_batches(cfg, NUM_BATCHES)
    gen = torch.Generator().manual_seed(SEED)
    out_dim = cfg.dim * len(cfg.rows)
    grads = [torch.randn(cfg.batch_size, out_dim, generator=gen) for _ in range(NUM_BATCHES)]
    results: dict[str, Any] = {}
    notes: list[str] = []
    impls = [("recscale", bench_recscale), ("recscale_torch", bench_recscale_torch), ("plain_pytorch", bench_plain)]
    if fbgemm:
        impls.append(("fbgemm", bench_fbgemm))
    for name, fn in impls:
        try:
            times, desc = fn(cfg, batches, grads, opt_name, iters, warmup)
        except ImportError as e:
            if name != "fbgemm":
                raise
            notes.append(f"fbgemm: not installed ({e})")
            continue
        except Exception as e:  # noqa: BLE001 - optional comparison: report, never fail
            if name != "fbgemm":
                raise
            notes.append(f"fbgemm: skipped, {type(e).__name__}: {e}")
            continue
        finally:
            gc.collect()
        times["samples_per_s"] = cfg.batch_size / (times["total"]["median"] / 1e3)
        times["description"] = desc
        results[name] = times
    base = results["recscale"]
    ratios = {}
    for name, r in results.items():
        if name == "recscale":
            continue
        ratios[name] = {ph: r[ph]["median"] / base[ph]["median"] for ph in ("forward", "backward_update", "total")}
    return {
        "config": cfg.name,
        "optimizer": opt_name,
        "batch_size": cfg.batch_size,
        "num_tables": len(cfg.rows),
        "dim": cfg.dim,
        "row_cap": cfg.row_cap,
        "total_rows": sum(cfg.rows),
        "ids_per_sample": sum(cfg.pooling),
        "table_source": cfg.source,
        "iters": iters,
        "warmup": warmup,
        "results": results,
        "ratio_vs_recscale": ratios,
        "notes": notes,
    }


TABLE_HEADERS = (
    "config", "impl", "forward ms", "bwd+update ms", "total ms", "samples/s",
    "fwd x", "bwd+upd x", "total x",
)  # fmt: skip


def table_rows(rep: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in rep["results"].items():
        ratio = rep["ratio_vs_recscale"].get(name)
        rx = ["1.00", "1.00", "1.00"] if ratio is None else [f"{ratio[p]:.2f}" for p in ("forward", "backward_update", "total")]
        rows.append(
            [rep["config"], name, fmt_ms(r["forward"]), fmt_ms(r["backward_update"]), fmt_ms(r["total"]),
             f"{r['samples_per_s']:,.0f}", *rx]
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("criteo", "multi-hot", "all"), default="criteo")
    p.add_argument("--batch-size", type=int, default=None, help="samples per batch (default 2048; 256 with --quick)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 30; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up iterations (default 5; 1 with --quick)")
    p.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="rowwise_adagrad")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="tiny run (rows capped at 10,000, few iterations)")
    p.add_argument("--no-fbgemm", action="store_true", help="skip the optional FBGEMM comparison")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    a = p.parse_args(argv)
    iters = a.iters if a.iters is not None else (3 if a.quick else 30)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 5)
    if iters < 1 or warmup < 0 or (a.batch_size is not None and a.batch_size < 1):
        p.error("--iters must be >= 1, --warmup >= 0 and --batch-size >= 1")
    threads = set_threads(a.threads)
    # torch.optim.Adagrad builds sparse tensors without invariant checks and says so once.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    torch.manual_seed(SEED)

    names = ["criteo", "multi-hot"] if a.config == "all" else [a.config]
    reports = []
    print(
        f"embedding_op: torch {torch.__version__}, {threads} threads, optimizer {a.optimizer}, "
        f"{warmup} warm-up + {iters} timed iterations{' (quick)' if a.quick else ''}"
    )
    for name in names:
        cfg = make_config(name, a.batch_size, a.quick)
        print(
            f"[{name}] {len(cfg.rows)} tables, {sum(cfg.rows):,} rows (cap {cfg.row_cap:,}), dim {cfg.dim}, "
            f"{sum(cfg.pooling)} ids/sample, batch {cfg.batch_size}; tables from {cfg.source}",
            flush=True,
        )
        reports.append(run_config(cfg, a.optimizer, iters, warmup, fbgemm=not a.no_fbgemm))

    print()
    print(format_table(TABLE_HEADERS, [r for rep in reports for r in table_rows(rep)], right_align_from=2))
    print()
    print("times: median [min-max] ms per iteration; 'x' columns: impl time / recscale time (>1: recscale faster)")
    for rep in reports:
        ratio = rep["ratio_vs_recscale"].get("fbgemm")
        if ratio is not None:
            verdict = "at least as fast" if min(ratio["forward"], ratio["backward_update"]) >= 1.0 else "SLOWER"
            print(
                f"  {rep['config']}: recscale vs FBGEMM: forward {ratio['forward']:.2f}x, backward+update "
                f"{ratio['backward_update']:.2f}x -> {verdict}"
            )
    for rep in reports:
        for name, r in rep["results"].items():
            print(f"  {rep['config']}/{name}: {r['description']}")
        for note in rep["notes"]:
            print(f"  {rep['config']}: {note}")
    if a.json is not None:
        write_json(a.json, {"benchmark": "embedding_op", "environment": environment(), "args": {
            "config": a.config, "batch_size": a.batch_size, "iters": iters, "warmup": warmup,
            "optimizer": a.optimizer, "threads": threads, "quick": a.quick}, "configs": reports})  # fmt: skip
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
