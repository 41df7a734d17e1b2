"""Table-batched embedding bags with the optimizer fused into backward.

All tables of the same dim and dtype share one weight buffer with per-table row offsets, so a
batch of every feature is pooled by a single ``embedding_bag`` call. Backward never builds a
gradient of table size: it turns pooled-output gradients into per-id gradients, sums the
gradients of duplicate rows (sorted, so the result is the same on every run), and hands the
unique rows to the optimizer, which updates each row exactly once.

Two kernels compute the same thing: the native CPU kernels (``native.py``: C++, SIMD, threads;
pooled output written sample-major straight from the key-major ids; backward and optimizer
fused in one pass) and the pure-PyTorch ones below (any device, any storage dtype). The
``kernel`` argument (``model.embedding_kernel``) picks; ``auto`` takes the native one for fp32
tables in CPU memory whenever it builds.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from recscale.embedding import native, tier_hooks
from recscale.embedding.config import TableConfig, check_tables
from recscale.embedding.module import EmbeddingInput, LocalInput, ReadyOutput
from recscale.embedding.optimizers import SparseOptimizer
from recscale.embedding.storage import DenseRowStorage, RowStorage

if TYPE_CHECKING:
    from recscale.embedding.tiered import StorageFactory
from recscale.host_memory import advise_huge_pages
from recscale.sparse import JaggedBatch, SparseInputError, permute_bags


@dataclass
class TableGroup:
    """Tables that share one row storage (same dim and dtype)."""

    dim: int
    dtype: torch.dtype
    tables: list[TableConfig]
    features: tuple[str, ...]
    table_row_offsets: list[int]  # first row of each table in the group buffer
    feature_row_offset: torch.Tensor  # [num features] first row of each feature's table
    feature_is_mean: torch.Tensor  # [num features] bool
    storage: RowStorage
    feature_num_rows: torch.Tensor  # [num features] rows of each feature's table
    step: int = 0
    # Modified-row tracking for differential checkpoints: a uint8 flag per row, set to 1 for
    # every row the backward updates; None (no cost) unless a checkpoint tracker turns it on.
    touched: torch.Tensor | None = None
    has_mean: bool = field(init=False)
    num_rows: int = field(init=False)
    feature_mean_u8: torch.Tensor = field(init=False)  # feature_is_mean as uint8, on the CPU
    _feature_index: dict[tuple[str, ...], torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.has_mean = bool(self.feature_is_mean.any())
        self.num_rows = sum(t.num_rows for t in self.tables)
        self.feature_mean_u8 = self.feature_is_mean.to(device="cpu", dtype=torch.uint8)

    def feature_index(self, keys: tuple[str, ...]) -> torch.Tensor:
        """Position of each of this group's features among a batch's ``keys`` (cached)."""
        idx = self._feature_index.get(keys)
        if idx is None:
            idx = torch.tensor([keys.index(f) for f in self.features], dtype=torch.int64)
            self._feature_index[keys] = idx
        return idx


INIT_CHUNK_ROWS = 4096


def init_rows(table: TableConfig, seed: int, row_offset: int = 0, num_rows: int | None = None,
              col_offset: int = 0, num_cols: int | None = None) -> torch.Tensor:
    """Initial values of a rectangle of one table.

    Rows are drawn in fixed chunks, each from a generator seeded by (seed, table, chunk), so the
    value of a cell depends only on the table, the seed and its position: a shard built on any
    rank starts from exactly the rows the whole table would have.
    """
    num_rows = table.num_rows - row_offset if num_rows is None else num_rows
    num_cols = table.dim - col_offset if num_cols is None else num_cols
    lo, hi = table.bounds
    out = torch.empty(num_rows, num_cols, dtype=torch.float32)
    base = (seed * 1_000_003 + zlib.crc32(table.name.encode())) % (2**62)
    first, last = row_offset // INIT_CHUNK_ROWS, (row_offset + num_rows - 1) // INIT_CHUNK_ROWS
    for chunk in range(first, last + 1):
        start = chunk * INIT_CHUNK_ROWS
        rows = min(INIT_CHUNK_ROWS, table.num_rows - start)
        gen = torch.Generator().manual_seed(base * 65_537 + chunk)
        block = torch.empty(rows, table.dim).uniform_(lo, hi, generator=gen)
        a, b = max(start, row_offset), min(start + rows, row_offset + num_rows)
        out[a - row_offset : b - row_offset] = block[a - start : b - start, col_offset : col_offset + num_cols]
    return out.to(table.torch_dtype)


def init_table_rows(table: TableConfig, seed: int) -> torch.Tensor:
    """Initial rows of a whole table (see ``init_rows``)."""
    return init_rows(table, seed)


def group_tables(tables: Sequence[TableConfig], apart: Collection[str] = ()) -> list[list[TableConfig]]:
    """Tables that share a weight buffer (same dim and dtype), in first-appearance order.
    Tables named in ``apart`` (their update needs a whole-row statistic from elsewhere) get
    groups of their own, so the others keep the one-pass fused update."""
    by_kind: dict[tuple[int, torch.dtype, bool], list[TableConfig]] = {}
    for t in tables:
        by_kind.setdefault((t.dim, t.torch_dtype, t.name in apart), []).append(t)
    return list(by_kind.values())


def output_feature_order(tables: Sequence[TableConfig], apart: Collection[str] = ()) -> tuple[str, ...]:
    """The order of features in the operator's output columns."""
    return tuple(f for group in group_tables(tables, apart) for t in group for f in t.features)


# Takes a group and this replica's (unique rows, summed gradients) and returns every replica's,
# combined in one fixed order (a row may repeat); the operator sums the repeats in that order,
# so every replica applies the same update.
GradReducer = Callable[["TableGroup", torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
RowStatFn = Callable[["TableGroup", torch.Tensor, torch.Tensor], torch.Tensor]
InitFn = Callable[[TableConfig], torch.Tensor]


class TableBatchedEmbeddingBags(nn.Module):
    """Pooled lookups of many tables in one operator; updates rows itself during backward.

    ``forward(batch)`` returns ``[B, sum of feature dims]`` in ``self.feature_names`` order.
    The optimizer runs inside ``loss.backward()``; there is no separate ``step()``.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: SparseOptimizer,
        seed: int = 0,
        device: torch.device | str = "cpu",
        init_fn: InitFn | None = None,
        grad_reducer: GradReducer | None = None,
        row_stat_fn: RowStatFn | None = None,
        kernel: str = "auto",
        row_stat_tables: Collection[str] = (),
        storage_factory: StorageFactory | None = None,
    ) -> None:
        """``init_fn`` gives a table's initial rows (default: ``init_table_rows``);
        ``grad_reducer`` combines (unique rows, summed gradients) of every replica before the
        optimizer runs (data-parallel tables); ``row_stat_fn`` gives each unique row's mean square
        gradient over its whole row when only some of its columns live here (column shards), for
        the tables named in ``row_stat_tables`` (grouped apart: the rest keep the fused update);
        ``kernel`` is ``auto`` (native where it builds and applies, else torch), ``native``
        (error if it cannot be built) or ``torch``; ``RECSCALE_EMBEDDING_KERNEL`` overrides it;
        ``storage_factory`` may give a group another row storage (None: dense, in RAM)."""
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ValueError("tables: at least one embedding table is required")
        check_tables(tables)
        self.tables = tables
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.grad_reducer = grad_reducer
        self.row_stat_fn = row_stat_fn
        self.row_stat_tables = frozenset(row_stat_tables)
        self.kernel = native.resolve_choice(kernel)
        if self.kernel == "native":
            native.require()
        elif self.kernel == "auto" and self.device.type == "cpu":
            native.load()  # a first-use compile happens here, not inside the first (timed) step
        self.seed = seed
        self._init_fn = init_fn or (lambda t: init_table_rows(t, seed))
        self._storage_factory = storage_factory
        self.groups: list[TableGroup] = []
        for members in group_tables(tables, self.row_stat_tables):
            self.groups.append(self._build_group(members[0].dim, members[0].torch_dtype, members, seed))
        self.feature_names: tuple[str, ...] = tuple(f for g in self.groups for f in g.features)
        self.feature_dims: tuple[int, ...] = tuple(g.dim for g in self.groups for _ in g.features)
        self.num_rows_by_feature = {f: t.num_rows for t in tables for f in t.features}
        # Anchor that makes the pooled output require grad, so autograd calls our backward.
        self._grad_anchor = nn.Parameter(torch.zeros(0), requires_grad=True)
        self._register_state_dict_hook(_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._load_hook, with_module=False)

    def _build_group(self, dim: int, dtype: torch.dtype, tables: list[TableConfig], seed: int) -> TableGroup:
        offsets, rows = [], 0
        for t in tables:
            offsets.append(rows)
            rows += t.num_rows
        storage = None
        if self._storage_factory is not None:
            storage = self._storage_factory(tables, offsets, dim, dtype, self.optimizer.state_columns(dim))
        if storage is None:
            # One buffer filled table by table: a concatenation would hold every table twice at peak.
            weight = torch.empty(rows, dim, dtype=dtype, device=self.device)
            advise_huge_pages(weight)  # before the first write: random rows, fewer TLB misses
            # On the meta device (a model about to be sharded: ``recscale.sharding.shard``) the module
            # only describes its tables; no rows exist, so none are drawn.
            for t, off in zip(tables, offsets) if weight.device.type != "meta" else ():
                weight[off : off + t.num_rows].copy_(self._init_fn(t))
            storage = DenseRowStorage(weight, self.optimizer.state_columns(dim))
        features = tuple(f for t in tables for f in t.features)
        feat_off = [off for t, off in zip(tables, offsets) for _ in t.features]
        feat_mean = [t.pooling == "mean" for t in tables for _ in t.features]
        index_device = self.device if self.device.type != "meta" else torch.device("cpu")  # small, read on the host
        return TableGroup(
            dim=dim,
            dtype=dtype,
            tables=tables,
            features=features,
            table_row_offsets=offsets,
            feature_row_offset=torch.tensor(feat_off, dtype=torch.int64, device=index_device),
            feature_is_mean=torch.tensor(feat_mean, dtype=torch.bool, device=index_device),
            storage=storage,
            feature_num_rows=torch.tensor([t.num_rows for t in tables for _ in t.features], dtype=torch.int64),
        )

    # ------------------------------------------------------------------ forward
    def start_input_dist(self, batch: JaggedBatch) -> LocalInput:
        """Nothing travels: the batch is pooled here (``EmbeddingModule``)."""
        return LocalInput(batch)

    def start_forward(self, batch: JaggedBatch | EmbeddingInput) -> ReadyOutput:
        ids = batch if isinstance(batch, JaggedBatch) else batch.wait()
        return ReadyOutput(self(ids), ids.batch_size)

    def forward(self, batch: JaggedBatch | EmbeddingInput) -> torch.Tensor:
        if not isinstance(batch, JaggedBatch):
            batch = batch.wait()
        if (self._storage_factory is not None and not torch.is_grad_enabled() and batch.batch_size > 1
                and not tier_hooks.fits_caches(self, batch)):
            # An evaluation batch larger than a cache is pooled in parts (samples pool apart).
            half = batch.batch_size // 2
            return torch.cat([self(part) for part in batch.split([half, batch.batch_size - half])])
        outs, offsets = [], None
        for g in self.groups:
            mod = self._native_kernels(g)
            if mod is None:
                outs.append(self._pool_group(g, batch.select(g.features)))
                continue
            if offsets is None:
                offsets = batch.offsets()
            outs.append(self._pool_group_native(mod, g, batch, offsets))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def runs_native(self) -> bool:
        """Whether every group's lookups and updates run the native kernels."""
        return all(self._native_kernels(g) is not None for g in self.groups)

    def _native_kernels(self, g: TableGroup):
        """The native kernels when they serve this group: fp32 rows in one dense CPU buffer."""
        if self.kernel == "torch" or self.device.type != "cpu":
            return None
        dense = isinstance(g.storage, DenseRowStorage) or getattr(g.storage, "native_slots", False)
        if g.dtype != torch.float32 or not dense or g.num_rows >= 2**32:
            return None
        return native.load()

    def _pool_group_native(self, mod, g: TableGroup, batch: JaggedBatch, offsets: torch.Tensor) -> torch.Tensor:
        values = batch.values if batch.values.dtype in (torch.int64, torch.int32) else batch.values.long()
        weights = batch.weights
        if weights is not None and weights.dtype != torch.float32:
            weights = weights.float()
        feat_idx = g.feature_index(batch.keys)
        row_off, feat_rows, num_rows = g.feature_row_offset, g.feature_num_rows, g.num_rows
        if not isinstance(g.storage, DenseRowStorage):  # a cache: the kernels see slot ids
            values, row_off, feat_rows, num_rows = _slot_values(g, values, offsets, batch.batch_size, feat_idx)
        args = (values.contiguous(), offsets, batch.batch_size, feat_idx,
                None if weights is None else weights.contiguous(), row_off, feat_rows, num_rows)  # fmt: skip
        if torch.is_grad_enabled():
            return _NativeFusedPooling.apply(self._grad_anchor, self, g, mod, batch.keys, args)
        return _native_pool(mod, g, batch.keys, *args)

    def _pool_group(self, g: TableGroup, batch: JaggedBatch) -> torch.Tensor:
        k, b = len(g.features), batch.batch_size
        lengths = batch.lengths
        n = batch.values.numel()
        per_key = lengths.view(k, b).sum(1)
        rows = batch.values + torch.repeat_interleave(g.feature_row_offset, per_key, output_size=n)
        weights = batch.weights
        if g.has_mean:
            inv = 1.0 / lengths.clamp(min=1).to(torch.float32)
            is_mean = g.feature_is_mean.repeat_interleave(b)
            bag_scale = torch.where(is_mean, inv, torch.ones_like(inv))
            id_scale = torch.repeat_interleave(bag_scale, lengths, output_size=n)
            weights = id_scale if weights is None else weights.to(torch.float32) * id_scale
        # Pool bags in sample-major order so the output is [B, K * dim] without a transpose:
        # permuting 8-byte ids is far cheaper than permuting dim-wide output rows.
        rows, lengths_sm, weights = _to_sample_major(rows, lengths, weights, k, b)
        slots = g.storage.slots_for(rows)
        offsets = torch.zeros(k * b + 1, dtype=torch.int64, device=slots.device)
        torch.cumsum(lengths_sm, 0, out=offsets[1:])
        if torch.is_grad_enabled():
            pooled = _FusedPooling.apply(self._grad_anchor, self, g, slots, offsets, weights)
        else:
            pooled = _pool(g.storage.weight, slots, offsets, weights)
        return pooled.view(b, k * g.dim)

    # ------------------------------------------------------------------ fused backward
    def _apply_gradients(self, g: TableGroup, unique: torch.Tensor, summed: torch.Tensor, mod=None,
                         step_args: tuple[int, list[float]] | None = None) -> None:
        """Update each unique row once with its summed gradient (with ``mod`` and ``step_args``:
        by the native kernel's update, which mirrors the optimizer's definition)."""
        if self.grad_reducer is not None:
            rows, grads = self.grad_reducer(g, unique, summed)
            unique, summed = row_gradients(rows, torch.arange(rows.numel() + 1, device=rows.device), grads, None)
        g.step += 1
        row_mean_sq = None
        if self._needs_row_stat(g):
            row_mean_sq = self._row_stat(g, unique, summed)
        if mod is not None and step_args is not None:
            state = g.storage.state_tensors()
            states = [state[name] for name in self.optimizer.state_columns(g.dim)]
            msq = None if row_mean_sq is None else row_mean_sq.float().contiguous()
            mod.apply_rows(unique.contiguous(), summed.float().contiguous(), msq, g.storage.weight, states, *step_args,
                           g.touched)
            return
        self.optimizer.apply(g.storage, unique, summed, g.step, row_mean_sq)
        if g.touched is not None:
            g.touched.index_fill_(0, unique, 1)

    def _row_stat(self, g: TableGroup, unique: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
        """``row_stat_fn`` of the unique rows; a storage that updates cache slots (the SSD tier)
        has them turned into ascending group rows first, the statistic put back in slot order."""
        rows_of = getattr(g.storage, "rows_of_slots", None)
        assert self.row_stat_fn is not None
        if rows_of is None:
            return self.row_stat_fn(g, unique, summed)
        rows = rows_of(unique)
        order = torch.argsort(rows)
        stat = self.row_stat_fn(g, rows[order], summed[order])
        out = torch.empty_like(stat)
        out[order] = stat
        return out

    def _needs_row_stat(self, g: TableGroup) -> bool:
        return (
            self.row_stat_fn is not None and self.optimizer.uses_row_mean_sq
            and any(t.name in self.row_stat_tables for t in g.tables)
        )

    def _native_backward(self, mod, g: TableGroup, grad: torch.Tensor, args: tuple) -> None:
        """The native twin of ``row_gradients`` + ``_apply_gradients``: one pass that sums each
        unique row's gradient (same order as the torch kernel) and updates it, marking it in
        ``g.touched``. Replicas of data-parallel tables gather their row gradients in between; a
        column shard that needs its whole row's statistic sums first, then updates natively
        with it; an optimizer the kernel does not mirror updates in Python."""
        values, offsets, batch_size, feat_idx, weights, row_off, _, num_rows = args
        is_mean = g.feature_mean_u8
        opt = self.optimizer
        step_args = native.optimizer_args(opt, g.step + 1)
        needs_row_stat = self._needs_row_stat(g)
        if step_args is None or needs_row_stat or self.grad_reducer is not None:
            unique, summed = mod.row_gradients(
                grad, values, offsets, batch_size, feat_idx, row_off, is_mean, weights, num_rows, g.dim
            )
            if step_args is None or needs_row_stat:
                self._apply_gradients(g, unique, summed, mod, step_args)
                return
            # Replicas agree first: gather every replica's summed rows, then let the fused
            # kernel sum the gathered rows (each a bag of one id, in gather order) and update.
            values, grad = self.grad_reducer(g, unique, summed)
            grad, batch_size, weights = grad.contiguous(), values.numel(), None
            offsets = torch.arange(batch_size + 1, device=values.device)
            feat_idx = row_off = torch.zeros(1, dtype=torch.int64, device=values.device)
            is_mean = torch.zeros(1, dtype=torch.uint8, device=values.device)
        g.step += 1
        kind, hp = step_args
        state = g.storage.state_tensors()
        states = [state[name] for name in opt.state_columns(g.dim)]
        mod.backward_update(
            grad, values, offsets, batch_size, feat_idx, row_off, is_mean, weights,
            g.storage.weight, states, kind, hp, g.touched,
        )  # fmt: skip

    # ------------------------------------------------------------------ access
    def set_learning_rate(self, lr: float) -> None:
        """The rate of the fused update from the next backward on (a learning-rate schedule)."""
        self.optimizer = replace(self.optimizer, lr=lr)

    def validate(self, batch: JaggedBatch) -> None:
        """Check ids against table sizes (clear error naming the feature)."""
        missing = [f for f in self.feature_names if f not in batch.keys]
        if missing:
            raise SparseInputError(f"batch lacks features {missing} that the embedding tables expect")
        batch.validate(self.num_rows_by_feature)

    def _locate(self, table: str) -> tuple[TableGroup, int, TableConfig]:
        for g in self.groups:
            for t, off in zip(g.tables, g.table_row_offsets):
                if t.name == table:
                    return g, off, t
        raise KeyError(f"no embedding table named '{table}'")

    def table_weight(self, table: str) -> torch.Tensor:
        """A view of one table's rows (in its storage dtype); a copy for a tiered storage."""
        g, off, t = self._locate(table)
        if not isinstance(g.storage, DenseRowStorage):
            return g.storage.read_rows(off, t.num_rows)[0]  # type: ignore[attr-defined]
        return g.storage.weight[off : off + t.num_rows]

    def table_state(self, table: str) -> dict[str, torch.Tensor]:
        """Views of one table's optimizer state rows; copies for a tiered storage."""
        g, off, t = self._locate(table)
        if not isinstance(g.storage, DenseRowStorage):
            return g.storage.read_rows(off, t.num_rows)[1]  # type: ignore[attr-defined]
        return {k: v[off : off + t.num_rows] for k, v in g.storage.state_tensors().items()}

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # Follow device moves (model.to(device)); the storage keeps its own dtypes.
        device = fn(torch.empty(0)).device
        if device != self.device:
            self.device = device
            for g in self.groups:
                _move_group(g, device)
        return super()._apply(fn, recurse)

    def _load_hook(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if not all(isinstance(g.storage, DenseRowStorage) for g in self.groups):
            raise NotImplementedError("loading rows into tables on the SSD tier is not supported; place them in RAM")
        for t in self.tables:
            key = f"{prefix}tables.{t.name}.weight"
            if key in state_dict:
                src = state_dict.pop(key)
                dst = self.table_weight(t.name)
                if src.shape != dst.shape:
                    error_msgs.append(f"{key}: shape {tuple(src.shape)} does not match table {tuple(dst.shape)}")
                    continue
                dst.copy_(src)
            elif strict:
                missing_keys.append(key)
            for name, dst in self.table_state(t.name).items():
                skey = f"{prefix}tables.{t.name}.{name}"
                if skey in state_dict:
                    dst.copy_(state_dict.pop(skey))
                elif strict:
                    missing_keys.append(skey)
        step_key = f"{prefix}step"
        if step_key in state_dict:
            step = int(state_dict.pop(step_key))
            for g in self.groups:
                g.step = step


def _state_dict_hook(module: TableBatchedEmbeddingBags, state_dict, prefix, local_metadata):
    state_dict.pop(f"{prefix}_grad_anchor", None)
    for t in module.tables:
        state_dict[f"{prefix}tables.{t.name}.weight"] = module.table_weight(t.name)
        for name, v in module.table_state(t.name).items():
            state_dict[f"{prefix}tables.{t.name}.{name}"] = v
    state_dict[f"{prefix}step"] = torch.tensor(module.groups[0].step)
    return state_dict


def _move_group(g: TableGroup, device: torch.device) -> None:
    st = g.storage
    if not isinstance(st, DenseRowStorage):
        raise NotImplementedError(f"{type(st).__name__} cannot be moved between devices")
    st._weight = st._weight.to(device)
    st._state = {k: v.to(device) for k, v in st._state.items()}
    g.feature_row_offset = g.feature_row_offset.to(device)
    g.feature_is_mean = g.feature_is_mean.to(device)
    if g.touched is not None:
        g.touched = g.touched.to(device)


def _to_sample_major(
    ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, k: int, b: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder key-major bags (feature, sample) into sample-major (sample, feature) order."""
    if k == 1 or b == 1:
        return ids, lengths, weights
    if ids.numel() == k * b and bool((lengths == 1).all()):  # one id per bag: a transpose
        ids = ids.view(k, b).t().reshape(-1)
        if weights is not None:
            weights = weights.view(k, b).t().reshape(-1)
        return ids, lengths, weights
    bag_order = torch.arange(k * b, device=ids.device).view(k, b).t().reshape(-1)
    return permute_bags(ids, lengths, weights, bag_order)


def _pool(weight: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    if w is not None and w.dtype != weight.dtype:
        w = w.to(weight.dtype)
    out = F.embedding_bag(slots, weight, offsets, mode="sum", per_sample_weights=w, include_last_offset=True)
    return out if out.dtype == torch.float32 else out.float()


def row_gradients(
    slots: torch.Tensor, offsets: torch.Tensor, grad_pooled: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows (ascending) and the summed gradient of each, never forming per-id gradients.

    The gradient of row r is the sum, over the ids equal to r, of (id weight) x (gradient of the
    id's bag). That is itself an embedding-bag: one bag per unique row, listing the bags its ids
    came from, pooled over ``grad_pooled``. A stable sort fixes the order of every sum, so the
    result is the same on every run and every device.
    """
    n = slots.numel()
    order = native.stable_argsort(slots)
    sorted_slots = slots[order]
    unique, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    row_offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(counts, 0, out=row_offsets[1:])
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    if n == num_bags and bool((lengths == 1).all()):  # one id per bag: id i belongs to bag i
        bag_of_sorted = order
    else:
        bag_of_id = torch.repeat_interleave(torch.arange(num_bags, device=slots.device), lengths, output_size=n)
        bag_of_sorted = bag_of_id[order]
    psw = None if weights is None else weights[order].to(grad_pooled.dtype)
    summed = F.embedding_bag(
        bag_of_sorted, grad_pooled, row_offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    return unique, summed


def _slot_values(g: TableGroup, values, offsets, batch_size: int, feat_idx: torch.Tensor):
    """A copy of ``values`` whose ids of ``g``'s features are cache slots of its storage, with
    the row offsets (zero) and table sizes (all slots) the kernels then take."""
    values = values.to(torch.int64, copy=True)
    starts, ends = offsets[feat_idx * batch_size], offsets[(feat_idx + 1) * batch_size]
    lens = ends - starts
    idx = torch.cat([torch.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
    per_id = lambda t: torch.repeat_interleave(t, lens, output_size=idx.numel())  # noqa: E731
    values[idx] = g.storage.native_lookup(  # type: ignore[attr-defined]
        per_id(g.feature_row_offset), per_id(g.feature_num_rows), values[idx]
    )
    slots = g.storage.weight.shape[0]
    zeros = torch.zeros_like(g.feature_row_offset)
    return values, zeros, torch.full_like(g.feature_num_rows, slots), slots


def _native_pool(mod, g: TableGroup, keys: tuple[str, ...], values, offsets, batch_size, feat_idx, weights,
                 row_off, feat_rows, num_rows):
    out, bad = mod.pool(
        g.storage.weight, values, offsets, batch_size, feat_idx, row_off, feat_rows, g.feature_mean_u8, weights,
    )  # fmt: skip
    pos = int(bad[0])
    if pos >= 0:  # the first id outside its table, named like JaggedBatch.validate does
        key = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
        f = keys[key // batch_size]
        rows = int(g.feature_num_rows[g.features.index(f)])
        raise SparseInputError(
            f"feature '{f}': id {int(values[pos])} is outside its table of {rows} rows; "
            f"ids must be in [0, {rows}) (hash or clip ids to the table size)"
        )
    return out


class _NativeFusedPooling(torch.autograd.Function):
    """The native pooled lookup; its backward updates the rows in the same native pass."""

    @staticmethod
    def forward(ctx, anchor, module, group, mod, keys, args):  # type: ignore[override]
        ctx.module, ctx.group, ctx.mod, ctx.args = module, group, mod, args
        return _native_pool(mod, group, keys, *args)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        ctx.module._native_backward(ctx.mod, ctx.group, grad_out.contiguous(), ctx.args)
        return None, None, None, None, None, None


class _FusedPooling(torch.autograd.Function):
    """Pooled lookup whose backward updates the rows instead of returning a weight gradient."""

    @staticmethod
    def forward(ctx, anchor, module, group, slots, offsets, weights):  # type: ignore[override]
        ctx.module, ctx.group = module, group
        ctx.save_for_backward(slots, offsets, weights if weights is not None else torch.empty(0))
        ctx.has_weights = weights is not None
        return _pool(group.storage.weight, slots, offsets, weights)

    @staticmethod
    def backward(ctx, grad_pooled):  # type: ignore[override]
        slots, offsets, weights = ctx.saved_tensors
        unique, summed = row_gradients(
            slots, offsets, grad_pooled.contiguous(), weights if ctx.has_weights else None
        )
        ctx.module._apply_gradients(ctx.group, unique, summed)
        return None, None, None, None, None, None
