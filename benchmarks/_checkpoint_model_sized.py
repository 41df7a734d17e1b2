"""``benchmarks/checkpoint.py --model criteo-dlrm``: Check-N-Run at a model-sized state.

26 tables x 1M rows x dim 64 with row-wise Adagrad (about 7 GB of rows and state), one-hot
Criteo-like ids (Zipf), MLPs 512-256-64 / 512-256-1. Training runs for ``--duration-min``
minutes with a checkpoint every ``--interval-min`` minutes (intermittent differential, exact
rows: full baselines and differentials), and as long again without checkpoints, in alternating
spans so that both see the same machine. It reports:

- this disk's sequential write rate (a file of ``--disk-probe-gb`` written and fsynced);
- each checkpoint's kind, bytes (every row of a full checkpoint unless ``--skip-initial-rows``), stall (the in-memory snapshot) and write rate (bytes / seconds
  its background write took), against the disk's rate;
- the training slowdown: the time the spans with checkpoints took beyond what their steps take
  at the rate without checkpoints, per checkpoint, as a share of the checkpoint interval (what
  a run checkpointing every interval loses);
- resume: the last checkpoint restored onto a fresh model equals the trained model bit for bit.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import format_table, zipf_batches

from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.restore import load_chain, load_manifest, restore_shards
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage
from recscale.data import Batch
from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.model import DLRM

POOL = 64  # distinct batches, cycled: generating ids every step would cost more than training


def disk_write_rate(root: Path, nbytes: int, block: int = 16 << 20) -> float:
    """Bytes per second of one sequential write of ``nbytes`` ending in fsync (file removed)."""
    buf = os.urandom(block)
    path = root / "disk-probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // block)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return max(1, nbytes // block) * block / seconds


def build(args):
    tables = [TableConfig(f"t{i}", args.rows, args.dim, (f"f{i}",)) for i in range(args.tables)]
    emb = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.05), seed=0)
    torch.manual_seed(0)
    model = DLRM(emb, 13, [512, 256, args.dim], [512, 256, 1])
    return model, torch.optim.Adagrad(model.dense_parameters(), lr=0.01)


def batches(args) -> list[Batch]:
    return zipf_batches(args.tables, args.rows, args.batch, args.alpha, POOL)


def _step(model, opt, b: Batch) -> None:
    loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _dense_state(model, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"dense": {k: v.detach().clone() for k, v in model.named_parameters() if "embeddings" not in k},
                "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def run(args) -> dict:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="recscale-ckpt-model-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        disk = disk_write_rate(root, int(args.disk_probe_gb * (1 << 30)))
        print(f"disk sequential write: {disk / 1e6:,.0f} MB/s ({args.disk_probe_gb} GB, fsynced)")
        data = batches(args)
        model, opt = build(args)
        for b in data[:2]:  # untimed: a first use compiles the native kernels
            _step(model, opt, b)
        settings = CheckpointSettings(dir=str(root / "ckpt"), policy="intermittent", quantization="none",
                                      keep_last=1, async_write=True, max_in_flight=1, at_end=False)
        manager = CheckpointManager(settings, LocalStorage(root / "ckpt"), local_shards(model.embeddings),
                                    init_seed=0 if args.skip_initial_rows else None)
        interval, span = 60.0 * args.interval_min, 60.0 * args.interval_min / 2
        step, stalls, spans = 0, [], {"with": [0.0, 0], "without": [0.0, 0]}
        deadline = time.monotonic() + 60.0 * args.duration_min
        last_ckpt = time.monotonic()
        # Alternate spans of half an interval: checkpoints are due only in "with" spans, and a
        # "without" span starts only when no write is in flight, so it sees an idle writer.
        mode = "with"
        while time.monotonic() < deadline:
            if mode == "without":
                manager.writer.wait_for_slot()  # no write in flight
            t0 = time.perf_counter()
            t_end = time.monotonic() + span
            n = 0
            while time.monotonic() < t_end:
                _step(model, opt, data[step % POOL])
                step, n = step + 1, n + 1
                if mode == "with" and time.monotonic() - last_ckpt >= interval:
                    stalls.append(manager.save(step, _dense_state(model, opt), {"step": step, "embedding_step": step}))
                    last_ckpt = time.monotonic()
                    print(f"  checkpoint at step {step}: stall {stalls[-1]:.2f} s", flush=True)
            spans[mode][0] += time.perf_counter() - t0
            spans[mode][1] += n
            mode = "without" if mode == "with" else "with"
        timed = len(stalls)
        stalls.append(manager.save(step, _dense_state(model, opt), {"step": step, "embedding_step": step}))
        reports = manager.finish()
        rate_with = spans["with"][1] / spans["with"][0]
        rate_without = spans["without"][1] / spans["without"][0]
        fresh, _ = build(args)
        storage = LocalStorage(root / "ckpt")
        latest = load_manifest(storage, reports[-1].name)
        restore_shards(storage, load_chain(storage, latest), local_shards(fresh.embeddings))
        bitwise = all(
            torch.equal(model.embeddings.table_weight(t.name), fresh.embeddings.table_weight(t.name))
            and all(torch.equal(v, fresh.embeddings.table_state(t.name)[k])
                    for k, v in model.embeddings.table_state(t.name).items())
            for t in model.embeddings.tables
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    ckpts = [{"name": r.name, "kind": r.kind, "step": r.step, "bytes": r.bytes_written, "stall_s": r.stall_s,
              "background_s": r.background_s, "write_mb_per_s": r.bytes_written / max(r.background_s, 1e-9) / 1e6,
              "share_of_disk_rate": r.bytes_written / max(r.background_s, 1e-9) / disk} for r in reports]
    print(format_table(["checkpoint", "kind", "GB", "stall s", "write s", "MB/s", "of disk rate"], [
        [c["name"], c["kind"], f"{c['bytes'] / 1e9:.2f}", f"{c['stall_s']:.2f}", f"{c['background_s']:.1f}",
         f"{c['write_mb_per_s']:,.0f}", f"{100 * c['share_of_disk_rate']:.0f}%"] for c in ckpts]))
    overhead = spans["with"][0] - spans["with"][1] / rate_without
    slowdown = overhead / (max(timed, 1) * 60.0 * args.interval_min)
    print(f"training: {rate_with:.2f} steps/s in spans with checkpoints, {rate_without:.2f} without; "
          f"{overhead:.1f} s lost over {timed} checkpoints: slowdown {100 * slowdown:+.2f}% at one checkpoint "
          f"every {args.interval_min:g} min; restore of the last checkpoint bitwise equal: {bitwise}")
    return {"disk_write_bytes_per_s": disk, "checkpoints": ckpts, "steps": step,
            "steps_per_s_with": rate_with, "steps_per_s_without": rate_without, "overhead_s": overhead, "timed_checkpoints": timed, "slowdown": slowdown,
            "resume_bitwise": bitwise, "stalls_s": stalls}
