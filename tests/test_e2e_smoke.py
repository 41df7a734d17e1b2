"""Smoke test of benchmarks/e2e.py: its --quick mode runs recscale (fp32 and bf16) and plain
PyTorch on both configs, 1 process and 2 ranks, and prints the table and the JSON. No timing
assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_e2e_quick_runs_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    proc = proc_utils.run(
        # TorchRec is optional (absent in CI); its rows are covered by running the script itself.
        [sys.executable, "benchmarks/e2e.py", "--quick", "--systems", "recscale,plain", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]  # a failed worker's log tail is on stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("config"))
    for col in ("system", "samples/s median (min-max)", "vs torchrec", "peak RSS GiB", "embeddings", "mlp", "comm",
                "of roofline"):
        assert col in header
    data = json.loads(out.read_text())
    rows = data["results"]
    got = {(r["config"], r["setup"], r["system"]) for r in rows}
    for config in ("criteo-dlrm", "multi-hot"):
        for setup in ("1proc", "2ranks"):
            assert {(config, setup, "recscale"), (config, setup, "plain")} <= got
    assert ("criteo-dlrm", "1proc", "recscale-bf16") in got
    for r in rows:
        assert r["samples_per_s"]["median"] > 0 and r["peak_rss_bytes"] > 0
        assert abs(sum(r["time_shares"].values()) - 1.0) < 1e-6
        assert 0 < r["roofline_share"]
    assert data["machine"]["mem_bw_gbs"] > 0 and data["machine"]["fp32_gflops"] > 0
