"""Collectives over TCP: CPU ranks on different hosts exchange through gloo's TCP transport,
where a collective inside a step costs several times what it costs over shared memory; the
calibration measures both and the simulator prices each where it applies."""

from __future__ import annotations

from pathlib import Path

import pytest

from recscale.planner.hardware import LOCAL_CPU
from recscale.sim.api import simulate
from recscale.sim.topology import TopologyError, topology_from_dict
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]", "model.embedding_dim=16",
         "train.batch_size=1024", "data.num_workers=0"]
TCP = {"tcp_latency_ms": 1.0, "tcp_replica_latency_ms": 0.8, "tcp_replica_byte_ns": 1.0}


def topo(hosts: int, per_host: int, **extra):
    return topology_from_dict({"base": "local-cpu", "hosts": hosts, "ranks_per_host": per_host, "flops_per_s": 2e10,
                               "op_overhead_s": 2e-5, "loop_s": 0.0, "sync_jitter": 0.0, "cross_host_mbit": 10_000,
                               **extra}, "test")


def test_over_tcp_takes_only_the_figures_measured():
    from dataclasses import replace

    hw = replace(LOCAL_CPU, latency_s=1e-4, replica_latency_s=5e-5, replica_byte_s=1e-10)
    assert hw.over_tcp() == hw  # nothing measured over TCP: shared memory's figures hold
    tcp = replace(hw, tcp_latency_s=9e-4).over_tcp()
    assert (tcp.latency_s, tcp.replica_latency_s, tcp.replica_byte_s) == (9e-4, 5e-5, 1e-10)
    with pytest.raises(ValueError, match="tcp_replica_latency_s must be >= 0"):
        replace(LOCAL_CPU, tcp_replica_latency_s=-1.0)


@pytest.mark.parametrize("plan", ["table_wise", "data_parallel"])
def test_collectives_between_cpu_hosts_cost_what_tcp_costs(plan):
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, f"sharding.default={plan}"])
    shm, tcp = simulate(cfg, topo(2, 1)), simulate(cfg, topo(2, 1, **TCP))
    added = tcp.step_time_s - shm.step_time_s
    # at least one collective's difference on the step's path, at most every collective's
    # (a table-wise step issues 7: three for the ids, the outputs, the gradients and the dense
    # gradients' two buckets; a data-parallel one 8: batch sizes, the replicas' 5, two buckets)
    assert 0.8e-3 <= added <= 8 * 1e-3
    # ranks of one host exchange through shared memory: the TCP figures do not apply
    assert simulate(cfg, topo(1, 2, **TCP)).step_time_s == pytest.approx(simulate(cfg, topo(1, 2)).step_time_s)


def test_a_calibration_with_tcp_figures_prices_hosts_by_them(tmp_path):
    from dataclasses import replace

    from recscale.planner.hardware import Hardware

    base = replace(LOCAL_CPU, world_size=1, ranks_per_host=1, tcp_latency_s=1e-3, tcp_replica_latency_s=8e-4,
                   tcp_replica_byte_s=1e-9)
    base.save(tmp_path / "cal.json")
    assert Hardware.load(tmp_path / "cal.json") == base  # saved and read back whole
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=table_wise"])
    from_file = simulate(cfg, topo(2, 1, base=str(tmp_path / "cal.json")))
    assert from_file.step_time_s == pytest.approx(simulate(cfg, topo(2, 1, **TCP)).step_time_s)
    assert from_file.step_time_s > simulate(cfg, topo(2, 1)).step_time_s


def test_an_asynchronous_collective_over_tcp_costs_its_rank_the_cpu_measured():
    # Over TCP much of a collective's latency is the peers' and the wire's: a rank that does
    # not wait in it (the outputs, the gradients, the dense buckets) pays the CPU time the
    # calibration measured for it, not its latency.
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=table_wise"])
    unmeasured = simulate(cfg, topo(2, 1, **TCP)).step_time_s
    assert simulate(cfg, topo(2, 1, **TCP, tcp_call_ms=1.0)).step_time_s == pytest.approx(unmeasured)
    cheap = simulate(cfg, topo(2, 1, **TCP, tcp_call_ms=0.1)).step_time_s
    # at least one asynchronous collective's 0.9 ms saved on the path, at most all five's
    # (the outputs, the gradients, the ids' three when pipelined, the dense buckets)
    assert unmeasured - 7 * 0.9e-3 <= cheap <= unmeasured - 0.9e-3
    # ranks of one host: shared memory, where the latency is the thread's (it spins)
    assert simulate(cfg, topo(1, 2, **TCP, tcp_call_ms=0.1)).step_time_s == pytest.approx(simulate(cfg, topo(1, 2)).step_time_s)


@pytest.mark.parametrize("key", [*sorted(TCP), "tcp_call_ms"])
def test_a_negative_tcp_figure_is_refused(key):
    with pytest.raises(TopologyError, match=key):
        topo(2, 1, **{key: -1.0})
