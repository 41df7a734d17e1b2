"""``RECSCALE_COMM_TRACE``: each rank's collectives, issued, waited for and done, in order."""

from __future__ import annotations

from recscale.comm import collectives
from recscale.comm.collectives import CommStats


def test_trace_is_off_by_default_and_logs_issue_wait_done(tmp_path, monkeypatch):
    stats = CommStats()
    stats.add("output_a2a", 8)  # off: nothing written anywhere
    monkeypatch.setattr(collectives, "_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    stats.add("grad_a2a", 8)
    with stats.timed("grad_a2a"):
        pass
    rows = [ln.split() for ln in (tmp_path / "rank3.trace").read_text().splitlines()]
    assert [(n, e) for n, e, _ in rows] == [("grad_a2a", "issue"), ("grad_a2a", "wait"), ("grad_a2a", "done")]
    times = [float(t) for _, _, t in rows]
    assert times == sorted(times)
    assert list(tmp_path.iterdir()) == [tmp_path / "rank3.trace"]
    assert stats.calls == {"output_a2a": 1, "grad_a2a": 1}
