"""Emulated hosts on one Linux machine: network namespaces joined through switch namespaces.

Host ``i`` is the namespace ``<prefix>-h<i>`` with one interface, ``eth0``, holding an address in
a private /24. Its veth peer ``h<i>`` sits in the namespace ``<prefix>-sw`` on a bridge, so every
byte between two hosts leaves one host's ``eth0`` and enters the other host through the
switch's ``h<j>``. Both ends carry a token-bucket qdisc (``tbf``) at the link's rate, so each
link is shaped in both directions; with ``delay_ms`` a ``netem`` qdisc above the token bucket
adds half the delay at each end (one way host to host: the full delay).

With two groups (``groups=2``) the hosts split evenly: the first half joins the switch
``<prefix>-sw``, the second half ``<prefix>-sw1``, and the two switches are joined by one veth
pair (``x1`` in the first, ``x0`` in the second), shaped both ways at the cross link's own rate:
every byte between the groups shares that one slower link, as between two buildings. All hosts
stay in one bridged /24, so addresses do not change with the grouping.

Nothing is created in the machine's own namespace: the veths are made inside the switch
namespace and one end moved into the host's, so the machine's interfaces, addresses and routes
are never touched, and names carry a per-invocation prefix so concurrent networks never meet.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

HOST_IFACE = "eth0"
_TBF_LATENCY_MS = 100  # queue bound of the token bucket: TCP sees delay, not drops, under load
_MIN_BURST = 128 << 10  # at least two 64 KiB GSO packets, so the bucket never splits one


class ClusterError(RuntimeError):
    """The emulated cluster cannot be built or run (one line, naming the fix)."""


@dataclass(frozen=True)
class LinkShape:
    """Each host's link to the switch: rate in both directions, optional one-way delay."""

    bandwidth_mbit: float
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_mbit > 0:
            raise ClusterError(f"--bandwidth-mbit must be positive, got {self.bandwidth_mbit}")
        if self.delay_ms < 0:
            raise ClusterError(f"--latency-ms must be zero or positive, got {self.delay_ms}")

    @property
    def burst_bytes(self) -> int:
        return max(_MIN_BURST, int(self.bandwidth_mbit * 1e6 / 8 * 1e-3))  # 1 ms of traffic

    def describe(self) -> str:
        delay = f", {self.delay_ms:g} ms one-way delay (netem)" if self.delay_ms else ", no added delay"
        return f"{self.bandwidth_mbit:g} Mbit/s each way (tbf){delay}"


@dataclass(frozen=True)
class CrossTraffic:
    """What the link between the two groups carried, from its qdiscs' counters."""

    forward_bytes: int  # group 0 -> group 1
    backward_bytes: int  # group 1 -> group 0
    dropped_packets: int


@dataclass(frozen=True)
class LinkTraffic:
    """What one host's link carried, from the qdiscs' counters."""

    host: int
    sent_bytes: int  # host -> switch (egress of the host's eth0)
    received_bytes: int  # switch -> host (egress of the switch's port)
    dropped_packets: int


def _run(args: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise ClusterError(f"'{args[0]}' not found: install iproute2 (apt-get install iproute2)") from e
    if check and done.returncode != 0:
        msg = (done.stderr or done.stdout).strip().splitlines()
        raise ClusterError(f"'{' '.join(args)}' failed: {msg[-1] if msg else f'exit status {done.returncode}'}")
    return done


def check_requirements() -> None:
    """Root and iproute2, or a one-line ``ClusterError`` naming what is missing."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        raise ClusterError("emulated hosts need Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterError("emulated hosts need root (network namespaces and tc): run recscale cluster as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"'{tool}' not found: install iproute2 (apt-get install iproute2)")


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this machine's own addresses and routes (read only)."""
    nets = []
    for args in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        out = _run(args, check=False).stdout
        for m in re.finditer(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", out):
            try:
                nets.append(ipaddress.ip_network(m.group(1), strict=False))
            except ValueError:
                pass
    return nets


def free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that none of this machine's addresses or routes overlaps (the default route's
    0.0.0.0/0 excepted), so no address of the emulated hosts can be mistaken for a real one."""
    used = [n for n in _used_networks() if n.prefixlen > 0]
    for second in range(241, 256):
        for third in range(0, 256, 7):
            cand = ipaddress.ip_network(f"10.{second}.{third}.0/24")
            if not any(cand.overlaps(n) for n in used):
                return cand
    raise ClusterError("no free private /24 under 10.241.0.0/12 for the emulated hosts")


@dataclass
class EmulatedNetwork:
    """Namespaces, veths and qdiscs of one emulated cluster; ``destroy()`` removes all of them."""

    hosts: int
    shape: LinkShape
    prefix: str = field(default_factory=lambda: f"rsc{os.getpid()}")
    subnet: ipaddress.IPv4Network | None = None
    groups: int = 1
    cross: LinkShape | None = None  # the link between the two groups (groups=2)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 250:
            raise ClusterError(f"--hosts must be between 1 and 250, got {self.hosts}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", self.prefix):
            raise ClusterError(f"namespace prefix {self.prefix!r} must be 1-40 letters, digits, '_', '.' or '-'")
        if self.groups not in (1, 2):
            raise ClusterError(f"--groups must be 1 or 2, got {self.groups}")
        if self.groups == 2 and self.hosts % 2:
            raise ClusterError(f"--groups 2 splits the hosts evenly: --hosts must be even, got {self.hosts}")
        if self.groups == 2 and self.cross is None:
            raise ClusterError("--groups 2 needs --cross-bandwidth-mbit (the link between the groups)")
        if self.groups == 1 and self.cross is not None:
            raise ClusterError("--cross-bandwidth-mbit needs --groups 2")

    @property
    def switch(self) -> str:
        return self.switch_of(0)

    def switch_of(self, group: int) -> str:
        return f"{self.prefix}-sw" if group == 0 else f"{self.prefix}-sw{group}"

    @property
    def switches(self) -> list[str]:
        return [self.switch_of(g) for g in range(self.groups)]

    def group_of(self, host: int) -> int:
        return host // (self.hosts // self.groups)

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + host + 1)

    def create(self) -> None:
        """Build the switches and the hosts; on any failure what was made is removed again."""
        check_requirements()
        if self.subnet is None:
            self.subnet = free_subnet()
        mine = set(self.namespaces_present())
        if mine:
            raise ClusterError(f"namespaces {sorted(mine)} already exist: another run uses prefix {self.prefix}")
        try:
            for g in range(self.groups):
                self._add_namespace(self.switch_of(g))
                sw = ["ip", "-n", self.switch_of(g)]
                _run(sw + ["link", "add", "br0", "type", "bridge"])
                _run(sw + ["link", "set", "br0", "up"])
            if self.groups == 2:
                assert self.cross is not None
                a, b = self.switch_of(0), self.switch_of(1)
                # born in the first switch, one end moved to the second: nothing in the root namespace
                _run(["ip", "-n", a, "link", "add", "x1", "type", "veth", "peer", "name", "x0", "netns", b])
                for ns, dev in ((a, "x1"), (b, "x0")):
                    _run(["ip", "-n", ns, "link", "set", dev, "master", "br0"])
                    _run(["ip", "-n", ns, "link", "set", dev, "up"])
                    self._shape(ns, dev, self.cross)
            for h in range(self.hosts):
                ns, switch = self.namespace(h), self.switch_of(self.group_of(h))
                sw = ["ip", "-n", switch]
                self._add_namespace(ns)
                # Both ends are born in the switch namespace; one moves to the host: nothing in the root one.
                _run(sw + ["link", "add", f"h{h}", "type", "veth", "peer", "name", HOST_IFACE, "netns", ns])
                _run(sw + ["link", "set", f"h{h}", "master", "br0"])
                _run(sw + ["link", "set", f"h{h}", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(h)}/{self.subnet.prefixlen}", "dev", HOST_IFACE])
                _run(["ip", "-n", ns, "link", "set", HOST_IFACE, "up"])
                self._shape(ns, HOST_IFACE, self.shape)
                self._shape(switch, f"h{h}", self.shape)
        except BaseException:
            self.destroy()
            raise

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # IPv4 only: gloo binds the interface's first address, which must not be a link-local IPv6 one.
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", ns, "sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{key}/disable_ipv6"],
                 check=False)

    def _shape(self, ns: str, dev: str, shape: LinkShape) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        tbf = ["tbf", "rate", f"{shape.bandwidth_mbit:g}mbit", "burst", str(shape.burst_bytes),
               "latency", f"{_TBF_LATENCY_MS}ms"]
        if not shape.delay_ms:
            done = _run(tc + ["root", "handle", "1:"] + tbf, check=False)
            if done.returncode != 0:
                raise ClusterError(f"cannot shape links with tc tbf ({done.stderr.strip()}): this kernel lacks sch_tbf")
            return
        done = _run(tc + ["root", "handle", "1:", "netem", "delay", f"{shape.delay_ms / 2:g}ms"], check=False)
        if done.returncode != 0:
            raise ClusterError(
                "--latency-ms/--cross-latency-ms: delay is unavailable on this kernel "
                f"(no netem qdisc: {done.stderr.strip() or 'refused'}); "
                "run without them"
            )
        _run(tc + ["parent", "1:1", "handle", "10:"] + tbf)

    def namespaces_present(self) -> list[str]:
        """This network's namespaces that exist now (by name; others' are never listed)."""
        out = _run(["ip", "netns", "list"], check=False).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        wanted = set(self.switches) | {self.namespace(h) for h in range(self.hosts)}
        return sorted(names & wanted)

    def traffic(self) -> list[LinkTraffic]:
        """Bytes through each host's shaped link so far (the token bucket's counters)."""
        out = []
        for h in range(self.hosts):
            sent, drop_out = _qdisc_counters(self.namespace(h), HOST_IFACE)
            received, drop_in = _qdisc_counters(self.switch_of(self.group_of(h)), f"h{h}")
            out.append(LinkTraffic(h, sent, received, drop_out + drop_in))
        return out

    def cross_traffic(self) -> CrossTraffic | None:
        """Bytes through the link between the groups so far; None with one group."""
        if self.groups != 2:
            return None
        fwd, d0 = _qdisc_counters(self.switch_of(0), "x1")
        back, d1 = _qdisc_counters(self.switch_of(1), "x0")
        return CrossTraffic(fwd, back, d0 + d1)

    def kill_processes(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``, every process inside this network's namespaces
        (only processes started there, by their ids). Returns how many there were."""
        pids = self._pids()
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._pids():
                break
        return len(pids)

    def _pids(self) -> list[int]:
        pids: set[int] = set()
        for ns in self.namespaces_present():
            out = _run(["ip", "netns", "pids", ns], check=False).stdout
            pids.update(int(p) for p in out.split() if p.isdigit() and _alive(int(p)))
        return sorted(pids)

    def destroy(self) -> list[str]:
        """Remove every process, veth, qdisc and namespace this network made; returns problems
        (empty when everything is gone). Safe to call twice and after a partial ``create``."""
        problems: list[str] = []
        self.kill_processes()
        present = set(self.namespaces_present())
        for g, switch in enumerate(self.switches):
            if switch not in present:
                continue
            # deleting one end of a veth deletes the pair and both qdiscs
            devs = [f"h{h}" for h in range(self.hosts) if self.group_of(h) == g] + (["x1"] if g == 0 and self.groups == 2 else [])
            for dev in devs:
                _run(["ip", "-n", switch, "link", "del", dev], check=False)
        for ns in sorted(present, reverse=True):
            done = _run(["ip", "netns", "del", ns], check=False)
            if done.returncode != 0:
                problems.append(f"{ns}: {done.stderr.strip()}")
        left = self.namespaces_present()
        if left:
            problems.append(f"namespaces still present: {left}")
        self._namespaces.clear()
        return problems


def _qdisc_counters(ns: str, dev: str) -> tuple[int, int]:
    """(bytes sent, packets dropped) by the root qdisc of ``dev`` in ``ns``; (0, 0) when it is gone."""
    out = _run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev], check=False).stdout
    m = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made here (for tests to skip with), or None when they can:
    builds and removes a one-host network with a shaped link."""
    try:
        net = EmulatedNetwork(1, LinkShape(100.0), prefix=f"rscprobe{os.getpid()}")
        try:
            net.create()
        finally:
            net.destroy()
    except ClusterError as e:
        return str(e)
    return None
