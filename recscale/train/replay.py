"""What a training summary records to rerun its run (``recscale train --replay SUMMARY.json``):
the resolved config, the plan and the hardware description it was planned on, and versions.

Two runs of one config and seed give equal summaries except for the fields in
``TIMING_FIELDS`` (wall-clock measurements), on one process and on N ranks alike."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recscale import __version__
from recscale.sharding.plan import PlanError, ShardingPlan
from recscale.train.config import Config, ConfigError, config_from_dict

# Summary fields that measure time: they differ between equal runs. The rest, ``evals``,
# losses, AUC, plan and config included, are equal bit for bit.
TIMING_FIELDS = ("train_seconds", "train_samples_per_sec", "steady_samples_per_sec", "comm_seconds_per_step",
                 "restore_seconds", "checkpoint_stall_s")
# Per checkpoint in ``checkpoints``: its stall and background write times.
CHECKPOINT_TIMING_FIELDS = ("stall_s", "background_s")


def versions() -> dict[str, str]:
    return {"recscale": __version__, "torch": torch.__version__, "python": platform.python_version()}


def without_timings(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary less its timing fields: what equal runs must agree on exactly."""
    out = {k: v for k, v in summary.items() if k not in TIMING_FIELDS}
    if "checkpoints" in out:
        out["checkpoints"] = [{k: v for k, v in c.items() if k not in CHECKPOINT_TIMING_FIELDS} for c in out["checkpoints"]]
    return out


@dataclass(frozen=True)
class Replay:
    """A recorded run: its config, world size, and (several ranks) the plan it ran, with the
    hardware description and search record of the planner that made it (None if not planned)."""

    path: str
    config: Config
    world_size: int
    plan: ShardingPlan | None
    hardware: dict[str, Any] | None
    plan_search: dict[str, Any] | None


def load_replay(path: str | Path) -> Replay:
    """Read a summary written by ``recscale train --summary-json``; ConfigError names what is wrong."""
    p = Path(path)
    where = f"--replay '{p}'"
    if not p.is_file():
        raise ConfigError(f"{where}: no such file (pass a summary written by `recscale train --summary-json`)")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    missing = [k for k in ("config", "world_size", "plan", "hardware", "versions") if not isinstance(d, dict) or k not in d]
    if missing:
        raise ConfigError(f"{where}: not a replayable training summary (no {', '.join(repr(k) for k in missing)}); "
                          "write one with `recscale train --summary-json`")
    try:
        cfg = config_from_dict(d["config"])
    except ConfigError as e:
        raise ConfigError(f"{where}: its config: {e}") from None
    plan = None
    if d["plan"] is not None:
        try:
            plan = ShardingPlan.from_dict(d["plan"], f"{where} plan")
        except PlanError as e:
            raise ConfigError(str(e)) from None
    world = d["world_size"]
    if not isinstance(world, int) or world < 1 or (plan.world_size if plan is not None else 1) != world:
        raise ConfigError(f"{where}: world_size {world!r} does not match its plan (several ranks need one, one process none)")
    return Replay(str(p), cfg, world, plan, d["hardware"], d.get("plan_search"))


def check_world_size(replay: Replay, world_size: int) -> None:
    """A replay runs at the recorded world size: another would shard and reduce differently."""
    if world_size != replay.world_size:
        how = "as one process" if replay.world_size == 1 else f"with torchrun --nproc_per_node={replay.world_size}"
        raise ConfigError(
            f"--replay '{replay.path}': the run had {replay.world_size} rank(s), this job has {world_size}; launch it {how}"
        )
