"""Runs and their lineage: every training run writes its checkpoints into a folder of its own.

Under ``checkpoint.dir``::

    run-20261125T114550Z-3f9a1c2e/   one folder per run (a resume starts a new run)
      run.json                       the run's identity, start time, world size, and the
                                     checkpoint it resumed from (path, run, name, step, digest)
      step0000000100/                its checkpoints

A run's first checkpoint is always a full one, so every chain stays inside its run folder and
a run never writes into a folder another run wrote: no checkpoint directory is overwritten,
and resuming from an older checkpoint leaves the other branch as it was. ``latest`` is the
newest checkpoint of the newest run that has one. The lineage of a run follows the ``parent``
records back; checkpoints of an ancestor after the step a descendant resumed from are a stale
branch. An older flat layout (``<dir>/stepN``) is still read.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recscale.checkpoint.manifest import MANIFEST, CheckpointError, short
from recscale.checkpoint.storage import LocalStorage, Storage

RUN_FILE = "run.json"
RUN_PREFIX = "run-"


@dataclass
class RunInfo:
    run: str  # the run folder's name: its identity
    started_unix: float
    world_size: int = 1
    # The checkpoint this run resumed from: {"path", "run", "name", "step", "digest", "newest"}
    # ("newest": it was its run's newest checkpoint then, i.e. this run continues that run).
    parent: dict[str, Any] | None = None
    # The parent's parent record, its parent's, ...: the lineage survives the pruning of a parent.
    ancestors: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    @staticmethod
    def from_json(raw: bytes, where: str) -> RunInfo:
        try:
            d = json.loads(raw)
            info = RunInfo(str(d["run"]), float(d["started_unix"]), int(d.get("world_size", 1)), d.get("parent"),
                           list(d.get("ancestors", [])))
            if not all(isinstance(x, dict) for x in [info.parent or {}, *info.ancestors]):
                raise TypeError("'parent' and 'ancestors' must be objects")
            return info
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: damaged run record ({type(e).__name__}: {short(str(e), 120)})") from None

    @property
    def parent_run(self) -> str:
        return str((self.parent or {}).get("run") or "")


@dataclass
class RunContext:
    """What a checkpoint manager needs to write a run: the root and this run's record."""

    root: LocalStorage
    info: RunInfo

    @property
    def storage(self) -> LocalStorage:
        return LocalStorage(self.root.root / self.info.run)


def new_run_name() -> str:
    """``run-<UTC start time>-<random>``: sorts by start time, unique without coordination."""
    return f"{RUN_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def list_checkpoints(storage: Storage) -> list[str]:
    """Committed checkpoint directories (names starting with 'step'), oldest first."""
    return [d for d in storage.list_dirs() if d.startswith("step")]


def read_run(root: Storage, run: str) -> RunInfo:
    path = f"{run}/{RUN_FILE}"
    if root.size(path) is None:
        raise CheckpointError(f"{root.describe(run)}: no {RUN_FILE}; not a run folder")
    return RunInfo.from_json(root.read(path), root.describe(path))


def list_runs(root: Storage) -> list[RunInfo]:
    """Every run folder under ``root`` with a readable record, oldest first."""
    runs = []
    for d in root.list_dirs():
        if d.startswith(RUN_PREFIX):
            try:
                runs.append(read_run(root, d))
            except (CheckpointError, OSError):
                continue
    return sorted(runs, key=lambda r: (r.started_unix, r.run))


def sub(root: LocalStorage, run: str) -> LocalStorage:
    return LocalStorage(root.root / run)


def newest(root: LocalStorage) -> tuple[LocalStorage, str]:
    """The newest checkpoint of the newest run that has one; else of the flat layout."""
    for info in reversed(list_runs(root)):
        names = list_checkpoints(sub(root, info.run))
        if names:
            return sub(root, info.run), names[-1]
    names = list_checkpoints(root)
    if names:
        return root, names[-1]
    raise CheckpointError(
        f"no checkpoints under '{root.root}' (committed ones are directories named step* in run-* folders)"
    )


def resolve(path: str, default_root: str = "") -> tuple[LocalStorage, str]:
    """``latest`` (the newest under ``default_root``), a checkpoint directory, a run folder (its
    newest) or a root of run folders (the newest checkpoint of the newest run)."""
    if path == "latest":
        if not default_root:
            raise CheckpointError("resume 'latest' needs checkpoint.dir, the directory to look in")
        path = default_root
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{p}' does not exist")
    if not p.is_dir():
        raise CheckpointError(
            f"checkpoint path '{p}' is a file; give a checkpoint directory, a run folder or checkpoint.dir"
        )
    if (p / MANIFEST).is_file() or any(p.glob("rank*.bin")):
        return LocalStorage(p.parent), p.name
    return newest(LocalStorage(p))


def cleanup(root: LocalStorage) -> None:
    """Remove what a killed run left: temporary checkpoint directories, half-deleted runs, and
    run folders without a committed checkpoint (a run that never got to its first one)."""
    for d in root.list_dirs():
        if d.startswith(".tmp-") or d.startswith(".old-"):
            root.delete_dir(d)
        elif d.startswith(RUN_PREFIX):
            run = sub(root, d)
            for t in run.list_dirs():
                if t.startswith(".tmp-") or t.startswith(".old-"):
                    run.delete_dir(t)
            if not list_checkpoints(run):
                root.delete_dir(d)


def parent_record(storage: LocalStorage, name: str, run: str, step: int, digest: str) -> dict[str, Any]:
    names = list_checkpoints(storage)
    return {
        "path": str((storage.root / name).resolve()), "run": run, "name": name, "step": step, "digest": digest,
        "newest": bool(names) and names[-1] == name,
    }


def prune_parent(root: LocalStorage, info: RunInfo) -> str | None:
    """A run that continues its parent run from the parent's newest checkpoint makes that run
    redundant once it has a checkpoint of its own: delete it (repeated kill and resume then does
    not fill the disk). A parent resumed from an older step (a branch), one with other children,
    or one that went on meanwhile is kept. Returns the run deleted."""
    p = info.parent or {}
    run = str(p.get("run") or "")
    if not run or not p.get("newest") or not (root.root / run / RUN_FILE).is_file():
        return None
    if Path(str(p.get("path", ""))).parent.resolve() != (root.root / run).resolve():
        return None  # resumed from another root: not ours to delete
    names = list_checkpoints(sub(root, run))
    if names and names[-1] != p.get("name"):
        return None
    if any(r.parent_run == run and r.run != info.run for r in list_runs(root)):
        return None
    hidden = f".old-{run}"
    root.commit(run, hidden)  # out of sight in one step, then deleted
    root.delete_dir(hidden)
    return run


# ---------------------------------------------------------------------- lineage
@dataclass
class Lineage:
    newest: str  # the newest run with a checkpoint ("" when none)
    # (run, last step on the lineage or None for all of it), newest first; "" = the flat layout
    runs: list[tuple[str, int | None]]

    def describe(self) -> str:
        if not self.runs:
            return "no runs"
        parts = [(run or "(flat layout)") + ("" if limit is None else f" up to step {limit}")
                 for run, limit in reversed(self.runs)]
        return " -> ".join(parts)

    def holds(self, run: str, step: int) -> bool:
        return any(r == run and (limit is None or step <= limit) for r, limit in self.runs)


def lineage(root: LocalStorage) -> Lineage:
    """The newest run with a checkpoint and its ancestors (from its parent records)."""
    with_ckpt = [r for r in list_runs(root) if list_checkpoints(sub(root, r.run))]
    if not with_ckpt:
        return Lineage("", [("", None)] if list_checkpoints(root) else [])
    cur = with_ckpt[-1]
    out: list[tuple[str, int | None]] = [(cur.run, None)]
    for rec in [cur.parent, *cur.ancestors] if cur.parent else []:
        out.append((str(rec.get("run") or ""), int(rec.get("step", 0))))
    return Lineage(cur.run, out)


def ancestry(storage: LocalStorage) -> list[dict[str, Any]]:
    """The parent records above a checkpoint's run (its run's parent, that one's, ...)."""
    try:
        info = RunInfo.from_json((storage.root / RUN_FILE).read_bytes(), str(storage.root / RUN_FILE))
    except (OSError, CheckpointError):
        return []
    return [info.parent, *info.ancestors] if info.parent else []


def branch_note(storage: LocalStorage, name: str, step: int) -> str:
    """Empty when the checkpoint is on the newest run's lineage; else a line that says it is a
    stale branch, which run it belongs to, and which run superseded it."""
    folder = storage.root.resolve()
    if (folder / RUN_FILE).is_file():
        root, run = LocalStorage(folder.parent), folder.name
    else:
        root, run = LocalStorage(folder), ""
    lin = lineage(root)
    if not lin.runs or lin.holds(run, step):
        return ""
    return (
        f"stale branch: {name} belongs to run {run or '(flat layout)'}, which the newest run {lin.newest} does not "
        f"build on (its lineage: {lin.describe()}); `--resume latest` restores {lin.newest}, not this"
    )
