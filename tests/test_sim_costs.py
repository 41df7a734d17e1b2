"""What a real CPU step costs beyond the planner's per-shard costs, priced by the simulator:
the loader in the training thread, ranks slowing each other on shared cores, and the
calibration that measures them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from recscale.planner.hardware import LOCAL_CPU
from recscale.sim.api import loads_in_process, simulate
from recscale.sim.step import contention_factor
from recscale.sim.topology import topology_from_dict
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.table_rows=[5000]", "data.pooling_factors=[2]", "model.embedding_dim=16",
         "train.batch_size=512", "model.bottom_mlp=[32, 16]", "model.top_mlp=[32, 1]", "sharding.default=table_wise"]


def small(*extra: str):
    return load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, *extra])


def topo(hosts: int = 1, per_host: int = 1, base: str = "local-cpu", **kw):
    return topology_from_dict({"base": base, "hosts": hosts, "ranks_per_host": per_host, "cross_host_mbit": 10_000,
                               "flops_per_s": 2e10, "op_overhead_s": 2e-5, **kw}, "test")


def _durations(res, name: str) -> list[float]:
    return [op.duration_s for op in res.ops if op.name == name and op.step == 2]


def test_loader_in_the_training_thread_adds_its_time():
    load = 2e-6  # s per sample: 1.024 ms per batch of 512, shorter than the step
    t = topo(load_s_per_sample=load)
    beside = simulate(small("data.num_workers=1"), t)
    inside = simulate(small("data.num_workers=0"), t)
    # a worker process loads the next batch while the step computes: it costs the step nothing;
    # in the training thread the step waits for it, every step
    assert inside.step_time_s - beside.step_time_s == pytest.approx(512 * load, rel=1e-6)
    assert inside.breakdown["data loading"] == pytest.approx(512 * load, rel=1e-6)
    assert "data loading" not in beside.breakdown
    assert all(op.stream == "compute" for op in inside.ops if op.name == "load batch")


def test_auto_workers_follow_the_trainers_sizing():
    cfg = small()  # data.num_workers = "auto"
    assert not loads_in_process(cfg, topo())  # dedicated hosts: a core for a worker
    assert loads_in_process(cfg, topo(shared_cores=2))  # 2 CPUs for the rank: it loads itself
    assert not loads_in_process(cfg, topo(shared_cores=8))  # 8 CPUs: one goes to a worker
    assert loads_in_process(cfg, topo(1, 2, shared_cores=4))  # 2 CPUs each for 2 ranks
    assert loads_in_process(small("data.num_workers=0"), topo())


def test_contention_slows_every_compute_of_ranks_sharing_a_machine(tmp_path):
    c = 0.25
    calm, busy = tmp_path / "calm.json", tmp_path / "busy.json"
    LOCAL_CPU.save(calm)
    replace(LOCAL_CPU, contention=c).save(busy)
    cfg = small()
    for hosts, per_host, cores, slowed in ((1, 2, 0, True), (2, 1, 2, True), (2, 1, 0, False)):
        a = simulate(cfg, topo(hosts, per_host, str(calm), shared_cores=cores, load_s_per_sample=1e-6))
        b = simulate(cfg, topo(hosts, per_host, str(busy), shared_cores=cores, load_s_per_sample=1e-6))
        factor = 1 + c if slowed else 1.0
        assert contention_factor(topo(hosts, per_host, str(busy), shared_cores=cores)) == pytest.approx(factor)
        for name in ("bottom MLP forward", "interaction + top MLP backward", "pack ids", "dense optimizer", "load batch"):
            for x, y in zip(_durations(a, name), _durations(b, name)):
                assert y == pytest.approx(x * factor, rel=1e-9), (hosts, per_host, name)
        assert b.step_time_s >= a.step_time_s * (1 - 1e-9)
        if slowed:
            assert b.step_time_s > a.step_time_s


def test_cpu_ranks_pay_each_collective_in_their_own_thread(tmp_path):
    slow = tmp_path / "slow.json"
    replace(LOCAL_CPU, latency_s=400e-6).save(slow)
    cfg = small()
    # a shared-memory copy so fast that each call is its latency alone (copies: test_sim_cores.py)
    base = simulate(cfg, topo(1, 2, str(slow), intra_host_gbyte_s=1e12))
    calls = [op for op in base.ops if op.name.endswith(" call") and op.step == 2]
    # every collective that does not already hold the thread (output all-to-all, dense
    # all-reduce buckets, the pipelined ids) costs each rank its latency on the compute stream
    assert {op.name for op in calls} >= {"output all-to-all call", "dense all-reduce call", "ids all-to-all call"}
    assert all(op.stream == "compute" and len(op.ranks) == 1 for op in calls)
    out = next(op for op in calls if op.name == "output all-to-all call")
    assert out.duration_s == pytest.approx(400e-6, rel=1e-6)  # log2(2 ranks) = 1 round
    ids = next(op for op in calls if op.name == "ids all-to-all call")
    assert ids.duration_s == pytest.approx(3 * 400e-6, rel=1e-6)  # batch sizes, lengths, ids
    # a GPU's collectives run on their own streams: nothing on the compute stream
    gpu = simulate(cfg, topo(1, 2, str(slow), flops_per_s=1e14, intra_host_gbyte_s=1e12))
    assert not [op for op in gpu.ops if op.name.endswith(" call")]
    fast = tmp_path / "fast.json"
    replace(LOCAL_CPU, latency_s=10e-6).save(fast)
    assert simulate(cfg, topo(1, 2, str(fast), intra_host_gbyte_s=1e12)).step_time_s < base.step_time_s


def test_one_rank_runs_one_program_whatever_the_plan():
    # the trainer shards nothing on one rank: no plan distributes anything there
    t = topo(load_s_per_sample=1e-6)
    steps = {p: simulate(small(f"sharding.default={p}"), t).step_time_s for p in ("table_wise", "row_wise", "data_parallel")}
    assert len(set(steps.values())) == 1, steps
    res = simulate(small("sharding.default=row_wise"), t)
    assert not [op for op in res.ops if op.name in ("output all-to-all", "unpack outputs")]


def test_loader_is_measured_for_a_ranks_share_in_the_training_thread(monkeypatch):
    import recscale.train.datasets as datasets
    from recscale.sim.calibrate import measure_loader

    seen = []
    build = datasets.build_data

    def spy(cfg, rank=0, world_size=1, num_workers=None):
        seen.append((rank, world_size, num_workers))
        return build(cfg, rank, world_size, num_workers)

    monkeypatch.setattr(datasets, "build_data", spy)
    cfg = small("data.num_samples=4096", "data.eval_samples=512")
    assert measure_loader(cfg, batches=4, world_size=2) > 0
    # rank 0's share of a 2-rank job, loaded without a worker process (as the trainer does here)
    assert seen == [(0, 2, 0)]
