"""Probe: what one configuration of an explorer validation run puts on the cross link, and when.

Trains one run of a saved ``explore_validation.py`` result (its plan made again by the same
search) on the emulated two-group cluster for a few steps, with each rank's collectives traced
(``RECSCALE_COMM_TRACE``: issue, wait and done times per collective) and the cross link's
veth byte counters (``x1`` in the first group's switch: group 0 to 1; ``x0`` in the second:
group 1 to 0) sampled every millisecond after the token bucket, on the same clock. It prints
each rank's collective timeline for the last steps, the bytes each direction carried in each
collective's span, and the bursts: bytes a direction carried faster than the link's rate right
after it idled (what a token bucket lets through at once).

    python benchmarks/link_probe.py --from out/explore-validation.json --run production-default

Needs root (network namespaces), as ``explore_validation.py`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recscale.sim.explore import explore as explore_candidates  # noqa: E402
from recscale.sim.explore_report import _name as candidate_name  # noqa: E402
from recscale.sim.tiers import EMULATED_FRAMING, FRAMING_KEYS, cluster_from_dict  # noqa: E402
from recscale.train.config import load_config  # noqa: E402

SAMPLER = """
import sys, time
path, out = sys.argv[1], open(sys.argv[2], "w", buffering=1)  # line by line: it ends by a signal
last = None
while True:
    try:
        with open(path) as f:
            v = int(f.read())
    except OSError:
        break
    if v != last:
        out.write(f"{time.perf_counter():.6f} {v}\\n")
        last = v
    time.sleep(0.001)
out.close()
"""


def plan_file(saved: dict, key: str, where: Path) -> Path:
    """The run's plan, made again by the search the saved file describes."""
    cluster_d = dict(saved["cluster"])
    if not any(k in cluster_d for k in FRAMING_KEYS):
        cluster_d.update(EMULATED_FRAMING)
    cluster = cluster_from_dict(cluster_d, cluster_d.get("name", "emulated"))
    cfg = load_config(ROOT / saved["config"], saved["sets"])
    e = explore_candidates(cfg, cluster, 60.0, max_auc_loss=saved["max_auc_loss"], use_all_ranks=saved["use_all_ranks"])
    by_name = {candidate_name(e, s): s for s in e.scored}
    by_name.update({f"baseline: {k}": b for k, b in e.baselines.items() if not isinstance(b, str)})
    s = by_name[saved["runs"][key]["name"]]
    path = where / "plan.json"
    path.write_text(e.plans[(s.candidate.placement, s.candidate.plan_name)].to_json())
    return path


def watch_switches(before: set[str], out: Path, stop: threading.Event, procs: list[subprocess.Popen]) -> None:
    """Start a sampler in each new switch namespace as soon as its cross veth exists."""
    started: set[str] = set()
    while not stop.is_set() and len(started) < 2:
        names = {ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout.splitlines() if ln.strip()}
        for ns in sorted(names - before - started):
            m = re.fullmatch(r"rsc\d+-sw(1?)", ns)
            if not m:
                continue
            dev = "x0" if m.group(1) else "x1"
            probe = subprocess.run(["ip", "netns", "exec", ns, "test", "-e", f"/sys/class/net/{dev}"])
            if probe.returncode != 0:
                continue
            name = "1to0" if m.group(1) else "0to1"
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SAMPLER,
                                           f"/sys/class/net/{dev}/statistics/tx_bytes", str(out / f"link_{name}.txt")]))
            started.add(ns)
        time.sleep(0.02)


def read_trace(path: Path) -> list[tuple[str, str, float]]:
    return [(a, b, float(c)) for a, b, c in (ln.split() for ln in path.read_text().splitlines())]


def spans(events: list[tuple[str, str, float]]) -> list[dict]:
    """Per collective call: issue, wait and done times (the n-th issue of a name with its n-th wait)."""
    issues: dict[str, list[float]] = {}
    waits: dict[str, list[tuple[float, float]]] = {}
    open_wait: dict[str, float] = {}
    for name, ev, t in events:
        if ev == "issue":
            issues.setdefault(name, []).append(t)
        elif ev == "wait":
            open_wait[name] = t
        else:
            waits.setdefault(name, []).append((open_wait.pop(name), t))
    out = []
    for name, ts in issues.items():
        for i, t in enumerate(ts):
            w = waits.get(name, [])
            out.append({"name": name, "issue": t, "wait": w[i][0] if i < len(w) else None,
                        "done": w[i][1] if i < len(w) else None})
    return sorted(out, key=lambda d: d["issue"])


def link_series(path: Path) -> list[tuple[float, int]]:
    return [(float(a), int(b)) for a, b in (ln.split() for ln in path.read_text().splitlines())] if path.is_file() else []


def bytes_between(series: list[tuple[float, int]], t0: float, t1: float) -> int:
    def at(t: float) -> int:
        v = series[0][1] if series else 0
        for s, b in series:
            if s > t:
                break
            v = b
        return v
    return at(t1) - at(t0)


def bursts(series: list[tuple[float, int]], rate: float, idle_s: float = 0.05) -> list[dict]:
    """After each idle gap of ``idle_s`` or more: the bytes carried in the next 30 ms against
    what the rate allows in that time."""
    out = []
    for (ta, ba), (tb, bb) in zip(series, series[1:]):
        if tb - ta >= idle_s:
            got = bytes_between(series, tb - 0.002, tb + 0.030)
            out.append({"after_idle_s": tb - ta, "at": tb, "bytes_30ms": got, "rate_allows": rate * 0.032})
    return out


def peaks(series: list[tuple[float, int]], t0: float, t1: float, window: float = 0.02) -> list[tuple[float, int, float]]:
    """The busiest spans of at least ``window`` seconds in [t0, t1]: (bytes/s, bytes, start),
    best first, one per start sample."""
    pts = [p for p in series if t0 <= p[0] <= t1]
    out = []
    for i, (ta, ba) in enumerate(pts):
        for tb, bb in pts[i + 1:]:
            if tb - ta >= window:
                out.append(((bb - ba) / (tb - ta), bb - ba, ta))
                break
    return sorted(out, reverse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", required=True, help="an explore_validation.py --json result")
    ap.add_argument("--run", default="production-default", help="which of its runs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="keep traces and counters here (default: a temporary folder)")
    args = ap.parse_args(argv)
    saved = json.loads(Path(args.src).read_text())
    out = Path(args.out or tempfile.mkdtemp(prefix="link-probe-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace").mkdir(exist_ok=True)
    cmd = list(saved["runs"][args.run]["command"])
    plan = plan_file(saved, args.run, out)
    cmd = [f"sharding.plan={plan}" if c.startswith("sharding.plan=") else c for c in cmd]
    cmd[cmd.index("--config") + 1] = str(ROOT / saved["config"])
    batch = saved["batch_size"]
    cmd += ["--set", f"train.max_steps={args.steps}", "--set", f"data.num_samples={batch * (args.steps + 2)}"]
    before = {ln.split()[0] for ln in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout.splitlines() if ln.strip()}
    stop, samplers = threading.Event(), []
    watcher = threading.Thread(target=watch_switches, args=(before, out, stop, samplers), daemon=True)
    watcher.start()
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", RECSCALE_COMM_TRACE=str(out / "trace"))
    proc = subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    stop.set()
    watcher.join()
    for p in samplers:  # they end when their veth goes; these are only stragglers
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.terminate()
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        return 1
    rate = saved["cross_mbit"] * 1e6 / 8
    links = {d: link_series(out / f"link_{d}.txt") for d in ("0to1", "1to0")}
    report: dict = {"out": str(out), "ranks": {}, "bursts": {d: bursts(s, rate) for d, s in links.items()}}
    for f in sorted((out / "trace").glob("rank*.trace")):
        calls = spans(read_trace(f))
        for c in calls:
            end = c["done"] or c["issue"]
            c["bytes"] = {d: bytes_between(s, c["issue"], end) for d, s in links.items()}
        report["ranks"][f.stem] = calls
    (out / "report.json").write_text(json.dumps(report, indent=1))
    t_ref = min(c["issue"] for calls in report["ranks"].values() for c in calls)
    for rank, calls in report["ranks"].items():
        print(f"{rank}:")
        for c in calls[-24:]:
            w = "" if c["wait"] is None else f" wait {c['wait'] - t_ref:8.3f} done {c['done'] - t_ref:8.3f}"
            print(f"  {c['name']:18s} issue {c['issue'] - t_ref:8.3f}{w}  bytes 0->1 {c['bytes']['0to1']:>9,} "
                  f"1->0 {c['bytes']['1to0']:>9,}")
    for d, bs in report["bursts"].items():
        print(f"link {d}: {len(bs)} idle gaps >= 50 ms; bytes in the 32 ms after each (rate allows "
              f"{rate * 0.032:,.0f}): " + ", ".join(f"{b['bytes_30ms']:,}" for b in bs[-12:]))
    t_end = max((c["done"] or c["issue"]) for calls in report["ranks"].values() for c in calls)
    for d, series in links.items():
        top = peaks(series, t_ref, t_end)[:5]
        print(f"link {d}: busiest 20 ms spans while training (rate {rate / 1e6:.2f} MB/s): " +
              ", ".join(f"{b:,} B at {r / 1e6:.1f} MB/s (t={t - t_ref:.3f})" for r, b, t in top))
    print(f"traces and counters: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
