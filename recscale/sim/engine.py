"""A discrete-event simulation of in-order streams and shared links.

Every rank has streams (``compute``, ``comm``, ``load``) that run their operations in program
order, as a CUDA stream or a CPU rank's main thread does. A collective is one operation of all
its ranks. Each rank issues it when its own inputs are ready and its ``comm`` stream (and,
when ``blocking``, its ``compute`` stream: a CPU rank waiting in a synchronous call) is free; a
link starts carrying the collective's bytes once every rank that sends over it has issued it
and the link has drained what earlier operations put on it (each link direction is a queue
draining at its bandwidth, so two collectives of one stream that share a link, the next
batch's ids and this batch's outputs, queue on it). Given which ranks
send and receive over each link (``link_ends``), the collective ends per rank, as over TCP and
NCCL: a rank is done when the bytes it receives have arrived and its sends fit in its send
buffer (``send_buffer`` bytes; what is beyond it holds the sender until the link drains it),
plus the latency; a heavy direction keeps draining while its senders go on. Without
``link_ends`` every rank ends when the slowest link is done.

Collectives of different streams (separate process groups: their own connections and worker
threads under gloo, their own communicators and streams under NCCL) can be on a link at once:
the link then drains their bytes together, each getting an equal share while it has bytes
left, and each ends when its own bytes are through (processor sharing), not one after the
other. Operations are scheduled in the order they are added (a valid topological order); a
transfer's end may still move while a later collective joins its link, until some operation
reads it (as a dependency or the next operation of a stream): from then on it is fixed, and
what comes later on that link queues behind it. A step of thousands of operations costs
milliseconds to simulate.
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
    # every rank ends when the slowest link is through, whatever ``link_ends`` says: a ring,
    # where every rank forwards the others' parts until the last one is round
    together: bool = False
    # set by the simulation
    start: float = 0.0
    end: float = 0.0
    cause: int | None = None  # the op whose end (or whose hold on a link) decided this one
    wire_start: float = 0.0  # when its slowest link began carrying it
    rank_end: dict[int, float] = field(default_factory=dict)  # when each rank is done with it; end is the latest

    def end_for(self, rank: int) -> float:
        return self.rank_end.get(rank, self.end)


@dataclass
class _Transfer:
    """One operation's bytes on one link: from ``begin`` (it is issued and the link's fixed
    backlog is through) until ``done`` (its last byte is across)."""

    op: int
    begin: float
    nbytes: float
    done: float = 0.0


def shared_finish(transfers: list[tuple[float, float]], bw: float, tokens: float = 0.0,
                  bucket: float = 0.0) -> list[float]:
    """When each of ``transfers`` ((begin, bytes)) is through a link of ``bw`` bytes/s that
    drains every transfer with bytes left at an equal share (processor sharing); one alone
    gets the whole link, so transfers that do not overlap end as in a queue. A shaped link
    (``bucket`` > 0: a token bucket of that many bytes, ``tokens`` of them there when the first
    transfer begins) passes bytes that find tokens at once (``drain``)."""
    return drain(transfers, bw, tokens, bucket)[0]


def drain(transfers: list[tuple[float, float]], bw: float, tokens: float = 0.0,
          bucket: float = 0.0) -> tuple[list[float], float, float]:
    """``shared_finish``, and the tokens left in the bucket when the last transfer is through,
    with that time. A token bucket (tc's ``tbf``) refills at ``bw`` up to ``bucket`` bytes
    while nothing waits on the link and lets what arrives through at once while it has tokens:
    after an idle spell the first ``bucket`` bytes cross without waiting; while bytes queue it
    drains at ``bw``, as a plain link."""
    n = len(transfers)
    order = sorted(range(n), key=lambda i: transfers[i][0])
    left = [b for _, b in transfers]
    done = [0.0] * n
    active: list[int] = []
    nxt = 0
    t = transfers[order[0]][0] if n else 0.0
    while nxt < n or active:
        if not active:
            t_next = max(t, transfers[order[nxt]][0])
            tokens = min(bucket, tokens + bw * (t_next - t))  # the idle link's bucket fills
            t = t_next
        while nxt < n and transfers[order[nxt]][0] <= t:
            i = order[nxt]
            nxt += 1
            take = min(tokens, left[i])
            left[i] -= take
            tokens -= take
            if left[i] <= 1e-9 * transfers[i][1]:
                done[i] = t  # all of it through on the bucket's tokens
            else:
                active.append(i)
        if not active:
            continue
        rate = bw / len(active)
        first = min(active, key=lambda i: left[i])
        finish = t + left[first] / rate
        arrival = transfers[order[nxt]][0] if nxt < n else float("inf")
        step_to = min(finish, arrival)
        for i in active:
            left[i] -= rate * (step_to - t)
        t = step_to
        if finish <= arrival:
            left[first] = 0.0
            # everything whose bytes ran out at this instant ends now
            for i in [i for i in active if left[i] <= 1e-9 * transfers[i][1]]:
                done[i] = t
                active.remove(i)
    return done, tokens, t


class Simulation:
    def __init__(self, bandwidth: dict[str, float], link_ends: LinkEnds | None = None,
                 send_buffer: float = 0.0, burst: dict[str, float] | None = None) -> None:
        """``bandwidth``: bytes/s of each link kind (the part of a ``Link`` before the index);
        ``link_ends``: the senders and receivers of a link, for collectives that end per rank;
        ``send_buffer``: bytes a rank's sends may have in flight without holding it;
        ``burst``: per link kind, the token bucket its shaper has (bytes; none: a plain link)."""
        self.bandwidth = bandwidth
        self.burst = burst or {}
        # per shaped link: the tokens its current busy period began with, and (tokens, time)
        # when its last computed busy period ended
        self._tokens_at_begin: dict[Link, float] = {}
        self._tokens_at_end: dict[Link, tuple[float, float]] = {}
        self.link_ends = link_ends
        self.send_buffer = send_buffer
        self.ops: list[Op] = []
        self._stream: dict[tuple[int, str], int] = {}
        # per link: when the transfers already read are through, and the op whose end that is
        self._link_free: dict[Link, tuple[float, int]] = {}
        self._on_link: dict[Link, list[_Transfer]] = {}  # the transfers of each link's busy period
        self._transfers: dict[int, list[tuple[Link, _Transfer]]] = {}  # per op, while open
        self._ready_at: dict[int, dict[int, float]] = {}  # per open op: when each rank issued it

    def _read(self, idx: int) -> Op:
        """``ops[idx]``, whose end now decides another op's: it can no longer move, so its
        transfers join their links' fixed backlog."""
        for link, tr in self._transfers.pop(idx, ()):
            if tr.done > self._link_free.get(link, (0.0, -1))[0]:
                self._link_free[link] = (tr.done, idx)
        self._ready_at.pop(idx, None)
        return self.ops[idx]

    def _ready(self, op: Op, rank: int) -> tuple[float, int | None]:
        """When ``rank`` can issue ``op``: its dependencies done for it, its streams free."""
        start, cause = 0.0, None
        for d in op.deps:
            dep = self._read(d)
            t = dep.end_for(rank)
            if t > start:
                start, cause = t, d
        for stream in (op.stream, "compute") if op.blocking else (op.stream,):
            last = self._stream.get((rank, stream))
            if last is not None and self._read(last).end_for(rank) > start:
                start, cause = self.ops[last].end_for(rank), last
        return start, cause

    def _finish(self, idx: int) -> None:
        """``ops[idx]``'s end (per rank, given ``link_ends``) from its transfers' ends."""
        op = self.ops[idx]
        ready = self._ready_at[idx]
        per_rank = self.link_ends is not None and len(op.ranks) > 1 and not op.together
        done_by_rank = dict(ready) if per_rank else {}
        end, wire_start = op.start, op.start
        for link, tr in self._transfers.get(idx, ()):
            if per_rank:
                senders, receivers = self.link_ends(link)  # type: ignore[misc]
                for r in receivers:
                    if r in done_by_rank and tr.done > done_by_rank[r]:
                        done_by_rank[r] = tr.done
                # a sender goes on once what it has left to send fits in its buffer
                sending = [s for s in senders if s in done_by_rank]
                if sending:
                    held = tr.done - len(sending) * self.send_buffer / self.bandwidth[link[0]]
                    for s in sending:
                        if held > done_by_rank[s]:
                            done_by_rank[s] = held
            if tr.done > end:
                end, wire_start = tr.done, tr.begin
        op.wire_start = wire_start
        if per_rank:
            op.rank_end = {r: t + op.duration_s for r, t in done_by_rank.items()}
            op.end = max(op.rank_end.values())
        else:
            op.end = end + op.duration_s

    def add(self, op: Op) -> int:
        """Schedule ``op`` after its dependencies and what its streams and links already hold;
        on a link that open transfers of other streams are on, it shares the link with them."""
        idx = len(self.ops)
        ready = {r: self._ready(op, r) for r in op.ranks}
        start, cause = 0.0, None
        for r in op.ranks:
            if ready[r][0] > start or cause is None:
                start, cause = ready[r]
        per_rank = self.link_ends is not None and len(op.ranks) > 1 and not op.together
        op.start = start
        self.ops.append(op)
        self._ready_at[idx] = {r: ready[r][0] for r in op.ranks}
        touched: set[int] = {idx}
        mine: list[tuple[Link, _Transfer]] = []
        slowest: tuple[float, float, float, int] | None = None  # done, begin, issued, holder
        for link, nbytes in op.links.items():
            if nbytes <= 0:
                continue
            free, holder = self._link_free.get(link, (0.0, -1))
            senders = self.link_ends(link)[0] if per_rank else frozenset()  # type: ignore[misc]
            issued = max((ready[s][0] for s in senders if s in ready), default=start) if per_rank else start
            tr = _Transfer(idx, max(issued, free), nbytes)
            busy = self._on_link.setdefault(link, [])
            bw, bucket = self.bandwidth[link[0]], self.burst.get(link[0], 0.0)
            if all(o.done <= tr.begin for o in busy):
                busy.clear()  # the link is idle when this one begins: what came before is through
                # a shaped link's bucket filled while it idled
                left, at = self._tokens_at_end.get(link, (bucket, tr.begin))
                self._tokens_at_begin[link] = min(bucket, left + bw * max(0.0, tr.begin - at))
            busy.append(tr)
            # the whole busy period again: the transfers already read ended before this one
            # begins, so they come out as they were; the open ones that overlap it move
            ends, left, at = drain([(o.begin, o.nbytes) for o in busy], bw, self._tokens_at_begin.get(link, 0.0), bucket)
            self._tokens_at_end[link] = (left, at)
            for o, t in zip(busy, ends):
                if o.op == idx or o.op in self._transfers:
                    o.done = t
                    touched.add(o.op)
            mine.append((link, tr))
            if slowest is None or tr.done > slowest[0]:
                slowest = (tr.done, tr.begin, issued, holder)
        self._transfers[idx] = mine
        for i in sorted(touched):
            self._finish(i)
        if slowest is not None and slowest[1] > slowest[2] and slowest[3] >= 0:
            cause = slowest[3]  # waiting for a link another op held: that op is on the path, not our inputs
        op.cause = cause
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
