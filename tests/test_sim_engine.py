"""The event engine's collectives end per rank: a rank is done when the bytes it receives have
arrived and its sends fit in its send buffer, links drain in order at their bandwidth, and a
symmetric exchange ends for every rank when its slowest link does, as before."""

from __future__ import annotations

import pytest

from recscale.sim.engine import Op, Simulation
from recscale.sim.topology import topology_from_dict
from recscale.sim.traffic import all_to_all, bandwidths, link_ends

MB = 1e6
LATENCY = 0.05


def cluster(hosts: int, per_host: int, tiers: list | None = None):
    d = {"base": "local-cpu", "hosts": hosts, "ranks_per_host": per_host, "cross_host_mbit": 8.0}
    if tiers:
        d["tiers"] = tiers
    return topology_from_dict(d, "test")


def exchange(sim: Simulation, links: dict, w: int, deps: list[int] | None = None) -> Op:
    return sim.ops[sim.add(Op("all-to-all", "comm", 0, tuple(range(w)), "comm", LATENCY, links, deps or []))]


def test_light_receiver_finishes_before_heavy_one():
    topo = cluster(2, 1)
    bw = topo.host_link_bw  # 1 MB/s each way
    # rank 0 sends 1 MB to rank 1 and receives 0.2 MB from it
    links = all_to_all(topo, [0.2 * MB, 1.0 * MB])
    op = exchange(Simulation(bandwidths(topo), link_ends(topo), send_buffer=4 * 2**20), links, 2)
    assert op.rank_end[0] == pytest.approx(0.2 * MB / bw + LATENCY)
    assert op.rank_end[1] == pytest.approx(1.0 * MB / bw + LATENCY)
    assert op.end == op.rank_end[1]
    # without a send buffer rank 0 waits for its own megabyte to leave
    held = exchange(Simulation(bandwidths(topo), link_ends(topo), send_buffer=0.0), links, 2)
    assert held.rank_end[0] == pytest.approx(held.rank_end[1])
    # with part of it buffered, it waits for the rest to leave
    part = exchange(Simulation(bandwidths(topo), link_ends(topo), send_buffer=0.5 * MB), links, 2)
    assert part.rank_end[0] == pytest.approx(0.5 * MB / bw + LATENCY)


def test_second_collective_queues_behind_the_first():
    topo = cluster(2, 1)
    bw = topo.host_link_bw
    sim = Simulation(bandwidths(topo), link_ends(topo), send_buffer=4 * 2**20)
    links = all_to_all(topo, [0.2 * MB, 1.0 * MB])
    first = exchange(sim, links, 2)
    second = exchange(sim, links, 2)
    # rank 0 issues the second while the first's heavy direction still drains ...
    assert first.rank_end[0] < first.rank_end[1]
    # ... so its heavy bytes go on the link right behind the first's, not after the first ended
    assert second.rank_end[1] == pytest.approx(2.0 * MB / bw + LATENCY)
    assert second.rank_end[1] < first.end + 1.0 * MB / bw + LATENCY
    # rank 1 sends its part of the second once it is done with the first
    assert second.rank_end[0] == pytest.approx(first.rank_end[1] + 0.2 * MB / bw + LATENCY)
    # a rank's next operation waits only for its own part
    after = sim.ops[sim.add(Op("compute", "c", 0, (0,), "compute", 0.1, deps=[sim.ops.index(second)]))]
    assert after.start == pytest.approx(second.rank_end[0])


@pytest.mark.parametrize("hosts,per_host,tiers", [(2, 1, None), (4, 2, None), (4, 2, [{"hosts_per_group": 2,
                                                                                        "bandwidth_gbit": 0.004}])])
def test_symmetric_exchange_ends_as_before(hosts, per_host, tiers):
    topo = cluster(hosts, per_host, tiers)
    w = topo.world_size
    links = all_to_all(topo, [0.3 * MB] * w)
    before = Simulation(bandwidths(topo))
    after = Simulation(bandwidths(topo), link_ends(topo), send_buffer=4 * 2**20)
    for sim in (before, after):
        exchange(sim, links, w)
        exchange(sim, links, w, deps=[0])
    for a, b in zip(before.ops, after.ops):
        assert a.end == pytest.approx(b.end)
        assert all(t == pytest.approx(a.end) for t in b.rank_end.values())


def test_topology_file_sets_the_send_buffer():
    assert cluster(2, 1).send_buffer_bytes == 4 * 2**20
    topo = topology_from_dict({"base": "local-cpu", "hosts": 2, "send_buffer_mib": 0.5}, "test")
    assert topo.send_buffer_bytes == 0.5 * 2**20
