"""A guard against divergence: a non-finite loss or dense weight stops the run with the step.

The loop must not pay a host sync per step for it, so each step's loss stays on the device in a
short list; ``check`` looks at them (and, when asked, at the dense parameters) in one sync at the
points where the loop synchronises anyway: the progress update every few steps, before a
checkpoint and at the end. On several ranks the verdict is agreed by one small all-reduce, so
every rank stops at the same step. An embedding row that turns non-finite shows in the loss of
the next batch that reads it; the tables themselves are not scanned.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class NonFiniteError(RuntimeError):
    """Training diverged: a loss or weight is NaN or infinite. The message names the step."""


class FiniteGuard:
    def __init__(self, params: list[tuple[str, torch.Tensor]], group: object | None = None) -> None:
        self.params = params
        self.group = group
        self.pending: list[torch.Tensor] = []  # per-step loss sums since the last check, on the device
        self.first_step = 0  # the step of pending[0]

    def observe(self, step: int, loss_sum: torch.Tensor) -> None:
        """Record one step's loss (no sync)."""
        if not self.pending:
            self.first_step = step
        self.pending.append(loss_sum.detach().reshape(()))

    def check(self, step: int, weights: bool, last_good: Callable[[int], str]) -> None:
        """Raise NonFiniteError when a loss since the last check (or, with ``weights``, a dense
        parameter) is not finite. ``last_good(step)``: the newest checkpoint before ``step``."""
        pending, first = self.pending, self.first_step
        self.pending = []
        if not pending and not weights:
            return
        device = pending[0].device if pending else (self.params[0][1].device if self.params else torch.device("cpu"))
        losses = (torch.stack([x.double() for x in pending]) if pending
                  else torch.zeros(0, dtype=torch.float64, device=device))
        bad = ~torch.isfinite(losses)
        n = len(pending)
        # First bad step (n when none) and the first bad parameter (len(params) when none).
        idx = torch.where(bad, torch.arange(n, device=device), n).min() if n else torch.tensor(0, device=device)
        p_idx = torch.tensor(len(self.params), device=device)
        if weights and self.params:
            finite = torch.stack([torch.isfinite(p).all() for _, p in self.params])
            p_idx = torch.where(~finite, torch.arange(len(self.params), device=device), len(self.params)).min()
        verdict = torch.stack([idx.to(torch.float64), p_idx.to(torch.float64)])
        if self.group is not None:
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=self.group)
        i, j = (int(v) for v in verdict.tolist())  # the one host sync
        if i < n:
            at = first + i
            local = float(losses[i])
            what = f"the training loss is {local}"
            if math.isfinite(local):  # the non-finite loss was another rank's
                what = "another rank's training loss is not finite"
            raise NonFiniteError(f"step {at}: {what}; stopping the run. {_resume_hint(last_good(at))}")
        if j < len(self.params):
            raise NonFiniteError(
                f"step {step}: dense parameter '{self.params[j][0]}' is not finite; stopping the run. "
                f"{_resume_hint(last_good(step))}"
            )


def _resume_hint(path: str) -> str:
    if not path:
        return "No checkpoint was written before it; lower the learning rates (or check the data) and start again"
    return f"Last good checkpoint: {path} (resume from it with --resume and lower learning rates)"
