"""Smoke test of benchmarks/data.py: it runs end to end in --quick mode, prints its tables and
writes its JSON (no timing assertions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_data_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "data.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/data.py", "--quick", "--no-torchrec", "--tmp", str(tmp_path), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("recscale prepare, 2 worker(s)", "python reader (read_criteo_tsv)", "ShardedReader, 1 worker(s)",
                 "trainer (configs/synthetic.toml)", "x the trainer's rate"):
        assert text in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "data" and data["args"]["quick"] is True
    assert data["prepare"]["recscale prepare, 1 worker(s)"]["rows"] == 5_000
    assert set(data["reader"]) == {"0", "1", "2"} and all(r["samples"] == 10_000 for r in data["reader"].values())
    assert data["trainer"]["synthetic_source_samples_per_s"] > 0 and data["reader_1worker_over_trainer"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["data.json"]  # generated files are removed


def test_loader_rates_times_a_loader_on_one_cpu_and_gives_the_cpus_back() -> None:
    import os

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    from loader_rates import loader_rate

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    rate, built, batch = loader_rate(None, ["data.num_samples=4096", "train.batch_size=512"], 0.2)
    assert rate > 0 and built >= 0 and batch == 512
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads
