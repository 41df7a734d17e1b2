"""Benchmark: end-to-end DLRM training, recscale against TorchRec and plain PyTorch, one run.

Every system trains the same model on the same batches (recscale's synthetic generator, fixed
seed, Zipf ids; every planner is told the generator's pooling factors and skew) in its own
worker process (or ``torchrun`` job of 2 ranks) started by this harness with one environment for
all (threads, OpenMP waiting, glibc allocator settings: ``worker_env``), so each one's memory is
its own and no system tunes a process the others do not get. A driver makes them take turns
(A B C A B C ...), so a slow phase of the machine hits all of them alike. Prints, per config
and setup, the median samples/s over the turns (min-max), the ratio to the fastest TorchRec
row and to plain PyTorch, peak RSS, where a step's time goes (data, embeddings, MLPs,
communication, other; from profiled steps) and each system's share of the roofline bound of
this machine (measured here: memory bandwidth and matmul FLOP/s).

    python benchmarks/e2e.py                               # every config, 1 process and 2 ranks
    python benchmarks/e2e.py --configs dcnv2 --setups 1proc --rounds 3
    python benchmarks/e2e.py --configs dcnv2 --systems recscale,torchrec,plain --rounds 2 --steps 10 \
        --warmup 2 --num-batches 32 --profile-steps 1   # dcnv2, 1 process and 2 ranks, ~7 min (estimated)
    python benchmarks/e2e.py --quick --json out/e2e.json   # tiny sizes, a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
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
from _common import environment, write_json  # noqa: E402
from _e2e_profile import breakdown, peak_rss_bytes, release_memory, reset_peak_rss  # noqa: E402
from _e2e_report import add_ratios, measure_machine, precision, print_table, roofline_samples_per_s  # noqa: E402
from _e2e_spec import CONFIGS, ModelSpec, embedding_bytes_per_step, make_batches, make_spec  # noqa: E402
from _e2e_systems import BF16_SYSTEMS, BUILDERS, ONE_PROCESS_ONLY, TORCHREC_SYSTEMS, torchrec_available  # noqa: E402

from recscale.comm.local_processes import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETUPS = {"1proc": (1, 2), "2ranks": (2, 1)}  # name: (ranks, threads per rank)
MAX_BF16_STEP_S = 2.0
# A worker with torch (and TorchRec) imported holds 0.27-0.38 GB resident, part of it shared
# library pages counted once; a built dcnv2 worker (batch 2048) held 1.75 GB: 0.44 tables, 0.22
# batches, the rest a step's activations, gradients and allocator slack (dcnv2's are the widest).
IDLE_WORKER_BYTES = 2**28
STEP_BYTES_PER_SAMPLE = 0.75 * 2**30 / 2048
DEFAULT_SYSTEMS = "recscale,recscale-tuned,recscale-sharded,torchrec,torchrec-tw,torchrec-ebc,plain"
# What recscale's in-process tuning does (recscale.host_memory, recscale.train.process_tuning),
# given by the harness to every worker instead: glibc keeps freed blocks under 1 GiB and never
# trims the heap top (mallopt's M_MMAP_THRESHOLD / M_TRIM_THRESHOLD), malloc asks for transparent
# huge pages for what it maps (recscale advises them for its tables), and idle OpenMP threads sleep.
TUNED_ENV = {
    "GLIBC_TUNABLES": ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=1073741824:"
                       "glibc.malloc.trim_threshold=2147483647"),
    "OMP_WAIT_POLICY": "PASSIVE",
}


def worker_env(threads: int, tuned: bool) -> dict[str, str]:
    """The environment of every worker: this one's, the thread counts, and ``TUNED_ENV``
    (or, untuned, the allocator and OpenMP defaults: the keys removed)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    for k, v in TUNED_ENV.items():
        if tuned:
            env[k] = v
        else:
            env.pop(k, None)
    return env


# --------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> int:
    """One system's process (or rank): executes the driver's commands from the store in order."""
    faulthandler.enable()  # a native crash (SIGSEGV) leaves every thread's Python stack in the worker's log
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    host, port = args.store.split(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=600))
    system, batches = None, []
    cursor, seq = 0, 0
    while True:
        key = f"{args.worker}/cmd/{seq}"
        store.wait([key])
        cmd = json.loads(store.get(key))
        result: dict[str, Any] = {}
        try:
            if cmd["op"] in ("build", "drop"):
                system, batches, cursor = None, [], 0
                release_memory()
            if cmd["op"] == "build":
                reset_peak_rss()
                spec = ModelSpec.from_dict(cmd["spec"])
                t0 = time.perf_counter()
                batches = make_batches(spec, rank, world, cmd["num_batches"])
                result["data_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                system = BUILDERS[cmd["system"]](spec)
                result["build_s"] = time.perf_counter() - t0
                result["plan"] = getattr(system, "plan_summary", None)
                seen = ("OMP_WAIT_POLICY", "GLIBC_TUNABLES", "OMP_NUM_THREADS")
                result["process"] = {"torch_threads": torch.get_num_threads(), **{k: os.environ.get(k) for k in seen}}
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

    def __init__(self, wid: str, system: str, ranks: int, env: dict[str, str], store_addr: str, store,
                 log_dir: Path) -> None:
        self.wid, self.system, self.ranks, self.store = wid, system, ranks, store
        self.seq = 0
        self.error: str | None = None
        threads = env["OMP_NUM_THREADS"]
        tail = [str(ROOT / "benchmarks/e2e.py"), "--worker", wid, "--store", store_addr, "--threads", threads]
        if ranks == 1:
            cmd = [sys.executable] + tail
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}"] + tail
        self.log = open(log_dir / f"{wid}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def call(self, op: str, timeout_s: float = 1800.0, **kw) -> list[dict[str, Any]] | None:
        """Send one command; return every rank's result (None once the worker has failed)."""
        if self.error:
            return None
        self.store.set(f"{self.wid}/cmd/{self.seq}", json.dumps({"op": op, **kw}))
        keys = [f"{self.wid}/res/{self.seq}/{r}" for r in range(self.ranks)]
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


def memory_estimate(spec: ModelSpec, system: str, ranks: int, num_batches: int) -> float:
    """Bytes one system's job is expected to hold with a model built, beyond an idle worker's
    ``IDLE_WORKER_BYTES``: its tables (replicated on every rank by plain PyTorch's DDP), the
    batches and a step's working memory."""
    tables = spec.table_bytes() * (ranks if system.startswith("plain") else 1)
    return 1.2 * tables + ranks * (num_batches * spec.batch_bytes() + spec.batch_size * STEP_BYTES_PER_SAMPLE)


# Systems compared with each other stay in one group where they fit: the headline trio, the bf16
# trio, recscale's variants, TorchRec's variants.
UNITS = (("recscale", "torchrec", "plain"), ("recscale-bf16", "torchrec-bf16", "plain-bf16"),
         ("recscale-tuned", "recscale-sharded", "recscale-nopipe"), ("torchrec-tw", "torchrec-ebc"))


def memory_groups(spec: ModelSpec, systems: list[str], ranks: int, num_batches: int, budget: float) -> list[list[str]]:
    """Split ``systems`` into groups that fit in ``budget`` bytes together, keeping each of
    ``UNITS`` whole where it fits; each group races on its own (its workers hold their models
    at once)."""
    units = [[s for s in u if s in systems] for u in UNITS]
    units = [u for u in units if u] + [[s] for s in systems if not any(s in u for u in UNITS)]
    groups: list[list[str]] = [[]]
    used = 0.0
    for unit in units:
        need = sum(memory_estimate(spec, s, ranks, num_batches) for s in unit)
        parts = [unit] if need <= budget else [[s] for s in unit]  # a unit too big alone is split
        for part in parts:
            need = sum(memory_estimate(spec, s, ranks, num_batches) for s in part)
            if groups[-1] and used + need > budget:
                groups.append([])
                used = 0.0
            groups[-1] += part
            used += need
    return groups


def available_memory() -> float:
    """MemAvailable from /proc/meminfo, bytes (inf where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def race(workers: list[Worker], spec: ModelSpec, setup: str, args) -> list[dict]:
    """One group's race: build one at a time, warm up, take turns, profile, then free."""
    ranks, threads = SETUPS[setup]
    group = [w.system for w in workers]
    rows = []
    try:
        built: dict[str, dict] = {}
        for w in workers:  # one at a time: builds allocate whole tables
            res = w.call("build", system=w.system, spec=spec.to_dict(), num_batches=args.num_batches)
            if res:
                built[w.system] = res[0]
        times: dict[str, list[float]] = {w.system: [] for w in workers}
        for r in range(args.rounds + 1):  # round 0 warms up
            for w in workers:
                res = w.call("run", steps=args.warmup if r == 0 else args.steps)
                if res and r > 0:
                    times[w.system].append(res[0]["seconds"])
        prof: dict[str, dict] = {}
        for w in workers:
            res = w.call("profile", steps=args.profile_steps)
            if res:
                prof[w.system] = {"shares": res[0]["shares"], "peak_rss": sum(x["peak_rss"] for x in res)}
        for w in workers:
            samples = args.steps * spec.batch_size * ranks
            sps = [samples / t for t in times[w.system]]
            b = built.get(w.system, {})
            rows.append({
                "config": spec.name, "setup": setup, "system": w.system, "ranks": ranks, "threads": threads,
                "group": group, "error": w.error,
                "samples_per_s": {"median": statistics.median(sps), "min": min(sps), "max": max(sps)} if sps else None,
                "rounds_samples_per_s": sps,
                "peak_rss_bytes": prof.get(w.system, {}).get("peak_rss"),
                "time_shares": prof.get(w.system, {}).get("shares"),
                "emb_bytes_per_sample": b.get("emb_bytes_per_sample"),
                **{k: b.get(k) for k in ("build_s", "data_s", "process", "plan")},
            })
    finally:
        for w in workers:  # the next group's models need the memory
            w.call("drop")
    return rows


def run_setup(setup: str, specs: list[ModelSpec], systems_for, args, log_dir: Path, notes: list[str]) -> list[dict]:
    """Every config's race at one setup; one worker (process or torchrun job) per system serves
    every config, freeing each model before the next is built."""
    ranks, threads = SETUPS[setup]
    env = worker_env(threads, args.worker_env == "tuned")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    names = [s for s in BUILDERS if any(s in systems_for(spec, setup) for spec in specs)]
    # Every worker stays up for the whole setup; the models of one group share the rest.
    budget = (args.memory_gb * 2**30 if args.memory_gb else 0.85 * available_memory())
    budget -= len(names) * ranks * IDLE_WORKER_BYTES
    workers = {s: Worker(f"{s}-{setup}", s, ranks, env, f"127.0.0.1:{port}", store, log_dir) for s in names}
    rows: list[dict] = []
    try:
        for spec in specs:
            groups = memory_groups(spec, systems_for(spec, setup), ranks, args.num_batches, budget)
            if len(groups) > 1:
                notes.append(f"{spec.name} {setup}: raced in {len(groups)} groups to fit {budget / 2**30:.1f} GiB: "
                             + " | ".join(",".join(g) for g in groups))
            this = []
            for group in groups:
                this += race([workers[s] for s in group], spec, setup, args)
            ebps = next((x["emb_bytes_per_sample"] for x in this if x["emb_bytes_per_sample"]), None)
            for x in this:
                x["emb_bytes_per_sample"] = ebps
            rows += this
    finally:
        for w in workers.values():
            w.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    p.add_argument("--setups", default="1proc,2ranks", help="1proc (1 process, 2 threads), 2ranks (torchrun, 1 thread each)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"fp32 systems (default {DEFAULT_SYSTEMS}; also recscale-nopipe); "
                        "recscale-sharded and torchrec-ebc run at one process only")
    p.add_argument("--bf16-configs", default="criteo-dlrm,dcnv2",
                   help="configs that also race the bf16 systems (recscale-, torchrec-, plain-bf16; '' for none)")
    p.add_argument("--rounds", type=int, default=5, help="timed turns per system")
    p.add_argument("--steps", type=int, default=20, help="training steps per turn")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before the first turn")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--num-batches", type=int, default=64, help="distinct batches, cycled through by the turns")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 2048; --quick 256)")
    p.add_argument("--worker-env", choices=("tuned", "bare"), default="tuned",
                   help="tuned: every worker gets the allocator and OpenMP settings of TUNED_ENV; bare: none")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory the systems of one config may hold at once (default 85%% of what is available)")
    p.add_argument("--quick", action="store_true", help="tiny tables and batches, few steps")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.profile_steps, args.num_batches = 2, 2, 1, 1, 2
    for name in ("rounds", "steps", "num_batches", "profile_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    specs = [make_spec(c, args.quick, args.batch_size) for c in args.configs.split(",") if c]
    setups = [s for s in args.setups.split(",") if s]
    for setup in setups:
        if setup not in SETUPS:
            raise SystemExit(f"--setups: unknown {setup!r}; choose from {', '.join(SETUPS)}")
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in BUILDERS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {', '.join(BUILDERS)}")
    bf16_configs = [c for c in args.bf16_configs.split(",") if c]
    notes: list[str] = []
    machine = measure_machine(2, args.quick)
    why = torchrec_available()
    if why and any(s in TORCHREC_SYSTEMS for s in systems):
        notes.append(f"torchrec systems skipped: TorchRec not importable ({why}); see benchmarks/README.md")
    for spec in specs:  # emulated bf16 (no bf16 instructions) can make a step take minutes
        step_s = spec.mlp_flops_per_sample() * spec.batch_size / (machine["bf16_gflops"] * 1e9)
        if spec.name in bf16_configs and step_s > MAX_BF16_STEP_S:
            bf16_configs.remove(spec.name)
            notes.append(f"{spec.name}: bf16 systems skipped: this CPU multiplies bf16 at {machine['bf16_gflops']:.0f} "
                         f"GFLOP/s (fp32 {machine['fp32_gflops']:.0f}), at least {step_s:.0f} s a step")

    def systems_for(spec: ModelSpec, setup: str) -> list[str]:
        wanted = set(systems)
        if spec.name in bf16_configs:  # the bf16 twin of every fp32 system raced
            wanted |= {b for b in BF16_SYSTEMS if b.replace("-bf16", "") in systems}
        return [s for s in BUILDERS if s in wanted and not (why and s in TORCHREC_SYSTEMS)
                and not (SETUPS[setup][0] > 1 and s in ONE_PROCESS_ONLY)]

    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"recscale-e2e-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows: list[dict] = []
    for setup in setups:
        rows += run_setup(setup, specs, systems_for, args, log_dir, notes)
    # The machine's best of two measurements, before and after the race: a busy moment during
    # one of them would otherwise lower the roofline below what the systems reached.
    after = measure_machine(2, args.quick)
    machine = {k: max(v, after[k]) for k, v in machine.items()}
    for x in rows:
        if x["emb_bytes_per_sample"] and x["samples_per_s"]:
            spec = next(s for s in specs if s.name == x["config"])
            bound = roofline_samples_per_s(spec, x["emb_bytes_per_sample"], machine, precision(x["system"]))
            x["roofline_samples_per_s"] = bound
            x["roofline_share"] = x["samples_per_s"]["median"] / bound
    add_ratios(rows)
    plans = sorted({f"{x['config']} {x['setup']} {x['system']}: "
                    + ", ".join(f"{k} x{v}" for k, v in sorted(x["plan"]["chosen"].items()))
                    for x in rows if x.get("plan") and "unsharded" not in x["plan"].get("chosen", {"unsharded": 1})
                    and not x["system"].endswith("-bf16")})
    notes += [f"plan {p}" for p in plans]
    print_table(rows, notes)
    print(f"machine: {machine['mem_bw_gbs']:.1f} GB/s copy bandwidth, {machine['fp32_gflops']:.0f} GFLOP/s fp32 and "
          f"{machine['bf16_gflops']:.0f} GFLOP/s bf16 matmul (2 threads); roofline = the slower of embedding bytes "
          "at that bandwidth and matmul FLOPs at that speed (bf16 rows: at the bf16 speed)")
    env = TUNED_ENV if args.worker_env == "tuned" else {}
    print(f"every worker: {' '.join(f'{k}={v}' for k, v in env.items()) or 'allocator and OpenMP defaults'}; "
          f"row caps: {', '.join(f'{s.name} {s.row_cap:,}' for s in specs)}")
    print(f"batch {specs[0].batch_size} per rank; {args.rounds} turns of {args.steps} steps per system over "
          f"{args.num_batches} batches, alternating, after {args.warmup} warm-up steps; shares from "
          f"{args.profile_steps} profiled step(s) of rank 0; peak RSS summed over ranks; "
          f"{time.monotonic() - t0:.0f} s; logs in {log_dir}")
    if args.json:
        write_json(args.json, {"benchmark": "e2e", "environment": environment(), "args": vars(args),
                               "machine": machine, "worker_env": env, "specs": [s.to_dict() for s in specs],
                               "results": rows, "notes": notes})
    return 0 if all(x["samples_per_s"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
