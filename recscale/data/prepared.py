"""A prepared directory as the reader sees it: manifest, schema, shards and their row groups.

Opening checks that the preparation finished (the manifest is written last) and that every
shard is present with the recorded size and, unless told not to, the recorded SHA-256, so a
missing or damaged shard is refused up front with its name rather than failing mid-epoch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recscale.data.errors import DataFormatError
from recscale.data.schema import DataSchema, SchemaError, schema_from_dict

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "recscale-prepared/1"


class PreparedDataError(DataFormatError):
    """A prepared directory is unfinished, incomplete or damaged; the message names the file."""


@dataclass(frozen=True)
class RowGroups:
    """Row groups of a row range of the dataset, in manifest order.

    ``skip[i]``/``rows[i]``: the part of row group ``i`` that belongs to the range."""

    shard: np.ndarray  # int64, index into PreparedDataset.shard_files
    group: np.ndarray  # int64, row group within the shard
    skip: np.ndarray  # int64
    rows: np.ndarray  # int64

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())


@dataclass(frozen=True)
class PreparedDataset:
    root: Path
    manifest: dict[str, Any]
    schema: DataSchema
    shard_files: tuple[Path, ...]
    fingerprint: str

    @property
    def num_rows(self) -> int:
        return int(self.manifest["rows"])

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return self.schema.sparse_names

    @property
    def dense_names(self) -> tuple[str, ...]:
        return self.schema.dense_names

    @property
    def table_rows(self) -> dict[str, int]:
        return {s.name: s.table_rows for s in self.schema.sparse}

    @staticmethod
    def open(path: str | Path, verify_checksums: bool = True) -> PreparedDataset:
        root = Path(path)
        if not root.is_dir():
            raise PreparedDataError(f"prepared data '{root}' is not a directory (make one with `recscale data prepare`)")
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise PreparedDataError(
                f"'{root}' has no {MANIFEST}: it is not a prepared directory, or its `recscale data prepare` "
                "did not finish (the manifest is written last); prepare it again"
            )
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise PreparedDataError(f"'{mpath}' is damaged ({e}); prepare the data again") from None
        if manifest.get("format") != MANIFEST_FORMAT:
            raise PreparedDataError(f"'{mpath}': format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        try:
            schema = schema_from_dict(manifest["schema"])
        except SchemaError as e:
            raise PreparedDataError(f"'{mpath}': {e}") from None
        files = []
        for s in manifest["shards"] + manifest.get("vocab", []):
            f = root / s["file"]
            if not f.is_file():
                raise PreparedDataError(f"shard '{f}' listed in the manifest is missing; prepare the data again")
            size = f.stat().st_size
            if size != s["bytes"]:
                raise PreparedDataError(
                    f"shard '{f}' is damaged: {size} bytes, the manifest says {s['bytes']}; prepare the data again"
                )
            if verify_checksums and file_sha256(f) != s["sha256"]:
                raise PreparedDataError(
                    f"shard '{f}' is damaged: its SHA-256 does not match the manifest; prepare the data again"
                )
        files = [root / s["file"] for s in manifest["shards"]]
        return PreparedDataset(root, manifest, schema, tuple(files), str(manifest["fingerprint"]))

    def row_groups(self, start: int = 0, stop: int | None = None) -> RowGroups:
        """The row groups holding rows ``[start, stop)`` of the dataset (file order)."""
        stop = self.num_rows if stop is None else stop
        shard, group, rows = [], [], []
        for i, s in enumerate(self.manifest["shards"]):
            for j, n in enumerate(s["row_groups"]):
                shard.append(i)
                group.append(j)
                rows.append(n)
        rows_a = np.asarray(rows, dtype=np.int64)
        begin = np.concatenate([[0], np.cumsum(rows_a)[:-1]]) if rows_a.size else rows_a
        lo = np.clip(start - begin, 0, rows_a)
        hi = np.clip(stop - begin, 0, rows_a)
        keep = hi > lo
        return RowGroups(
            np.asarray(shard, np.int64)[keep], np.asarray(group, np.int64)[keep], lo[keep], (hi - lo)[keep]
        )


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
