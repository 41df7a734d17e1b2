"""A discrete-event simulation of in-order streams and shared links.

Every rank has streams (``compute``, ``comm``, ``load``) that run their operations in program
order, as a CUDA stream or a CPU rank's main thread does. A collective is one operation of all
its ranks. Each rank issues it when its own inputs are ready and its ``comm`` stream (and,
when ``blocking``, its ``compute`` stream: a CPU rank waiting in a synchronous call) is free; a
link starts carrying the collective's bytes once every rank that sends over it has issued it
and the link has drained what earlier operations put on it (each link direction is a queue
draining at its bandwidth, so two collectives that share a link, the next batch's ids and this
batch's outputs, gradient buckets and the gradient all-to-all, queue on it). Given which ranks
send and receive over each link (``link_ends``), the collective ends per rank, as over TCP and
NCCL: a rank is done when the bytes it receives have arrived and its sends fit in its send
buffer (``send_buffer`` bytes; what is beyond it holds the sender until the link drains it),
plus the latency; a heavy direction keeps draining while its senders go on. Without
``link_ends`` every rank ends when the slowest link is done. Operations are scheduled in the order they are added (a valid topological order), so
a step of thousands of operations costs milliseconds to simulate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Link = tuple[str, int]  # ("host_out", host), ("intra_in", rank), ("tier0_out", group), ...
# The ranks whose bytes a link carries and the ranks it carries them to.
LinkEnds = Callable[[Link], tuple[frozenset[int], frozenset[int]]]


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
    rank_end: dict[int, float] = field(default_factory=dict)  # when each rank is done with it; end is the latest

    def end_for(self, rank: int) -> float:
        return self.rank_end.get(rank, self.end)


class Simulation:
    def __init__(self, bandwidth: dict[str, float], link_ends: LinkEnds | None = None,
                 send_buffer: float = 0.0) -> None:
        """``bandwidth``: bytes/s of each link kind (the part of a ``Link`` before the index);
        ``link_ends``: the senders and receivers of a link, for collectives that end per rank;
        ``send_buffer``: bytes a rank's sends may have in flight without holding it."""
        self.bandwidth = bandwidth
        self.link_ends = link_ends
        self.send_buffer = send_buffer
        self.ops: list[Op] = []
        self._stream: dict[tuple[int, str], int] = {}
        self._link_free: dict[Link, tuple[float, int]] = {}

    def _ready(self, op: Op, rank: int) -> tuple[float, int | None]:
        """When ``rank`` can issue ``op``: its dependencies done for it, its streams free."""
        start, cause = 0.0, None
        for d in op.deps:
            dep = self.ops[d]
            t = dep.end_for(rank)
            if t > start:
                start, cause = t, d
        for stream in (op.stream, "compute") if op.blocking else (op.stream,):
            last = self._stream.get((rank, stream))
            if last is not None and self.ops[last].end_for(rank) > start:
                start, cause = self.ops[last].end_for(rank), last
        return start, cause

    def add(self, op: Op) -> int:
        """Schedule ``op`` after its dependencies and what its streams and links already hold."""
        idx = len(self.ops)
        ready = {r: self._ready(op, r) for r in op.ranks}
        start, cause = 0.0, None
        for r in op.ranks:
            if ready[r][0] > start or cause is None:
                start, cause = ready[r]
        per_rank = self.link_ends is not None and len(op.ranks) > 1
        done_by_rank = {r: ready[r][0] for r in op.ranks} if per_rank else {}
        end, wire_start, link_cause = start, start, None
        for link, nbytes in op.links.items():
            if nbytes <= 0:
                continue
            free, holder = self._link_free.get(link, (0.0, -1))
            senders, receivers = self.link_ends(link) if per_rank else (frozenset(), frozenset())
            issued = max((ready[s][0] for s in senders if s in ready), default=start) if per_rank else start
            begin = max(issued, free)
            bw = self.bandwidth[link[0]]
            done = begin + nbytes / bw
            self._link_free[link] = (done, idx)
            if per_rank:
                for r in receivers:
                    if r in done_by_rank and done > done_by_rank[r]:
                        done_by_rank[r] = done
                # a sender goes on once what it has left to send fits in its buffer
                sending = [s for s in senders if s in done_by_rank]
                if sending:
                    held = done - len(sending) * self.send_buffer / bw
                    for s in sending:
                        if held > done_by_rank[s]:
                            done_by_rank[s] = held
            if done > end:
                end, wire_start = done, begin
                # waiting for a link another op held: that op is on the path, not our inputs
                link_cause = holder if begin > issued and holder >= 0 else None
        if link_cause is not None:
            cause = link_cause
        op.start, op.cause, op.wire_start = start, cause, wire_start
        if per_rank:
            op.rank_end = {r: t + op.duration_s for r, t in done_by_rank.items()}
            op.end = max(op.rank_end.values())
        else:
            op.end = end + op.duration_s
        self.ops.append(op)
        for r in op.ranks:
            for stream in (op.stream, "compute") if op.blocking else (op.stream,):
                self._stream[(r, stream)] = idx
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
