"""Reading checkpoints: find one, validate it and its chain, and load the rows this rank owns.

A restore applies the chain baseline -> differential (or every increment) in order, each
overwriting the rows it holds. Rows are matched in whole-table coordinates, so the reader can
use any plan and world size: each rank reads only the chunks whose row range meets a shard it
now owns, from whichever rank's file holds them, and takes the columns its shard covers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from recscale.checkpoint.lineage import list_checkpoints, resolve  # noqa: F401  (this module's API too)
from recscale.checkpoint.checksum import crc32
from recscale.checkpoint.manifest import BY_CHUNKS, MANIFEST, CheckpointError, Chunk, FileEntry, Manifest
from recscale.checkpoint.quantize import Codec
from recscale.checkpoint.shards import LocalShard, row_state_names
from recscale.checkpoint.storage import Storage
from recscale.embedding.table_batched import init_rows


@dataclass
class ReadStats:
    bytes_read: int = 0
    chunks_read: int = 0


def load_manifest(storage: Storage, name: str) -> Manifest:
    where = storage.describe(name)
    if storage.size(f"{name}/{MANIFEST}") is None:
        raise CheckpointError(
            f"{where}: no {MANIFEST}; the checkpoint was never committed (a write was interrupted) or is "
            "damaged, so it is not loaded; pick another checkpoint"
        )
    return Manifest.from_json(storage.read(f"{name}/{MANIFEST}"), where)


def load_chain(storage: Storage, manifest: Manifest) -> list[Manifest]:
    """The manifests a restore applies, each checked: format, version, checksum, file sizes, and
    that each is the very checkpoint ``manifest`` was built on (its digest, not just its name)."""
    chain = []
    links = {str(x.get("name")): x for x in manifest.links}
    for name in manifest.chain:
        m = manifest if name == manifest.name else load_manifest(storage, name)
        if m is not manifest and manifest.version >= 2:
            check_link(storage, manifest, m, links.get(name))
        if m.chain != manifest.chain[: len(m.chain)]:
            raise CheckpointError(f"{storage.describe(name)}: its chain {m.chain} does not lead to {manifest.name}")
        check_files(storage, m, deep=False)
        chain.append(m)
    return chain


def check_link(storage: Storage, manifest: Manifest, base: Manifest, link: dict | None) -> None:
    """``base`` must be the checkpoint ``manifest`` recorded it builds on: same digest. Another
    one under the same name (a directory replaced, another run's) is refused."""
    if link is None:
        raise CheckpointError(
            f"{storage.describe(manifest.name)}: records no digest for {base.name}, the checkpoint it builds on; "
            "the manifest is damaged, do not load it"
        )
    if link.get("digest") != base.digest:
        raise CheckpointError(
            f"{storage.describe(base.name)} is not the checkpoint {manifest.name} builds on (digest "
            f"{base.digest[:12]}, recorded {str(link.get('digest'))[:12]}): it belongs to run {base.run or '(unknown)'}, "
            f"{manifest.name} to run {manifest.run or '(unknown)'}; this chain mixes two runs, do not load it"
        )


def check_files(storage: Storage, m: Manifest, deep: bool) -> None:
    """Every file present with the recorded size (and, when ``deep``, the recorded sha256; a
    data file's chunks must tile it, their crc32s are checked where they are read);
    every chunk inside a listed file and inside its table."""
    names = {f.path for f in m.files}
    for c in m.chunks:
        t = next((t for t in m.tables if t.name == c.table), None)
        if c.file not in names or t is None or c.row_stop > t.num_rows or c.col_offset + c.num_cols > t.dim:
            raise CheckpointError(
                f"{storage.describe(m.name)}: a chunk of table '{c.table[:60]}' lies outside its file or table; "
                "the manifest is damaged, do not load it"
            )
    for f in m.files:
        where = storage.describe(f"{m.name}/{f.path}")
        size = storage.size(f"{m.name}/{f.path}")
        if size is None:
            raise CheckpointError(f"{where}: missing; the checkpoint is incomplete and is not loaded")
        if size != f.size:
            raise CheckpointError(f"{where}: {size} bytes but the manifest records {f.size} (truncated or damaged)")
        if f.sha256 == BY_CHUNKS:  # its bytes are checked by each chunk's crc32 as it is read
            _check_tiling(where, f, [c for c in m.chunks if c.file == f.path])
        elif deep and hashlib.sha256(storage.read(f"{m.name}/{f.path}")).hexdigest() != f.sha256:
            raise CheckpointError(f"{where}: sha256 mismatch; the file is damaged")


def _check_tiling(where: str, f: FileEntry, chunks: list[Chunk]) -> None:
    """A data file checked by its chunks' crc32s: they must cover it exactly, back to back."""
    end = 0
    for c in sorted(chunks, key=lambda c: c.offset):
        if c.offset != end:
            break
        end += c.length
    if end != f.size or sum(c.length for c in chunks) != f.size:
        raise CheckpointError(f"{where}: its chunks do not cover the file exactly; the manifest is damaged, "
                              "do not load it")


def read_file_checked(storage: Storage, m: Manifest, path: str, stats: ReadStats | None = None) -> bytes:
    entry = next((f for f in m.files if f.path == path), None)
    where = storage.describe(f"{m.name}/{path}")
    if entry is None:
        raise CheckpointError(f"{where}: not listed in the manifest")
    data = storage.read(f"{m.name}/{path}")
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise CheckpointError(f"{where}: size or sha256 does not match the manifest; the file is damaged")
    if stats is not None:
        stats.bytes_read += len(data)
    return data


@dataclass
class DecodedChunk:
    rows: torch.Tensor  # whole-table row ids
    weight: torch.Tensor  # [n, num_cols]
    state: dict[str, torch.Tensor]


def read_chunk(storage: Storage, m: Manifest, c: Chunk, stats: ReadStats | None = None) -> DecodedChunk:
    where = storage.describe(f"{m.name}/{c.file}")
    buf = storage.read(f"{m.name}/{c.file}", c.offset, c.length)
    if len(buf) != c.length:
        raise CheckpointError(f"{where}: chunk of table '{c.table}' at byte {c.offset} is cut short (truncated file)")
    if crc32(buf) != c.crc32:
        raise CheckpointError(f"{where}: checksum mismatch in a chunk of table '{c.table}' at byte {c.offset}; the file is damaged")
    if stats is not None:
        stats.bytes_read += len(buf)
        stats.chunks_read += 1
    try:
        return _decode(m, c, buf)
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise CheckpointError(
            f"{where}: a chunk of table '{c.table}' at byte {c.offset} does not match its manifest entry "
            f"({type(e).__name__}); the manifest is damaged, do not load it"
        ) from None


def _decode(m: Manifest, c: Chunk, buf: bytes) -> DecodedChunk:
    wcodec, scodec = Codec.from_dict(m.weight_codec), Codec.from_dict(m.state_codec)
    n, span = c.num_rows, c.row_stop - c.row_start
    want_ids = {"range": 0, "bitmap": (span + 7) // 8, "ids": 4 * n}[c.selector]
    if (c.selector == "range" and n != span) or c.id_bytes != want_ids or n > span \
            or c.weight_bytes != wcodec.nbytes_of(memoryview(buf)[c.id_bytes :], n, c.num_cols) \
            or any(b != scodec.nbytes(n, cols) for _, cols, b in c.state) \
            or c.id_bytes + c.weight_bytes + sum(b for _, _, b in c.state) != c.length:
        raise ValueError("sizes")
    view = memoryview(buf)
    sel = view[: c.id_bytes]
    if c.selector == "range":
        local = np.arange(c.row_stop - c.row_start)
    elif c.selector == "bitmap":
        mask = np.unpackbits(np.frombuffer(sel, np.uint8), bitorder="little", count=c.row_stop - c.row_start)
        local = np.flatnonzero(mask)
    else:
        local = np.frombuffer(sel, np.int32).astype(np.int64)
        if len(local) and (local.min() < 0 or local.max() >= span):
            raise ValueError("ids")
    if len(local) != n:
        raise ValueError("rows")
    rows = torch.from_numpy(np.asarray(local, dtype=np.int64) + c.row_start)
    pos = c.id_bytes
    weight = wcodec.decode(view[pos : pos + c.weight_bytes], c.num_rows, c.num_cols)
    pos += c.weight_bytes
    state = {}
    for name, cols, nbytes in c.state:
        state[name] = scodec.decode(view[pos : pos + nbytes], c.num_rows, cols).float()
        pos += nbytes
    return DecodedChunk(rows, weight, state)


def check_compatible(m: Manifest, shards: list[LocalShard], optimizer_name: str) -> None:
    """The model's tables and optimizer must be the checkpoint's."""
    for s in shards:
        t = m.table(s.table.name)
        if (t.num_rows, t.dim) != (s.table.num_rows, s.table.dim):
            raise CheckpointError(
                f"checkpoint {m.name}: table '{t.name}' is {t.num_rows} x {t.dim} but the model's is "
                f"{s.table.num_rows} x {s.table.dim}; resume with the model config that wrote it"
            )
    if m.optimizer.get("name") != optimizer_name:
        raise CheckpointError(
            f"checkpoint {m.name}: embedding optimizer '{m.optimizer.get('name')}' but the model uses "
            f"'{optimizer_name}'; resume with the same embedding_optimizer.name"
        )


@torch.no_grad()
def restore_shards(storage: Storage, chain: list[Manifest], shards: list[LocalShard]) -> ReadStats:
    """Load every shard's rows (weights and optimizer state) from the chain."""
    stats = ReadStats()
    by_table: dict[str, list[LocalShard]] = {}
    for s in shards:
        by_table.setdefault(s.table.name, []).append(s)
    seen: set[str] = set()
    initial = chain[0].initial_rows if chain and chain[0].kind == "full" else None
    if initial is not None:
        for s in shards:
            reset_to_initial(s, chain[0], initial)
    for m in chain:
        for c in m.chunks:
            targets = [
                s for s in by_table.get(c.table, ())
                if c.row_start < s.row_offset + s.num_rows and s.row_offset < c.row_stop
                and _wants(s, c)
            ]
            if not targets:
                continue
            d = read_chunk(storage, m, c, stats)
            for s in targets:
                _apply(s, c, d)
                seen.add(s.local_name)
    if chain and chain[0].kind == "full" and initial is None:
        missing = sorted({s.local_name for s in shards} - seen)
        if missing:
            raise CheckpointError(f"checkpoint {chain[-1].name}: holds no rows for {missing[:5]}; it is incomplete")
    return stats


# Rows a restore into the SSD tier sets at once (bounded memory for a table larger than it).
_TIER_CHUNK_ROWS = 65_536


def reset_to_initial(s: LocalShard, m: Manifest, initial: dict) -> None:
    """Set a shard to its initial rows and zero optimizer state: what every row a full
    checkpoint with ``initial_rows`` leaves out holds."""
    bounds = initial.get("bounds", {}).get(s.table.name)
    if bounds is not None and tuple(float(x) for x in bounds) != tuple(float(x) for x in s.table.bounds):
        raise CheckpointError(
            f"checkpoint {m.name}: table '{s.table.name}' was initialised in [{bounds[0]}, {bounds[1]}] but the "
            f"model's is {list(s.table.bounds)}; resume with the model config that wrote it"
        )
    tier = s.tiered()
    if tier is not None:  # in chunks: the table need not fit in memory
        st, off = tier
        names = s.module.optimizer.state_columns(s.table.dim)
        for a in range(0, s.num_rows, _TIER_CHUNK_ROWS):
            n = min(_TIER_CHUNK_ROWS, s.num_rows - a)
            init = init_rows(s.table, int(initial["seed"]), s.row_offset + a, n, s.col_offset, s.num_cols)
            st.write_rows_at(torch.arange(off + a, off + a + n), init, {k: torch.zeros(n, c) for k, c in names.items()})
        return
    init = init_rows(s.table, int(initial["seed"]), s.row_offset, s.num_rows, s.col_offset, s.num_cols)
    w = s.module.table_weight(s.local_name)
    w.copy_(init.to(device=w.device, dtype=w.dtype))
    for t in s.module.table_state(s.local_name).values():
        t.zero_()


def _wants(s: LocalShard, c: Chunk) -> bool:
    cols = c.col_offset < s.col_offset + s.num_cols and s.col_offset < c.col_offset + c.num_cols
    row_state = bool(row_state_names(s.module, s.table.dim) & {n for n, _, _ in c.state})
    return cols or row_state


def _apply(s: LocalShard, c: Chunk, d: DecodedChunk) -> None:
    keep = (d.rows >= s.row_offset) & (d.rows < s.row_offset + s.num_rows)
    local = d.rows[keep] - s.row_offset
    if local.numel() == 0:
        return
    tier = s.tiered()
    if tier is not None:  # read the rows the chunk sets, set them in the copies, write them back
        st, off = tier
        local, order = torch.sort(local)  # the storage takes ascending rows
        at = torch.empty_like(order)
        at[order] = torch.arange(order.numel())  # where each of the chunk's rows lands
        w, states = st.read_rows_at(local + off)
        _apply_into(s, c, d, keep, at, w, states)
        st.write_rows_at(local + off, w, states)
        return
    _apply_into(s, c, d, keep, local.to(s.module.device), s.module.table_weight(s.local_name),
                s.module.table_state(s.local_name))


def _apply_into(s: LocalShard, c: Chunk, d: DecodedChunk, keep: torch.Tensor, local_dev: torch.Tensor,
                w: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
    """Set rows ``local_dev`` of ``w`` and ``states`` (the shard's tensors or copies of some of
    its rows) from the chunk's rows ``keep``."""
    dev = w.device
    c0, c1 = max(s.col_offset, c.col_offset), min(s.col_offset + s.num_cols, c.col_offset + c.num_cols)
    if c0 < c1:
        src = d.weight[keep][:, c0 - c.col_offset : c1 - c.col_offset]
        w[local_dev, c0 - s.col_offset : c1 - s.col_offset] = src.to(device=dev, dtype=w.dtype)
    per_row = row_state_names(s.module, s.table.dim)
    for name, t in d.state.items():
        if name not in states:
            raise CheckpointError(f"checkpoint state '{name}' of table '{c.table}' is unknown to the model's optimizer")
        dst = states[name]
        if name in per_row:
            dst[local_dev] = t[keep].to(device=dev, dtype=dst.dtype)
        elif c0 < c1:
            dst[local_dev, c0 - s.col_offset : c1 - s.col_offset] = t[keep][:, c0 - c.col_offset : c1 - c.col_offset].to(
                device=dev, dtype=dst.dtype
            )
