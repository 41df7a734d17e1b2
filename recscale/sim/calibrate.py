"""This machine's dense compute rate for the simulator: DLRM MLPs and the dot interaction,
forward and backward, timed at one thread (what a CPU rank runs), fitted as FLOPs / rate plus
a fixed cost per operator. Cached beside ``recscale calibrate``'s hardware description."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from recscale.atomic import write_text_atomic
from recscale.sim.dense import DenseModel
from recscale.sim.topology import DenseCompute

# (bottom MLP, top MLP, tables, dim): small and large enough to separate per-op cost from FLOPs
SHAPES = [([64, 16], [64, 1], 26, 16), ([256, 64, 32], [256, 128, 1], 26, 32), ([512, 256, 64], [512, 256, 1], 8, 64)]
BATCHES = (128, 512, 2048)


def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recscale"
    return base / "sim-compute.json"


def cached_compute() -> DenseCompute | None:
    p = cache_path()
    if not p.is_file():
        return None
    try:
        return DenseCompute(**json.loads(p.read_text()))
    except (json.JSONDecodeError, TypeError):
        return None


def _time_dense(model: DenseModel, batch: int, repeats: int) -> float:
    import torch

    from recscale.model.interaction import DotInteraction
    from recscale.model.mlp import MLP

    torch.manual_seed(0)
    bottom = MLP(model.bottom[0], list(model.bottom[1:]))
    inter = DotInteraction(model.vectors, model.dim)
    top = MLP(model.top[0], list(model.top[1:]), final_activation=False)
    dense = torch.randn(batch, model.bottom[0])
    pooled = torch.randn(batch, (model.vectors - 1) * model.dim, requires_grad=True)
    label = torch.rand(batch)
    opt = torch.optim.Adagrad([*bottom.parameters(), *top.parameters()], lr=0.01)
    times = []
    for i in range(repeats + 2):
        t = time.thread_time()  # CPU time of this thread: what a core gives it, whatever else runs
        out = top(inter(bottom(dense), pooled)).squeeze(1)
        torch.nn.functional.binary_cross_entropy_with_logits(out, label).backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.thread_time() - t)
    return float(np.median(times))


def measure_compute(repeats: int = 15, load_s_per_sample: float = 0.0) -> DenseCompute:
    """Least-squares fit (relative errors, coefficients >= 0) of time = 3 (FLOPs / rate +
    values x value_s) + (3 ops + 2 tensors) x overhead (forward, backward, and the dense
    optimizer's step over each parameter tensor) over ``SHAPES`` x ``BATCHES`` at one thread,
    in the thread's CPU time."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, ys = [], []
        for bottom, top, tables, dim in SHAPES:
            m = DenseModel.of(13, bottom, top, tables, dim)
            for b in BATCHES:
                flops = 3 * (m.bottom_flops(b) + m.top_flops(b))
                values = 3 * (m.bottom_values(b) + m.top_values(b))
                ops = 3 * (m.bottom_ops + m.top_ops) + 2 * m.tensors
                rows.append([flops, values, ops])
                ys.append(_time_dense(m, b, repeats))
    finally:
        torch.set_num_threads(threads)
    a, y = np.asarray(rows, dtype=float), np.asarray(ys)
    # relative errors matter: weight each point by 1/time
    coef = _nonnegative_fit(a / y[:, None], np.ones_like(y))
    return DenseCompute(1.0 / max(coef[0], 1e-15), coef[2], load_s_per_sample, coef[1])


def _nonnegative_fit(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the terms a fit makes negative."""
    keep = list(range(a.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all() or len(keep) == 1:
            out = np.zeros(a.shape[1])
            out[keep] = np.maximum(sol, 0.0)
            return out
        keep.pop(int(np.argmin(sol)))


def measure_loader(cfg, batches: int = 20, world_size: int = 1) -> float:
    """Seconds of CPU one sample of a rank's share of ``cfg``'s training batches costs the
    training thread where it loads them itself: the loader's fetch and collate (ids, offsets,
    dense features, labels) and the trainer's check of the ids against the tables, at one
    thread, as rank 0 of ``world_size`` builds them. A batch has a fixed cost per feature
    besides its per-sample one, so a rank's half of a batch costs more than half of the whole."""
    import torch

    from recscale.train.datasets import build_data

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = build_data(cfg, 0, world_size, num_workers=0)
        rows = dict(zip(data.sparse_names, data.table_rows))
        n = min(batches, len(data.train))
        if n < 2:
            raise ValueError("measure_loader needs at least 2 batches of training data")
        it = iter(data.train_loader())
        next(it)  # warm: first-touch allocations
        times = []
        for _ in range(1, n):
            t = time.thread_time()
            b = next(it)
            b.sparse.validate(rows)
            times.append((time.thread_time() - t) / max(b.batch_size, 1))
        # the lower half's mean: a batch another job's burst slowed does not count
        times.sort()
        low = times[: max(1, len(times) // 2)]
        return sum(low) / len(low)
    finally:
        torch.set_num_threads(threads)


def save_compute(c: DenseCompute, path: Path | None = None) -> Path:
    p = path or cache_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p, json.dumps({"flops_per_s": c.flops_per_s, "op_overhead_s": c.op_overhead_s,
                                     "load_s_per_sample": c.load_s_per_sample, "value_s": c.value_s}, indent=1) + "\n")
    return p
