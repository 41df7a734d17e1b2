"""The checkpoint manager: when to checkpoint, what to snapshot, what to keep.

``save`` is called on every rank at the same step. It measures what a differential would hold,
lets the policy pick the kind (all ranks agree: the counts are summed over ranks first), copies
the chosen rows and the caller's small state into memory (the only stall), and hands the rest to
the background writer. After each commit rank 0 applies retention: keep the last ``keep_last``
restorable checkpoints and every checkpoint their chains need; delete the rest. With a run
context (``recscale.checkpoint.lineage``) checkpoints go into the run's own folder, carry the
run's identity and parent, and a run that continues its parent's newest checkpoint deletes the
parent run once its own first checkpoint is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from recscale.checkpoint.lineage import RUN_FILE, RunContext, list_checkpoints, prune_parent
from recscale.checkpoint.manifest import CheckpointError, Manifest, TableMeta, checkpoint_name
from recscale.checkpoint.policy import Policy
from recscale.checkpoint.quantize import CODEC_METHODS, Codec, make_codec, state_codec
from recscale.checkpoint.range_memory import RangeMemory
from recscale.checkpoint.restore import load_manifest
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.shards import LocalShard, row_state_names
from recscale.checkpoint.snapshot import SnapshotBuffers
from recscale.checkpoint.storage import Storage
from recscale.checkpoint.tracker import RowTracker
from recscale.checkpoint.writer import CheckpointWriter, ShardSnapshot, WriteJob, WriteReport, write_failure

log = logging.getLogger(__name__)

# Sums a list of numbers over every rank (identity on one rank).
SumFn = Callable[[list[float]], list[float]]


class CheckpointManager:
    def __init__(
        self,
        settings: CheckpointSettings,
        storage: Storage,
        shards: list[LocalShard],
        rank: int = 0,
        world_size: int = 1,
        plan: dict | None = None,
        sum_over_ranks: SumFn | None = None,
        log: Callable[[str], None] = lambda _: None,
        init_seed: int | None = None,
        run: RunContext | None = None,
    ) -> None:
        """``init_seed``: the seed the embedding rows were initialised with
        (``recscale.embedding.table_batched.init_rows``); with ``skip_initial_rows`` full
        checkpoints then leave out rows still bitwise at those values. None: store every row.
        ``run``: the run this job is (``storage`` is then its folder); None: no run identity."""
        settings.validate()
        self.run = run
        self.parent_checked = run is None
        self.settings, self.storage, self.shards = settings, storage, shards
        self.rank, self.world_size, self.plan = rank, world_size, plan
        self.sum_over_ranks = sum_over_ranks or (lambda xs: xs)
        self.log = log
        self.policy = Policy(settings)
        self.init_seed = init_seed if settings.skip_initial_rows else None
        self.tracker = RowTracker(shards) if settings.policy != "full" else None
        dtypes = {s.table.dtype for s in shards}
        self.weight_codec: Codec = make_codec(
            settings.quantization, dtypes.pop() if len(dtypes) == 1 else "fp32",
            settings.effective_bits, settings.adaptive_bins, settings.adaptive_ratio,
        )
        if settings.quantization == "none" and len({s.table.dtype for s in shards}) > 1:
            raise CheckpointError("checkpoint.quantization = 'none' needs one embedding dtype for every table")
        self.state_codec: Codec = state_codec(settings.optimizer_state)
        self.chain: list[str] = []
        if rank == 0:
            storage.make_dir("")
            for d in storage.list_dirs():  # leftovers of a run killed while writing
                if d.startswith(".tmp-") or d.startswith(".old-"):
                    storage.delete_dir(d)
        self.writer = CheckpointWriter(
            storage, rank, world_size, settings.async_write, settings.max_in_flight,
            settings.commit_timeout_s, self._retain if rank == 0 else None,
        )
        self.snapshots = SnapshotBuffers()
        self.ranges = RangeMemory()  # adaptive: each row's last range search, for the next one
        self.ranges_used = False  # an adaptive checkpoint was submitted since the last restore
        if settings.async_write:  # the snapshot's memory, mapped before training rather than at its first save
            self.snapshots.reserve([t for s in shards if s.writer and s.tiered() is None for t in (
                s.module.table_weight(s.local_name), *s.module.table_state(s.local_name).values())])
        self.last_step = -1
        self.last_time = time.monotonic()

    # ------------------------------------------------------------------ when
    def due(self, step: int) -> bool:
        """Step interval reached (every rank agrees without communication)."""
        s = self.settings
        return bool(s.interval_steps) and step % s.interval_steps == 0

    def minutes_due(self) -> bool:
        s = self.settings
        return bool(s.interval_minutes) and time.monotonic() - self.last_time >= 60.0 * s.interval_minutes

    # ------------------------------------------------------------------ save
    def next_kind(self) -> str:
        """The kind ``save`` would write if called now (full, differential, incremental), without
        writing anything; on several ranks every rank must call it, as ``save``."""
        cand = self.policy.candidate_kind()
        if self.tracker is None or cand == "full":
            return self.policy.decide(1.0)
        changed, total = self.tracker.changed_cells(cand)
        changed, total = self.sum_over_ranks([float(changed), float(total)])
        return self.policy.decide(changed / max(total, 1.0))

    @torch.no_grad()
    def save(self, step: int, rank_state: bytes, training: dict, weight_codec: Codec | None = None) -> float:
        """Snapshot now, write in the background; returns the stall in seconds. ``weight_codec``:
        this checkpoint's embedding rows in this codec instead of the settings' (each manifest
        names its own codec, so a chain may mix them; adaptive range hints carry over only
        between adaptive checkpoints of the same bits); every rank must pass the same one."""
        codec = self.weight_codec if weight_codec is None else weight_codec
        if codec.method not in CODEC_METHODS:
            raise ValueError(f"save: weight_codec method '{codec.method}' is unknown; choose one of {CODEC_METHODS}")
        t0 = time.perf_counter()
        self.writer.wait_for_slot()
        cand = self.policy.candidate_kind()
        if self.tracker is not None and cand != "full":
            changed, total = self.tracker.changed_cells(cand)
            changed, total = self.sum_over_ranks([float(changed), float(total)])
            fraction = changed / max(total, 1.0)
        else:
            fraction = 1.0
        kind = self.policy.decide(fraction)
        name = checkpoint_name(step)
        chain = [name] if kind == "full" else (
            self.chain + [name] if kind == "incremental" else [self.chain[0], name]
        )
        held: list[torch.Tensor] = []  # snapshot buffers, reused once this checkpoint is written
        snaps = [self._snapshot(s, kind, held) for s in self.shards if s.writer]
        self.ranges_used |= codec.method == "adaptive"
        changed = self._changed_rows()
        if self.tracker is not None:
            self.tracker.advance(kind)
        self.policy.record(kind, fraction)
        self.chain = chain
        stall = time.perf_counter() - t0
        skip = kind == "full" and self.init_seed is not None
        # With a tracker, the snapshot already left out the rows never updated: no scan.
        scan = skip and self.tracker is None
        manifest = Manifest(
            initial_rows=self._initial_rows_meta() if skip else None,
            name=name, step=step, kind=kind, chain=chain, policy=self.settings.policy,
            weight_codec=codec.to_dict(), state_codec=self.state_codec.to_dict(),
            world_size=self.world_size, plan=self.plan, tables=self._table_meta(),
            optimizer=self._optimizer_meta(), files=[], chunks=[],
            training={**training, "changed_fraction": fraction},
            run=self.run.info.run if self.run else "", parent=self.run.info.parent if self.run else None,
        )
        job = WriteJob(
            manifest, self.rank, self.world_size, snaps, rank_state, codec, self.state_codec,
            self.settings.chunk_rows, stall, self._full_fp32_bytes(), self.init_seed if scan else None,
            on_done=lambda: self.snapshots.release(held),
            ranges=self.ranges if codec.method == "adaptive" or changed is not None else None, changed=changed,
        )
        self.writer.submit(job)
        self.last_step, self.last_time = step, time.monotonic()
        return stall

    def _changed_rows(self) -> dict[tuple[str, int, int], torch.Tensor] | None:
        """Per shard written, the rows updated since the last checkpoint, for the writer to stop
        keeping their adaptive encodings; None without a tracker (no row is kept then), or while
        no adaptive encoding is kept."""
        if self.tracker is None or not self.ranges_used:
            return None
        return {(s.table.name, s.row_offset, s.col_offset): self.tracker.changed_this_interval(s)
                for s in self.shards if s.writer}

    def _snapshot(self, s: LocalShard, kind: str, held: list[torch.Tensor]) -> ShardSnapshot:
        mask = None if self.tracker is None else self.tracker.shard_mask(s, kind)
        if mask is None and self.tracker is not None and self.init_seed is not None:
            mask = self.tracker.changed_since_init(s)  # a full checkpoint of the rows off their initial values
        keep_state = set(s.module.optimizer.state_columns(s.table.dim))
        keep_state -= row_state_names(s.module, s.table.dim) if s.col_offset > 0 else set()
        if s.tiered() is not None:  # rows from the cache or the tier file: read just those asked
            rows = None if mask is None else torch.nonzero(mask).view(-1)
            weight, states = s.read_rows(rows)
            state = {k: v for k, v in states.items() if k in keep_state}
            return ShardSnapshot(s.table.name, s.row_offset, s.num_rows, s.col_offset, s.num_cols, rows, weight,
                                 state, s.table)
        w = s.module.table_weight(s.local_name)
        states = s.module.table_state(s.local_name)
        if mask is None:
            rows = None
            weight = self.snapshots.copy(w, held)
            state = {k: self.snapshots.copy(v, held) for k, v in states.items() if k in keep_state}
        else:
            rows = torch.nonzero(mask).view(-1)
            weight = self.snapshots.gather(w, rows, held)
            state = {k: self.snapshots.gather(v, rows, held) for k, v in states.items() if k in keep_state}
            rows = rows.cpu()
        return ShardSnapshot(s.table.name, s.row_offset, s.num_rows, s.col_offset, s.num_cols, rows, weight, state, s.table)

    def restored(self) -> None:
        """After a restore into the tracked tables: the rows that now differ from their initial
        values are what the next full checkpoint must hold; every row's next range search
        starts cold."""
        self.ranges.forget()
        self.ranges_used = False
        if self.tracker is not None and self.init_seed is not None:
            self.tracker.mark_off_initial(self.init_seed)

    def _initial_rows_meta(self) -> dict:
        bounds = {s.table.name: list(s.table.bounds) for s in self.shards}
        return {"seed": self.init_seed, "bounds": bounds}

    def _table_meta(self) -> list[dict]:
        seen: dict[str, TableMeta] = {}
        for s in self.shards:
            t = s.table
            seen.setdefault(t.name, TableMeta(t.name, t.num_rows, t.dim, t.dtype))
        return [asdict(t) for t in seen.values()]  # type: ignore[misc]

    def _optimizer_meta(self) -> dict:
        m = self.shards[0].module.optimizer if self.shards else None
        return {"name": m.name if m else "", "lr": getattr(m, "lr", None)}

    def _full_fp32_bytes(self) -> int:
        total = 0
        for s in self.shards:
            if not s.writer:
                continue
            cols = s.num_cols + sum(
                c for k, c in s.module.optimizer.state_columns(s.table.dim).items()
                if not (k in row_state_names(s.module, s.table.dim) and s.col_offset > 0)
            )
            total += 4 * s.num_rows * cols
        return total

    # ------------------------------------------------------------------ retention
    def start_run(self, parent: dict | None, ancestors: list[dict] | None = None) -> None:
        """Rank 0: record the run (its identity, the checkpoint it resumed from and that one's
        ancestry) in its folder."""
        if self.run is None or self.rank != 0:
            return
        self.run.info.parent, self.run.info.ancestors = parent, list(ancestors or [])
        try:
            self.storage.write_atomic(RUN_FILE, self.run.info.to_json())
        except OSError as e:
            raise CheckpointError(write_failure(f"the run record {RUN_FILE}", self.storage.describe(), e)) from None

    def _retain(self, latest: Manifest) -> None:
        keep_last = self.settings.keep_last
        if not keep_last:
            return
        if not self.parent_checked:  # once, after this run's first commit
            self.parent_checked = True
            assert self.run is not None
            pruned = prune_parent(self.run.root, self.run.info)
            if pruned:
                self.log(f"checkpoints: deleted run {pruned}, which this run continues from its newest checkpoint")
        names = list_checkpoints(self.storage)
        restorable = [n for n in names if n <= latest.name][-keep_last:]
        needed: set[str] = set(restorable) | set(latest.chain)
        for n in restorable:
            try:
                needed |= set(load_manifest(self.storage, n).chain)
            except CheckpointError as e:  # its own folder is kept; the bases it names cannot be known
                log.warning("checkpoint retention: cannot read the manifest of %s, so the checkpoints it builds on "
                            "may be deleted: %s", n, e)
        for n in names:
            if n not in needed and n < latest.name:
                self.storage.delete_dir(n)

    # ------------------------------------------------------------------ end
    def finish(self) -> list[WriteReport]:
        """Wait for every checkpoint in flight; the reports of every checkpoint this rank wrote."""
        self.writer.close()
        self.snapshots.close()
        if self.tracker is not None:
            self.tracker.detach()
        return self.writer.reports
