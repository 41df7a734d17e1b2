"""Collectives used by the sharded embeddings and the dense all-reduce.

Thin, typed wrappers over ``torch.distributed`` that (1) count the bytes this rank sends to
other ranks, per named collective, and (2) turn a failed or timed-out collective into one
``DistributedError`` that names this rank and the collective.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recscale.comm.errors import DistributedError
from recscale.comm.shared_memory import PendingShared, row_bytes, shared_memory_group


# A debugging aid, off unless set: a directory where each rank appends, per collective it
# issues and waits for, "<name> <issue|wait|done> <time.perf_counter()>" (one file a rank),
# to line up collectives with a link's byte counters.
_TRACE_DIR = os.environ.get("RECSCALE_COMM_TRACE")


def _trace(name: str, event: str) -> None:
    t = time.perf_counter()
    path = os.path.join(_TRACE_DIR or ".", f"rank{os.environ.get('RANK', '0')}.trace")
    with open(path, "a") as f:
        f.write(f"{name} {event} {t:.6f}\n")


@dataclass
class CommStats:
    """Bytes sent to other ranks and number of calls, per collective name.

    With ``ranks_per_host`` set (group rank r on host r // ranks_per_host), all-to-alls also
    count the bytes sent to other hosts: the ones that cross the slow links."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cross_host_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ranks_per_host: int = 0

    def add(self, name: str, nbytes: int) -> None:
        self.bytes_sent[name] += int(nbytes)
        self.calls[name] += 1
        if _TRACE_DIR:
            _trace(name, "issue")

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to ``name`` (blocking time of this rank)."""
        t0 = time.perf_counter()
        if _TRACE_DIR:
            _trace(name, "wait")
        try:
            with torch.profiler.record_function(f"comm:{name}"):  # visible in profiles as communication
                yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            if _TRACE_DIR:
                _trace(name, "done")

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.cross_host_bytes.clear()
        self.calls.clear()
        self.seconds.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes_sent)


def _fail(name: str, err: Exception) -> DistributedError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistributedError(
        f"rank {rank}: collective '{name}' failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
        "another rank probably died or hung past the timeout"
    )


def all_to_all(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int] | None,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> torch.Tensor:
    """Exchange dim-0 slices: ``send_splits[d]`` rows go to rank d; returns the received rows."""
    return all_to_all_async(x, send_splits, recv_splits, group, stats, name).wait()


class PendingCollective:
    """The received tensor of a collective started with ``async_op``; ``wait()`` returns it
    once it has arrived (and counts the blocking time, as the synchronous calls do)."""

    def __init__(self, out: torch.Tensor | None, work, name: str, stats: CommStats | None,
                 counts: list[int] | None = None) -> None:
        self._out, self._work, self._name, self._stats, self._counts = out, work, name, stats, counts

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                with self._stats.timed(self._name) if self._stats is not None else nullcontext():
                    got = self._work.wait()
            except DistributedError:
                raise
            except RuntimeError as e:
                raise _fail(self._name, e) from e
            if isinstance(self._work, PendingShared):
                self._out = got
                if self._counts is None:
                    self._counts = self._work.rows_from()
            self._work = None
        assert self._out is not None
        return self._out

    def rows_from(self) -> list[int]:
        """Rows received from each rank (waits first)."""
        self.wait()
        assert self._counts is not None, "rows_from() is for all-to-alls started without recv_splits"
        return self._counts


def all_to_all_async(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int] | None,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> PendingCollective:
    """``all_to_all`` that returns at once; the exchange runs while the caller computes.

    ``recv_splits`` may be ``None`` when this rank does not know what others send it:
    through shared memory the sizes travel with the data and nothing blocks; through the
    process group's backend a small blocking exchange of the sizes comes first. Then
    ``rows_from()`` of the result tells the rows received from each rank. Every rank must
    start its collectives in the same order (as for the blocking calls), and leave ``x``
    unchanged until ``wait()``."""
    if recv_splits is None:
        return all_to_all_unsized_async([(x, send_splits, name)], group, stats)[0]
    return _start_all_to_all(x, send_splits, recv_splits, group, stats, name)


def all_to_all_unsized_async(
    parts: Sequence[tuple[torch.Tensor, Sequence[int], str]],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> list[PendingCollective]:
    """Several ``all_to_all_async`` whose receive sizes no rank knows in advance (``(x,
    send_splits, name)`` each), started in order. Through shared memory the sizes travel with
    the data; through the process group's backend one blocking exchange carries all their
    sizes first (``exchange_sizes``): one round trip, not one per exchange."""
    on_cpu = bool(parts) and parts[0][0].device.type == "cpu"
    if group is None or not parts or (on_cpu and shared_memory_group(group) is not None):
        return [_start_all_to_all(x, splits, None, group, stats, name) for x, splits, name in parts]
    recv = exchange_sizes([splits for _, splits, _ in parts], group, parts[0][0].device,
                          "+".join(name for *_, name in parts) + ".sizes")
    return [_start_all_to_all(x, splits, r, group, stats, name, counts=r) for (x, splits, name), r in zip(parts, recv)]


def _start_all_to_all(x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int] | None,
                      group: dist.ProcessGroup | None, stats: CommStats | None, name: str,
                      counts: list[int] | None = None) -> PendingCollective:
    """Count the bytes and start the exchange: through shared memory (``recv_splits`` may be
    ``None``), else through the backend (``recv_splits`` known; ``counts``: what ``rows_from``
    reports)."""
    if group is None:
        return PendingCollective(x.clone(), None, name, stats, [x.shape[0]])
    if stats is not None:
        me = dist.get_rank(group)
        stats.add(name, (int(sum(send_splits)) - int(send_splits[me])) * row_bytes(x))
        if 0 < stats.ranks_per_host < len(send_splits):  # several hosts
            host = me // stats.ranks_per_host
            away = sum(int(n) for d, n in enumerate(send_splits) if d // stats.ranks_per_host != host)
            stats.cross_host_bytes[name] += away * row_bytes(x)
    shm = shared_memory_group(group) if x.device.type == "cpu" else None
    if shm is not None:
        return PendingCollective(None, shm.all_to_all(x, send_splits, recv_splits, name), name, stats)
    assert recv_splits is not None, "through the backend the receive sizes are exchanged first"
    out = x.new_empty((int(sum(recv_splits)),) + tuple(x.shape[1:]))
    try:
        work = dist.all_to_all_single(
            out, x.contiguous(), list(map(int, recv_splits)), list(map(int, send_splits)), group=group, async_op=True
        )
    except RuntimeError as e:
        raise _fail(name, e) from e
    return PendingCollective(out, work, name, stats, counts)


def exchange_sizes(send_splits: Sequence[Sequence[int]], group: dist.ProcessGroup,
                   device: torch.device, name: str = "sizes") -> list[list[int]]:
    """What every rank sends this one in each of several all-to-alls (``send_splits[i][d]``:
    the rows of exchange i for rank d), in one blocking all-to-all of the sizes."""
    sizes = torch.tensor([[int(n) for n in s] for s in send_splits], dtype=torch.int64, device=device).T.contiguous()
    ones = [1] * sizes.shape[0]
    got = _start_all_to_all(sizes, ones, ones, group, None, name).wait()
    return [[int(v) for v in col] for col in got.T]


def all_gather_sizes(n: int, group: dist.ProcessGroup | None, device: torch.device, name: str = "sizes") -> list[int]:
    if group is None:
        return [n]
    world = dist.get_world_size(group)
    t = torch.tensor([n], dtype=torch.int64, device=device)
    shm = shared_memory_group(group) if device.type == "cpu" else None
    if shm is not None:
        return [int(v) for v in torch.cat(shm.all_gather(t.view(1, 1), name))]
    out = [torch.empty_like(t) for _ in range(world)]
    try:
        dist.all_gather(out, t, group=group)
    except RuntimeError as e:
        raise _fail(name, e) from e
    return [int(v) for v in out]


def _check_own_size(x: torch.Tensor, group: dist.ProcessGroup, sizes: Sequence[int], name: str) -> None:
    if int(sizes[dist.get_rank(group)]) != x.shape[0]:
        raise ValueError(f"{name}: this rank has {x.shape[0]} rows but sizes says {sizes[dist.get_rank(group)]}")


def all_gather_rows(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_gather",
    sizes: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Gather tensors whose dim 0 differs across ranks (padded to the largest, then trimmed).
    ``sizes``: every rank's dim 0 when the caller already knows them (saves an exchange)."""
    if group is None:
        return [x]
    if sizes is not None:
        _check_own_size(x, group, sizes, name)
    shm = shared_memory_group(group) if x.device.type == "cpu" else None
    if shm is not None:
        if stats is not None:
            stats.add(name, x.element_size() * x.numel() * (dist.get_world_size(group) - 1))
        with stats.timed(name) if stats is not None else nullcontext():
            return shm.all_gather(x, name)
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device, name + ".sizes")
    biggest = max(sizes)
    padded = x.new_zeros((biggest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    out = [torch.empty_like(padded) for _ in sizes]
    if stats is not None:
        stats.add(name, row_bytes(x) * biggest * (len(sizes) - 1))
    try:
        with stats.timed(name) if stats is not None else nullcontext():
            dist.all_gather(out, padded, group=group)
    except RuntimeError as e:
        raise _fail(name, e) from e
    return [t[:n] for t, n in zip(out, sizes)]


def all_gather_concat(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    name: str = "all_gather",
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """``torch.cat(all_gather_rows(...))`` without the intermediate parts: with ``sizes`` known
    and shared memory, each rank's rows are copied once, straight into the result."""
    if group is None:
        return x
    shm = shared_memory_group(group) if x.device.type == "cpu" else None
    if shm is None or sizes is None:
        return torch.cat(all_gather_rows(x, group, stats, name, sizes))
    _check_own_size(x, group, sizes, name)
    if stats is not None:
        stats.add(name, x.element_size() * x.numel() * (dist.get_world_size(group) - 1))
    with stats.timed(name) if stats is not None else nullcontext():
        return shm.all_gather_into(x.contiguous(), sizes, name)


def all_reduce_sum(
    x: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats | None = None, name: str = "all_reduce", async_op: bool = False
):
    """In-place sum over ranks; with ``async_op`` returns the work handle."""
    if group is None:
        return None
    if stats is not None:
        world = dist.get_world_size(group)
        # A ring all-reduce sends 2 (N - 1) / N of the buffer from each rank.
        stats.add(name, int(2 * (world - 1) / world * x.numel() * x.element_size()))
    try:
        return dist.all_reduce(x, group=group, async_op=async_op)
    except RuntimeError as e:
        raise _fail(name, e) from e


def all_gather_object_check(value: str, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on every rank when ranks disagree on ``value`` (e.g. a config or plan digest)."""
    if group is None:
        return
    values: list[str] = [""] * dist.get_world_size(group)
    try:
        dist.all_gather_object(values, value, group=group)
    except RuntimeError as e:
        raise _fail(f"check {what}", e) from e
    if len(set(values)) > 1:
        groups: dict[str, list[int]] = defaultdict(list)
        for r, v in enumerate(values):
            groups[v].append(r)
        parts = "; ".join(f"ranks {ranks} have {v[:12]}" for v, ranks in groups.items())
        raise DistributedError(f"ranks were started with different {what}: {parts}; start every rank with the same one")
