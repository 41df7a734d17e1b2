"""Output distribution shared by every sharded type, and its backward.

Each rank returns to every source the pooled outputs of that source's samples for the shards it
owns; the source places each shard's output at its columns, which concatenates column shards
and sums row shards (reduce-scatter as all-to-all plus a local sum, so it also works on gloo,
which has no reduce-scatter). A type may add a stage before this exchange (table-row-wise on
several hosts: ``TypeRuntime.output_stage``). Backward runs the same exchange in reverse; each
type's ``after_output_backward`` then sees the gradient of this rank's shard outputs before the
operator's fused update reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from recscale.comm.collectives import all_to_all_async
from recscale.sharding.column_runs import ColumnRun, column_runs, place, take
from recscale.sharding.context import ShardingContext, StepContext
from recscale.sharding.types import TypeRuntime
from recscale.sharding.types.base import OutputStage


class OutputDist:
    """The column maps of the output exchange (built once) and its two autograd nodes."""

    def __init__(self, context: ShardingContext, runtimes: Sequence[TypeRuntime],
                 replica_features: Sequence[tuple[str, int]]) -> None:
        ctx = self.context = context
        self.backward_hooks = [rt for rt in runtimes if type(rt).after_output_backward is not TypeRuntime.after_output_backward]
        stages = [rt.output_stage for rt in runtimes if rt.output_stage is not None]
        if len(stages) > 1:  # their blocks would need one layout of the payload per stage
            raise NotImplementedError("more than one sharding type with an output stage in one plan")
        self.hierarchy: OutputStage | None = stages[0] if stages else None
        hier = self.hierarchy
        me, world, device = ctx.rank, ctx.world, ctx.device
        self.local_dims = ctx.local_dims
        hier_tables = hier.tables if hier is not None else frozenset()
        # What each owner sends every source flat: all its shards but the hierarchical ones.
        flat = [[sf for sf in served if sf.table not in hier_tables] for served in ctx.served]
        self.flat_local_cols = torch.tensor(
            [ctx.local_col[sf.key] + c for sf in flat[me] for c in range(sf.num_cols)], dtype=torch.int64, device=device
        )
        flat_dims = [sum(sf.num_cols for sf in f) for f in flat]
        # Output columns each owner's flat shards fill, in that owner's output order; with the
        # hierarchy, the owner of local index j also sends sources of index j its host's block.
        colmaps = [[ctx.feature_col[sf.feature] + sf.col_offset + c for sf in f for c in range(sf.num_cols)] for f in flat]
        extra = hier.extra_cols if hier is not None else (lambda sender, receiver: 0)
        block_cols = [
            [ctx.feature_col[f] + c for f, d in b.features for c in range(d)] for b in hier.blocks
        ] if hier is not None else []
        host_of = ctx.groups.topology.host_of
        self.in_widths = [flat_dims[d] + extra(d, me) for d in range(world)]  # columns rank d sends me
        self.out_widths = [flat_dims[me] + extra(me, s) for s in range(world)]  # columns I send rank s
        in_cols = [colmaps[d] + (block_cols[host_of(d)] if extra(d, me) else []) for d in range(world)]
        # Owners whose shards are whole features (full width, not row-split) of one common dim
        # place their block with one copy of dim-wide rows per feature instead of a per-column
        # scatter-add (and gradients go back by the same rows). None: the general path.
        dims = set(ctx.feature_dims)
        common = dims.pop() if len(dims) == 1 else None
        order = {f: i for i, f in enumerate(ctx.feature_names)}
        self.feature_slots = [
            torch.tensor([order[sf.feature] for sf in served], dtype=torch.int64, device=device)
            if common is not None and served and hier is None and all(
                not sf.routes_by_row and sf.col_offset == 0 and sf.num_cols == common for sf in served)
            else None
            for served in ctx.served
        ]
        self.common_dim = common
        # The others' blocks go in by runs of columns, in rank order; the first writer of a
        # column copies, later ones (row shards' partial sums) add.
        written = [False] * ctx.total_dim
        for served, slots in zip(ctx.served, self.feature_slots):
            if slots is not None:
                for sf in served:
                    written[ctx.feature_col[sf.feature] : ctx.feature_col[sf.feature] + sf.num_cols] = [True] * sf.num_cols
        self.in_runs = [() if slots is not None else column_runs(cols, written) for cols, slots in zip(in_cols, self.feature_slots)]
        self.replica_runs: tuple[ColumnRun, ...] = ()
        if replica_features:
            self.replica_runs = column_runs([ctx.feature_col[f] + c for f, d in replica_features for c in range(d)], written)
        # Every output column is written by a copy: no need to zero the output first.
        self.output_all_copied = all(written)

    def start(self, anchor: torch.Tensor, pooled: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Start sending this rank's pooled shard outputs home; returns the token ``finish`` takes."""
        return _OutputSend.apply(anchor, self, pooled, step)

    def finish(self, token: torch.Tensor, step: StepContext, replica_out: torch.Tensor | None) -> torch.Tensor:
        """Wait for this rank's samples' outputs and assemble ``[B, total dim]`` (with the
        replicated tables' own output, pooled meanwhile)."""
        return _OutputRecv.apply(token, self, step, replica_out)


class _OutputSend(torch.autograd.Function):
    """Starts the output all-to-all (pooled shard outputs back to their source ranks); its
    backward waits for the gradient all-to-all that ``_OutputRecv.backward`` started."""

    @staticmethod
    def forward(ctx, anchor, dist: OutputDist, pooled: torch.Tensor, step: StepContext):  # type: ignore[override]
        ctx.dist, ctx.step = dist, step
        sc = dist.context
        sizes = step.sizes
        me, world = sc.rank, sc.world
        codec = sc.forward_codec
        pooled = pooled.detach().float().contiguous()
        send = [sizes[s] * codec.row_bytes(dist.out_widths[s]) for s in range(world)]
        recv = [sizes[me] * codec.row_bytes(dist.in_widths[d]) for d in range(world)]
        if dist.hierarchy is None:
            payload = codec.encode(pooled)  # [B_total, row_bytes]
        else:  # flat shards' rows per source, and this rank's finished block sums for its sources
            reduced = dist.hierarchy.reduce_scatter(pooled, sizes, codec, sc.groups.embedding, sc.stats)
            flat = pooled.index_select(1, dist.flat_local_cols)
            chunks, start, pos = [], 0, 0
            for s in range(world):
                rows = flat[start : start + sizes[s]]
                if dist.out_widths[s] > flat.shape[1]:
                    rows = torch.cat([rows, reduced[pos : pos + sizes[s]]], dim=1)
                    pos += sizes[s]
                chunks.append(codec.encode(rows).reshape(-1))
                start += sizes[s]
            payload = torch.cat(chunks)
        step.output = (all_to_all_async(payload.reshape(-1), send, recv, sc.groups.embedding, sc.stats, "output_a2a"), recv)
        return pooled.new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):  # type: ignore[override]
        dist, step = ctx.dist, ctx.step
        sc = dist.context
        sizes = step.sizes
        codec = sc.backward_codec
        scale = sc.precision.loss_scale if codec.name == "fp16" else 1.0
        local_dim = dist.local_dims[sc.rank]
        got = step.grad.wait()
        step.grad = None
        if dist.hierarchy is None:
            grad_pooled = codec.decode(got.view(sum(sizes), codec.row_bytes(local_dim)), local_dim)
        else:  # flat shards' gradients, and the block's, which the host's ranks share
            flat_dim = dist.flat_local_cols.numel()
            flat_parts, block_parts = [], []
            splits = [sizes[s] * codec.row_bytes(dist.out_widths[s]) for s in range(sc.world)]
            for s, piece in enumerate(torch.split(got, splits)):
                g = codec.decode(piece.view(sizes[s], codec.row_bytes(dist.out_widths[s])), dist.out_widths[s])
                flat_parts.append(g[:, :flat_dim])
                if dist.out_widths[s] > flat_dim:
                    block_parts.append(g[:, flat_dim:])
            block = torch.cat(block_parts) if block_parts else got.new_zeros(0, 0, dtype=torch.float32)
            block = dist.hierarchy.all_gather(block, sizes, codec, sc.groups.embedding, sc.stats)
            grad_pooled = block.new_zeros(sum(sizes), local_dim)
            grad_pooled.index_copy_(1, dist.flat_local_cols, torch.cat(flat_parts))
            grad_pooled.index_copy_(1, dist.hierarchy.my_local_cols, block)
        if scale != 1.0:
            grad_pooled = grad_pooled / scale
        for hook in dist.backward_hooks:
            hook.after_output_backward(grad_pooled, step)
        return None, None, grad_pooled, None


class _OutputRecv(torch.autograd.Function):
    """Waits for the output all-to-all and sums each shard into its column range, beside the
    data-parallel replicas' own output; backward starts sending the gradient columns of each
    shard back to its owner, and hands the replicas theirs."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, dist: OutputDist, step: StepContext,  # type: ignore[override]
                replica_out: torch.Tensor | None):
        pending, recv = step.output
        step.output = None
        ctx.dist, ctx.step = dist, step
        sc = dist.context
        sizes = step.sizes
        codec = sc.forward_codec
        got = pending.wait()
        b = sizes[sc.rank]
        alloc = torch.empty if dist.output_all_copied else torch.zeros
        out = alloc(b, sc.total_dim, device=token.device)
        for d, part in enumerate(torch.split(got, recv)):
            dim_d = dist.in_widths[d]
            if dim_d == 0:
                continue
            block = codec.decode(part.view(b, codec.row_bytes(dim_d)), dim_d)
            slots = dist.feature_slots[d]
            if slots is not None:  # whole features: copy dim-wide rows
                dim = dist.common_dim
                out.view(b, -1, dim).index_copy_(1, slots, block.view(b, -1, dim))
            else:
                place(out, block, dist.in_runs[d])
        if replica_out is not None:
            place(out, replica_out, dist.replica_runs)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        dist, step = ctx.dist, ctx.step
        sc = dist.context
        sizes = step.sizes
        me, world = sc.rank, sc.world
        codec = sc.backward_codec
        scale = sc.precision.loss_scale if codec.name == "fp16" else 1.0
        grad_out = grad_out.contiguous()
        parts, send = [], []
        for d in range(world):
            dim_d = dist.in_widths[d]
            slots = dist.feature_slots[d]
            if not dim_d:
                g = grad_out.new_zeros(sizes[me], 0)
            elif slots is not None:  # whole features: gather dim-wide rows
                b, dim = sizes[me], dist.common_dim
                g = grad_out.view(b, -1, dim).index_select(1, slots).view(b, dim_d)
            else:
                g = take(grad_out, dist.in_runs[d])
            parts.append(codec.encode(g * scale if scale != 1.0 else g).reshape(-1))
            send.append(sizes[me] * codec.row_bytes(dim_d))
        recv = [sizes[s] * codec.row_bytes(dist.out_widths[s]) for s in range(world)]
        step.grad = all_to_all_async(torch.cat(parts), send, recv, sc.groups.embedding, sc.stats, "grad_a2a")
        grad_replica = take(grad_out, dist.replica_runs) if ctx.needs_input_grad[3] else None
        return grad_out.new_zeros(0), None, None, grad_replica
