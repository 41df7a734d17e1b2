"""``recscale explore``: arguments and the one call."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    s = sub.add_parser("explore", help="search placement, sharding plan, wire precision and pipelining on a tiered "
                                       "cluster, scored by the simulator")
    s.add_argument("--config", required=True, help="TOML training config (tables, MLPs, global batch)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    s.add_argument("--topology", default="two-buildings",
                   help="preset (two-buildings, zionex) or a tiers file (JSON/TOML; see docs/explorer.md)")
    s.add_argument("--time-budget", type=float, default=120.0, metavar="S", help="seconds for the whole search")
    s.add_argument("--top", type=int, default=24, help="candidates to run through the full simulation beyond the "
                   "best four of each placement (the time budget may stop it sooner)")
    s.add_argument("--max-auc-loss", type=float, default=0.002,
                   help="leave out wire precisions whose measured eval AUC loss exceeds this")
    s.add_argument("--use-all-ranks", action="store_true",
                   help="search only placements on every rank of the cluster (a fixed world size; by default "
                        "fewer buildings or ranks per host are candidates too)")
    s.add_argument("--out", metavar="JSON", help="write ranked candidates and baselines")
    s.add_argument("--plans-dir", metavar="DIR",
                   help="write each candidate's plan JSON here; --out then gives each its train arguments and, "
                        "where the cluster can be emulated, its `recscale cluster` command")
    s.add_argument("--report", metavar="HTML", help="write an HTML page comparing the top candidates with the baselines")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from recscale.sim.explore import explore
    from recscale.sim.explore_report import RunSpec, summary, to_dict, write_html
    from recscale.sim.report import write_json
    from recscale.sim.tiers import load_cluster
    from recscale.sim.topology import TopologyError
    from recscale.train.config import ConfigError, load_config

    if args.time_budget <= 0:
        raise ConfigError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    if args.plans_dir and not args.out:
        raise ConfigError("--plans-dir needs --out (the JSON that names each candidate's plan file and command)")
    cfg = load_config(args.config, args.set)
    try:
        cluster = load_cluster(args.topology)
    except TopologyError as e:
        raise ConfigError(str(e)) from None
    e = explore(cfg, cluster, args.time_budget, args.top, args.max_auc_loss, args.use_all_ranks)
    print(summary(e))
    if args.out:
        write_json(args.out, to_dict(e, RunSpec(args.config, tuple(args.set), args.plans_dir)))
        print(f"written to {args.out}")
    if args.report:
        write_html(args.report, e)
        print(f"report written to {args.report}")
    return 0
