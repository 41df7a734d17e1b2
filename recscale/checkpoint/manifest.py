"""The checkpoint format: one directory per checkpoint, rank data files, a manifest written last.

Directory ``<root>/step0000000100/``::

    manifest.json      format name and version, kind (full/differential/incremental), the chain
                       of checkpoints a restore applies (baseline first), policy, codecs, plan,
                       tables, every file with size and sha256 (a data file: none, its chunks'
                       crc32s cover it byte for byte), every chunk, training position;
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
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FORMAT_NAME = "recscale-checkpoint"
FORMAT_VERSION = 3
# Version 1 (no run identity, chain links by name only) is still read; a restore checks its chain by name.
# Version 2 also hashed the data files (sha256); from version 3 their chunks' crc32s check them.
READABLE_VERSIONS = (1, 2, 3)
# A file entry's sha256 for a data file: its chunks tile it and each carries a crc32, so a second
# pass over every byte (sha256 costs twice crc32's CPU) would check nothing more.
BY_CHUNKS = ""
MANIFEST = "manifest.json"
KINDS = ("full", "differential", "incremental")


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
    # The run that wrote it (its run folder's name) and, per checkpoint of ``chain`` before this
    # one, {"name", "run", "digest"}: a chain is valid only if every link's manifest has that digest.
    run: str = ""
    links: list[dict[str, Any]] = field(default_factory=list)
    # The checkpoint the run resumed from: {"path", "run", "name", "step", "digest"}; None: a fresh start.
    parent: dict[str, Any] | None = None
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    # The manifest's checksum (its content digest), set when written or read; not part of the body.
    digest: str = field(default="", repr=False, compare=False)

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
        d.pop("digest")
        d["chunks"] = [c.to_dict() for c in self.chunks]
        return d

    def to_json(self) -> bytes:
        body = self.to_dict()
        body["checksum"] = self.digest = _digest(body)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @staticmethod
    def from_json(raw: bytes, where: str) -> Manifest:
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where}: not a recscale checkpoint manifest (format {d.get('format') if isinstance(d, dict) else None!r})")
        if d.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where}: unknown checkpoint format version {short(d.get('version'))}; this recscale reads "
                f"versions {list(READABLE_VERSIONS)} (use the recscale release that wrote it, or export it there)"
            )
        checksum = d.pop("checksum", None)
        if checksum != _digest(d):
            raise CheckpointError(f"{where}: manifest checksum mismatch; the manifest is damaged, do not load it")
        try:
            _check_fields(d)
            d["tables"] = [TableMeta(**t) for t in d["tables"]]
            d["files"] = [FileEntry(**f) for f in d["files"]]
            d["chunks"] = [Chunk.from_dict(c) for c in d["chunks"]]
            for dc in (*d["tables"], *d["files"], *d["chunks"]):
                _check_dataclass(dc)
            m = Manifest(**d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {short(str(e), 160)})") from None
        m.digest = checksum
        return m


# Top-level manifest keys and the JSON types they must have (a checksum only proves the bytes are
# the ones written; a reader must not trust the types of what a writer put there).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "step": (int,), "kind": (str,), "chain": (list,), "policy": (str,),
    "weight_codec": (dict,), "state_codec": (dict,), "world_size": (int,), "plan": (dict, type(None)),
    "tables": (list,), "optimizer": (dict,), "files": (list,), "chunks": (list,), "training": (dict,),
    "stats": (dict,), "initial_rows": (dict, type(None)), "created_unix": (int, float), "run": (str,),
    "links": (list,), "parent": (dict, type(None)),
}


def _check_fields(d: dict[str, Any]) -> None:
    for key, types in _FIELD_TYPES.items():
        if key in d and (not isinstance(d[key], types) or isinstance(d[key], bool)):
            raise TypeError(f"'{key}' is {type(d[key]).__name__}, expected {' or '.join(t.__name__ for t in types)}")
    if d.get("kind") not in KINDS:
        raise ValueError(f"'kind' is {short(d.get('kind'))}, expected one of {list(KINDS)}")
    if d.get("step", 0) < 0 or d.get("world_size", 1) < 1:
        raise ValueError("'step' must be >= 0 and 'world_size' >= 1")
    chain = d.get("chain")
    names_ok = bool(chain) and all(isinstance(c, str) and _SIMPLE_NAME.fullmatch(c) for c in chain)
    if not names_ok or chain[-1] != d.get("name"):
        raise ValueError("'chain' must be a list of checkpoint names ending with this one")
    for link in d.get("links", []):
        if not isinstance(link, dict) or not all(isinstance(link.get(k), str) for k in ("name", "digest")):
            raise ValueError("every entry of 'links' must name a checkpoint and its digest")
    for key in ("tables", "files", "chunks"):
        if not all(isinstance(x, dict) for x in d.get(key, [])):
            raise TypeError(f"every entry of '{key}' must be an object")
    for c in d.get("chunks", []):
        if not isinstance(c.get("state"), list) or not all(isinstance(s, list) and len(s) == 3 for s in c["state"]):
            raise ValueError("a chunk's 'state' must be a list of [name, columns, bytes]")


def _check_dataclass(obj: Any) -> None:
    """Every int field a non-negative int and every str field a str (no bools, no floats)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{type(obj).__name__}.{f.name} is {short(v)}, expected an integer >= 0")
        if f.type == "str" and not isinstance(v, str):
            raise ValueError(f"{type(obj).__name__}.{f.name} is {short(v)}, expected a string")
    if isinstance(obj, Chunk):
        if obj.row_stop < obj.row_start or obj.selector not in ("range", "bitmap", "ids"):
            raise ValueError(f"chunk of table {short(obj.table)}: bad row range or selector")
        if any(c < 0 or b < 0 for _, c, b in obj.state):
            raise ValueError(f"chunk of table {short(obj.table)}: negative state size")
    for name in (getattr(obj, "path", None), getattr(obj, "file", None)):
        if name is not None and not _SIMPLE_NAME.fullmatch(name):
            raise ValueError(f"file name {short(name)} is not a plain name inside the checkpoint")


# Names a manifest may use for files and checkpoints: plain names, never a path out of the directory.
_SIMPLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to a readable length (a huge number or string in an error message)."""
    try:
        text = value if isinstance(value, str) and limit > 60 else repr(value)  # long limits: messages
    except ValueError:  # an int too long to print
        return f"<an integer of about {value.bit_length() * 0.30103:.0f} digits>"
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text):,} characters)"


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def checkpoint_name(step: int) -> str:
    return f"step{step:010d}"


def tmp_name(name: str) -> str:
    return f".tmp-{name}"
