"""Benchmark: data ingestion. Prepare rows/s, reader samples/s, and the trainer's consumption rate.

1. prepare: a generated Criteo-format TSV (Zipf-skewed hex hashes, missing values) through
   ``recscale data prepare`` with 1 and 2 worker processes, against the in-memory Python reader
   (``read_criteo_tsv``, per-row parsing) and TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` when
   TorchRec is installed;
2. reader: a prepared dataset shaped like ``configs/synthetic.toml`` (26 tables, its multi-hot
   pooling factors, batch 1024) read by ``ShardedReader`` with 0, 1 and 2 worker processes
   (window shuffle on), against the trainer's rate: ``recscale train`` on ``configs/synthetic.toml``
   (and, for reference, the same training reading the prepared directory). The goal: the reader
   with at most one worker keeps up with >= 3x the trainer's rate.

``--stream-gb X`` instead generates an X GB TSV under ``--tmp``, prepares it in a subprocess while
sampling the whole process tree's memory (RSS summed over the main process and its workers),
reports rows/s and the peak, and deletes the file and the output.

    python benchmarks/data.py                 # 1M-row TSV, 400k-sample reader dataset
    python benchmarks/data.py --quick         # a smoke run
    python benchmarks/data.py --json out/data.json
    python benchmarks/data.py --stream-gb 5 --tmp /tmp
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import environment, format_table, write_json, zipf_ids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


# ---------------------------------------------------------------------------------- inputs
def _hex8(v: np.ndarray) -> pa.Array:
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    chars = _HEX[(v.astype(np.uint32)[:, None] >> shifts) & 15]
    return pa.array(np.ascontiguousarray(chars).view("S8").ravel()).cast(pa.string())


def criteo_chunk(rows: int, seed: int) -> pa.Table:
    """``rows`` Criteo-like rows: label, 13 skewed integers (some missing), 26 Zipf hex hashes."""
    rng = np.random.default_rng(seed)
    cols: dict[str, pa.Array] = {"label": pa.array((rng.random(rows) < 0.25).astype(np.int8))}
    for i in range(13):
        v = np.floor(rng.exponential(3.0 * (i + 1), rows)).astype(np.int64) - (i == 1)
        cols[f"I{i + 1}"] = pa.array(v, mask=rng.random(rows) < 0.2)
    for j, n in enumerate(CRITEO_ROWS):
        ranks = zipf_ids(n, rows, rng, salt=j)
        with np.errstate(over="ignore"):
            h = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(j)) >> np.uint64(32)
        arr = _hex8(h)
        missing = rng.random(rows) < 0.05
        cols[f"C{j + 1}"] = pa.array(np.where(missing, None, arr.to_numpy(zero_copy_only=False)), pa.string())
    return pa.table(cols)


def write_criteo_tsv(path: Path, rows: int | None = None, target_bytes: int | None = None, seed: int = 0) -> int:
    """Write a Criteo-format TSV of ``rows`` rows or about ``target_bytes`` bytes; returns rows."""
    opts = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    written, chunk = 0, 200_000
    with pacsv.CSVWriter(str(path), criteo_chunk(1, 0).schema, write_options=opts) as w:
        i = 0
        while (rows is not None and written < rows) or (target_bytes is not None and path.stat().st_size < target_bytes):
            n = chunk if rows is None else min(chunk, rows - written)
            w.write_table(criteo_chunk(n, seed * 1_000_003 + i))
            written += n
            i += 1
    return written


def synthetic_parquet(path: Path, samples: int) -> tuple[dict[str, Any], list[int]]:
    """``configs/synthetic.toml``'s data (its generator) as a Parquet file with list columns."""
    from recscale.data import SyntheticClickData, SyntheticConfig
    from recscale.train.config import load_config

    cfg = load_config(ROOT / "configs" / "synthetic.toml")
    rows, pf = cfg.model.table_rows, cfg.data.pooling_factors
    src = SyntheticClickData(SyntheticConfig(samples, tuple(rows), tuple(pf), seed=0))
    writer = None
    for start in range(0, samples, 65536):
        b = src.make_samples(start, min(65536, samples - start))
        n = b.batch_size
        cols: dict[str, Any] = {"label": b.labels.numpy()}
        for i in range(b.dense.shape[1]):
            cols[f"d{i}"] = b.dense[:, i].numpy()
        offs = np.concatenate([[0], np.cumsum(b.sparse.lengths.numpy())])
        for k, name in enumerate(b.sparse.keys):
            lens = b.sparse.lengths.numpy()[k * n : (k + 1) * n]
            vals = b.sparse.values.numpy()[offs[k * n] : offs[(k + 1) * n]]
            if pf[k] == 1:
                cols[name] = vals
            else:
                o = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                cols[name] = pa.ListArray.from_arrays(pa.array(o), pa.array(vals))
        t = pa.table(cols)
        writer = writer or pq.ParquetWriter(str(path), t.schema)
        writer.write_table(t)
    assert writer is not None
    writer.close()
    schema = {
        "label": "label",
        "dense": [{"name": f"d{i}", "log": False} for i in range(13)],
        "sparse": [
            {"name": f"s{k}", "kind": "int", "transform": "identity", "table_rows": r, "multi_hot": pf[k] > 1}
            for k, r in enumerate(rows)
        ],
    }
    return schema, list(rows)


# ---------------------------------------------------------------------------------- measurements
def run_prepare(inputs: list[Path], fmt: str, schema, out: Path, workers: int) -> dict[str, float]:
    from recscale.data.prepare import PrepareOptions, prepare

    r = prepare(
        PrepareOptions(inputs=tuple(map(str, inputs)), fmt=fmt, schema=schema, out=str(out), workers=workers,
                       block_bytes=16 << 20, overwrite=True, progress=False),
        log=lambda _: None,
    )
    return {"rows": r.rows, "seconds": r.seconds, "rows_per_s": r.rows_per_s, "mb_per_s": r.input_bytes / 1e6 / r.seconds}


def time_python_reader(tsv: Path, rows: int) -> dict[str, float]:
    from recscale.data import read_criteo_tsv

    t0 = time.perf_counter()
    d = read_criteo_tsv(tsv, [1000] * 26, max_rows=rows)
    s = time.perf_counter() - t0
    return {"rows": len(d), "seconds": s, "rows_per_s": len(d) / s}


def time_torchrec(tsv: Path, tmp: Path) -> dict[str, Any]:
    try:
        from torchrec.datasets.criteo import BinaryCriteoUtils
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return {"note": f"torchrec not available ({type(e).__name__})"}
    rows = sum(1 for _ in open(tsv, "rb"))
    t0 = time.perf_counter()
    try:
        BinaryCriteoUtils.tsv_to_npys(str(tsv), str(tmp / "d.npy"), str(tmp / "s.npy"), str(tmp / "l.npy"), dataset_name="criteo_kaggle")
    except ImportError as e:  # torchrec's file loading needs iopath (torchrec[datasets])
        return {"note": f"torchrec tsv_to_npys not available ({e})".split(". ")[0] + ")"}
    s = time.perf_counter() - t0
    return {"rows": rows, "seconds": s, "rows_per_s": rows / s}


def time_reader(root: Path, batch: int, workers: int, window: int) -> dict[str, float]:
    from recscale.data.prepared import PreparedDataset
    from recscale.data.sharded_reader import ShardedReader

    ds = PreparedDataset.open(root, verify_checksums=False)
    r = ShardedReader(ds, batch, shuffle=True, shuffle_window=window, seed=0, num_workers=workers)
    t0 = time.perf_counter()
    n, first = 0, None
    for b in r:
        n += b.batch_size
        first = first or time.perf_counter()
    end = time.perf_counter()
    return {"samples": n, "seconds": end - t0, "samples_per_s": n / (end - t0), "startup_s": (first or end) - t0}


def trainer_rate(overrides: list[str]) -> float:
    from recscale.train.config import load_config
    from recscale.train.loop import train

    cfg = load_config(ROOT / "configs" / "synthetic.toml", overrides + ["train.progress=false"])
    return float(train(cfg, log=lambda _: None)["train_samples_per_sec"])


def stream_measure(gb: float, tmp: Path, workers: int, tsv: Path | None = None, block_mb: float = 32) -> dict[str, Any]:
    """Generate an X GB TSV (or take ``tsv``), prepare it in a subprocess, sample the process
    tree's memory (RSS summed over the main process and its workers, sampled every 0.2 s)."""
    import psutil

    work = Path(tempfile.mkdtemp(prefix="recscale-stream-", dir=tmp))
    try:
        if tsv is None:
            tsv = work / "big.tsv"
            t0 = time.perf_counter()
            write_criteo_tsv(tsv, target_bytes=int(gb * 1e9))
            print(f"generated {tsv.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        with open(tsv, "rb") as f:
            rows = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
        size = tsv.stat().st_size
        cmd = [sys.executable, "-m", "recscale", "data", "prepare", "--input", str(tsv), "--format", "criteo-tsv",
               "--table-rows", "40000000", "--out", str(work / "out"), "--workers", str(workers), "--no-progress",
               "--block-mb", str(block_mb)]
        t0 = time.perf_counter()
        proc = psutil.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peak = peak_pss = 0
        while proc.poll() is None:
            try:
                procs = [proc] + proc.children(recursive=True)
                info = [p.memory_full_info() for p in procs if p.is_running()]
                rss, pss = sum(i.rss for i in info), sum(getattr(i, "pss", i.rss) for i in info)
            except psutil.Error:
                rss = pss = 0
            peak, peak_pss = max(peak, rss), max(peak_pss, pss)
            time.sleep(0.2)
        seconds = time.perf_counter() - t0
        out = proc.stdout.read() if proc.stdout else ""
        if proc.returncode != 0:
            raise SystemExit(f"prepare failed:\n{out}")
        print(out.strip())
        return {"rows": rows, "input_bytes": size, "workers": workers, "seconds": seconds, "rows_per_s": rows / seconds,
                "mb_per_s": size / 1e6 / seconds, "peak_rss_bytes": peak, "peak_rss_gb": peak / 1e9,
                "peak_pss_bytes": peak_pss, "peak_pss_gb": peak_pss / 1e9}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--tsv-rows", type=int, default=None, help="rows of the generated TSV (default 1,000,000; 5,000 quick)")
    p.add_argument("--samples", type=int, default=None, help="samples of the reader dataset (default 400,000; 10,000 quick)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps timed (default 100; 3 quick)")
    p.add_argument("--no-torchrec", action="store_true", help="skip TorchRec's tsv_to_npys")
    p.add_argument("--stream-gb", type=float, default=None, help="only the streaming measurement of an X GB TSV")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where generated files go")
    p.add_argument("--workers", type=int, default=2, help="prepare workers for --stream-gb")
    p.add_argument("--block-mb", type=float, default=32, help="--stream-gb: prepare's --block-mb")
    p.add_argument("--input-tsv", type=Path, default=None, help="--stream-gb: use this TSV instead of generating one")
    p.add_argument("--generate-tsv", type=Path, default=None, metavar="PATH", help="only write an X GB (--stream-gb) TSV to PATH")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    result: dict[str, Any] = {"benchmark": "data", "environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    result["args"]["quick"] = args.quick
    if args.generate_tsv:
        rows = write_criteo_tsv(args.generate_tsv, target_bytes=int((args.stream_gb or 1) * 1e9))
        print(f"wrote {rows:,} rows, {args.generate_tsv.stat().st_size / 1e9:.2f} GB to {args.generate_tsv}")
        return
    if args.stream_gb or args.input_tsv:
        s = stream_measure(args.stream_gb or 0, args.tmp, args.workers, args.input_tsv, args.block_mb)
        print(format_table(["input GB", "rows", "workers", "seconds", "rows/s", "MB/s", "peak RSS GB", "peak PSS GB"],
                           [[f"{s['input_bytes'] / 1e9:.2f}", f"{s['rows']:,}", s["workers"], f"{s['seconds']:.1f}",
                             f"{s['rows_per_s']:,.0f}", f"{s['mb_per_s']:.1f}", f"{s['peak_rss_gb']:.2f}", f"{s['peak_pss_gb']:.2f}"]]))
        print("RSS sums each process's resident pages (pages shared after fork count once per process); PSS splits them fairly")
        result["stream"] = s
        if args.json:
            write_json(args.json, result)
        return

    from recscale.data.schema import criteo_schema, schema_from_dict

    tsv_rows = args.tsv_rows or (5_000 if args.quick else 1_000_000)
    samples = args.samples or (10_000 if args.quick else 400_000)
    steps = args.steps or (3 if args.quick else 100)
    work = Path(tempfile.mkdtemp(prefix="recscale-bench-data-", dir=args.tmp))
    try:
        tsv = work / "criteo.tsv"
        write_criteo_tsv(tsv, rows=tsv_rows)
        prep = {}
        for w in (1, 2):
            prep[f"recscale prepare, {w} worker(s)"] = run_prepare([tsv], "criteo-tsv", criteo_schema(40_000_000), work / f"c{w}", w)
        # The per-row baselines get at most 200k rows (they are slow); rows/s is what compares.
        small = tsv if tsv_rows <= 200_000 else work / "small.tsv"
        if small != tsv:
            write_criteo_tsv(small, rows=200_000)
        prep["python reader (read_criteo_tsv)"] = time_python_reader(small, 200_000)
        if not args.no_torchrec:
            prep["torchrec tsv_to_npys"] = time_torchrec(small, work)
        result["prepare"] = prep
        print(f"prepare: {tsv_rows:,}-row Criteo TSV ({tsv.stat().st_size / 1e6:.0f} MB)")
        print(format_table(["impl", "rows", "seconds", "rows/s"], [
            [k, f"{v['rows']:,}", f"{v['seconds']:.2f}", f"{v['rows_per_s']:,.0f}"] if "rows" in v else [k, "-", "-", v["note"]]
            for k, v in prep.items()
        ]))

        schema_doc, rows = synthetic_parquet(work / "synthetic.parquet", samples)
        prep_pq = run_prepare([work / "synthetic.parquet"], "parquet", schema_from_dict(schema_doc), work / "syn", 2)
        result["prepare_parquet"] = prep_pq
        batch = 1024
        readers = {w: time_reader(work / "syn", batch, w, 65_536) for w in (0, 1, 2)}
        result["reader"] = {str(k): v for k, v in readers.items()}
        common = [f"train.max_steps={steps}", f"data.eval_samples={batch}", f"data.num_samples={batch * (steps + 1)}"]
        t_syn = trainer_rate(common)
        t_prep = trainer_rate([f"train.max_steps={steps}", "data.source=prepared", f"data.train_path={work / 'syn'}",
                               "data.eval_fraction=0.01", "data.verify_checksums=false"])
        result["trainer"] = {"synthetic_source_samples_per_s": t_syn, "prepared_source_samples_per_s": t_prep}
        # One worker is the honest figure: with 0 the reading runs in the trainer's own process.
        one = readers[1]["samples_per_s"]
        result["reader_1worker_over_trainer"] = one / t_syn
        print(f"\nreader: {samples:,} samples shaped like configs/synthetic.toml, batch {batch}, window 65,536 "
              f"(prepared from Parquet at {prep_pq['rows_per_s']:,.0f} rows/s)")
        print(format_table(["what", "samples/s", "x trainer", "startup s"], [
            *[[f"ShardedReader, {w} worker(s)", f"{v['samples_per_s']:,.0f}", f"{v['samples_per_s'] / t_syn:.1f}", f"{v['startup_s']:.2f}"]
              for w, v in readers.items()],
            ["trainer (configs/synthetic.toml)", f"{t_syn:,.0f}", "1.0", "-"],
            ["trainer reading the prepared data", f"{t_prep:,.0f}", f"{t_prep / t_syn:.2f}", "-"],
        ]))
        verdict = "meets" if one >= 3 * t_syn else "MISSES"
        print(f"reader with 1 worker: {one / t_syn:.1f}x the trainer's rate ({verdict} the 3x goal)")
        if args.json:
            write_json(args.json, result)
            print(f"written to {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
