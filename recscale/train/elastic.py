"""Elastic restart: the checkpoint a job resumes from by itself (``checkpoint.auto_resume``).

``torchrun --max-restarts N`` restarts every rank of a job when one of them dies, with
``TORCHELASTIC_RESTART_COUNT`` one higher, and the same command line. With ``auto_resume`` such
a job continues from the newest valid checkpoint on the newest run's lineage under
``checkpoint.dir``: the counters, RNG states and reader position come from that checkpoint, so
the steps trained after it and lost with the dead rank are trained again, once, and no sample
is counted twice. The ranks may be more or fewer than the checkpoint's: restores reshard.

A job whose config also names ``checkpoint.resume`` starts from that one on its first attempt;
a restart takes the newest checkpoint only when it descends from that one (it was written by
this job), else the configured one again (the job died before its first checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from recscale.checkpoint.lineage import ancestry, lineage, list_checkpoints, resolve, sub
from recscale.checkpoint.manifest import CheckpointError
from recscale.checkpoint.restore import load_chain, load_manifest
from recscale.checkpoint.settings import CheckpointSettings
from recscale.checkpoint.storage import LocalStorage

Target = tuple[LocalStorage, str]


def restart_count() -> int:
    """How often torchrun has restarted this job (0 on its first attempt and outside torchrun)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def newest_valid(root: LocalStorage, log: Callable[[str], None]) -> Target | None:
    """The newest checkpoint on the newest run's lineage whose manifest and chain check out
    (manifests, digest links, file sizes); damaged ones are skipped with a line that says why."""
    for run, limit in lineage(root).runs:
        storage = sub(root, run) if run else root
        names = [n for n in list_checkpoints(storage) if limit is None or int(n.removeprefix("step")) <= limit]
        for name in reversed(names):
            try:
                load_chain(storage, load_manifest(storage, name))
                return storage, name
            except (CheckpointError, OSError, ValueError) as e:
                log(f"checkpoint.auto_resume: skipping {storage.describe(name)}: {e}")
    return None


def descends(found: Target, start: Target) -> bool:
    """``found`` is ``start`` or was written by a run that resumed (directly or not) from it."""
    if (found[0].root / found[1]).resolve() == (start[0].root / start[1]).resolve():
        return True
    digest = load_manifest(*start).digest
    return any(rec.get("digest") == digest for rec in ancestry(found[0]))


def auto_resume_target(settings: CheckpointSettings, log: Callable[[str], None]) -> Target | None:
    """Rank 0: the checkpoint this attempt resumes from, or None to start fresh."""
    attempt = restart_count()
    configured = settings.resume
    if configured and attempt == 0:
        return resolve(configured, settings.dir)
    found = newest_valid(LocalStorage(settings.dir), log)
    how = f"restart {attempt} of this job" if attempt else "first attempt"
    if found is None:
        if configured:
            log(f"checkpoint.auto_resume ({how}): no checkpoint written yet; resuming from {configured} as configured")
            return resolve(configured, settings.dir)
        log(f"checkpoint.auto_resume ({how}): no checkpoint under {settings.dir} yet; starting fresh")
        return None
    if configured and configured != "latest":
        start = resolve(configured, settings.dir)
        if not descends(found, start):
            log(f"checkpoint.auto_resume ({how}): {found[0].describe(found[1])} does not descend from the configured "
                f"{configured}; resuming from that again")
            return start
    log(f"checkpoint.auto_resume ({how}): resuming from the newest valid checkpoint, {found[0].describe(found[1])}")
    return found
