"""Declarations of embedding tables: what a table is, independent of where its rows live."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

Pooling = Literal["sum", "mean"]
StorageDtype = Literal["fp32", "fp16", "bf16"]

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TableConfig:
    """One embedding table and the sparse features that look it up.

    Several features may share a table (their ids index the same rows). ``init_range``
    defaults to DLRM's uniform(-1/sqrt(rows), 1/sqrt(rows)).
    """

    name: str
    num_rows: int
    dim: int
    features: tuple[str, ...] = field(default_factory=tuple)
    pooling: Pooling = "sum"
    init_range: tuple[float, float] | None = None
    dtype: StorageDtype = "fp32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features) or (self.name,))
        if self.num_rows <= 0:
            raise ValueError(f"table '{self.name}': num_rows must be > 0, got {self.num_rows}")
        if self.dim <= 0:
            raise ValueError(f"table '{self.name}': dim must be > 0, got {self.dim}")
        if self.pooling not in ("sum", "mean"):
            raise ValueError(f"table '{self.name}': pooling must be 'sum' or 'mean', got {self.pooling!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"table '{self.name}': dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.init_range is not None:
            lo, hi = self.init_range
            if not lo < hi:
                raise ValueError(f"table '{self.name}': init_range must be (low, high) with low < high")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def bounds(self) -> tuple[float, float]:
        if self.init_range is not None:
            return self.init_range
        a = 1.0 / math.sqrt(self.num_rows)
        return (-a, a)


def check_tables(tables: list[TableConfig]) -> None:
    """Names unique and each feature served by exactly one table."""
    seen_tables: set[str] = set()
    owner: dict[str, str] = {}
    for t in tables:
        if t.name in seen_tables:
            raise ValueError(f"table name '{t.name}' is used twice; table names must be unique")
        seen_tables.add(t.name)
        for f in t.features:
            if f in owner:
                raise ValueError(f"feature '{f}' is served by tables '{owner[f]}' and '{t.name}'; pick one")
            owner[f] = t.name
