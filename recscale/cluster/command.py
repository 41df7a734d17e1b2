"""``recscale cluster``: its arguments and what it prints (registered by ``recscale.cli``)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster",
        help="run a job on N emulated hosts (network namespaces over tc-shaped links; needs root)",
        description="Run `recscale train ...` (or a script.py) as a torchrun job of R ranks on each of N emulated "
                    "hosts: network namespaces joined through a switch, each host's link shaped to the given "
                    "bandwidth in both directions. Everything it creates is removed when the job ends.",
    )
    p.add_argument("--hosts", type=int, required=True, help="emulated hosts (network namespaces)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun ranks in each host")
    p.add_argument("--bandwidth-mbit", type=float, required=True, help="each host's link rate, Mbit/s, each way")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="one-way delay between two hosts, ms (needs the kernel's netem qdisc)")
    p.add_argument("--groups", type=int, default=1,
                   help="2: split the hosts evenly into two groups, each behind its own switch, the switches "
                        "joined by one link (--cross-bandwidth-mbit) that all traffic between the groups shares")
    p.add_argument("--cross-bandwidth-mbit", type=float, default=None,
                   help="with --groups 2: the rate of the link between the groups, Mbit/s, each way")
    p.add_argument("--cross-latency-ms", type=float, default=0.0,
                   help="with --groups 2: one-way delay of the link between the groups, ms (needs netem)")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- train --config X.toml ...",
                   help="the job: recscale arguments (train ...) or a script.py and its arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recscale.cluster.launch import ClusterSpec, run_cluster
    from recscale.cluster.network import ClusterError, LinkShape

    try:
        if args.cross_bandwidth_mbit is None and args.cross_latency_ms:
            raise ClusterError("--cross-latency-ms needs --groups 2 and --cross-bandwidth-mbit")
        cross = None
        if args.cross_bandwidth_mbit is not None:
            if not args.cross_bandwidth_mbit > 0:
                raise ClusterError(f"--cross-bandwidth-mbit must be positive, got {args.cross_bandwidth_mbit}")
            cross = LinkShape(args.cross_bandwidth_mbit, args.cross_latency_ms)
        spec = ClusterSpec(args.hosts, args.ranks_per_host, LinkShape(args.bandwidth_mbit, args.latency_ms),
                           args.groups, cross)
        result = run_cluster(spec, args.job, log=lambda line: print(line, flush=True))
    except ClusterError as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 2
    return result.exit_status
