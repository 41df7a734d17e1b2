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

``--parts`` picks among the hit rates (``hits``), the throughput runs (``train``) and the disk
probe (``disk``); the disk part also reads records the way the tier does (a batch of pages
requested at once) and prints the prefetching run's share of the rate the disk bounds.

The full size holds about 8 GiB of rows; run it under a cgroup memory limit that counts the
page cache (e.g. ``systemd-run --scope -p MemoryMax=3G``) to check that the tier keeps to its
budget. Hit rates count distinct rows per batch, as ``cache_hit_rate`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, set_threads, write_json, zipf_ids  # noqa: E402

from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig  # noqa: E402
from recscale.embedding.tier_file import RowFile  # noqa: E402
from recscale.embedding.tier_hooks import (  # noqa: E402
    announce_batch, begin_batch, close_tiers, tier_stats, tiered_storages,
)
from recscale.embedding.tiered import TierSettings, tiered_storage_factory  # noqa: E402
from recscale.planner.miss_curve import zipf_access  # noqa: E402
from recscale.sparse import JaggedBatch  # noqa: E402

SHARES = (0.05, 0.10, 0.25, 0.50)


def make_batches(tables: list[TableConfig], n: int, batch: int, pooling: int, alpha: float, seed: int) -> list[JaggedBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        values, lengths = [], []
        for i, t in enumerate(tables):
            values.append(torch.from_numpy(zipf_ids(t.num_rows, batch * pooling, rng, alpha, salt=i)))
            lengths.append(torch.full((batch,), pooling, dtype=torch.int64))
        out.append(JaggedBatch(tuple(t.features[0] for t in tables), torch.cat(values), torch.cat(lengths)))
    return out


def belady_hit_rate(batches: list[np.ndarray], cache: int) -> float:
    """Offline Belady per batch: admit the batch's missing rows, evicting the cached rows whose
    next use is farthest in the future (never one of this batch)."""
    nxt: dict[int, list[int]] = {}
    for t in range(len(batches) - 1, -1, -1):
        for r in batches[t].tolist():
            nxt.setdefault(r, []).append(t)  # descending batch indices; the last is the soonest
    cached: set[int] = set()
    hits = lookups = 0
    for t, rows in enumerate(batches):
        rows_l = rows.tolist()
        for r in rows_l:
            nxt[r].pop()
        missing = [r for r in rows_l if r not in cached]
        lookups += len(rows_l)
        hits += len(rows_l) - len(missing)
        over = len(cached) + len(missing) - cache
        if over > 0:
            cur = set(rows_l)
            cand = [r for r in cached if r not in cur]
            far = sorted(cand, key=lambda r: (nxt[r][-1] if nxt[r] else 1 << 40), reverse=True)[:over]
            cached.difference_update(far)
        cached.update(missing)
    return hits / max(lookups, 1)


def policy_hit_rate(table: TableConfig, batches: list[JaggedBatch], cache: int, policy: str, lookahead: int,
                    ssd_dir: str) -> float:
    """The tier's own hit rate on one table, driven as the training pipeline drives it."""
    fac = tiered_storage_factory({table.name: ("ssd", cache)}, TierSettings(ssd_dir, policy, lookahead, 4), seed=0)
    m = TableBatchedEmbeddingBags([table], RowWiseAdagrad(lr=0.01), storage_factory=fac)
    st = m.groups[0].storage
    rows = [b.select((table.features[0],)).values for b in batches]
    ahead = 0
    for i in range(len(rows)):
        while lookahead and ahead < min(len(rows), i + 1 + lookahead):  # batch i and the next ones
            st.announce(rows[ahead])
            ahead += 1
        st.begin_batch()
        st.slots_for(rows[i])
    stats = st.stats
    close_tiers(m)
    return stats.hits / max(stats.lookups, 1)


def train_rate(tables, batches, placement, settings, lookahead: int, warmup: int) -> tuple[float, float, float, int]:
    """(samples/s, io_stall_fraction, missed rows per step, blocks a write-back had to re-read)
    of forward + fused backward over ``batches``."""
    fac = tiered_storage_factory(placement, settings, seed=0) if placement else None
    m = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.01), storage_factory=fac)
    stall0, miss0, t0 = 0.0, 0, 0.0
    ahead = 0
    for i, b in enumerate(batches):
        if i == warmup:
            st = tier_stats(m)
            stall0, miss0 = (st.stall_seconds, st.lookups - st.hits) if st else (0.0, 0)
            t0 = time.perf_counter()
        while placement and ahead < min(len(batches), i + 1 + lookahead):
            announce_batch(m, batches[ahead])
            ahead += 1
        if placement:
            begin_batch(m)
        m(b).sum().backward()
    seconds = time.perf_counter() - t0
    st = tier_stats(m)
    stall = (st.stall_seconds - stall0) if st else 0.0
    misses = (st.lookups - st.hits - miss0) if st else 0
    rereads = sum(seg.file.rereads for _, s in tiered_storages(m) for seg in s.segments)
    if placement:
        close_tiers(m)
    samples = (len(batches) - warmup) * batches[0].batch_size
    return samples / seconds, stall / seconds, misses / (len(batches) - warmup), rereads


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


def hit_rates(table: TableConfig, sim_steps: int, batch: int, pooling: int, window: int, ssd_dir: str, result: dict) -> None:
    """Hit rates of every policy and offline Belady on one table's trace."""
    hit_rows = []
    for alpha in (1.05, 0.8):
        trace = make_batches([table], sim_steps, batch, pooling, alpha, seed=2)
        uniq = [np.unique(b.values.numpy()) for b in trace]
        low = max(u.size for u in uniq)
        curve = zipf_access(table.num_rows, alpha, batch * pooling, scatter=False)  # zipf_ids: a bijection
        for share in SHARES:
            cache = max(low, int(share * table.num_rows))
            row = {"belady": belady_hit_rate(uniq, cache)}
            for policy in ("lru", "lfu", "lookahead"):
                row[policy] = policy_hit_rate(table, trace, cache, policy, window, ssd_dir)
            for policy in ("lru", "lookahead"):  # the planner's miss-ratio curves, same run length
                row[f"predicted_{policy}"] = curve.hit_rate(policy, cache, sim_steps, window)
            result["hit_rate"][f"zipf{alpha}_cache{share:.2f}"] = {"cache_rows": cache, **row}
            hit_rows.append([f"{alpha}", f"{share:.0%}", f"{cache:,}"] + [f"{row[k]:.3f}" for k in (
                "lru", "lfu", "lookahead", "belady", "predicted_lru", "predicted_lookahead")])
    print(format_table(["zipf", "cache", "rows", "lru", "lfu", "lookahead", "belady", "pred lru", "pred lookahead"], hit_rows))
    print()


def throughput(tables: list[TableConfig], steps: int, batch: int, pooling: int, ssd_dir: str, window: int, prefetch: int,
               result: dict) -> None:
    """Training throughput at a 25% cache, Zipf 1.05: all in RAM, the tier with and without
    prefetch (``window`` batches announced to eviction either way)."""
    batches = make_batches(tables, steps, batch, pooling, 1.05, seed=3)
    rows = tables[0].num_rows
    low = max(int(torch.unique(b.select((t.features[0],)).values).numel()) for b in batches for t in tables)
    cache = max(low, rows // 4)
    place = {t.name: ("ssd", cache) for t in tables}
    warm = max(2, steps // 6)
    ram_rate, _, _, _ = train_rate(tables, batches, None, None, 0, warm)
    tp_rows = [["all in RAM", f"{ram_rate:,.0f}", "1.00", "-", "-"]]
    result["throughput"]["ram"] = {"samples_per_s": ram_rate}
    for name, k in (("tier, prefetch", prefetch), ("tier, no prefetch", 0)):
        settings = TierSettings(ssd_dir, "lookahead", window, 8, k)
        rate, stall, misses, rereads = train_rate(tables, batches, place, settings, window, warm)
        result["throughput"][name] = {"prefetch_batches": k, "samples_per_s": rate, "share_of_ram": rate / ram_rate,
                                      "io_stall_fraction": stall,
                                      "missed_rows_per_step": misses, "write_back_page_rereads": rereads}
        label = f"{name} ({k}, window {window})" if k else name
        tp_rows.append([label, f"{rate:,.0f}", f"{rate / ram_rate:.2f}", f"{stall:.3f}", f"{misses:,.0f}"])
    print(format_table(["run (25% cache, zipf 1.05)", "samples/s", "share", "io_stall_fraction", "missed rows/step"], tp_rows))
    print()


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


def main() -> None:
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
    ap.add_argument("--steps", type=int, default=None, help="timed training steps (default 120; --quick 16)")
    ap.add_argument("--sim-steps", type=int, default=None, help="batches of the hit-rate trace (default 200; --quick 24)")
    ap.add_argument("--parts", default="hits,train,disk", help="comma list of the parts to run: hits, train, disk")
    args = ap.parse_args()
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

    if "hits" in parts:
        hit_rates(tables[0], sim_steps, batch, pooling, args.window, ssd_dir, result)
    if "train" in parts:
        throughput(tables, steps, batch, pooling, ssd_dir, args.window, args.prefetch, result)
    if "disk" in parts:
        disk(ssd_dir, rows, dim, 1_000 if args.quick else 50_000, result)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
