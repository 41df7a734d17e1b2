"""The cluster a simulated step runs on: the planner's hardware description (per-shard costs,
bandwidths per rank) plus what a training step needs beyond the embeddings: each host's link
(shared by its ranks), optional tiers of hosts (racks, buildings) behind shared uplinks, the
dense compute rate and the data loader's cost per sample.

``--topology`` is a planner preset (``zionex``, ``local-cpu``, ``torchrec-defaults``),
``this-machine`` (``recscale calibrate``'s cache), a calibrated hardware JSON, or a topology
file (TOML or JSON)::

    base = "local-cpu"            # preset or calibrated JSON: the per-shard constants
    hosts = 2
    ranks_per_host = 1
    cross_host_mbit = 200         # each host's link, each way, shared by its ranks
    cross_host_latency_ms = 0.0   # one way, host to host
    intra_host_gbyte_s = 2.15     # optional: per-rank bandwidth inside a host
    flops_per_s = 4e9             # optional: dense compute rate per rank
    op_overhead_s = 30e-6         # optional: fixed cost per dense operator (launch, autograd)
    value_s = 1e-9                # optional: per activation value written (forward; x3 with backward)
    loop_s = 0.2e-3               # optional: the training loop's own CPU time per step
    shm_loop_s = 1e-3             # optional: a step of several ranks beyond that, through shared memory
    tcp_loop_s = 1e-3             # optional: the same for ranks over TCP (on several hosts)
    sync_jitter = 0.2             # optional: the cores' unsteadiness (ranks wait for the slowest)
    load_s_per_sample = 1e-6      # optional: data loader time per sample
    checkpoint_gbyte_s = 1.0      # optional: checkpoint write rate per rank (stalls)
    shared_cores = 2              # optional: all ranks run on one machine of this many cores
    contention = 0.18             # optional: how much ranks sharing a machine slow each other (the base's)
    mtu_bytes = 1500              # optional: TCP/IP packets on host links and tiers (0: payload alone)
    frame_bytes = 38              # optional: per frame beyond the IP packet (Ethernet; 14 under tc)
    segments_per_ack = 2          # optional: a pure ACK back per this many segments (0: none)
    burst_bytes = 0               # optional: a shaper's token bucket, let through at once after idling
    cores_per_host = 16           # optional: CPU cores of each host, shared by its ranks
    [[tiers]]                     # optional: groups of hosts behind one uplink
    hosts_per_group = 4
    bandwidth_gbit = 100
    latency_ms = 0.5
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from recscale.planner.hardware import PRESETS, Hardware, resolve_hardware
from recscale.sim.cores import CoreShare


class TopologyError(ValueError):
    """A topology that cannot be read; the message names the key and the fix."""


@dataclass(frozen=True)
class Tier:
    """Hosts in consecutive groups of ``hosts_per_group`` share one uplink of ``bandwidth``
    bytes/s each way; traffic leaving a group also pays ``latency_s``."""

    hosts_per_group: int
    bandwidth: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class Framing:
    """What the network links carry beyond a collective's payload: every packet of
    ``payload_bytes`` costs ``overhead_bytes`` more on the link (the transport's and IP's
    headers, the frame's), and every ``segments_per_ack`` packets one way the receiver sends an
    acknowledgement of ``ack_bytes`` the other way (0: none). Shared memory and NVLink inside a
    host carry payload alone."""

    payload_bytes: float
    overhead_bytes: float
    ack_bytes: float = 0.0
    segments_per_ack: int = 0

    @property
    def data_factor(self) -> float:
        """Bytes on the link per payload byte sent over it."""
        return 1.0 + self.overhead_bytes / self.payload_bytes

    @property
    def ack_factor(self) -> float:
        """Bytes on the link per payload byte going the other way (its acknowledgements)."""
        return self.ack_bytes / (self.segments_per_ack * self.payload_bytes) if self.segments_per_ack else 0.0


_TCP_IP_HEADERS = 52  # IPv4 20 + TCP 20 + the timestamp option 12, as Linux sends by default
ETHERNET_FRAME_BYTES = 38  # header 14 + FCS 4 + preamble 8 + inter-frame gap 12
TC_FRAME_BYTES = 14  # what a tc qdisc counts and shapes beyond the IP packet: the Ethernet header


def tcp_framing(mtu_bytes: float = 1500, frame_bytes: float = ETHERNET_FRAME_BYTES,
                segments_per_ack: int = 2) -> Framing:
    """TCP/IPv4 over Ethernet: full segments of ``mtu_bytes`` less the headers (1448 of 1538
    bytes on the wire at MTU 1500); a pure ACK (headers alone) every ``segments_per_ack``
    segments the other way (Linux's delayed ACK acknowledges every second full segment)."""
    return Framing(mtu_bytes - _TCP_IP_HEADERS, _TCP_IP_HEADERS + frame_bytes, _TCP_IP_HEADERS + frame_bytes,
                   segments_per_ack)


# RoCEv2 at MTU 4096 (NCCL between GPU hosts): Ethernet 38, IPv4 20, UDP 8, the InfiniBand
# transport header 12 and ICRC 4 per packet; acknowledgements are coalesced (negligible).
ROCE_FRAMING = Framing(4096, ETHERNET_FRAME_BYTES + 20 + 8 + 12 + 4)


@dataclass(frozen=True)
class DenseCompute:
    """The MLPs' and interaction's cost on one rank: FLOPs at ``flops_per_s``, ``value_s`` per
    activation value written (the interaction and small layers are bound by memory, not
    FLOPs), ``op_overhead_s`` per operator (launch, autograd and Python), the loader's
    ``load_s_per_sample``, and ``loop_s``: the training loop's own CPU time per step beyond
    the operators priced (pipeline bookkeeping, the loss's record, the guards, the optimizers'
    Python), which does not shrink with a rank's share of the batch; ``sync_jitter``: how
    unsteady the cores' speed is (``recscale.planner.jitter``), which makes ranks that meet at
    collectives wait for the slowest. ``shm_loop_s`` and ``tcp_loop_s``: what a step of
    several ranks costs beyond that (their meetings at every collective: the wake-ups and the
    waits for each other that no probe of one part sees), for ranks that meet through shared
    memory and over TCP."""

    flops_per_s: float
    op_overhead_s: float = 0.0
    load_s_per_sample: float = 0.0
    value_s: float = 0.0
    loop_s: float = 0.0
    sync_jitter: float = 0.0
    shm_loop_s: float = 0.0
    tcp_loop_s: float = 0.0


@dataclass(frozen=True)
class ClusterTopology:
    name: str
    hardware: Hardware  # world size and ranks per host set
    host_link_bw: float  # bytes/s each way per host, shared by its ranks
    host_link_latency_s: float
    compute: DenseCompute
    tiers: tuple[Tier, ...] = ()
    checkpoint_bw: float = 1e9  # bytes/s a rank writes its checkpoint shards at
    # Cores every rank of the cluster shares (emulated hosts on one machine); 0: each rank
    # has its own. More ranks than cores stretch every rank's compute by ranks / cores.
    shared_cores: int = 0
    # Bytes a rank's sends may have in flight before a send holds it (TCP socket buffers, as
    # Linux grows them up to 4 MiB; NCCL's channel buffers are of the same order): a
    # collective's heavy direction drains while its senders go on.
    send_buffer_bytes: float = 4 * 2**20
    # Framing on the host links and tiers (None: payload alone)
    framing: Framing | None = tcp_framing()
    # Bytes a host link or tier lets through at once after it idled: the token bucket of a
    # shaper (tc's tbf, as emulated hosts have); 0: a link that never runs above its rate.
    burst_bytes: float = 0.0
    # CPU cores of each host, shared by its ranks (0: not given: a core per training thread and
    # one to spare). ``shared_cores``, where set, is the pool instead.
    cores_per_host: int = 0

    def core_share(self, threads: int = 1) -> CoreShare:
        """How the cores a rank shares divide among the ranks sharing them, at ``threads``
        training threads per rank."""
        if self.shared_cores:
            return CoreShare(self.world_size, self.shared_cores, threads)
        return CoreShare(self.ranks_per_host, self.cores_per_host, threads)

    @property
    def compute_stretch(self) -> float:
        """How much slower a single-threaded rank computes where ranks outnumber cores."""
        return self.core_share().serial_stretch

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @property
    def ranks_per_host(self) -> int:
        return self.hardware.ranks_per_host

    @property
    def hosts(self) -> int:
        return self.hardware.num_hosts

    def with_bandwidth(self, host_link_bw: float) -> ClusterTopology:
        return replace(self, host_link_bw=host_link_bw)


# Dense compute of the presets. ZionEX: an A100 runs large bf16/TF32 GEMMs at about 150 of its
# 312 TFLOP/s, a kernel launch costs ~10 us; its hosts' CPUs keep the loader off the critical
# path (load 0). The CPU figure is this kind of 2-core VM at one thread per rank (CPU time, so
# other jobs on the machine do not slow it), from ``recscale.sim.calibrate`` (DLRM MLPs and
# interaction forward + backward + Adagrad step); `recscale simulate --measure-compute`
# measures another machine.
PRESET_COMPUTE = {
    "zionex": DenseCompute(150e12, 10e-6, 0.0),
    "torchrec-defaults": DenseCompute(150e12, 10e-6, 0.0),
    "local-cpu": DenseCompute(112e9, 9.2e-6, 0.0, 0.74e-9),
}


# The presets' networks: NCCL over RoCE for the GPU clusters; TCP over Ethernet otherwise.
PRESET_FRAMING = {"zionex": ROCE_FRAMING, "torchrec-defaults": ROCE_FRAMING}


def _num(d: dict, key: str, source: str, default: float | None = None, positive: bool = False) -> float | None:
    v = d.get(key, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (positive and v == 0):
        raise TopologyError(f"topology '{source}': key '{key}' must be a number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _base(name: str, world: int | None, per_host: int | None) -> Hardware:
    try:
        return resolve_hardware(name, world, per_host)
    except ValueError as e:
        raise TopologyError(str(e)) from None


def _compute_for(hw: Hardware) -> DenseCompute:
    """The dense compute a step on ``hw`` is priced with: a preset's own, else this machine's
    measured one (``recscale simulate --measure-compute``), else the CPU preset's; and the
    calibration's own jitter where it measured one, since its collective figures are fitted
    net of the wait at that jitter (the simulator adds the wait back, once)."""
    if hw.name in PRESET_COMPUTE and hw.name != "local-cpu":
        c = PRESET_COMPUTE[hw.name]
    else:  # a calibration of this machine: the CPU figures, or this machine's measured dense rate
        from recscale.sim.calibrate import cached_compute

        c = cached_compute() or PRESET_COMPUTE["local-cpu"]
    return replace(c, sync_jitter=hw.sync_jitter) if hw.sync_jitter > 0 else c


def load_topology(spec: str, hosts: int | None = None, ranks_per_host: int | None = None) -> ClusterTopology:
    """A preset, a calibrated hardware JSON or a topology file; ``hosts``/``ranks_per_host``
    resize it (the preset's own shape otherwise)."""
    if spec == "this-machine":  # `recscale calibrate`'s cache for this many local ranks
        from recscale.planner.hardware import cached_calibration

        cached = cached_calibration(ranks_per_host or 2)
        if not cached.is_file():
            raise TopologyError(f"--topology this-machine: no calibration at {cached}; run `recscale calibrate "
                                f"--ranks {ranks_per_host or 2}` first, or name a preset {sorted(PRESETS)}")
        spec = str(cached)
    p = Path(spec)
    if spec in PRESETS or (p.suffix == ".json" and _is_hardware_json(p)):
        hw0 = _base(spec, None, None)
        r = ranks_per_host or hw0.ranks_per_host
        world = (hosts * r) if hosts else (hw0.world_size if not ranks_per_host else max(hw0.num_hosts, 1) * r)
        hw = _base(spec, world, r)
        return ClusterTopology(hw.name, hw, hw.cross_host_bw * hw.ranks_per_host, 0.0, _compute_for(hw),
                               framing=PRESET_FRAMING.get(hw.name, tcp_framing()))
    if not p.is_file():
        raise TopologyError(f"--topology '{spec}' is neither a preset {sorted(PRESETS)} nor an existing file")
    try:
        d = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise TopologyError(f"topology file '{p}' is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
    return topology_from_dict(d, str(p), hosts, ranks_per_host)


def _is_hardware_json(p: Path) -> bool:
    try:
        return "memory_bw" in json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False


_KEYS = {"base", "hosts", "ranks_per_host", "cross_host_mbit", "cross_host_latency_ms", "intra_host_gbyte_s",
         "flops_per_s", "op_overhead_s", "load_s_per_sample", "tiers", "name", "checkpoint_gbyte_s",
         "shared_cores", "value_s", "send_buffer_mib", "mtu_bytes", "frame_bytes", "segments_per_ack",
         "cores_per_host", "loop_s", "burst_bytes", "contention", "sync_jitter", "tcp_latency_ms",
         "tcp_replica_latency_ms", "tcp_replica_byte_ns", "tcp_call_ms", "shm_loop_s", "tcp_loop_s"}


def topology_from_dict(d: dict, source: str = "topology", hosts: int | None = None,
                       ranks_per_host: int | None = None) -> ClusterTopology:
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise TopologyError(f"topology '{source}': unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    base = d.get("base", "local-cpu")
    if not isinstance(base, str):
        raise TopologyError(f"topology '{source}': key 'base' must be a preset name or a hardware JSON path")
    h = hosts or int(_num(d, "hosts", source, 1, positive=True))  # type: ignore[arg-type]
    r = ranks_per_host or int(_num(d, "ranks_per_host", source, 1, positive=True))  # type: ignore[arg-type]
    if not Path(base).is_absolute() and base not in PRESETS and not Path(base).exists():
        base = str(Path(source).parent / base)
    hw = _base(base, h * r, r)
    intra = _num(d, "intra_host_gbyte_s", source, positive=True)
    mbit = _num(d, "cross_host_mbit", source, positive=True)
    link = mbit * 1e6 / 8 if mbit else hw.cross_host_bw * r
    # the cost model's cross-host figure is per rank: an R-rank host's link carries R shares
    hw = replace(hw, cross_host_bw=link / r, intra_host_bw=intra * 1e9 if intra else hw.intra_host_bw)
    contention = _num(d, "contention", source)
    if contention is not None:  # ranks sharing a machine the base was not calibrated with several ranks on
        hw = replace(hw, contention=contention)
    # collectives over TCP, as a calibration of several ranks measures them (``Hardware.over_tcp``),
    # for a base that has none (a one-rank calibration) or other figures
    tcp = {field: (_num(d, key, source), unit) for field, key, unit in (
        ("tcp_latency_s", "tcp_latency_ms", 1e-3), ("tcp_replica_latency_s", "tcp_replica_latency_ms", 1e-3),
        ("tcp_replica_byte_s", "tcp_replica_byte_ns", 1e-9), ("tcp_call_s", "tcp_call_ms", 1e-3))}
    hw = replace(hw, **{field: v * unit for field, (v, unit) in tcp.items() if v is not None})  # type: ignore[operator]
    c0 = _compute_for(hw)
    compute = DenseCompute(
        _num(d, "flops_per_s", source, c0.flops_per_s, positive=True),  # type: ignore[arg-type]
        _num(d, "op_overhead_s", source, c0.op_overhead_s),  # type: ignore[arg-type]
        _num(d, "load_s_per_sample", source, c0.load_s_per_sample),  # type: ignore[arg-type]
        _num(d, "value_s", source, c0.value_s),  # type: ignore[arg-type]
        _num(d, "loop_s", source, c0.loop_s),  # type: ignore[arg-type]
        _num(d, "sync_jitter", source, c0.sync_jitter),  # type: ignore[arg-type]
        _num(d, "shm_loop_s", source, c0.shm_loop_s),  # type: ignore[arg-type]
        _num(d, "tcp_loop_s", source, c0.tcp_loop_s),  # type: ignore[arg-type]
    )
    tiers = []
    for i, t in enumerate(d.get("tiers", [])):
        where = f"{source}' tiers[{i}"
        if not isinstance(t, dict) or set(t) - {"hosts_per_group", "bandwidth_gbit", "latency_ms"}:
            raise TopologyError(f"topology '{where}]': a table of hosts_per_group, bandwidth_gbit, latency_ms")
        missing = [k for k in ("hosts_per_group", "bandwidth_gbit") if k not in t]
        if missing:
            raise TopologyError(f"topology '{where}]': missing key(s) {missing}")
        tiers.append(Tier(int(_num(t, "hosts_per_group", where, positive=True)),  # type: ignore[arg-type]
                          _num(t, "bandwidth_gbit", where, positive=True) * 1e9 / 8,  # type: ignore[operator]
                          _num(t, "latency_ms", where, 0.0) / 1e3))  # type: ignore[operator]
    latency = _num(d, "cross_host_latency_ms", source, 0.0) / 1e3  # type: ignore[operator]
    ckpt = _num(d, "checkpoint_gbyte_s", source, 1.0, positive=True) * 1e9  # type: ignore[operator]
    cores = int(_num(d, "shared_cores", source, 0))  # type: ignore[arg-type]
    buffer = _num(d, "send_buffer_mib", source, 4.0) * 2**20  # type: ignore[operator]
    per_host = _num(d, "cores_per_host", source, 0.0)
    if per_host != int(per_host):  # type: ignore[arg-type]
        raise TopologyError(f"topology '{source}': key 'cores_per_host' must be a whole number of cores, got {per_host!r}")
    burst = _num(d, "burst_bytes", source, 0.0)
    return ClusterTopology(str(d.get("name", Path(source).stem)), hw, link, latency, compute, tuple(tiers), ckpt, cores,
                           buffer, _framing(d, source, hw.name), burst_bytes=burst,  # type: ignore[arg-type]
                           cores_per_host=int(per_host))  # type: ignore[arg-type]


def _framing(d: dict, source: str, base: str) -> Framing | None:
    """TCP over Ethernet at ``mtu_bytes`` (0: payload alone), ``frame_bytes`` per frame beyond
    the IP packet, a pure ACK every ``segments_per_ack`` segments (0: none counted); none of
    them given: the base preset's network."""
    if not any(k in d for k in ("mtu_bytes", "frame_bytes", "segments_per_ack")):
        return PRESET_FRAMING.get(base, tcp_framing())
    mtu = _num(d, "mtu_bytes", source, 1500.0)
    if not mtu:
        return None
    if mtu <= _TCP_IP_HEADERS:
        raise TopologyError(f"topology '{source}': key 'mtu_bytes' must exceed the TCP/IP headers "
                            f"({_TCP_IP_HEADERS} bytes), got {mtu:g}; 1500 for Ethernet, 0 for payload alone")
    frame = _num(d, "frame_bytes", source, float(ETHERNET_FRAME_BYTES))
    acks = d.get("segments_per_ack", 2)
    if not isinstance(acks, int) or isinstance(acks, bool) or acks < 0:
        raise TopologyError(f"topology '{source}': key 'segments_per_ack' must be an integer >= 0, got {acks!r}")
    return tcp_framing(mtu, frame, acks)  # type: ignore[arg-type]
