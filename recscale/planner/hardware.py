"""Hardware descriptions the planner costs plans against: presets and calibrated files.

Bandwidths are in bytes per second per rank, memory in bytes per rank, latency in seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from recscale.atomic import write_text_atomic

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    world_size: int
    ranks_per_host: int
    memory_bytes: float  # fast memory per rank (HBM, or DDR on CPU)
    memory_bw: float  # random-gather bandwidth of embedding rows
    intra_host_bw: float  # all-to-all bandwidth per rank inside a host
    cross_host_bw: float  # all-to-all bandwidth per rank across hosts
    latency_s: float = 10e-6  # per collective
    kernel_overhead_s: float = 20e-6  # per lookup kernel launch / per shard
    # Per operator group a rank runs per step (shards of one width share a buffer: one lookup,
    # one backward, one update; every data-parallel dim is a group on every rank): the launch,
    # Python and bookkeeping of each, whatever its size. On a CPU with few threads it is
    # hundreds of microseconds, so a plan that spreads widths over ranks or replicates tables
    # of several dims pays it many times; `recscale calibrate` measures it.
    group_s: float = 0.0
    backward_factor: float = 2.0  # backward + fused update relative to forward bytes
    # Per-item costs beyond bytes moved. On a GPU they hide behind bandwidth (0 in the GPU
    # presets); on a CPU the index work (offsets, sorting ids, bucketizing, Python per feature)
    # costs as much as the bytes, so `recscale calibrate` measures them.
    id_s: float = 0.0  # per id looked up, forward + backward (offsets, sort for exact updates)
    row_s: float = 0.0  # per unique row updated
    bag_s: float = 0.0  # per pooled bag (one per sample per feature a shard serves)
    route_id_s: float = 0.0  # per id bucketized by row range at its source (row-split tables)
    # per row-split table at each source: bucketizing its ids is a handful of small operators
    # and a host sync (the shards' id counts), whatever the table's size
    route_table_s: float = 0.0
    # per id of a column shard whose optimizer keeps a whole-row statistic (row-wise Adagrad):
    # its row gradients are formed a second time to share the row's sum of squares
    column_stat_id_s: float = 0.0
    # per such column shard: selecting its features' gradients, its second sort, its part of
    # the statistic's gather (whatever the shard's size)
    column_stat_shard_s: float = 0.0
    feature_s: float = 0.0  # per feature per step at its source (input/output distribution)
    # The input and output distribution's own work, on top of the link time: per id (its
    # source packs it, its owner orders it for the operator) and per pooled value (the owner
    # packs it, the source places it in the output, and the reverse for its gradient). Tables
    # that are not data-parallel pay it even on one rank.
    dist_id_s: float = 0.0
    dist_value_s: float = 0.0
    step_overhead_s: float = 0.0  # fixed per step
    # Per byte of row gradients a data-parallel replica combines with the other replicas' (every
    # replica's gathered rows with their ids, or a dense reduce's buffer in and out), beyond one
    # rank's own work: the copies, the second pass over them, and the waits at each operator
    # group's collectives mid-backward.
    replica_byte_s: float = 0.0
    # What one collective of a data-parallel operator group (its replicas' counts, rows and
    # gradients, mid-backward) adds to every rank; None: ``latency_s``. Fitted apart from the
    # exchanges' latency: a step of several replicated tables costs about the sum of one-table
    # steps, so the collectives they share cost little, and the exchanges' latency prices them low.
    replica_latency_s: float | None = None
    # The same three costs when the collectives go through gloo's TCP transport (ranks on
    # different hosts, or shared memory off) rather than shared memory: fitted from the same
    # steps run over TCP. Inside a step a collective then costs its ranks their threads'
    # wake-ups and the network stack's work, several times an isolated round trip. None: not
    # measured (a one-rank calibration, a GPU preset), the figures above hold.
    tcp_latency_s: float | None = None
    tcp_replica_latency_s: float | None = None
    tcp_replica_byte_s: float | None = None
    # What one collective over TCP takes from its rank's cores (per log2 step, as latency_s):
    # the process's CPU time, its own thread's, gloo's and the kernel's network work, fitted
    # from the same steps' CPU time. A collective its thread does not wait in (asynchronous)
    # costs the rank this, not its latency: over TCP much of that is the peer's and the
    # wire's. None: not measured, the latency is charged.
    tcp_call_s: float | None = None
    # Ranks of one host (CPU processes) slow each other while both compute (shared memory
    # bandwidth and caches): a rank pays ``contention`` x the time it computes alongside each
    # other rank of its host (min of the two computes, averaged over the others). Measured by
    # running single-thread steps side by side. 0 on GPUs (own HBM).
    contention: float = 0.0
    # How unsteady the cores' speed is (``recscale.planner.jitter``): ranks that meet at every
    # collective wait for the slowest of them, which the collective figures above are fitted
    # net of (the simulator adds the wait to the ranks' compute). 0: not measured (one rank, a
    # GPU preset).
    sync_jitter: float = 0.0
    # Rows of a shard larger than the rank's share of the last-level cache come from DRAM: each
    # byte of a unique row touched (looked up, then updated: row and optimizer state) costs
    # ``cold_byte_s`` more, times the share of the shard that does not fit
    # (``cost_model.cold_fraction``). On a CPU this is most of a big table's cost. 0 on the GPU
    # presets (their gathers are bandwidth-bound).
    cache_bytes: float = 0.0
    cold_byte_s: float = 0.0
    # Bytes a random row read moves at least: a GPU reads whole 128-byte lines, so a shard 4
    # columns wide costs as much per id as one 32 columns wide (0: reads are exactly the row).
    min_row_read_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_host < 1 or self.world_size % self.ranks_per_host:
            raise ValueError(
                f"hardware '{self.name}': ranks_per_host {self.ranks_per_host} must divide world size {self.world_size}"
            )
        for key in ("memory_bytes", "memory_bw", "intra_host_bw", "cross_host_bw"):
            if getattr(self, key) <= 0:
                raise ValueError(f"hardware '{self.name}': {key} must be > 0")
        for key in ("latency_s", "kernel_overhead_s", "group_s", "backward_factor", "id_s", "row_s", "bag_s", "route_id_s", "route_table_s",
                    "column_stat_id_s", "column_stat_shard_s", "feature_s", "dist_id_s", "dist_value_s", "step_overhead_s", "replica_byte_s", "contention",
                    "sync_jitter", "min_row_read_bytes", "cache_bytes", "cold_byte_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"hardware '{self.name}': {key} must be >= 0")
        for key, null in (("replica_latency_s", "as latency_s"), ("tcp_latency_s", "not measured"),
                          ("tcp_replica_latency_s", "not measured"), ("tcp_replica_byte_s", "not measured"),
                          ("tcp_call_s", "not measured")):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ValueError(f"hardware '{self.name}': {key} must be >= 0 (or null: {null})")

    @property
    def replica_collective_latency_s(self) -> float:
        return self.latency_s if self.replica_latency_s is None else self.replica_latency_s

    def over_tcp(self) -> Hardware:
        """This hardware with its collectives priced as they cost over TCP, where measured."""
        pairs = (("latency_s", self.tcp_latency_s), ("replica_latency_s", self.tcp_replica_latency_s),
                 ("replica_byte_s", self.tcp_replica_byte_s))
        return replace(self, **{k: v for k, v in pairs if v is not None})

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def with_world(self, world_size: int, ranks_per_host: int | None = None) -> Hardware:
        per_host = ranks_per_host or min(self.ranks_per_host, world_size)
        return replace(self, world_size=world_size, ranks_per_host=per_host)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> Hardware:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"topology file '{p}' does not exist (make one with `recscale calibrate`)")
        try:
            d = json.loads(p.read_text())
            return Hardware(**d)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
            raise ValueError(f"topology file '{p}' is not a valid hardware description: {str(e)[:160]}") from None


# ZionEX-like (Meta's DLRM training cluster): 8 A100 per host, 320 GB HBM at 12.4 TB/s per
# host (40 GB, 1.55 TB/s per GPU), NVLink-class intra-host fabric (TorchRec's 600 GB/s default),
# one 200 Gb/s RDMA NIC per GPU (25 GB/s) across hosts. Random row gathers reach well under
# peak HBM bandwidth; TorchRec's planner uses 897 GB/s, which we adopt. Index work per id (the
# int64 id read forward and again backward, the radix sort of (id, position) pairs that makes
# the fused update exact, the segment offsets) moves about 112 bytes per id at that bandwidth;
# without it the planner splits a table with 40M rows and 100 ids per sample into 4-column
# shards, each paying the whole table's index work.
ZIONEX = Hardware(
    name="zionex",
    world_size=128,
    ranks_per_host=8,
    memory_bytes=40 * GB,
    memory_bw=897 * GB,
    intra_host_bw=600 * GB,
    cross_host_bw=25 * GB,
    latency_s=10e-6,
    kernel_overhead_s=10e-6,
    id_s=112 / (897 * GB),
    min_row_read_bytes=128,
)

# TorchRec planner defaults (HBM 32 GB at 897 GB/s, 600 GB/s intra-node, 12.5 GB/s cross-node).
TORCHREC_DEFAULTS = Hardware(
    name="torchrec-defaults",
    world_size=8,
    ranks_per_host=8,
    memory_bytes=32 * GB,
    memory_bw=897 * GB,
    intra_host_bw=600 * GB,
    cross_host_bw=12.5 * GB,
)

# One 2-core AMD EPYC VM (shared memory between local ranks), as `recscale calibrate --ranks 2`
# measured it (contention measured side by side, replicas' per-byte cost fitted). Only a
# fallback: the trainer's planner measures the machine it runs on (``this_machine``) and uses
# this where it cannot. Memory is a conservative 4 GB per rank.
LOCAL_CPU = Hardware(
    name="local-cpu",
    world_size=2,
    ranks_per_host=2,
    memory_bytes=4 * GB,
    memory_bw=79.2 * GB,
    intra_host_bw=2.15 * GB,
    cross_host_bw=2.15 * GB,
    latency_s=78e-6,
    kernel_overhead_s=0.0,
    backward_factor=1.0,
    id_s=17.4e-9,
    row_s=11.0e-9,
    bag_s=0.0,
    route_id_s=16.4e-9,
    column_stat_id_s=37.6e-9,
    feature_s=0.0,
    dist_id_s=4.7e-9,
    dist_value_s=1.42e-9,
    step_overhead_s=0.175e-3,
    replica_byte_s=0.277e-9,
    contention=0.0,
)

PRESETS = {h.name: h for h in (ZIONEX, TORCHREC_DEFAULTS, LOCAL_CPU)}


# "off" (or 0, false, no): never measure this machine on first use; plan on the built-in
# description instead (tests and CI, which must not pay for it in every process).
CALIBRATE_ENV = "RECSCALE_CALIBRATE"
# A first-use calibration that takes longer than this is stopped and the built-in description used.
QUICK_TIMEOUT_S = 90.0


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recscale"


def cached_calibration(world_size: int, quick: bool = False) -> Path:
    """Where `recscale calibrate` keeps this machine's description for ``world_size`` ranks
    (``quick``: the quick one, made on first use when there is no full one)."""
    return cache_dir() / f"topology-local-{world_size}{'-quick' if quick else ''}.json"


def _say(text: str) -> None:
    print(f"recscale: {text}", file=sys.stderr, flush=True)


def this_machine(world_size: int, ranks_per_host: int, gpu: bool, say: Callable[[str], None] = _say) -> Hardware:
    """The planner's description of the machine a job runs on: its cached calibration (the
    full one of `recscale calibrate`, else the quick one), else on a CPU a quick calibration
    made now (about 10-20 s, once per machine, then cached); the built-in presets (ZionEX-like
    on GPUs, ``local-cpu`` on CPUs) only where none can be had, and the output says so."""
    path, why = machine_calibration(ranks_per_host, say, make=not gpu)
    if path is not None:
        return Hardware.load(path).with_world(world_size, ranks_per_host)
    if gpu:
        say("planner: costing plans on the built-in 'zionex' GPU description (no calibration of this machine)")
        return ZIONEX.with_world(world_size, ranks_per_host)
    say(f"planner: costing plans on the built-in 'local-cpu' description of another machine ({why}); "
        "run `recscale calibrate` to measure this one")
    return LOCAL_CPU.with_world(world_size, ranks_per_host)


def machine_calibration(ranks_per_host: int, say: Callable[[str], None] = _say, make: bool = True) -> tuple[Path | None, str]:
    """This machine's calibration for ``ranks_per_host`` local ranks as the planner finds it:
    the full one, else the quick one, else (``make``) a quick one made now; ``(None, why)``
    when none can be had."""
    for path in (cached_calibration(ranks_per_host), cached_calibration(ranks_per_host, quick=True)):
        if path.is_file():
            return path, ""
    if not make:
        return None, "no calibration of this machine is cached"
    why = quick_calibration(ranks_per_host, say)
    return (None, why) if why else (cached_calibration(ranks_per_host, quick=True), "")


def quick_calibration(ranks: int, say: Callable[[str], None] = _say, timeout_s: float = QUICK_TIMEOUT_S) -> str:
    """Measure this machine quickly (`recscale calibrate --quick`, in a child process so it is
    bounded) into its cache; returns why not ("" when done)."""
    if os.environ.get(CALIBRATE_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"{CALIBRATE_ENV}=off"
    out = cached_calibration(ranks, quick=True)
    say(f"planner: measuring this machine once for {ranks} local rank(s) (a quick calibration, about 10-20 s; "
        f"cached in {out}; `recscale calibrate` makes the full one) ...")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "recscale", "calibrate", "--quick", "--ranks", str(ranks), "--out", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    # Every rank of a job asks at once: one measures, the others wait and read its result
    # (two calibrations side by side would measure each other).
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return ""
        code, text = run_bounded(cmd, timeout_s)
    if code is None:
        return f"the quick calibration took over {timeout_s:.0f} s"
    if code != 0 or not out.is_file():
        lines = text.strip().splitlines()
        return f"the quick calibration failed: {lines[-1] if lines else f'exit status {code}'}"
    say(f"planner: measured this machine in {time.monotonic() - t0:.0f} s")
    return ""


def run_bounded(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` in a process group of its own; past ``timeout_s`` kill the whole group.
    Returns (exit status or None on timeout, stderr or else stdout). Killing only the child, as
    ``subprocess.run`` does, leaves its worker processes holding the pipes, and the wait for
    their end never returns."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        return None, ""
    finally:
        _kill_group(proc.pid)  # workers the child left behind
    return proc.returncode, stderr or stdout


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def resolve_hardware(name_or_file: str, world_size: int | None = None, ranks_per_host: int | None = None) -> Hardware:
    """A preset by name or a calibrated JSON file, resized to the requested world."""
    if name_or_file in PRESETS:
        hw = PRESETS[name_or_file]
    elif Path(name_or_file).suffix == ".json" or Path(name_or_file).exists():
        hw = Hardware.load(name_or_file)
    else:
        raise ValueError(f"topology '{name_or_file}' is neither a preset {sorted(PRESETS)} nor a JSON file")
    if world_size:
        hw = hw.with_world(world_size, ranks_per_host)
    elif ranks_per_host:
        hw = hw.with_world(hw.world_size, ranks_per_host)
    return hw
