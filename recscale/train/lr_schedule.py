"""The learning-rate schedule: an optional linear warmup, then the configured rate, then a
polynomial decay (the shape of MLPerf's DLRM reference), for both optimizers alike.

The multiplier is a pure function of the number of finished steps, so a resumed run follows
the same schedule with nothing extra in the checkpoint. Decaying the rate also makes the end of
a run a smooth function of its middle: with a constant rate, a sample crossing a ReLU boundary
late in training becomes a full Adagrad step that nothing damps
(``benchmarks/results/2026-11-24-checkpoint-sensitivity.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LRScheduleConfig:
    # The rate ramps linearly from lr / warmup_steps to lr over the first warmup_steps steps (0: none).
    warmup_steps: int = 0
    # Step at which the decay begins (-1: the rate never decays).
    decay_start_step: int = -1
    # Steps the decay lasts (0: until the last step of the last epoch; train.max_steps, a stop,
    # does not shorten it, so a run stopped early and resumed follows one schedule).
    decay_steps: int = 0
    # Shape of the decay: 1 linear, 2 quadratic (MLPerf DLRM).
    decay_power: float = 1.0
    # Share of the configured rate left when the decay ends, and kept after it.
    end_factor: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.warmup_steps > 0 or self.decay_start_step >= 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the key for values no schedule can have."""
        if self.warmup_steps < 0:
            raise ValueError(f"config key 'lr_schedule.warmup_steps': expected a value >= 0, got {self.warmup_steps}")
        if self.decay_start_step < -1:
            raise ValueError(
                f"config key 'lr_schedule.decay_start_step': expected a step >= 0, or -1 for no decay, "
                f"got {self.decay_start_step}"
            )
        if self.decay_steps < 0:
            raise ValueError(f"config key 'lr_schedule.decay_steps': expected a value >= 0, got {self.decay_steps}")
        if not self.decay_power > 0:
            raise ValueError(f"config key 'lr_schedule.decay_power': expected a value > 0, got {self.decay_power}")
        if not 0.0 <= self.end_factor <= 1.0:
            raise ValueError(f"config key 'lr_schedule.end_factor': expected a value in [0, 1], got {self.end_factor}")
        if self.decay_start_step >= 0 and self.warmup_steps > self.decay_start_step:
            raise ValueError(
                f"config key 'lr_schedule.decay_start_step': the decay starts at step {self.decay_start_step}, "
                f"inside the warmup (lr_schedule.warmup_steps = {self.warmup_steps}); start it at the warmup's end or later"
            )

    def check_length(self, total_steps: int) -> None:
        """A rate of 0 is no training step: refuse a decay to 0 that ends before the run does."""
        if self.decay_start_step < 0 or self.end_factor > 0:
            return
        end = self.decay_start_step + self._decay_length(total_steps)
        if end < total_steps:
            raise ValueError(
                f"config key 'lr_schedule.decay_steps': the rate decays to 0 at step {end} but the run has "
                f"{total_steps} steps; set decay_steps to {total_steps - self.decay_start_step} or 0 (until the end), "
                "or lr_schedule.end_factor > 0"
            )

    def factor(self, step: int, total_steps: int) -> float:
        """Multiplier of the configured rates for the step after ``step`` finished steps."""
        f = 1.0
        if step < self.warmup_steps:
            f = (step + 1) / self.warmup_steps
        if 0 <= self.decay_start_step <= step:
            done = min(1.0, (step - self.decay_start_step) / self._decay_length(total_steps))
            f = self.end_factor + (1.0 - self.end_factor) * (1.0 - done) ** self.decay_power
        return f

    def describe(self, total_steps: int) -> str:
        """One line for the training log."""
        parts = [f"warmup {self.warmup_steps} steps"] if self.warmup_steps else []
        if self.decay_start_step >= 0:
            shape = "linear" if self.decay_power == 1 else f"power {self.decay_power:g}"
            parts.append(
                f"{shape} decay from step {self.decay_start_step} over {self._decay_length(total_steps)} steps "
                f"to {self.end_factor:g} x lr"
            )
        return "lr schedule: " + ", ".join(parts) + f" ({total_steps} steps in all)"

    def _decay_length(self, total_steps: int) -> int:
        return max(1, self.decay_steps or total_steps - self.decay_start_step)


def set_learning_rates(
    dense_opt: torch.optim.Optimizer, embeddings: torch.nn.Module, dense_lr: float, embedding_lr: float
) -> None:
    """Give the dense optimizer and the fused embedding optimizer their rates for the next step."""
    for group in dense_opt.param_groups:
        group["lr"] = dense_lr
    embeddings.set_learning_rate(embedding_lr)


class LearningRates:
    """Applies the schedule before each step: sets both optimizers' rates when the factor changes."""

    def __init__(self, schedule: LRScheduleConfig, total_steps: int, dense_opt: torch.optim.Optimizer,
                 embeddings: torch.nn.Module, dense_lr: float, embedding_lr: float) -> None:
        self.schedule, self.total_steps = schedule, total_steps
        self.dense_opt, self.embeddings = dense_opt, embeddings
        self.dense_lr, self.embedding_lr = dense_lr, embedding_lr
        self.factor: float | None = None  # the factor in force (None: no schedule)

    def before_step(self, step: int) -> None:
        """``step``: finished steps so far."""
        if not self.schedule.enabled:
            return
        f = self.schedule.factor(step, self.total_steps)
        if f != self.factor:
            self.factor = f
            set_learning_rates(self.dense_opt, self.embeddings, self.dense_lr * f, self.embedding_lr * f)
