"""The jagged sparse batch: per feature, per sample, a variable number of ids.

Layout is key-major (like TorchRec's KeyedJaggedTensor): ``values`` holds all ids of
feature 0 for samples 0..B-1, then feature 1, and so on; ``lengths`` has ``K * B`` entries
in the same order. Keeping ids flat lets one operator serve every table in a single call
and lets the sharding layer send one contiguous slice per destination.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class SparseInputError(ValueError):
    """A jagged batch is malformed; the message names the feature and the fix."""


@dataclass(frozen=True)
class JaggedBatch:
    """Ids of K sparse features for a batch of B samples.

    keys: feature names, in the order their ids appear in ``values``.
    values: flat int64 ids, key-major then sample-major.
    lengths: int64 ``[K * B]``, the number of ids of each (feature, sample) bag.
    weights: optional float ``[len(values)]`` per-id weights (weighted pooling).
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        if len(set(self.keys)) != len(self.keys):
            raise SparseInputError(f"keys: duplicate feature names in {list(self.keys)}")
        if self.values.dim() != 1 or self.lengths.dim() != 1:
            raise SparseInputError("values and lengths must be 1-D tensors")
        if self.keys and self.lengths.numel() % len(self.keys) != 0:
            raise SparseInputError(
                f"lengths: {self.lengths.numel()} entries is not a multiple of the "
                f"{len(self.keys)} keys; expected keys x batch_size entries"
            )
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise SparseInputError(
                f"weights: shape {tuple(self.weights.shape)} must equal values shape "
                f"{tuple(self.values.shape)} (one weight per id)"
            )

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_lists(
        features: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> JaggedBatch:
        """Build from ``{feature: [ids of sample 0, ids of sample 1, ...]}``."""
        keys = list(features)
        sizes = {len(bags) for bags in features.values()}
        if len(sizes) > 1:
            detail = ", ".join(f"{k}: {len(v)}" for k, v in features.items())
            raise SparseInputError(f"every feature needs the same number of samples ({detail})")
        values: list[int] = []
        lengths: list[int] = []
        flat_w: list[float] = []
        for key in keys:
            for i, bag in enumerate(features[key]):
                values.extend(int(v) for v in bag)
                lengths.append(len(bag))
                if weights is not None:
                    if key not in weights or len(weights[key]) != len(features[key]):
                        raise SparseInputError(
                            f"feature '{key}': weights must give one list per sample "
                            f"({len(features[key])} samples), like the ids"
                        )
                    wbag = weights[key][i]
                    if len(wbag) != len(bag):
                        raise SparseInputError(
                            f"feature '{key}', sample {i}: {len(wbag)} weights for {len(bag)} ids"
                        )
                    flat_w.extend(float(w) for w in wbag)
        return JaggedBatch(
            keys=tuple(keys),
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
            weights=torch.tensor(flat_w, dtype=torch.float32) if weights is not None else None,
        )

    @staticmethod
    def from_dense_ids(keys: Sequence[str], ids: torch.Tensor) -> JaggedBatch:
        """One id per (sample, feature) from a ``[B, K]`` tensor (the one-hot Criteo case)."""
        if ids.dim() != 2 or ids.shape[1] != len(keys):
            raise SparseInputError(f"ids: expected shape [batch, {len(keys)}], got {tuple(ids.shape)}")
        values = ids.t().contiguous().reshape(-1).to(torch.int64)
        lengths = torch.ones(values.numel(), dtype=torch.int64)
        return JaggedBatch(tuple(keys), values, lengths)

    # ------------------------------------------------------------------ shape
    @property
    def num_keys(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def offsets(self) -> torch.Tensor:
        """``[K * B + 1]`` start of each bag in ``values`` (derived, never stored)."""
        out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def lengths_per_key(self) -> list[int]:
        """Number of ids of each feature over the batch."""
        if not self.keys:
            return []
        return self.lengths.view(self.num_keys, -1).sum(1).tolist()

    def _key_ranges(self) -> list[tuple[int, int]]:
        ranges, start = [], 0
        for n in self.lengths_per_key():
            ranges.append((start, start + n))
            start += n
        return ranges

    def __getitem__(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, lengths)`` of one feature."""
        idx = self._index_of(key)
        lo, hi = self._key_ranges()[idx]
        b = self.batch_size
        return self.values[lo:hi], self.lengths[idx * b : (idx + 1) * b]

    def _index_of(self, key: str) -> int:
        try:
            return self.keys.index(key)
        except ValueError:
            raise SparseInputError(f"feature '{key}' is not in this batch (keys: {list(self.keys)})") from None

    # ------------------------------------------------------------------ transforms
    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        return JaggedBatch(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> JaggedBatch:
        return JaggedBatch(
            self.keys,
            self.values.pin_memory(),
            self.lengths.pin_memory(),
            None if self.weights is None else self.weights.pin_memory(),
        )

    def select(self, keys: Sequence[str]) -> JaggedBatch:
        """A batch with only ``keys``, in that order (selection and permutation)."""
        order = [self._index_of(k) for k in keys]
        if order == list(range(self.num_keys)):
            return self
        ranges = self._key_ranges()
        b = self.batch_size
        vals = [self.values[ranges[i][0] : ranges[i][1]] for i in order]
        lens = [self.lengths[i * b : (i + 1) * b] for i in order]
        wts = None
        if self.weights is not None:
            wts = _cat([self.weights[ranges[i][0] : ranges[i][1]] for i in order], self.weights)
        return JaggedBatch(tuple(keys), _cat(vals, self.values), _cat(lens, self.lengths), wts)

    def split(self, sizes: Sequence[int]) -> list[JaggedBatch]:
        """Split by sample into consecutive batches of the given sizes."""
        if sum(sizes) != self.batch_size or any(s < 0 for s in sizes):
            raise SparseInputError(f"split sizes {list(sizes)} must be >= 0 and sum to batch size {self.batch_size}")
        b = self.batch_size
        per_key_lengths = self.lengths.view(self.num_keys, b) if self.keys else self.lengths.view(0, 0)
        # Number of ids of each (key, chunk): one small reduction, then slicing.
        out: list[JaggedBatch] = []
        offsets = self.offsets()
        start = 0
        for size in sizes:
            stop = start + size
            lens = per_key_lengths[:, start:stop].reshape(-1)
            vals, wts = [], []
            for k in range(self.num_keys):
                lo = int(offsets[k * b + start])
                hi = int(offsets[k * b + stop])
                vals.append(self.values[lo:hi])
                if self.weights is not None:
                    wts.append(self.weights[lo:hi])
            out.append(
                JaggedBatch(
                    self.keys,
                    _cat(vals, self.values),
                    lens.contiguous(),
                    _cat(wts, self.weights) if self.weights is not None else None,
                )
            )
            start = stop
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, num_rows: Mapping[str, int] | None = None) -> None:
        """Raise SparseInputError naming the feature when the batch is inconsistent.

        ``num_rows`` maps a feature to the row count of its table; ids must lie in
        ``[0, rows)``.
        """
        b = self.batch_size
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            bad = int(torch.nonzero(self.lengths < 0)[0])
            raise SparseInputError(
                f"feature '{self.keys[bad // b]}', sample {bad % b}: negative length "
                f"{int(self.lengths[bad])}; lengths count ids and must be >= 0"
            )
        if total != self.values.numel():
            n = self.values.numel()
            # The first feature whose ids would run past the end of values (or the last one).
            ends = torch.cumsum(self.lengths.view(self.num_keys, -1).sum(1), 0).tolist() if self.keys else []
            culprit = next((k for k, e in zip(self.keys, ends) if e > n), self.keys[-1] if self.keys else "?")
            raise SparseInputError(
                f"feature '{culprit}': lengths sum to {total} but there are {n} values; "
                "each id must belong to exactly one (feature, sample) bag"
            )
        if num_rows is None:
            return
        for k, (lo, hi) in zip(self.keys, self._key_ranges()):
            if k not in num_rows:
                raise SparseInputError(f"feature '{k}' is not served by any embedding table")
            if hi == lo:
                continue
            ids = self.values[lo:hi]
            mn, mx = int(ids.min()), int(ids.max())
            rows = num_rows[k]
            if mn < 0 or mx >= rows:
                bad = mn if mn < 0 else mx
                raise SparseInputError(
                    f"feature '{k}': id {bad} is outside its table of {rows} rows; "
                    f"ids must be in [0, {rows}) (hash or clip ids to the table size)"
                )


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not parts:
        return like.new_empty((0,))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def permute_bags(
    values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, bag_order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reorder whole bags: bag ``i`` of the result is bag ``bag_order[i]`` of the input.

    Moves ids (8 bytes each) instead of anything dim-wide; used to turn key-major bags into
    sample-major ones and to regroup bags received from several ranks.
    """
    new_lengths = lengths[bag_order]
    n = values.numel()
    starts = torch.cumsum(lengths, 0) - lengths
    new_starts = torch.cumsum(new_lengths, 0) - new_lengths
    shift = torch.repeat_interleave(starts[bag_order] - new_starts, new_lengths, output_size=n)
    perm = torch.arange(n, device=values.device) + shift
    return values[perm], new_lengths, None if weights is None else weights[perm]
