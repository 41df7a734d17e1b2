"""Probe: do gloo's exchanges between two emulated hosts send both ways at once?

    recscale cluster --hosts 2 --ranks-per-host 1 --bandwidth-mbit 200 -- benchmarks/_gloo_duplex.py

Times, on each rank (median of REPS rounds, each after the link idled 20 ms), a gloo
all-to-all that sends N bytes one way only and N bytes each way, a gloo all-gather and
all-reduce of N bytes, the same N bytes one way and both ways over a plain TCP socket, and small
collectives; with each, the bytes this host's shaped link sent (its tbf qdisc's counter). Rank
0 prints the table and the connections' TCP state (``ss -tin``). ``BUSY=1`` runs a spinning
process beside each rank. The simulator's ``traffic.connections`` prices what it shows: gloo's
exchange of N bytes each way takes as long as 2 N one way, a socket's does not.
"""

import datetime
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

REPS = int(os.environ.get("REPS", "7"))


def egress() -> int:
    out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", out)
    return int(m.group(1)) if m else -1


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me, w = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    a = dist.new_group(list(range(w)))
    sync = dist.new_group(list(range(w)))

    def a2a(n_send_to_other, n_recv):
        send = torch.zeros(n_send_to_other // 4, dtype=torch.float32)
        recv = torch.empty(n_recv // 4, dtype=torch.float32)
        ss = [0] * w
        rs = [0] * w
        ss[1 - me] = send.numel()
        rs[1 - me] = recv.numel()
        x = torch.cat([torch.zeros(0), send])
        dist.all_to_all_single(recv, x, rs, ss, group=a)

    def tests(n):
        def one_way():
            if me == 0:
                a2a(n, 0)
            else:
                a2a(0, n)

        def both():
            a2a(n, n)

        def ag():
            x = torch.zeros(n // 4)
            out = [torch.empty_like(x) for _ in range(w)]
            dist.all_gather(out, x, group=a)

        def ar():
            x = torch.zeros(n // 4)
            dist.all_reduce(x, group=a)

        return {f"one_way {n}": one_way, f"both {n}": both, f"all_gather {n}": ag, f"all_reduce {n}": ar}

    def tiny():
        def ag8():
            x = torch.zeros(1, dtype=torch.int64)
            out = [torch.empty_like(x) for _ in range(w)]
            dist.all_gather(out, x, group=a)

        def a2a16():
            x = torch.zeros(w, dtype=torch.int64)
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x, [1] * w, [1] * w, group=a)

        def ar4():
            dist.all_reduce(torch.zeros(1), group=a)

        return {"tiny all_gather": ag8, "tiny a2a": a2a16, "tiny all_reduce": ar4}

    import socket
    import threading
    port = int(os.environ["MASTER_PORT"]) + 7
    if me == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(1)
        dist.barrier(group=sync)
        sock, _ = srv.accept()
    else:
        dist.barrier(group=sync)
        sock = socket.create_connection((os.environ["MASTER_ADDR"], port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def recv_n(n):
        got = 0
        buf = bytearray(1 << 20)
        while got < n:
            k = sock.recv_into(buf, min(len(buf), n - got))
            if not k:
                raise RuntimeError("closed")
            got += k

    def raw(n):
        payload = bytes(n)

        def one():
            if me == 0:
                sock.sendall(payload)
                recv_n(1)  # the end of the transfer, as the receiver sees it
            else:
                recv_n(n)
                sock.sendall(b"x")

        def both():
            t = threading.Thread(target=sock.sendall, args=(payload,))
            t.start()
            recv_n(n)
            t.join()

        return {f"raw one_way {n}": one, f"raw both {n}": both}

    ops = {}
    for n in (16 << 10, 128 << 10, 512 << 10, 2 << 20):
        ops.update(tests(n))
        ops.update(raw(n))
    ops.update(tiny())
    names = list(ops)
    times = {k: [] for k in names}
    wire = {k: [] for k in names}
    spin = None
    if os.environ.get("BUSY"):  # a process spinning beside each rank: the cores busy, as in training
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    # warm up every connection and cwnd
    for k in names:
        ops[k]()
    for rep in range(REPS):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for k in order:
            dist.barrier(group=sync)
            time.sleep(0.02)  # the link idles: its token bucket fills, as between steps
            dist.barrier(group=sync)
            e0 = egress()
            t0 = time.perf_counter()
            inner = 20 if k.startswith("tiny") else 1
            for _ in range(inner):
                ops[k]()
            t1 = time.perf_counter()
            e1 = egress()
            times[k].append((t1 - t0) / inner)
            wire[k].append((e1 - e0) / inner)
    if spin is not None:
        spin.kill()
        spin.wait()
    # gather rank 1's into rank 0's print
    mine = {k: (statistics.median(times[k]), min(times[k]), statistics.median(wire[k])) for k in names}
    allr = [None] * w
    dist.all_gather_object(allr, mine, group=sync)
    if me == 0:
        print(f"{'op':24s} {'r0 med ms':>9s} {'r0 min':>7s} {'r1 med ms':>9s} {'eg0 B':>10s} {'eg1 B':>10s}  payload MB/s (r0 med)")
        for k in names:
            t0m, t0min, e0 = allr[0][k]
            t1m, _, e1 = allr[1][k]
            n = int(k.split()[-1]) if k.split()[-1].isdigit() else 0
            rate = n / t0m / 1e6 if n else 0
            print(f"{k:24s} {t0m*1e3:9.3f} {t0min*1e3:7.3f} {t1m*1e3:9.3f} {e0:10.0f} {e1:10.0f}  {rate:8.2f}")
        print(subprocess.run(["ss", "-tin"], capture_output=True, text=True).stdout[-6000:])
        print(subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout)
    dist.barrier(group=sync)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
