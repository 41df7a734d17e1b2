"""Plan reports: a per-rank text table for the terminal and an HTML page with a load chart."""

from __future__ import annotations

import html

from recscale.atomic import write_text_atomic
from recscale.planner.search import PlanResult


def rank_table(result: PlanResult, max_rows: int = 32) -> str:
    """Per rank: tables held, memory, predicted compute and communication; then the summary."""
    header = f"{'rank':>4}  {'tables':>6}  {'memory GB':>9}  {'compute ms':>10}  {'comm ms':>8}  {'total ms':>8}  tables held"
    lines = [header, "-" * len(header)]
    ranks = list(enumerate(result.ranks))
    shown = ranks if len(ranks) <= max_rows else ranks[: max_rows // 2] + ranks[-max_rows // 2 :]
    for i, (r, load) in enumerate(shown):
        if len(ranks) > max_rows and i == max_rows // 2:
            lines.append(f"{'...':>4}")
        names = ", ".join(load.tables[:4]) + (f", +{len(load.tables) - 4}" if len(load.tables) > 4 else "")
        lines.append(
            f"{r:>4}  {len(load.tables):>6}  {load.memory_bytes / 1e9:>9.2f}  {load.compute_s * 1e3:>10.3f}  "
            f"{load.comm_s * 1e3:>8.3f}  {(load.time_s + result.common_s) * 1e3:>8.3f}  {names}"
        )
    lines.append(summary_line(result))
    return "\n".join(lines)


def summary_line(result: PlanResult) -> str:
    kinds: dict[str, int] = {}
    for t in result.plan.tables:
        kinds[t.sharding_type] = kinds.get(t.sharding_type, 0) + 1
    mix = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return (
        f"predicted step (slowest rank): {result.max_rank_s * 1e3:.3f} ms; imbalance (max / mean) "
        f"{result.imbalance:.3f}; common to all ranks {result.common_s * 1e3:.3f} ms; {mix}; "
        f"planned in {result.seconds:.2f} s"
    )


def _svg_bars(result: PlanResult, width: int = 900, height: int = 260) -> str:
    n = len(result.ranks)
    top = max((r.time_s + result.common_s) for r in result.ranks) or 1.0
    bar_w = max(1.0, (width - 60) / n)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 40}">']
    parts.append(f'<text x="5" y="14" font-size="12">predicted ms per rank (max {top * 1e3:.3f})</text>')
    for i, r in enumerate(result.ranks):
        x = 50 + i * bar_w
        segs = [(result.common_s, "#bbbbbb"), (r.compute_s, "#4878cf"), (r.comm_s, "#d65f5f")]
        y = height + 20
        for value, color in segs:
            h = value / top * height
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 0.5):.1f}" height="{h:.1f}" fill="{color}"/>')
    parts.append(f'<line x1="48" y1="{height + 20}" x2="{width}" y2="{height + 20}" stroke="black"/>')
    parts.append(f'<text x="50" y="{height + 36}" font-size="11">rank 0 .. {n - 1}; grey: common, blue: compute, red: communication</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_html_report(path: str, result: PlanResult, title: str = "recscale plan", extra: str = "") -> None:
    rows = "\n".join(
        f"<tr><td>{i}</td><td>{len(r.tables)}</td><td>{r.memory_bytes / 1e9:.2f}</td><td>{r.compute_s * 1e3:.3f}</td>"
        f"<td>{r.comm_s * 1e3:.3f}</td><td>{html.escape(', '.join(r.tables))}</td></tr>"
        for i, r in enumerate(result.ranks)
    )
    tables = "\n".join(
        f"<tr><td>{html.escape(t.table)}</td><td>{t.sharding_type}</td><td>"
        + "; ".join(f"r{s.rank}: rows {s.row_offset}+{s.num_rows}, cols {s.col_offset}+{s.num_cols}" for s in t.shards[:8])
        + (f"; ... {len(t.shards) - 8} more" if len(t.shards) > 8 else "")
        + "</td></tr>"
        for t in result.plan.tables
    )
    note = f"<p>{html.escape(result.note)}</p>" if result.note else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style>
</head><body><h1>{html.escape(title)}</h1><p>{html.escape(summary_line(result))}</p>{note}{extra}
{_svg_bars(result)}
<h2>Ranks</h2><table><tr><th>rank</th><th>tables</th><th>memory GB</th><th>compute ms</th><th>comm ms</th><th>tables held</th></tr>
{rows}</table>
<h2>Tables</h2><table><tr><th>table</th><th>sharding</th><th>shards</th></tr>
{tables}</table></body></html>
"""
    write_text_atomic(path, page)
