"""The synchronisation wait a cluster's ranks pay for their cores' unsteady speed.

Every collective of a training step waits for the last rank to reach it. Where a rank's
compute time between two collectives varies from one step to the next (a shared VM's cores,
other processes, frequency changes), the step takes the expected maximum over the ranks of
those times, more than their mean, even for a plan that balances the ranks exactly. The
simulator's durations are the mean; ``sync_wait_factor`` stretches them by that expected excess.

``measure_jitter`` times it on this machine: one process per core runs the same short chunks
of arithmetic (about a step's stretch between two collectives) for a few seconds, and the
chunks that ran at the same moment on different cores are compared. Taking the ranks' times
as normal with a common spread and correlation, the excess of their maximum over the mean is
``jitter`` x the expected maximum of that many standard normals: ``jitter`` (the spread
relative to the mean, times sqrt(1 - correlation)) is what is kept, so a calibration on 2
cores prices 16 ranks too.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import queue
import time

import numpy as np


@functools.cache  # a numeric integral (milliseconds) that every simulated step of n ranks asks for
def expected_max_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one; 1/sqrt(pi) for two)."""
    if n <= 1:
        return 0.0
    x = np.linspace(-10.0, 10.0, 20001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-x * x / 2.0) / math.sqrt(2.0 * math.pi)
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


def sync_wait_factor(jitter: float, ranks: int) -> float:
    """How much longer ``ranks`` ranks that meet at every collective take than one rank's mean
    time, at this machine's ``jitter``."""
    return 1.0 + jitter * expected_max_normal(ranks) if ranks > 1 else 1.0


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """The standard normal CDF, vectorised (Abramowitz and Stegun 7.1.26: error below 2e-7)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def synced_stretch(means: list[float], jitter: float) -> float:
    """How much longer ranks whose compute between two collectives takes ``means`` on average
    run until the last of them arrives, relative to the slowest mean: E[max_r X_r] / max_r m_r,
    each X_r normal with mean m_r and spread ``jitter`` x m_r. Balanced ranks give
    ``sync_wait_factor``; a rank much slower than the others hardly waits for any of them, so
    only its own spread's share of the maximum is added (an unbalanced plan's slow rank is
    not stretched as if every rank could be the last)."""
    m = np.asarray([x for x in means if x > 0], dtype=float)  # ranks without work arrive at once
    if jitter <= 0 or m.size < 2:  # no spread, or at most one rank with work: no one to wait for
        return 1.0
    top = float(m.max())
    if np.allclose(m, top, rtol=1e-9):
        return sync_wait_factor(jitter, len(means))
    s = jitter * m
    x = np.linspace(float((m - 9 * s).min()), float((m + 9 * s).max()), 1201)
    cdf = np.prod(_normal_cdf((x[:, None] - m[None, :]) / s[None, :]), axis=1)
    expected = x[0] + float(np.sum((1.0 - cdf[:-1] + 1.0 - cdf[1:]) / 2) * (x[1] - x[0]))
    return max(1.0, expected / top)


def _probe(barrier, chunk_s: float, seconds: float, out) -> None:
    """One core's chunks: (start, duration) of each, in the machine's monotonic clock."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(96, 96)
    reps, t = 1, time.perf_counter()
    while time.perf_counter() - t < 0.2:  # size a chunk to about chunk_s
        for _ in range(reps):
            a @ a
        reps *= 2
    per = (time.perf_counter() - t) / (2 * reps - 1)
    n = max(1, int(chunk_s / per))
    barrier.wait()
    chunks, end = [], time.monotonic() + seconds
    while (t0 := time.monotonic()) < end:
        for _ in range(n):
            a @ a
        chunks.append((t0, time.monotonic() - t0))
    out.put(chunks)


def wait_excess(chunks: list[list[tuple[float, float]]]) -> float:
    """The mean over the first core's chunks of the slowest duration among the chunks running
    on every core at that chunk's midpoint, over the mean duration, less 1."""
    starts = [np.array([c[0] for c in cs]) for cs in chunks]
    durations = [np.array([c[1] for c in cs]) for cs in chunks]
    worst = []
    for s, d in zip(starts[0], durations[0]):
        mid, row = s + d / 2, [d]
        for st, du in zip(starts[1:], durations[1:]):
            i = int(np.searchsorted(st, mid, side="right")) - 1
            if i < 0 or st[i] + du[i] < mid:
                break
            row.append(du[i])
        else:
            worst.append(max(row))
    if not worst:
        raise RuntimeError("measuring jitter: the cores' chunks never overlapped")
    return max(0.0, float(np.mean(worst)) / float(np.mean(np.concatenate(durations))) - 1.0)


def measure_jitter(processes: int, chunk_s: float = 0.003, seconds: float = 24.0, windows: int = 12) -> float:
    """This machine's ``jitter`` from ``processes`` cores at once (0 for fewer than two): the
    median over ``windows`` stretches of ``seconds``, so one burst of other work does not set it.
    (On a shared 2-core VM three 2-second windows gave anything from 0.1 to 1.0 from one run to
    the next; twelve gave 0.21 +- 0.01, with one run in four at 0.35.)"""
    if processes < 2:
        return 0.0
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_probe, args=(barrier, chunk_s, seconds, out), daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        chunks = [out.get(timeout=120 + seconds) for _ in procs]
    except queue.Empty:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"measuring jitter: a probe process reported nothing (exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    t0 = min(cs[0][0] for cs in chunks)
    span = seconds / windows
    excess = [wait_excess([[c for c in cs if t0 + k * span <= c[0] < t0 + (k + 1) * span] for cs in chunks])
              for k in range(windows)]
    return float(np.median(excess)) / expected_max_normal(processes)
