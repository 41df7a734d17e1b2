"""A discrete-event simulation of in-order streams and shared links.

Every rank has streams (``compute``, ``comm``, ``load``) that run their operations in program
order, as a CUDA stream or a CPU rank's main thread does. A collective is one operation of all
its ranks: it starts when its inputs are ready and every participant's ``comm`` stream (and,
when ``blocking``, its ``compute`` stream: a CPU rank waiting in a synchronous call) is free; it
moves its bytes over every link it crosses, each link carrying one transfer at a time, so two
collectives that share a link (the next batch's ids and this batch's outputs, gradient buckets
and the gradient all-to-all) queue on it; it ends when its slowest link is done, plus its
latency. Operations are scheduled in the order they are added (a valid topological order), so
a step of thousands of operations costs milliseconds to simulate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Link = tuple[str, int]  # ("host_out", host), ("intra_in", rank), ("tier0_out", group), ...


@dataclass
class Op:
    name: str
    category: str  # the breakdown it counts under
    step: int
    ranks: tuple[int, ...]
    stream: str  # "compute", "comm" or "load"
    duration_s: float = 0.0  # compute time, or a collective's latency
    links: dict[Link, float] = field(default_factory=dict)  # bytes per link
    deps: list[int] = field(default_factory=list)
    blocking: bool = False  # a collective that also holds its ranks' compute streams
    # set by the simulation
    start: float = 0.0
    end: float = 0.0
    cause: int | None = None  # the op whose end (or whose hold on a link) decided this one
    wire_start: float = 0.0  # when its slowest link began carrying it


class Simulation:
    def __init__(self, bandwidth: dict[str, float]) -> None:
        """``bandwidth``: bytes/s of each link kind (the part of a ``Link`` before the index)."""
        self.bandwidth = bandwidth
        self.ops: list[Op] = []
        self._stream: dict[tuple[int, str], int] = {}
        self._link_free: dict[Link, tuple[float, int]] = {}

    def add(self, op: Op) -> int:
        """Schedule ``op`` after its dependencies and what its streams and links already hold."""
        idx = len(self.ops)
        start, cause = 0.0, None
        for d in op.deps:
            if self.ops[d].end > start:
                start, cause = self.ops[d].end, d
        streams = [(r, op.stream) for r in op.ranks]
        if op.blocking:
            streams += [(r, "compute") for r in op.ranks]
        for key in streams:
            last = self._stream.get(key)
            if last is not None and self.ops[last].end > start:
                start, cause = self.ops[last].end, last
        end, wire_start, link_cause = start, start, None
        for link, nbytes in op.links.items():
            if nbytes <= 0:
                continue
            free, holder = self._link_free.get(link, (0.0, -1))
            begin = max(start, free)
            done = begin + nbytes / self.bandwidth[link[0]]
            self._link_free[link] = (done, idx)
            if done > end:
                end, wire_start = done, begin
                # waiting for a link another op held: that op is on the path, not our inputs
                link_cause = holder if begin > start and holder >= 0 else None
        if link_cause is not None:
            cause = link_cause
        op.start, op.end, op.cause, op.wire_start = start, end + op.duration_s, cause, wire_start
        self.ops.append(op)
        for key in streams:
            self._stream[key] = idx
        return idx

    def critical_path(self, last: int, window_start: float) -> tuple[list[int], dict[str, float]]:
        """Ops from ``last`` back along their causes until ``window_start``, and the time the
        path spends in each category over [window_start, end of ``last``] (idle gaps count as
        ``wait``): it sums to that interval exactly."""
        path: list[int] = []
        spent: dict[str, float] = {}
        cursor = self.ops[last].end
        i: int | None = last
        while i is not None and cursor > window_start:
            op = self.ops[i]
            if op.end < cursor:
                spent["wait"] = spent.get("wait", 0.0) + cursor - max(op.end, window_start)
                cursor = max(op.end, window_start)
            begin = max(op.wire_start if op.links else op.start, window_start)
            if cursor > begin:
                spent[op.category] = spent.get(op.category, 0.0) + cursor - begin
                cursor = begin
            path.append(i)
            i = op.cause
        if cursor > window_start:
            spent["wait"] = spent.get("wait", 0.0) + cursor - window_start
        path.reverse()
        return path, spent
