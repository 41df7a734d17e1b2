"""Fault injection for tests and the kill campaign: SIGKILL a chosen rank at a chosen moment.

Off unless the environment sets ``RECSCALE_FAULT``, read once, here only::

    RECSCALE_FAULT="rank=1,step=5,at=checkpoint,restarts=0;1"

kills rank 1 (``RANK``, 0 outside torchrun) at the first point of kind ``at`` whose step is at
least 5, on the attempts whose ``TORCHELASTIC_RESTART_COUNT`` (0 when unset) is listed
(default: 0 only); ``step=5;9`` with ``restarts=0;1`` kills at step 5 on the first attempt and
at step 9 on the second. Points: ``step`` (after a training step, before its checkpoint),
``checkpoint`` (while the background writer is in the middle of that step's data file) and
``loader`` (while the data loader builds that step's batch; from a loader worker process the
rank itself is killed). A process dies the way an out-of-memory kill or a lost machine would
take it: no handler runs, nothing is flushed.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "RECSCALE_FAULT"
POINTS = ("step", "checkpoint", "loader")


class FaultSpecError(ValueError):
    """A malformed ``RECSCALE_FAULT``; the message names the part and the expected form."""


@dataclass(frozen=True)
class Fault:
    rank: int
    steps: tuple[int, ...]  # one step for every listed attempt, or one per attempt
    at: str
    restarts: tuple[int, ...] = (0,)

    def step_on(self, attempt: int) -> int | None:
        """The step this fault strikes at on an attempt (None: not on this one)."""
        if attempt not in self.restarts:
            return None
        return self.steps[0] if len(self.steps) == 1 else self.steps[self.restarts.index(attempt)]


def parse(text: str) -> Fault:
    """``rank=R,step=S[;S2...],at=POINT[,restarts=A;B]`` -> Fault (FaultSpecError when malformed)."""
    form = "expected rank=R,step=S[;S2...],at=step|checkpoint|loader[,restarts=A;B]"
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in ("rank", "step", "at", "restarts"):
            raise FaultSpecError(f"{ENV}: cannot read '{part[:40]}'; {form}")
        fields[key] = value.strip()
    missing = [k for k in ("rank", "step", "at") if k not in fields]
    if missing:
        raise FaultSpecError(f"{ENV}: missing {', '.join(missing)}; {form}")
    if fields["at"] not in POINTS:
        raise FaultSpecError(f"{ENV}: at={fields['at'][:40]} is not one of {', '.join(POINTS)}")
    try:
        steps = tuple(int(x) for x in fields["step"].split(";"))
        restarts = tuple(int(x) for x in fields.get("restarts", "0").split(";"))
        fault = Fault(int(fields["rank"]), steps, fields["at"], restarts)
    except ValueError:
        raise FaultSpecError(f"{ENV}: rank, step and restarts must be integers; {form}") from None
    if len(steps) not in (1, len(restarts)):
        raise FaultSpecError(f"{ENV}: give one step, or one per listed restart ({len(restarts)}); {form}")
    return fault


def _active() -> tuple[str, int] | None:
    """(point, step) where this process is to be killed, if anywhere."""
    text = os.environ.get(ENV, "")
    if not text:
        return None
    fault = parse(text)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    step = fault.step_on(attempt)
    if int(os.environ.get("RANK", "0") or 0) != fault.rank or step is None:
        return None
    return fault.at, step


_UNREAD = ("", 0)
_target: tuple[str, int] | None = _UNREAD


def point(kind: str, step: int, worker: bool = False) -> None:
    """A place where the configured fault may strike (nearly free when none is configured).
    ``worker``: called in a data-loader worker, whose parent is the rank."""
    global _target
    if _target is _UNREAD:  # read on first use: a malformed value is an error of the run, not of an import
        _target = _active()
    t = _target
    if t is None or t[0] != kind or step < t[1]:
        return
    os.kill(os.getppid() if worker else os.getpid(), signal.SIGKILL)
    if worker:  # the rank is gone; this worker must not outlive it
        os.kill(os.getpid(), signal.SIGKILL)
