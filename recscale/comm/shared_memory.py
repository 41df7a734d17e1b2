"""All-to-all and all-gather among the ranks of one host, through shared memory.

Gloo moves data between processes of one host over TCP loopback, far below memory bandwidth,
so a multi-hot step waits on its pooled outputs (``benchmarks/collectives.py`` compares both).
Ranks of one host can instead copy through files in ``/dev/shm`` at memory speed, as NCCL's
shared-memory transport does between GPUs of one host.

Protocol. Each rank owns a control block and ``SLOTS`` data files. Collective number ``k`` on a
group uses slot ``k % SLOTS`` on every rank: the sender copies its chunks into its slot, writes
each destination's byte range, then publishes ``k``; a receiver waits for ``k`` to appear in each
peer's control block, copies its range out, and marks the slot consumed. A sender reuses a slot
only after every peer has consumed the previous round in it. Published values are plain 8-byte
stores made after the data copy; x86's total store order keeps them in that order for readers,
so other architectures keep gloo (``shared_memory_supported``).

Files are unlinked as soon as every rank has opened them, so nothing is left in ``/dev/shm``
even when a rank is killed. A waiting rank notices a dead peer within half a second and every
wait fails after the group's timeout, as a gloo collective would.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from recscale.comm.errors import DistributedError

SLOTS = 8  # two steps of exchanges (4 per step), so a rank never waits to reuse a slot
_MIN_FILE = 1 << 20
_YIELD_S = 0.005  # how long a waiting rank yields its core before it sleeps
_MIN_FREE = 256 << 20  # do not start on a nearly full /dev/shm (writes there would fail later)
_OP_NAMES = {1: "all_to_all", 2: "all_gather"}
ALL_TO_ALL, ALL_GATHER = 1, 2

# Control block (int64 words): pid, then per slot: published round, op, row bytes, consumed
# round (as a reader of every peer's slot), then (start, end) byte offsets per destination.
_HEAD = 1
_SLOT_FIXED = 4


def shared_memory_supported(directory: str = "/dev/shm") -> bool:
    """x86 (total store order), Linux-style shared memory with room to spare."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= _MIN_FREE and os.access(directory, os.W_OK)


class _Mapped:
    """A file mapped as a uint8 tensor; ``reach(n)`` remaps after the owner has grown it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._mm: mmap.mmap | None = None
        self.remap()

    def remap(self) -> None:
        size = os.fstat(self.fd).st_size
        if size == self.size:
            return
        self._mm = mmap.mmap(self.fd, size)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.size = size

    def reach(self, nbytes: int) -> None:
        if nbytes > self.size:
            self.remap()
            if nbytes > self.size:
                raise DistributedError(f"shared-memory file holds {self.size} bytes but {nbytes} were published")

    def grow(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        new = max(nbytes, 2 * self.size, _MIN_FILE)
        new = (new + _MIN_FILE - 1) // _MIN_FILE * _MIN_FILE
        try:
            os.posix_fallocate(self.fd, 0, new)  # fails cleanly now rather than SIGBUS on a write
        except OSError as e:
            raise DistributedError(
                f"shared memory for collectives is full ({e.strerror} growing a buffer to {new >> 20} MiB); "
                "free space in /dev/shm or set dist.shared_memory = false (RECSCALE_SHARED_MEMORY=0)"
            ) from e
        self.remap()


class PendingShared:
    """One started collective; ``wait()`` copies this rank's parts out of the peers' slots and
    returns the received tensor (``None`` for a gather, whose parts are in ``parts``)."""

    def __init__(self, ex: SharedMemoryGroup, k: int, op: int, name: str, x: torch.Tensor,
                 out: torch.Tensor | None, recv_bytes: Sequence[int] | None, mine: torch.Tensor) -> None:
        self.ex, self.k, self.op, self.name = ex, k, op, name
        self.row_bytes = row_bytes(x)
        self.dtype, self.row_shape = x.dtype, tuple(x.shape[1:])
        self.out, self.recv_bytes, self.mine = out, recv_bytes, mine
        self.parts: list[torch.Tensor] = []
        self.counts: list[int] = []
        self.done = False

    def wait(self) -> torch.Tensor | None:
        if not self.done:
            self.ex._receive(self)
        return self.out

    def rows_from(self) -> list[int]:
        """Rows received from each rank, for an all-to-all without ``recv_splits`` (after ``wait``)."""
        return self.counts


class SharedMemoryGroup:
    """Shared-memory collectives for the ranks of one process group (all on one host).

    Use from one thread, and start collectives in the same order on every rank."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, directory: str, token: str) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._ctl_words = _HEAD + SLOTS * (_SLOT_FIXED + 2 * self.world)
        self._next = 0
        self._pending: dict[int, PendingShared] = {}
        self._paths: list[Path] = []
        base = Path(directory) / f"recscale-{token}"
        self._ctl_path = lambda r: Path(f"{base}-r{r}.ctl")
        self._data_path = lambda r, s: Path(f"{base}-r{r}-s{s}.dat")
        self._ctl: list[memoryview] = []
        self._ctl_maps: list[mmap.mmap] = []
        self._data: list[list[_Mapped]] = []
        self._pids: list[int | None] = []
        self._fds: list[int] = []

    # ------------------------------------------------------------------ setup
    def create_own(self) -> None:
        nbytes = 8 * self._ctl_words
        path = self._ctl_path(self.rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._paths.append(path)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes)
        ctl = memoryview(mm).cast("q")
        for s in range(SLOTS):
            b = self._slot(s)
            ctl[b], ctl[b + 3] = -1, -1
        ctl[0] = os.getpid()
        os.close(fd)
        del ctl, mm
        for s in range(SLOTS):
            path = self._data_path(self.rank, s)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._paths.append(path)
            os.posix_fallocate(fd, 0, _MIN_FILE)
            os.close(fd)

    def open_all(self) -> None:
        for r in range(self.world):
            fd = os.open(self._ctl_path(r), os.O_RDWR)
            mm = mmap.mmap(fd, 8 * self._ctl_words)
            os.close(fd)
            self._ctl_maps.append(mm)
            self._ctl.append(memoryview(mm).cast("q"))
            row = []
            for s in range(SLOTS):
                fd = os.open(self._data_path(r, s), os.O_RDWR)
                self._fds.append(fd)
                row.append(_Mapped(fd))
            self._data.append(row)
        for r in range(self.world):
            pid = int(self._ctl[r][0])
            self._pids.append(pid if r != self.rank and _alive(pid) else None)

    def unlink_own(self) -> None:
        for p in self._paths:
            p.unlink(missing_ok=True)
        self._paths = []

    def close(self) -> None:
        self.unlink_own()
        self._pending.clear()
        self._data = []
        self._ctl = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # ------------------------------------------------------------------ collectives
    def all_to_all(self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int] | None, name: str) -> PendingShared:
        """Start an all-to-all of dim-0 slices; ``wait()`` returns the received rows. Without
        ``recv_splits`` the receiver takes what each rank published (the sizes travel along)."""
        size = row_bytes(x)
        cum = [0]
        for n in send_splits:
            cum.append(cum[-1] + int(n) * size)
        bounds = [(cum[d], cum[d + 1]) for d in range(self.world)]
        src = _bytes(x)
        if src.numel() != cum[-1]:
            raise DistributedError(f"collective '{name}': send splits sum to {cum[-1] // max(size, 1)} rows but the input has {x.shape[0]}")
        out = recv_bytes = None
        if recv_splits is not None:
            out = x.new_empty((int(sum(recv_splits)),) + tuple(x.shape[1:]))
            recv_bytes = [int(n) * size for n in recv_splits]
        return self._start(ALL_TO_ALL, name, x, src, bounds, out, recv_bytes, src[bounds[self.rank][0] : bounds[self.rank][1]])

    def all_gather(self, x: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Every rank's ``x`` (dim 0 may differ), in rank order; this rank's entry is ``x`` itself."""
        src = _bytes(x)
        pending = self._start(ALL_GATHER, name, x, src, [(0, src.numel())] * self.world, None, None, src)
        pending.wait()
        size, shape = pending.row_bytes, pending.row_shape
        out = []
        for r, part in enumerate(pending.parts):
            if r == self.rank:
                out.append(x)
            else:
                out.append(part.view(x.dtype).view((part.numel() // size,) + shape) if size else x.new_empty((0,) + shape))
        return out

    def all_gather_into(self, x: torch.Tensor, sizes: Sequence[int], name: str) -> torch.Tensor:
        """Every rank's ``x`` (``sizes[r]`` rows from rank r) end to end in rank order, copied
        straight out of the peers' slots into one tensor: no per-part copies to concatenate."""
        size = row_bytes(x)
        out = x.new_empty((int(sum(sizes)),) + tuple(x.shape[1:]))
        src = _bytes(x)
        pending = self._start(ALL_GATHER, name, x, src, [(0, src.numel())] * self.world, out,
                              [int(n) * size for n in sizes], src)
        pending.wait()
        return out

    def _start(self, op: int, name: str, x: torch.Tensor, src: torch.Tensor, bounds: list[tuple[int, int]],
               out: torch.Tensor | None, recv_bytes: list[int] | None, mine: torch.Tensor) -> PendingShared:
        pending = PendingShared(self, self._next, op, name, x, out, recv_bytes, mine)
        k = self._next
        self._next += 1
        s, b = k % SLOTS, self._slot(k % SLOTS)
        # Our own unfinished receives of this slot's previous round come first (peers wait for them).
        for j in sorted(j for j in self._pending if j <= k - SLOTS):
            self._receive(self._pending[j])
        if k >= SLOTS:
            peers = [r for r in range(self.world) if r != self.rank]
            self._spin(lambda: all(self._ctl[r][b + 3] >= k - SLOTS for r in peers), name, "to read the previous round")
        own = self._data[self.rank][s]
        own.grow(src.numel())
        lo, hi = bounds[self.rank]
        if op == ALL_TO_ALL:  # this rank's own chunk never goes through the slot
            own.tensor[:lo].copy_(src[:lo])
            own.tensor[hi : src.numel()].copy_(src[hi:])
        elif src.numel():
            own.tensor[: src.numel()].copy_(src)
        ctl = self._ctl[self.rank]
        ctl[b + 1], ctl[b + 2] = op, pending.row_bytes
        for d, (lo, hi) in enumerate(bounds):
            ctl[b + _SLOT_FIXED + 2 * d], ctl[b + _SLOT_FIXED + 2 * d + 1] = lo, hi
        ctl[b] = k  # publish last: readers see the data and offsets before the round number
        self._pending[k] = pending
        return pending

    def _receive(self, p: PendingShared) -> None:
        s, b = p.k % SLOTS, self._slot(p.k % SLOTS)
        dst = _bytes(p.out) if p.out is not None else None
        pos = 0
        for r in range(self.world):
            if r == self.rank:
                part = p.mine
            else:
                ctl = self._ctl[r]
                self._spin(lambda ctl=ctl: ctl[b] >= p.k, p.name, f"for rank {r}")
                if ctl[b] != p.k or ctl[b + 1] != p.op or ctl[b + 2] != p.row_bytes:
                    raise DistributedError(
                        f"rank {self.rank}: collective '{p.name}' ({_OP_NAMES[p.op]}, {p.row_bytes}-byte rows) met "
                        f"{_OP_NAMES.get(ctl[b + 1], 'another collective')} with {ctl[b + 2]}-byte rows on rank {r}: "
                        "ranks started different collectives; every rank must run the same sequence"
                    )
                lo, hi = ctl[b + _SLOT_FIXED + 2 * self.rank], ctl[b + _SLOT_FIXED + 2 * self.rank + 1]
                peer = self._data[r][s]
                peer.reach(hi)
                part = peer.tensor[lo:hi]
            if dst is not None:
                n = p.recv_bytes[r]
                if part.numel() != n:
                    raise DistributedError(
                        f"rank {self.rank}: collective '{p.name}': rank {r} sent {part.numel()} bytes where "
                        f"{n} were expected; the ranks disagree on the split sizes"
                    )
                dst[pos : pos + n].copy_(part)
                pos += n
            else:
                if p.row_bytes and part.numel() % p.row_bytes:
                    raise DistributedError(
                        f"rank {self.rank}: collective '{p.name}': rank {r} sent {part.numel()} bytes, "
                        f"not a whole number of {p.row_bytes}-byte rows"
                    )
                p.parts.append(part)  # a view of the peer's slot until marked consumed below
        if dst is None and p.op == ALL_TO_ALL:
            p.counts = [part.numel() // p.row_bytes if p.row_bytes else 0 for part in p.parts]
            p.out = torch.empty((sum(p.counts),) + p.row_shape, dtype=p.dtype)
            if p.out.numel():
                torch.cat(p.parts, out=_bytes(p.out))
            p.parts = []
        elif dst is None:
            p.parts = [part if r == self.rank else part.clone() for r, part in enumerate(p.parts)]
        self._ctl[self.rank][b + 3] = p.k
        p.done = True
        del self._pending[p.k]

    # ------------------------------------------------------------------ waiting
    def _spin(self, ready: Callable[[], bool], name: str, what: str) -> None:
        """Wait for a peer: yield the core for the first ``_YIELD_S`` (peers usually arrive
        within a few milliseconds; a sleep oversleeps by ~50 us on Linux, once per collective,
        while a yield returns at once when no other thread wants the core and hands it over when
        one does: ranks sharing cores), then sleep in 0.2 ms steps."""
        if ready():
            return
        start = time.monotonic()
        check_at = start + 0.5
        while not ready():
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(2e-4)
            if now >= check_at:
                check_at = now + 0.5
                for r, pid in enumerate(self._pids):
                    if pid is not None and not _alive(pid):
                        raise DistributedError(
                            f"rank {self.rank}: collective '{name}' failed: rank {r} (pid {pid}) exited while this rank waited {what}"
                        )
                if now - start > self.timeout_s:
                    raise DistributedError(
                        f"rank {self.rank}: collective '{name}' timed out after {self.timeout_s:.0f} s waiting {what}; "
                        "another rank probably hung or runs a different sequence of collectives"
                    )

    def _slot(self, s: int) -> int:
        return _HEAD + s * (_SLOT_FIXED + 2 * self.world)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    return x.view(-1).view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one dim-0 row of ``x``."""
    return x.element_size() * math.prod(x.shape[1:])


def shared_memory_wanted() -> bool:
    """False when the environment turns the transport off (``RECSCALE_SHARED_MEMORY=0``)."""
    return os.environ.get("RECSCALE_SHARED_MEMORY", "1") != "0"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


# ---------------------------------------------------------------------- registry
_GROUPS: dict[int, tuple[dist.ProcessGroup, SharedMemoryGroup]] = {}


def enable_shared_memory(group: dist.ProcessGroup, timeout_s: float, directory: str = "/dev/shm") -> bool:
    """Set up shared-memory collectives for ``group`` (a collective on it); False, on every rank,
    when any rank cannot (another host, another architecture, no room in ``directory``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = [secrets.token_hex(8) if rank == 0 else ""]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    ex = SharedMemoryGroup(group, timeout_s, directory, token[0])

    def agree(ok: bool) -> bool:
        flags: list[bool] = [False] * world
        dist.all_gather_object(flags, ok, group=group)
        return all(flags)

    ok = shared_memory_supported(directory)
    if ok:
        try:
            ex.create_own()
        except OSError:
            ok = False
    if agree(ok):
        try:
            ex.open_all()  # fails when a peer's files are not visible here (another host)
        except OSError:
            ok = False
        if agree(ok):
            ex.unlink_own()
            _GROUPS[id(group)] = (group, ex)
            return True
    ex.close()
    return False


def shared_memory_group(group: dist.ProcessGroup | None) -> SharedMemoryGroup | None:
    if group is None or not _GROUPS:
        return None
    entry = _GROUPS.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def close_shared_memory() -> None:
    for _, ex in _GROUPS.values():
        ex.close()
    _GROUPS.clear()
