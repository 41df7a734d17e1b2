"""Bytes each link carries for one collective, given where ranks sit: each rank has its own
link into its host's fabric (``intra_out``/``intra_in``, shared memory or NVLink), each host
one link to the network shared by its ranks (``host_out``/``host_in``), and each group of hosts
of a tier one uplink (``tier<i>_out``/``tier<i>_in``). Consecutive ranks share a host,
consecutive hosts a group, as ``recscale cluster`` and torchrun place them."""

from __future__ import annotations

from recscale.sim.engine import Link
from recscale.sim.topology import ClusterTopology


def bandwidths(topo: ClusterTopology) -> dict[str, float]:
    bw = {"intra_out": topo.hardware.intra_host_bw, "intra_in": topo.hardware.intra_host_bw,
          "host_out": topo.host_link_bw, "host_in": topo.host_link_bw,
          # one TCP connection between two ranks of different hosts, both ways in turn (``connections``)
          "pair": topo.host_link_bw}
    for i, t in enumerate(topo.tiers):
        bw[f"tier{i}_out"] = bw[f"tier{i}_in"] = t.bandwidth
    return bw


def bursts(topo: ClusterTopology) -> dict[str, float]:
    """The token bucket (bytes) of each shaped link kind: host links and tiers; a rank's link
    into its host (shared memory, NVLink) is not shaped."""
    if not topo.burst_bytes:
        return {}
    # a connection's two directions pass two shapers, each with its own bucket
    return {k: topo.burst_bytes * (2 if k == "pair" else 1) for k in bandwidths(topo) if not k.startswith("intra")}


def _groups(topo: ClusterTopology) -> list[tuple[str, int]]:
    """(link prefix, ranks per group) for every level above a rank whose groups number > 1."""
    levels = []
    if topo.hosts > 1:
        levels.append(("host", topo.ranks_per_host))
    for i, t in enumerate(topo.tiers):
        per = t.hosts_per_group * topo.ranks_per_host
        if per < topo.world_size:
            levels.append((f"tier{i}", per))
    return levels


def all_to_all(topo: ClusterTopology, per_dest: list[float], toward_dest: bool = True) -> dict[Link, float]:
    """Every rank s exchanges ``per_dest[d]`` bytes with every other rank d: sent from s to d
    when ``toward_dest`` (ids, gradients: sources to owners), else from d to s (outputs)."""
    w = topo.world_size
    out, inn = ("out", "in") if toward_dest else ("in", "out")
    links: dict[Link, float] = {}
    if w == 1:
        return links
    total = sum(per_dest)
    r = topo.ranks_per_host
    if r > 1:
        for h in range(topo.hosts):
            ranks = range(h * r, (h + 1) * r)
            host_sum = sum(per_dest[d] for d in ranks)
            for s in ranks:
                links[(f"intra_{out}", s)] = host_sum - per_dest[s]  # s to its host's others
                links[(f"intra_{inn}", s)] = per_dest[s] * (r - 1)  # its host's others to s
    for prefix, per in _groups(topo):
        for g in range(0, w, per):
            size = min(per, w - g)
            group_sum = sum(per_dest[g:g + per])
            links[(f"{prefix}_{out}", g // per)] = size * (total - group_sum)
            links[(f"{prefix}_{inn}", g // per)] = group_sum * (w - size)
    return links


def uniform(topo: ClusterTopology, per_pair: float) -> dict[Link, float]:
    """Every rank sends ``per_pair`` bytes to every other rank (an all-gather of equal parts)."""
    return all_to_all(topo, [per_pair] * topo.world_size)


def ring_all_reduce(topo: ClusterTopology, nbytes: float) -> dict[Link, float]:
    """A ring all-reduce of ``nbytes`` per rank: each rank sends and receives 2 (W-1)/W of it
    to and from its ring neighbour; one ring edge leaves each host, and each group of a tier."""
    return _ring(topo, 2 * (topo.world_size - 1) / topo.world_size * nbytes)


def ring_all_gather(topo: ClusterTopology, part: float) -> dict[Link, float]:
    """An all-gather of ``part`` bytes from every rank as gloo and NCCL run it, around the ring:
    every ring edge carries W-1 parts, so a tier's uplink carries W-1 parts, not the group's
    ranks times the others' (what sending each part straight to every rank would cost)."""
    return _ring(topo, (topo.world_size - 1) * part)


def _ring(topo: ClusterTopology, v: float) -> dict[Link, float]:
    """``v`` bytes over every edge of the ring of ranks in order."""
    w = topo.world_size
    if w == 1:
        return {}
    r = topo.ranks_per_host
    links: dict[Link, float] = {}
    for s in range(w):
        if topo.hosts == 1 or (s + 1) % r:
            links[("intra_out", s)] = links[("intra_in", (s + 1) % w)] = v
    for prefix, per in _groups(topo):
        for g in range(0, w, per):
            links[(f"{prefix}_out", g // per)] = links[(f"{prefix}_in", g // per)] = v
    return links


def connections(topo: ClusterTopology, per_dest: list[float] | None = None, ring_part: float = 0.0) -> dict[Link, float]:
    """The bytes each connection between two ranks of different hosts carries one direction
    after the other, as gloo runs its all-to-all (``per_dest``: bytes every rank sends rank d)
    and, between two ranks, its all-gather of ``ring_part`` bytes a rank.

    gloo sends a message only once the receiver has told it that its receive is posted, and
    that notice travels on the same TCP connection as the data. Each rank posts its send before
    its receive: the rank that comes second finds the first one's notice waiting, sends its
    data at once and only then its own notice, which queues behind that data on the link. So
    the first rank's data leaves once the second rank's has arrived: a pair's two directions
    go in turn, and an exchange of N bytes each way takes as long as 2 N one way. gloo's
    all-gather sends in two halves, so at W = 2 the first rank's first half overlaps the second
    rank's second half: 3/2 of a part in turn. A ring of more ranks sends and receives on
    different connections (nothing in turn); an all-reduce posts its receives first."""
    w, r = topo.world_size, topo.ranks_per_host
    links: dict[Link, float] = {}
    if topo.hosts < 2:
        return links
    for s in range(w):
        for d in range(s + 1, w):
            if s // r == d // r:
                continue
            v = (per_dest[d] + per_dest[s]) if per_dest else 0.0
            if w == 2:
                v += 1.5 * ring_part
            if v > 0:
                links[("pair", s * w + d)] = v
    return links


def intra_host(topo: ClusterTopology, per_rank: list[float]) -> dict[Link, float]:
    """A reduce-scatter or all-gather inside each host: ``per_rank[r]`` bytes out of and into r."""
    links: dict[Link, float] = {}
    for s, v in enumerate(per_rank):
        if v > 0:
            links[("intra_out", s)] = links[("intra_in", s)] = v
    return links


def merge(*parts: dict[Link, float]) -> dict[Link, float]:
    out: dict[Link, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def link_ends(topo: ClusterTopology):
    """The ranks whose bytes each link carries and the ranks it carries them to, for
    collectives that end per rank: a rank's own link into its host's fabric carries its bytes
    to the host's other ranks (``intra_out``) or theirs to it (``intra_in``); a host's or a
    group's link out carries its ranks' bytes to every rank outside, its link in the reverse."""
    w, r = topo.world_size, topo.ranks_per_host
    everyone = frozenset(range(w))
    sizes = {"host": r}
    for i, t in enumerate(topo.tiers):
        sizes[f"tier{i}"] = t.hosts_per_group * r
    cache: dict[Link, tuple[frozenset[int], frozenset[int]]] = {}

    def ends(link: Link) -> tuple[frozenset[int], frozenset[int]]:
        if link in cache:
            return cache[link]
        kind, index = link
        if kind == "pair":  # a connection: both ranks send and receive over it
            both = frozenset([index // w, index % w])
            cache[link] = (both, both)
            return cache[link]
        prefix, direction = kind.rsplit("_", 1)
        if prefix == "intra":
            inside = frozenset(range(index // r * r, min(w, (index // r + 1) * r))) if topo.hosts > 1 else everyone
            one, others = frozenset([index]), inside - {index}
        else:
            per = sizes[prefix]
            one = frozenset(range(index * per, min(w, (index + 1) * per)))
            others = everyone - one
        cache[link] = (one, others) if direction == "out" else (others, one)
        return cache[link]

    return ends


def on_wire(topo: ClusterTopology, links: dict[Link, float]) -> dict[Link, float]:
    """What ``links`` (payload bytes) put on each link with the network's framing: every host
    link and tier carries its payload times the framing's data factor plus the acknowledgements
    of the payload going the other way (``host_out`` h answers ``host_in`` h), a connection
    (``pair``) its payload framed; the links inside a host (shared memory, NVLink) carry payload
    alone."""
    f = topo.framing
    if f is None or not links:
        return links
    data, ack = f.data_factor, f.ack_factor
    out: dict[Link, float] = {}
    for (kind, i), v in links.items():
        if kind.startswith("intra_"):
            out[(kind, i)] = out.get((kind, i), 0.0) + v
            continue
        out[(kind, i)] = out.get((kind, i), 0.0) + v * data
        if ack and v > 0 and kind != "pair":
            prefix, direction = kind.rsplit("_", 1)
            back = (f"{prefix}_{'in' if direction == 'out' else 'out'}", i)
            out[back] = out.get(back, 0.0) + v * ack
    return out
