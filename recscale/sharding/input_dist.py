"""Input distribution shared by every sharded type: each rank sends every other rank the ids of
its own samples that the receiver's shards serve (row-split types route each id to the shard
holding its row, ``ShardingType.route_ids``), lengths first, then ids and weights. Mean
pooling is folded into per-id weights here, at the source, where the whole bag is known."""

from __future__ import annotations

from collections.abc import Callable

import torch

from recscale.comm.collectives import all_to_all_async, all_to_all_unsized_async
from recscale.comm.errors import DistributedError
from recscale.sharding.context import ShardingContext, StepContext
from recscale.sharding.types import SHARDING_TYPES
from recscale.sharding.types.base import FeatureIds
from recscale.sparse import JaggedBatch, permute_bags


class InputDist:
    """Starts one batch's id exchange (``start``); the returned step context waits for it."""

    def __init__(self, context: ShardingContext, replicated_only: bool) -> None:
        self.context = context
        # Every table replicated: only the batch sizes travel (for the global batch of the loss).
        self.replicated_only = replicated_only
        tables = context.tables
        self._mean_features = {f for t in tables if t.pooling == "mean" for f in t.features}
        # Ids travel as int32 when every table is small enough: half the bytes.
        self._id_wire_dtype = torch.int32 if max(t.num_rows for t in tables) < 2**31 else torch.int64
        self._routed_plans = [table_plan for table_plan in context.plan.tables
                              if SHARDING_TYPES[table_plan.sharding_type].routes_by_row]
        self._row_bounds = {
            table_plan.table: torch.tensor([s.row_offset for s in table_plan.shards]
                                           + [context.by_name[table_plan.table].num_rows], device=context.device)
            for table_plan in self._routed_plans
        }
        self._bag_order_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def start(self, batch: JaggedBatch) -> StepContext:
        ctx = self.context
        if self.replicated_only:
            ones = [1] * ctx.world
            b = torch.full((ctx.world,), batch.batch_size, dtype=torch.int64, device=ctx.device)
            pending = all_to_all_async(b, ones, ones, ctx.groups.embedding, None, "batch_sizes")
            return StepContext(batch, lambda: (batch, [int(v) for v in pending.wait().tolist()]))
        return StepContext(batch, self._distribute(batch))

    def _feature_ids(self, batch: JaggedBatch) -> dict[str, FeatureIds]:
        """Per feature: ids, lengths and weights, mean pooling folded into the weights."""
        out = {}
        offsets = batch.offsets()
        b = batch.batch_size
        for k, f in enumerate(batch.keys):
            if f not in self.context.feature_col:
                continue
            lo, hi = int(offsets[k * b]), int(offsets[(k + 1) * b])
            vals, lens = batch.values[lo:hi], batch.lengths[k * b : (k + 1) * b]
            w = None if batch.weights is None else batch.weights[lo:hi].float()
            if f in self._mean_features:
                inv = torch.repeat_interleave(1.0 / lens.clamp(min=1).float(), lens, output_size=vals.numel())
                w = inv if w is None else w * inv
            out[f] = (vals, lens, w)
        return out

    def _distribute(self, batch: JaggedBatch) -> Callable[[], tuple[JaggedBatch, list[int]]]:
        """Start the exchanges of lengths (each rank's part led by its batch size), ids and
        weights; the returned function waits for them and orders the received bags for the
        operator. No rank needs to know in advance how much the others send it."""
        ctx = self.context
        me, b = ctx.rank, batch.batch_size
        need_weights = batch.weights is not None or bool(self._mean_features)
        per_feature = self._feature_ids(batch)
        routed: dict[tuple[str, int, str], FeatureIds] = {}
        for table_plan in self._routed_plans:
            kind = SHARDING_TYPES[table_plan.sharding_type]
            by_shard = kind.route_ids(table_plan, ctx.by_name[table_plan.table], self._row_bounds[table_plan.table],
                                      per_feature, b)
            routed.update({(table_plan.table, row, f): ids for (row, f), ids in by_shard.items()})
        lens_out, vals_out, wts_out = [], [], []
        len_splits, val_splits = [], []
        for served in ctx.served:
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
        dev = ctx.device
        head = torch.tensor([b], dtype=torch.int64, device=dev)
        lens_parts: list[torch.Tensor] = []
        cursor = 0
        for served in ctx.served:  # each destination's lengths, led by this rank's batch size
            lens_parts.append(head)
            lens_parts.extend(lens_out[cursor : cursor + len(served)])
            cursor += len(served)
        lens_send = torch.cat(lens_parts).to(torch.int64)
        vals_send = torch.cat(vals_out) if vals_out else torch.zeros(0, dtype=torch.int64, device=dev)
        parts = [(lens_send, len_splits, "input_lengths"), (vals_send.to(self._id_wire_dtype), val_splits, "input_ids")]
        if need_weights:
            parts.append((torch.cat(wts_out) if wts_out else torch.zeros(0, device=dev), val_splits, "input_weights"))
        # one exchange of the sizes for all of them (over TCP a round trip each would cost as much)
        lens_pending, ids_pending, *rest = all_to_all_unsized_async(parts, ctx.groups.embedding, ctx.stats)
        wts_pending = rest[0] if rest else None
        k = len(ctx.served[me])

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
        ctx = self.context
        mine = ctx.served[ctx.rank]
        k = len(mine)
        if k == 0:
            return JaggedBatch((), vals_recv, lens_recv, wts_recv)
        key = tuple(sizes)
        order = self._bag_order_cache.get(key)
        if order is None:  # depends only on the batch sizes: built once, not every step
            bag_order = []
            src_start = [0]
            for s in range(ctx.world):
                src_start.append(src_start[-1] + k * sizes[s])
            for j in range(k):
                for s in range(ctx.world):
                    start = src_start[s] + j * sizes[s]
                    bag_order.append(torch.arange(start, start + sizes[s], device=ctx.device))
            order = torch.cat(bag_order)
            if len(self._bag_order_cache) > 8:
                self._bag_order_cache.clear()
            self._bag_order_cache[key] = order
        vals, lens, wts = permute_bags(vals_recv, lens_recv, wts_recv, order)
        return JaggedBatch(tuple(sf.key for sf in mine), vals, lens, wts)
