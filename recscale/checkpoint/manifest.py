"""The checkpoint format: one directory per checkpoint, rank data files, a manifest written last.

Directory ``<root>/step0000000100/``::

    manifest.json      format name and version, kind (full/differential/incremental), the chain
                       of checkpoints a restore applies (baseline first), policy, codecs, plan,
                       tables, every file with size and sha256, every chunk, training position;
                       its own sha256 over the rest, so a damaged manifest is refused too
    rank00000.bin      that rank's embedding chunks, back to back
    rank00000.state    that rank's RNG states and accumulators (rank 0 also: dense model and optimizer)

A chunk is one block of rows of one table shard: a row selector (a contiguous range, a bitmap
over [row_start, row_stop) or sorted int32/int64 ids), then the weights in the chunk's codec,
then each optimizer-state tensor; it carries its own crc32, so a rank that reads only the rows
it owns (resharding) still detects damage in what it reads. A full checkpoint with
``initial_rows`` set holds only the rows that differ from their initial values; a restore
regenerates the others from the seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_NAME = "recscale-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint directory
    size: int
    sha256: str


@dataclass(frozen=True)
class Chunk:
    """One block of rows of one table shard in a rank's data file."""

    table: str
    file: str
    offset: int
    length: int
    crc32: int
    row_start: int  # rows of the whole table this chunk may hold: [row_start, row_stop)
    row_stop: int
    selector: str  # "range" (all of them), "bitmap" or "ids"
    num_rows: int  # rows actually stored
    col_offset: int
    num_cols: int
    id_bytes: int  # bytes of the selector
    weight_bytes: int
    state: tuple[tuple[str, int, int], ...] = ()  # (name, columns, bytes) in stored order

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = [list(s) for s in self.state]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Chunk:
        d = dict(d)
        d["state"] = tuple((str(n), int(c), int(b)) for n, c, b in d["state"])
        return Chunk(**d)


@dataclass(frozen=True)
class TableMeta:
    name: str
    num_rows: int
    dim: int
    dtype: str


@dataclass
class Manifest:
    name: str
    step: int
    kind: str  # full | differential | incremental
    chain: list[str]  # checkpoints a restore applies in order, ending with this one
    policy: str
    weight_codec: dict[str, Any]
    state_codec: dict[str, Any]
    world_size: int
    plan: dict[str, Any] | None
    tables: list[TableMeta]
    optimizer: dict[str, Any]  # name and state columns per table dim
    files: list[FileEntry]
    chunks: list[Chunk]
    training: dict[str, Any]  # step, epoch, next_batch, data fingerprint, embedding step
    stats: dict[str, Any] = field(default_factory=dict)
    # Full checkpoints only: rows they do not hold are at their initial values
    # (``recscale.embedding.table_batched.init_rows`` with this seed and these bounds per table)
    # with zero optimizer state: {"seed": int, "bounds": {table: [lo, hi]}}. None: every row held.
    initial_rows: dict[str, Any] | None = None
    created_unix: float = 0.0
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def base(self) -> str:
        return self.chain[0]

    def table(self, name: str) -> TableMeta:
        for t in self.tables:
            if t.name == name:
                return t
        raise CheckpointError(f"checkpoint {self.name} has no table '{name}'")

    def data_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [c.to_dict() for c in self.chunks]
        return d

    def to_json(self) -> bytes:
        body = self.to_dict()
        body["checksum"] = _digest(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @staticmethod
    def from_json(raw: bytes, where: str) -> Manifest:
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not a recscale checkpoint manifest (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{where}: unknown checkpoint format version {d.get('version')!r}; this recscale reads "
                f"version {FORMAT_VERSION} (use the recscale release that wrote it, or export it there)"
            )
        checksum = d.pop("checksum", None)
        if checksum != _digest(d):
            raise CheckpointError(f"{where}: manifest checksum mismatch; the manifest is damaged, do not load it")
        try:
            d["tables"] = [TableMeta(**t) for t in d["tables"]]
            d["files"] = [FileEntry(**f) for f in d["files"]]
            d["chunks"] = [Chunk.from_dict(c) for c in d["chunks"]]
            return Manifest(**d)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step{step:010d}"


def tmp_name(name: str) -> str:
    return f".tmp-{name}"
