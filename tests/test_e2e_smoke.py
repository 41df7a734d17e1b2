"""Smoke test of benchmarks/e2e.py: its --quick mode races recscale (plain, sharded at one
process) against plain PyTorch on the DCNv2 config, 1 process and 2 ranks, and TorchRec where
it is installed (where it is not, its systems are skipped with a note); prints the table and
writes the JSON. No timing assertions. The bf16 twins are left out (they double the run's
time; bf16 training has tests of its own)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import proc_utils

REPO = Path(__file__).resolve().parents[1]


def test_e2e_quick_runs_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/e2e.py", "--quick", "--configs", "dcnv2", "--bf16-configs", "",
         "--batch-size", "64", "--systems", "recscale,recscale-sharded,plain,torchrec", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]  # a failed worker's log tail is on stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("config"))
    for col in ("system", "samples/s median (min-max)", "vs torchrec", "vs plain", "peak RSS GiB", "embeddings", "mlp",
                "comm", "of roofline"):
        assert col in header
    data = json.loads(out.read_text())
    rows = data["results"]
    got = {(r["config"], r["setup"], r["system"]) for r in rows}
    skipped = any("torchrec systems skipped" in n for n in data["notes"])
    if not all(importlib.util.find_spec(m) is not None for m in ("torchrec", "fbgemm_gpu")):
        assert skipped  # not installed: skipped with a note, the rest still races
    for config in ("dcnv2",):  # one config keeps it short; other tests train criteo-dlrm
        for setup in ("1proc", "2ranks"):
            assert {(config, setup, "recscale"), (config, setup, "plain")} <= got
            assert ((config, setup, "torchrec") in got) != skipped
        assert (config, "1proc", "recscale-sharded") in got
        assert (config, "2ranks", "recscale-sharded") not in got  # at 2 ranks recscale itself is sharded
    assert not any(r["system"].endswith("-bf16") for r in rows)  # no --bf16-configs: no bf16 twins
    for r in rows:
        # a worker that died (its log's tail, with its threads' stacks, is on stderr) says so
        assert not r["error"], f"{r['setup']} {r['system']}: {r['error']}\n{proc.stderr[-5000:]}"
        assert r["samples_per_s"]["median"] > 0 and r["peak_rss_bytes"] > 0
        assert abs(sum(r["time_shares"].values()) - 1.0) < 1e-6
        assert 0 < r["roofline_share"]
        assert r["process"]["OMP_WAIT_POLICY"] == "PASSIVE" and "mmap_threshold" in r["process"]["GLIBC_TUNABLES"]
        peer = next(p for p in rows if (p["config"], p["setup"], p["system"]) == (r["config"], r["setup"], "plain"))
        assert abs(r["vs_plain"] - r["samples_per_s"]["median"] / peer["samples_per_s"]["median"]) < 1e-9
    assert data["machine"]["mem_bw_gbs"] > 0 and data["machine"]["fp32_gflops"] > 0
    assert data["specs"][0]["interaction"] == "dcn" and data["specs"][0]["dcn_low_rank"] == 512


def test_systems_that_do_not_fit_together_race_in_groups_that_do() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import e2e
        from _e2e_spec import make_spec
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    spec = make_spec("criteo-dlrm")
    systems = ["recscale", "torchrec", "plain", "recscale-bf16", "torchrec-bf16", "plain-bf16", "recscale-tuned"]
    assert e2e.memory_groups(spec, systems, 1, 64, float("inf")) == [systems]
    one = e2e.memory_estimate(spec, "recscale", 1, 64)
    groups = e2e.memory_groups(spec, systems, 1, 64, 3.5 * one)
    # Each group fits, the compared trios stay whole, and every system races once.
    assert groups == [systems[:3], systems[3:6], systems[6:]]
    assert e2e.memory_groups(spec, systems[:3], 1, 64, 1.5 * one) == [[s] for s in systems[:3]]
    # Plain PyTorch replicates its tables on every rank; the sharded systems do not.
    assert e2e.memory_estimate(spec, "plain", 2, 64) - e2e.memory_estimate(spec, "recscale", 2, 64) > spec.table_bytes()


def test_dcnv2_dense_quick_times_every_dense_part_and_prints_the_bound() -> None:
    proc = proc_utils.run([sys.executable, "benchmarks/dcnv2_dense.py", "--quick", "--batch-size", "64"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:] + proc.stdout[-3000:]
    names = {f"{s} {part}" for s in ("recscale", "plain", "torchrec") for part in ("dense", "step")}
    rows = {line[:16].strip(): line[16:].split() for line in proc.stdout.splitlines() if line[:16].strip() in names}
    has_torchrec = all(importlib.util.find_spec(m) is not None for m in ("torchrec", "fbgemm_gpu"))
    want = {"recscale dense", "plain dense", "recscale step", "plain step"}
    want |= {"torchrec dense", "torchrec step"} if has_torchrec else set()
    assert set(rows) == want
    for name, cols in rows.items():
        wall_ms, samples, cpu_ms = float(cols[0]), float(cols[1].replace(",", "")), float(cols[2])
        assert wall_ms > 0 and cpu_ms > 0 and abs(samples - 64 / (wall_ms / 1e3)) <= 0.01 * samples + 1, name
    assert ("Amdahl bound vs torchrec" in proc.stdout) == has_torchrec
