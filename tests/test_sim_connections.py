"""gloo over TCP between hosts: a pair of ranks exchanges both ways over one connection, and
gloo sends a message only once the receiver's notice (on that same connection) is in, so the
two directions go one after the other (``traffic.connections``); and a CPU rank meets the
data-parallel replicas' exchange before its bottom MLP's backward, as autograd orders it."""

from __future__ import annotations

from pathlib import Path

import pytest

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.planner.cost_model import Workload
from recscale.sharding.default_plan import default_plan
from recscale.sim.api import simulate
from recscale.sim.engine import Op, Simulation
from recscale.sim.step import StepInputs, replica_links
from recscale.sim.topology import topology_from_dict
from recscale.sim.traffic import all_to_all, bandwidths, connections, link_ends, on_wire
from recscale.train.config import load_config
from recscale.train.planning import table_specs

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def cluster(hosts: int = 2, per_host: int = 1, gpu: bool = False, **keys):
    """Emulated-looking hosts: CPU ranks (gloo) unless ``gpu`` (a NCCL-class compute rate)."""
    return topology_from_dict({"base": "local-cpu", "hosts": hosts, "ranks_per_host": per_host, "cross_host_mbit": 8.0,
                               "flops_per_s": 1e14 if gpu else 2e10, "mtu_bytes": 0, **keys}, "test")


def exchange_s(topo, per_dest: list[float]) -> float:
    """One all-to-all of ``per_dest`` bytes to each rank, as the step prices it, alone on the links."""
    from recscale.sim.step import serial_connections
    from recscale.sim.traffic import merge

    sim = Simulation(bandwidths(topo), link_ends(topo), topo.send_buffer_bytes)
    links = on_wire(topo, merge(all_to_all(topo, per_dest), serial_connections(topo, per_dest)))
    sim.add(Op("a2a", "x", 0, tuple(range(topo.world_size)), "comm", 0.0, links))
    return sim.ops[0].end


def test_a_pair_sends_its_two_directions_in_turn():
    t = cluster()
    # 1 MB each way over 1 MB/s links: gloo's exchange takes 2 s (what 2 MB one way takes)
    assert connections(t, [1 * MB, 1 * MB]) == {("pair", 1): 2 * MB}
    assert exchange_s(t, [1 * MB, 1 * MB]) == pytest.approx(2.0)
    assert exchange_s(t, [0.0, 1 * MB]) == pytest.approx(1.0)  # one way only: nothing waits
    assert exchange_s(t, [0.25 * MB, 1 * MB]) == pytest.approx(1.25)  # lopsided: the light way after
    # gloo's all-gather of two ranks sends in halves: the second half of one overlaps the other's first
    assert connections(t, [0.0, 0.0], ring_part=1 * MB) == {("pair", 1): 1.5 * MB}
    # more ranks: every pair across hosts has its connection, ranks of one host none
    t4 = cluster(2, 2)
    pairs = connections(t4, [1.0, 2.0, 3.0, 4.0])
    assert pairs == {("pair", 2): 4.0, ("pair", 3): 5.0, ("pair", 6): 5.0, ("pair", 7): 6.0}
    assert link_ends(t4)(("pair", 7)) == (frozenset({1, 3}), frozenset({1, 3}))
    assert connections(t4, [0.0] * 4, ring_part=1.0) == {}  # a ring of 4: sends and receives on other connections
    assert connections(cluster(1, 2), [1.0, 1.0]) == {}  # one host: shared memory, no TCP


def test_nccl_and_one_host_send_both_ways_at_once():
    assert exchange_s(cluster(gpu=True), [1 * MB, 1 * MB]) == pytest.approx(1.0)


def test_connection_bursts_once_per_direction_and_carries_framed_payload():
    from recscale.sim.traffic import bursts

    t = cluster(mtu_bytes=1500, frame_bytes=14, burst_bytes=131072)
    assert bursts(t)["pair"] == 2 * bursts(t)["host_out"] == 2 * 131072
    wire = on_wire(t, {("pair", 1): 1448.0})
    assert wire == {("pair", 1): pytest.approx(1514.0)}  # framed, and no ACKs of its own


SMALL = ["model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]", "model.embedding_dim=16",
         "train.batch_size=512", "model.bottom_mlp=[32, 16]", "model.top_mlp=[32, 1]"]


def test_replica_exchange_serializes_the_gathers_over_tcp():
    """Both replicas all-gather their rows and reduce-scatter + all-gather the dense tables:
    over gloo's connection the gathers cross 3/2 of a part in turn, the reduce-scatter both
    ways in turn; NCCL (GPU ranks) sends both ways at once."""
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    specs = table_specs(cfg)
    tables = [TableConfig(t.name, t.rows, t.dim, (t.name[2:],)) for t in specs]
    plan = default_plan(tables, Topology(2, 0, 1), "data_parallel")
    inputs = StepInputs(specs, Workload(cfg.train.batch_size), plan, None, True)
    links = replica_links(inputs, cluster())
    one_way = links[("host_out", 0)]
    assert one_way > 0 and links[("host_out", 1)] == pytest.approx(one_way)
    assert 1.5 * one_way * (1 - 1e-9) <= links[("pair", 1)] <= 2 * one_way * (1 + 1e-9)
    assert ("pair", 1) not in replica_links(inputs, cluster(gpu=True))


def test_cpu_replicas_exchange_before_the_bottom_mlp_backward():
    """A CPU rank waits in the replicas' exchange, then updates them, before its bottom MLP's
    backward, so the last dense bucket's all-reduce starts after both (the trainer's autograd
    order: the replicas pooled after the bottom MLP's forward), not beside them."""
    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=data_parallel"])
    step = [op for op in simulate(cfg, cluster()).ops if op.step == 2]
    rep = next(op for op in step if op.name == "replica gradient exchange")
    update = next(op for op in step if op.name == "replica backward + update" and 0 in op.ranks)
    bottom_b = next(op for op in step if op.name == "bottom MLP backward" and 0 in op.ranks)
    assert update.duration_s > 0 and update.start >= rep.end_for(0)
    assert all(op.start >= rep.end for op in step if op.name == "bottom MLP backward")
    assert bottom_b.start >= update.end
    assert max(op.start for op in step if op.name == "dense all-reduce") >= max(rep.end, bottom_b.end)


def test_every_replica_collective_pays_the_delay_between_hosts():
    """The replicas' counts, rows and gradients cross the hosts like any other collective: each
    of them pays the one-way delay between hosts (``cross_host_latency_ms``)."""
    from recscale.planner.cost_model import group_collectives

    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=data_parallel"])

    def exchange(ms: float):
        ops = simulate(cfg, cluster(cross_host_latency_ms=ms)).ops
        return next(op for op in ops if op.step == 2 and op.name == "replica gradient exchange")

    n = group_collectives([(True, False)])  # one dim: counts, rows, gradients (both tables gathered)
    assert exchange(5.0).duration_s - exchange(0.0).duration_s == pytest.approx(n * 5e-3)


def test_emulated_hosts_on_one_machine_contend_as_its_local_ranks(tmp_path, monkeypatch):
    """Emulated hosts of one rank each are priced on the one-rank calibration, which has no
    neighbour to measure contention with; their ranks share one machine, so the validation takes
    it from the machine's calibration for that many ranks (topology key ``contention``)."""
    import json
    import sys

    from recscale.planner.hardware import LOCAL_CPU

    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=table_wise"])
    alone = simulate(cfg, cluster(shared_cores=2, contention=0.0)).step_time_s
    together = cluster(shared_cores=2, contention=0.5)
    assert together.hardware.contention == 0.5
    assert simulate(cfg, together).step_time_s > alone
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    one, two = tmp_path / "one.json", tmp_path / "two.json"
    for path, c in ((one, 0.0), (two, 0.25)):
        d = {k: getattr(LOCAL_CPU, k) for k in LOCAL_CPU.__dataclass_fields__}
        path.write_text(json.dumps({**d, "contention": c}))
    monkeypatch.setattr(sv, "_CALIBRATIONS", {1: str(one), 2: str(two)})
    monkeypatch.setattr(sv, "_LINK_LATENCY", {"2x1 200 Mbit/s": 1e-3})
    monkeypatch.setattr(sv, "_LOADER", {})
    monkeypatch.setattr(sv, "measure_loader", lambda cfg, world_size: 0.0)
    topo = sv.topology(sv.Group("2x1 hosts", 2, 1, 200, ("table_wise",)), cfg)
    assert topo.hardware.contention == 0.25 and topo.host_link_latency_s == pytest.approx(1e-3)
