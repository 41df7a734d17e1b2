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
