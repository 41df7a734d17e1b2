"""Smoke run of the checkpoint benchmark with tiny sizes: the figures are produced and consistent
(a full fp32 checkpoint of every row is the 1x reference; full checkpoints that leave out rows
never updated write less and still restore exactly, as lossless differentials do; 2-bit ones
do not restore exactly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_utils

ROOT = Path(__file__).resolve().parents[1]


def test_checkpoint_benchmark_smoke(tmp_path):
    out = tmp_path / "ckpt.json"
    proc_utils.run(
        [sys.executable, "benchmarks/checkpoint.py", "--quick", "--tables", "2", "--rows", "3000", "--dim", "16",
         "--batch", "256", "--intervals", "3", "--json", str(out),
         "--settings", "full/none/state-fp32,intermittent/none/state-fp32,incremental/uniform2/state-fp16"],
        check=True, cwd=ROOT, timeout=120, capture_output=True,
    )
    d = json.loads(out.read_text())
    by = {r["setting"]: r for r in d["results"]}
    full = by["full/none/state-fp32"]
    assert full["restored_rel_l2_error"] == 0.0
    assert all(b < full["full_fp32_reference_bytes"] for b in full["bytes_written"])
    assert full["write_reduction"] > 1.0
    assert by["intermittent/none/state-fp32"]["restored_rel_l2_error"] == 0.0
    q = by["incremental/uniform2/state-fp16"]
    assert q["kinds"] == ["full", "incremental", "incremental"]
    assert q["write_reduction"] > 5 and 0 < q["restored_rel_l2_error"] < 1


def test_model_sized_checkpoint_benchmark_smoke(tmp_path):
    """The criteo-dlrm mode at a tiny size: its disk probe, checkpoints of both kinds, the
    slowdown figure and a bitwise resume."""
    out = tmp_path / "model.json"
    proc_utils.run(
        [sys.executable, "benchmarks/checkpoint.py", "--model", "criteo-dlrm", "--tables", "3", "--rows", "2000",
         "--dim", "16", "--batch", "128", "--interval-min", "0.02", "--duration-min", "0.1",
         "--disk-probe-gb", "0.02", "--dir", str(tmp_path / "work"), "--json", str(out)],
        check=True, cwd=ROOT, timeout=180, capture_output=True,
    )
    d = json.loads(out.read_text())
    assert d["resume_bitwise"] is True
    assert d["disk_write_bytes_per_s"] > 0
    kinds = [c["kind"] for c in d["checkpoints"]]
    assert kinds[0] == "full" and "differential" in kinds
    assert all(c["bytes"] > 0 and c["write_mb_per_s"] > 0 for c in d["checkpoints"])


CRITEO_10K = ROOT.parent / "shared" / "data" / "criteo" / "criteo_10k_encoded_train.csv"


def test_checkpoint_sensitivity_smoke(tmp_path):
    """The sensitivity benchmark on the real Criteo 10k sample: a lossless restore ends exactly
    where the uninterrupted run does, and noise of 1e-6 in the restored rows stays below 1e-6."""
    import pytest

    if not CRITEO_10K.is_file():
        pytest.skip("../shared/data/criteo is not present")
    out = tmp_path / "sens.json"
    proc_utils.run([sys.executable, "benchmarks/checkpoint_sensitivity.py", "--quick", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    d = json.loads(out.read_text())
    by = {r["experiment"]: r["logloss_rel_diff"] for r in d["results"]}
    assert by["lossless restore"] == 0.0
    assert abs(by["noise 1e-06 on emb rows (all), draw 0"]) < 1e-6


def test_checkpoint_accuracy_smoke(tmp_path):
    """The accuracy benchmark on the real Criteo 10k sample: a lossless restore at the middle ends
    exactly where the uninterrupted run does, and with the config's decaying rate an 8-bit one
    ends near it (the bound would fail with a constant rate). One restore point keeps it short;
    the synthetic smoke below covers several."""
    import pytest

    if not CRITEO_10K.is_file():
        pytest.skip("../shared/data/criteo is not present")
    out = tmp_path / "acc.json"
    proc_utils.run([sys.executable, "benchmarks/checkpoint_accuracy.py", "--codecs", "none,uniform8",
                    "--steps", "mid", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    d = json.loads(out.read_text())
    by = {(r["codec"], r["restore_step"]): r["logloss_rel_diff"] for r in d["results"]}
    mid = d["middle_step"]
    assert by[("none", mid)] == 0.0
    assert abs(by[("uniform8", mid)]) < 2e-4


def test_checkpoint_accuracy_synthetic_smoke(tmp_path):
    """The synthetic accuracy study at a tiny size: an exact restore changes nothing bitwise, a
    3-bit one changes the final logloss, and the spread comes from the uninterrupted seeds."""
    out = tmp_path / "acc.json"
    proc_utils.run(
        [sys.executable, "benchmarks/checkpoint_accuracy.py", "--case", "synthetic", "--codecs", "none,adaptive3:bf16",
         "--seeds", "1", "--spread-seeds", "2", "--set", "data.num_samples=8192", "--set", "data.eval_samples=2048",
         "--set", "lr_schedule.decay_start_step=4", "--json", str(out)],
        check=True, cwd=ROOT, timeout=240, capture_output=True,
    )
    d = json.loads(out.read_text())
    assert d["points"] == [2, 4, 6]
    by = {s["codec"]: s for s in d["summary"]}
    assert by["none"]["bitwise_equal"] and by["none"]["max_abs_rel"] == 0.0
    assert not by["adaptive3:bf16"]["bitwise_equal"] and by["adaptive3:bf16"]["max_abs_rel"] > 0
    assert d["spread_rel_std"] > 0 and len(d["uninterrupted"]) == 2


def test_paired_checkpoint_benchmark_smoke(tmp_path):
    """``--paired``: one run whose checkpoints alternate two codecs by cycles of the policy, each
    position in the cycle written in both alike; the chain mixing them restores; structure only."""
    out = tmp_path / "paired.json"
    a, b = "intermittent/uniform2/state-fp16", "intermittent/adaptive2/state-fp16"
    proc_utils.run(
        [sys.executable, "benchmarks/checkpoint.py", "--quick", "--tables", "2", "--rows", "2000", "--dim", "16",
         "--batch", "128", "--intervals", "17", "--paired", f"{a},{b}", "--json", str(out)],
        check=True, cwd=ROOT, timeout=120, capture_output=True,
    )
    d = json.loads(out.read_text())
    run, summary = d["paired"], d["summary"]
    assert run["codecs"] == ["uniform2", "adaptive2"]
    assert len(run["intervals"]) == 17 and run["intervals"][0]["codec"] is None
    cks = run["checkpoints"]
    assert all((c["kind"] == "full") == (c["position"] == 0) for c in cks)
    assert all((c["warm_share"] is not None) == (c["codec"] == 1) for c in cks)
    # whole cycles in one codec, as each codec runs alone
    assert run["paired_by"] == "cycle" and all(len({c["codec"] for c in cks if c["cycle"] == k}) == 1 for k in
                                               {c["cycle"] for c in cks})
    assert summary["unit_kind"] == "cycle pairs" and len(summary["units"]) >= 2
    for unit in summary["units"]:  # each position of the cycle once in A and once in B
        for which in (0, 1):
            assert sorted(cks[j]["position"] for j in unit if cks[j]["codec"] == which) == \
                sorted(cks[j]["position"] for j in unit if cks[j]["codec"] == 1 - which)
    assert [c["setting"] for c in summary["codecs"]] == [a, b]
    assert summary["codecs"][0]["intervals"] == summary["codecs"][1]["intervals"] > 0
    assert summary["wall_points"]["n"] == summary["cpu_points"]["n"] == len(summary["units"])
    assert set(run["restored_chain_codecs"]) <= {"uniform2", "adaptive2"}
    assert 0 < run["restored_rel_l2_error"] < 1
