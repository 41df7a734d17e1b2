"""Check-N-Run checkpointing: bytes written, bytes stored, bytes read on restore, stall and
slowdown, per policy and quantization, against full fp32 checkpoints.

A synthetic DLRM (row-wise Adagrad tables of dim 128 as in MLPerf DLRM-DCNv2; small MLPs, so
embeddings are over 99% of the model as in production) trains on a fresh
Zipf id stream; the number of steps per interval is chosen from the stream's distribution so that
about 26% of rows change per interval (Check-N-Run's 30-minute figure), and every setting trains
the same batches for ``--intervals`` intervals, checkpointing after each one with the real
``recscale.checkpoint`` manager (background writes, retention keeping only what restoring the
latest checkpoint needs). Per setting:

- write reduction: bytes a full fp32 checkpoint of every row per interval writes / bytes this
  setting wrote (baselines leave out rows never updated since initialisation: a restore
  regenerates them from the seed, so they need no bytes);
- capacity reduction: one full fp32 checkpoint / the most this setting ever kept on disk;
- bytes read to restore the last checkpoint onto a fresh model, and the restored tables' relative
  L2 error;
- stall: the in-memory snapshot (training paused) as a share of training time; slowdown: wall
  time of the checkpointed run vs the same steps without checkpoints; train CPU: the training
  thread's CPU time vs that of the runs without checkpoints (snapshots included, waiting for a
  write slot not; it moves little with other load on the machine, wall time moves a lot).

``--paired A,B`` (two labels of one policy and state, different quantization) measures the
slowdown of B against A in one run instead of two: one model trains on the same batches and
writes one checkpoint chain whose codec alternates by whole cycles of the policy's kinds (a full
and the differentials after it) in A B B A order, so every position in the cycle is written in A
and B alike, a linear drift of the machine's speed cancels, and each codec's checkpoints follow
one another as in a run of that codec alone (``--paired-by checkpoint``: A B B A within each
cycle, and cycles alternating with their mirror). Each interval (its steps, the stall of the
save ending it, any wait for a write slot) is charged to the codec of the checkpoint at its
start, whose background work overlaps it; the first interval is left out. B - A per balanced
unit (pairs of cycles) is given in points of the no-checkpoint interval (runs of the same
batches before and after), with its standard error and 95% interval, on wall time, on the
training thread's CPU time and on the quantizing thread's CPU; the last checkpoint, its chain
mixing both codecs, is restored and its error reported. Adaptive keeps a row's last encoding
while the row is unchanged (no search) and starts other rows' searches from their last result;
both carry over a uniform checkpoint, but a row changed in any interval is searched again. The
first full of an adaptive cycle after a uniform one keeps fewer rows than in a run of adaptive
alone (the shares are printed per checkpoint): the comparison leans, if at all, against adaptive.

    python benchmarks/checkpoint.py                 # 8 tables x 100k rows x dim 128, 10 intervals
    python benchmarks/checkpoint.py --quick --json results/checkpoint.json
    python benchmarks/checkpoint.py --paired intermittent/uniform2/state-fp16,intermittent/adaptive2/state-fp16
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import environment, format_table, set_threads, write_json, zipf_batches  # noqa: E402

from recscale.checkpoint.manager import CheckpointManager  # noqa: E402
from recscale.checkpoint.quantize import Codec, make_codec, range_search  # noqa: E402
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards  # noqa: E402
from recscale.checkpoint.settings import CheckpointSettings  # noqa: E402
from recscale.checkpoint.shards import local_shards  # noqa: E402
from recscale.checkpoint.storage import LocalStorage  # noqa: E402
from recscale.checkpoint.tracker import RowTracker  # noqa: E402
from recscale.data import Batch  # noqa: E402
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig  # noqa: E402
from recscale.model import DLRM  # noqa: E402


@dataclass(frozen=True)
class Setting:
    policy: str
    quantization: str  # none, fp16, bf16, uniformN, adaptiveN, mixedN
    state: str = "fp32"

    @property
    def label(self) -> str:
        return f"{self.policy}/{self.quantization}/state-{self.state}"

    def settings(self, root: str, chunk_rows: int, max_in_flight: int = 1) -> CheckpointSettings:
        method, bits = self.quantization, ""
        for prefix in ("uniform", "adaptive", "mixed"):
            if self.quantization.startswith(prefix):
                method, bits = prefix, self.quantization[len(prefix):]
        return CheckpointSettings(
            dir=root, policy=self.policy, quantization=method, bits=int(bits) if bits else 0,  # type: ignore[arg-type]
            optimizer_state=self.state, keep_last=1, async_write=True,  # type: ignore[arg-type]
            max_in_flight=max_in_flight,
            chunk_rows=chunk_rows, at_end=False,
        )


SETTINGS = [  # uniform and adaptive of the same bit width write the same bytes; adaptive errs less
    Setting("full", "none"),
    Setting("one_shot", "none"),
    Setting("incremental", "none"),
    Setting("intermittent", "none"),
    Setting("intermittent", "fp16", "fp16"),
    Setting("intermittent", "uniform8", "fp16"),
    Setting("intermittent", "uniform4", "fp16"),
    Setting("intermittent", "uniform3", "fp16"),
    Setting("intermittent", "uniform2", "fp16"),
    Setting("intermittent", "adaptive2", "fp16"),
    # bf16 keeps row-wise Adagrad's small accumulators, which fp16 flushes toward its subnormals
    Setting("intermittent", "adaptive3", "bf16"),
    Setting("intermittent", "adaptive3", "fp32"),
    # 3 bits per value on average, per row 2 to 8 by the row's Adagrad state
    Setting("intermittent", "mixed3", "bf16"),
    Setting("one_shot", "uniform2", "fp16"),
    Setting("incremental", "uniform2", "fp16"),
]


# small: embeddings are over 99% of the model; mlperf: MLPerf DLRM's MLPs (a realistic step cost)
MLPS = {"small": ([64], [64, 1]), "mlperf": ([512, 256], [1024, 1024, 512, 256, 1])}


def steps_for_fraction(rows: int, alpha: float, lookups_per_step: int, target: float) -> int:
    """Steps after which the expected share of distinct rows drawn from the stream is ``target``."""
    e = 1.0 - alpha
    k = np.arange(rows, dtype=np.float64)
    cdf = (lambda v: np.log(v) / np.log(rows)) if abs(e) < 1e-9 else (lambda v: (v**e - 1.0) / (rows**e - 1.0))
    p = cdf(np.minimum(k + 2, rows)) - cdf(k + 1)
    p[-1] += 1.0 - p.sum()
    lo, hi = 1, 1 << 40
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if np.mean(-np.expm1(mid * np.log1p(-p))) < target else (lo, mid)
    return max(1, round(hi / lookups_per_step))


def make_batches(args, steps: int) -> list[Batch]:
    return zipf_batches(args.tables, args.rows, args.batch, args.alpha, steps)


def build(args):
    tables = [TableConfig(f"t{i}", args.rows, args.dim, (f"f{i}",)) for i in range(args.tables)]
    emb = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.05), seed=0)
    torch.manual_seed(0)
    bottom, top = MLPS[args.mlp]
    model = DLRM(emb, 13, bottom + [args.dim], top)
    opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.01)
    return model, opt


def step(model, opt, b: Batch) -> None:
    loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def train_only(args, batches, track: bool = False, cpu: list[float] | None = None,
               steps_per_interval: int = 0, intervals: list[tuple[float, float]] | None = None) -> float:
    """Seconds to train ``batches`` without checkpoints (``track``: with the row tracker on);
    the training thread's CPU seconds are appended to ``cpu``, and with ``steps_per_interval``
    each interval's (wall, CPU) seconds to ``intervals``."""
    model, opt = build(args)
    if track:
        RowTracker(local_shards(model.embeddings))
    t0, c0 = time.perf_counter(), time.thread_time()
    ti, ci = t0, c0
    for i, b in enumerate(batches, 1):
        step(model, opt, b)
        if intervals is not None and steps_per_interval and i % steps_per_interval == 0:
            t, c = time.perf_counter(), time.thread_time()
            intervals.append((t - ti, c - ci))
            ti, ci = t, c
    if cpu is not None:
        cpu.append(time.thread_time() - c0)
    return time.perf_counter() - t0


def dense_state(model, opt) -> bytes:
    """The rank's small state a checkpoint carries beside the tables: dense weights and optimizer."""
    buf = io.BytesIO()
    torch.save({"dense": {k: v.detach().clone() for k, v in model.named_parameters() if "embeddings" not in k},
                "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def restore_check(args, model, storage: LocalStorage, name: str) -> tuple:
    """Restore checkpoint ``name`` onto a fresh model: (read stats, seconds, the restored tables'
    relative L2 error against ``model``'s, the chain's manifests)."""
    fresh, _ = build(args)
    chain = load_chain(storage, load_manifest(storage, name))
    t1 = time.perf_counter()
    stats = restore_shards(storage, chain, local_shards(fresh.embeddings))
    seconds = time.perf_counter() - t1
    num = den = 0.0
    for t in model.embeddings.tables:
        a, b = model.embeddings.table_weight(t.name).double(), fresh.embeddings.table_weight(t.name).double()
        num += float((a - b).square().sum())
        den += float(a.square().sum())
    return stats, seconds, (num / den) ** 0.5, chain


def warm_share(r) -> float | None:
    """Share of an adaptive checkpoint's range-searched rows that started from an earlier search."""
    n = r.phases.get("searched_rows")
    return r.phases.get("warm_rows", 0) / n if n else None


def kept_share(r) -> float | None:
    """Share of an adaptive checkpoint's rows unchanged since their last encoding (no search)."""
    n = r.phases.get("searched_rows", 0) + r.phases.get("kept_rows", 0)
    return r.phases.get("kept_rows", 0) / n if n else None


def run_setting(args, s: Setting, batches, steps_per_interval: int, root: Path) -> dict:
    model, opt = build(args)
    shards = local_shards(model.embeddings)
    storage = LocalStorage(root)
    # seed 0: what build() initialises the tables with, so baselines leave out rows never updated
    settings = s.settings(str(root), args.chunk_rows, args.max_in_flight)
    manager = CheckpointManager(settings, storage, shards, init_seed=0)
    stalls, changed = [], []
    state_bytes = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    for i, b in enumerate(batches, 1):
        step(model, opt, b)
        if i % steps_per_interval == 0:
            state = dense_state(model, opt)
            state_bytes = len(state)
            stalls.append(manager.save(i, state, {"step": i, "embedding_step": i}))
    train_wall = time.perf_counter() - t0
    train_cpu = time.thread_time() - c0
    reports = manager.finish()
    drain = time.perf_counter() - t0 - train_wall
    written = [r.extra["bytes_written"] for r in reports]
    by_name = {r.name: r.extra["bytes_written"] for r in reports}
    stored_peak = max(sum(by_name[n] for n in r.extra["chain"]) for r in reports)
    # Restore the last checkpoint onto a fresh model: bytes read and error of the restored rows.
    stats, restore_s, error, _ = restore_check(args, model, storage, reports[-1].name)
    changed = [r.extra.get("rows_written", 0) for r in reports]
    return {
        "setting": s.label, "policy": s.policy, "quantization": s.quantization, "state": s.state,
        "kinds": [r.kind for r in reports], "bytes_written": written,
        "full_fp32_reference_bytes": reports[0].extra["full_fp32_bytes"] + state_bytes, "rows_written": changed,
        "changed_fraction": [r.extra["changed_fraction"] for r in reports],
        "bytes_written_total": sum(written), "stored_peak_bytes": stored_peak, "restore_bytes_read": stats.bytes_read,
        "restore_seconds": restore_s, "restored_rel_l2_error": error,
        "stall_seconds": stalls, "stall_total_s": sum(stalls), "train_wall_s": train_wall, "train_cpu_s": train_cpu,
        "drain_s": drain,
        "background_s": [r.background_s for r in reports],
        "warm_share": [warm_share(r) for r in reports], "kept_share": [kept_share(r) for r in reports],
    }


def parse_setting(label: str) -> Setting:
    parts = label.strip().split("/")
    if len(parts) != 3 or not parts[2].startswith("state-"):
        raise SystemExit(f"--paired: '{label}' is not a setting label policy/quantization/state-X "
                         "(e.g. intermittent/uniform2/state-fp16)")
    return Setting(parts[0], parts[1], parts[2][len("state-"):])


def abba(j: int) -> int:
    """0 (A) or 1 (B) for the ``j``-th of a sequence in blocks A B B A: a linear drift over a
    block and the order within it cancel in B - A."""
    return 0 if j % 4 in (0, 3) else 1


def paired_codec(cycle: int, position: int, by: str = "cycle") -> int:
    """The codec (0: A, 1: B) of the checkpoint at ``position`` in the ``cycle``-th run of
    checkpoints from a full one. The policy's kinds repeat with the cycle (intermittent: a full,
    then differentials growing until the next full), so each position gets A and B alike.
    ``by="cycle"``: whole cycles in one codec, A B B A over cycles, so a codec's checkpoints
    follow each other as in a run of that codec alone (adaptive keeps unchanged rows' encodings
    from its last checkpoint: after one of the other codec it could keep fewer);
    ``by="checkpoint"``: within a cycle the codecs go A B B A, and cycles alternate with their
    mirror B A A B in A B B A order (every position A B B A over four cycles, whatever the
    cycle's length). Without fulls after the first (one_shot, incremental) every checkpoint is
    in cycle 0, so only ``by="checkpoint"`` alternates: A B B A along the chain."""
    if by == "cycle":
        return abba(cycle)
    return abba(cycle) ^ abba(position)


# two-sided 95% quantiles of Student's t by degrees of freedom (between entries: the next lower, wider)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00}


def mean_ci(xs: list[float]) -> dict:
    """Mean, standard error and 95% interval (Student's t) of ``xs``."""
    n = len(xs)
    m = float(np.mean(xs)) if n else float("nan")
    if n < 2:
        return {"n": n, "mean": m, "se": float("nan"), "ci95": [float("nan"), float("nan")]}
    se = float(np.std(xs, ddof=1) / np.sqrt(n))
    half = _T975[max(k for k in _T975 if k <= n - 1)] * se
    return {"n": n, "mean": m, "se": se, "ci95": [m - half, m + half]}


def run_paired(args, pair: tuple[Setting, Setting], batches, spi: int, root: Path) -> dict:
    """One model, one training run, one checkpoint chain; each checkpoint is written in the codec
    of ``pair[paired_codec(cycle, position)]``, its place in the policy's cycle known before the
    save (``next_kind``). Interval ``j`` (the steps after checkpoint ``j - 1``, the stall of the
    save ending it, its wait for a write slot) is charged to checkpoint ``j - 1``'s codec: its
    background quantization and writing overlap that interval."""
    model, opt = build(args)
    storage = LocalStorage(root)
    # Without fulls after the first, every checkpoint is in cycle 0: alternate per checkpoint.
    by = args.paired_by if pair[0].policy == "intermittent" else "checkpoint"
    settings = pair[0].settings(str(root), args.chunk_rows, args.max_in_flight)
    manager = CheckpointManager(settings, storage, local_shards(model.embeddings), init_seed=0)
    codecs = []
    for s in pair:  # each setting's codec as the manager would build it for this model
        cs = s.settings(str(root), args.chunk_rows)
        cs.validate()
        codecs.append(make_codec(cs.quantization, manager.weight_codec.dtype, cs.effective_bits, cs.adaptive_bins,
                                 cs.adaptive_ratio))
    intervals: list[dict] = []
    order: list[tuple[int, int, int]] = []  # per checkpoint: its cycle, position in it, codec
    cycle = position = -1
    t_prev, c_prev = time.perf_counter(), time.thread_time()
    for i, b in enumerate(batches, 1):
        step(model, opt, b)
        if i % spi == 0:
            j = i // spi - 1
            # The kind this save will write (the policy's rule; the codec does not enter it).
            cycle, position = (cycle + 1, 0) if manager.next_kind() == "full" else (cycle, position + 1)
            order.append((cycle, position, paired_codec(cycle, position, by)))
            stall = manager.save(i, dense_state(model, opt), {"step": i, "embedding_step": i},
                                 weight_codec=codecs[order[-1][2]])
            t, c = time.perf_counter(), time.thread_time()
            intervals.append({"interval": j, "wall_s": t - t_prev, "cpu_s": c - c_prev, "stall_s": stall,
                              "codec": None if j == 0 else order[j - 1][2]})
            t_prev, c_prev = t, c
    reports = sorted(manager.finish(), key=lambda r: r.step)
    stats, restore_s, error, chain = restore_check(args, model, storage, reports[-1].name)
    checkpoints = [{"checkpoint": j, "cycle": order[j][0], "position": order[j][1], "codec": order[j][2],
                    "kind": r.kind, "bytes_written": r.bytes_written, "rows_written": r.rows_written,
                    "background_s": r.background_s, "encode_thread_cpu_s": r.phases.get("encode_thread_cpu_s"),
                    "warm_share": warm_share(r), "kept_share": kept_share(r), "phases": r.phases}
                   for j, r in enumerate(reports)]
    if [c["kind"] == "full" for c in checkpoints] != [c["position"] == 0 for c in checkpoints]:
        raise RuntimeError("--paired: a checkpoint's kind differs from the one announced before its save")
    return {"pair": [s.label for s in pair], "paired_by": by, "codecs": [c.name for c in codecs],
            "intervals": intervals,
            "checkpoints": checkpoints, "restore_bytes_read": stats.bytes_read, "restore_seconds": restore_s,
            "restored_rel_l2_error": error,
            "restored_chain_codecs": [Codec.from_dict(m.weight_codec).name for m in chain]}


def paired_units(checkpoints: list[dict]) -> tuple[list[list[int]], str]:
    """The checkpoints (each charged with the interval after it) grouped into units with as many
    A as B: pairs of whole cycles (each position once in A, once in B) when there are at least two
    such pairs, else A B B A blocks of four positions within a cycle."""
    charged = checkpoints[:-1]  # the last one has no interval after it
    cycles: dict[int, list[int]] = {}
    for c in charged:
        cycles.setdefault(c["cycle"], []).append(c["checkpoint"])
    whole = [k for k in cycles if k + 1 in cycles or k + 1 == checkpoints[-1]["cycle"]]
    pairs = [cycles[k] + cycles[k + 1] for k in whole if k % 2 == 0 and k + 1 in whole]
    if len(pairs) >= 2:
        return pairs, "cycle pairs"
    blocks: dict[tuple[int, int], list[int]] = {}
    for c in charged:
        blocks.setdefault((c["cycle"], c["position"] // 4), []).append(c["checkpoint"])
    return [v for v in blocks.values() if len(v) == 4], "blocks of four"


def paired_summary(run: dict, base_wall: float, base_cpu: float) -> dict:
    """Per codec the mean interval; B - A per unit (``paired_units``) in points of slowdown
    (100 x seconds / the no-checkpoint interval), its mean, standard error and 95% interval."""
    cks = run["checkpoints"]
    units, unit_kind = paired_units(cks)
    after = {iv["interval"] - 1: iv for iv in run["intervals"][1:]}  # checkpoint -> the interval it is charged
    used = sorted(j for u in units for j in u)
    out: dict = {"units": units, "unit_kind": unit_kind, "base_interval_wall_s": base_wall,
                 "base_interval_cpu_s": base_cpu, "codecs": []}

    def enc(j: int) -> float:
        return cks[j]["encode_thread_cpu_s"] or 0.0

    for which in (0, 1):
        mine = [j for j in used if cks[j]["codec"] == which]
        shares = [cks[j]["warm_share"] for j in mine if cks[j]["warm_share"] is not None]
        kept = [cks[j]["kept_share"] for j in mine if cks[j]["kept_share"] is not None]
        out["codecs"].append({
            "setting": run["pair"][which], "codec": run["codecs"][which], "intervals": len(mine),
            "fulls": sum(cks[j]["kind"] == "full" for j in mine),
            "rows_written": float(np.mean([cks[j]["rows_written"] for j in mine])) if mine else None,
            "wall_s": float(np.mean([after[j]["wall_s"] for j in mine])) if mine else None,
            "cpu_s": float(np.mean([after[j]["cpu_s"] for j in mine])) if mine else None,
            "encode_thread_cpu_s": float(np.mean([enc(j) for j in mine])) if mine else None,
            "background_s": float(np.mean([cks[j]["background_s"] for j in mine])) if mine else None,
            "warm_share": float(np.mean(shares)) if shares else None,
            "kept_share": float(np.mean(kept)) if kept else None,
        })
    for key, base in (("wall", base_wall), ("cpu", base_cpu)):
        diffs = [100.0 * float(np.mean([after[j][f"{key}_s"] for j in u if cks[j]["codec"] == 1])
                               - np.mean([after[j][f"{key}_s"] for j in u if cks[j]["codec"] == 0])) / base
                 for u in units]
        out[f"{key}_points_per_unit"] = diffs
        out[f"{key}_points"] = mean_ci(diffs)
    # The quantizing thread's CPU per checkpoint, in points of the training thread's interval: the
    # slowdown it would cost if it took training's core rather than a spare one (little noise).
    enc_diffs = [100.0 * float(np.mean([enc(j) for j in u if cks[j]["codec"] == 1])
                               - np.mean([enc(j) for j in u if cks[j]["codec"] == 0])) / base_cpu for u in units]
    out["encode_cpu_points_per_unit"] = enc_diffs
    out["encode_cpu_points"] = mean_ci(enc_diffs)
    return out


def paired_main(args, batches, spi: int) -> int:
    labels = [x for x in args.paired.split(",") if x.strip()]
    if len(labels) != 2:
        raise SystemExit(f"--paired: expected two setting labels A,B, got {len(labels)}")
    a, b = (parse_setting(x) for x in labels)
    if (a.policy, a.state) != (b.policy, b.state) or a.quantization == b.quantization:
        raise SystemExit(f"--paired: A and B must share policy and state and differ in quantization, got "
                         f"{a.label} and {b.label}")
    if args.intervals < 5:
        raise SystemExit(f"--paired: --intervals must be at least 5 (one A B B A block after the first), "
                         f"got {args.intervals}")
    train_only(args, batches[:2])  # untimed: a first use compiles the native kernels
    base_ivs: list[tuple[float, float]] = []
    base_runs = [train_only(args, batches, steps_per_interval=spi, intervals=base_ivs)]
    work = Path(tempfile.mkdtemp(prefix="recscale-ckpt-paired-"))
    try:
        run = run_paired(args, (a, b), batches, spi, work / "paired")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base_runs.append(train_only(args, batches, steps_per_interval=spi, intervals=base_ivs))
    # Each baseline run's first interval left out, as the paired run's is.
    n = args.intervals
    kept = base_ivs[1:n] + base_ivs[n + 1 :]
    base_wall, base_cpu = float(np.mean([w for w, _ in kept])), float(np.mean([c for _, c in kept]))
    summary = paired_summary(run, base_wall, base_cpu)
    if not summary["units"]:
        raise SystemExit("--paired: no unit with as many A as B intervals; raise --intervals")
    rows = []
    for c in summary["codecs"]:
        rows.append([
            c["setting"], f"{c['intervals']} ({c['fulls']} full)", f"{c['rows_written']:,.0f}", f"{c['wall_s']:.3f}",
            f"{100 * (c['wall_s'] / base_wall - 1):+.1f}%", f"{c['cpu_s']:.3f}",
            f"{100 * (c['cpu_s'] / base_cpu - 1):+.1f}%", f"{c['background_s']:.3f}", f"{c['encode_thread_cpu_s']:.3f}",
            "-" if c["warm_share"] is None else f"{100 * c['warm_share']:.0f}%",
            "-" if c["kept_share"] is None else f"{100 * c['kept_share']:.0f}%",
        ])
    print(format_table(["setting (checkpoint at interval start)", "intervals", "rows written", "wall s", "slowdown",
                        "thread CPU s", "CPU increase", "background s", "encode CPU s", "warm of searched",
                        "kept rows"], rows))

    def line(x: dict) -> str:
        return f"{x['mean']:+.2f} points (SE {x['se']:.2f}, 95% [{x['ci95'][0]:+.2f}, {x['ci95'][1]:+.2f}])"

    print(f"B - A ({run['codecs'][1]} - {run['codecs'][0]}) per unit, {len(summary['units'])} {summary['unit_kind']}, "
          f"in points of the no-checkpoint interval ({base_wall:.3f} s wall, {base_cpu:.3f} s thread CPU): "
          f"wall {line(summary['wall_points'])}; thread CPU {line(summary['cpu_points'])}; quantizing thread's "
          f"CPU per checkpoint (of the training thread's interval) {line(summary['encode_cpu_points'])}")
    ws = [f"{run['codecs'][c['codec']]}:{c['kind'][0]}"
          + ("" if c["warm_share"] is None else f" {100 * c['kept_share']:.0f}%/{100 * c['warm_share']:.0f}%")
          for c in run["checkpoints"]]
    print("checkpoints (codec:kind, adaptive rows kept / searched rows warm): " + ", ".join(ws))
    chain = run["restored_chain_codecs"]
    print(f"restored the last checkpoint (chain of {len(chain)}: "
          f"{', '.join(f'{chain.count(c)} {c}' for c in run['codecs'] if c in chain)}): "
          f"relative L2 error {run['restored_rel_l2_error']:.2e}, {run['restore_bytes_read'] / 1e6:,.1f} MB read; "
          f"training without checkpoints before/after: {base_runs[0]:.2f} / {base_runs[1]:.2f} s")
    if args.json:
        write_json(args.json, {
            "environment": environment(), "args": vars(args), "steps_per_interval": spi,
            "baseline_train_s": base_runs, "baseline_intervals": [{"wall_s": w, "cpu_s": c} for w, c in base_ivs],
            "paired": run, "summary": summary,
        })
    return 0


def quantizer_throughput(dim: int, rows: int = 32768, repeats: int = 3) -> list[dict]:
    """Each row codec's encode rate on one thread (MB of fp32 rows per second per core): the
    writer quantizes on one background thread. Adaptive is timed with its native range search
    and with the PyTorch definition (same codes; on an eighth of the rows, it is slow), and warm:
    each row's search starting from its result on the rows before a small change. Per
    second of the thread's CPU time (steady on a shared machine) and of wall time, best of
    ``repeats``."""
    x = torch.randn(rows, dim) * torch.rand(rows, 1) * 0.05
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        cases = [("uniform", b, True) for b in (2, 3, 4, 8)] + [("adaptive", b, True) for b in (2, 3, 4, 8)]
        for method, bits, native in cases + [("adaptive", b, False) for b in (2, 3, 4)]:
            codec = Codec(method, bits=bits)
            block = x if native else x[: max(rows // 8, 1)]
            if not native:
                os.environ["RECSCALE_NATIVE_QUANTIZE"] = "0"  # read on every call: the PyTorch search
            try:
                codec.encode(x[:256])  # untimed: a first use builds the native kernel
                seconds = cpu = float("inf")
                for _ in range(repeats):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    codec.encode(block)
                    seconds, cpu = min(seconds, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
            finally:
                if not native:
                    os.environ.pop("RECSCALE_NATIVE_QUANTIZE", None)
            out.append({"codec": codec.name + ("" if native else " (PyTorch)"),
                        "mb_per_s_per_core": block.numel() * 4 / cpu / 1e6,
                        "mb_per_wall_s": block.numel() * 4 / seconds / 1e6})
        # Warm: the rows changed a little since a first search (as between checkpoints), each
        # search starting from the row's last result.
        moved = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) * x.std(1, keepdim=True) * 0.05
        for bits in (2, 3, 4):
            codec = Codec("adaptive", bits=bits)
            last = range_search(x, bits, codec.bins, codec.ratio)[2]
            seconds = cpu = float("inf")
            for _ in range(repeats):
                start = last.clone()
                t0, c0 = time.perf_counter(), time.thread_time()
                codec.encode(moved, ranges=start)
                seconds, cpu = min(seconds, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
            out.append({"codec": codec.name + " warm", "mb_per_s_per_core": x.numel() * 4 / cpu / 1e6,
                        "mb_per_wall_s": x.numel() * 4 / seconds / 1e6})
    finally:
        torch.set_num_threads(saved)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model and batch, for a smoke run")
    ap.add_argument("--tables", type=int)
    ap.add_argument("--rows", type=int, help="rows per table")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--mlp", choices=sorted(MLPS), default="small",
                    help="small (embeddings dominate the model) or mlperf (MLPerf DLRM's MLPs: longer steps)")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the id stream")
    ap.add_argument("--target", type=float, default=0.26, help="share of rows changing per interval")
    ap.add_argument("--intervals", type=int,
                    help="checkpoint intervals (default 10; with --paired 41, --quick --paired 9)")
    ap.add_argument("--paired", metavar="A,B",
                    help="two labels of one policy and state, different quantization: one run whose checkpoints "
                         "alternate A B B A; prints B - A per block in points of slowdown with its 95%% interval")
    ap.add_argument("--paired-by", choices=("cycle", "checkpoint"), default="cycle",
                    help="--paired: alternate whole cycles of the policy (a full and its differentials; default), "
                         "or checkpoints within each cycle")
    ap.add_argument("--chunk-rows", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=1,
                    help="training threads (default 1: the checkpoint writer uses the other core, as Check-N-Run "
                         "uses spare host cores)")
    ap.add_argument("--interleave-baselines", action="store_true",
                    help="time the no-checkpoint baseline between settings too (steadier slowdown figures)")
    ap.add_argument("--settings", help="comma-separated subset of labels (policy/quantization/state-X)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the chosen settings this many times in turn (interleaved: load shared with other "
                         "processes falls on every setting alike); the mean slowdown per setting is printed")
    ap.add_argument("--max-in-flight", type=int, default=1,
                    help="checkpoints being written at once; the next snapshot waits for a slot "
                         "(checkpoint.max_in_flight)")
    ap.add_argument("--quantizer-only", action="store_true", help="print the quantizers' encode rates and stop")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--model", choices=["synthetic", "criteo-dlrm"], default="synthetic",
                    help="criteo-dlrm: 26 x 1M x dim 64 with row-wise Adagrad, checkpointed every --interval-min "
                         "minutes for --duration-min minutes against the disk's sequential write rate")
    ap.add_argument("--interval-min", type=float, help="criteo-dlrm: minutes between checkpoints (default 5)")
    ap.add_argument("--duration-min", type=float, help="criteo-dlrm: minutes of training (default 20)")
    ap.add_argument("--span-s", type=float,
                    help="criteo-dlrm: seconds of each alternating span with and without checkpoints "
                         "(default 20, at most half an interval)")
    ap.add_argument("--disk-probe-gb", type=float, default=0.0,
                    help="criteo-dlrm: size of every disk probe; 0 (default): as large as the checkpoint it is "
                         "compared with")
    ap.add_argument("--disk-probe-min-gb", type=float,
                    help="criteo-dlrm: a probe beside a full checkpoint writes at least this much (default 4)")
    ap.add_argument("--probe-differentials", action="store_true",
                    help="criteo-dlrm: probe the disk around differential checkpoints too (default: full ones)")
    ap.add_argument("--write-mode", choices=["direct", "stream", "buffered"], default="direct",
                    help="criteo-dlrm: direct (direct I/O where the file system takes it, the default), stream "
                         "(page cache, handed to the disk as written) or buffered (page cache, one fsync at the "
                         "end); the probes write the same way")
    ap.add_argument("--dir", help="criteo-dlrm: where to write (default a temporary folder)")
    ap.add_argument("--skip-initial-rows", action="store_true",
                    help="criteo-dlrm: full checkpoints leave out rows still at their initial values (the "
                         "training default); without it every row is written, the heaviest case for the disk")
    args = ap.parse_args()
    if args.model == "criteo-dlrm":
        return _model_sized(args)
    defaults = dict(tables=4, rows=20_000, dim=64, batch=512) if args.quick else dict(tables=8, rows=100_000, dim=128, batch=4096)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.intervals is None:
        args.intervals = (9 if args.quick else 41) if args.paired else 10
    threads = set_threads(args.threads)
    if args.quantizer_only:
        quant = quantizer_throughput(args.dim)
        print(f"quantizer encode rate, rows of dim {args.dim}, one thread, MB per CPU second (wall): "
              + ", ".join(f"{q['codec']} {q['mb_per_s_per_core']:,.0f} ({q['mb_per_wall_s']:,.0f})" for q in quant))
        if args.json:
            write_json(args.json, {"environment": environment(), "args": vars(args),
                                   "quantizer_mb_per_s_per_core": quant})
        return 0
    spi = steps_for_fraction(args.rows, args.alpha, args.batch, args.target)
    total = spi * args.intervals
    batches = make_batches(args, total)
    if args.paired:
        print(f"{args.tables} tables x {args.rows:,} rows x dim {args.dim}, batch {args.batch}, Zipf {args.alpha}: "
              f"{spi} steps per interval (expected {args.target:.0%} of rows changed), {args.intervals} intervals, "
              f"{threads} training thread(s), {args.mlp} MLPs; paired {args.paired}")
        return paired_main(args, batches, spi)
    chosen = SETTINGS if not args.settings else [s for s in SETTINGS if s.label in args.settings.split(",")]
    print(f"{args.tables} tables x {args.rows:,} rows x dim {args.dim}, batch {args.batch}, Zipf {args.alpha}: "
          f"{spi} steps per interval (expected {args.target:.0%} of rows changed), {args.intervals} intervals, "
          f"{threads} training thread(s), {args.mlp} MLPs")
    quant = quantizer_throughput(args.dim)
    print("quantizer encode rate, one thread, MB per CPU second (wall): "
          + ", ".join(f"{q['codec']} {q['mb_per_s_per_core']:,.0f} ({q['mb_per_wall_s']:,.0f})" for q in quant))
    train_only(args, batches[:2])  # untimed: a first use compiles the native kernels
    base_cpu: list[float] = []  # the training thread's CPU seconds: steadier than wall time under load
    bases = [train_only(args, batches, cpu=base_cpu)]
    results = []
    work = Path(tempfile.mkdtemp(prefix="recscale-ckpt-bench-"))
    try:
        for i, s in enumerate(chosen * max(args.repeat, 1)):
            root = work / s.label.replace("/", "_")
            results.append(run_setting(args, s, batches, spi, root))
            results[-1]["repeat"] = i // len(chosen)
            shutil.rmtree(root, ignore_errors=True)
            if args.interleave_baselines:
                bases.append(train_only(args, batches, cpu=base_cpu))
                results[-1]["baseline_s"] = (bases[-2] + bases[-1]) / 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not args.interleave_baselines:
        bases.append(train_only(args, batches, cpu=base_cpu))
    tracked = train_only(args, batches, track=True)
    base = float(np.mean(bases))
    # The reference: a full fp32 checkpoint of every row and its optimizer state, plus the dense
    # state file (what full/none writes when no row is left out as never updated).
    full_ckpt = results[0]["full_fp32_reference_bytes"] if results else None
    rows = []
    for r in results:
        r["write_reduction"] = full_ckpt * len(r["bytes_written"]) / r["bytes_written_total"] if full_ckpt else None
        r["capacity_reduction"] = full_ckpt / r["stored_peak_bytes"] if full_ckpt else None
        r["stall_share"] = r["stall_total_s"] / r["train_wall_s"]
        r["slowdown"] = r["train_wall_s"] / r.get("baseline_s", base) - 1.0
        # CPU time the training thread spent (training and snapshots; not waiting for a slot)
        r["train_cpu_increase"] = r["train_cpu_s"] / float(np.mean(base_cpu)) - 1.0
        rows.append([
            r["setting"] + (f" #{r['repeat']}" if args.repeat > 1 else ""), "".join(k[0].upper() if k == "full" else k[0] for k in r["kinds"]),
            f"{r['bytes_written_total'] / 1e6:,.1f}", f"{r['write_reduction']:.1f}x" if full_ckpt else "-",
            f"{r['stored_peak_bytes'] / 1e6:,.1f}", f"{r['capacity_reduction']:.1f}x" if full_ckpt else "-",
            f"{r['restore_bytes_read'] / 1e6:,.1f}", f"{r['restored_rel_l2_error']:.1e}",
            f"{100 * r['stall_share']:.2f}%", f"{100 * r['slowdown']:+.1f}%", f"{100 * r['train_cpu_increase']:+.1f}%",
        ])
    print(format_table(
        ["setting", "kinds", "written MB", "write red.", "stored MB", "capacity red.", "restore read MB",
         "restore err", "stall", "slowdown", "train CPU"], rows))
    if args.repeat > 1:
        for s in chosen:
            mine = [r for r in results if r["setting"] == s.label]
            print(f"{s.label}: mean over {len(mine)} runs: slowdown {100 * np.mean([r['slowdown'] for r in mine]):+.1f}%, "
                  f"stall {100 * np.mean([r['stall_share'] for r in mine]):.2f}%, "
                  f"training thread CPU {100 * np.mean([r['train_cpu_increase'] for r in mine]):+.1f}%")
    for r in results:
        if any(w is not None for w in r["warm_share"]):
            print(f"{r['setting']}: rows searched warm per checkpoint: "
                  + ", ".join("-" if w is None else f"{100 * w:.0f}%" for w in r["warm_share"]))
    inc = next((r for r in results if r["policy"] == "incremental"), None)
    if inc:
        per = inc["changed_fraction"][1:]
        print(f"rows changed per interval (measured by the tracker): mean {100 * np.mean(per):.1f}%, "
              f"range {100 * min(per):.1f}-{100 * max(per):.1f}%")
    one = next((r for r in results if r["policy"] == "one_shot"), None)
    if one:
        print(f"rows changed since the first baseline after {len(one['changed_fraction']) - 1} intervals: "
              f"{100 * one['changed_fraction'][-1]:.1f}%")
    print(f"training without checkpoints: {', '.join(f'{b:.2f}' for b in bases)} s "
          f"(training thread CPU {', '.join(f'{c:.2f}' for c in base_cpu)} s; "
          f"{total} steps); with the modified-row tracker alone: {tracked:.2f} s ({100 * (tracked / base - 1):+.2f}%); "
          "kinds: F full, d differential, i incremental")
    if args.json:
        write_json(args.json, {
            "environment": environment(), "args": vars(args), "steps_per_interval": spi,
            "baseline_train_s": bases, "baseline_train_cpu_s": base_cpu, "quantizer_mb_per_s_per_core": quant,
            "tracked_train_s": tracked, "full_fp32_checkpoint_bytes": full_ckpt, "results": results,
        })
    return 0


def _model_sized(args) -> int:
    import _checkpoint_model_sized

    full = dict(tables=26, rows=1_000_000, dim=64, batch=2048, interval_min=5.0, duration_min=20.0, disk_probe_min_gb=4.0)
    # --quick: seconds, for a smoke run (the same code paths at a few MB)
    quick = dict(tables=4, rows=20_000, dim=64, batch=256, interval_min=0.05, duration_min=0.2, disk_probe_min_gb=0.0)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    threads = set_threads(args.threads)
    print(f"criteo-dlrm: {args.tables} tables x {args.rows:,} rows x dim {args.dim}, row-wise Adagrad, batch "
          f"{args.batch}, {threads} training thread(s); a checkpoint every {args.interval_min:g} min for "
          f"{args.duration_min:g} min")
    result = _checkpoint_model_sized.run(args)
    if args.json:
        write_json(args.json, {"environment": environment(), "args": vars(args), **result})
    return 0 if result["resume_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
