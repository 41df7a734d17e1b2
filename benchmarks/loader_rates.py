"""Benchmark: does every data source feed the trainer from one core?

For each source the trainer reads (synthetic, Criteo TSV, pre-encoded Criteo CSV, a prepared
Parquet directory) it times the training loader's batches with the process pinned to one CPU and
one torch thread (what a loader worker gets), and ``recscale train`` on its default settings (a
subprocess, as users run it) at the same batch size; the goal is a loader rate at least twice the
trainer's. The Criteo files are parsed into memory when the trainer starts; that one-off parse is
reported apart from the per-batch rate.

    python benchmarks/loader_rates.py            # 100 trainer steps per source
    python benchmarks/loader_rates.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import environment, format_table, write_json  # noqa: E402
from data import write_criteo_tsv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "criteo"


def sources(tmp: Path, quick: bool) -> dict[str, tuple[str | None, list[str]]]:
    """Source name -> (config file, overrides): a generated Criteo TSV (read directly, and
    prepared into a Parquet directory), the synthetic config, and the real 10k Criteo sample
    where present."""
    tsv = tmp / "criteo.tsv"
    write_criteo_tsv(tsv, rows=5_000 if quick else 200_000)
    out = tmp / "prepared"
    subprocess.run([sys.executable, "-m", "recscale", "data", "prepare", "--input", str(tsv), "--format", "criteo-tsv",
                    "--table-rows", "100000", "--out", str(out), "--workers", "0", "--no-progress"],
                   cwd=ROOT, check=True, capture_output=True)
    criteo = ["model.table_rows=100000", "train.batch_size=1024"]
    found = {
        "synthetic (configs/synthetic.toml)": (str(ROOT / "configs" / "synthetic.toml"), []),
        "criteo_tsv": (None, ["data.source=criteo_tsv", f'data.train_path="{tsv}"'] + criteo),
        "prepared": (None, ["data.source=prepared", f'data.train_path="{out}"', "model.table_rows=100000", "train.batch_size=1024"]),
    }
    encoded = DATA / "criteo_10k_encoded_train.csv"
    if encoded.is_file():
        found["criteo_encoded_csv (configs/criteo_10k.toml)"] = (str(ROOT / "configs" / "criteo_10k.toml"), [])
    return found


def loader_rate(config: str | None, overrides: list[str], seconds: float) -> tuple[float, float, int]:
    """(samples/s of the train loader on one CPU and one thread, seconds to build the data, batch size)."""
    from recscale.train.config import load_config
    from recscale.train.datasets import build_data

    cfg = load_config(config, overrides + ["data.num_workers=0"])
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(affinity)})
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        data = build_data(cfg)
        built = time.perf_counter() - t0
        n, epoch, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            data.train.set_epoch(epoch)
            for batch in data.train_loader():
                n += batch.batch_size
                if time.perf_counter() - t0 >= seconds:
                    break
            epoch += 1
        return n / (time.perf_counter() - t0), built, cfg.train.batch_size
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def trainer_rate(config: str | None, overrides: list[str], steps: int, tmp: Path) -> tuple[float, str]:
    """``recscale train`` on its defaults: (samples/s, its process-tuning log line)."""
    out = tmp / "summary.json"
    cmd = [sys.executable, "-m", "recscale", "train", "--summary-json", str(out)] + (["--config", config] if config else [])
    for o in overrides + [f"train.max_steps={steps}", "train.progress=false", "data.eval_samples=1024"]:
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise SystemExit(f"recscale train failed:\n{p.stdout}\n{p.stderr}")
    line = next((x for x in p.stdout.splitlines() if x.startswith("process")), "")
    return float(json.loads(out.read_text())["train_samples_per_sec"]), line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per source (default 100; 3 quick)")
    p.add_argument("--seconds", type=float, default=None, help="loader seconds per source (default 5; 0.5 quick)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    steps = args.steps or (3 if args.quick else 100)
    seconds = args.seconds or (0.5 if args.quick else 5.0)
    result: dict[str, Any] = {"benchmark": "loader_rates", "environment": environment(), "sources": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="recscale-loaders-") as d:
        tmp = Path(d)
        for name, (config, overrides) in sources(tmp, args.quick).items():
            if args.quick:
                overrides = overrides + ["data.num_samples=20000"] if "synthetic" in name else overrides
            rate, built, batch = loader_rate(config, overrides, seconds)
            train, tuning = trainer_rate(config, overrides, steps, tmp)
            result["sources"][name] = {"batch_size": batch, "loader_one_cpu_samples_per_s": rate, "build_seconds": built,
                                       "trainer_samples_per_s": train, "ratio": rate / train, "trainer_process": tuning}
            rows.append([name, batch, f"{rate:,.0f}", f"{built:.2f}", f"{train:,.0f}", f"{rate / train:.1f}x"])
    print(format_table(["source", "batch", "loader samples/s (1 CPU)", "build s", "trainer samples/s", "loader / trainer"], rows))
    print("goal: every loader at >= 2x the trainer's rate")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
