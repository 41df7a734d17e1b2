"""Command line: parse arguments, call one function of a layer, print the result."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from recscale import __version__


def _train(args: argparse.Namespace) -> int:
    from recscale.train.config import load_config
    from recscale.train.loop import format_summary, train, write_json_atomic

    cfg = load_config(args.config, args.set)
    summary = train(cfg)
    if summary.get("rank", 0) != 0:
        return 0  # rank 0 reports for the whole job
    print(format_summary(summary))
    if args.summary_json:
        write_json_atomic(args.summary_json, summary)
        print(f"summary written to {args.summary_json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recscale", description="Train large recommendation models (DLRM).")
    parser.add_argument("--version", action="version", version=f"recscale {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train and evaluate a DLRM from a TOML config")
    p.add_argument("--config", help="TOML config file (defaults apply to missing keys)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), e.g. --set train.batch_size=512",
    )
    p.add_argument("--summary-json", metavar="PATH", help="write the final summary as JSON")
    p.set_defaults(func=_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from recscale.comm.process_group import DistributedError
    from recscale.data.errors import DataFormatError
    from recscale.sharding.plan import PlanError
    from recscale.sparse import SparseInputError
    from recscale.train.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataFormatError, SparseInputError, PlanError, FileNotFoundError) as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 2
    except DistributedError as e:
        print(f"recscale: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("recscale: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
