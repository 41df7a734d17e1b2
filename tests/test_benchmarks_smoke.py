"""Smoke test of the embedding operator benchmark: it runs, prints its table, writes its JSON.

No timing assertions: only that the script works end to end in its --quick mode.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_embedding_op_quick(tmp_path: Path) -> None:
    out = tmp_path / "embedding_op.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/embedding_op.py", "--quick", "--threads", "1", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = [line for line in proc.stdout.splitlines() if line.startswith("config")]
    assert header, proc.stdout
    for col in ("impl", "forward ms", "bwd+update ms", "total ms", "samples/s", "total x"):
        assert col in header[0]
    assert "recscale" in proc.stdout and "plain_pytorch" in proc.stdout

    data = json.loads(out.read_text())
    assert {"benchmark", "environment", "args", "configs"} <= set(data)
    assert data["benchmark"] == "embedding_op"
    assert data["args"]["quick"] is True
    (rep,) = data["configs"]
    assert rep["config"] == "criteo"
    assert rep["optimizer"] == "rowwise_adagrad"
    assert rep["num_tables"] == 26 and rep["row_cap"] == 10_000
    assert {"recscale", "plain_pytorch"} <= set(rep["results"])
    for r in rep["results"].values():
        for phase in ("forward", "backward_update", "total"):
            assert {"median", "min", "max"} <= set(r[phase])
            assert r[phase]["min"] <= r[phase]["median"] <= r[phase]["max"]
        assert r["samples_per_s"] > 0
    assert set(rep["ratio_vs_recscale"]["plain_pytorch"]) == {"forward", "backward_update", "total"}
    assert isinstance(rep["notes"], list)
    assert not list(tmp_path.glob(".*.tmp")), "write-then-rename left a temporary file"


def test_scaling_benchmark_quick_runs(tmp_path):
    out = tmp_path / "scaling.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/scaling.py", "--quick", "--sharding", "row_wise", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "samples/s" in proc.stdout and "output_a2a %" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["setup"] for r in data["results"]] == ["1 process", "2 ranks"]


def test_planner_benchmark_quick_runs(tmp_path):
    out = tmp_path / "planner.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/planner.py", "--quick", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recscale ms" in proc.stdout and "karmarkar_karp ms" in proc.stdout
    data = json.loads(out.read_text())
    assert all(r["recscale_model_ms"]["recscale"] > 0 for r in data["results"])


def test_collectives_benchmark_quick_runs(tmp_path):
    from recscale.comm.shared_memory import shared_memory_supported

    if not shared_memory_supported():
        pytest.skip("no x86 shared memory with room on this machine")
    out = tmp_path / "collectives.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/collectives.py", "--quick", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a2a shm" in proc.stdout and "gather gloo" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["transport"] for r in data["results"]} == {"shared memory", "gloo"}
    assert all(r["all_to_all"] > 0 and r["all_gather"] > 0 for r in data["results"])


def test_planner_validation_quick_runs_and_its_recording_refits_to_the_same_predictions(tmp_path):
    # --json keeps the raw calibration measurements; --refit must rebuild every probe by name
    # and give back the run's own constants, so its predictions match exactly. A quarter of the
    # default batch: the plans' times only need to exist.
    out, again = tmp_path / "validation.json", tmp_path / "refit.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/planner_validation.py", "--quick", "--batch-size", "1024", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "predicted ms" in proc.stdout and "Kendall tau" in proc.stdout
    # The refit measures nothing: here, not in an interpreter that would spend seconds importing torch.
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import planner_validation
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert planner_validation.main(["--refit", str(out), "--json", str(again)]) == 0
    first, second = json.loads(out.read_text()), json.loads(again.read_text())
    # 5 plans on 1 rank, 5 fixed plans on 2, and the planner's unless it chose one of those
    assert len(first["results"]) == len(second["results"]) in (10, 11)
    assert second["planner_chose"] == first["planner_chose"]
    for a, b in zip(first["results"], second["results"]):
        assert a["plan"] == b["plan"] and a["measured_ms"] == b["measured_ms"]
        assert b["predicted_ms"] == pytest.approx(a["predicted_ms"], rel=1e-9), a["plan"]
    assert second["hardware"] == first["hardware"]
