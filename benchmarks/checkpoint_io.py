"""Checkpoint data-file writes alone and beside a CPU-bound loop: what the writer's CPU costs.

Writes a file laid out like a full lossless checkpoint of ``--tables`` tables of 1M rows x dim 64
with row-wise Adagrad (chunks of 65,536 rows: a 16 MiB part of rows and a 256 KiB part of state
from page-aligned buffers; each table's last chunk is shorter and leaves the file offset
unaligned, as in the real file), with the crc32 of each chunk computed on a second thread as the
writer's encoder does, through ``LocalStorage.open_write`` (direct I/O where the file system
takes it). Each write is timed alone and beside a thread running a CPU-bound torch loop on
``--load-threads`` threads (as training beside the writer would); it prints each rate and the
ratio beside load / alone.

``--baseline-storage FILE`` also loads another revision's ``storage.py`` (and crc32 from zlib)
and interleaves its runs with this tree's, so both are measured under the same conditions.

    python benchmarks/checkpoint_io.py --dir DIR --tables 12 --repeat 2
    python benchmarks/checkpoint_io.py --dir DIR --baseline-storage OLD/storage.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import queue
import threading
import time
import zlib
from pathlib import Path

import torch

from recscale.checkpoint import storage as storage_mod
from recscale.checkpoint.checksum import BACKEND, crc32

ROWS, DIM, CHUNK_ROWS = 1_000_000, 64, 65_536


def layout(tables: int) -> list[tuple[int, int]]:
    """(row-part bytes, state-part bytes) of each chunk of the file."""
    out = []
    for _ in range(tables):
        for a in range(0, ROWS, CHUNK_ROWS):
            n = min(CHUNK_ROWS, ROWS - a)
            out.append((n * DIM * 4, n * 4))
    return out


class Source:
    """Page-aligned buffers the parts are views of (a snapshot's), walked through in turn so
    the crc reads memory, not a cache."""

    def __init__(self, nbytes: int = 1 << 30) -> None:
        self.mem = mmap.mmap(-1, nbytes)
        for i in range(0, nbytes, 1 << 20):
            self.mem[i : i + 1] = bytes([i >> 20 & 255])
        self.view = memoryview(self.mem)
        self.at = 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.view):
            self.at = 0
        mv = self.view[self.at : self.at + n]
        self.at += (n + 4095) // 4096 * 4096
        return mv


def write_file(storage_module, crc, root: Path, chunks: list[tuple[int, int]], src: Source) -> dict:
    """One data file written as the checkpoint writer does; seconds and rate."""
    storage = storage_module.LocalStorage(root)
    q: queue.Queue = queue.Queue(maxsize=4)

    def encode() -> None:  # the encoder thread: rows out of the snapshot, crc32 of each chunk
        for w, s in chunks:
            parts = [src.take(w), src.take(s)]
            c = 0
            for p in parts:
                c = crc(p, c)
            q.put(parts)
        q.put(None)

    t0 = time.perf_counter()
    th = threading.Thread(target=encode, daemon=True)
    th.start()
    nbytes = 0
    with storage.open_write("io-bench.bin") as f:
        while (parts := q.get()) is not None:
            for p in parts:
                f.write(p)
                nbytes += len(p)
    th.join()
    dt = time.perf_counter() - t0
    (root / "io-bench.bin").unlink()
    return {"bytes": nbytes, "seconds": dt, "mb_per_s": nbytes / dt / 1e6}


class Load:
    """A CPU-bound torch loop on its own thread (matrix products on ``threads`` threads)."""

    def __init__(self, threads: int) -> None:
        self.threads, self.stop, self.steps = threads, threading.Event(), 0
        self.th = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        torch.set_num_threads(self.threads)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        while not self.stop.is_set():
            a = (a @ b).tanh_()
            self.steps += 1

    def __enter__(self) -> Load:
        self.th.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.th.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder on the disk to measure (the file is removed after each write)")
    ap.add_argument("--tables", type=int, default=12, help="tables of 1M x 64 (0.26 GB each)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--load-threads", type=int, default=2)
    ap.add_argument("--baseline-storage", help="another revision's storage.py, measured interleaved as 'baseline'")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    impls = {"this": (storage_mod, crc32)}
    if args.baseline_storage:
        spec = importlib.util.spec_from_file_location("baseline_storage", args.baseline_storage)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        impls["baseline"] = (mod, zlib.crc32)
    chunks, src = layout(args.tables), Source()
    runs = []
    for rep in range(args.repeat):
        for name, (mod, c) in impls.items():
            alone = write_file(mod, c, root, chunks, src)
            with Load(args.load_threads) as load:
                t = time.perf_counter()
                beside = write_file(mod, c, root, chunks, src)
                load_rate = load.steps / (time.perf_counter() - t)
            r = {"impl": name, "repeat": rep, "alone": alone, "beside_load": beside, "load_steps_per_s": load_rate,
                 "beside_over_alone": beside["mb_per_s"] / alone["mb_per_s"]}
            runs.append(r)
            print(f"{name:9s} rep {rep}: alone {alone['mb_per_s']:7,.0f} MB/s, beside load {beside['mb_per_s']:7,.0f}"
                  f" MB/s ({r['beside_over_alone']:.0%}), load {load_rate:,.1f} steps/s", flush=True)
    out = {"tables": args.tables, "bytes": runs[0]["alone"]["bytes"], "crc": BACKEND,
           "load_threads": args.load_threads, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
