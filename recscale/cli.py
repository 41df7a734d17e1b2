"""Command line: parse arguments, call one function of a layer, print the result."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from recscale import __version__

MAX_RANKS = 1 << 20  # a bound on the ranks one plan is searched for (the search's lists grow with them)


def _train(args: argparse.Namespace) -> int:
    from recscale.atomic import check_output_dir, check_output_file
    from recscale.train.config import ConfigError, load_config
    from recscale.train.loop import train
    from recscale.train.summary import format_summary, write_json_atomic
    from recscale.train.replay import load_replay

    if args.summary_json:  # before any work: a bad path must not cost the run's summary
        check_output_file(args.summary_json, "--summary-json")
    replay = None
    if args.replay:
        given = [flag for flag, v in (("--config", args.config), ("--set", args.set), ("--resume", args.resume),
                                      ("--plan", args.plan)) if v]
        if given:
            raise ConfigError(f"--replay reruns the recorded config and plan as they were; drop {', '.join(given)}")
        replay = load_replay(args.replay)  # every rank reads the file
        cfg = replay.config
    else:
        overrides = list(args.set) + ([f"checkpoint.resume={_toml_str(args.resume)}"] if args.resume else [])
        if args.plan:  # --plan FILE is --set sharding.plan="FILE"
            overrides.append(f"sharding.plan={_toml_str(args.plan)}")
        cfg = load_config(args.config, overrides)
    if cfg.checkpoint.dir:
        check_output_dir(cfg.checkpoint.dir, "config key 'checkpoint.dir':")
    summary = train(cfg, replay=replay)
    if summary.get("rank", 0) != 0:
        return 0  # rank 0 reports for the whole job
    print(format_summary(summary))
    if args.summary_json:
        write_json_atomic(args.summary_json, summary)
        print(f"summary written to {args.summary_json}")
    return 0


def _toml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _ckpt(args: argparse.Namespace) -> int:
    from recscale.checkpoint import tools

    if args.ckpt_command == "list":
        runs = tools.list_root(args.dir)
        if not runs:
            print(f"no checkpoints under {args.dir}")
        for run in runs:
            print(_run_line(run))
            for r in run.checkpoints:
                if r.error:
                    print(f"  {r.name}  DAMAGED: {r.error}")
                    continue
                mark = "  <- latest" if r.latest else "  [stale branch]" if r.stale else ""
                print(f"  {r.name}  step {r.step:>10,}  {r.kind:12s}  {r.bytes:>14,} bytes  "
                      f"restore: {' + '.join(r.chain)}{mark}")
    elif args.ckpt_command == "inspect":
        print(json.dumps(tools.inspect(args.dir), indent=1, sort_keys=True))
    elif args.ckpt_command == "verify":
        lines = tools.verify(args.dir)
        for line in lines:
            print(line)
        stale = any(line.startswith("stale branch") for line in lines)
        print("verified: the checkpoint and its chain are intact" + (", but it is on a stale branch" if stale else ""))
    else:
        from recscale.atomic import check_output_file

        check_output_file(args.out, "--out")
        out, n = tools.export(args.dir, args.out)
        print(f"exported {n} tensors (full precision) to {out}")
    return 0


def _run_line(run) -> str:
    import time

    if not run.run:
        return "(flat layout, written before run folders)"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.started_unix))
    p = run.parent
    if not p:
        origin = "a fresh start"
    else:
        how = "continues it" if p.get("newest") else "a branch from an older checkpoint"
        origin = f"resumed from {p.get('run') or p.get('path')} {p.get('name')} ({how})"
    return f"run {run.run}  started {started}, {origin}"


def _plan(args: argparse.Namespace) -> int:
    from recscale.planner.hardware import resolve_hardware
    from recscale.planner.report import rank_table, write_html_report
    from recscale.atomic import check_output_file, write_text_atomic
    from recscale.planner.search import BASELINES, REPLICA_ERROR, SEARCH_STEPS, TIME_LIMIT_S, baseline_plan, plan_tables
    from recscale.sharding.plan import PlanError
    from recscale.train.config import ConfigError, load_config
    from recscale.train.planning import table_specs, workload

    from recscale.train.config import short

    for flag, value, low, high in (("--world-size", args.world_size, 1, MAX_RANKS),
                                   ("--ranks-per-host", args.ranks_per_host, 1, MAX_RANKS),
                                   ("--time-budget", args.time_budget, 0, float("inf")),
                                   ("--replica-error", args.replica_error, 0, float("inf"))):
        if value is not None and not (low <= value < high):
            bound = "finite" if high == float("inf") else f"< {high:,}"
            raise ConfigError(f"{flag}: expected a number >= {low} and {bound}, got {short(value)}")
    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path:
            check_output_file(path, flag)
    data = ["data.source=\"prepared\"", f"data.train_path={_toml_str(args.data)}"] if args.data else []
    cfg = load_config(args.config, data + list(args.set))
    try:
        hw = resolve_hardware(args.topology, args.world_size, args.ranks_per_host)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tables, batch_workload = table_specs(cfg), workload(cfg)
    steps = SEARCH_STEPS if args.search_steps is None else args.search_steps
    limit = TIME_LIMIT_S if args.time_budget is None else args.time_budget
    if steps < 0 or not limit > 0:
        raise ConfigError(f"--search-steps must be >= 0 (got {steps}) and --time-budget > 0 seconds (got {limit:g})")
    result = plan_tables(tables, hw, batch_workload, search_steps=steps, time_limit_s=limit,
                         replica_error=REPLICA_ERROR if args.replica_error is None else args.replica_error)
    print(f"{len(tables)} tables on {hw.world_size} ranks ({hw.ranks_per_host} per host) of '{hw.name}', global batch {batch_workload.batch_size}")
    print(rank_table(result))
    if result.note:
        print(f"note: {result.note}")
    print(f"search: {result.search_steps:,} of {steps:,} steps")
    if not result.reproducible:
        print(f"warning: the {limit:g} s time limit stopped the search before its step budget: this plan "
              "is not reproducible (another run may differ); raise --time-budget or lower --search-steps")
    lines = []
    for method in BASELINES:
        try:
            b = baseline_plan(method, tables, hw, batch_workload)
            lines.append(f"  {method:28s} {b.max_rank_s * 1e3:10.3f} ms  ({100 * (1 - result.max_rank_s / b.max_rank_s):+.1f}% by recscale)")
        except PlanError as e:
            lines.append(f"  {method:28s} does not fit ({str(e)[:80]})")
    print("baselines (table-wise; predicted slowest rank):\n" + "\n".join(lines))
    if cfg.tiers.enabled():
        from recscale.train.tier_plan import config_tables, plan_tiers, table_access

        from recscale.train.datasets import build_data

        tier_data = None if cfg.data.source == "synthetic" else build_data(cfg)
        tier_tables, optimizer = config_tables(cfg, tier_data)
        tier_plan = plan_tiers(cfg.tiers, tier_tables, optimizer,
                               table_access(cfg, tier_tables, tier_data) if cfg.tiers.ram_budget_mb else None)
        print(f"tiers (one process; RAM budget {cfg.tiers.ram_budget_mb} MiB):\n{tier_plan.table_text()}")
    if args.out:
        # The plan, and under "planner" how it was searched (deterministic: the same inputs
        # write the same bytes unless the time limit cut the search, which it then says).
        write_text_atomic(args.out, json.dumps({**result.plan.to_dict(), "planner": result.search_record()},
                                               indent=1, sort_keys=True) + "\n")
        print(f"plan written to {args.out}")
    if args.report:
        write_html_report(args.report, result, extra="<pre>" + "\n".join(lines) + "</pre>")
        print(f"report written to {args.report}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from recscale.planner.calibrate import fit_hardware, measure

    from recscale.planner.calibration_record import (load_measurements, measurements_path, pool_measurements,
                                                     save_measurements)
    from recscale.planner.hardware import cached_calibration

    from recscale.atomic import check_output_file
    from recscale.train.config import ConfigError

    progress = print if args.verbose else None
    if args.refit:
        try:
            m = pool_measurements([load_measurements(p) for p in args.refit])
        except ValueError as e:
            raise ConfigError(f"--refit: {e}") from None
        if args.ranks is not None and args.ranks != m.world_size:
            raise ConfigError(f"--ranks {args.ranks}: the recordings are of {m.world_size} rank(s); leave --ranks out "
                              "with --refit")
        out = args.out or str(cached_calibration(m.world_size, quick=m.quick))
        check_output_file(out, "--out")
        rounds = max((len(v) for v in m.compute.values()), default=0)
        print(f"fitting {len(args.refit)} recording(s) of {m.world_size} rank(s), no measuring "
              f"(up to {rounds} round(s) a probe, each probe's median)")
    else:
        ranks = 2 if args.ranks is None else args.ranks
        if ranks < 1:
            raise ConfigError(f"--ranks: expected an integer >= 1, got {ranks}")
        out = args.out or str(cached_calibration(ranks, quick=args.quick))
        check_output_file(out, "--out")
        m = measure(ranks, progress, args.quick)
    hw = fit_hardware(m, progress=progress)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    hw.save(out)
    record = measurements_path(out)
    save_measurements(m, record)
    print(
        f"this machine, {hw.world_size} local rank(s): row gathers {hw.memory_bw / 1e9:.1f} GB/s, "
        f"backward + update {hw.backward_factor:.2f} x forward, kernel overhead {hw.kernel_overhead_s * 1e6:.0f} us, "
        f"per operator group {hw.group_s * 1e6:.0f} us, "
        f"all-to-all {hw.intra_host_bw / 1e9:.2f} GB/s per rank, latency {hw.latency_s * 1e6:.0f} us "
        f"(replica groups' {hw.replica_collective_latency_s * 1e6:.0f} us), "
        f"memory {hw.memory_bytes / 1e9:.1f} GB per rank"
    )
    print(f"per id {hw.id_s * 1e9:.1f} ns, per unique row {hw.row_s * 1e9:.1f} ns "
          f"(+{hw.cold_byte_s * 1e12:.1f} ns per kB twice beyond {hw.cache_bytes / 2**20:.0f} MiB of cache), per bag {hw.bag_s * 1e9:.1f} ns, "
          f"per bucketized id {hw.route_id_s * 1e9:.1f} ns and row-split table {hw.route_table_s * 1e6:.0f} us, per column-statistic id {hw.column_stat_id_s * 1e9:.1f} ns "
          f"and shard {hw.column_stat_shard_s * 1e6:.0f} us, "
          f"per distributed id {hw.dist_id_s * 1e9:.1f} ns, per distributed value {hw.dist_value_s * 1e9:.2f} ns, "
          f"per step {hw.step_overhead_s * 1e6:.0f} us")
    if hw.tcp_latency_s is not None:
        tcp = hw.over_tcp()
        print(f"over TCP (ranks on different hosts): latency {tcp.latency_s * 1e6:.0f} us "
              f"(replica groups' {tcp.replica_collective_latency_s * 1e6:.0f} us)"
              + (f", {hw.tcp_call_s * 1e6:.0f} us of its rank's CPU" if hw.tcp_call_s is not None else ""))
    if hw.world_size > 1:
        print(f"cores' jitter {hw.sync_jitter:.2f}: collectives are fitted net of the ranks' wait for the slowest "
              "(the simulator adds it to their compute)")
    print(f"written to {out} (use it with: recscale plan --topology {out}; the trainer's planner uses the cached file "
          f"by default); what was measured: {record} (fit it again: recscale calibrate --refit {record})")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    import time
    import warnings

    from recscale import native_build
    from recscale.checkpoint.native import quantize_kernels
    from recscale.embedding import native
    from recscale.model.native import interaction_kernels

    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said below, once
        embedding, interaction, quantizer = native.load(), interaction_kernels(), quantize_kernels()
    print(f"native kernels in {native_build.cache_root()}: embedding {'ready' if embedding else 'unavailable'}, "
          f"dot interaction {'ready' if interaction else 'unavailable'}, checkpoint quantizer "
          f"{'ready' if quantizer else 'unavailable'} ({time.monotonic() - t0:.0f} s)")
    if embedding is None:
        print(f"recscale: the pure-PyTorch kernels will run (same results, slower): {native.failure()}", file=sys.stderr)
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from recscale.data.prepare import PrepareOptions, build_schema, prepare, resolve_inputs
    from recscale.data.prepared import PreparedDataset
    from recscale.data.schema import SchemaError, load_schema
    from recscale.train.config import short

    if not 0 < args.block_mb <= 1 << 16:
        raise SchemaError(f"--block-mb: expected a number of megabytes > 0 and <= 65536, got {short(args.block_mb)}")
    if args.workers < 0 or args.row_group_rows <= 0:
        raise SchemaError(f"--workers must be >= 0 (got {short(args.workers)}) and --row-group-rows > 0 "
                          f"(got {short(args.row_group_rows)})")
    if args.vocab_from:
        if args.table_rows or args.vocab_min_count:
            raise SchemaError("--vocab-from: the table sizes and vocabularies come from that directory; "
                              "drop --table-rows and --vocab-min-count")
        # The column layout from --schema when given, else as the earlier directory read its input.
        schema = load_schema(args.schema) if args.schema else PreparedDataset.open(args.vocab_from).schema
    else:
        schema = build_schema(args.format, args.schema, args.table_rows, args.vocab_min_count)
    opts = PrepareOptions(
        inputs=resolve_inputs(args.input),
        fmt=args.format,
        schema=schema,
        out=args.out,
        workers=args.workers,
        block_bytes=int(args.block_mb * (1 << 20)),
        row_group_rows=args.row_group_rows,
        skip_bad_rows=args.skip_bad_rows,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        compression=args.compression,
        vocab_from=args.vocab_from or "",
    )
    r = prepare(opts)
    print(
        f"prepared {r.rows:,} rows from {len(opts.inputs)} file(s) ({r.input_bytes / 1e6:,.1f} MB) into {r.shards} shards "
        f"in {r.out} in {r.seconds:.1f} s: {r.rows_per_s:,.0f} rows/s, {r.input_bytes / 1e6 / max(r.seconds, 1e-9):,.1f} MB/s"
    )
    if r.skipped_rows:
        print(f"skipped {r.skipped_rows:,} bad rows, e.g.:\n  " + "\n  ".join(r.skipped_examples))
    print(f"table rows per feature: {list(r.table_rows.values())}")
    if r.oov:
        print("values outside the vocabulary (out-of-vocabulary id 1): "
              + ", ".join(f"{n} {k:,} lookups ({100 * share:.1f}%)" for n, (k, share) in r.oov.items()))
    print(f"statistics: {r.out}/stats.json; train with --set data.source=prepared --set data.train_path={r.out}")
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
    p.add_argument(
        "--resume", metavar="DIR|latest",
        help="continue from a checkpoint directory, or the newest one under checkpoint.dir (= checkpoint.resume)",
    )
    p.add_argument("--plan", metavar="PLAN_JSON", help="shard tables as this plan says (from `recscale plan --out`) "
                   "instead of planning them (same as --set sharding.plan=...)")
    p.add_argument("--replay", metavar="SUMMARY_JSON",
                   help="rerun the run a --summary-json file records: its config, and on several ranks its plan and "
                        "the hardware description it was planned on (no new planning); same world size")
    p.set_defaults(func=_train)

    k = sub.add_parser("ckpt", help="list, inspect, verify or export checkpoints")
    ks = k.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (
        ("list", "the checkpoints under a checkpoint root directory"),
        ("inspect", "one checkpoint's manifest: kind, chain, codecs, files, rows and bytes per table"),
        ("verify", "check a checkpoint and its chain: manifests, sizes, sha256 of every file, every chunk"),
        ("export", "write a plain full-precision state dict (.safetensors when installed, else torch.save)"),
    ):
        kp = ks.add_parser(name, help=text)
        kp.add_argument("dir", help="checkpoint root" if name == "list" else "a checkpoint directory (or a root: its newest)")
        if name == "export":
            kp.add_argument("--out", required=True, metavar="FILE", help="output file (.safetensors or .pt)")
    k.set_defaults(func=_ckpt)

    q = sub.add_parser("plan", help="plan how a config's tables are sharded over ranks, with a cost model")
    q.add_argument("--config", help="TOML training config (its tables, batch and wire precisions)")
    q.add_argument("--data", metavar="DIR", help="plan for a prepared directory (`recscale data prepare`): its tables "
                   "and each feature's pooling and skew from its stats.json (= --set data.source=prepared "
                   "--set data.train_path=DIR)")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    q.add_argument("--world-size", type=int, help="ranks to plan for (default: the topology's)")
    q.add_argument("--ranks-per-host", type=int, help="ranks per host (default: the topology's)")
    q.add_argument("--topology", default="zionex", help="preset (zionex, torchrec-defaults, local-cpu) or a calibrated JSON file")
    q.add_argument("--search-steps", type=int, default=None,
                   help="re-placements the local search may try (default 10,000); the plan depends on the inputs "
                        "and this budget only")
    q.add_argument("--time-budget", type=float, default=None,
                   help="safety stop in seconds (default 60); a search it cuts short is reported as not reproducible")
    q.add_argument("--replica-error", type=float, default=None,
                   help="replicate tables only where the plan stays faster with the replicas costing this fraction "
                        "more than predicted (default 0.2; 0: trust the prediction)")
    q.add_argument("--out", metavar="PLAN_JSON", help="write the plan (readable by `recscale train --set sharding.plan=...`)")
    q.add_argument("--report", metavar="HTML", help="write an HTML report with a per-rank load chart")
    q.set_defaults(func=_plan)

    c = sub.add_parser("calibrate", help="measure this machine (lookups, updates, collectives) for the planner")
    c.add_argument("--ranks", type=int, default=None, help="local ranks to measure collectives between (default 2)")
    c.add_argument("--out", help="hardware JSON to write (default: this machine's cached calibration, "
                   "~/.cache/recscale/topology-local-RANKS.json, which the trainer's planner reads)")
    c.add_argument("--verbose", action="store_true", help="print every probe as it is measured")
    c.add_argument("--quick", action="store_true", help="fewer, smaller probes (seconds; rougher constants; the "
                   "trainer's planner makes this one on first use, cached as topology-local-RANKS-quick.json)")
    c.add_argument("--refit", nargs="+", metavar="MEASUREMENTS_JSON",
                   help="measure nothing: fit the recordings that calibrations wrote beside their hardware files "
                        "(*.measurements.json); several of one kind are pooled, each probe's median over all their rounds")
    c.set_defaults(func=_calibrate)

    kb = sub.add_parser("kernels", help="compile the native CPU kernels now (make setup does), not on first use")
    kbs = kb.add_subparsers(dest="kernels_command", required=True)
    kbs.add_parser("build", help="compile (or load from the cache) the embedding, interaction and quantizer kernels")
    kb.set_defaults(func=_kernels)

    data = sub.add_parser("data", help="prepare click logs into sharded Parquet for fast, resumable reading")
    dsub = data.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="stream raw logs (TSV/CSV/Parquet, plain or gzip) into Parquet shards + stats")
    d.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_GLOB", help="input files (quote globs)")
    d.add_argument("--format", required=True, choices=["criteo-tsv", "csv", "parquet"])
    d.add_argument("--schema", help="schema file (JSON or TOML): label, dense and sparse columns (required for csv/parquet)")
    d.add_argument("--out", required=True, help="output directory (shards, stats.json, manifest.json)")
    d.add_argument("--table-rows", type=lambda t: [int(x) for x in t.split(",")], metavar="N[,N...]",
                   help="hash categorical values into tables of N rows (one value, or 26 for criteo-tsv)")
    d.add_argument("--vocab-min-count", type=int, metavar="K",
                   help="instead of hashing: a vocabulary of the values seen at least K times (MLPerf-style)")
    d.add_argument("--vocab-from", metavar="DIR",
                   help="encode like this earlier prepared directory (its vocabularies and hashing settings; "
                        "unseen values get the out-of-vocabulary id): prepare eval data with the training data's")
    d.add_argument("--workers", type=int, default=2, help="worker processes (0: in this process)")
    d.add_argument("--block-mb", type=float, default=32, help="input read per block (one shard per block; memory grows with it)")
    d.add_argument("--row-group-rows", type=int, default=32768, help="rows per Parquet row group (the unit ranks split)")
    d.add_argument("--compression", default="zstd", choices=["zstd", "snappy", "lz4", "none"])
    d.add_argument("--skip-bad-rows", action="store_true", help="count, report and skip malformed rows instead of stopping")
    d.add_argument("--overwrite", action="store_true", help="replace an existing prepared directory")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_data_prepare)

    from recscale.cluster.command import add_parser as add_cluster_parser

    add_cluster_parser(sub)
    from recscale.sim.command import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    from recscale.sim.explore_command import add_parser as add_explore_parser

    add_explore_parser(sub)
    return parser


def _prefer_passive_openmp_for_train(argv: Sequence[str] | None) -> None:
    """``train``: let idle OpenMP threads sleep, decided before anything loads torch (building
    the parser does) and its OpenMP runtime reads the policy. ``calibrate`` too: it times the
    operators training runs, so under training's policy (spinning threads on a busy machine's
    shared cores price every operator group several times dearer than training pays)."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "calibrate":
        from recscale.train.process_tuning import prefer_passive_openmp

        prefer_passive_openmp()
        return
    if not words or words[0] != "train":
        return
    from recscale.train.process_tuning import prefer_passive_openmp, tuning_requested

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--set", action="append", default=[])
    known, _ = pre.parse_known_args(words[1:])
    if tuning_requested(known.config, known.set):
        prefer_passive_openmp()


def main(argv: Sequence[str] | None = None) -> int:
    _prefer_passive_openmp_for_train(argv)
    args = build_parser().parse_args(argv)
    from recscale.atomic import OutputPathError
    from recscale.checkpoint.manifest import CheckpointError
    from recscale.comm.process_group import DistributedError
    from recscale.data.errors import DataFormatError
    from recscale.data.schema import SchemaError
    from recscale.data.sharded_reader import ReaderStateError
    from recscale.embedding.tier_file import TierError
    from recscale.faults import FaultSpecError
    from recscale.sharding.plan import PlanError
    from recscale.sparse import SparseInputError
    from recscale.train.config import ConfigError
    from recscale.train.guards import NonFiniteError

    try:
        return args.func(args)
    except (
        ConfigError, DataFormatError, SparseInputError, PlanError, FileNotFoundError, SchemaError, ReaderStateError,
        FileExistsError, CheckpointError, OutputPathError, TierError, FaultSpecError,
    ) as e:
        error_line(f"recscale: error: {e}")
        return 2
    except (DistributedError, NonFiniteError) as e:
        error_line(f"recscale: error: {e}")
        return 1
    except KeyboardInterrupt:
        print("recscale: interrupted", file=sys.stderr)
        return 130


def error_line(text: str) -> None:
    """One line on stderr in one write: the ranks of a job share the stream, and a line written
    in two pieces (text, then newline) can interleave with another rank's."""
    sys.stderr.write(text.replace("\n", " ") + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
