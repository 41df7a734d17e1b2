"""Benchmark: `recscale train` on its defaults against the engine, TorchRec's loop and a busy machine.

For one model and data source it measures, in interleaved turns (A B C D A B C D ...):

* ``harness``: recscale's engine timed the way ``benchmarks/e2e.py`` times it (its worker
  process, by import: pre-made batches, warm-up steps untimed);
* ``train``: ``recscale train`` with default settings (threads, loader workers, pipeline,
  progress bar), a subprocess as users run it; its rate is the summary's train rate
  (``--summary-json``), so start-up, data parsing and evaluation are excluded;
* ``train, 1 busy process``: the same while one other process spins on the machine;
* ``torchrec``: TorchRec's training loop on the same shape (``benchmarks/e2e.py``'s TorchRec
  worker: DistributedModelParallel, FBGEMM's fused row-wise Adagrad, the plain loop a TorchRec
  user writes).

Cases: ``criteo-1m`` (26 tables of 1M rows, dim 64, MLPs 512-256-64 / 512-256-1, batch 2048,
synthetic data) and ``criteo-10k`` (``configs/criteo_10k.toml`` as shipped; the harness and
TorchRec run that model's shape on synthetic batches). Only one system's process is alive at a
time (each holds whole tables), so every turn builds its system; builds are not timed.

    python benchmarks/trainer_defaults.py                 # both cases, 3 rounds
    python benchmarks/trainer_defaults.py --quick         # tiny tables, one round: a smoke run
    python benchmarks/trainer_defaults.py --cases criteo-1m --rounds 5 --json out/defaults.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch.distributed as dist  # noqa: E402
from _common import environment, format_table, write_json  # noqa: E402
from _e2e_spec import ModelSpec  # noqa: E402
from _e2e_systems import torchrec_available  # noqa: E402
from e2e import Worker, worker_env  # noqa: E402

from recscale.comm.local_processes import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HARNESS_THREADS = 2  # e2e.py's one-process setup


@dataclass
class Case:
    """One model and data source: the trainer's config (file and overrides) and the same shape
    as the harness's ModelSpec."""

    name: str
    spec: ModelSpec
    config: str | None
    overrides: list[str]
    steps: int  # trainer steps per turn (one epoch of this many batches); harness steps per turn
    warmup: int = 3
    num_batches: int = 16
    notes: list[str] = field(default_factory=list)


def criteo_1m(quick: bool, rows: int | None = None) -> Case:
    """``rows``: per table instead of 1M (10k with ``quick``)."""
    batch, steps = (256, 10) if quick else (2048, 150)
    rows = rows or (10_000 if quick else 1_000_000)
    spec = ModelSpec("criteo-1m", (rows,) * 26, (1,) * 26, 64, (512, 256, 64), (512, 256, 1), batch)
    # 26 values: with synthetic data the list's length is the number of features.
    sets = [f"model.table_rows=[{','.join([str(rows)] * 26)}]", "model.embedding_dim=64", "model.bottom_mlp=[512,256,64]",
            "model.top_mlp=[512,256,1]", f"train.batch_size={batch}", f"data.num_samples={steps * batch}",
            "data.eval_samples=4096"]
    notes = [] if rows == 1_000_000 else [f"criteo-1m: {rows:,} rows per table instead of 1M (--rows)"]
    return Case("criteo-1m", spec, None, sets, steps, num_batches=4 if quick else 16, notes=notes)


def criteo_10k(quick: bool, rows: int | None = None) -> Case:
    """The shipped Criteo 10k config; the harness gets its model shape (rows from the data)."""
    from recscale.train.config import load_config
    from recscale.train.datasets import build_data, with_table_rows

    config = str(ROOT / "configs" / "criteo_10k.toml")
    cfg = load_config(config, [])
    data = build_data(cfg)
    cfg = with_table_rows(cfg, data.table_rows)
    m = cfg.model
    spec = ModelSpec("criteo-10k", tuple(cfg.model.rows_for(26)), (1,) * 26, m.embedding_dim, tuple(m.bottom_mlp),
                     tuple(m.top_mlp), cfg.train.batch_size)
    return Case("criteo-10k", spec, config, [], len(data.train), warmup=10, num_batches=16,
                notes=["criteo-10k: harness and TorchRec train its shape on synthetic batches; the trainer reads the file"])


CASES: dict[str, Callable[[bool, int | None], Case]] = {"criteo-1m": criteo_1m, "criteo-10k": criteo_10k}


# --------------------------------------------------------------------------- the systems' turns


def harness_turn(system: str, case: Case, log_dir: Path) -> float:
    """samples/s of one turn of an e2e.py worker (``recscale`` or ``torchrec``): build, warm up,
    then ``case.steps`` timed steps; the worker exits after the turn."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    # e2e.py's default worker environment (threads, allocator, OpenMP waiting).
    w = Worker(f"{system}-{case.name}", system, 1, worker_env(HARNESS_THREADS, True), f"127.0.0.1:{port}", store,
               log_dir)
    try:
        if not w.call("build", system=system, spec=case.spec.to_dict(), num_batches=case.num_batches):
            raise RuntimeError(f"{system}: build failed ({w.error})")
        if not w.call("run", steps=case.warmup):
            raise RuntimeError(f"{system}: warm-up failed ({w.error})")
        res = w.call("run", steps=case.steps)
        if not res:
            raise RuntimeError(f"{system}: run failed ({w.error})")
        return case.steps * case.spec.batch_size / res[0]["seconds"]
    finally:
        w.close()


# The busy process: spins until stopped, or until its parent (this driver) is gone.
SPIN = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


def train_turn(case: Case, busy: bool, tmp: Path, log_dir: Path, turn: int) -> float:
    """samples/s (the summary's train rate) of ``recscale train`` on its defaults, with one
    spinning process alive during the whole run when ``busy``."""
    out = tmp / f"summary-{turn}.json"
    cmd = [sys.executable, "-m", "recscale", "train", "--summary-json", str(out)]
    cmd += ["--config", case.config] if case.config else []
    for o in case.overrides:
        cmd += ["--set", o]
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        with open(log_dir / f"train-{case.name}-{turn}{'-busy' if busy else ''}.log", "w") as log:
            p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if p.returncode:
        raise RuntimeError(f"recscale train exited with {p.returncode}; see {log.name}")
    return float(json.loads(out.read_text())["train_samples_per_sec"])


# --------------------------------------------------------------------------- driver

SYSTEMS = ("harness", "train", "train-busy", "torchrec")
LABELS = {"harness": "engine (e2e.py harness)", "train": "recscale train, defaults",
          "train-busy": "recscale train, defaults, 1 busy process", "torchrec": "TorchRec loop (e2e.py worker)"}


def run_case(case: Case, systems: list[str], rounds: int, tmp: Path, log_dir: Path) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {s: [] for s in systems}
    turn = 0
    for r in range(rounds):
        for s in systems:
            turn += 1
            if s == "harness":
                rate = harness_turn("recscale", case, log_dir)
            elif s == "torchrec":
                rate = harness_turn("torchrec", case, log_dir)
            else:
                rate = train_turn(case, s == "train-busy", tmp, log_dir, turn)
            rates[s].append(rate)
            print(f"[{case.name}] round {r + 1}/{rounds} {s}: {rate:,.0f} samples/s", file=sys.stderr, flush=True)
    return rates


def summarize(case: Case, rates: dict[str, list[float]]) -> list[dict[str, Any]]:
    med = {s: statistics.median(v) for s, v in rates.items() if v}
    rows = []
    for s, v in rates.items():
        m = med[s]
        rows.append({
            "case": case.name, "system": s, "label": LABELS[s], "rounds_samples_per_s": v,
            "samples_per_s": {"median": m, "min": min(v), "max": max(v)},
            "share_of_harness": m / med["harness"] if "harness" in med and s.startswith("train") else None,
            "vs_torchrec": m / med["torchrec"] if "torchrec" in med and s != "torchrec" else None,
            "loaded_over_unloaded": m / med["train"] if s == "train-busy" and "train" in med else None,
        })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    pct = lambda x: f"{100 * x:.0f}%" if x is not None else "-"  # noqa: E731
    table = [[x["case"], x["label"],
              f"{x['samples_per_s']['median']:,.0f} ({x['samples_per_s']['min']:,.0f}-{x['samples_per_s']['max']:,.0f})",
              pct(x["share_of_harness"]), f"{x['vs_torchrec']:.2f}x" if x["vs_torchrec"] else "-",
              pct(x["loaded_over_unloaded"])] for x in rows]
    print(format_table(["case", "system", "samples/s median (min-max)", "of harness", "vs TorchRec loop",
                        "loaded / unloaded"], table, right_align_from=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="criteo-1m,criteo-10k", help=f"comma-separated, from {sorted(CASES)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {list(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=None, help="interleaved turns per system (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="tiny tables and batches, one round: a smoke run")
    p.add_argument("--rows", type=int, default=None, help="criteo-1m: rows per table (default 1M; a smaller "
                   "model where memory is short: each process holds its tables, 6.7 GB at 1M)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.rows is not None and args.rows < 1:
        raise SystemExit(f"--rows must be >= 1, got {args.rows}")
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    systems = [s for s in args.systems.split(",") if s]
    if any(s not in SYSTEMS for s in systems):
        raise SystemExit(f"--systems: unknown {[s for s in systems if s not in SYSTEMS]}; choose from {list(SYSTEMS)}")
    notes = []
    why = torchrec_available()
    if "torchrec" in systems and why:
        systems.remove("torchrec")
        notes.append(f"torchrec: not importable ({why}); see benchmarks/README.md to install it")
    rows: list[dict[str, Any]] = []
    cases = [CASES[c](args.quick, args.rows) for c in args.cases.split(",")]
    with tempfile.TemporaryDirectory(prefix="recscale-defaults-") as d:
        tmp = Path(d)
        log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"recscale-defaults-{os.getpid()}"
        log_dir.mkdir(parents=True, exist_ok=True)
        for case in cases:
            rows += summarize(case, run_case(case, systems, rounds, tmp, log_dir))
            notes += case.notes
    print_table(rows)
    for n in notes:
        print(n)
    print(f"{rounds} round(s), systems in turn, one process alive at a time; harness and TorchRec: {HARNESS_THREADS} "
          f"threads, warm-up untimed; train: its summary's train rate; logs in {log_dir}")
    print("targets: train >= 90% of the harness and >= 1.3x the TorchRec loop; >= 40% kept with 1 busy process")
    if args.json:
        write_json(args.json, {"benchmark": "trainer_defaults", "environment": environment(), "rounds": rounds,
                               "cases": {c.name: {"spec": c.spec.to_dict(), "config": c.config, "overrides": c.overrides,
                                                  "steps": c.steps} for c in cases},
                               "results": rows, "notes": notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
