"""Where a training run stands (steps, samples, timed seconds, the running loss, evaluations)
and the progress bar that shows it: the loop's counters in one place, so the loop itself reads
as calls to its components."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from recscale.train.checkpointing import Progress

# The bar's figures need a host sync (the loss lives on the device): refresh every this many steps.
REFRESH_EVERY_STEPS = 20
# Steps a process runs before its steady rate is timed: the first builds the collectives'
# connections and buffers, fills the pipeline and grows the allocator's pools.
WARMUP_STEPS = 5


@dataclass
class TrainState:
    """The loop's counters. Timing counts training only: ``pause()`` before an evaluation and
    ``resume()`` after it keep evaluations out of ``train_seconds``."""

    step: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    epoch: int = 0
    next_batch: int = 0  # batches of ``epoch`` already trained
    running_loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    running_n: int = 0
    evals: list[dict[str, float]] = field(default_factory=list)
    first_step: int = 0  # the step this process started from (after a resume, not 0)
    _span_start: float | None = None
    _warm: tuple[int, float] | None = None  # (samples, training seconds) once WARMUP_STEPS are through

    @classmethod
    def from_progress(cls, p: Progress, device: torch.device) -> TrainState:
        # A device tensor: adding each step's loss costs no host sync.
        loss = torch.tensor(p.running_loss, dtype=torch.float64, device=device)
        return cls(p.step, p.samples, p.train_seconds, p.epoch, p.next_batch, loss, p.running_n, list(p.evals), p.step)

    def resume(self) -> None:
        self._span_start = time.perf_counter()

    def pause(self) -> None:
        if self._span_start is not None:
            self.train_seconds += time.perf_counter() - self._span_start
            self._span_start = None

    def elapsed(self) -> float:
        """Training seconds so far, the open span included."""
        return self.train_seconds + (time.perf_counter() - self._span_start if self._span_start is not None else 0.0)

    def record(self, loss_sum: torch.Tensor, batch_size: int, global_batch_size: int) -> None:
        self.step += 1
        self.samples += global_batch_size
        self.running_loss += loss_sum
        self.running_n += batch_size
        if self.steps_this_process == WARMUP_STEPS:
            if self.running_loss.is_cuda:
                torch.cuda.synchronize()  # the warm-up's queued kernels count as warm-up
            self._warm = (self.samples, self.elapsed())

    def steady_samples_per_sec(self) -> float | None:
        """Samples per second after this process's first ``WARMUP_STEPS`` steps: what a long
        run settles at (a short run's whole-run rate carries its start-up); ``None`` for a run
        of fewer than twice as many steps, too short to tell."""
        if self._warm is None or self.steps_this_process < 2 * WARMUP_STEPS:
            return None
        samples, seconds = self._warm
        return (self.samples - samples) / max(self.train_seconds - seconds, 1e-9)

    def mean_loss(self) -> float:
        return float(self.running_loss) / max(self.running_n, 1)

    @property
    def steps_this_process(self) -> int:
        return self.step - self.first_step

    def position(self) -> Progress:
        """What a checkpoint records, so a resumed run continues exactly here."""
        return Progress(self.step, self.samples, self.elapsed(), self.epoch, self.next_batch,
                        float(self.running_loss), self.running_n, list(self.evals))

    def loss_over_ranks(self, group) -> None:
        """Make the running loss the mean over every rank's samples, not rank 0's alone."""
        # On the loss's device: NCCL reduces device tensors only.
        totals = torch.tensor([float(self.running_loss), float(self.running_n)], dtype=torch.float64,
                              device=self.running_loss.device)
        torch.distributed.all_reduce(totals, group=group)
        self.running_loss, self.running_n = totals[0], int(totals[1])


class ProgressBar:
    """tqdm with samples/s, the running loss, the learning-rate factor and the tiers' figures."""

    def __init__(self, total_steps: int, state: TrainState, show: bool, rank: int) -> None:
        """``show``: draw the bar (rank 0 only); ``write`` prints on rank 0 either way."""
        self.total_steps, self.rank = total_steps, rank
        self._bar = tqdm(total=total_steps, initial=state.step, disable=not show or rank != 0, unit="step",
                         dynamic_ncols=True)

    def due(self, step: int) -> bool:
        return step % REFRESH_EVERY_STEPS == 0 or step == self.total_steps

    def show(self, state: TrainState, lr_factor: float | None, extra: dict[str, Any]) -> None:
        fields = {"lr_factor": f"{lr_factor:.3g}"} if lr_factor is not None else {}
        fields.update({k: f"{v:.3g}" for k, v in extra.items()})
        elapsed = max(state.elapsed(), 1e-9)
        self._bar.set_postfix(loss=f"{state.mean_loss():.4f}", samples_per_s=f"{state.samples / elapsed:,.0f}", **fields)

    def update(self) -> None:
        self._bar.update(1)

    def write(self, line: str) -> None:
        if self.rank == 0:
            self._bar.write(line)

    def close(self) -> None:
        self._bar.close()
