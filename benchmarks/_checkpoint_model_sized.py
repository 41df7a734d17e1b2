"""``benchmarks/checkpoint.py --model criteo-dlrm``: Check-N-Run at a model-sized state.

26 tables x 1M rows x dim 64 with row-wise Adagrad (about 7 GB of rows and state), one-hot
Criteo-like ids (Zipf), MLPs 512-256-64 / 512-256-1. Training runs for ``--duration-min``
minutes with a checkpoint every ``--interval-min`` minutes (intermittent differential, exact
rows: full baselines and differentials), in alternating spans of ``--span-s`` seconds with and
without checkpoints so that both see the same machine (a span with a checkpoint lasts until its
write is done). It reports:

- this disk's sequential write rate, probed right before and right after each full checkpoint
  (``--probe-differentials``: each differential too) with a file as large as the checkpoint (a
  full one's at least ``--disk-probe-min-gb``) written the way the writer writes (the same
  storage, write calls of a chunk's sizes, the closing fsync); each probe runs in a pause of
  training that belongs to neither measured span (this disk's rate varies by half within an
  hour: a checkpoint is compared with the probes beside it, not one taken long before);
- each checkpoint's kind, bytes (every row of a full checkpoint unless ``--skip-initial-rows``),
  stall (the in-memory snapshot), write rate (bytes / seconds its background write took)
  against the mean of its adjacent probes, and where the writer's seconds went (wall seconds in
  encode, crc32, write calls, fsync, small files, commit; waits: the encoder for room
  ``encode_ahead_wait`` = the writes are behind, the writes for chunks ``write_wait`` = the
  encoding is; each thread's CPU seconds and ``runqueue`` seconds, runnable but waiting for a
  CPU: the writer runs at nice 19, so a busy machine starves it);
- the training slowdown: the time the spans with checkpoints took beyond what their steps take
  at the rate without checkpoints, per checkpoint, as a share of the checkpoint interval (what
  a run checkpointing every interval loses);
- resume: the last checkpoint restored onto a fresh model equals the trained model bit for bit.

``--write-mode`` picks how data files (and the probes) are written: direct I/O (the default
where the file system takes it), page cache streamed to the disk, or page cache with one fsync.
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


def disk_write_rate(storage: LocalStorage, nbytes: int, parts: tuple[int, ...] = (16 << 20,)) -> tuple[float, float]:
    """(bytes per second, seconds) of one sequential write of about ``nbytes`` written the way
    the checkpoint writer writes a data file: through ``storage.open_write`` (the same streaming
    and closing fsync), in write calls of the sizes of a chunk's ``parts``; the file is removed."""
    bufs = [os.urandom(n) for n in parts]
    per = sum(parts)
    count = max(1, round(nbytes / per))
    t0 = time.perf_counter()
    with storage.open_write("disk-probe.bin") as f:
        for _ in range(count):
            for b in bufs:
                f.write(b)
    seconds = time.perf_counter() - t0
    (storage.root / "disk-probe.bin").unlink()
    return count * per / seconds, seconds


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


class Probes:
    """Disk probes around checkpoints, each in a pause of training that belongs to neither
    measured span (no step runs and no checkpoint is being written while one runs)."""

    def __init__(self, args, storage: LocalStorage, manager: CheckpointManager, chunk_parts: tuple[int, ...]) -> None:
        self.args, self.storage, self.manager, self.parts = args, storage, manager, chunk_parts
        self.records: list[dict] = []  # every probe: when, checkpoint step, bytes, seconds, rate
        self.pending: tuple[int, int] | None = None  # (step, bytes): an "after" probe still to run
        self.paused_s = 0.0

    def size_for(self, kind: str) -> int:
        """Bytes of a probe for the next checkpoint: as large as it (every row's fp32 bytes for a
        full one, the changed share of them for a differential), a full one's at least
        ``--disk-probe-min-gb``; ``--disk-probe-gb`` fixes the size instead."""
        if self.args.disk_probe_gb:
            return int(self.args.disk_probe_gb * (1 << 30))
        full = self.manager._full_fp32_bytes()
        if kind == "full":
            return max(full, int(self.args.disk_probe_min_gb * (1 << 30)))
        changed, total = self.manager.tracker.changed_cells(kind) if self.manager.tracker else (1, 1)
        return max(int(full * changed / max(total, 1)), 1 << 20)

    def wanted(self, kind: str) -> bool:
        return kind == "full" or self.args.probe_differentials

    def run(self, when: str, step: int, nbytes: int) -> float:
        """Write one probe now; the seconds the pause took."""
        t0 = time.perf_counter()
        rate, seconds = disk_write_rate(self.storage, nbytes, self.parts)
        self.records.append({"when": when, "checkpoint_step": step, "bytes": nbytes, "seconds": seconds,
                             "bytes_per_s": rate})
        print(f"  disk probe {when} the checkpoint at step {step}: {rate / 1e6:,.0f} MB/s "
              f"({nbytes / 1e9:.2f} GB, {seconds:.1f} s; training paused, outside both spans)", flush=True)
        dt = time.perf_counter() - t0
        self.paused_s += dt
        return dt

    def before(self, step: int, kind: str) -> float:
        """Before a checkpoint is saved: the last one's probe after (once its write is done) and
        this one's probe before."""
        dt = 0.0
        if self.pending is not None or self.wanted(kind):
            self.manager.writer.wait_for_slot()  # nothing being written while a probe runs
            dt += self.after_if_done()
        if self.wanted(kind):
            nbytes = self.size_for(kind)
            dt += self.run("before", step, nbytes)
            self.pending = (step, nbytes)
        return dt

    def after_if_done(self) -> float:
        """The pending probe after a checkpoint, if its write has finished; seconds paused."""
        if self.pending is None or not self.manager.writer.idle():
            return 0.0
        step, nbytes = self.pending
        self.pending = None
        return self.run("after", step, nbytes)

    def around(self, step: int) -> tuple[float | None, float | None]:
        rates = {r["when"]: r["bytes_per_s"] for r in self.records if r["checkpoint_step"] == step}
        return rates.get("before"), rates.get("after")


def run(args) -> dict:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="recscale-ckpt-model-"))
    root.mkdir(parents=True, exist_ok=True)
    stream_window = 0 if args.write_mode == "buffered" else None
    direct = args.write_mode == "direct"
    try:
        data = batches(args)
        model, opt = build(args)
        for b in data[:2]:  # untimed: a first use compiles the native kernels
            _step(model, opt, b)
        settings = CheckpointSettings(dir=str(root / "ckpt"), policy="intermittent", quantization="none",
                                      keep_last=1, async_write=True, max_in_flight=1, at_end=False)
        manager = CheckpointManager(settings, LocalStorage(root / "ckpt", stream_window, direct), local_shards(model.embeddings),
                                    init_seed=0 if args.skip_initial_rows else None)
        # A chunk's write calls: its rows (fp32), then the row-wise Adagrad state (one column).
        probes = Probes(args, LocalStorage(root, stream_window, direct), manager,
                        (settings.chunk_rows * args.dim * 4, settings.chunk_rows * 4))
        # Short alternating spans: the VM's speed drifts over minutes, and spans of seconds see the
        # same drift with and without checkpoints (at most half an interval each).
        interval = 60.0 * args.interval_min
        span = min(args.span_s or 20.0, interval / 2)
        step, stalls, spans = 0, [], {"with": [0.0, 0], "without": [0.0, 0]}
        deadline = time.monotonic() + 60.0 * args.duration_min
        last_ckpt = time.monotonic()
        # Alternate spans: checkpoints are due only in "with" spans, a "with" span lasts until its
        # write is done (its whole cost falls in it), and a "without" span sees an idle writer.
        # Disk probes pause training: their seconds count in neither span, nor in the run's
        # duration or the checkpoint interval.
        mode = "with"
        while time.monotonic() < deadline:
            if mode == "without":
                manager.writer.wait_for_slot()  # no write in flight
                dt = probes.after_if_done()
                deadline, last_ckpt = deadline + dt, last_ckpt + dt
            t0 = time.perf_counter()
            t_end = time.monotonic() + span
            n, paused = 0, 0.0
            while time.monotonic() < t_end or (mode == "with" and not manager.writer.idle()):
                _step(model, opt, data[step % POOL])
                step, n = step + 1, n + 1
                dt = probes.after_if_done()
                if mode == "with" and time.monotonic() - last_ckpt >= interval:
                    dt += probes.before(step, manager.next_kind())
                    stalls.append(manager.save(step, _dense_state(model, opt), {"step": step, "embedding_step": step}))
                    last_ckpt = time.monotonic()
                    print(f"  checkpoint at step {step}: stall {stalls[-1]:.2f} s", flush=True)
                if dt:
                    paused, t_end, deadline, last_ckpt = paused + dt, t_end + dt, deadline + dt, last_ckpt + dt
            spans[mode][0] += time.perf_counter() - t0 - paused
            spans[mode][1] += n
            mode = "without" if mode == "with" else "with"
        timed = len(stalls)
        probes.before(step, manager.next_kind())
        stalls.append(manager.save(step, _dense_state(model, opt), {"step": step, "embedding_step": step}))
        reports = manager.finish()
        probes.after_if_done()
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
    disk = sum(r["bytes_per_s"] for r in probes.records) / max(len(probes.records), 1)
    ckpts = []
    for r in reports:
        rate = r.bytes_written / max(r.background_s, 1e-9)
        before, after = probes.around(r.step)
        near = [x for x in (before, after) if x]
        adjacent = sum(near) / len(near) if near else None
        ckpts.append({
            "name": r.name, "kind": r.kind, "step": r.step, "bytes": r.bytes_written, "stall_s": r.stall_s,
            "background_s": r.background_s, "write_mb_per_s": rate / 1e6,
            # against the mean of the probes right before and after it (the run's mean if it has none)
            "share_of_disk_rate": rate / (adjacent or disk),
            "probe_before_bytes_per_s": before, "probe_after_bytes_per_s": after,
            "adjacent_disk_bytes_per_s": adjacent, "phases_s": r.phases,
        })
    fmt = lambda x: f"{x / 1e6:,.0f}" if x else "-"  # noqa: E731
    print(format_table(
        ["checkpoint", "kind", "GB", "stall s", "write s", "MB/s", "probe before", "probe after", "of adjacent probes"], [
        [c["name"], c["kind"], f"{c['bytes'] / 1e9:.2f}", f"{c['stall_s']:.2f}", f"{c['background_s']:.1f}",
         f"{c['write_mb_per_s']:,.0f}", fmt(c["probe_before_bytes_per_s"]), fmt(c["probe_after_bytes_per_s"]),
         f"{100 * c['share_of_disk_rate']:.0f}%" + ("" if c["adjacent_disk_bytes_per_s"] else " (of run mean)")]
        for c in ckpts]))
    for c in ckpts:
        print(f"  {c['name']} writer phases (s): " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in c["phases_s"].items()))
    overhead = spans["with"][0] - spans["with"][1] / rate_without
    slowdown = overhead / (max(timed, 1) * 60.0 * args.interval_min)
    print(f"disk probes: {len(probes.records)}, {probes.paused_s:.1f} s in pauses outside both training spans; "
          f"write mode {args.write_mode}")
    print(f"training: {rate_with:.2f} steps/s in spans with checkpoints, {rate_without:.2f} without; "
          f"{overhead:.1f} s lost over {timed} checkpoints: slowdown {100 * slowdown:+.2f}% at one checkpoint "
          f"every {args.interval_min:g} min; restore of the last checkpoint bitwise equal: {bitwise}")
    return {"disk_write_bytes_per_s": disk, "checkpoints": ckpts, "steps": step,
            "steps_per_s_with": rate_with, "steps_per_s_without": rate_without, "overhead_s": overhead, "timed_checkpoints": timed, "slowdown": slowdown,
            "resume_bitwise": bitwise, "stalls_s": stalls, "disk_probes": probes.records,
            "probe_pause_s": probes.paused_s, "write_mode": args.write_mode}
