"""Benchmark: tables on the SSD tier (a RAM cache over a file per table) against all in RAM.

Prints, on Zipf-like multi-hot ids:

  * the cache hit rate of ``lru``, ``lfu``, ``lookahead`` and offline Belady (every future
    batch known) at caches of 5, 10, 25 and 50% of the rows, for each Zipf exponent, and the
    planner's predicted ``lru`` and ``lookahead`` hit rates (``recscale.planner.miss_curve``);
  * training throughput (embedding operator, forward + fused backward) with the tier as a
    share of the all-in-RAM run, and ``io_stall_fraction`` with and without prefetch;
  * this disk's random-read rate of one row record at queue depth 1 and 32, and the step time
    that rate sets for the misses of one batch.

    python benchmarks/tiers.py --quick --json out.json     # seconds: small tables
    python benchmarks/tiers.py --ssd-dir /mnt/nvme/tmp      # 8 tables of 4M rows, dim 64
    python benchmarks/tiers.py --rows 500000 --steps 24 --parts train,disk   # a few minutes
    python benchmarks/tiers.py --parts train --steps 200 --warmup 32 --duration-s 300   # bounded

``--parts`` picks among the hit rates (``hits``), the throughput runs (``train``) and the disk
probe (``disk``); the disk part also reads records the way the tier does (a batch of pages
requested at once) and prints the prefetching run's share of the rate the disk bounds.

Hit rates replay each trace through the tier's own cache and eviction code with a stand-in
file that does no I/O (``recscale.embedding.tier_sim``: the same hits as a real tier, which a
test checks), and offline Belady in numpy; they count distinct rows per batch, as
``cache_hit_rate`` does. Batches are held as one int32 array of ids, built per step.

The throughput runs' cache is 25% of each table's rows, or the most that ``--tier-budget-mb``
(default 2048) holds, counting the cache's rows and optimizer state, the tier's bookkeeping (per
slot and per table row, ``recscale.embedding.tiered.tier_ram``) and pool of known blocks of
every table, and what a step's tier work holds besides (``tier_step_ram``: the reads in flight
of every table, the announced rows, one admission, one table's eviction ranks); each part is
printed. The tier runs return freed blocks to the OS (``host_memory.return_freed_memory``), so
what a cgroup counts is what they hold. ``--warmup`` steps fill the cache untimed (at 4M rows a
sixth of the steps is too few for a steady state); ``--duration-s`` ends a run's timing at the
first step past it (the second tier run then times the same batches), and the table says how
many steps each run timed after how many warm-up steps. Every ``--progress-s`` seconds (30) a
run prints its step, samples/s, hit rate, io stall share and RSS; the ``--json`` file is
rewritten (write, then rename) on each such line and as each run ends, so a run stopped early
still leaves its figures (``progress``: the latest line of each run). ``--cgroup-mb N``
(Linux, root) runs the tier runs, and nothing else, in a child process inside a memory cgroup
of N MiB that this script creates and removes (cgroup v1 ``memory.limit_in_bytes``, which
counts the page cache; v2 ``memory.max`` where v2 is mounted); ``--cgroup-mb auto`` sets the
limit to the tier budget + the child's measured baseline (Python, torch, the trace) + 256 MiB
for the rest of the step (the operator's ids, outputs and gradients, page cache of the I/O in
flight). It prints the limit, the baseline, the cgroup's maximum usage and failcnt, and
whether the child finished inside it (a child the OOM killer ends is a FAILED line and exit
code 1). The all-in-RAM run stays outside (it holds every row). The full size, in about 20
minutes:

    python benchmarks/tiers.py --ssd-dir /mnt/nvme/tmp --parts train --cgroup-mb auto \
        --steps 160 --warmup 32 --duration-s 300 --json tiers.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cgroup import CgroupError, MemoryCgroup  # noqa: E402
from _common import environment, format_table, set_threads, write_json, zipf_ids  # noqa: E402

from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig  # noqa: E402
from recscale.embedding.tier_file import RowFile  # noqa: E402
from recscale.embedding.tier_hooks import (  # noqa: E402
    announce_batch, begin_batch, close_tiers, tier_stats, tiered_storages,
)
from recscale.embedding.tier_sim import belady_hit_rate, replay_hit_rate  # noqa: E402
from recscale.embedding.tiered import (  # noqa: E402
    TierRam, TierSettings, TierStepRam, tier_ram, tier_step_ram, tiered_storage_factory,
)
from recscale.host_memory import return_freed_memory  # noqa: E402
from recscale.planner.miss_curve import zipf_access  # noqa: E402
from recscale.sparse import JaggedBatch  # noqa: E402

SHARES = (0.05, 0.10, 0.25, 0.50)
TRAIN_SHARE = 0.25  # the throughput runs' cache: this share of each table, if the budget holds it
POOL_MB = 16.0  # per table: the pool of known block images (``TierSettings.block_pool_bytes``)
PROGRESS_S = 30.0  # seconds between progress lines of a training run
HEADROOM_MB = 256  # --cgroup-mb auto: the step's working memory above the baseline and the tier
_CHILD_TAG = "@@tier-child "


class Trace:
    """Batches of Zipf ids of every table, held compactly: one int32 array ``[steps, tables,
    batch * pooling]`` (ids in [0, rows)) and one shared lengths tensor; ``batch(i)`` builds
    batch ``i`` when it is used, so holding a long trace costs 4 bytes per id, not a
    ``JaggedBatch`` of int64 values and lengths per step."""

    def __init__(self, tables: list[TableConfig], n: int, batch: int, pooling: int, alpha: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        dtype = np.int32 if max(t.num_rows for t in tables) <= 2**31 else np.int64
        self.ids = np.empty((n, len(tables), batch * pooling), dtype=dtype)
        for s in range(n):
            for i, t in enumerate(tables):
                self.ids[s, i] = zipf_ids(t.num_rows, batch * pooling, rng, alpha, salt=i)
        self.keys = tuple(t.features[0] for t in tables)
        self.lengths = torch.full((len(tables) * batch,), pooling, dtype=torch.int64)
        self.batch_size = batch

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, i: int) -> JaggedBatch:
        return JaggedBatch(self.keys, torch.from_numpy(self.ids[i].reshape(-1)).to(torch.int64), self.lengths)

    def distinct(self, i: int, table: int) -> np.ndarray:
        """The distinct rows batch ``i`` looks up in table ``table``, ascending."""
        return np.unique(self.ids[i, table]).astype(np.int64)


def policy_hit_rate(rows: int, uniq: list[torch.Tensor], cache: int, policy: str, lookahead: int) -> float:
    """The tier's own hit rate on one table (its cache and eviction code, no file I/O)."""
    return replay_hit_rate(rows, uniq, cache, policy, lookahead)


def rss_mb() -> tuple[float, float]:
    """(resident, peak resident) MiB of this process, from ``/proc/self/status`` (0 elsewhere)."""
    got = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return got.get("VmRSS", 0.0), got.get("VmHWM", 0.0)


def train_rate(tables, trace: Trace, placement, settings, lookahead: int, warmup: int, duration_s: float = 0.0,
               progress=None, label: str = "", stop: int | None = None) -> dict:
    """Figures of forward + fused backward over ``trace``: samples/s, io_stall_fraction, hit
    rate and missed rows per step over the steps after ``warmup``, blocks a write-back had to
    re-read, how many steps were timed (``duration_s`` > 0: timing stops at the first step
    ending past it, the rest of the trace is not run; ``stop``: only the first ``stop`` steps
    run) and the peak RSS. Every ``PROGRESS_S``
    seconds ``progress`` (if given) gets the figures so far, so a run stopped early still says
    what it measured."""
    fac = tiered_storage_factory(placement, settings, seed=0) if placement else None
    t_start = time.perf_counter()
    m = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.01), storage_factory=fac)
    build_s = time.perf_counter() - t_start
    warmup = min(warmup, len(trace) - 1)
    zero = (0.0, 0, 0)  # stall seconds, lookups, hits

    def counters() -> tuple[float, int, int]:
        st = tier_stats(m)
        return (st.stall_seconds, st.lookups, st.hits) if st else zero

    def figures(steps: int, seconds: float, since: tuple[float, int, int], done: int) -> dict:
        stall, lookups, hits = (a - b for a, b in zip(counters(), since))
        rss, peak = rss_mb()
        return {"step": done, "steps": len(trace), "timed": i >= warmup,
                "samples_per_s": steps * trace.batch_size / max(seconds, 1e-9), "io_stall_fraction": stall / max(seconds, 1e-9), "hit_rate": hits / lookups if lookups else None,
                "missed_rows_per_step": (lookups - hits) / max(steps, 1), "rss_mb": rss, "peak_rss_mb": peak}

    start, t0, ahead, timed = zero, time.perf_counter(), 0, 0
    shown_at, shown_step, shown = t0, 0, zero
    for i in range(len(trace) if stop is None else min(stop, len(trace))):
        if i == warmup:
            start, t0 = counters(), time.perf_counter()
        while placement and ahead < min(len(trace), i + 1 + lookahead):
            announce_batch(m, trace.batch(ahead))
            ahead += 1
        if placement:
            begin_batch(m)
        m(trace.batch(i)).sum().backward()
        now = time.perf_counter()
        timed = i + 1 - warmup if i >= warmup else 0
        if progress is not None and now - shown_at >= PROGRESS_S:
            # the figures of the steps since the last line (hit rate, stall, rate), the RSS now
            line = figures(i + 1 - shown_step, now - shown_at, shown, i + 1)
            line.update(run=label, elapsed_s=now - t_start, interval_s=now - shown_at)
            if timed:
                line["timed_samples_per_s"] = timed * trace.batch_size / (now - t0)
            progress(line)
            shown_at, shown_step, shown = now, i + 1, counters()
        if duration_s and timed and now - t0 >= duration_s:
            break
    seconds = time.perf_counter() - t0
    out = figures(timed, seconds, start, i + 1)
    out.pop("timed")
    out.pop("step")
    out.pop("steps")
    out.update(measured_steps=timed, warmup_steps=warmup, seconds=seconds, build_s=build_s)
    out["write_back_page_rereads"] = sum(seg.file.rereads for _, s in tiered_storages(m) for seg in s.segments)
    if placement:
        close_tiers(m)
    del m
    gc.collect()  # the module holds reference cycles: free its rows before the next run starts
    return out


def tier_ram_bytes(rows: int, cache: int, dim: int, state_cols: int = 1, pool_mb: float = POOL_MB) -> TierRam:
    """RAM one table on the tier holds (fp32 rows, row-wise Adagrad, ``lookahead``): the cache,
    its per-slot and per-row bookkeeping and the pool of known blocks (``tier_ram``)."""
    return tier_ram(rows, cache, 4 * dim + 4 * state_cols, "lookahead", int(pool_mb * 2**20))


def step_ram(tables: int, low: int, dim: int, cache: int, window: int, prefetch: int,
             state_cols: int = 1) -> TierStepRam:
    """RAM a step's tier work holds beyond ``tier_ram``, all tables (``tier_step_ram``): reads
    in flight, the announced window, one admission and one table's eviction ranks; ``low`` a
    batch's most distinct rows of one table."""
    return tier_step_ram(tables, low, 4 * dim + 4 * state_cols, cache, window, prefetch, 8)


def choose_cache(tables: list[TableConfig], low: int, budget_mb: int, reserved: int = 0) -> int:
    """The throughput runs' cache rows per table: ``TRAIN_SHARE`` of the rows, or the most
    the tier budget holds (cache, bookkeeping and block pool of every table, and ``reserved``
    bytes for the step's tier work: reads in flight, announced rows, admission, ranks) if that is less."""
    rows, dim, n = tables[0].num_rows, tables[0].dim, len(tables)
    cache = max(low, int(TRAIN_SHARE * rows))
    budget = (budget_mb << 20) - reserved
    if budget_mb and n * tier_ram_bytes(rows, cache, dim).total > budget:
        slot_bytes = tier_ram_bytes(rows, 1, dim).total - tier_ram_bytes(rows, 0, dim).total
        fit = (budget // n - tier_ram_bytes(rows, 0, dim).total) // slot_bytes
        if fit < low:
            raise SystemExit(f"--tier-budget-mb {budget_mb}: {n} tables of {rows:,} rows leave room for {max(fit, 0):,} cached "
                             f"rows per table, fewer than one batch's {low:,} distinct rows; raise the budget")
        cache = int(fit)
    return cache


def hit_rates(table: TableConfig, sim_steps: int, batch: int, pooling: int, window: int, result: dict) -> None:
    """Hit rates of every policy and offline Belady on one table's trace."""
    hit_rows = []
    cpu0 = time.process_time()
    for alpha in (1.05, 0.8):
        trace = Trace([table], sim_steps, batch, pooling, alpha, seed=2)
        uniq = [trace.distinct(i, 0) for i in range(len(trace))]
        del trace
        rows_t = [torch.from_numpy(u) for u in uniq]
        low = max(u.size for u in uniq)
        curve = zipf_access(table.num_rows, alpha, batch * pooling, scatter=False)  # zipf_ids: a bijection
        for share in SHARES:
            cache = max(low, int(share * table.num_rows))
            row = {"belady": belady_hit_rate(uniq, cache)}
            for policy in ("lru", "lfu", "lookahead"):
                row[policy] = policy_hit_rate(table.num_rows, rows_t, cache, policy, window)
            for policy in ("lru", "lookahead"):  # the planner's miss-ratio curves, same run length
                row[f"predicted_{policy}"] = curve.hit_rate(policy, cache, sim_steps, window)
            result["hit_rate"][f"zipf{alpha}_cache{share:.2f}"] = {"cache_rows": cache, **row}
            print(f"hits: zipf {alpha}, {share:.0%} cache done, {time.process_time() - cpu0:,.0f} s CPU so far",
                  file=sys.stderr, flush=True)
            hit_rows.append([f"{alpha}", f"{share:.0%}", f"{cache:,}"] + [f"{row[k]:.3f}" for k in (
                "lru", "lfu", "lookahead", "belady", "predicted_lru", "predicted_lookahead")])
    print(format_table(["zipf", "cache", "rows", "lru", "lfu", "lookahead", "belady", "pred lru", "pred lookahead"], hit_rows))
    print()


class Recorder:
    """The figures of a run, written to ``--json`` (atomically: write, then rename) each time a
    part or a progress line adds to them, so a run stopped early still leaves what it measured."""

    def __init__(self, result: dict, path: str) -> None:
        self.result, self.path = result, path

    def save(self) -> None:
        if self.path:
            write_json(self.path, self.result)

    def progress(self, line: dict) -> None:
        """A progress line of a training run: printed, and kept as that run's latest."""
        phase = "timed" if line["timed"] else "warm-up"
        rate = line.get("timed_samples_per_s")
        print(f"progress: {line['run']}: step {line['step']}/{line['steps']} ({phase}), {line['elapsed_s']:,.0f} s; "
              f"last {line['interval_s']:.0f} s: {line['samples_per_s']:,.0f} samples/s, hit rate "
              + (f"{line['hit_rate']:.3f}" if line["hit_rate"] is not None else "-")
              + f", io stall {line['io_stall_fraction']:.2f}; " + (f"timed so far {rate:,.0f} samples/s; " if rate else "")
              + f"RSS {line['rss_mb']:,.0f} MiB (peak {line['peak_rss_mb']:,.0f})", flush=True)
        self.result.setdefault("progress", {})[line["run"]] = line
        self.save()

    def run_done(self, name: str, figures: dict) -> None:
        tp = self.result["throughput"]
        if "ram" in tp and name != "ram":
            figures["share_of_ram"] = figures["samples_per_s"] / tp["ram"]["samples_per_s"]
        tp[name] = figures
        print(f"done: {name}: {figures['samples_per_s']:,.0f} samples/s over {figures['measured_steps']} timed steps "
              f"after {figures['warmup_steps']} warm-up steps ({figures['seconds']:,.0f} s timed)", flush=True)
        self.save()


def tier_runs(tables: list[TableConfig], trace: Trace, cache: int, ssd_dir: str, window: int, prefetch: int,
              warmup: int | None = None, duration_s: float = 0.0, progress=None, done=None) -> dict:
    """The two tier throughput runs (with and without prefetch) at ``cache`` rows per table;
    ``done(name, figures)`` gets each as soon as it ends, ``progress`` its progress lines."""
    place = {t.name: ("ssd", cache) for t in tables}
    warm = max(2, len(trace) // 6) if warmup is None else warmup
    out: dict = {}
    stop = None
    for name, k in (("tier, prefetch", prefetch), ("tier, no prefetch", 0)):
        # Freed blocks go back to the OS, and what the run before left free in the heaps too:
        # the resident memory (what a cgroup counts) is then the tier's and the step's, not
        # glibc's retained past peaks (~100-200 MiB at 1M rows).
        return_freed_memory()
        settings = TierSettings(ssd_dir, "lookahead", window, 8, k, int(POOL_MB * 2**20))
        # the second run times the same batches as the first (a --duration-s bound ends the first)
        out[name] = {"prefetch_batches": k, **train_rate(tables, trace, place, settings, window, warm,
                                                         duration_s if stop is None else 0.0, progress, name, stop)}
        stop = warm + out[name]["measured_steps"]
        if done is not None:
            done(name, out[name])
    return out


def _child_main(spec: str) -> None:
    """The tier runs in a child process (placed in the memory cgroup by the parent): make the
    trace, say so and wait for the go (the parent measures the baseline in between), run;
    progress lines and each run's figures go to the parent as they come."""
    global PROGRESS_S
    p = json.loads(spec)
    PROGRESS_S = p["progress_s"]
    set_threads(p["threads"])
    tables = [TableConfig(f"t{i}", p["rows"], p["dim"], (f"f{i}",)) for i in range(p["tables"])]
    trace = Trace(tables, p["steps"], p["batch"], p["pooling"], 1.05, seed=3)
    print(_CHILD_TAG + json.dumps({"ready": True}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return

    def send(key: str):
        return lambda *a: print(_CHILD_TAG + json.dumps({key: a}), flush=True)

    tier_runs(tables, trace, p["cache"], p["ssd_dir"], p["window"], p["prefetch"], p.get("warmup"),
              p.get("duration_s", 0.0), send("progress"), send("run"))
    print(_CHILD_TAG + json.dumps({"finished": True}), flush=True)


def tier_runs_in_cgroup(spec: dict, cgroup_mb: int | None, budget_mb: int, rec: Recorder) -> dict | None:
    """Run ``tier_runs`` in a child inside a fresh memory cgroup of ``cgroup_mb`` MiB (None:
    the tier budget + the child's measured baseline + ``HEADROOM_MB``); print what the cgroup
    saw. None if the child did not finish inside it (the runs it finished are recorded)."""
    args = [sys.executable, str(Path(__file__).resolve()), "--tier-child", json.dumps(spec)]
    runs: dict = {}
    base, finished = 0, False
    with MemoryCgroup("recscale-tiers", cgroup_mb) as cg:
        proc = cg.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if not line.startswith(_CHILD_TAG):
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            got = json.loads(line[len(_CHILD_TAG):])
            if "ready" in got:
                base = cg.current_bytes()
                if cgroup_mb is None:
                    cg.set_limit(budget_mb + -(-base // 2**20) + HEADROOM_MB)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif "progress" in got:
                line_ = got["progress"][0]
                line_["cgroup_usage_mb"] = cg.current_bytes() / 2**20
                rec.progress(line_)
            elif "run" in got:
                name, figures = got["run"]
                runs[name] = figures
                rec.run_done(name, figures)
            finished = finished or "finished" in got
        code = proc.wait()
        usage = cg.usage()
    mib = 2**20
    info = {"limit_mb": usage.limit_bytes // mib, "max_usage_mb": usage.max_usage_bytes / mib, "failcnt": usage.failcnt,
            "oom_kills": usage.oom_kills, "baseline_mb": base / mib, "tier_budget_mb": budget_mb, "exit_code": code,
            "finished_inside": code == 0 and finished}
    rec.result["cgroup"] = info
    rec.save()
    print(f"cgroup: limit {info['limit_mb']:,} MiB = {budget_mb:,} MiB for the tier + {base / mib:,.0f} MiB process baseline "
          f"(Python, torch, the trace) + {info['limit_mb'] - budget_mb - base / mib:,.0f} MiB for the step; "
          f"max usage {info['max_usage_mb']:,.0f} MiB, failcnt {usage.failcnt} (limit reached, page cache reclaimed), "
          f"OOM kills {usage.oom_kills}")
    if info["finished_inside"]:
        print("cgroup: the tier runs finished inside the limit")
        return runs
    why = "killed by the OOM killer" if usage.oom_kills or code == -signal.SIGKILL else f"exit code {code}"
    print(f"FAILED: the tier runs did not finish inside the {info['limit_mb']:,} MiB cgroup ({why}); "
          "raise --cgroup-mb or lower --tier-budget-mb")
    return None


def throughput(tables: list[TableConfig], steps: int, batch: int, pooling: int, ssd_dir: str, window: int, prefetch: int,
               threads: int, budget_mb: int, cgroup: str, rec: Recorder, warmup: int | None = None,
               duration_s: float = 0.0) -> bool:
    """Training throughput at a 25% cache (or the most ``budget_mb`` holds), Zipf 1.05: all in
    RAM, the tier with and without prefetch (``window`` batches announced to eviction either
    way); the tier runs in a memory cgroup if ``cgroup`` ('auto' or MiB) is given. Each run
    times the steps after ``warmup`` (default a sixth of ``steps``), for at most about
    ``duration_s`` seconds if given. False if the tier runs did not finish inside the cgroup."""
    result = rec.result
    trace = Trace(tables, steps, batch, pooling, 1.05, seed=3)
    rows, dim = tables[0].num_rows, tables[0].dim
    low = max(trace.distinct(i, k).size for i in range(len(trace)) for k in range(len(tables)))
    # the step's share is reserved at the largest cache (its eviction ranks grow with the slots)
    step = step_ram(len(tables), low, dim, max(low, int(TRAIN_SHARE * rows)), window, prefetch)
    cache = choose_cache(tables, low, budget_mb, step.total)
    step = step_ram(len(tables), low, dim, cache, window, prefetch)
    ram = tier_ram_bytes(rows, cache, dim)
    mib, n = 2**20, len(tables)
    parts = {"cache_mb": n * ram.cache / mib, "slot_bookkeeping_mb": n * ram.slots / mib,
             "row_bookkeeping_mb": n * ram.rows / mib, "block_pool_mb": n * ram.pool / mib,
             "reads_in_flight_mb": step.reads / mib, "announced_window_mb": step.window / mib,
             "admission_mb": step.admission / mib, "eviction_ranks_mb": step.ranking / mib}
    total = sum(parts.values())
    print(f"tier: {cache:,} cached rows per table ({cache / rows:.1%} of {rows:,}); cache {parts['cache_mb']:,.0f} MiB + "
          f"bookkeeping {parts['slot_bookkeeping_mb']:,.0f} MiB per slot, {parts['row_bookkeeping_mb']:,.0f} MiB per row + "
          f"block pool {parts['block_pool_mb']:,.0f} MiB + the step's reads in flight {step.reads / mib:,.0f} MiB, "
          f"announced rows {step.window / mib:,.0f} MiB, admission {step.admission / mib:,.0f} MiB, eviction ranks "
          f"{step.ranking / mib:,.0f} MiB ({low:,} distinct rows a table and batch at most) = {total:,.0f} MiB "
          f"of the {budget_mb:,} MiB tier budget", flush=True)
    result["throughput_cache"] = {"cache_rows": cache, "share": cache / rows, **parts, "total_mb": total,
                                  "tier_budget_mb": budget_mb}
    warm = max(2, steps // 6) if warmup is None else warmup
    rec.run_done("ram", train_rate(tables, trace, None, None, 0, warm, duration_s, rec.progress, "ram"))
    if cgroup:
        del trace  # the child makes its own (the same seed: the same batches)
        spec = {"threads": threads, "tables": len(tables), "rows": rows, "dim": dim, "steps": steps, "batch": batch,
                "pooling": pooling, "cache": cache, "ssd_dir": ssd_dir, "window": window, "prefetch": prefetch,
                "warmup": warm, "duration_s": duration_s, "progress_s": PROGRESS_S}
        runs = tier_runs_in_cgroup(spec, None if cgroup == "auto" else int(cgroup), budget_mb, rec)
    else:
        runs = tier_runs(tables, trace, cache, ssd_dir, window, prefetch, warm, duration_s, rec.progress, rec.run_done)
    ram_run = result["throughput"]["ram"]
    tp_rows = [["all in RAM", f"{ram_run['samples_per_s']:,.0f}", "1.00", "-", "-", "-",
                f"{ram_run['measured_steps']} ({ram_run['warmup_steps']})"]]
    for name, r in result["throughput"].items():
        if name == "ram":
            continue
        k = r["prefetch_batches"]
        label = f"{name} ({k}, window {window})" if k else name
        tp_rows.append([label, f"{r['samples_per_s']:,.0f}", f"{r['share_of_ram']:.2f}", f"{r['io_stall_fraction']:.3f}",
                        f"{r['hit_rate']:.3f}", f"{r['missed_rows_per_step']:,.0f}", f"{r['measured_steps']} ({r['warmup_steps']})"])
    print(format_table([f"run ({cache / rows:.0%} cache, zipf 1.05)", "samples/s", "share", "io_stall_fraction", "hit rate",
                        "missed rows/step", "timed steps (warm-up)"], tp_rows))
    print()
    return runs is not None


def random_read_rate(path_dir: str, rows: int, dim: int, reads: int, depth: int) -> float:
    """Random single-record reads per second at queue depth ``depth`` (threads)."""
    from recscale.embedding.tier_file import TierFileMeta

    meta = TierFileMeta("probe", rows, 0, dim, "fp32", (("sum_sq", 1),), 0)
    f = RowFile.create(path_dir, meta, lambda s, n: (torch.zeros(n, dim), {"sum_sq": torch.zeros(n, 1)}))
    rng = np.random.default_rng(1)
    picks = rng.integers(0, rows, reads)
    bufs = np.empty((depth, 1, f.record_bytes), dtype=np.uint8)

    def worker(k: int) -> None:
        for r in picks[k::depth]:
            f.read(np.array([r]), bufs[k])
            # Drop the page again, so every read goes to the device, not the page cache.
            os.posix_fadvise(f.fd, int(f.offsets(np.array([r]))[0]), f.record_bytes, os.POSIX_FADV_DONTNEED)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(worker, range(depth)))
    rate = reads / (time.perf_counter() - t0)
    f.close()
    os.unlink(f.path)
    return rate


def disk(ssd_dir: str, rows: int, dim: int, reads: int, result: dict) -> None:
    """This disk's random record reads at queue depth 1 and 32, and the step time they bound."""
    qd1 = random_read_rate(ssd_dir, rows, dim, reads, 1)
    qd32 = random_read_rate(ssd_dir, rows, dim, reads, 32)
    batched = batched_read_rate(ssd_dir, rows, dim, reads)
    best = max(qd32, batched)  # the bound: the fastest way this disk was seen to read
    result["disk"] = {"reads_per_s_qd1": qd1, "reads_per_s_qd32": qd32, "reads_per_s_batched": batched}
    shown = [["random record reads/s, queue depth 1", f"{qd1:,.0f}"], ["random record reads/s, queue depth 32", f"{qd32:,.0f}"],
             ["random record reads/s, batched (pages requested ahead)", f"{batched:,.0f}"]]
    tier = result["throughput"].get("tier, prefetch")
    if tier:  # the misses the prefetching run measured bound its step time at this read rate
        miss_rows = tier["missed_rows_per_step"]
        bound_rate = result["batch"] / (miss_rows / best) if miss_rows else float("inf")
        share = tier["samples_per_s"] / bound_rate
        result["disk"].update(missed_rows_per_step=miss_rows, step_bound_s=miss_rows / best,
                              disk_bound_samples_per_s=bound_rate, share_of_disk_bound=share)
        shown += [["missed rows per step (lookahead, 25%)", f"{miss_rows:,.0f}"],
                  ["step-time bound from the fastest reads", f"{miss_rows / best * 1e3:.1f} ms"],
                  ["disk-bound samples/s; tier (prefetch) share", f"{bound_rate:,.0f}; {share:.2f}"]]
    print(format_table(["disk", "value"], shown))


def batched_read_rate(path_dir: str, rows: int, dim: int, reads: int, batch_rows: int = 4096) -> float:
    """Random record reads per second as the tier issues them: ``batch_rows`` sorted rows at a
    time, all their pages requested at once, then read; the file's pages dropped after each."""
    from recscale.embedding.tier_file import TierFileMeta

    meta = TierFileMeta("probe", rows, 0, dim, "fp32", (("sum_sq", 1),), 0)
    f = RowFile.create(path_dir, meta, lambda s, n: (torch.zeros(n, dim), {"sum_sq": torch.zeros(n, 1)}))
    rng = np.random.default_rng(2)
    done, seconds = 0, 0.0
    while done < reads:
        picks = np.unique(rng.integers(0, rows, min(batch_rows, reads - done)))
        buf = np.empty((picks.size, f.record_bytes), dtype=np.uint8)
        t0 = time.perf_counter()
        f.read(picks, buf)
        seconds += time.perf_counter() - t0
        done += picks.size
        f.drop_pages(force=True)
    f.close()
    os.unlink(f.path)
    return done / seconds


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    global PROGRESS_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small tables, seconds")
    ap.add_argument("--ssd-dir", default="", help="directory of the tier files (default: a temporary one)")
    ap.add_argument("--window", type=int, default=16, help="lookahead window (batches announced to eviction)")
    ap.add_argument("--prefetch", type=int, default=2, help="batches read ahead in the throughput run")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--tables", type=int, default=None, help="number of tables (default 8; --quick 2)")
    ap.add_argument("--rows", type=int, default=None, help="rows per table (default 4M; --quick 8000)")
    ap.add_argument("--dim", type=int, default=None, help="embedding dim (default 64; --quick 16)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 4096; --quick 128)")
    ap.add_argument("--pooling", type=int, default=None, help="ids per sample and table (default 20; --quick 8)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of each throughput run, warm-up included (default 120; --quick 16)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="of --steps, the first ones not timed: the cache filling (default a sixth)")
    ap.add_argument("--duration-s", type=float, default=0.0,
                    help="stop each throughput run's timing at the first step ending this many seconds after its "
                         "warm-up (the rest of --steps is not run; default 0: every step)")
    ap.add_argument("--progress-s", type=float, default=PROGRESS_S,
                    help="seconds between the progress lines of a training run (default 30)")
    ap.add_argument("--sim-steps", type=int, default=None, help="batches of the hit-rate trace (default 200; --quick 24)")
    ap.add_argument("--parts", default="hits,train,disk", help="comma list of the parts to run: hits, train, disk")
    ap.add_argument("--tier-budget-mb", type=int, default=2048,
                    help="RAM of the tier in the throughput runs (cache and bookkeeping of every table; 0: no cap)")
    ap.add_argument("--cgroup-mb", default="",
                    help="run the tier throughput runs in a memory cgroup of this many MiB (Linux, root), or 'auto': "
                         "the tier budget + the measured process baseline + 256 MiB")
    ap.add_argument("--tier-child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tier_child:
        _child_main(args.tier_child)
        return
    signal.signal(signal.SIGTERM, _interrupt)  # a killed run still removes its cgroup and child
    if args.cgroup_mb and args.cgroup_mb != "auto" and not (args.cgroup_mb.isdigit() and int(args.cgroup_mb) > 0):
        ap.error(f"--cgroup-mb: expected a number of MiB or 'auto', got {args.cgroup_mb!r}")
    threads = set_threads(args.threads)
    if args.quick:
        sizes = (2, 8_000, 16, 128, 8, 16, 24)
    else:
        sizes = (8, 4_000_000, 64, 4096, 20, 120, 200)
    given = (args.tables, args.rows, args.dim, args.batch, args.pooling, args.steps, args.sim_steps)
    n_tables, rows, dim, batch, pooling, steps, sim_steps = (d if g is None else g for g, d in zip(given, sizes))
    parts = set(args.parts.split(","))
    if not parts <= {"hits", "train", "disk"}:
        ap.error(f"--parts: expected a comma list of hits, train, disk; got {args.parts!r}")
    ssd_dir = args.ssd_dir or tempfile.mkdtemp(prefix="recscale-tiers-")
    tables = [TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i in range(n_tables)]
    result: dict = {"environment": environment(), "threads": threads, "window": args.window, "prefetch": args.prefetch, "rows": rows, "tables": n_tables, "dim": dim,
                    "batch": batch, "pooling": pooling, "hit_rate": {}, "throughput": {}}

    if args.duration_s < 0:
        ap.error(f"--duration-s: expected seconds >= 0, got {args.duration_s}")
    if args.warmup is not None and not 0 <= args.warmup < steps:
        ap.error(f"--warmup: expected 0 <= warmup < --steps ({steps}), got {args.warmup}")
    PROGRESS_S = args.progress_s
    rec = Recorder(result, args.json)
    ok = True
    try:
        if "hits" in parts:
            hit_rates(tables[0], sim_steps, batch, pooling, args.window, result)
            rec.save()
        if "train" in parts:
            try:
                ok = throughput(tables, steps, batch, pooling, ssd_dir, args.window, args.prefetch, threads,
                                args.tier_budget_mb, args.cgroup_mb, rec, args.warmup, args.duration_s)
            except CgroupError as e:
                ap.error(str(e))
        if "disk" in parts:
            disk(ssd_dir, rows, dim, 1_000 if args.quick else 50_000, result)
    finally:
        rec.save()  # what was measured, also when stopped early
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
