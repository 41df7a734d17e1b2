"""Benchmark: where a real training step's time goes, beside ``recscale simulate``'s breakdown.

Runs ``configs/synthetic.toml`` as ``simulator_validation.py`` does (one thread per rank,
batch 1024, the loader in the training process) for a few steps, timing each phase of every
step in the main thread's CPU time (robust when other jobs share the cores): loader fetch and
collate, batch preparation and input distribution, embedding forward (lookup and output
distribution), bottom MLP, interaction and top MLP forward, the backward pass (autograd; the
embeddings' backward and fused update apart with ``--split-backward``), the dense
all-reduce's wait, the dense optimizer step and the trainer's bookkeeping. The best of the
steps per phase is kept (shared machine). Beside it: the simulator's busy time per category
of rank 0 for the same config and topology.

    python benchmarks/sim_step_breakdown.py --plan table_wise
    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29531 \\
        benchmarks/sim_step_breakdown.py --plan table_wise
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from simulator_validation import _COMPUTE as COMPUTE  # noqa: E402
from simulator_validation import CONFIG, Group, overrides, topology  # noqa: E402

from recscale.comm.collectives import CommStats  # noqa: E402
from recscale.comm.dense_sync import DenseGradSync  # noqa: E402
from recscale.comm.process_group import destroy_process_groups, env_topology, init_process_groups  # noqa: E402
from recscale.sim.api import simulate  # noqa: E402
from recscale.train.config import load_config  # noqa: E402
from recscale.train.datasets import build_data, with_table_rows  # noqa: E402
from recscale.train.loop import _tune, seed_everything  # noqa: E402
from recscale.train.model_factory import build_dense_optimizer, build_model, build_tables, choose_plan  # noqa: E402
from recscale.train.pipeline import TrainPipeline  # noqa: E402


def _backward_kind(name: str) -> str:
    if "FusedPooling" in name:
        return "embedding backward + update"
    if name.startswith("AccumulateGrad") or name.endswith("AccumulateGrad"):
        return "dense gradient accumulate (+ all-reduce launch)"
    if any(k in name for k in ("Dist", "All", "Output", "Send", "Recv", "Exchange", "Gather", "Scatter")):
        return "gradient distribution (" + name + ")"
    return "MLP + interaction backward"


def _time_nodes(root, now: dict[str, float], clock) -> None:
    """Hooks on every autograd node of this step's graph: its backward's thread time, by kind."""
    seen, stack, start = set(), [root], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = _backward_kind(node.name())
        node.register_prehook(lambda *_, n=node: start.__setitem__(n, clock()))
        node.register_hook(lambda *_, n=node, k=kind: now.__setitem__(k, now.get(k, 0.0) + clock() - start[n]))
        stack.extend(nxt for nxt, _ in node.next_functions)


def measure(cfg, steps: int, warmup: int, split_backward: bool = False) -> dict[str, float]:
    topo = env_topology(cfg.dist.ranks_per_host)
    tuning = _tune(cfg, topo.ranks_per_host)
    groups = init_process_groups(topo, cfg.dist.timeout_s, device=torch.device("cpu"))
    try:
        seed_everything(cfg.train.seed)
        world, rank = groups.world_size, groups.rank
        data = build_data(cfg, rank, world, tuning.plan.workers)
        cfg = with_table_rows(cfg, data.table_rows, lambda _: None)
        choice = choose_plan(cfg, build_tables(cfg, data.sparse_names), groups, None, data) if world > 1 else None
        model = build_model(cfg, data.sparse_names, data.num_dense, torch.device("cpu"), groups, CommStats(),
                            choice.plan if choice else None, data)
        params = model.dense_parameters()
        opt = build_dense_optimizer(cfg, params)
        sync = DenseGradSync(params, groups.dense, cfg.comm.dense, cfg.comm.loss_scale, CommStats())
        clock = time.thread_time
        phases: dict[str, list[float]] = defaultdict(list)
        now: dict[str, float] = defaultdict(float)
        mark: list[float] = [0.0]

        def timed(module: torch.nn.Module, name: str) -> None:
            module.register_forward_pre_hook(lambda *_: mark.__setitem__(0, clock()))
            module.register_forward_hook(lambda *_: now.__setitem__(name, now[name] + clock() - mark[0]))

        timed(model.bottom, "bottom MLP forward")
        timed(model.interaction, "interaction forward")
        timed(model.top, "top MLP forward")
        loader = iter(data.train_loader())
        pipe = TrainPipeline([], model.embeddings, torch.device("cpu"), False)
        for i in range(warmup + steps):
            if i == warmup:
                wall0, cpu0 = time.perf_counter(), time.process_time()
            now.clear()
            t = clock()
            batch = next(loader)
            now["loader fetch + collate"] = clock() - t
            t = clock()
            batch, sparse = pipe._prepare(batch)
            now["prepare + ids all-to-all"] = clock() - t
            t = clock()
            logits = model(batch.dense, sparse)
            fwd = clock() - t
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
            t = clock()
            opt.zero_grad(set_to_none=True)
            if split_backward:  # hooks on every node: their own cost inflates the backward
                _time_nodes(loss.grad_fn, now, clock)
            (loss / sparse.global_batch_size).backward()
            now["backward (MLPs + embeddings + fused update)"] = clock() - t
            t = clock()
            sync.finish()
            now["dense all-reduce wait"] = clock() - t
            t = clock()
            opt.step()
            now["dense optimizer"] = clock() - t
            t = clock()
            loss.detach().item()  # the loop's loss bookkeeping syncs about as often
            now["bookkeeping"] = clock() - t
            dense_fwd = now["bottom MLP forward"] + now["interaction forward"] + now["top MLP forward"]
            now["embedding forward (lookup + output dist)"] = fwd - dense_fwd
            if i >= warmup:
                for k, v in now.items():
                    phases[k].append(v)
        # every phase of the step once: the backward's parts (``--split-backward``) are inside it
        top = [k for k in phases if k[0].islower()
               and not k.startswith(("embedding backward", "dense gradient", "gradient distribution", "MLP + inter"))]
        sums = [sum(phases[k][i] for k in top) for i in range(steps)]
        if os.environ.get("SIM_BREAKDOWN_THREADS"):
            for task in sorted(Path("/proc/self/task").iterdir()):
                f = (task / "stat").read_text().rsplit(")", 1)[1].split()
                print(rank, (task / "comm").read_text().strip(), (int(f[11]) + int(f[12])) * 10, "ms")
        whole = {"step (sum of phases, median)": statistics.median(sums),
                 "process CPU per step (every thread)": (time.process_time() - cpu0) / steps,
                 "wall per step": (time.perf_counter() - wall0) / steps}
        return {k: min(v) for k, v in phases.items()} | whole
    finally:
        if groups.world_size > 1:
            destroy_process_groups()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="table_wise")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--split-backward", action="store_true",
                    help="time the backward's nodes by kind (MLPs, embeddings, gradient exchange; adds overhead)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = Group(f"{world} ranks", 1, world, None, (args.plan,))
    sets = overrides(g, args.plan, args.steps + args.warmup, 1024)
    torch.set_num_threads(1)
    cfg = load_config(CONFIG, sets)
    real = measure(cfg, args.steps, args.warmup, args.split_backward)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    from recscale.sim.calibrate import cached_compute, measure_compute

    dense = cached_compute() or measure_compute()  # the simulator's calibration, as the validation takes it
    COMPUTE.update(flops_per_s=dense.flops_per_s, value_s=dense.value_s, op_overhead_s=dense.op_overhead_s)
    res = simulate(cfg, topology(g, cfg))
    print(f"{world} rank(s), {args.plan}: measured (thread CPU, best of {args.steps} per phase), ms per step")
    for k, v in real.items():
        print(f"  {k:48s} {1e3 * v:8.2f}")
    print(f"simulated: step {1e3 * res.step_time_s:.2f} ms, {res.samples_per_s:,.0f} samples/s; rank 0 busy, ms:")
    for k, v in sorted(res.busy_s[0].items(), key=lambda kv: -kv[1]):
        print(f"  {k:48s} {1e3 * v:8.2f}")
    cpu = real["process CPU per step (every thread)"]
    print(f"step: measured {1e3 * cpu:.2f} ms of this rank's CPU, predicted {1e3 * res.step_time_s:.2f} ms "
          f"({100 * (cpu / res.step_time_s - 1):+.1f}% as samples/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
