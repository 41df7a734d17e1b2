"""A cluster described by its tiers, for ``recscale explore``: ranks per host, hosts per pod,
pods per building, buildings, and each link tier's bandwidth, latency and oversubscription.

A tiers file (JSON or TOML)::

    {"name": "two-buildings", "base": "zionex",
     "ranks_per_host": 8, "hosts_per_pod": 8, "pods_per_building": 1, "buildings": 2,
     "links": {"host":     {"bandwidth_gbit": 1600, "latency_ms": 0.0},
               "pod":      {"oversubscription": 1, "latency_ms": 0.0},
               "building": {"oversubscription": 4, "latency_ms": 1.0}}}

``host`` is each host's own link (shared by its ranks; default: the base preset's). A pod's or
building's uplink carries ``bandwidth_gbit`` each way, or, given ``oversubscription`` instead,
the sum of its hosts' links divided by it. It becomes the simulator's topology: the host link,
and one tier of hosts per pod and per building (a tier with one group is dropped).

Optional: ``shared_cores`` (every rank runs on one machine of that many cores, as emulated
hosts do), ``compute`` (``flops_per_s``, ``op_overhead_s``, ``value_s``,
``load_s_per_sample``, ``loop_s``: a calibrated dense rate, loader and training-loop cost
in place of the base's) and the network's framing (``mtu_bytes``, ``frame_bytes``,
``segments_per_ack``, as in a topology file; the base's network otherwise: RoCE for the GPU
presets, TCP over Ethernet for the others).
``emulated_cluster`` describes ``recscale cluster --groups 2`` this way, and ``cluster_args``
turns a placement back into that command's arguments.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from recscale.sim.topology import TC_FRAME_BYTES, ClusterTopology, TopologyError, load_topology, topology_from_dict

LINK_TIERS = ("host", "pod", "building")
_SHAPE = ("ranks_per_host", "hosts_per_pod", "pods_per_building", "buildings")
_LINK_KEYS = {"bandwidth_gbit", "latency_ms", "oversubscription"}


@dataclass(frozen=True)
class LinkTier:
    bandwidth_gbit: float  # each way, per host (host) or per group uplink (pod, building)
    latency_ms: float = 0.0


@dataclass(frozen=True)
class TieredCluster:
    name: str
    base: str  # the planner preset giving per-shard costs and dense compute
    ranks_per_host: int
    hosts_per_pod: int
    pods_per_building: int
    buildings: int
    links: dict[str, LinkTier]
    shared_cores: int = 0  # all ranks on one machine of this many cores (emulated hosts); 0: own cores
    compute: dict[str, float] = field(default_factory=dict)  # calibrated DenseCompute fields over the base's
    framing: dict[str, float] = field(default_factory=dict)  # FRAMING_KEYS over the base's network

    @property
    def hosts_per_building(self) -> int:
        return self.hosts_per_pod * self.pods_per_building

    @property
    def hosts(self) -> int:
        return self.hosts_per_building * self.buildings

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def shrink(self, buildings: int, ranks_per_host: int) -> TieredCluster:
        """The cluster a job placed on its first ``buildings`` buildings with ``ranks_per_host``
        ranks on each host sees."""
        return TieredCluster(self.name, self.base, ranks_per_host, self.hosts_per_pod, self.pods_per_building,
                             buildings, self.links, self.shared_cores, self.compute, self.framing)

    def topology(self) -> ClusterTopology:
        host = self.links["host"]
        tiers = []
        if self.pods_per_building > 1 and self.hosts > self.hosts_per_pod:
            p = self.links["pod"]
            tiers.append({"hosts_per_group": self.hosts_per_pod, "bandwidth_gbit": p.bandwidth_gbit,
                          "latency_ms": p.latency_ms})
        if self.buildings > 1:
            b = self.links["building"]
            tiers.append({"hosts_per_group": self.hosts_per_building, "bandwidth_gbit": b.bandwidth_gbit,
                          "latency_ms": b.latency_ms})
        d = {"name": self.name, "base": self.base, "hosts": self.hosts, "ranks_per_host": self.ranks_per_host,
             "cross_host_mbit": host.bandwidth_gbit * 1e3, "cross_host_latency_ms": host.latency_ms, "tiers": tiers,
             "shared_cores": self.shared_cores, **self.compute, **self.framing}
        return topology_from_dict(d, self.name)

    def to_dict(self) -> dict:
        return {"name": self.name, "base": self.base, **{k: getattr(self, k) for k in _SHAPE},
                "links": {k: {"bandwidth_gbit": v.bandwidth_gbit, "latency_ms": v.latency_ms} for k, v in self.links.items()},
                "shared_cores": self.shared_cores, **({"compute": dict(self.compute)} if self.compute else {}),
                **self.framing}

    def cluster_args(self) -> list[str] | None:
        """``recscale cluster`` arguments that emulate this cluster on one machine (hosts over
        shaped links, two buildings as two groups), or None where it cannot be emulated: more
        than two buildings, pods inside a building, or added latency (netem)."""
        if self.buildings > 2 or self.pods_per_building > 1:
            return None
        if any(self.links[k].latency_ms for k in ("host", "building")):
            return None
        args = ["--hosts", str(self.hosts), "--ranks-per-host", str(self.ranks_per_host),
                "--bandwidth-mbit", f"{self.links['host'].bandwidth_gbit * 1e3:g}"]
        if self.buildings == 2:
            args += ["--groups", "2", "--cross-bandwidth-mbit", f"{self.links['building'].bandwidth_gbit * 1e3:g}"]
        return args


COMPUTE_KEYS = ("flops_per_s", "op_overhead_s", "value_s", "load_s_per_sample", "loop_s", "shm_loop_s", "tcp_loop_s")
FRAMING_KEYS = ("mtu_bytes", "frame_bytes", "segments_per_ack", "burst_bytes")  # as in a topology file
# A tc qdisc counts (and its token bucket shapes) each frame's Ethernet header beyond the IP
# packet, not the preamble, gap or FCS of a physical link; ``recscale cluster``'s token buckets
# hold 128 KiB (or 1 ms of the rate, when more), so a link that idled passes that much at once.
EMULATED_BURST_BYTES = 128 << 10
EMULATED_FRAMING = {"mtu_bytes": 1500, "frame_bytes": TC_FRAME_BYTES, "burst_bytes": EMULATED_BURST_BYTES}


def emulated_cluster(hosts_per_group: int, ranks_per_host: int, intra_mbit: float, cross_mbit: float,
                     shared_cores: int, base: str = "local-cpu", compute: dict[str, float] | None = None,
                     name: str = "emulated-two-groups") -> TieredCluster:
    """``recscale cluster --groups 2`` on this machine as tiers: each group a building of
    ``hosts_per_group`` hosts (links at ``intra_mbit``), the groups joined by one link of
    ``cross_mbit``; every rank shares this machine's ``shared_cores``."""
    return cluster_from_dict({"name": name, "base": base, "ranks_per_host": ranks_per_host,
                              "hosts_per_pod": hosts_per_group, "pods_per_building": 1, "buildings": 2,
                              "links": {"host": {"bandwidth_gbit": intra_mbit / 1e3},
                                        "building": {"bandwidth_gbit": cross_mbit / 1e3}},
                              "shared_cores": shared_cores, **({"compute": compute} if compute else {}),
                              **EMULATED_FRAMING}, name)


def _host_gbit(base: str) -> float:
    t = load_topology(base, 1, 8)
    return t.host_link_bw * 8 / 1e9


def _int(d: dict, key: str, source: str) -> int:
    v = d.get(key, 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise TopologyError(f"tiers file '{source}': key '{key}' must be an integer >= 1, got {v!r}")
    return v


def _pos(d: dict, key: str, where: str, default: float | None, zero_ok: bool = False) -> float | None:
    v = d.get(key, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and not zero_ok):
        raise TopologyError(f"tiers file '{where}': key '{key}' must be a number {'>= 0' if zero_ok else '> 0'}, got {v!r}")
    return float(v)


def cluster_from_dict(d: dict, source: str = "tiers") -> TieredCluster:
    if not isinstance(d, dict):
        raise TopologyError(f"tiers file '{source}': expected an object with keys {sorted({'name', 'base', 'links', *_SHAPE})}")
    known = {"name", "base", "links", "shared_cores", "compute", *_SHAPE, *FRAMING_KEYS}
    unknown = sorted(set(d) - known)
    if unknown:
        raise TopologyError(f"tiers file '{source}': unknown key(s) {unknown}; known: {sorted(known)}")
    base = d.get("base", "zionex")
    if not isinstance(base, str):
        raise TopologyError(f"tiers file '{source}': key 'base' must be a preset name (zionex, local-cpu, ...)")
    shape = {k: _int(d, k, source) for k in _SHAPE}
    links_in = d.get("links", {})
    if not isinstance(links_in, dict) or set(links_in) - set(LINK_TIERS):
        raise TopologyError(f"tiers file '{source}': key 'links' must be an object with tiers among {list(LINK_TIERS)}")
    try:
        host_default = _host_gbit(base)
    except TopologyError as e:
        raise TopologyError(f"tiers file '{source}': key 'base': {e}") from None
    links: dict[str, LinkTier] = {}
    below = host_default
    for tier, hosts in (("host", 1), ("pod", shape["hosts_per_pod"]),
                        ("building", shape["hosts_per_pod"] * shape["pods_per_building"])):
        spec = links_in.get(tier, {})
        where = f"{source}' links.{tier}"
        if not isinstance(spec, dict) or set(spec) - _LINK_KEYS:
            raise TopologyError(f"tiers file '{where}': an object of {sorted(_LINK_KEYS)}")
        if "bandwidth_gbit" in spec and "oversubscription" in spec:
            raise TopologyError(f"tiers file '{where}': give bandwidth_gbit or oversubscription, not both")
        lat = _pos(spec, "latency_ms", where, 0.0, zero_ok=True)
        if tier == "host":
            bw = _pos(spec, "bandwidth_gbit", where, host_default)
            if "oversubscription" in spec:
                raise TopologyError(f"tiers file '{where}': a host link has no oversubscription; give bandwidth_gbit")
            below = bw  # type: ignore[assignment]
        else:
            over = _pos(spec, "oversubscription", where, 1.0)
            bw = _pos(spec, "bandwidth_gbit", where, None) or hosts * below / over  # type: ignore[operator]
        links[tier] = LinkTier(bw, lat)  # type: ignore[arg-type]
    cores = d.get("shared_cores", 0)
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 0:
        raise TopologyError(f"tiers file '{source}': key 'shared_cores' must be an integer >= 0, got {cores!r}")
    compute = d.get("compute", {})
    if not isinstance(compute, dict) or set(compute) - set(COMPUTE_KEYS):
        raise TopologyError(f"tiers file '{source}': key 'compute' must be an object of {list(COMPUTE_KEYS)}")
    comp = {k: _pos(compute, k, f"{source}' compute", None, zero_ok=k != "flops_per_s") for k in compute}
    framing = {k: d[k] for k in FRAMING_KEYS if k in d}
    for k, v in framing.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise TopologyError(f"tiers file '{source}': key '{k}' must be a number >= 0, got {v!r}")
    return TieredCluster(str(d.get("name", Path(source).stem)), base, **shape, links=links, shared_cores=cores,
                         compute=comp, framing=framing)  # type: ignore[arg-type]


PRESETS: dict[str, dict] = {
    # Two buildings of 8 ZionEX hosts joined by a 1:4 oversubscribed link with 1 ms more latency.
    "two-buildings": {"name": "two-buildings", "base": "zionex", "ranks_per_host": 8, "hosts_per_pod": 8,
                      "pods_per_building": 1, "buildings": 2,
                      "links": {"building": {"oversubscription": 4, "latency_ms": 1.0}}},
    # The ZionEX scale of the DLRM papers: 16 hosts x 8 GPUs behind one non-blocking fabric.
    "zionex": {"name": "zionex", "base": "zionex", "ranks_per_host": 8, "hosts_per_pod": 16,
               "pods_per_building": 1, "buildings": 1},
}


def load_cluster(spec: str) -> TieredCluster:
    """A preset name (``two-buildings``, ``zionex``) or a tiers file (JSON or TOML)."""
    if spec in PRESETS:
        return cluster_from_dict(PRESETS[spec], spec)
    p = Path(spec)
    if not p.is_file():
        raise TopologyError(f"--topology '{spec}' is neither a preset {sorted(PRESETS)} nor an existing tiers file")
    try:
        d = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TopologyError(f"tiers file '{p}' is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
    return cluster_from_dict(d, str(p))
