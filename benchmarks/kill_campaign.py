"""Kill campaign: SIGKILL a random rank of a 2-rank torchrun job at a random moment, resume with
``--resume latest``, and compare the finished job bit for bit with the uninterrupted run.

    .venv/bin/python benchmarks/kill_campaign.py --trials 20 --seed 0 --json benchmarks/results/kill_campaign.json

Each trial draws a rank (0 or 1), a moment and a step: ``step`` (right after a training step),
``checkpoint`` (in the middle of writing a checkpoint's data file, in the background writer) or
``loader`` (while a data-loader worker builds the batch of that step; the rank is killed). The
fault is injected through ``RECSCALE_FAULT`` (``recscale/faults.py``); the job must die. It is
then started again with ``--resume latest`` (fresh when the kill came before the first
checkpoint was committed) and must finish with the same final state on both ranks (a digest of
embedding shards, their optimizer state, dense parameters and optimizer state:
``benchmarks/_train_digest.py``) and the same summary (steps, samples, losses, AUC, evaluations)
as the uninterrupted run. Exit status 1 when any trial differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, format_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOMENTS = ("step", "checkpoint", "loader")
SUMMARY_KEYS = ("steps", "samples", "eval_auc", "eval_logloss", "train_logloss", "evals")
INTERVAL = 4  # steps between checkpoints


def config(quick: bool) -> list[str]:
    samples = 4096 if quick else 8192  # 16 or 32 steps of 256
    return [
        "data.source=synthetic", f"data.num_samples={samples}", "data.eval_samples=1024",
        "data.pooling_factors=[1, 3, 2, 1]", "data.num_workers=1", "model.table_rows=[1000, 5000, 300, 50]",
        "train.batch_size=256", "train.progress=false", "train.eval_every_steps=8", "dist.timeout_s=30",
        f"checkpoint.interval_steps={INTERVAL}", "checkpoint.keep_last=2",
    ]


def run_job(work: Path, name: str, ckpt: Path, overrides: list[str], extra: list[str], fault: str = "",
            timeout_s: float = 300) -> tuple[int, dict[str, Any] | None, dict[str, str], str]:
    """One 2-rank torchrun job: (exit status, rank 0's summary, digest per rank, output tail)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RECSCALE_CALIBRATE": "off"}
    env.pop("RECSCALE_FAULT", None)
    if fault:
        env["RECSCALE_FAULT"] = fault
    digests, summary = work / f"{name}-digests", work / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.2", str(ROOT / "benchmarks" / "_train_digest.py"), str(digests), "train",
           "--summary-json", str(summary), *extra]
    for o in overrides + [f"checkpoint.dir='{ckpt}'"]:
        cmd += ["--set", o]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            return 124, None, {}, out[-2000:]
    s = json.loads(summary.read_text()) if summary.is_file() and proc.returncode == 0 else None
    ranks = {p.stem: json.loads(p.read_text())["digest"] for p in sorted(digests.glob("rank*.json"))}
    return proc.returncode, s, ranks, out[-2000:]


def has_checkpoint(ckpt: Path) -> bool:
    return any(ckpt.glob("run-*/step*/manifest.json"))


def trial(work: Path, i: int, rng: random.Random, steps: int, overrides: list[str],
          ref: tuple[dict[str, Any], dict[str, str]]) -> dict[str, Any]:
    rank, moment = rng.randrange(2), rng.choice(MOMENTS)
    # After the first checkpoint, so that there is one to resume from (unless its background write
    # had not committed yet); the last checkpoint is the one written at the end.
    if moment == "checkpoint":
        step = rng.choice(range(2 * INTERVAL, steps + 1, INTERVAL))
    else:
        step = rng.randint(INTERVAL + 2, steps)
    ckpt = work / f"trial{i}-ckpt"
    t0 = time.monotonic()
    rc, _, _, out1 = run_job(work, f"trial{i}-killed", ckpt, overrides, [], f"rank={rank},step={step},at={moment}")
    row: dict[str, Any] = {"trial": i, "rank": rank, "moment": moment, "step": step, "killed_rc": rc}
    left = sorted(str(p.relative_to(ckpt)) for p in ckpt.glob("run-*/step*")) if ckpt.is_dir() else []
    row["checkpoints_left"] = left
    resume = has_checkpoint(ckpt)
    rc2, s, digests, out2 = run_job(work, f"trial{i}-resumed", ckpt, overrides, ["--resume", "latest"] if resume else [])
    row.update(resumed_rc=rc2, resumed_from=Path(s.get("resumed_from", "")).name if s else "",
               seconds=round(time.monotonic() - t0, 1))
    problems = []
    if rc == 0:
        problems.append("the fault did not fire: the job finished")
    if rc2 != 0 or s is None:
        problems.append(f"the resumed job failed (exit {rc2}): {out2[-600:]}")
    else:
        ref_s, ref_d = ref
        problems += [f"{k} differs: {s[k]!r} vs {ref_s[k]!r}" for k in SUMMARY_KEYS if s[k] != ref_s[k]]
        if digests != ref_d:
            problems.append(f"final state differs: {digests} vs {ref_d}")
    row["equal"] = not problems
    row["problems"] = problems
    if problems:
        row["killed_output"] = out1[-1000:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="16 steps instead of 32")
    ap.add_argument("--json", metavar="PATH", help="write the trials and the result as JSON")
    args = ap.parse_args()
    if args.trials < 1:
        raise SystemExit(f"--trials must be >= 1, got {args.trials}")
    overrides = config(args.quick)
    steps = (4096 if args.quick else 8192) // 256
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill-campaign-") as tmp:
        work = Path(tmp)
        rc, ref_s, ref_d, out = run_job(work, "reference", work / "reference-ckpt", overrides, [])
        if rc != 0 or ref_s is None or len(ref_d) != 2:
            print(f"the uninterrupted run failed (exit {rc}):\n{out}", file=sys.stderr)
            return 1
        rows = []
        for i in range(1, args.trials + 1):
            row = trial(work, i, rng, steps, overrides, (ref_s, ref_d))
            rows.append(row)
            print(f"trial {i}: rank {row['rank']} killed at {row['moment']} {row['step']}: "
                  f"{'equal' if row['equal'] else 'DIFFERS: ' + '; '.join(row['problems'])[:300]}", flush=True)
    passed = sum(r["equal"] for r in rows)
    print(format_table(
        ["trial", "rank", "moment", "step", "killed exit", "resumed from", "equal", "s"],
        [[r["trial"], r["rank"], r["moment"], r["step"], r["killed_rc"], r["resumed_from"] or "(fresh)",
          "yes" if r["equal"] else "NO", r["seconds"]] for r in rows],
    ))
    print(f"{passed}/{len(rows)} trials bitwise equal to the uninterrupted run ({steps} steps, 2 ranks, "
          f"{time.monotonic() - t0:.0f} s)")
    if args.json:
        write_json(args.json, {
            "benchmark": "kill_campaign", "environment": environment(), "args": vars(args), "steps": steps,
            "config": overrides, "reference": {k: ref_s[k] for k in SUMMARY_KEYS}, "trials": rows,
            "passed": passed, "total": len(rows),
        })
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
