"""What ``recscale ckpt list|inspect|verify|export`` does: read-only views of checkpoints and a
plain full-precision export (no recscale needed to read it)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recscale.atomic import write_text_atomic
from recscale.checkpoint.lineage import RUN_FILE, branch_note, lineage, list_runs, newest, sub
from recscale.checkpoint.manifest import CheckpointError, Manifest
from recscale.checkpoint.restore import (
    check_files,
    list_checkpoints,
    load_chain,
    load_manifest,
    read_chunk,
    read_file_checked,
    resolve,
)
from recscale.checkpoint.storage import LocalStorage, Storage
from recscale.embedding import TableConfig, make_optimizer
from recscale.embedding.table_batched import init_rows


@dataclass
class Listing:
    name: str
    step: int
    kind: str
    chain: list[str]
    bytes: int
    error: str = ""
    stale: bool = False  # not on the newest run's lineage (a branch a later run did not build on)
    latest: bool = False  # what `--resume latest` restores


@dataclass
class RunListing:
    run: str  # "" = checkpoints of the older flat layout directly under the root
    started_unix: float
    parent: dict[str, Any] | None
    checkpoints: list[Listing]


def list_root(root: str) -> list[RunListing]:
    """Every run under ``root`` with its committed checkpoints, oldest first (a damaged
    checkpoint is listed with its error); marks the latest and the stale branches."""
    p = Path(root)
    if not p.is_dir():
        raise CheckpointError(
            f"checkpoint directory '{p}' does not exist" if not p.exists() else f"'{p}' is a file, not a checkpoint directory"
        )
    top = LocalStorage(p)
    if (p / RUN_FILE).is_file():  # a run folder: list it within its root
        top = LocalStorage(p.resolve().parent)
        runs = [r for r in list_runs(top) if r.run == p.resolve().name]
    else:
        runs = list_runs(top)
    lin = lineage(top)
    try:
        latest = newest(top)
        latest_path = latest[0].root / latest[1]
    except CheckpointError:
        latest_path = None
    out = []
    flat = [] if (p / RUN_FILE).is_file() else [RunListing("", 0.0, None, _listings(top, "", lin, latest_path))]
    for info in runs:
        listed = _listings(sub(top, info.run), info.run, lin, latest_path)
        out.append(RunListing(info.run, info.started_unix, info.parent, listed))
    return [r for r in flat if r.checkpoints] + out


def _listings(storage: LocalStorage, run: str, lin, latest_path) -> list[Listing]:
    out = []
    for name in list_checkpoints(storage):
        try:
            m = load_manifest(storage, name)
            out.append(Listing(name, m.step, m.kind, m.chain, m.data_bytes(), stale=not lin.holds(run, m.step),
                               latest=latest_path == storage.root / name))
        except CheckpointError as e:
            out.append(Listing(name, -1, "?", [], 0, str(e)))
    return out


def inspect(path: str) -> dict[str, Any]:
    storage, name = resolve(path)
    m = load_manifest(storage, name)
    per_table: dict[str, dict[str, int]] = {}
    for c in m.chunks:
        t = per_table.setdefault(c.table, {"chunks": 0, "rows": 0, "bytes": 0})
        t["chunks"] += 1
        t["rows"] += c.num_rows
        t["bytes"] += c.length
    return {
        "path": storage.describe(name), "step": m.step, "kind": m.kind, "chain": m.chain, "policy": m.policy,
        "format_version": m.version, "world_size": m.world_size, "weight_codec": m.weight_codec,
        "state_codec": m.state_codec, "optimizer": m.optimizer, "training": m.training, "stats": m.stats,
        "files": [{"path": f.path, "size": f.size} for f in m.files], "tables": per_table,
        "table_shapes": {t.name: [t.num_rows, t.dim, t.dtype] for t in m.tables},
    }


def verify(path: str) -> list[str]:
    """Check the whole chain deeply: manifests, every file's size and sha256, every chunk's crc32.
    Returns what was checked; raises CheckpointError on the first problem."""
    storage, name = resolve(path)
    m = load_manifest(storage, name)
    checked = []
    for cm in load_chain(storage, m):
        check_files(storage, cm, deep=True)
        names = {f.path for f in cm.files}
        for c in cm.chunks:
            if c.file not in names:
                raise CheckpointError(
                    f"{storage.describe(cm.name)}: a chunk names file '{c.file}', which the manifest does not list"
                )
            read_chunk(storage, cm, c)
        checked.append(f"{storage.describe(cm.name)}: {cm.kind}, {len(cm.files)} files, {len(cm.chunks)} chunks, "
                       f"{cm.data_bytes():,} bytes OK" + (f", digest {cm.digest[:12]}" if cm.digest else ""))
    note = branch_note(storage, name, m.step)
    if note:
        checked.append(note)
    return checked


def assemble(storage: Storage, m: Manifest) -> dict[str, torch.Tensor]:
    """Whole tables (weights and optimizer state, float32) plus dense parameters, from the chain."""
    chain = load_chain(storage, m)
    out: dict[str, torch.Tensor] = {}
    initial = chain[0].initial_rows if chain[0].kind == "full" else None
    for t in m.tables:
        out[f"embeddings.{t.name}.weight"] = torch.zeros(t.num_rows, t.dim)
        if initial is not None:  # rows the baseline left out are at their initial values
            bounds = initial.get("bounds", {}).get(t.name)
            cfg = TableConfig(t.name, t.num_rows, t.dim, init_range=tuple(bounds) if bounds else None, dtype=t.dtype)  # type: ignore[arg-type]
            out[f"embeddings.{t.name}.weight"] = init_rows(cfg, int(initial["seed"])).float()
    dims = {t.name: t.dim for t in m.tables}
    opt = make_optimizer(m.optimizer["name"]) if m.optimizer.get("name") else None
    for cm in chain:
        for c in cm.chunks:
            d = read_chunk(storage, cm, c)
            out[f"embeddings.{c.table}.weight"][d.rows, c.col_offset : c.col_offset + c.num_cols] = d.weight.float()
            cols = opt.state_columns(dims[c.table]) if opt is not None else {}
            for name, t in d.state.items():
                key = f"embeddings.{c.table}.{name}"
                full_cols = cols.get(name, t.shape[1])
                if key not in out:
                    out[key] = torch.zeros(len(out[f"embeddings.{c.table}.weight"]), full_cols)
                if full_cols == dims[c.table]:  # one value per weight: this chunk's columns
                    out[key][d.rows, c.col_offset : c.col_offset + c.num_cols] = t
                else:  # one value per row
                    out[key][d.rows] = t
    state = torch.load(io.BytesIO(read_file_checked(storage, m, "rank00000.state")), weights_only=False)
    for k, v in state.get("dense_params", {}).items():
        out[f"dense.{k}"] = v.float()
    out["step"] = torch.tensor(int(m.training.get("step", m.step)))
    return out


def export(path: str, out: str) -> tuple[str, int]:
    """Write a plain state dict: safetensors for a ``.safetensors`` name, else ``torch.save``."""
    storage, name = resolve(path)
    m = load_manifest(storage, name)
    tensors = assemble(storage, m)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    if target.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(
                "--out ends with .safetensors but the safetensors package is not installed; "
                "pip install safetensors, or use a .pt name for torch.save"
            ) from None
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"source": storage.describe(name)})
    else:
        torch.save(tensors, tmp)
    tmp.replace(target)
    return str(target), len(tensors)


def write_json(path: str, text: str) -> None:
    write_text_atomic(path, text)
