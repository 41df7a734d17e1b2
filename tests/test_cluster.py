"""Emulated hosts: results equal one process, cross-host bytes go through the shaped links, and
nothing the command made is left behind after a killed rank or a SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import proc_utils
from recscale.cluster import ClusterError, ClusterSpec, LinkShape, run_cluster, unavailable_reason
from recscale.cluster.launch import program_args

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "data.source=synthetic", "data.num_samples=4096", "data.eval_samples=2048", "data.pooling_factors=[1, 3, 2, 1]",
    "data.num_workers=0", "model.table_rows=[1000, 5000, 300, 50]", "train.batch_size=512", "train.progress=false",
    "dist.timeout_s=20", "sharding.default=table_wise",
]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def namespaces() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"emulated hosts unavailable here: {reason}")


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


def leftovers(prefix: str) -> list[str]:
    """Namespaces, and links in this namespace, whose names start with ``prefix``."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split()
    return [n for n in names + links if n.startswith(prefix)]


def test_job_arguments():
    assert program_args(["--", "train", "--config", "x.toml"]) == ["-m", "recscale", "train", "--config", "x.toml"]
    assert program_args(["bench.py", "--quick"]) == ["bench.py", "--quick"]
    with pytest.raises(ClusterError, match="nothing to run"):
        program_args(["--"])
    with pytest.raises(ClusterError, match="bandwidth-mbit"):
        LinkShape(0)
    with pytest.raises(ClusterError, match="ranks-per-host"):
        ClusterSpec(2, 0, LinkShape(100))


def test_two_hosts_match_one_process_over_the_shaped_link(namespaces, tmp_path, monkeypatch):
    from recscale.train.config import load_config
    from recscale.train.loop import train

    one = train(load_config(None, TINY), log=lambda _: None)
    summary = tmp_path / "s.json"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(ROOT)
    lines: list[str] = []
    result = run_cluster(ClusterSpec(2, 1, LinkShape(1000)),
                         ["train", "--summary-json", str(summary)] + sets(TINY), log=lines.append,
                         prefix=f"rsctest{os.getpid()}a")
    assert result.exit_status == 0 and not result.leftovers, lines
    assert not leftovers(f"rsctest{os.getpid()}a")
    two = json.loads(summary.read_text())
    assert two["world_size"] == 2 and two["steps"] == one["steps"]
    assert abs(two["eval_auc"] - one["eval_auc"]) < 1e-4, (two["eval_auc"], one["eval_auc"])
    # Every byte rank 0 sends to rank 1 leaves host 0 through its token bucket: the embedding
    # all-to-alls too, which shared memory would carry if both hosts saw one /dev/shm.
    per_step = two["comm_bytes_per_step"]
    assert per_step["output_a2a"] > per_step.get("dense_allreduce", 0)
    expected = two["steps"] * sum(per_step.values())
    h0, h1 = result.traffic
    assert h0.sent_bytes > expected and h0.received_bytes > 0.5 * expected, (result.traffic, per_step)
    assert h1.received_bytes >= h0.sent_bytes * 0.99 and h1.sent_bytes >= h0.received_bytes * 0.99


def _start() -> tuple[subprocess.Popen, str]:
    """A long cluster job; returns it and its namespace prefix (from its first line)."""
    cmd = [sys.executable, "-m", "recscale", "cluster", "--hosts", "2", "--ranks-per-host", "1",
           "--bandwidth-mbit", "500", "--", "train"] + sets(TINY + ["data.num_samples=4000000"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    first = proc.stdout.readline()
    m = re.search(r"switch (\S+)-sw", first)
    assert m, first
    return proc, m.group(1)


def _ranks(prefix: str, host: int, timeout_s: float = 90.0) -> list[int]:
    """Pids in host ``host``'s namespace that are ranks (RANK in their environment), once there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ns = f"{prefix}-h{host}"
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        ranks = []
        for p in pids:
            try:
                if b"RANK=" in Path(f"/proc/{p}/environ").read_bytes():
                    ranks.append(int(p))
            except OSError:
                pass
        if ranks:
            return ranks
        time.sleep(0.5)
    raise AssertionError(f"no rank started in {prefix}-h{host}")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                out.append(p)
        except OSError:
            pass
    return out


def test_a_killed_rank_fails_the_job_and_leaves_nothing(namespaces, tmp_path):
    proc, prefix = _start()
    try:
        victims = _ranks(prefix, 1)
        everyone = victims + _ranks(prefix, 0)
        time.sleep(3.0)  # into training
        os.kill(victims[0], signal.SIGKILL)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc_utils.kill_group(proc.pid)
        proc.wait()
    assert proc.returncode != 0, out[-2000:]
    assert "cluster: removed namespaces" in out, out[-2000:]
    assert not leftovers(prefix)
    assert not _alive(everyone)


def test_sigterm_stops_the_job_and_leaves_nothing(namespaces, tmp_path):
    proc, prefix = _start()
    try:
        everyone = _ranks(prefix, 0) + _ranks(prefix, 1)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc_utils.kill_group(proc.pid)
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-2000:]
    assert not leftovers(prefix)
    assert not _alive(everyone)


def test_delay_without_netem_is_a_clear_error(namespaces):
    cmd = [sys.executable, "-m", "recscale", "cluster", "--hosts", "2", "--bandwidth-mbit", "100",
           "--latency-ms", "5", "--", "train", "--config", "missing.toml"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc_utils.kill_group(proc.pid)
    if proc.returncode == 0 or "netem" not in err:
        pytest.skip("this kernel offers netem: delay is available")
    assert proc.returncode == 2 and err.strip().count("\n") == 0, err
    assert "delay is unavailable on this kernel" in err, err
    assert not leftovers(f"rsc{proc.pid}-")


_SINK = ("import socket,sys\n"
         "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 29611)); s.listen(4)\n"
         "print('ready', flush=True)\n"
         "for _ in range(int(sys.argv[1])):\n"
         "    c, _a = s.accept(); n = 0\n"
         "    while (b := c.recv(1 << 16)): n += len(b)\n"
         "    c.close(); print(n, flush=True)\n")
_SOURCE = ("import socket,sys,time\n"
           "c=socket.create_connection((sys.argv[1], 29611)); t=time.monotonic()\n"
           "c.sendall(b'x' * int(sys.argv[2])); c.shutdown(socket.SHUT_WR); c.recv(1); print(time.monotonic() - t)\n")


def test_two_groups_share_one_slower_link(namespaces):
    from recscale.cluster.network import EmulatedNetwork

    prefix = f"rsctest{os.getpid()}g"
    net = EmulatedNetwork(4, LinkShape(1000), prefix=prefix, groups=2, cross=LinkShape(40))
    try:
        net.create()
        assert [net.group_of(h) for h in range(4)] == [0, 0, 1, 1]
        qdisc = subprocess.run(["ip", "netns", "exec", net.switch_of(1), "tc", "qdisc", "show", "dev", "x0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "40Mbit" in qdisc, qdisc
        sink = subprocess.Popen(["ip", "netns", "exec", net.namespace(0), sys.executable, "-c", _SINK, "2"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout.readline().strip() == "ready"
            nbytes = 1_500_000
            inside = subprocess.run(["ip", "netns", "exec", net.namespace(1), sys.executable, "-c", _SOURCE,
                                     net.address(0), str(nbytes)], capture_output=True, text=True, timeout=60)
            before = net.cross_traffic()
            across = subprocess.run(["ip", "netns", "exec", net.namespace(3), sys.executable, "-c", _SOURCE,
                                     net.address(0), str(nbytes)], capture_output=True, text=True, timeout=60)
            got = [int(sink.stdout.readline()) for _ in range(2)]
        finally:
            sink.kill()
            sink.wait()
        assert inside.returncode == 0 and across.returncode == 0, (inside.stderr, across.stderr)
        assert got == [nbytes, nbytes]
        after = net.cross_traffic()
        # traffic inside a group never touches the cross link; traffic between the groups all of it
        assert before.forward_bytes < 100_000 and before.backward_bytes < 100_000, before
        assert after.backward_bytes - before.backward_bytes >= nbytes, (before, after)
        # the token bucket bounds it: never faster than 40 Mbit/s (plus one burst)
        seconds = float(across.stdout.split()[-1])
        assert (nbytes - 2 * LinkShape(40).burst_bytes) * 8 / seconds <= 40e6 * 1.05, seconds
    finally:
        assert not net.destroy()
    assert not leftovers(prefix)


def test_failed_build_of_two_groups_leaves_nothing(namespaces, monkeypatch):
    from recscale.cluster import network

    prefix = f"rsctest{os.getpid()}f"
    net = network.EmulatedNetwork(4, LinkShape(1000), prefix=prefix, groups=2, cross=LinkShape(100))
    real = network.EmulatedNetwork._shape

    def fail_on_host(self, ns, dev, shape):
        if ns.endswith("-h2"):
            raise ClusterError("shaping refused")
        real(self, ns, dev, shape)

    monkeypatch.setattr(network.EmulatedNetwork, "_shape", fail_on_host)
    with pytest.raises(ClusterError, match="shaping refused"):
        net.create()
    assert not leftovers(prefix)


def test_group_arguments_are_checked():
    with pytest.raises(ClusterError, match="--hosts must be even"):
        ClusterSpec(3, 1, LinkShape(1000), 2, LinkShape(100))
    with pytest.raises(ClusterError, match="needs --cross-bandwidth-mbit"):
        ClusterSpec(4, 1, LinkShape(1000), 2)
    with pytest.raises(ClusterError, match="--groups must be 1 or 2"):
        ClusterSpec(6, 1, LinkShape(1000), 3, LinkShape(100))
