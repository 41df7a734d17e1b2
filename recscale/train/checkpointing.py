"""Checkpoints in the training loop: what a training job saves besides the embedding rows, and
how a resumed job continues exactly where it stopped.

The loop calls three things: ``restore()`` once at the start, ``after_step()`` after every step
and ``finish()`` at the end. A checkpoint holds the embedding shards (via
``recscale.checkpoint``), and per rank a small state file: the Python, NumPy and torch RNG
states, the loop position (epoch, next batch of that epoch), step and sample counters, the loss
accumulators and the evaluations so far; rank 0's also holds the dense parameters and the dense
optimizer state (identical on every rank). The data settings that decide the sample sequence
are fingerprinted, and a resume with different ones is refused.

Every run writes into a run folder of its own under ``checkpoint.dir``
(``recscale.checkpoint.lineage``), with a record of the checkpoint it resumed from. With
``checkpoint.auto_resume`` a job restarted by torchrun finds its checkpoint by itself
(``recscale.train.elastic``).
"""

from __future__ import annotations

import io
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recscale import faults
from recscale.checkpoint.lineage import (
    RunContext,
    RunInfo,
    ancestry,
    cleanup,
    list_checkpoints,
    new_run_name,
    parent_record,
    resolve,
)
from recscale.checkpoint.manager import CheckpointManager
from recscale.checkpoint.manifest import CheckpointError
from recscale.checkpoint.restore import check_compatible, load_chain, load_manifest, read_file_checked, restore_shards
from recscale.checkpoint.shards import local_shards
from recscale.checkpoint.storage import LocalStorage
from recscale.checkpoint.writer import rank_file
from recscale.comm.process_group import ProcessGroups
from recscale.model import DLRM
from recscale.sharding.collection import ShardedEmbeddingCollection
from recscale.train.config import Config
from recscale.train.datasets import DataSplits
from recscale.train.elastic import auto_resume_target


@dataclass
class Progress:
    """Where the loop is: what a resumed run starts from."""

    step: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    epoch: int = 0
    next_batch: int = 0  # batches of ``epoch`` already trained
    running_loss: float = 0.0
    running_n: int = 0
    evals: list[dict[str, float]] = field(default_factory=list)


def data_fingerprint(cfg: Config, data: DataSplits) -> dict[str, Any]:
    """The settings that decide which samples each step sees (world size does not: a global batch
    is the same on any number of ranks)."""
    d = cfg.data
    fp: dict[str, Any] = {
        "source": d.source, "train_path": d.train_path, "shuffle": d.shuffle, "seed": cfg.train.seed,
        "batch_size": cfg.train.batch_size, "train_samples": data.train.num_samples, "batches_per_epoch": len(data.train),
    }
    if d.source == "synthetic":
        fp.update(pooling_factors=list(d.pooling_factors), zipf_alpha=d.zipf_alpha, table_rows=list(cfg.model.table_rows))
        if d.seed >= 0:  # recorded only when set, so checkpoints written before the key existed still resume
            fp["data_seed"] = d.seed
    reader_fp = getattr(data.train, "fingerprint", None)
    if callable(reader_fp):  # the prepared-data reader: its plan also depends on the world size
        fp["reader"] = json.loads(json.dumps({k: v for k, v in reader_fp().items() if k != "rank"}, default=str))
    return fp


def check_checkpoint_dir(path: str) -> str:
    """``checkpoint.dir`` must be a directory or creatable as one: checked before any training."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"config key 'checkpoint.dir': '{p}' is a file; give a directory for checkpoints")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"config key 'checkpoint.dir': cannot create '{p}' ({e.strerror}); give a writable directory") from None
    return path


class TrainCheckpointing:
    """Checkpoint and resume for one rank of a training job (inactive when not configured)."""

    def __init__(self, cfg: Config, model: DLRM, dense_opt: torch.optim.Optimizer, data: DataSplits,
                 groups: ProcessGroups, log: Callable[[str], None] = print) -> None:
        self.settings = cfg.checkpoint
        self.model, self.dense_opt, self.groups, self.log = model, dense_opt, groups, log
        self.rank, self.world = groups.rank, groups.world_size
        self.fingerprint = data_fingerprint(cfg, data)
        self.shards = local_shards(model.embeddings, self.rank)
        self.resumed_from: str | None = None
        self.restore_info: dict[str, Any] = {}
        self.manager: CheckpointManager | None = None
        if self.settings.enabled:
            root = LocalStorage(check_checkpoint_dir(self.settings.dir))
            if self.rank == 0:
                cleanup(root)  # before this run's folder exists
            names = [new_run_name()]
            if self.world > 1:  # one run identity for every rank
                torch.distributed.broadcast_object_list(names, src=0, group=self.groups.dense)
            run = RunContext(root, RunInfo(names[0], time.time(), self.world))
            plan = model.embeddings.plan if isinstance(model.embeddings, ShardedEmbeddingCollection) else None
            self.manager = CheckpointManager(
                self.settings, run.storage, self.shards, self.rank, self.world,
                plan.to_dict() if plan is not None else None, self._sum_over_ranks, log, cfg.train.seed, run,
            )

    # ------------------------------------------------------------------ collectives
    def _sum_over_ranks(self, xs: list[float]) -> list[float]:
        if self.world == 1:
            return xs
        t = torch.tensor(xs, dtype=torch.float64, device=self.groups.device)
        torch.distributed.all_reduce(t, group=self.groups.dense)
        return t.tolist()

    # ------------------------------------------------------------------ restore
    def restore(self) -> Progress:
        """Load the checkpoint named by ``checkpoint.resume``, or with ``checkpoint.auto_resume``
        the one ``recscale.train.elastic`` picks (or start fresh)."""
        t0 = time.perf_counter()
        target = self._resolve() if self.settings.resume or self.settings.auto_resume else None
        if target is None:
            if self.manager is not None:
                self.manager.start_run(None)
            return Progress()
        storage, name = target
        manifest = load_manifest(storage, name)
        check_compatible(manifest, self.shards, self.shards[0].module.optimizer.name if self.shards else "")
        saved_fp = manifest.training.get("data", {})
        if saved_fp != self.fingerprint:
            diff = {k: (saved_fp.get(k), self.fingerprint.get(k)) for k in set(saved_fp) | set(self.fingerprint)
                    if saved_fp.get(k) != self.fingerprint.get(k)}
            raise CheckpointError(
                f"checkpoint {storage.describe(name)} was written with other data settings "
                f"(key: (checkpoint, now)) {diff}; resuming would not continue the same sample sequence"
            )
        chain = load_chain(storage, manifest)
        stats = restore_shards(storage, chain, self.shards)
        if self.manager is not None:
            self.manager.restored()
        step = int(manifest.training["embedding_step"])
        for s in self.shards:
            for g in s.module.groups:
                g.step = step
        same_world = manifest.world_size == self.world
        own = self._read_state(storage, manifest, self.rank if same_world else 0, stats)
        # The dense part is replicated: rank 0 stored it once, every rank loads it.
        dense = own if self.rank == 0 or not same_world else self._read_state(storage, manifest, 0, stats)
        with torch.no_grad():
            for k, v in dense["dense_params"].items():
                self.model.get_parameter(k).copy_(v)
        self.dense_opt.load_state_dict(dense["dense_opt"])
        if not same_world:  # the loss sums of every old rank go to rank 0, so totals stay right
            loss, n = 0.0, 0
            if self.rank == 0:
                for r in range(manifest.world_size):
                    st = own if r == 0 else self._read_state(storage, manifest, r, stats)
                    loss += st["progress"]["running_loss"]
                    n += st["progress"]["running_n"]
            own["progress"]["running_loss"], own["progress"]["running_n"] = loss, n
        rng = own["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available() and same_world:
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.resumed_from = storage.describe(name)
        parent = parent_record(storage, name, manifest.run, manifest.step, manifest.digest)
        self.restore_info = {
            "resumed_from": self.resumed_from, "restore_chain": manifest.chain,
            "restore_bytes_read": stats.bytes_read, "restore_seconds": time.perf_counter() - t0,
            "restore_world_size": manifest.world_size, "resumed_run": manifest.run, "resumed_digest": manifest.digest,
        }
        self.log(f"resumed from {self.resumed_from} (run {manifest.run or '(none recorded)'}, step {manifest.step}, "
                 f"chain {' + '.join(manifest.chain)}, digest {manifest.digest[:12]}, {stats.bytes_read:,} bytes read "
                 "by rank 0)")
        above = ancestry(storage)
        if above:
            steps = [f"{r.get('run') or '(flat layout)'} to step {r.get('step')}" for r in reversed(above)]
            self.log(f"lineage of that checkpoint: {' -> '.join(steps)} -> {manifest.run}")
        if self.manager is not None:
            assert self.manager.run is not None
            how = "continues it" if parent["newest"] else "a new branch from an older checkpoint"
            self.log(f"this run: {self.manager.run.info.run} ({how})")
            self.manager.start_run(parent, above)
            self.restore_info["run"] = self.manager.run.info.run
        return Progress(**own["progress"])

    def _resolve(self) -> tuple[LocalStorage, str] | None:
        """Rank 0 finds the checkpoint (None: start fresh); every rank restores that one (or fails
        with its error)."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                found = (auto_resume_target(self.settings, self.log) if self.settings.auto_resume
                         else resolve(self.settings.resume, self.settings.dir))
                box[0] = str(found[0].root / found[1]) if found is not None else None
            except CheckpointError as e:
                box[0] = e
        if self.world > 1:
            torch.distributed.broadcast_object_list(box, src=0, group=self.groups.dense)
        if isinstance(box[0], CheckpointError):
            raise box[0]
        if box[0] is None:
            return None
        path = Path(box[0])
        return LocalStorage(path.parent), path.name

    def last_checkpoint(self, before_step: int) -> str:
        """The newest checkpoint this run committed (or resumed from) before a step; "" if none.
        Checkpoints still being written are finished first: they hold a good state."""
        m = self.manager
        if m is not None:
            try:
                m.writer.wait()
            except CheckpointError as e:
                self.log(f"a checkpoint in flight failed: {e}")
            done = [n for n in list_checkpoints(m.storage) if int(n.removeprefix("step")) < before_step]
            if done:
                return m.storage.describe(done[-1])
        return self.resumed_from or ""

    def _read_state(self, storage, manifest, rank: int, stats) -> dict[str, Any]:
        raw = read_file_checked(storage, manifest, rank_file(rank, "state"), stats)
        return torch.load(io.BytesIO(raw), weights_only=False)

    # ------------------------------------------------------------------ save
    def after_step(
        self, step: int, progress: Callable[[], Progress], before_save: Callable[[], None] | None = None
    ) -> None:
        """Checkpoint when the interval says so; call after every step. ``progress`` gives the
        loop's position and is only called when a checkpoint is taken (it syncs with the device);
        ``before_save`` runs first (the divergence guard: no checkpoint of a diverged state)."""
        faults.point("step", step)
        m = self.manager
        if m is None:
            return
        due = m.due(step)
        if self.settings.interval_minutes:
            due = self._sum_over_ranks([1.0 if (due or m.minutes_due()) and self.rank == 0 else 0.0])[0] > 0
        if due:
            if before_save is not None:
                before_save()
            self.save(progress())

    def save(self, p: Progress) -> float:
        assert self.manager is not None
        buf = io.BytesIO()
        torch.save(self._rank_state(p), buf)
        training = {
            "step": p.step, "epoch": p.epoch, "next_batch": p.next_batch, "samples": p.samples,
            "data": self.fingerprint, "embedding_step": self.shards[0].module.groups[0].step if self.shards else p.step,
        }
        return self.manager.save(p.step, buf.getvalue(), training)

    def _rank_state(self, p: Progress) -> dict[str, Any]:
        state: dict[str, Any] = {
            "progress": asdict(p),
            "rng": {
                "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }
        if self.rank == 0:
            state["dense_params"] = {
                k: v.detach().cpu().clone() for k, v in self.model.named_parameters() if not k.startswith("embeddings.")
            }
            state["dense_opt"] = self.dense_opt.state_dict()
        return state

    def finish(self, p: Progress) -> dict[str, Any]:
        """Final checkpoint (when ``at_end``), wait for every write; summary fields."""
        out: dict[str, Any] = dict(self.restore_info)
        m = self.manager
        if m is None:
            return out
        if self.settings.at_end and m.last_step != p.step:
            self.save(p)
        reports = m.finish()
        self._sum_over_ranks([0.0])  # returns once rank 0 has committed: the checkpoint is visible to all
        out["checkpoints"] = [
            {"name": r.name, "kind": r.kind, "step": r.step, "stall_s": r.stall_s, "background_s": r.background_s,
             "bytes_written_rank": r.bytes_written, **r.extra}
            for r in reports
        ]
        out["checkpoint_stall_s"] = sum(r.stall_s for r in reports)
        out["checkpoint_run"] = m.run.info.run if m.run else ""
        return out
