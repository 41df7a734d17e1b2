"""Benchmark: does ``recscale simulate`` predict measured training throughput on this machine?

Trains ``configs/synthetic.toml`` (one thread per rank, a fixed number of steps) for real as
1 rank, 2 local ranks, and 2 emulated hosts x 1 and x 2 ranks over shaped links (``recscale
cluster``: 200 Mbit/s, 1 Gbit/s, 10 Gbit/s), under each plan of a group (table-wise, row-wise,
column-wise, table-row-wise, data-parallel and the planner's), with heavier pooling, fp16 on
the wire and the pipeline off as variants; predicts each with the simulator on the same
topology (``local-cpu``, or this machine's ``recscale calibrate`` cache for 2 ranks, with the
link rate and the machine's shared cores); prints measured and predicted samples/s per
configuration (training's ``steady_samples_per_sec``: the rate after the first steps'
start-up, as a long run settles at and the simulator predicts) and reports:

- the geometric mean of |predicted - measured| / measured over all configurations;
- Kendall's tau between predicted and measured order of the plans within each group (not for
  one rank, which shards nothing: its plans are one program, predicted alike); beside it, the
  same over only the pairs whose order the turns settle (a sign test: 5 of 5 turns, 9 of 10),
  where a misorder is the model's and not a draw of the machine's noise;
- per group, whether the simulator's best plan is within 5% of the best measured;
- the pipeline's measured (per turn, median and spread) and predicted speed-up on 2 emulated
  hosts: at 200 Mbit/s with the default pooling, and at 500 Mbit/s with pooling x20, where the
  id exchange is most of the step's bytes (``--only "pooling x20" --turns 5`` runs just that
  pair).

Every configuration runs once per turn; turns are interleaved (each turn runs all of them, in
a rotated order) and the median over turns is kept, so slow drifts of a shared machine hit
all configurations alike. Emulated hosts need root; without it those groups are skipped.

    python benchmarks/simulator_validation.py --quick --json out/simval.json
    python benchmarks/simulator_validation.py --turns 5 --json out/simval.json     # the full set
    python benchmarks/simulator_validation.py --refit out/simval.json               # re-predict only
    python benchmarks/simulator_validation.py --turns 5 --skip "no pipeline"        # without those groups

Every prediction is priced from this machine's calibrations, never from these measurements:
``recscale calibrate --ranks N`` for N of at least each group's ranks per host and this
machine's cores (``base_ranks``: every rank here has one thread, as each of that many local
ranks had when calibrated; the full one, else the quick one training makes on first use, made
here if missing; ``--fresh-calibration DIR``: a quick one taken now, beside the measurements),
the simulator's dense compute, training loop, ranks' meetings and
cores' jitter (``recscale.sim.calibrate``, cached; ``--measure-compute`` measures them again;
a calibration's own jitter first, which its collective figures are fitted net of) and the
loader's cost for each data set and world size (measured here as each turn starts, a second
each, and the median over turns kept; ``--refit`` reuses them). The full run (53
configurations, ``--turns 5``, 60 steps on emulated hosts and 300 on this host alone: 265 runs
of 5-30 s) takes 40-85 minutes on 2 cores, by the machine; ``--quick`` (9, one turn, 20 steps)
about 4.5 minutes.

Run it alone on the machine: it times things.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import environment, format_table, write_json  # noqa: E402

from recscale.sharding.plan import ShardingPlan  # noqa: E402
from recscale.sim.api import simulate  # noqa: E402
from recscale.sim.calibrate import measure_loader, one_thread_ranks  # noqa: E402
from recscale.sim.tiers import EMULATED_FRAMING  # noqa: E402
from recscale.sim.topology import TC_FRAME_BYTES, ClusterTopology, topology_from_dict  # noqa: E402
from recscale.train.config import load_config  # noqa: E402

CONFIG = ROOT / "configs" / "synthetic.toml"
# Every group of several ranks runs all six: with four plans, one toss-up pair (two plans
# within the machine's noise of each other) is a tau of 0.67 however good the model is.
PLANS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "auto")


@dataclass
class Group:
    name: str
    hosts: int
    ranks_per_host: int
    mbit: float | None  # None: one host, no shaped link
    plans: tuple[str, ...]
    sets: tuple[str, ...] = ()


@dataclass
class Case:
    group: str
    plan: str
    measured: list[float] = field(default_factory=list)  # samples/s per turn
    predicted: float = 0.0
    run_plan: dict | None = None  # the plan training ran (the planner's, for "auto"), as its summary has it


def groups(quick: bool) -> list[Group]:
    if quick:
        return [Group("1 rank", 1, 1, None, ("table_wise", "data_parallel")),
                Group("2 ranks", 1, 2, None, ("table_wise", "row_wise", "data_parallel")),
                Group("2x1 hosts 200 Mbit/s", 2, 1, 200, ("table_wise", "data_parallel", "auto")),
                Group("2x1 hosts 200 Mbit/s, no pipeline", 2, 1, 200, ("table_wise",), ("train.pipeline=false",))]
    pooled = "data.pooling_factors=[4, 4, 12, 4, 8, 4, 4, 4, 4, 16, 4, 8, 4, 4, 4, 4, 4, 4, 4, 4, 20, 4, 4, 4, 4, 4]"
    return [
        Group("1 rank", 1, 1, None, ("table_wise", "data_parallel", "auto")),
        Group("2 ranks", 1, 2, None, PLANS),
        Group("2 ranks, pooling x4", 1, 2, None, PLANS, (pooled,)),
        Group("2 ranks, fp16 wire", 1, 2, None, PLANS, ("comm.forward=fp16", "comm.backward=fp16")),
        Group("2x1 hosts 200 Mbit/s", 2, 1, 200, PLANS),
        Group("2x1 hosts 200 Mbit/s, no pipeline", 2, 1, 200, PLANS, ("train.pipeline=false",)),
        Group("2x1 hosts 1 Gbit/s", 2, 1, 1000, PLANS),
        Group("2x1 hosts 10 Gbit/s", 2, 1, 10_000, PLANS),
        Group("2x2 hosts 1 Gbit/s", 2, 2, 1000, PLANS),
        *pipeline_pair(),
    ]


# Heavy pooling (x20: 20-100 ids a sample per feature), where the ids all-to-all is the largest
# exchange of a step and, at 500 Mbit/s, takes about the wire time of the rest of the step's
# compute: what the pipeline hides is a large part of the step.
PIPELINE_POOLING = ("data.pooling_factors=[20, 20, 60, 20, 40, 20, 20, 20, 20, 80, 20, 40, 20, 20, 20, 20, 20, 20, 20, 20, "
                    "100, 20, 20, 20, 20, 20]")
PIPELINE_PAIR = "2x1 hosts 500 Mbit/s, pooling x20"


def pipeline_pair() -> list[Group]:
    """The pipeline on and off where it should matter (``--only "pooling x20"`` runs just these)."""
    return [Group(PIPELINE_PAIR, 2, 1, 500, ("table_wise",), (PIPELINE_POOLING,)),
            Group(f"{PIPELINE_PAIR}, no pipeline", 2, 1, 500, ("table_wise",),
                  (PIPELINE_POOLING, "train.pipeline=false"))]


def overrides(g: Group, plan: str, steps: int, batch: int) -> list[str]:
    return [f"train.max_steps={steps}", f"train.batch_size={batch}", f"data.num_samples={batch * (steps + 2)}",
            "data.eval_samples=1024", "train.progress=false", "train.threads=1", f"sharding.default={plan}", *g.sets]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunFailed(RuntimeError):
    """A measured run exited with an error or wrote no summary (the message: ``failure_report``)."""


# Failed runs that were run again (``measure``): each one's message, reported with the results.
_FAILED: list[str] = []


def measure(g: Group, plan: str, steps: int, batch: int) -> tuple[float, dict | None]:
    """One run's samples/s and plan. A failed run is reported and run once more, so that one
    rare failure does not discard an hour of turns; a second failure stops the validation."""
    try:
        return _measure_once(g, plan, steps, batch)
    except RunFailed as e:
        _FAILED.append(str(e))
        print(f"{e}\n(run again once)", file=sys.stderr, flush=True)
    try:
        return _measure_once(g, plan, steps, batch)
    except RunFailed as e:
        raise SystemExit(str(e)) from None


def _measure_once(g: Group, plan: str, steps: int, batch: int) -> tuple[float, dict | None]:
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        train = ["train", "--config", str(CONFIG), "--summary-json", str(summary)]
        for o in overrides(g, plan, steps, batch):
            train += ["--set", o]
        py = [sys.executable, "-m"]
        if g.mbit is not None:
            cmd = cluster_command(g, train)
        elif g.ranks_per_host > 1:
            cmd = py + ["torch.distributed.run", f"--nproc_per_node={g.ranks_per_host}", "--master_addr=127.0.0.1",
                        f"--master_port={_free_port()}", "-m", "recscale"] + train
        else:
            cmd = py + ["recscale"] + train
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not summary.is_file():
            raise RunFailed(failure_report(f"{g.name}, {plan}", cmd, proc))
        out = json.loads(summary.read_text())
        # the rate after the first steps' start-up: the steady step is what the simulator predicts
        return float(out.get("steady_samples_per_sec") or out["train_samples_per_sec"]), out.get("plan")


def cluster_command(g: Group, job: list[str]) -> list[str]:
    """``recscale cluster`` running ``job`` (a recscale command or a script) on the group's
    emulated hosts and shaped link."""
    return [sys.executable, "-m", "recscale", "cluster", "--hosts", str(g.hosts), "--ranks-per-host", str(g.ranks_per_host),
            "--bandwidth-mbit", str(g.mbit), "--", *job]


def failure_report(what: str, cmd: list[str], proc: subprocess.CompletedProcess) -> str:
    """A failed run's message: the lines of its output that name an error, its tails, and where
    its whole output was kept (every rank's, which the tails cut off)."""
    with tempfile.NamedTemporaryFile("w", prefix="recscale-validation-failed-", suffix=".log", delete=False) as f:
        f.write(f"$ {' '.join(cmd)}\nexit status {proc.returncode}\n"
                f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    errors = [line for line in (proc.stdout + proc.stderr).splitlines()
              if any(k in line.lower() for k in ("error", "abort", "terminate", "what():", "fatal", "exception"))]
    return (f"run failed ({what}), exit status {proc.returncode}; whole output in {f.name}\n"
            + "\n".join(errors[-30:]) + f"\n--- tail\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")


# the loader's cost per sample of a rank's share (seconds), per ``loader_key``: one measurement
# per turn, taken as the turn starts, so that the cost spans the turns' minutes as the
# measurements do (this machine's speed drifts, and one second of measuring catches one moment)
_LOADER: dict[str, list[float]] = {}
_COMPUTE: dict[str, float] = {}  # this machine's dense rate (the simulator's calibration)


def loader_key(g: Group, cfg) -> str:
    """What the loader's cost depends on: the data, the model's tables, the batch, the seed and
    the world size; a pair that differs only in the training loop (the pipeline on and off)
    shares its measurements, not two draws of the machine's noise."""
    d = cfg.to_dict()
    return json.dumps([{k: d[k] for k in ("data", "model")}, cfg.train.batch_size, cfg.train.seed,
                       g.hosts * g.ranks_per_host], sort_keys=True, default=str)


def sample_loaders(gs: list[Group], steps_of, batch: int) -> None:
    """One more measurement of the loader's cost for every distinct data set of ``gs``."""
    done = set()
    for g in gs:
        cfg = load_config(CONFIG, overrides(g, g.plans[0], steps_of(g), batch))
        key = loader_key(g, cfg)
        if key not in done:
            done.add(key)
            _LOADER.setdefault(key, []).append(measure_loader(cfg, world_size=g.hosts * g.ranks_per_host))


def loader_cost(g: Group, cfg) -> float:
    """The median of the loader's measurements for ``cfg``'s data (one taken now if none was)."""
    key = loader_key(g, cfg)
    if not _LOADER.get(key):
        _LOADER[key] = [measure_loader(cfg, world_size=g.hosts * g.ranks_per_host)]
    return statistics.median(_LOADER[key])


def topology(g: Group, cfg) -> ClusterTopology:
    """The group's cluster as the simulator sees it: this machine's calibration (else
    ``local-cpu``), the shaped link, the machine's shared cores, the loader's measured cost."""
    link = {"cross_host_mbit": g.mbit, "cross_host_latency_ms": 1e3 * link_latency(g)} if g.mbit else {}
    world = g.hosts * g.ranks_per_host
    if g.mbit and world > g.ranks_per_host:
        # every rank of every emulated host shares this machine: they slow each other as that
        # many local ranks do, which a calibration of fewer ranks per host did not measure, and
        # their collectives cost what that many local ranks' cost over TCP
        link.update(shared_machine(world))
    return topology_from_dict({
        "base": calibration(base_ranks(g)), "hosts": g.hosts, "ranks_per_host": g.ranks_per_host,
        **link, "shared_cores": os.cpu_count() or 1,
        "load_s_per_sample": loader_cost(g, cfg), **_COMPUTE,
        # shaped veth links frame as tc counts them; unshaped ranks talk over loopback (MTU 64 KiB)
        **(EMULATED_FRAMING if g.mbit else {"mtu_bytes": 65536, "frame_bytes": TC_FRAME_BYTES}),
    }, "validation")


def base_ranks(g: Group) -> int:
    """The local ranks whose calibration prices the group's ranks' compute. Every rank here trains
    with one thread (``train.threads=1``), and ``recscale calibrate --ranks N`` gives each rank
    the cores / N threads: at least as many ranks as cores, whose ranks had one thread each (a
    one-rank calibration gives its rank every core, and pays their wake-ups at every operator)."""
    return max(g.ranks_per_host, one_thread_ranks())


_LINK_LATENCY: dict[str, float] = {}  # emulated cluster shape -> seconds its link adds to one small gloo collective


def _shape(g: Group) -> str:
    return f"{g.hosts}x{g.ranks_per_host} {g.mbit:g} Mbit/s"


def link_latency(g: Group) -> float:
    """Seconds the group's emulated link adds to one collective: a small collective's time
    between the emulated hosts less its time between as many ranks on this host over loopback
    TCP, each measured once per cluster shape by the same probe (``_link_latency.py``). What a
    collective costs the ranks over TCP inside a step (their threads' wake-ups, the network
    stack) is the calibration's (``shared_machine``); the link adds its shaping and the veth hops."""
    key = _shape(g)
    if key not in _LINK_LATENCY:
        if os.geteuid() != 0:
            print(f"not root: the collective latency across {key} is not measured (priced at 0)")
            _LINK_LATENCY[key] = 0.0
            return 0.0
        across = _probe_latency(g, cluster=True)
        local = _probe_latency(g, cluster=False)
        _LINK_LATENCY[key] = max(0.0, across - local)
        print(f"collective latency across {key}: {across * 1e3:.3f} ms, over loopback {local * 1e3:.3f} ms "
              f"(measured now)", flush=True)
    return _LINK_LATENCY[key]


def _probe_latency(g: Group, cluster: bool) -> float:
    """The probe's small-collective time between the group's emulated hosts (``cluster``), or
    between as many ranks on this host over loopback TCP."""
    world = g.hosts * g.ranks_per_host
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency.txt"
        job = [str(ROOT / "benchmarks" / "_link_latency.py"), str(out)]
        cmd = cluster_command(g, job) if cluster else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", *job]
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(failure_report(f"collective latency probe, {_shape(g)}{'' if cluster else ' (loopback)'}",
                                            cmd, proc))
        return float(out.read_text())


_CALIBRATIONS: dict[int, str] = {}  # ranks per host -> the planner's calibration of this machine


def calibration(ranks_per_host: int) -> str:
    """This machine's calibration for ``ranks_per_host`` local ranks, as training's planner finds
    it (``this_machine``): the full one, else the quick one, else a quick one made now (as a
    first training does); ``--fresh-calibration``'s, taken right before the measurements, first.
    Never a calibration for another number of ranks (a lone rank has no neighbour slowing it
    and gets every core) nor another machine's preset, unless none can be made."""
    if ranks_per_host not in _CALIBRATIONS:
        from recscale.planner.hardware import machine_calibration

        cal, why = machine_calibration(ranks_per_host, print)
        if cal is None:
            print(f"no calibration of this machine for {ranks_per_host} rank(s) ({why}): pricing on 'local-cpu'")
        _CALIBRATIONS[ranks_per_host] = str(cal) if cal else "local-cpu"
    return _CALIBRATIONS[ranks_per_host]


_SHARED: dict[str, dict[str, float]] = {}  # calibration file -> its topology keys (``shared_machine``)


def shared_machine(ranks: int) -> dict[str, float]:
    """Topology keys for ``ranks`` ranks sharing this machine, from its calibration for that many
    local ranks (as ``calibration`` finds or makes it): how much they slow each other
    (``contention``), what a collective over TCP costs them inside a step and their cores (the
    ``tcp_`` keys; none where the calibration has none: then the shared-memory figures price
    them, and the run says so), and the cores' jitter its collective figures are fitted net of (``sync_jitter``,
    where it measured one). Each calibration file is read once."""
    path = calibration(ranks)
    if path not in _SHARED:
        from recscale.planner.hardware import Hardware

        hw = Hardware.load(path) if path != "local-cpu" else None
        keys = {"contention": hw.contention if hw else 0.0}
        if hw is not None and hw.sync_jitter > 0:
            keys["sync_jitter"] = hw.sync_jitter
        if hw is None or hw.tcp_latency_s is None:
            print(f"the calibration for {ranks} ranks has no collectives over TCP (make it again with `recscale "
                  f"calibrate --ranks {ranks}`): the emulated hosts' collectives are priced as over shared memory")
        else:
            tcp = hw.over_tcp()
            keys.update(tcp_latency_ms=1e3 * tcp.latency_s, tcp_replica_latency_ms=1e3 * tcp.replica_collective_latency_s,
                        tcp_replica_byte_ns=1e9 * tcp.replica_byte_s)
            if hw.tcp_call_s is not None:
                keys["tcp_call_ms"] = 1e3 * hw.tcp_call_s
        _SHARED[path] = keys
    return _SHARED[path]


def fresh_calibrations(gs: list[Group], out: Path) -> None:
    """A quick calibration for each number of local ranks the groups are priced on, taken now
    (before the measurements, under the same load), kept in ``out``, used instead of the cached
    ones."""
    for r in sorted({base_ranks(g) for g in gs} | {g.hosts * g.ranks_per_host for g in gs if g.mbit}):
        path = out / f"calibration-{r}.json"
        subprocess.run([sys.executable, "-m", "recscale", "calibrate", "--quick", "--ranks", str(r), "--out", str(path)],
                       cwd=ROOT, check=True, capture_output=True, text=True, timeout=900)
        _CALIBRATIONS[r] = str(path)
        print(f"calibrated this machine for {r} rank(s) now: {path}", flush=True)


def predict(g: Group, plan: str, steps: int, batch: int, run_plan: dict | None = None) -> float:
    """Samples/s the simulator predicts; ``run_plan``: the plan training ran. The trainer's
    planner costs its plan on this machine's calibration, which knows nothing of the shaped
    link, so "auto" is predicted for the plan it chose, not the one the simulator's own
    topology would lead the planner to."""
    cfg = load_config(CONFIG, overrides(g, plan, steps, batch))
    return simulate(cfg, topology(g, cfg), ShardingPlan.from_dict(run_plan) if run_plan else None).samples_per_s


def order(x: float, y: float) -> int:
    """+1 if x > y, -1 if x < y, 0 for a tie: values equal up to floating-point rounding (two
    plans the simulator prices by the same operations in another order differ in the last
    bits: a tie, not an order it predicts)."""
    if abs(x - y) <= 1e-9 * max(abs(x), abs(y)):
        return 0
    return 1 if x > y else -1


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a: concordant less discordant pairs over all pairs (a tie counts 0)."""
    n = len(a)
    s = sum(order(a[i], a[j]) * order(b[i], b[j]) for i in range(n) for j in range(i + 1, n))
    pairs = n * (n - 1) / 2
    return s / pairs if pairs else float("nan")


# A pair's measured order counts as known when a two-sided sign test over the turns (a group's
# plans run one after the other in every turn: paired) puts a tie at this probability or less:
# 5 of 5 turns, 9 of 10.
RESOLVED_P = 0.1


def sign_test_p(ahead: int, turns: int) -> float:
    """Two-sided sign test: the chance that two equally fast plans split ``turns`` at least as
    unevenly as ``ahead`` to ``turns - ahead``."""
    k = max(ahead, turns - ahead)
    return min(1.0, 2 * sum(math.comb(turns, i) for i in range(k, turns + 1)) / 2 ** turns)


def resolved_pairs(members: list[Case]) -> list[tuple[int, int]]:
    """The pairs (faster, slower) of ``members`` whose order the turns settle (``RESOLVED_P``).
    The others are toss-ups on this machine: their medians' order is a draw of its noise, which
    no model can predict."""
    out = []
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            turns = [(a, b) for a, b in zip(members[i].measured, members[j].measured) if a != b]
            ahead = sum(a > b for a, b in turns)
            if turns and sign_test_p(ahead, len(turns)) <= RESOLVED_P:
                out.append((i, j) if 2 * ahead > len(turns) else (j, i))
    return out


def resolved_tau(members: list[Case], pred: list[float]) -> tuple[float | None, int, list[str]]:
    """Kendall's tau over the pairs the turns order (``resolved_pairs``; a predicted tie counts
    0), how many pairs that is, and the ones the simulator orders the other way."""
    pairs = resolved_pairs(members)
    s, wrong = 0, []
    for fast, slow in pairs:
        o = order(pred[fast], pred[slow])
        s += o
        if o < 0:
            wrong.append(f"{members[fast].plan} > {members[slow].plan}")
    return (s / len(pairs) if pairs else None), len(pairs), wrong


def score(gs: list[Group], cases: dict[tuple[str, str], Case]) -> dict:
    rows, errors, per_group = [], [], []
    for g in gs:
        members = [cases[(g.name, p)] for p in g.plans if (g.name, p) in cases and cases[(g.name, p)].measured]
        if not members:
            continue
        meas = [statistics.median(c.measured) for c in members]
        pred = [c.predicted for c in members]
        for c, m, p in zip(members, meas, pred):
            err = abs(p - m) / m
            errors.append(err)
            spread = (max(c.measured) - min(c.measured)) / m if len(c.measured) > 1 else 0.0
            rows.append([g.name, c.plan, f"{m:,.0f}", f"±{100 * spread:.0f}%", f"{p:,.0f}", f"{100 * (p - m) / m:+.1f}%"])
        # one rank shards nothing: its plans are one program, and their measured order is noise
        ranks = len(members) > 1 and g.hosts * g.ranks_per_host > 1
        tau = kendall_tau(meas, pred) if ranks else None
        known_tau, known, wrong = resolved_tau(members, pred) if ranks else (None, 0, [])
        pick = max(range(len(members)), key=lambda i: pred[i])
        best_ok = meas[pick] >= 0.95 * max(meas)
        per_group.append({"group": g.name, "tau": tau, "best_within_5pct": best_ok, "sim_best": members[pick].plan,
                          "measured_best": members[max(range(len(meas)), key=lambda i: meas[i])].plan,
                          "pairs": len(members) * (len(members) - 1) // 2, "resolved_pairs": known,
                          "resolved_tau": known_tau, "misordered_resolved": wrong})
    geo = math.exp(sum(math.log(max(e, 1e-6)) for e in errors) / len(errors)) if errors else float("nan")
    ranked = [p for p in per_group if p["tau"] is not None]
    return {"rows": rows, "configs": len(errors), "geomean_error": geo, "groups": per_group,
            "min_tau": min((p["tau"] for p in ranked), default=float("nan")),
            "best_within_5pct_share": sum(p["best_within_5pct"] for p in ranked) / len(ranked) if ranked else float("nan"),
            "pipeline": _pipeline_ratio(cases)}


def _pipeline_ratio(cases: dict[tuple[str, str], Case]) -> list[dict]:
    """Pipeline on / off for every group that has a ", no pipeline" twin: per turn (the two ran
    in the same turn), their median, and the simulator's ratio."""
    out = []
    for (name, plan), off in cases.items():
        if not name.endswith(", no pipeline"):
            continue
        on = cases.get((name.removesuffix(", no pipeline"), plan))
        if on and on.measured and off.measured:
            turns = [a / b for a, b in zip(on.measured, off.measured)]
            out.append({"group": on.group, "plan": plan, "measured_ratio": statistics.median(turns),
                        "turn_ratios": turns, "predicted_ratio": on.predicted / off.predicted})
    return out


def report(result: dict) -> None:
    print(format_table(["group", "plan", "measured samples/s", "spread", "predicted", "error"], result["rows"], 2))
    print(f"\n{result['configs']} configurations; geometric-mean |predicted - measured| / measured "
          f"{100 * result['geomean_error']:.1f}% (acceptance <= 10%, >= 30 configurations)")
    for g in result["groups"]:
        tau = "-" if g["tau"] is None else f"{g['tau']:+.2f}"
        print(f"  {g['group']:36s} tau {tau:>6s}  simulator's best {g['sim_best']:15s} measured best "
              f"{g['measured_best']:15s} within 5%: {'yes' if g['best_within_5pct'] else 'NO'}")
    print(f"min tau {result['min_tau']:+.2f} (acceptance >= 0.8); best plan within 5% in "
          f"{100 * result['best_within_5pct_share']:.0f}% of groups (acceptance >= 90%)")
    print(f"pairs the turns order (a sign test over them: a tie's chance <= {RESOLVED_P:g}), and the simulator's "
          f"tau over those alone:")
    for g in result["groups"]:
        if g["tau"] is not None:
            tau = "-" if g["resolved_tau"] is None else f"{g['resolved_tau']:+.2f}"
            wrong = g["misordered_resolved"]
            wrong = f"; ordered the other way: {', '.join(wrong)}" if wrong else ""
            print(f"  {g['group']:36s} {g['resolved_pairs']:2d} of {g['pairs']:2d} pairs, tau {tau}{wrong}")
    for p in result["pipeline"]:
        print(f"pipeline on/off, {p['group']}, {p['plan']}: measured {p['measured_ratio']:.3f}x "
              f"(turns {', '.join(f'{r:.3f}' for r in p['turn_ratios'])}; spread "
              f"{max(p['turn_ratios']) - min(p['turn_ratios']):.3f}), predicted {p['predicted_ratio']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="9 configurations, one turn, 20 steps (a smoke run)")
    ap.add_argument("--turns", type=int, default=None, help="interleaved turns (default 3; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 60; quick 20)")
    ap.add_argument("--local-steps", type=int, default=None,
                    help="training steps per run of the groups on this host alone (default 300; quick as --steps): "
                         "their plans differ by a few percent and a short run's rate by much more")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--json", metavar="PATH", help="write every measurement and prediction")
    ap.add_argument("--measure-compute", action="store_true",
                    help="measure this machine's dense compute rate again (else its cached calibration, "
                         "measured and cached on first use)")
    ap.add_argument("--fresh-calibration", metavar="DIR",
                    help="first take a quick calibration of this machine per ranks per host into DIR and price "
                         "on it (beside the measurements, under the same load), instead of the cached ones")
    ap.add_argument("--only", nargs="+", metavar="TEXT", help="only the groups whose name contains one of these")
    ap.add_argument("--skip", nargs="+", metavar="TEXT", default=[],
                    help="leave out the groups whose name ends with one of these")
    ap.add_argument("--refit", metavar="JSON", help="predict again for the measurements of an earlier --json")
    args = ap.parse_args(argv)
    if args.refit:
        old = json.loads(Path(args.refit).read_text())
        args.quick, args.steps, args.batch_size = old["quick"], old["steps"], old["batch_size"]
        args.local_steps = old.get("local_steps", old["steps"])
    steps = args.steps or (20 if args.quick else 60)
    local_steps = args.local_steps or (steps if args.quick else 300)

    def steps_of(g: Group) -> int:
        return steps if g.mbit is not None else local_steps
    turns = args.turns or (1 if args.quick else 3)
    gs = [g for g in groups(args.quick) if (not args.only or any(o in g.name for o in args.only))
          and not any(g.name.endswith(s) for s in args.skip)]
    if os.geteuid() != 0 and not args.refit:
        print("not root: emulated hosts (recscale cluster) need it; those groups are skipped")
        gs = [g for g in gs if g.mbit is None]
    cases = {(g.name, p): Case(g.name, p) for g in gs for p in g.plans}
    if args.fresh_calibration:
        Path(args.fresh_calibration).mkdir(parents=True, exist_ok=True)
        fresh_calibrations(gs, Path(args.fresh_calibration))
    if args.refit:
        _LINK_LATENCY.update(old.get("link_latency_s", {}))
        _LOADER.update(old.get("loader_s_per_sample", {}))  # (an older recording: measured now)
        for c in old["cases"]:
            if (c["group"], c["plan"]) in cases:
                cases[(c["group"], c["plan"])].measured = c["measured"]
                cases[(c["group"], c["plan"])].run_plan = c.get("run_plan")
    else:
        order = list(cases)
        for turn in range(turns):
            sample_loaders(gs, steps_of, args.batch_size)
            rot = order[turn % len(order):] + order[: turn % len(order)]
            for key in rot:
                g = next(g for g in gs if g.name == key[0])
                samples, run_plan = measure(g, key[1], steps_of(g), args.batch_size)
                cases[key].measured.append(samples)
                cases[key].run_plan = run_plan
                print(f"turn {turn + 1}/{turns}  {key[0]:36s} {key[1]:15s} {cases[key].measured[-1]:10,.0f} samples/s", flush=True)
    from recscale.sim.calibrate import cached_compute, measure_compute, save_compute

    m = None if args.measure_compute else cached_compute()
    source = "cached"
    if m is None:  # the simulator's calibration of this machine's dense compute, kept for next time
        m, source = measure_compute(), "measured"
        save_compute(m)
    # (not its jitter: a calibrated base prices the wait at the jitter its collectives are fitted
    # net of, else at this same measurement, cached, which topology_from_dict falls back to)
    _COMPUTE.update(flops_per_s=m.flops_per_s, value_s=m.value_s, op_overhead_s=m.op_overhead_s, loop_s=m.loop_s,
                    shm_loop_s=m.shm_loop_s, tcp_loop_s=m.tcp_loop_s)
    print(f"dense compute ({source}): {m.flops_per_s / 1e9:.0f} GFLOP/s, {m.value_s * 1e9:.2f} ns per value, "
          f"{m.op_overhead_s * 1e6:.1f} us per operator, training loop {m.loop_s * 1e3:.2f} ms per step, "
          f"ranks' meetings {m.shm_loop_s * 1e3:.2f} ms (shared memory) and {m.tcp_loop_s * 1e3:.2f} ms (TCP) a step, "
          f"cores' jitter {m.sync_jitter:.2f}")
    for key, c in cases.items():
        g = next(g for g in gs if g.name == key[0])
        c.predicted = predict(g, key[1], steps_of(g), args.batch_size, c.run_plan)
    result = score(gs, cases)
    report(result)
    if _FAILED:
        print(f"{len(_FAILED)} run(s) failed and were run again:\n" + "\n".join(m.splitlines()[0] for m in _FAILED))
    if args.json:
        write_json(args.json, {"environment": environment(), "quick": args.quick, "steps": steps, "local_steps": local_steps,
                               "turns": turns,
                               "batch_size": args.batch_size, "groups": [asdict(g) for g in gs],
                               "cases": [asdict(c) for c in cases.values()], "link_latency_s": dict(_LINK_LATENCY),
                               "loader_s_per_sample": dict(_LOADER),
                               "failed_runs": list(_FAILED),
                               **{k: v for k, v in result.items() if k != "rows"}})
        print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
