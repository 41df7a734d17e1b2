"""This machine's dense compute rate for the simulator: DLRM MLPs and the dot interaction,
forward and backward, timed at one thread (what a CPU rank runs), fitted as FLOPs / rate plus
a fixed cost per operator; the training loop's own cost per step, and what two ranks meeting at
every collective add to a step, through shared memory and over TCP. Cached beside
``recscale calibrate``'s hardware description.

Everything here is timed in wall time, the kind ``recscale calibrate`` times the planner's
constants in and the kind a measured step is: a prediction adds the two, so they must be of
one kind. (In a thread's CPU time the dense compute, the loader and the loop leave out the
share of a core that other work on the machine takes, which the embeddings' wall-time
constants include: on a loaded machine the step came out too short by about wall over CPU.)
A burst of other work slows a measurement but not the fit: each point is a median, the
loader's the mean of its faster half."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from recscale.atomic import write_text_atomic
from recscale.planner.jitter import measure_jitter
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
        d = json.loads(p.read_text())
        known = set(DenseCompute.__dataclass_fields__)
        return DenseCompute(**{k: v for k, v in d.items() if k in known})  # a later version's keys are left
    except (json.JSONDecodeError, TypeError, AttributeError):
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
        t = time.perf_counter()  # wall time, as the planner's constants and a measured step
        out = top(inter(bottom(dense), pooled)).squeeze(1)
        torch.nn.functional.binary_cross_entropy_with_logits(out, label).backward()
        opt.step()
        opt.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure_compute(repeats: int = 15, load_s_per_sample: float = 0.0, loop: bool = True) -> DenseCompute:
    """Least-squares fit (relative errors, coefficients >= 0) of time = 3 (FLOPs / rate +
    values x value_s) + (3 ops + 2 tensors) x overhead (forward, backward, and the dense
    optimizer's step over each parameter tensor) over ``SHAPES`` x ``BATCHES`` at one thread,
    in wall time; the cores' ``sync_jitter`` (``recscale.planner.jitter``); with ``loop``, the
    training loop's own time per step (``measure_loop``, on this machine's calibration if it
    has one)."""
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
    # every core busy at once, as a distributed run on this machine keeps them
    c = DenseCompute(1.0 / max(coef[0], 1e-15), coef[2], load_s_per_sample, coef[1],
                     sync_jitter=measure_jitter(os.cpu_count() or 1))
    if not loop:
        return c
    from recscale.planner.hardware import machine_calibration

    # the loop is timed on one rank of one thread: price its embeddings on this machine's
    # calibration whose ranks had one thread each (as many ranks as cores; a one-rank calibration
    # gives its rank every core, whose wake-ups at every operator a one-thread rank never pays),
    # else the one-rank one (another machine's constants would leave their error in loop_s)
    cal = machine_calibration(one_thread_ranks(), make=False)[0] or machine_calibration(1, make=False)[0]
    c = replace(c, loop_s=measure_loop(c, str(cal) if cal else "local-cpu"))
    # two ranks' meetings, priced on the calibration for two local ranks (where there is one)
    two = machine_calibration(2, make=False)[0]
    if two is None or (os.cpu_count() or 1) < 2:
        return c
    return replace(c, shm_loop_s=measure_distributed_loop(c, str(two), tcp=False),
                   tcp_loop_s=measure_distributed_loop(c, str(two), tcp=True))


def one_thread_ranks() -> int:
    """The fewest local ranks whose calibration measured a rank with one thread (``recscale
    calibrate`` gives each of N ranks the cores / N threads): as many as this machine has cores."""
    return os.cpu_count() or 1


# A model so small that its step is almost all fixed cost: the loop's own work shows.
LOOP_MODEL = ["model.table_rows=[10]", "data.pooling_factors=[1]", "model.embedding_dim=4", "model.bottom_mlp=[4]",
              "model.top_mlp=[4, 1]", "train.batch_size=16", "sharding.default=table_wise", "train.threads=1",
              "data.num_workers=0", "train.progress=false", "data.eval_samples=64"]
LOOP_STEPS = (20, 520)


def _training_wall_s(config: Path, steps: int, sets: list[str], ranks: int = 1, tcp: bool = False) -> float:
    """Wall seconds of a ``recscale train`` of ``steps`` in its training loop (the trainer's own
    ``train_seconds``: start-up and evaluation left out), on one rank or ``ranks`` local ones
    (``tcp``: meeting over gloo's TCP connections, as ranks on different hosts do)."""
    import subprocess
    import sys
    import tempfile

    from recscale.comm.local_processes import free_port

    args = [*sets, f"train.max_steps={steps}", f"data.num_samples={16 * (steps + 2)}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"RECSCALE_SHARED_MEMORY": "0"} if tcp else {})}
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "s.json"
        cmd = [sys.executable, "-m", "recscale", "train", "--config", str(config), "--summary-json", str(summary)]
        if ranks > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                        f"--master_port={free_port()}", "-m", "recscale"]
        proc = subprocess.run(cmd + [a for s in args for a in ("--set", s)], capture_output=True, text=True,
                              timeout=600, env=env)
        if proc.returncode != 0 or not summary.is_file():
            raise RuntimeError(f"measuring the training loop: recscale train failed: {proc.stderr.strip()[-400:]}")
        return float(json.loads(summary.read_text())["train_seconds"])


def measure_loop(compute: DenseCompute, base: str = "local-cpu") -> float:
    """The training loop's own time per step beyond what the simulator prices: a one-rank
    training of ``LOOP_MODEL`` (a step almost all fixed cost) at two step counts, whose
    difference leaves out the first steps' warm-up, in wall time (the kind of everything else
    the simulator adds it to), less the simulator's busy time for the same step, priced on
    ``compute`` (this machine's dense rates) and ``base`` (the planner's hardware description)."""
    from recscale.sim.api import simulate
    from recscale.sim.topology import topology_from_dict
    from recscale.train.config import load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "synthetic.toml"
    short, long = (_training_wall_s(config, n, LOOP_MODEL) for n in LOOP_STEPS)
    per_step = (long - short) / (LOOP_STEPS[1] - LOOP_STEPS[0])
    cfg = load_config(config, [*LOOP_MODEL, "data.num_samples=4096"])
    cores = os.cpu_count() or 1
    topo = topology_from_dict({"base": base, "shared_cores": cores, "flops_per_s": compute.flops_per_s,
                               "op_overhead_s": compute.op_overhead_s, "value_s": compute.value_s, "loop_s": 0.0,
                               "load_s_per_sample": measure_loader(cfg)}, "loop")
    priced = sum(simulate(cfg, topo).busy_s[0].values())
    return max(0.0, per_step - priced)


# Ranks over TCP on one machine talk over loopback: a link this fast adds nothing to the
# few bytes of ``LOOP_MODEL``'s step.
LOOPBACK_MBIT = 100_000


def measure_distributed_loop(compute: DenseCompute, base: str, tcp: bool, ranks: int = 2) -> float:
    """What a step of ``LOOP_MODEL`` on ``ranks`` local ranks takes beyond the simulator's step
    for it (``base``: the planner's calibration for that many ranks): the cost of ranks meeting
    at every collective, their wake-ups and their waits for each other at a handful of meetings
    a step, which no probe of one part sees. Through shared memory, or over TCP (``tcp``: gloo's
    connections over loopback, priced as that many hosts of one rank on a fast link)."""
    from recscale.sim.api import simulate
    from recscale.sim.topology import topology_from_dict
    from recscale.train.config import load_config

    config = Path(__file__).resolve().parents[2] / "configs" / "synthetic.toml"
    short, long = (_training_wall_s(config, n, LOOP_MODEL, ranks, tcp) for n in LOOP_STEPS)
    per_step = (long - short) / (LOOP_STEPS[1] - LOOP_STEPS[0])
    cfg = load_config(config, [*LOOP_MODEL, "data.num_samples=4096"])
    shape = ({"hosts": ranks, "ranks_per_host": 1, "cross_host_mbit": LOOPBACK_MBIT} if tcp
             else {"ranks_per_host": ranks})
    topo = topology_from_dict({"base": base, **shape, "shared_cores": os.cpu_count() or 1,
                               "flops_per_s": compute.flops_per_s, "op_overhead_s": compute.op_overhead_s,
                               "value_s": compute.value_s, "loop_s": compute.loop_s,
                               "shm_loop_s": 0.0, "tcp_loop_s": 0.0,  # what is measured here
                               "load_s_per_sample": measure_loader(cfg, world_size=ranks)}, "loop")
    return max(0.0, per_step - simulate(cfg, topo).step_time_s)


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
    """Seconds (wall) one sample of a rank's share of ``cfg``'s training batches costs the
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
            t = time.perf_counter()
            b = next(it)
            b.sparse.validate(rows)
            times.append((time.perf_counter() - t) / max(b.batch_size, 1))
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
                                     "load_s_per_sample": c.load_s_per_sample, "value_s": c.value_s,
                                     "loop_s": c.loop_s, "sync_jitter": c.sync_jitter, "shm_loop_s": c.shm_loop_s,
                                     "tcp_loop_s": c.tcp_loop_s}, indent=1) + "\n")
    return p
