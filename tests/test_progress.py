"""The loop's counters: the steady rate leaves out the first steps' start-up."""

from __future__ import annotations

import torch

from recscale.train import progress
from recscale.train.progress import WARMUP_STEPS, TrainState


def _run(monkeypatch, step_seconds: list[float], batch: int = 100) -> TrainState:
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    state = TrainState()
    state.resume()
    for s in step_seconds:
        clock[0] += s
        state.record(torch.tensor(0.0, dtype=torch.float64), batch, batch)
    state.pause()
    return state


def test_steady_rate_leaves_out_a_slow_start(monkeypatch):
    # a first step of 1 s (connections, buffers), then steps of 10 ms
    state = _run(monkeypatch, [1.0] + [0.01] * 39)
    assert abs(state.steady_samples_per_sec() - 100 / 0.01) < 1e-6
    whole = state.samples / state.train_seconds
    assert whole < 0.3 * state.steady_samples_per_sec()


def test_steady_rate_needs_enough_steps(monkeypatch):
    assert _run(monkeypatch, [0.01] * (2 * WARMUP_STEPS - 1)).steady_samples_per_sec() is None
    assert _run(monkeypatch, [0.01] * (2 * WARMUP_STEPS)).steady_samples_per_sec() is not None


def test_steady_rate_leaves_out_paused_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    state = TrainState()
    state.resume()
    for i in range(20):
        clock[0] += 0.02
        state.record(torch.tensor(0.0, dtype=torch.float64), 50, 50)
        if i == 12:  # an evaluation: paused, not training time
            state.pause()
            clock[0] += 5.0
            state.resume()
    state.pause()
    assert abs(state.steady_samples_per_sec() - 50 / 0.02) < 1e-6
