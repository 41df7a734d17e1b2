"""``recscale simulate``: arguments and the one call."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="predict a training step on a cluster (event simulation of every rank)")
    s.add_argument("--config", help="TOML training config (tables, MLPs, batch, precisions, pipeline)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    s.add_argument("--topology", default="zionex",
                   help="preset (zionex, local-cpu, torchrec-defaults), this-machine (recscale calibrate's cache), a "
                        "calibrated hardware JSON, or a topology "
                        "file (TOML/JSON: hosts, ranks_per_host, cross_host_mbit, ...; see docs/simulator.md)")
    s.add_argument("--hosts", type=int, help="hosts (default: the topology's)")
    s.add_argument("--ranks-per-host", type=int, help="ranks per host (default: the topology's)")
    s.add_argument("--plan", metavar="PLAN_JSON", help="simulate this plan (default: the one training would use)")
    s.add_argument("--json", metavar="OUT", help="write step_time_s, samples_per_s, breakdown, critical path, memory")
    s.add_argument("--trace", metavar="TRACE_JSON", help="write a Chrome/Perfetto trace of one simulated step")
    s.add_argument("--measure-compute", action="store_true",
                   help="first measure this machine's dense compute rate (one thread) and cache it for local-cpu "
                        "and calibrated topologies (seconds)")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recscale.sharding.plan import ShardingPlan
    from recscale.sim.api import simulate
    from recscale.sim.report import summary, to_dict, trace, write_json
    from recscale.sim.topology import TopologyError, load_topology
    from recscale.train.config import ConfigError, load_config

    for flag, v in (("--hosts", args.hosts), ("--ranks-per-host", args.ranks_per_host)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    cfg = load_config(args.config, args.set)
    if args.measure_compute:
        from recscale.sim.calibrate import measure_compute, save_compute

        c = measure_compute()
        path = save_compute(c)
        print(f"dense compute on this machine: {c.flops_per_s / 1e9:.1f} GFLOP/s per thread, "
              f"{c.op_overhead_s * 1e6:.0f} us per operator, training loop {c.loop_s * 1e3:.2f} ms per step, "
              f"ranks' meetings {c.shm_loop_s * 1e3:.2f} ms per step through shared memory and "
              f"{c.tcp_loop_s * 1e3:.2f} ms over TCP (cached in {path})")
    try:
        topo = load_topology(args.topology, args.hosts, args.ranks_per_host)
    except TopologyError as e:
        raise ConfigError(str(e)) from None
    plan = ShardingPlan.load(args.plan) if args.plan else None
    res = simulate(cfg, topo, plan)
    print(summary(res, topo))
    if args.json:
        write_json(args.json, to_dict(res, topo))
        print(f"written to {args.json}")
    if args.trace:
        write_json(args.trace, trace(res))
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
