"""The models and data ``e2e.py`` races on: one description (``ModelSpec``) every system builds
from, the batches every system trains on, and the bytes and FLOPs that bound a step.

The workload description is the data generator's: per-feature mean pooling factors and Zipf
skew (``ZIPF_ALPHA``). Every system is told the same description (recscale's planner through
``data.pooling_factors`` / ``data.zipf_alpha``, TorchRec's planner through
``ParameterConstraints.pooling_factors``; TorchRec's planner has no input for the skew on CPU).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recscale.data import Batch, ClickBatches, SyntheticClickData, SyntheticConfig

TABLES_JSON = Path(__file__).resolve().parents[1].parent / "shared/data/tables/criteo_table_sizes.json"
CRITEO_KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                      27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
               2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]  # fmt: skip
MLPERF_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
SEED = 2026
ZIPF_ALPHA = 1.05  # the generator's id skew, told to every planner that takes it
# Row caps that let the tables (and several systems' copies) fit this kind of machine; dcnv2
# uses configs/mlperf_dlrmv2.toml's cap.
ROW_CAPS = {"criteo-dlrm": 1_000_000, "multi-hot": 500_000, "dcnv2": 100_000}
QUICK_ROW_CAP = 10_000
CONFIGS = tuple(ROW_CAPS)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark config: the model and the per-rank batch."""

    name: str
    table_rows: tuple[int, ...]
    pooling: tuple[int, ...]  # mean ids per sample of each feature
    dim: int
    bottom: tuple[int, ...]  # layer sizes after the 13 dense inputs; ends with dim
    top: tuple[int, ...]  # layer sizes after the interaction; ends with 1
    batch_size: int  # per rank
    num_dense: int = 13
    interaction: str = "dot"  # "dot" (DLRM) or "dcn" (DLRM-DCNv2's low-rank cross network)
    dcn_layers: int = 3
    dcn_low_rank: int = 512
    zipf_alpha: float = ZIPF_ALPHA
    row_cap: int = 0  # the cap applied to the source tables' rows (recorded for the report)

    @property
    def num_features(self) -> int:
        return len(self.table_rows)

    @property
    def interaction_width(self) -> int:
        f = self.num_features + 1
        if self.interaction == "dcn":
            return f * self.dim
        return self.dim + f * (f - 1) // 2

    def mlp_flops_per_sample(self) -> float:
        """Forward + backward FLOPs of the matmuls (MLPs and the interaction): 3 x forward."""
        macs, prev = 0, self.num_dense
        for s in self.bottom:
            macs, prev = macs + prev * s, s
        prev = self.interaction_width
        for s in self.top:
            macs, prev = macs + prev * s, s
        f = self.num_features + 1
        if self.interaction == "dcn":
            macs += self.dcn_layers * 2 * (f * self.dim) * self.dcn_low_rank  # V then W per cross layer
        else:
            macs += f * f * self.dim  # the Gram matrix
        return 3 * 2 * macs

    def table_bytes(self) -> int:
        """fp32 rows of every table plus one float of row-wise optimizer state per row."""
        return sum(self.table_rows) * (self.dim + 1) * 4

    def batch_bytes(self) -> int:
        """One rank's batch held in memory: ids, lengths, dense features and labels."""
        ids = self.batch_size * sum(self.pooling)
        return ids * 8 + self.batch_size * (self.num_features * 8 + self.num_dense * 4 + 4)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelSpec:
        return ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _table_json() -> dict[str, Any] | None:
    try:
        return json.loads(TABLES_JSON.read_text())
    except (OSError, ValueError):
        return None


def make_spec(name: str, quick: bool = False, batch_size: int | None = None) -> ModelSpec:
    """``criteo-dlrm``: Criteo Kaggle tables, one id per table, dim 64, MLPs 512-256-64 and
    512-256-1, dot interaction. ``multi-hot``: MLPerf DLRM-DCNv2 tables and multi-hot pooling
    factors, dim 128, MLPs 256-128 and 256-1, dot interaction. ``dcnv2``: the MLPerf DLRM-DCNv2
    model (those tables and pooling, dim 128, bottom 512-256-128, 3 cross layers of rank 512,
    top 1024-1024-512-256-1). Rows capped by ``ROW_CAPS``; ``quick``: at 10k rows, batch 256."""
    if name not in ROW_CAPS:
        raise SystemExit(f"--configs: unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    data = _table_json()
    extra: dict[str, Any] = {}
    if name == "criteo-dlrm":
        rows = data["criteo_kaggle_dac"]["rows"] if data else CRITEO_KAGGLE_ROWS
        pooling, dim, bottom, top = [1] * len(rows), 64, (512, 256, 64), (512, 256, 1)
    else:
        d = data["mlperf_dlrm_dcnv2"] if data else None
        rows = d["rows"] if d else MLPERF_ROWS
        pooling = list(d["pooling_factors"]) if d else MLPERF_POOLING
        if name == "multi-hot":
            dim, bottom, top = 128, (256, 128), (256, 1)
        else:
            dim, bottom, top = 128, (512, 256, 128), (1024, 1024, 512, 256, 1)
            extra = {"interaction": "dcn", "dcn_layers": 3, "dcn_low_rank": 512}
    cap = QUICK_ROW_CAP if quick else ROW_CAPS[name]
    b = batch_size or (256 if quick else 2048)
    return ModelSpec(name, tuple(min(int(r), cap) for r in rows), tuple(int(p) for p in pooling), dim, bottom, top, b,
                     row_cap=cap, **extra)


def make_batches(spec: ModelSpec, rank: int, world: int, count: int) -> list[Batch]:
    """``count`` global batches (this rank's share of each) from recscale's synthetic generator:
    Zipf-skewed ids (``spec.zipf_alpha``), multi-hot bags, fixed seed; every system gets these."""
    global_batch = spec.batch_size * world
    src = SyntheticClickData(SyntheticConfig(
        num_samples=global_batch * count, table_rows=spec.table_rows, pooling_factors=spec.pooling,
        num_dense=spec.num_dense, zipf_alpha=spec.zipf_alpha, seed=SEED,
    ))
    batches = ClickBatches(src, global_batch, shuffle=False, seed=SEED, rank=rank, world_size=world)
    return [batches[i] for i in range(count)]


def embedding_bytes_per_step(spec: ModelSpec, batch: Batch) -> float:
    """Bytes the embedding part must move per step at the least (fp32 rows, row-wise Adagrad):
    forward reads every looked-up row and writes the pooled outputs; backward reads the output
    gradients and reads and writes each unique row and its state once."""
    ids = batch.sparse.values
    lengths = batch.sparse.lengths.view(spec.num_features, -1).sum(1)
    unique = 0
    for vals in torch.split(ids, lengths.tolist()):
        unique += int(torch.unique(vals).numel())
    b, d = batch.batch_size, spec.dim
    out = b * spec.num_features * d * 4
    return ids.numel() * d * 4 + out + out + unique * (2 * d * 4 + 2 * 4)
