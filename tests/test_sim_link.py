"""What a shaped link carries and how it is shared: framing (TCP/IP and Ethernet headers on the
payload, ACKs the other way) on the network's links only, and collectives of different streams
draining a link together, each ending when its own bytes are through."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.sim.engine import Op, Simulation, shared_finish
from recscale.sim.tiers import FRAMING_KEYS, emulated_cluster
from recscale.sim.topology import ROCE_FRAMING, TopologyError, load_topology, tcp_framing, topology_from_dict
from recscale.sim.traffic import all_to_all, bandwidths, link_ends, on_wire, ring_all_reduce

MB = 1e6


def cluster(**keys):
    return topology_from_dict({"base": "local-cpu", "hosts": 2, "ranks_per_host": 2, "cross_host_mbit": 8.0, **keys},
                              "test")


def test_tcp_over_ethernet_at_mtu_1500():
    f = tcp_framing()
    assert f.payload_bytes == 1448
    assert f.payload_bytes + f.overhead_bytes == 1538  # 1500 + header, FCS, preamble, gap
    assert f.data_factor == pytest.approx(1538 / 1448)
    assert f.ack_factor == pytest.approx(90 / (2 * 1448))
    tc = tcp_framing(frame_bytes=14)  # what a tc token bucket counts
    assert tc.data_factor == pytest.approx(1514 / 1448)


def test_network_links_carry_payload_times_the_framing_and_acks_back():
    topo = cluster()
    f = topo.framing
    payload = all_to_all(topo, [0.1 * MB, 0.2 * MB, 0.3 * MB, 0.4 * MB])
    wire = on_wire(topo, payload)
    for link, v in payload.items():
        kind, i = link
        if kind.startswith("intra_"):
            assert wire[link] == v  # shared memory: payload alone
        else:
            back = (kind.replace("_out", "_X").replace("_in", "_out").replace("_X", "_in"), i)
            assert wire[link] == pytest.approx(v * f.data_factor + payload[back] * f.ack_factor)


def test_framing_keys_and_defaults():
    assert cluster(mtu_bytes=0).framing is None
    assert on_wire(cluster(mtu_bytes=0), {("host_out", 0): 5.0}) == {("host_out", 0): 5.0}
    assert cluster().framing == tcp_framing()
    assert cluster(mtu_bytes=9000, segments_per_ack=0).framing == tcp_framing(9000, 38, 0)
    assert load_topology("zionex", 2, 8).framing == ROCE_FRAMING
    assert load_topology("local-cpu", 2, 1).framing == tcp_framing()
    emulated = emulated_cluster(2, 1, 20.0, 10.0, 2).topology()
    assert emulated.framing == tcp_framing(1500, 14)
    with pytest.raises(TopologyError, match="mtu_bytes"):
        cluster(mtu_bytes=40)
    with pytest.raises(TopologyError, match="segments_per_ack"):
        cluster(segments_per_ack=1.5)


def test_shared_link_drains_both_together():
    bw = 1.0
    # together from the start: equal shares, the smaller ends at twice its own time
    assert shared_finish([(0.0, 1.0), (0.0, 3.0)], bw) == pytest.approx([2.0, 4.0])
    # a small one joins a big one: both slow down, the link ends when all bytes are through
    assert shared_finish([(0.0, 4.0), (1.0, 1.0)], bw) == pytest.approx([5.0, 3.0])
    # apart: each alone, as in a queue
    assert shared_finish([(0.0, 1.0), (2.0, 1.0)], bw) == pytest.approx([1.0, 3.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 10)), min_size=1, max_size=6))
def test_sharing_keeps_the_link_busy_as_a_queue_would(transfers):
    """Work conserving: the last byte leaves when a queue's would; nothing ends before its own
    bytes could have crossed alone."""
    done = shared_finish(transfers, 2.0)
    t = 0.0
    for begin, nbytes in sorted(transfers):
        t = max(t, begin) + nbytes / 2.0
    assert max(done) == pytest.approx(t)
    for (begin, nbytes), d in zip(transfers, done):
        assert d >= begin + nbytes / 2.0 - 1e-9


def _two(stream_b: str, read_first: bool = False):
    topo = cluster(mtu_bytes=0)
    bw = topo.host_link_bw
    sim = Simulation(bandwidths(topo), link_ends(topo), send_buffer=0.0)
    w = topo.world_size
    heavy = all_to_all(topo, [0.0, 0.0, 1.0 * MB, 1.0 * MB])  # to the second host's ranks
    a = sim.add(Op("a2a", "grad", 0, tuple(range(w)), "comm", 0.0, heavy))
    if read_first:
        sim.add(Op("uses a2a", "c", 0, (2,), "compute", 0.0, deps=[a]))
    ring = ring_all_reduce(topo, 1.0 * MB)
    b = sim.add(Op("all-reduce", "dense", 0, tuple(range(w)), stream_b, 0.0, ring, together=True))
    return sim.ops[a], sim.ops[b], bw, heavy, ring


def test_collectives_of_two_streams_share_a_link():
    a, b, bw, heavy, ring = _two("dense")
    out = ("host_out", 0)
    # both begin at 0 on the first host's link out: equal shares until the smaller is through
    small = min(heavy[out], ring[out])
    assert b.end == pytest.approx(2 * ring[out] / bw if ring[out] < heavy[out] else (heavy[out] + ring[out]) / bw)
    assert max(a.end_for(2), b.end) == pytest.approx((heavy[out] + ring[out]) / bw)
    assert min(a.end_for(2), b.end) == pytest.approx(2 * small / bw)
    # a ring ends for every rank together
    assert {b.end_for(r) for r in range(4)} == {b.end}


def test_one_stream_queues_and_a_read_end_stays_put():
    for stream, read in (("comm", False), ("dense", True)):
        a, b, bw, heavy, ring = _two(stream, read)
        out = ("host_out", 0)
        assert a.end_for(2) == pytest.approx(heavy[out] / bw)  # as if alone
        assert b.end == pytest.approx((heavy[out] + ring[out]) / bw)  # behind it


def test_explore_validation_predicts_a_saved_run_again(tmp_path):
    """``--predict-from``: the saved run's configurations, found by name, predicted again."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import explore_validation as ev

    from recscale.sim.explore import explore
    from recscale.sim.explore_report import _name
    from recscale.train.config import load_config

    sets = [*ev.MODEL, "train.batch_size=384"]
    cluster = emulated_cluster(2, 1, 20.0, 10.0, 2, compute={"load_s_per_sample": 1e-5})
    e = explore(load_config(ev.CONFIG, sets), cluster, 60.0, max_auc_loss=0.0, use_all_ranks=True)
    top, base = e.scored[0], e.baselines["production-default"]
    runs = {"explorer top": {"name": _name(e, top), "predicted_step_s": 1.0, "measured_step_s": 1.0},
            "production-default": {"name": "baseline: production-default", "predicted_step_s": 2.0,
                                   "measured_step_s": 1.5}}
    # a file written before the network's framing was recorded: the emulated network's is assumed
    saved = {"cluster": {k: v for k, v in cluster.to_dict().items() if k not in FRAMING_KEYS},
             "config": str(ev.CONFIG.relative_to(root)), "sets": sets, "max_auc_loss": 0.0, "use_all_ranks": True,
             "runs": runs, "predicted_gain": 1.0, "measured_gain": 0.5}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    v = ev.predict_from(str(path))
    assert v["runs"]["explorer top"]["predicted_step_s"] == pytest.approx(top.result.step_time_s)
    assert v["runs"]["production-default"]["predicted_step_s"] == pytest.approx(base.result.step_time_s)
    assert v["predicted_gain"] == pytest.approx(base.result.step_time_s / top.result.step_time_s - 1)
    assert v["gain_points_apart"] == pytest.approx(100 * (0.5 - v["predicted_gain"]))
