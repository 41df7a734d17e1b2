"""Shaped links: a token bucket lets what arrives after an idle spell through at once, up to its
depth; while bytes queue the link drains at its rate. The emulated cluster's buckets are
``recscale cluster``'s own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.cluster.network import LinkShape
from recscale.sim.engine import Op, Simulation, drain, shared_finish
from recscale.sim.tiers import EMULATED_BURST_BYTES, emulated_cluster
from recscale.sim.topology import topology_from_dict
from recscale.sim.traffic import all_to_all, bandwidths, bursts, link_ends


def test_a_full_bucket_passes_its_depth_at_once():
    bw, bucket = 1.0, 2.0
    # the first 2 bytes cross on the tokens, the other 3 at the rate
    assert shared_finish([(0.0, 5.0)], bw, bucket, bucket) == pytest.approx([3.0])
    # a small transfer fits the bucket: through on arrival
    assert shared_finish([(1.0, 1.5)], bw, bucket, bucket) == pytest.approx([1.0])
    # queued bytes drain at the rate: the second finds no tokens and shares the link
    assert shared_finish([(0.0, 4.0), (1.0, 1.0)], bw, bucket, bucket) == pytest.approx([3.0, 3.0])


def test_the_bucket_refills_while_the_link_idles():
    bw, bucket = 1.0, 2.0
    # 1 byte of tokens at t=0; the link idles from 3 to 4: one token back, 1 byte at once
    done, left, at = drain([(0.0, 4.0), (4.0, 3.0)], bw, 1.0, bucket)
    assert done == pytest.approx([3.0, 6.0])
    assert (left, at) == pytest.approx((0.0, 6.0))
    # idle long enough: full again, never above its depth
    assert drain([(0.0, 1.0)], bw, 0.0, bucket)[0] == pytest.approx([1.0])
    assert drain([(0.0, 1.0), (10.0, 5.0)], bw, 0.0, bucket)[0] == pytest.approx([1.0, 13.0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0.01, 10)), min_size=1, max_size=6), st.floats(0, 5))
def test_a_bucket_only_brings_ends_forward_and_by_at_most_its_depth(transfers, bucket):
    """Never later than a plain link; the last byte at most one full bucket (at the rate)
    earlier for each idle spell it could have refilled in, and no earlier than a token
    bucket allows: one bucket at once, the rest at the rate."""
    bw = 2.0
    plain = shared_finish(transfers, bw)
    shaped = shared_finish(transfers, bw, bucket, bucket)
    total = sum(b for _, b in transfers)
    # relative to the times compared: a sum of a few seconds rounds in its last bits
    tol = 1e-9 * (1.0 + max(t for t, _ in transfers) + total / bw)
    for p, s in zip(plain, shaped):
        assert s <= p + tol
    assert max(shaped) >= min(t for t, _ in transfers) + (total - bucket) / bw - tol
    assert max(shaped) >= max(b for b, _ in transfers) - tol
    assert max(plain) - max(shaped) <= len(transfers) * bucket / bw + tol


def test_emulated_links_carry_the_shapers_bucket():
    # the simulator's emulated cluster has the token buckets recscale cluster gives its links
    for mbit in (10.0, 20.0):
        assert LinkShape(mbit).burst_bytes == EMULATED_BURST_BYTES
    topo = emulated_cluster(2, 1, 20.0, 10.0, 2).topology()
    assert topo.burst_bytes == EMULATED_BURST_BYTES
    b = bursts(topo)
    assert b and all(not k.startswith("intra") for k in b) and set(b) <= set(bandwidths(topo))
    # a physical network's links are not shaped; the key is optional
    plain = topology_from_dict({"base": "local-cpu", "hosts": 2, "cross_host_mbit": 8.0}, "test")
    assert plain.burst_bytes == 0 and bursts(plain) == {}
    assert topology_from_dict({"hosts": 2, "cross_host_mbit": 8.0, "burst_bytes": 4096}, "t").burst_bytes == 4096


def test_directions_that_take_turns_each_burst_once_per_spell():
    """One link's two directions used in turn (outputs one way, gradients back): each
    direction idles while the other works, so each turn's first bucket crosses at once."""
    topo = topology_from_dict({"base": "local-cpu", "hosts": 2, "ranks_per_host": 1, "cross_host_mbit": 8.0,
                               "mtu_bytes": 0}, "test")
    bw, bucket, mb = topo.host_link_bw, 100e3, 1e6

    def turns(burst: dict[str, float]) -> float:
        sim = Simulation(bandwidths(topo), link_ends(topo), 0.0, burst)
        last = None
        for k in range(3):
            fwd = sim.add(Op("out", "o", k, (0, 1), "comm", 0.0, all_to_all(topo, [mb, 0.0]),
                             deps=[last] if last is not None else []))
            last = sim.add(Op("grad", "g", k, (0, 1), "comm", 0.0, all_to_all(topo, [0.0, mb]), deps=[fwd]))
        return sim.ops[last].end

    plain, shaped = turns({}), turns({k: bucket for k in bandwidths(topo) if not k.startswith("intra")})
    assert plain == pytest.approx(6 * mb / bw)
    # each of the 6 turns finds its direction idle long enough to refill: one bucket saved each,
    # counted once on the host's link out and once on the other host's link in (both shaped)
    assert shaped == pytest.approx(6 * (mb - bucket) / bw)
