"""Run one torchrun job across emulated hosts: one ``torchrun`` per host, inside its namespace.

Each host's torchrun starts R ranks (``--nnodes=N --node_rank=i``, static rendezvous at host 0's
address), so ``LOCAL_WORLD_SIZE`` tells recscale R ranks per host. Ranks reach other hosts only
through gloo over TCP on the host's shaped ``eth0`` (``GLOO_SOCKET_IFNAME``). Each host also
gets its own ``/dev/shm`` (a tmpfs in the private mount namespace ``ip netns exec`` makes), as a
real host has: recscale's shared-memory transport finds the peers' files of its own host only,
so it never carries traffic between emulated hosts past the shaped link.

The job's exit status is the first failing host's (128 + signal for a signal), 0 when every
host succeeds. Whatever happens (a failing rank, SIGINT, SIGTERM, SIGHUP) the network and every
process inside it are removed before returning.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from recscale.cluster.network import HOST_IFACE, ClusterError, CrossTraffic, EmulatedNetwork, LinkShape, LinkTraffic

MASTER_PORT = 29500  # inside the emulated hosts' own namespaces: no other job listens there
_FAILURE_GRACE_S = 5.0  # after a host fails, the others get this long to notice and exit on their own
_SHM = 'mount -t tmpfs -o mode=1777 recscale-shm /dev/shm && exec "$@"'


@dataclass(frozen=True)
class ClusterSpec:
    hosts: int
    ranks_per_host: int
    shape: LinkShape
    groups: int = 1  # 2: two halves of the hosts joined by one ``cross`` link
    cross: LinkShape | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ClusterError(f"--hosts must be at least 1, got {self.hosts}")
        if self.ranks_per_host < 1:
            raise ClusterError(f"--ranks-per-host must be at least 1, got {self.ranks_per_host}")
        EmulatedNetwork(self.hosts, self.shape, groups=self.groups, cross=self.cross)  # its checks, nothing built


@dataclass(frozen=True)
class ClusterResult:
    exit_status: int
    traffic: list[LinkTraffic]
    leftovers: list[str]  # what could not be removed (empty: nothing is left behind)
    cross_traffic: CrossTraffic | None = None  # the link between the groups (two groups)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def program_args(argv: Sequence[str]) -> list[str]:
    """What each rank runs: ``train --config X`` is ``python -m recscale train --config X``; a
    first argument ending in ``.py`` is a script run with its arguments."""
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ClusterError("nothing to run: add the job after '--', e.g. -- train --config configs/criteo_10k.toml")
    if argv[0].endswith(".py"):
        return argv
    return ["-m", "recscale", *argv]


def torchrun_command(spec: ClusterSpec, net: EmulatedNetwork, host: int, program: Sequence[str]) -> list[str]:
    return [
        "ip", "netns", "exec", net.namespace(host), "sh", "-c", _SHM, "sh",
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.hosts}", f"--node_rank={host}", f"--nproc_per_node={spec.ranks_per_host}",
        f"--master_addr={net.address(0)}", f"--master_port={MASTER_PORT}", "--max_restarts=0",
        *program,
    ]


def describe(spec: ClusterSpec, net: EmulatedNetwork) -> str:
    hosts = ", ".join(f"{net.namespace(h)} {net.address(h)}" + (" (master)" if h == 0 else "")
                      for h in range(spec.hosts))
    groups = ""
    if spec.groups == 2:
        assert spec.cross is not None
        half = spec.hosts // 2
        groups = (f"; groups h0..h{half - 1} and h{half}..h{spec.hosts - 1} joined by one link of "
                  f"{spec.cross.describe()} (switches {net.switch_of(0)}, {net.switch_of(1)})")
    return (f"cluster: {spec.hosts} hosts x {spec.ranks_per_host} ranks (world {spec.hosts * spec.ranks_per_host}), "
            f"links {spec.shape.describe()}, subnet {net.subnet}; hosts {hosts}; switch {net.switch}{groups}")


def describe_traffic(traffic: list[LinkTraffic]) -> str:
    parts = [f"h{t.host} sent {t.sent_bytes / 1e6:,.2f} MB received {t.received_bytes / 1e6:,.2f} MB"
             + (f" dropped {t.dropped_packets} pkts" if t.dropped_packets else "") for t in traffic]
    return "cluster: shaped links carried " + "; ".join(parts)


def describe_cross(t: CrossTraffic) -> str:
    return (f"cluster: the link between the groups carried {t.forward_bytes / 1e6:,.2f} MB from group 0 and "
            f"{t.backward_bytes / 1e6:,.2f} MB from group 1" + (f", dropped {t.dropped_packets} pkts" if t.dropped_packets else ""))


def run_cluster(spec: ClusterSpec, argv: Sequence[str], *, log: Callable[[str], None] = print,
                prefix: str | None = None) -> ClusterResult:
    """Build the network, run the job on it, tear everything down; never raises for the job's
    own failure (that is the exit status), only for a network that cannot be built."""
    program = program_args(argv)
    net = EmulatedNetwork(spec.hosts, spec.shape, groups=spec.groups, cross=spec.cross,
                          **({"prefix": prefix} if prefix else {}))
    # Signal handlers can only be set from the main thread; elsewhere the caller handles signals.
    on_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if on_main else {}

    def interrupt(signum: int, _frame: object) -> None:
        raise _Interrupted(signum)

    for s in previous:
        signal.signal(s, interrupt)
    traffic: list[LinkTraffic] = []
    cross: CrossTraffic | None = None
    procs: list[subprocess.Popen] = []
    status, leftovers = 0, []
    try:
        net.create()
        log(describe(spec, net))
        env = dict(os.environ, GLOO_SOCKET_IFNAME=HOST_IFACE, TP_SOCKET_IFNAME=HOST_IFACE)
        for h in range(spec.hosts):
            # Own session: a terminal's Ctrl-C reaches this launcher only, which stops the hosts in order.
            procs.append(subprocess.Popen(torchrun_command(spec, net, h, program), env=env, start_new_session=True))
        status = _wait(procs)
    except _Interrupted as e:
        log(f"cluster: {e} received, stopping the hosts")
        status = 128 + e.signum
    finally:
        for s in previous:  # a second signal must not cut the teardown short
            signal.signal(s, signal.SIG_IGN)
        try:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
            _reap(procs, _FAILURE_GRACE_S)
            if net.subnet is not None:
                traffic = net.traffic()
                cross = net.cross_traffic()
            leftovers = net.destroy()
            _reap(procs, 5.0)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if traffic:
        log(describe_traffic(traffic))
    if cross is not None:
        log(describe_cross(cross))
    log(f"cluster: removed namespaces {', '.join(net.switches)} and {net.prefix}-h0..h{spec.hosts - 1} with their veths and qdiscs"
        if not leftovers else f"cluster: could not remove: {'; '.join(leftovers)}")
    return ClusterResult(status, traffic, leftovers, cross)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _wait(procs: list[subprocess.Popen]) -> int:
    """Until every host ends; after the first failure the rest get a grace period, then SIGTERM."""
    failed_at: float | None = None
    status = 0
    while True:
        codes = [p.poll() for p in procs]
        for c in codes:
            if c not in (None, 0) and status == 0:
                status, failed_at = _exit_status(c), time.monotonic()
        if all(c is not None for c in codes):
            return status
        if failed_at is not None and time.monotonic() - failed_at > _FAILURE_GRACE_S:
            return status
        time.sleep(0.2)


def _reap(procs: list[subprocess.Popen], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
