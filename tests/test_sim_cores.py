"""How a CPU host's cores divide among its ranks in the simulator: the arithmetic of a rank's
MLPs spreads over the cores its threads get, ranks that outnumber cores stretch everything,
and the bytes between ranks of one host are CPU time of those ranks, not a link beside them."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.planner.hardware import LOCAL_CPU
from recscale.sim.api import simulate, training_threads
from recscale.sim.cores import CoreShare
from recscale.sim.topology import TopologyError, load_topology, topology_from_dict
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]", "model.embedding_dim=16",
         "train.batch_size=1024", "model.bottom_mlp=[256, 64, 16]", "model.top_mlp=[256, 1]",
         "sharding.default=table_wise", "data.num_workers=0"]


def small(*extra: str):
    return load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, *extra])


def topo(hosts: int = 1, per_host: int = 1, base: str = "local-cpu", **kw):
    return topology_from_dict({"base": base, "hosts": hosts, "ranks_per_host": per_host, "cross_host_mbit": 10_000,
                               "flops_per_s": 2e10, "op_overhead_s": 2e-5, "value_s": 1e-9, "loop_s": 0.0, "sync_jitter": 0.0,
                               "shm_loop_s": 0.0, "tcp_loop_s": 0.0, **kw}, "test")


def _mlp_s(res) -> float:
    return sum(op.duration_s for op in res.ops if op.step == 2 and op.ranks == (0,) and op.category == "MLP + interaction")


@given(ranks=st.integers(1, 16), cores=st.integers(0, 64), threads=st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_core_share_is_consistent(ranks, cores, threads):
    s = CoreShare(ranks, cores, threads)
    assert 0 < s.parallel <= threads
    assert s.serial_stretch >= 1.0
    # below one core a rank's arithmetic and its serial work slow alike
    if s.parallel < 1:
        assert s.serial_stretch == pytest.approx(1 / s.parallel)
    assert s.spare_cores == (float("inf") if not cores else cores - ranks * threads)


def test_two_single_core_ranks_compute_slower_than_one_rank_on_both_cores():
    # the same global batch: two ranks of one core each, against one rank with two threads
    one = simulate(small("train.threads=2"), topo(1, 1, cores_per_host=2))
    two = simulate(small("train.threads=1"), topo(1, 2, cores_per_host=2))
    # each of the two computes half the batch on one core, and pays every operator's fixed cost
    # itself; the one rank spreads the whole batch's arithmetic over two cores
    assert 2 * _mlp_s(two) > _mlp_s(one)
    assert _mlp_s(one) < _mlp_s(simulate(small("train.threads=1"), topo(1, 1, cores_per_host=2)))


def test_threads_beyond_the_cores_do_not_help():
    a = simulate(small("train.threads=2"), topo(1, 2, cores_per_host=2))
    b = simulate(small("train.threads=1"), topo(1, 2, cores_per_host=2))
    assert _mlp_s(a) == pytest.approx(_mlp_s(b), rel=1e-9)
    # ranks outnumbering cores stretch every operator by ranks / cores
    c = simulate(small("train.threads=1"), topo(1, 4, cores_per_host=2))
    d = simulate(small("train.threads=1"), topo(1, 4, cores_per_host=4))
    assert _mlp_s(c) == pytest.approx(2 * _mlp_s(d), rel=1e-9)
    assert c.step_time_s > d.step_time_s


def test_auto_threads_follow_the_trainers_sizing():
    assert training_threads(small("train.threads=0"), topo(1, 2, cores_per_host=16)) == 8
    assert training_threads(small("train.threads=3"), topo(1, 2, cores_per_host=16)) == 3
    assert training_threads(small("train.threads=0"), topo(1, 2)) == 1  # cores not given: as calibrated
    # an emulated host's process sees the whole machine
    assert training_threads(small("train.threads=0"), topo(2, 1, shared_cores=2)) == 2


def test_intra_host_bytes_are_the_ranks_cpu_time(tmp_path):
    cfg = small()
    res = simulate(cfg, topo(1, 2))
    # no link inside a host: the copies are compute-stream work of both ranks
    assert not [op for op in res.ops if any(k[0].startswith("intra_") for k in op.links)]
    call = next(op for op in res.ops if op.name == "output all-to-all call" and op.step == 2 and op.ranks == (0,))
    assert call.stream == "compute" and call.duration_s > LOCAL_CPU.latency_s
    # a slower copy costs the step more
    slow = tmp_path / "slow.json"
    replace(LOCAL_CPU, intra_host_bw=LOCAL_CPU.intra_host_bw / 10).save(slow)
    assert simulate(cfg, topo(1, 2, str(slow))).step_time_s > res.step_time_s
    # across hosts the bytes stay on the links
    apart = simulate(cfg, topo(2, 1))
    assert any(k[0].startswith("host_") for op in apart.ops for k in op.links)


def test_gpu_presets_unchanged_by_cores():
    cfg = small("train.threads=4")
    base = load_topology("zionex", 2, 8)
    assert base.core_share(4).spare_cores == float("inf")
    a = simulate(cfg, base)
    b = simulate(small("train.threads=1"), base)
    assert a.step_time_s == b.step_time_s
    # the collectives' bytes stay on the GPUs' links (NVLink): nothing on the compute stream
    assert not [op for op in a.ops if op.name.endswith(" call")]
    assert any(k[0].startswith("intra_") for op in a.ops for k in op.links)


def test_spare_cores_keep_the_loader_beside_the_ranks():
    cfg = small("data.num_workers=1")
    roomy = simulate(cfg, topo(1, 2, cores_per_host=4, load_s_per_sample=1e-6))
    full = simulate(cfg, topo(1, 2, cores_per_host=2, load_s_per_sample=1e-6))
    assert all(op.stream == "load" for op in roomy.ops if op.name == "load batch")
    assert all(op.stream == "compute" for op in full.ops if op.name == "load batch")


def test_cores_per_host_must_be_whole():
    with pytest.raises(TopologyError, match="cores_per_host"):
        topo(1, 2, cores_per_host=2.5)
    with pytest.raises(TopologyError, match="cores_per_host"):
        topo(1, 2, cores_per_host=-1)


def test_training_loop_costs_every_rank_each_step():
    cfg = small()
    base = simulate(cfg, topo(1, 2))
    looped = simulate(cfg, topo(1, 2, loop_s=1e-3))
    ops = [op for op in looped.ops if op.name == "training loop" and op.step == 2]
    assert len(ops) == 2 and all(op.stream == "compute" for op in ops)
    # the loop's work is serial: one rank per core here, so it is the loop's time (times contention)
    assert ops[0].duration_s == pytest.approx(1e-3 * (1 + LOCAL_CPU.contention), rel=1e-9)
    assert looped.step_time_s > base.step_time_s
    # one rank, nothing to overlap with: the step is longer by exactly the loop's time
    one, one_looped = simulate(cfg, topo()), simulate(cfg, topo(loop_s=1e-3))
    assert one_looped.step_time_s == pytest.approx(one.step_time_s + 1e-3, rel=1e-6)
    assert one_looped.breakdown["training loop"] == pytest.approx(1e-3, rel=1e-6)
    # ranks that meet pay their meetings' cost on top, as measured (wall time: not stretched),
    # through shared memory on one host and over TCP between hosts; a lone rank meets no one
    meets = {"loop_s": 1e-3, "shm_loop_s": 2e-3, "tcp_loop_s": 5e-3}
    for shape, extra in (((1, 2), 2e-3), ((2, 1), 5e-3), ((1, 1), 0.0)):
        got = simulate(cfg, topo(*shape, **meets))
        loop = [op for op in got.ops if op.name == "training loop" and op.step == 2]
        plain = [op for op in simulate(cfg, topo(*shape, loop_s=1e-3)).ops
                 if op.name == "training loop" and op.step == 2]
        assert loop[0].duration_s == pytest.approx(plain[0].duration_s + extra, rel=1e-9)


def test_loop_measurement_is_the_time_per_step_the_simulator_leaves_out(monkeypatch):
    import recscale.sim.calibrate as cal
    from recscale.sim.topology import DenseCompute

    per_step = 5e-3
    monkeypatch.setattr(cal, "_training_wall_s", lambda config, steps, sets: 2.0 + steps * per_step)  # start-up + steps
    monkeypatch.setattr(cal, "measure_loader", lambda cfg, batches=20, world_size=1: 1e-6)
    c = DenseCompute(2e10, 2e-5, 0.0, 1e-9)
    loop = cal.measure_loop(c)
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*cal.LOOP_MODEL, "data.num_samples=4096"])
    t = topology_from_dict({"base": "local-cpu", "shared_cores": 2, "flops_per_s": 2e10, "op_overhead_s": 2e-5,
                            "value_s": 1e-9, "load_s_per_sample": 1e-6, "loop_s": 0.0}, "t")
    priced = sum(simulate(cfg, t).busy_s[0].values())
    assert 0 < priced < per_step
    assert loop == pytest.approx(per_step - priced, rel=1e-6)
    # what the simulator already prices is never charged twice
    monkeypatch.setattr(cal, "_training_wall_s", lambda config, steps, sets: 2.0 + steps * priced / 2)
    assert cal.measure_loop(c) == 0.0


@pytest.mark.parametrize("tcp", [False, True])
def test_meetings_are_the_time_per_step_the_simulator_leaves_out_of_several_ranks(monkeypatch, tcp):
    import recscale.sim.calibrate as cal
    from recscale.sim.topology import DenseCompute

    per_step, calls = 9e-3, []

    def wall(config, steps, sets, ranks=1, tcp=False):
        calls.append((ranks, tcp))
        return 3.0 + steps * per_step

    monkeypatch.setattr(cal, "_training_wall_s", wall)
    monkeypatch.setattr(cal, "measure_loader", lambda cfg, batches=20, world_size=1: 1e-6)
    c = DenseCompute(2e10, 2e-5, 0.0, 1e-9, loop_s=2e-4, shm_loop_s=1.0, tcp_loop_s=1.0)  # the old ones: not counted
    got = cal.measure_distributed_loop(c, "local-cpu", tcp=tcp)
    assert calls == [(2, tcp)] * 2  # two local ranks, over TCP or not, at both step counts
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*cal.LOOP_MODEL, "data.num_samples=4096"])
    shape = {"hosts": 2, "ranks_per_host": 1, "cross_host_mbit": cal.LOOPBACK_MBIT} if tcp else {"ranks_per_host": 2}
    t = topology_from_dict({"base": "local-cpu", **shape, "shared_cores": os.cpu_count() or 1,
                            "flops_per_s": 2e10, "op_overhead_s": 2e-5, "value_s": 1e-9, "load_s_per_sample": 1e-6,
                            "loop_s": 2e-4, "shm_loop_s": 0.0, "tcp_loop_s": 0.0}, "t")
    priced = simulate(cfg, t).step_time_s
    assert 0 < priced < per_step
    assert got == pytest.approx(per_step - priced, rel=1e-6)
    # priced back into the same step, the measured step comes out
    key = "tcp_loop_s" if tcp else "shm_loop_s"
    back = topology_from_dict({"base": "local-cpu", **shape, "shared_cores": os.cpu_count() or 1,
                               "flops_per_s": 2e10, "op_overhead_s": 2e-5, "value_s": 1e-9, "load_s_per_sample": 1e-6,
                               "loop_s": 2e-4, "shm_loop_s": 0.0, "tcp_loop_s": 0.0, key: got}, "t")
    assert simulate(cfg, back).step_time_s == pytest.approx(per_step, rel=1e-3)
    monkeypatch.setattr(cal, "_training_wall_s", lambda config, steps, sets, ranks=1, tcp=False: steps * priced / 2)
    assert cal.measure_distributed_loop(c, "local-cpu", tcp=tcp) == 0.0
