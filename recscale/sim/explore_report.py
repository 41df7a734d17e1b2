"""``recscale explore``'s outputs: a JSON of ranked candidates and baselines (each with its
config overrides, launch shape, plan and simulated breakdown), an HTML page comparing them, and
a terminal summary."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from recscale.atomic import write_text_atomic
from recscale.sim.explore import Exploration, Scored


@dataclass(frozen=True)
class RunSpec:
    """How to train a candidate: the config and ``--set`` overrides the search was given, and
    a folder to write each candidate's plan JSON into (``sharding.plan`` of its command)."""

    config: str
    sets: tuple[str, ...] = ()
    plans_dir: str | None = None


def _commands(e: Exploration, s: Scored, key: str, run: RunSpec) -> dict:
    c = s.candidate
    sub = e.cluster.shrink(c.placement.buildings, c.placement.ranks_per_host)
    plan_file = str(Path(run.plans_dir) / f"{key}.json")
    Path(run.plans_dir).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    write_text_atomic(plan_file, e.plans[(c.placement, c.plan_name)].to_json())
    train = ["train", "--config", run.config]
    for o in (*run.sets, f"sharding.plan={plan_file}", *c.overrides()):
        train += ["--set", o]
    emulate = sub.cluster_args()
    return {"plan_file": plan_file, "train_args": train,
            "cluster_command": None if emulate is None else ["recscale", "cluster", *emulate, "--", *train]}


def _entry(e: Exploration, s: Scored) -> dict:
    c, r = s.candidate, s.result
    assert r is not None
    sub = e.cluster.shrink(c.placement.buildings, c.placement.ranks_per_host)
    return {
        "predicted_samples_per_s": r.samples_per_s,
        "step_time_s": r.step_time_s,
        "analytic_step_time_s": s.analytic_s,
        "breakdown": r.breakdown,
        "overrides": c.overrides(),
        "launch": {"buildings": c.placement.buildings, "hosts": sub.hosts, "ranks_per_host": sub.ranks_per_host,
                   "world_size": sub.world_size, "per_rank_batch": round(r.samples_per_s * r.step_time_s) // sub.world_size},
        "plan_name": c.plan_name,
        "accuracy_cost": {"eval_logloss_increase": s.accuracy[0], "eval_auc_loss": s.accuracy[1]},
        "plan": e.plans[(c.placement, c.plan_name)].to_dict(),
    }


def _name(e: Exploration, s: Scored) -> str:
    for k, b in e.baselines.items():
        if b is s:
            return f"baseline: {k}"
    c = s.candidate
    return (f"{c.placement.buildings} bldg x {c.placement.ranks_per_host}/host, {c.plan_name}, fwd {c.forward}, "
            f"bwd {c.backward}, dense {c.dense}, pipeline {'on' if c.pipeline else 'off'}")


def gains(e: Exploration, best_of: Scored | None = None) -> dict[str, float]:
    """The best candidate's (or ``best_of``'s) speed-up over each baseline (1.30: 30% faster)."""
    best = (best_of or e.scored[0]).result.samples_per_s  # type: ignore[union-attr]
    return {k: best / b.result.samples_per_s for k, b in e.baselines.items()  # type: ignore[union-attr]
            if isinstance(b, Scored)}


def best_using_all(e: Exploration) -> Scored | None:
    """The best candidate that runs on every rank of the cluster."""
    full = (e.cluster.buildings, e.cluster.ranks_per_host)
    return next((s for s in e.scored if (s.candidate.placement.buildings, s.candidate.placement.ranks_per_host) == full), None)


def to_dict(e: Exploration, run: RunSpec | None = None) -> dict:
    """The ranked result; with ``run`` (and its ``plans_dir``) each entry also names its plan
    file and the command that trains it (``cluster_command``: on emulated hosts, where the
    cluster can be emulated)."""
    def more(s: Scored, key: str) -> dict:
        return _commands(e, s, key, run) if run is not None and run.plans_dir else {}

    return {
        "cluster": e.cluster.to_dict(),
        "candidates": [_entry(e, s) | {"name": _name(e, s)} | more(s, f"candidate-{i + 1}") for i, s in enumerate(e.scored)],
        "baselines": {k: (_entry(e, b) | {"name": _name(e, b)} | more(b, f"baseline-{k}") if isinstance(b, Scored)
                          else {"unavailable": b}) for k, b in e.baselines.items()},
        "speedup_over_baselines": gains(e),
        "speedup_over_baselines_using_every_rank": gains(e, best_using_all(e)),
        "search": {"candidates_scored": e.analytic_count, "analytic_seconds": e.analytic_seconds,
                   "candidates_per_minute": e.candidates_per_minute, "simulated": len(e.scored),
                   "seconds": e.seconds, "time_budget_s": e.time_budget_s, "within_budget": e.within_budget,
                   "placements": sorted({(s.candidate.placement.buildings, s.candidate.placement.ranks_per_host)
                                         for s in e.scored}, reverse=True),
                   "scorer": "analytic (cached per placement and plan) for all, "
                                                   "full event simulation for the top ones and the baselines",
                   "notes": e.notes},
    }


def summary(e: Exploration, top: int = 5) -> str:
    lines = [f"explored {e.analytic_count:,} candidates on {e.cluster.name} in {e.seconds:.1f} s "
             f"{'' if e.time_budget_s is None else f'(budget {e.time_budget_s:g} s) '}"
             f"({e.candidates_per_minute:,.0f} per minute scored analytically; {len(e.scored)} simulated)"]
    for i, s in enumerate(e.scored[:top]):
        lines.append(f"{i + 1:>2}. {s.result.samples_per_s:>14,.0f} samples/s  {_name(e, s)}")  # type: ignore[union-attr]
    for k, b in e.baselines.items():
        fig = f"{b.result.samples_per_s:>14,.0f} samples/s" if isinstance(b, Scored) else f"{'-':>14}           "  # type: ignore[union-attr]
        lines.append(f"    {fig}  baseline {k}{'' if isinstance(b, Scored) else ': ' + b}")
    for k, g in gains(e).items():
        lines.append(f"best vs {k}: {100 * (g - 1):+.1f}%")
    full = best_using_all(e)
    if full is not None and full is not e.scored[0]:
        lines.append(f"best on every rank: {full.result.samples_per_s:,.0f} samples/s  {_name(e, full)}")  # type: ignore[union-attr]
        for k, g in gains(e, full).items():
            lines.append(f"best on every rank vs {k}: {100 * (g - 1):+.1f}%")
    return "\n".join(lines)


_COLORS = ["#4878cf", "#6acc65", "#d65f5f", "#b47cc7", "#c4ad66", "#77bedb", "#bbbbbb", "#e08e45", "#333333"]


def _bars(e: Exploration, rows: list[Scored], width: int = 900) -> str:
    cats = sorted({k for s in rows for k in s.result.breakdown})  # type: ignore[union-attr]
    top = max(s.result.step_time_s for s in rows) or 1.0  # type: ignore[union-attr]
    h = 22
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h * len(rows) + 50}">']
    for i, s in enumerate(rows):
        x, y = 40.0, 10 + i * h
        parts.append(f'<text x="2" y="{y + 14}" font-size="11">{i + 1}</text>')
        for j, k in enumerate(cats):
            w = s.result.breakdown.get(k, 0.0) / top * (width - 60)  # type: ignore[union-attr]
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h - 4}" fill="{_COLORS[j % len(_COLORS)]}">'
                         f'<title>{html.escape(k)}</title></rect>')
            x += w
    y = 20 + h * len(rows)
    x = 40
    for j, k in enumerate(cats):
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{_COLORS[j % len(_COLORS)]}"/>'
                     f'<text x="{x + 13}" y="{y + 9}" font-size="10">{html.escape(k)}</text>')
        x += 14 + 6 * len(k)
    parts.append("</svg>")
    return "\n".join(parts)


def write_html(path: str, e: Exploration, top: int = 10) -> None:
    rows = e.scored[:top] + [b for b in e.baselines.values() if isinstance(b, Scored) and b not in e.scored[:top]]
    trs = []
    for i, s in enumerate(rows):
        r = s.result
        trs.append(f"<tr><td>{i + 1}</td><td>{html.escape(_name(e, s))}</td><td>{r.samples_per_s:,.0f}</td>"  # type: ignore[union-attr]
                   f"<td>{r.step_time_s * 1e3:.3f}</td><td>{s.accuracy[1]:.4f}</td>"  # type: ignore[union-attr]
                   f"<td><code>{html.escape(' '.join('--set ' + o for o in s.candidate.overrides()))}</code></td></tr>")
    absent = "".join(f"<li>{html.escape(k)}: {html.escape(b)}</li>" for k, b in e.baselines.items() if isinstance(b, str))
    gain = "".join(f"<li>best vs {html.escape(k)}: {100 * (g - 1):+.1f}%</li>" for k, g in gains(e).items())
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>recscale explore: {html.escape(e.cluster.name)}</title>
<style>body{{font-family:sans-serif;margin:20px}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}</style>
</head><body>
<h2>recscale explore on {html.escape(e.cluster.name)}</h2>
<p>{e.analytic_count:,} candidates scored ({e.candidates_per_minute:,.0f} per minute, analytic), {len(e.scored)} simulated, {e.seconds:.1f} s.</p>
<ul>{gain}{absent}</ul>
<table><tr><th>#</th><th>configuration</th><th>samples/s (simulated)</th><th>step ms</th><th>AUC cost</th><th>overrides</th></tr>
{''.join(trs)}</table>
<h3>Simulated step, critical path by category</h3>
{_bars(e, rows)}
</body></html>
"""
    write_text_atomic(path, page)
