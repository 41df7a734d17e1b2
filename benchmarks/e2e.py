"""Benchmark: end-to-end DLRM training, recscale against TorchRec and plain PyTorch, one run.

Every system trains the same model on the same batches (recscale's synthetic generator, fixed
seed, Zipf ids) in its own worker process (or ``torchrun`` job of 2 ranks), so each one's peak
memory is its own; a driver makes them take turns (A B C A B C ...), so a slow phase of the
machine hits all of them alike. Prints, per config and setup, the median samples/s over the
rounds (min-max), the ratio to TorchRec, peak RSS, where a step's time goes (data, embeddings,
MLPs, communication, other; from one profiled step) and each system's share of the roofline
bound of this machine (measured here: memory bandwidth and matmul FLOP/s).

    python benchmarks/e2e.py                               # both configs, 1 process and 2 ranks
    python benchmarks/e2e.py --configs multi-hot --setups 2ranks --rounds 7
    python benchmarks/e2e.py --quick --json out/e2e.json   # tiny sizes, under a minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import environment, format_table, write_json  # noqa: E402
from _e2e_systems import (  # noqa: E402
    BUILDERS,
    ModelSpec,
    breakdown,
    embedding_bytes_per_step,
    make_batches,
    make_spec,
    peak_rss_bytes,
    reset_peak_rss,
    torchrec_available,
)

from recscale.comm.local_processes import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETUPS = {"1proc": (1, 2), "2ranks": (2, 1)}  # name: (ranks, threads per rank)
CATEGORIES = ("data", "embeddings", "mlp", "comm", "other")


# --------------------------------------------------------------------------- machine limits


def measure_machine(threads: int, quick: bool) -> dict[str, float]:
    """Streaming memory bandwidth (copy: bytes read + written) and square-matmul FLOP/s."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = (16 if quick else 64) << 20  # floats
        a, b = torch.ones(n), torch.empty(n)
        b.copy_(a)
        best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
        bw = 2 * n * 4 / best
        out = {"mem_bw_gbs": bw / 1e9}
        m = 1024 if quick else 2048
        out["fp32_gflops"] = _matmul_gflops(m, torch.float32, 5)
        # bf16 gets a small probe first: without bf16 instructions it runs at about 1 GFLOP/s,
        # and the full-size matmul would take minutes to say so.
        out["bf16_gflops"] = _matmul_gflops(256, torch.bfloat16, 1)
        if out["bf16_gflops"] >= out["fp32_gflops"] / 10:
            out["bf16_gflops"] = _matmul_gflops(m, torch.bfloat16, 5)
        return out
    finally:
        torch.set_num_threads(old)


def _matmul_gflops(m: int, dtype: torch.dtype, repeats: int) -> float:
    x, y = torch.randn(m, m).to(dtype), torch.randn(m, m).to(dtype)
    x @ y
    best = min(_timed(lambda: x @ y) for _ in range(repeats))
    return 2 * m**3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def roofline_samples_per_s(spec: ModelSpec, emb_bytes_per_sample: float, machine: dict[str, float], dtype: str) -> float:
    """The most samples/s this machine allows: a step can go no faster than its embedding bytes
    at full memory bandwidth or its matmul FLOPs at full matmul speed (whichever is slower)."""
    t_mem = emb_bytes_per_sample / (machine["mem_bw_gbs"] * 1e9)
    t_mlp = spec.mlp_flops_per_sample() / (machine[f"{dtype}_gflops"] * 1e9)
    return 1.0 / max(t_mem, t_mlp)


# --------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> int:
    """One system's process (or rank): executes the driver's commands from the store in order."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    host, port = args.store.split(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=600))
    system, batches, spec = None, [], None
    cursor, seq = 0, 0
    while True:
        key = f"{args.worker}/cmd/{seq}"
        store.wait([key])
        cmd = json.loads(store.get(key))
        result: dict[str, Any] = {}
        try:
            if cmd["op"] == "build":
                system, batches = None, []
                reset_peak_rss()
                spec = ModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in cmd["spec"].items()})
                batches = make_batches(spec, rank, world, cmd["num_batches"])
                t0 = time.perf_counter()
                system = BUILDERS[args.worker](spec)
                result["build_s"] = time.perf_counter() - t0
                if rank == 0:
                    result["emb_bytes_per_sample"] = sum(
                        embedding_bytes_per_step(spec, b) / b.batch_size for b in batches) / len(batches)
            elif cmd["op"] == "run":
                if world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                system.run(batches, cursor, cmd["steps"])
                if world > 1:
                    dist.barrier()
                result["seconds"] = time.perf_counter() - t0
                cursor += cmd["steps"]
            elif cmd["op"] == "profile":
                result["shares"] = breakdown(system, batches, cmd["steps"])
                result["peak_rss"] = peak_rss_bytes()
            elif cmd["op"] == "quit":
                return 0
        except Exception:
            result = {"error": traceback.format_exc()}
        store.set(f"{args.worker}/res/{seq}/{rank}", json.dumps(result))
        seq += 1
        if "error" in result:
            return 1


class Worker:
    """The driver's handle on one system's process (or torchrun job)."""

    def __init__(self, system: str, ranks: int, threads: int, store_addr: str, store, log_dir: Path) -> None:
        self.system, self.ranks, self.store = system, ranks, store
        self.seq = 0
        self.error: str | None = None
        tail = [str(ROOT / "benchmarks/e2e.py"), "--worker", system, "--store", store_addr, "--threads", str(threads)]
        if ranks == 1:
            cmd = [sys.executable] + tail
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}"] + tail
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        self.log = open(log_dir / f"{system}-{ranks}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def call(self, op: str, timeout_s: float = 900.0, **kw) -> list[dict[str, Any]] | None:
        """Send one command; return every rank's result (None once the worker has failed)."""
        if self.error:
            return None
        self.store.set(f"{self.system}/cmd/{self.seq}", json.dumps({"op": op, **kw}))
        keys = [f"{self.system}/res/{self.seq}/{r}" for r in range(self.ranks)]
        self.seq += 1
        if op == "quit":
            return None
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.error = f"worker exited with status {self.proc.poll()} (see its log {self.log.name})"
                self.log.flush()
                tail = Path(self.log.name).read_text(errors="replace")[-4000:]
                print(f"[{self.system}] {self.error}; its log ends:\n{tail}", file=sys.stderr)
                return None
            time.sleep(0.005)
        results = [json.loads(self.store.get(k)) for k in keys]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            self.error = errors[0].strip().splitlines()[-1]
            print(f"[{self.system}] failed:\n{errors[0]}", file=sys.stderr)
            return None
        return results

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=30)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --------------------------------------------------------------------------- driver


def run_setup(setup: str, specs: list[ModelSpec], systems_for: dict[str, list[str]], args, machine, log_dir) -> list[dict]:
    ranks, threads = SETUPS[setup]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    names = sorted({s for v in systems_for.values() for s in v}, key=lambda s: list(BUILDERS).index(s))
    workers = {s: Worker(s, ranks, threads, f"127.0.0.1:{port}", store, log_dir) for s in names}
    rows = []
    try:
        for spec in specs:
            active = [workers[s] for s in systems_for[spec.name]]
            built: dict[str, dict] = {}
            for w in active:  # one at a time: builds allocate whole tables
                res = w.call("build", spec=spec.__dict__, num_batches=args.num_batches)
                if res:
                    built[w.system] = res[0]
            times: dict[str, list[float]] = {w.system: [] for w in active}
            for r in range(args.rounds + 1):  # round 0 warms up
                for w in active:
                    res = w.call("run", steps=args.warmup if r == 0 else args.steps)
                    if res and r > 0:
                        times[w.system].append(res[0]["seconds"])
            prof: dict[str, dict] = {}
            for w in active:
                res = w.call("profile", steps=args.profile_steps)
                if res:
                    prof[w.system] = {"shares": res[0]["shares"], "peak_rss": sum(x["peak_rss"] for x in res)}
            for w in active:
                samples = args.steps * spec.batch_size * ranks
                sps = [samples / t for t in times[w.system]]
                rows.append({
                    "config": spec.name, "setup": setup, "system": w.system, "ranks": ranks, "threads": threads,
                    "error": w.error,
                    "samples_per_s": {"median": statistics.median(sps), "min": min(sps), "max": max(sps)} if sps else None,
                    "rounds_samples_per_s": sps,
                    "peak_rss_bytes": prof.get(w.system, {}).get("peak_rss"),
                    "time_shares": prof.get(w.system, {}).get("shares"),
                    "emb_bytes_per_sample": built.get(w.system, {}).get("emb_bytes_per_sample"),
                })
            ebps = next((x["emb_bytes_per_sample"] for x in rows if x["emb_bytes_per_sample"] and x["config"] == spec.name
                         and x["setup"] == setup), None)
            for x in rows:
                if x["config"] == spec.name and x["setup"] == setup:
                    x["emb_bytes_per_sample"] = ebps
                    dtype = "bf16" if x["system"].endswith("bf16") else "fp32"
                    if ebps and x["samples_per_s"]:
                        bound = roofline_samples_per_s(spec, ebps, machine, dtype)
                        x["roofline_samples_per_s"] = bound
                        x["roofline_share"] = x["samples_per_s"]["median"] / bound
    finally:
        for w in workers.values():
            w.close()
    return rows


def print_table(rows: list[dict], notes: list[str]) -> None:
    table = []
    for x in rows:
        base = next((y for y in rows if y["config"] == x["config"] and y["setup"] == x["setup"]
                     and y["system"] == "torchrec" and y["samples_per_s"]), None)
        s = x["samples_per_s"]
        if not s:
            table.append([x["config"], x["setup"], x["system"], "failed: " + (x["error"] or "?")[:60]] + [""] * 9)
            continue
        sh = x["time_shares"] or {}
        table.append([
            x["config"], x["setup"], x["system"],
            f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})",
            f"{s['median'] / base['samples_per_s']['median']:.2f}x" if base else "-",
            f"{x['peak_rss_bytes'] / 2**30:.2f}" if x.get("peak_rss_bytes") else "-",
        ] + [f"{100 * sh[c]:.0f}%" if c in sh else "-" for c in CATEGORIES]
          + [f"{100 * x['roofline_share']:.0f}%" if x.get("roofline_share") else "-"])
    headers = ["config", "setup", "system", "samples/s median (min-max)", "vs torchrec", "peak RSS GiB",
               "data", "embeddings", "mlp", "comm", "other", "of roofline"]
    print(format_table(headers, table, right_align_from=3))
    for n in notes:
        print(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="criteo-dlrm,multi-hot")
    p.add_argument("--setups", default="1proc,2ranks", help="1proc (1 process, 2 threads), 2ranks (torchrun, 1 thread each)")
    p.add_argument("--systems", default="recscale,torchrec,plain")
    p.add_argument("--bf16-configs", default="criteo-dlrm", help="configs that also run recscale's bf16 MLP mode ('' for none)")
    p.add_argument("--rounds", type=int, default=5, help="timed turns per system")
    p.add_argument("--steps", type=int, default=6, help="training steps per turn")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first turn")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--num-batches", type=int, default=4, help="distinct batches cycled")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 2048; --quick 256)")
    p.add_argument("--quick", action="store_true", help="tiny tables and batches, few steps: under a minute")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.profile_steps, args.num_batches = 2, 2, 1, 1, 2
    specs = [make_spec(c, args.quick, args.batch_size) for c in args.configs.split(",") if c]
    notes = []
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in BUILDERS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {sorted(BUILDERS)}")
    why = torchrec_available()
    if "torchrec" in systems and why:
        systems.remove("torchrec")
        notes.append(f"torchrec: not installed or not importable ({why}); see benchmarks/README.md to install it")
    systems_for = {}
    for spec in specs:
        extra = ["recscale-bf16"] if spec.name in args.bf16_configs.split(",") and "recscale" in systems else []
        systems_for[spec.name] = [s for s in list(BUILDERS) if s in systems + extra]
    machine = measure_machine(2, args.quick)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"recscale-e2e-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for setup in args.setups.split(","):
        if setup not in SETUPS:
            raise SystemExit(f"--setups: unknown {setup!r}; choose from {sorted(SETUPS)}")
        rows += run_setup(setup, specs, systems_for, args, machine, log_dir)
    print_table(rows, notes)
    print(f"machine: {machine['mem_bw_gbs']:.1f} GB/s copy bandwidth, {machine['fp32_gflops']:.0f} GFLOP/s fp32 and "
          f"{machine['bf16_gflops']:.0f} GFLOP/s bf16 matmul (2 threads); roofline = the slower of embedding bytes "
          "at that bandwidth and matmul FLOPs at that speed")
    print(f"batch {specs[0].batch_size} per rank; {args.rounds} turns of {args.steps} steps per system, alternating; "
          f"shares from {args.profile_steps} profiled step(s) of rank 0; peak RSS summed over ranks; logs in {log_dir}")
    if args.json:
        write_json(args.json, {"benchmark": "e2e", "environment": environment(), "args": vars(args),
                               "machine": machine, "specs": [s.__dict__ for s in specs], "results": rows, "notes": notes})
    return 0 if all(x["samples_per_s"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
