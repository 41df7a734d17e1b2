"""Embedding tables sharded over ranks by a plan, with the same interface as the single-process
operator: ``forward(local batch) -> [local batch, sum of dims]``, optimizer fused into backward.

One step, for every sharding type but data-parallel:
  1. input distribution: each rank sends every other rank the ids of its own samples that the
     receiver's shards serve (row-split types: only the ids in the shard's row range, rebased),
     lengths first, then ids and weights (mean pooling is folded into per-id weights here, at
     the source, where the whole bag is known);
  2. each rank pools the ids it received with one table-batched fused operator over its shards;
  3. output distribution: each rank returns to every source the partial pooled outputs of that
     source's samples; the source adds each shard's output into the shard's column range, which
     concatenates column shards and sums row shards (reduce-scatter as all-to-all + local sum,
     so it also works on gloo, which has no reduce-scatter);
  backward runs the same collectives in reverse, and each rank updates only the rows it owns.
On several hosts, table-row-wise outputs take two stages instead (``hierarchical.py``): a
reduce-scatter inside the host, then the sums cross hosts once, not once per rank of the host.
Data-parallel tables are looked up locally; their row gradients are combined (gathered, or
reduced densely for small tables: ``replica_gradients.py``) before the same fused optimizer
updates every replica identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from recscale.comm.codecs import get_codec
from recscale.comm.collectives import CommStats, all_gather_rows, all_to_all_async
from recscale.comm.errors import DistributedError
from recscale.comm.process_group import ProcessGroups
from recscale.embedding import SparseOptimizer, TableBatchedEmbeddingBags, TableConfig, native
from recscale.embedding.table_batched import init_rows, output_feature_order, row_gradients
from recscale.sharding.hierarchical import HostBlock, TableRowWiseHierarchy
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.sharding.column_runs import ColumnRun, column_runs, place, take
from recscale.sharding.replica_gradients import ReplicaGradients, Reduction
from recscale.sparse import JaggedBatch, SparseInputError, permute_bags


@dataclass(frozen=True)
class CommPrecision:
    """Wire precision per collective; ``loss_scale`` multiplies fp16 gradients on the wire."""

    forward: str = "fp32"
    backward: str = "fp32"
    loss_scale: float = 1024.0


@dataclass(frozen=True)
class _ShardFeature:
    """One feature as served by one shard: what a rank pools for that feature."""

    key: str  # local feature name on the owner, e.g. "C1#0"
    feature: str
    table: str
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int
    routes_by_row: bool


@dataclass
class PendingInput:
    """A local batch whose ids are on their way to their owners (``start_input_dist``)."""

    batch: JaggedBatch
    _finish: Callable[[], tuple[JaggedBatch, list[int]]] = field(repr=False)
    _received: tuple[JaggedBatch, list[int]] | None = field(default=None, repr=False)

    def wait(self) -> JaggedBatch:
        """The ids this rank's shards serve, ordered for its operator (waits once)."""
        if self._received is None:
            self._received = self._finish()
        return self._received[0]

    @property
    def sizes(self) -> list[int]:
        """Every rank's batch size (they travel with the ids)."""
        self.wait()
        assert self._received is not None
        return self._received[1]


@dataclass
class _Exchange:
    """The in-flight output (forward) and gradient (backward) all-to-alls of one step, shared
    by the sending and the receiving autograd nodes."""

    output: object = None
    grad: object = None


class PendingOutput:
    """A step's pooled outputs on their way home (``ShardedEmbeddingCollection.start_forward``)."""

    def __init__(self, coll: "ShardedEmbeddingCollection", batch: JaggedBatch, token: torch.Tensor | None,
                 state: _Exchange | None) -> None:
        self._coll, self._batch, self._token, self._state = coll, batch, token, state

    def finish(self) -> torch.Tensor:
        coll = self._coll
        if coll._dp_only:
            return coll.dp(self._batch.select(coll.dp.feature_names))
        # The replicas pool their own samples while the outputs are still on their way.
        dp_out = coll.dp(self._batch.select(coll.dp.feature_names)) if coll.dp is not None else None
        return _OutputRecv.apply(self._token, coll, self._state, dp_out)


def _shard_table_name(table: str, index: int) -> str:
    return f"{table}#{index}"


class ShardedEmbeddingCollection(nn.Module):
    """``hierarchical=False`` keeps table-row-wise outputs on the flat path on several hosts
    too (same results up to summation order; for comparisons); ``dp_reduction`` forces how
    data-parallel replicas combine gradients (``gather`` or ``dense``; same bits either way)."""

    def __init__(
        self,
        tables: list[TableConfig],
        optimizer: SparseOptimizer,
        plan: ShardingPlan,
        groups: ProcessGroups,
        seed: int = 0,
        precision: CommPrecision = CommPrecision(),
        stats: CommStats | None = None,
        kernel: str = "auto",
        hierarchical: bool = True,
        dp_reduction: Reduction = "auto",
    ) -> None:
        super().__init__()
        plan.validate(tables)
        if plan.world_size != groups.world_size:
            raise PlanError(f"the plan is for {plan.world_size} ranks but the job has {groups.world_size}; plan again for "
                            f"{groups.world_size} ranks (or start {plan.world_size})")
        self.tables = list(tables)
        self.optimizer = optimizer
        self.plan = plan
        self.groups = groups
        self.rank = groups.rank
        self.world = groups.world_size
        self.precision = precision
        self.stats = stats if stats is not None else CommStats()
        self.stats.ranks_per_host = groups.topology.ranks_per_host
        self.fwd_codec = get_codec(precision.forward)
        self.bwd_codec = get_codec(precision.backward)
        self.global_batch_size = 0
        by_name = {t.name: t for t in tables}
        self._by_name = by_name
        table_of_feature = {f: t for t in tables for f in t.features}
        self.feature_names = output_feature_order(tables)
        self.feature_dims = tuple(table_of_feature[f].dim for f in self.feature_names)
        self.num_rows_by_feature = {f: t.num_rows for t in tables for f in t.features}
        col = 0
        self._feature_col: dict[str, int] = {}
        for f, d in zip(self.feature_names, self.feature_dims):
            self._feature_col[f] = col
            col += d
        self.total_dim = col
        self._mean_features = {f for t in tables if t.pooling == "mean" for f in t.features}
        self._id_wire_dtype = torch.int32 if max(t.num_rows for t in tables) < 2**31 else torch.int64

        # Shards of every rank, as local tables, and the features each rank serves, in the
        # order of that rank's operator output (every rank computes this for every rank).
        local_tables: list[list[TableConfig]] = [[] for _ in range(self.world)]
        origin: dict[str, tuple[TableConfig, object, int]] = {}
        self._dp_tables: list[TableConfig] = []
        for table_plan in plan.tables:
            t = by_name[table_plan.table]
            if table_plan.sharding_type == "data_parallel":
                self._dp_tables.append(t)
                continue
            for i, s in enumerate(table_plan.shards):
                name = _shard_table_name(t.name, i)
                local_tables[s.rank].append(
                    TableConfig(name, s.num_rows, s.num_cols, tuple(f"{f}#{i}" for f in t.features), "sum", None, t.dtype)
                )
                origin[name] = (t, s, table_plan.routes_by_row)
        # Column-shard tables whose optimizer keeps a whole-row statistic (row-wise Adagrad):
        # their shards update with it, in operator groups apart from the other tables.
        self._cw_row_stat = [
            table_plan for table_plan in plan.tables if table_plan.sharding_type == "column_wise" and len(table_plan.shards) > 1
        ] if optimizer.uses_row_mean_sq else []
        row_stat_tables = frozenset(_shard_table_name(table_plan.table, i) for table_plan in self._cw_row_stat for i in range(len(table_plan.shards)))
        self._served: list[list[_ShardFeature]] = []
        for r in range(self.world):
            served = []
            for key in output_feature_order(local_tables[r], row_stat_tables):
                feature, idx = key.rsplit("#", 1)
                t, s, by_row = origin[_shard_table_name(table_of_feature[feature].name, int(idx))]
                served.append(_ShardFeature(key, feature, t.name, s.row_offset, s.num_rows, s.col_offset, s.num_cols, by_row))
            self._served.append(served)
        self._local_dims = [sum(shard_feature.num_cols for shard_feature in served) for served in self._served]

        def shard_init(local: TableConfig) -> torch.Tensor:
            t, s, _ = origin[local.name]
            return init_rows(t, seed, s.row_offset, s.num_rows, s.col_offset, s.num_cols)

        device = groups.device
        self._column_shard_row_mean_sq: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._local_col = {}
        col = 0
        for shard_feature in self._served[self.rank]:
            self._local_col[shard_feature.key] = col
            col += shard_feature.num_cols
        self.local = (
            TableBatchedEmbeddingBags(
                local_tables[self.rank], optimizer, seed, device, init_fn=shard_init,
                row_stat_fn=self._row_mean_sq if self._cw_row_stat else None, kernel=kernel,
                row_stat_tables=row_stat_tables,
            )
            if local_tables[self.rank]
            else None
        )
        self.dp = (
            TableBatchedEmbeddingBags(
                self._dp_tables, optimizer, seed, device, kernel=kernel,
                grad_reducer=ReplicaGradients(groups.embedding_grads, self.stats, dp_reduction),
            )
            if self._dp_tables
            else None
        )
        self._hier = self._table_row_wise_hierarchy(plan, groups.topology, device) if hierarchical else None
        hier_tables = {table_plan.table for table_plan in plan.tables if table_plan.sharding_type == "table_row_wise"} if self._hier else set()
        # What each owner sends every source flat: all its shards but the hierarchical ones.
        flat = [[shard_feature for shard_feature in served if shard_feature.table not in hier_tables] for served in self._served]
        self._flat_local_cols = torch.tensor(
            [self._local_col[shard_feature.key] + c for shard_feature in flat[self.rank] for c in range(shard_feature.num_cols)], dtype=torch.int64, device=device
        )
        flat_dims = [sum(shard_feature.num_cols for shard_feature in f) for f in flat]
        # Output columns each owner's flat shards fill, in that owner's output order; with the
        # hierarchy, the owner of local index j also sends sources of index j its host's block.
        colmaps = [
            [self._feature_col[shard_feature.feature] + shard_feature.col_offset + c for shard_feature in f for c in range(shard_feature.num_cols)] for f in flat
        ]
        me = self.rank
        extra = self._hier.extra_cols if self._hier else (lambda sender, receiver: 0)
        block_cols = [
            [self._feature_col[f] + c for f, d in b.features for c in range(d)] for b in self._hier.blocks
        ] if self._hier else []
        host_of = groups.topology.host_of
        self._in_widths = [flat_dims[d] + extra(d, me) for d in range(self.world)]  # columns rank d sends me
        self._out_widths = [flat_dims[me] + extra(me, s) for s in range(self.world)]  # columns I send rank s
        in_cols = [colmaps[d] + (block_cols[host_of(d)] if extra(d, me) else []) for d in range(self.world)]
        # Owners whose shards are whole features (full width, not row-split) of one common dim
        # place their block with one copy of dim-wide rows per feature instead of a per-column
        # scatter-add (and gradients go back by the same rows). None: the general path.
        dims = set(self.feature_dims)
        common = dims.pop() if len(dims) == 1 else None
        order = {f: i for i, f in enumerate(self.feature_names)}
        self._feature_slots = [
            torch.tensor([order[shard_feature.feature] for shard_feature in served], dtype=torch.int64, device=device)
            if common is not None and served and self._hier is None and all(
                not shard_feature.routes_by_row and shard_feature.col_offset == 0 and shard_feature.num_cols == common for shard_feature in served)
            else None
            for served in self._served
        ]
        self._common_dim = common
        # The others' blocks go in by runs of columns, in rank order; the first writer of a
        # column copies, later ones (row shards' partial sums) add.
        written = [False] * self.total_dim
        for served, slots in zip(self._served, self._feature_slots):
            if slots is not None:
                for shard_feature in served:
                    written[self._feature_col[shard_feature.feature] : self._feature_col[shard_feature.feature] + shard_feature.num_cols] = [True] * shard_feature.num_cols
        self._in_runs = [() if slots is not None else column_runs(cols, written) for cols, slots in zip(in_cols, self._feature_slots)]
        # Every table data-parallel, pooled in output order: each rank looks up its own batch,
        # so there are no ids to exchange and the replicas' output is the output (no scatter).
        self._dp_only = False
        self._dp_runs: tuple[ColumnRun, ...] = ()
        if self.dp is not None:
            self._dp_runs = column_runs(
                [self._feature_col[f] + c for f, d in zip(self.dp.feature_names, self.dp.feature_dims) for c in range(d)], written
            )
            self._dp_only = not any(self._local_dims) and list(self.dp.feature_names) == list(self.feature_names)
        self._row_bounds = {
            table_plan.table: torch.tensor([s.row_offset for s in table_plan.shards] + [by_name[table_plan.table].num_rows], device=device)
            for table_plan in plan.tables
            if table_plan.routes_by_row
        }
        self._shard_index = {
            (table_plan.table, s.row_offset, s.col_offset): i for table_plan in plan.tables for i, s in enumerate(table_plan.shards)
        }
        # Every output column is written by a copy: no need to zero the output first.
        self._output_all_copied = all(written)
        self._bag_order_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # Makes the output require grad on every rank, so every rank joins the backward collectives.
        self._anchor = nn.Parameter(torch.zeros(0, device=device))

    def _table_row_wise_hierarchy(self, plan: ShardingPlan, topology, device) -> TableRowWiseHierarchy | None:
        """The two-stage output path of table-row-wise tables, when there are several hosts and
        each such table has one shard on every rank of its host (else the flat path)."""
        table_row_wise_plans = [table_plan for table_plan in plan.tables if table_plan.sharding_type == "table_row_wise"]
        if not table_row_wise_plans or topology.num_hosts < 2 or topology.world_size != self.world:
            return None
        blocks: list[list[tuple[str, int]]] = [[] for _ in range(topology.num_hosts)]
        for table_plan in table_row_wise_plans:
            host = topology.host_of(table_plan.shards[0].rank)
            if sorted(s.rank for s in table_plan.shards) != topology.ranks_of_host(host):
                return None
            t = self._by_name[table_plan.table]
            blocks[host].extend((f, t.dim) for f in t.features)
        key_of = {shard_feature.feature: shard_feature.key for shard_feature in self._served[self.rank] if shard_feature.routes_by_row}
        mine = blocks[topology.host_of(self.rank)]
        cols = [self._local_col[key_of[f]] + c for f, d in mine for c in range(d)]
        return TableRowWiseHierarchy(
            topology, [HostBlock(tuple(b)) for b in blocks], torch.tensor(cols, dtype=torch.int64, device=device)
        )

    # ------------------------------------------------------------------ forward
    def set_learning_rate(self, lr: float) -> None:
        """The rate of every fused update (sharded and replicated tables) from the next backward on."""
        self.optimizer = replace(self.optimizer, lr=lr)
        for part in (self.local, self.dp):
            if part is not None:
                part.set_learning_rate(lr)

    def validate(self, batch: JaggedBatch) -> None:
        missing = [f for f in self.feature_names if f not in batch.keys]
        if missing:
            raise SparseInputError(f"batch lacks features {missing} that the embedding tables expect")
        batch.validate(self.num_rows_by_feature)

    def start_input_dist(self, batch: JaggedBatch) -> PendingInput:
        """Send this batch's ids to their owners now; ``forward(pending)`` uses them later.

        The batch sizes, lengths, ids and weights travel while the caller computes the previous
        batch; through shared memory nothing here waits for another rank (through a process
        group's backend, small exchanges of message sizes do). Every rank must call this and
        ``forward`` in the same order, as for any collective."""
        if self._dp_only:  # only the batch sizes (for the global batch of the loss)
            ones = [1] * self.world
            b = torch.full((self.world,), batch.batch_size, dtype=torch.int64, device=self.groups.device)
            pending = all_to_all_async(b, ones, ones, self.groups.embedding, None, "batch_sizes")
            return PendingInput(batch, lambda: (batch, [int(v) for v in pending.wait().tolist()]))
        return PendingInput(batch, self._distribute_input(batch))

    def forward(self, batch: JaggedBatch | PendingInput) -> torch.Tensor:
        return self.start_forward(batch).finish()

    def start_forward(self, batch: JaggedBatch | PendingInput) -> PendingOutput:
        """Pool this rank's shards and start sending the outputs home; ``finish()`` waits for
        them. Work the caller does in between (the bottom MLP, which needs no embeddings)
        overlaps the output all-to-all, and in backward the bottom MLP's gradients overlap the
        gradient all-to-all (autograd runs the later-created receiving node first)."""
        pending = batch if isinstance(batch, PendingInput) else self.start_input_dist(batch)
        received = pending.wait()
        batch, sizes = pending.batch, pending.sizes
        self.global_batch_size = sum(sizes)
        if self._dp_only:
            return PendingOutput(self, batch, None, None)
        self._received = received  # column shards with row-wise state need it in backward
        if self.local is not None:
            pooled = self.local(received)
        else:
            pooled = torch.zeros(self.global_batch_size, 0, device=self.groups.device)
        state = _Exchange()
        token = _OutputSend.apply(self._anchor, self, pooled, sizes, state)
        return PendingOutput(self, batch, token, state)

    def _feature_ids(self, batch: JaggedBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per feature: ids, lengths and weights, mean pooling folded into the weights."""
        out = {}
        offsets = batch.offsets()
        b = batch.batch_size
        for k, f in enumerate(batch.keys):
            if f not in self._feature_col:
                continue
            lo, hi = int(offsets[k * b]), int(offsets[(k + 1) * b])
            vals, lens = batch.values[lo:hi], batch.lengths[k * b : (k + 1) * b]
            w = None if batch.weights is None else batch.weights[lo:hi].float()
            if f in self._mean_features:
                inv = torch.repeat_interleave(1.0 / lens.clamp(min=1).float(), lens, output_size=vals.numel())
                w = inv if w is None else w * inv
            out[f] = (vals, lens, w)
        return out

    def _distribute_input(self, batch: JaggedBatch) -> Callable[[], tuple[JaggedBatch, list[int]]]:
        """Start the exchanges of lengths (each rank's part led by its batch size), ids and
        weights; the returned function waits for them and orders the received bags for the
        operator. No rank needs to know in advance how much the others send it."""
        me, b = self.rank, batch.batch_size
        need_weights = batch.weights is not None or bool(self._mean_features)
        per_feature = self._feature_ids(batch)
        routed = self._route_row_split(per_feature, b)
        lens_out, vals_out, wts_out = [], [], []
        len_splits, val_splits = [], []
        for served in self._served:
            n_vals = 0
            for shard_feature in served:
                if shard_feature.routes_by_row:
                    vals, lens, w = routed[(shard_feature.table, shard_feature.row_offset, shard_feature.feature)]
                else:
                    vals, lens, w = per_feature[shard_feature.feature]
                lens_out.append(lens)
                vals_out.append(vals)
                if need_weights:
                    wts_out.append(w if w is not None else torch.ones(vals.numel(), device=vals.device))
                n_vals += vals.numel()
            len_splits.append(1 + len(served) * b)
            val_splits.append(n_vals)
        dev = self.groups.device
        head = torch.tensor([b], dtype=torch.int64, device=dev)
        lens_parts: list[torch.Tensor] = []
        cursor = 0
        for served in self._served:  # each destination's lengths, led by this rank's batch size
            lens_parts.append(head)
            lens_parts.extend(lens_out[cursor : cursor + len(served)])
            cursor += len(served)
        lens_send = torch.cat(lens_parts).to(torch.int64)
        pg = self.groups.embedding
        lens_pending = all_to_all_async(lens_send, len_splits, None, pg, self.stats, "input_lengths")
        vals_send = torch.cat(vals_out) if vals_out else torch.zeros(0, dtype=torch.int64, device=dev)
        # Ids travel as int32 when every table is small enough: half the bytes.
        ids_pending = all_to_all_async(vals_send.to(self._id_wire_dtype), val_splits, None, pg, self.stats, "input_ids")
        wts_pending = None
        if need_weights:
            wts_send = torch.cat(wts_out) if wts_out else torch.zeros(0, device=dev)
            wts_pending = all_to_all_async(wts_send, val_splits, None, pg, self.stats, "input_weights")
        k = len(self._served[me])

        def finish() -> tuple[JaggedBatch, list[int]]:
            got = lens_pending.wait()
            sizes, lens_recv = [], []
            pos = 0
            for n in lens_pending.rows_from():
                if n < 1 or (n - 1) % max(k, 1) or (k == 0 and n != 1):
                    raise DistributedError(f"rank {me}: a rank sent {n} lengths, which no batch size explains; the ranks' plans differ")
                sizes.append(int(got[pos]))
                lens_recv.append(got[pos + 1 : pos + n])
                pos += n
            vals_recv = ids_pending.wait().to(torch.int64)
            wts_recv = None if wts_pending is None else wts_pending.wait()
            return self._order_received(vals_recv, torch.cat(lens_recv), wts_recv, sizes), sizes

        return finish

    def _order_received(
        self, vals_recv: torch.Tensor, lens_recv: torch.Tensor, wts_recv: torch.Tensor | None, sizes: list[int]
    ) -> JaggedBatch:
        # Received bags are ordered (source, feature, sample); the operator wants (feature, source, sample).
        mine = self._served[self.rank]
        dev = self.groups.device
        k = len(mine)
        if k == 0:
            return JaggedBatch((), vals_recv, lens_recv, wts_recv)
        key = tuple(sizes)
        order = self._bag_order_cache.get(key)
        if order is None:  # depends only on the batch sizes: built once, not every step
            bag_order = []
            src_start = [0]
            for s in range(self.world):
                src_start.append(src_start[-1] + k * sizes[s])
            for j in range(k):
                for s in range(self.world):
                    start = src_start[s] + j * sizes[s]
                    bag_order.append(torch.arange(start, start + sizes[s], device=dev))
            order = torch.cat(bag_order)
            if len(self._bag_order_cache) > 8:
                self._bag_order_cache.clear()
            self._bag_order_cache[key] = order
        vals, lens, wts = permute_bags(vals_recv, lens_recv, wts_recv, order)
        return JaggedBatch(tuple(shard_feature.key for shard_feature in mine), vals, lens, wts)

    def _route_row_split(self, per_feature, b: int):
        """For row-split tables: per (table, shard row offset, feature) the ids in that shard's
        row range, rebased to the shard, in sample order, with per-sample counts."""
        routed = {}
        for table_plan in self.plan.tables:
            if not table_plan.routes_by_row:
                continue
            bounds = self._row_bounds[table_plan.table]
            n_shards = len(table_plan.shards)
            t = self._by_name[table_plan.table]
            for f in t.features:
                if f not in per_feature:
                    continue
                vals, lens, w = per_feature[f]
                shard_of = torch.searchsorted(bounds, vals, right=True) - 1
                sample_of = torch.repeat_interleave(torch.arange(b, device=vals.device), lens, output_size=vals.numel())
                counts = torch.bincount(shard_of * b + sample_of, minlength=n_shards * b).view(n_shards, b)
                order = native.stable_argsort(shard_of)
                sorted_vals = vals[order] - bounds[shard_of[order]]
                sorted_w = None if w is None else w[order]
                per_shard = counts.sum(1).tolist()
                start = 0
                for i, s in enumerate(table_plan.shards):
                    n = per_shard[i]
                    routed[(table_plan.table, s.row_offset, f)] = (
                        sorted_vals[start : start + n],
                        counts[i],
                        None if sorted_w is None else sorted_w[start : start + n],
                    )
                    start += n
        return routed

    # ------------------------------------------------------------------ column shards, row-wise state
    def _exchange_column_shard_row_sq(self, grad_pooled: torch.Tensor) -> None:
        """Give every column shard the full-row mean square gradient of each row it updates.

        All column shards of a table receive the same ids, so they touch the same rows in the
        same order. Each owner computes its columns' sum of squares per row; every rank joins
        one gather; each shard then sums the parts in shard order (so all shards agree) and
        divides by the table's dim. Runs on every rank, once per step, in backward.
        """
        me, pg = self.rank, self.groups.embedding
        counts, parts = [], []
        for table_plan in self._cw_row_stat:
            t = self._by_name[table_plan.table]
            for i, s in enumerate(table_plan.shards):
                if s.rank != me:
                    continue
                keys = tuple(f"{f}#{i}" for f in t.features)
                sub = self._received.select(keys)
                bag_grads = torch.cat(
                    [grad_pooled[:, self._local_col[k] : self._local_col[k] + s.num_cols] for k in keys]
                )
                unique, summed = row_gradients(sub.values, sub.offsets(), bag_grads, sub.weights)
                self._column_shard_row_mean_sq[_shard_table_name(t.name, i)] = (unique, summed.new_empty(0))
                parts.append(summed.square().sum(1))
                counts.append(unique.numel())
        dev = grad_pooled.device
        all_counts = all_gather_rows(torch.tensor(counts, dtype=torch.int64, device=dev).view(-1, 1), pg, name="cw_row_sq_counts")
        all_parts = all_gather_rows(
            (torch.cat(parts) if parts else torch.zeros(0, device=dev)).view(-1, 1), pg, self.stats, "cw_row_sq"
        )
        # Position of each (table, shard) part in its owner's buffer.
        found: dict[tuple[str, int], torch.Tensor] = {}
        for r in range(self.world):
            cursor, n = 0, 0
            sizes = all_counts[r].view(-1).tolist()
            for table_plan in self._cw_row_stat:
                for i, s in enumerate(table_plan.shards):
                    if s.rank == r:
                        found[(table_plan.table, i)] = all_parts[r][cursor : cursor + sizes[n], 0]
                        cursor += sizes[n]
                        n += 1
        for table_plan in self._cw_row_stat:
            t = self._by_name[table_plan.table]
            for i, s in enumerate(table_plan.shards):
                if s.rank == me:
                    unique, _ = self._column_shard_row_mean_sq[_shard_table_name(t.name, i)]
                    total = found[(table_plan.table, 0)].clone()
                    for j in range(1, len(table_plan.shards)):
                        total += found[(table_plan.table, j)]
                    self._column_shard_row_mean_sq[_shard_table_name(t.name, i)] = (unique, total / t.dim)

    def _row_mean_sq(self, group, unique: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
        """Per unique row of one operator group: its mean square gradient over the whole row."""
        msq = summed.square().mean(dim=1)
        # ``unique`` is ascending, so each table's rows are one slice of it (found by bisection:
        # a mask per table would cost rows x tables).
        named = [(t, off) for t, off in zip(group.tables, group.table_row_offsets) if t.name in self._column_shard_row_mean_sq]
        if not named:
            return msq
        bounds = torch.tensor([[off, off + t.num_rows] for t, off in named], dtype=unique.dtype, device=unique.device)
        cuts = torch.searchsorted(unique, bounds.view(-1)).view(-1, 2).tolist()
        for (t, off), (lo, hi) in zip(named, cuts):
            rows, full = self._column_shard_row_mean_sq[t.name]
            if hi - lo != rows.numel() or not torch.equal(unique[lo:hi] - off, rows):
                raise RuntimeError(f"column shard {t.name}: rows differ between lookup and update")
            msq[lo:hi] = full
        return msq

    # ------------------------------------------------------------------ access (collective)
    def full_table(self, name: str) -> torch.Tensor:
        """The whole table assembled from every rank's shards (a collective: call on all ranks)."""
        return self._assemble(name, lambda tbe, local: tbe.table_weight(local).float())

    def full_state(self, name: str) -> dict[str, torch.Tensor]:
        t = self._by_name[name]
        names = self.optimizer.state_columns(t.dim)
        out = {}
        for key, cols in names.items():
            out[key] = self._assemble(name, lambda tbe, local, key=key: tbe.table_state(local)[key], state_cols=cols)
        return out

    def _assemble(self, name: str, get, state_cols: int | None = None) -> torch.Tensor:
        table_plan = self.plan.table(name)
        t = self._by_name[name]
        if table_plan.sharding_type == "data_parallel":
            return get(self.dp, name).clone()
        elementwise = state_cols is None or state_cols == t.dim  # shaped like the weights
        width = t.dim if state_cols is None else state_cols
        full = torch.zeros(t.num_rows, width, device=self.groups.device)
        for i, s in enumerate(table_plan.shards):
            shape = (s.num_rows, s.num_cols if elementwise else width)
            if s.rank == self.rank:
                part = get(self.local, _shard_table_name(name, i)).float().contiguous()
            else:
                part = torch.zeros(shape, device=full.device)
            if self.groups.embedding is not None:
                torch.distributed.broadcast(part, s.rank, group=self.groups.embedding)
            if elementwise:
                full[s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols] = part
            else:  # one value per row (each column shard keeps its own; the last one wins here)
                full[s.row_offset : s.row_offset + s.num_rows] = part
        return full


class _OutputSend(torch.autograd.Function):
    """Starts the output all-to-all (pooled shard outputs back to their source ranks); its
    backward waits for the gradient all-to-all that ``_OutputRecv.backward`` started."""

    @staticmethod
    def forward(ctx, anchor, coll: ShardedEmbeddingCollection, pooled: torch.Tensor, sizes: list[int], state: _Exchange):  # type: ignore[override]
        ctx.coll, ctx.sizes, ctx.state = coll, sizes, state
        me, world = coll.rank, coll.world
        codec = coll.fwd_codec
        pooled = pooled.detach().float().contiguous()
        send = [sizes[s] * codec.row_bytes(coll._out_widths[s]) for s in range(world)]
        recv = [sizes[me] * codec.row_bytes(coll._in_widths[d]) for d in range(world)]
        if coll._hier is None:
            payload = codec.encode(pooled)  # [B_total, row_bytes]
        else:  # flat shards' rows per source, and this rank's finished block sums for its sources
            reduced = coll._hier.reduce_scatter(pooled, sizes, codec, coll.groups.embedding, coll.stats)
            flat = pooled.index_select(1, coll._flat_local_cols)
            chunks, start, pos = [], 0, 0
            for s in range(world):
                rows = flat[start : start + sizes[s]]
                if coll._out_widths[s] > flat.shape[1]:
                    rows = torch.cat([rows, reduced[pos : pos + sizes[s]]], dim=1)
                    pos += sizes[s]
                chunks.append(codec.encode(rows).reshape(-1))
                start += sizes[s]
            payload = torch.cat(chunks)
        state.output = (all_to_all_async(payload.reshape(-1), send, recv, coll.groups.embedding, coll.stats, "output_a2a"),
                        recv, sizes)
        return pooled.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):  # type: ignore[override]
        coll, sizes, state = ctx.coll, ctx.sizes, ctx.state
        codec = coll.bwd_codec
        scale = coll.precision.loss_scale if codec.name == "fp16" else 1.0
        local_dim = coll._local_dims[coll.rank]
        got = state.grad.wait()
        state.grad = None
        if coll._hier is None:
            grad_pooled = codec.decode(got.view(sum(sizes), codec.row_bytes(local_dim)), local_dim)
        else:  # flat shards' gradients, and the block's, which the host's ranks share
            flat_dim = coll._flat_local_cols.numel()
            flat_parts, block_parts = [], []
            splits = [sizes[s] * codec.row_bytes(coll._out_widths[s]) for s in range(coll.world)]
            for s, piece in enumerate(torch.split(got, splits)):
                g = codec.decode(piece.view(sizes[s], codec.row_bytes(coll._out_widths[s])), coll._out_widths[s])
                flat_parts.append(g[:, :flat_dim])
                if coll._out_widths[s] > flat_dim:
                    block_parts.append(g[:, flat_dim:])
            block = torch.cat(block_parts) if block_parts else got.new_zeros(0, 0, dtype=torch.float32)
            block = coll._hier.all_gather(block, sizes, codec, coll.groups.embedding, coll.stats)
            grad_pooled = block.new_zeros(sum(sizes), local_dim)
            grad_pooled.index_copy_(1, coll._flat_local_cols, torch.cat(flat_parts))
            grad_pooled.index_copy_(1, coll._hier.my_local_cols, block)
        if scale != 1.0:
            grad_pooled = grad_pooled / scale
        if coll._cw_row_stat:
            coll._exchange_column_shard_row_sq(grad_pooled)
        return None, None, grad_pooled, None, None


class _OutputRecv(torch.autograd.Function):
    """Waits for the output all-to-all and sums each shard into its column range, beside the
    data-parallel replicas' own output; backward starts sending the gradient columns of each
    shard back to its owner, and hands the replicas theirs."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, coll: ShardedEmbeddingCollection, state: _Exchange,  # type: ignore[override]
                dp_out: torch.Tensor | None):
        pending, recv, sizes = state.output
        state.output = None
        ctx.coll, ctx.sizes, ctx.state = coll, sizes, state
        me = coll.rank
        codec = coll.fwd_codec
        got = pending.wait()
        b = sizes[me]
        alloc = torch.empty if coll._output_all_copied else torch.zeros
        out = alloc(b, coll.total_dim, device=token.device)
        for d, part in enumerate(torch.split(got, recv)):
            dim_d = coll._in_widths[d]
            if dim_d == 0:
                continue
            block = codec.decode(part.view(b, codec.row_bytes(dim_d)), dim_d)
            slots = coll._feature_slots[d]
            if slots is not None:  # whole features: copy dim-wide rows
                dim = coll._common_dim
                out.view(b, -1, dim).index_copy_(1, slots, block.view(b, -1, dim))
            else:
                place(out, block, coll._in_runs[d])
        if dp_out is not None:
            place(out, dp_out, coll._dp_runs)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        coll, sizes, state = ctx.coll, ctx.sizes, ctx.state
        me, world = coll.rank, coll.world
        codec = coll.bwd_codec
        scale = coll.precision.loss_scale if codec.name == "fp16" else 1.0
        grad_out = grad_out.contiguous()
        parts, send = [], []
        for d in range(world):
            dim_d = coll._in_widths[d]
            slots = coll._feature_slots[d]
            if not dim_d:
                g = grad_out.new_zeros(sizes[me], 0)
            elif slots is not None:  # whole features: gather dim-wide rows
                b, dim = sizes[me], coll._common_dim
                g = grad_out.view(b, -1, dim).index_select(1, slots).view(b, dim_d)
            else:
                g = take(grad_out, coll._in_runs[d])
            parts.append(codec.encode(g * scale if scale != 1.0 else g).reshape(-1))
            send.append(sizes[me] * codec.row_bytes(dim_d))
        recv = [sizes[s] * codec.row_bytes(coll._out_widths[s]) for s in range(world)]
        state.grad = all_to_all_async(torch.cat(parts), send, recv, coll.groups.embedding, coll.stats, "grad_a2a")
        grad_dp = take(grad_out, coll._dp_runs) if ctx.needs_input_grad[3] else None
        return grad_out.new_zeros(0), None, None, grad_dp
