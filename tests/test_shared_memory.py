"""Shared-memory collectives: the same bytes as gloo's, in any order of waits, growing buffers,
clear errors for mismatched sequences and dead peers, and nothing left in /dev/shm."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from recscale.comm.collectives import (all_gather_concat, all_gather_rows, all_gather_sizes, all_to_all,
                                      all_to_all_async, all_to_all_unsized_async)
from recscale.comm.errors import DistributedError
from recscale.comm.shared_memory import SLOTS, enable_shared_memory, shared_memory_group, shared_memory_supported
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="no x86 shared memory with room on this machine")

DTYPES = [torch.float32, torch.int64, torch.int32, torch.uint8, torch.bfloat16]


def _groups(rank: int, world: int):
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    shm, plain = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    assert enable_shared_memory(shm, timeout_s=30.0)
    assert shared_memory_group(shm) is not None and shared_memory_group(plain) is None
    return shm, plain


def _payload(rank: int, rnd: int, world: int, big: bool) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """Rank ``rank``'s tensor of round ``rnd`` and every rank's send splits (known to all)."""
    g = torch.Generator().manual_seed(1000 * rnd + 7)
    scale = 40_000 if big else 30
    splits = torch.randint(0, scale, (world, world), generator=g).tolist()  # splits[src][dst]
    dtype = DTYPES[rnd % len(DTYPES)]
    width = 1 + rnd % 3
    gl = torch.Generator().manual_seed(1000 * rnd + rank)
    rows = sum(splits[rank])
    x = (torch.randn(rows, width, generator=gl) * 100).to(dtype)
    return x, splits[rank], splits


def _exchange_many(rank: int, world: int) -> list[tuple[str, int, bool]]:
    shm, plain = _groups(rank, world)
    checked = []
    rounds = 3 * SLOTS + 2
    pending = []
    for rnd in range(rounds):
        x, send, splits = _payload(rank, rnd, world, big=rnd in (5, 6))  # rounds 5-6 grow the buffers past 1 MiB
        recv = [splits[s][rank] for s in range(world)]
        pending.append((rnd, all_to_all_async(x, send, recv, shm, name=f"r{rnd}"), all_to_all(x, send, recv, plain)))
        if rnd % 3 == 2:  # wait three at a time, newest first
            for r, p, ref in reversed(pending):
                got = p.wait()
                checked.append(("a2a", r, bool(got.dtype == ref.dtype and torch.equal(got, ref))))
            pending = []
        rows = torch.arange(rnd * (rank + 1), dtype=torch.float32).view(-1, 1) * (rank + 1)
        got, ref = all_gather_rows(rows, shm), all_gather_rows(rows, plain)
        checked.append(("gather", rnd, all(torch.equal(a, b) for a, b in zip(got, ref))))
        # straight into one tensor, with every rank's size known (rounds 5-6: past 1 MiB)
        x, _, _ = _payload(rank, rnd, world, big=rnd in (5, 6))
        sizes = [_payload(r, rnd, world, big=rnd in (5, 6))[0].shape[0] for r in range(world)]
        got = all_gather_concat(x, shm, sizes=sizes)
        checked.append(("concat", rnd, bool(got.dtype == x.dtype and torch.equal(got, torch.cat(all_gather_rows(x, plain))))))
        sizes = all_gather_sizes(rnd + rank, shm, torch.device("cpu"))
        checked.append(("sizes", rnd, sizes == [rnd + r for r in range(world)]))
    for r, p, ref in pending:
        checked.append(("a2a", r, torch.equal(p.wait(), ref)))
    ex = shared_memory_group(shm)
    left = [p for r in range(world) for p in [ex._ctl_path(r)] + [ex._data_path(r, s) for s in range(SLOTS)] if p.exists()]
    checked.append(("unlinked", 0, not left))
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_equal_gloo(world: int) -> None:
    for checks in run_ranks(_exchange_many, world, timeout_s=120):
        bad = [(kind, r) for kind, r, ok in checks if not ok]
        assert not bad, f"differs from gloo: {bad}"
        assert len(checks) > 40


def _unsized(rank: int, world: int) -> list[bool]:
    """Exchanges whose receive sizes no rank knows, started together: through shared memory
    (the sizes travel with the data) and through gloo (one exchange of all their sizes first)."""
    shm, plain = _groups(rank, world)
    ok = []
    for rnd in range(4):
        payloads = [_payload(rank, 10 * rnd + i, world, big=False) for i in range(1 + rnd % 3)]
        parts = [(x, send, f"part{i}") for i, (x, send, _) in enumerate(payloads)]
        for a, b, (_, _, splits) in zip(all_to_all_unsized_async(parts, shm), all_to_all_unsized_async(parts, plain),
                                        payloads):
            want = [splits[src][rank] for src in range(world)]
            ok.append(torch.equal(a.wait(), b.wait()) and a.rows_from() == b.rows_from() == want)
    return ok


@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_of_unknown_size_agree_through_shared_memory_and_gloo(world: int) -> None:
    for ok in run_ranks(_unsized, world, timeout_s=120):
        assert len(ok) == 7 and all(ok), ok


def _mismatch(rank: int, world: int) -> str:
    shm, _ = _groups(rank, world)
    try:
        if rank == 0:
            all_to_all(torch.zeros(4, 2), [2, 2], [2, 2], shm, name="ids")
        else:
            all_gather_rows(torch.zeros(3, 2), shm, name="grads")
    except DistributedError as e:
        return str(e)
    return "no error"


def test_mismatched_collectives_are_named() -> None:
    msgs = run_ranks(_mismatch, 2, timeout_s=90)
    assert "ranks started different collectives" in msgs[0] and "'ids'" in msgs[0]
    assert "ranks started different collectives" in msgs[1] and "'grads'" in msgs[1]


def _dead_peer(rank: int, world: int) -> tuple[str, float]:
    shm, _ = _groups(rank, world)
    if rank == 1:
        os._exit(0)  # dies without joining the collective
    t0 = time.monotonic()
    try:
        all_to_all(torch.zeros(4, 2), [2, 2], [2, 2], shm, name="output_a2a")
    except DistributedError as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


def test_dead_peer_fails_fast_with_a_clear_error() -> None:
    msg, waited = run_ranks(_dead_peer, 2, timeout_s=90, allow_missing=True)[0]
    assert "rank 1" in msg and "exited" in msg and "'output_a2a'" in msg, msg
    # "exited" already says the death was noticed; the group's timeout (30 s) was not reached either.
    assert waited < 30.0


def _mismatched_splits(rank: int, world: int) -> str:
    shm, _ = _groups(rank, world)
    try:
        recv = [2, 2] if rank == 0 else [2, 3]  # rank 1 expects one row more than rank 0 sends
        all_to_all(torch.zeros(4, 2), [2, 2], recv, shm, name="input_ids")
    except DistributedError as e:
        return str(e)
    return "no error"


def test_disagreeing_splits_are_refused() -> None:
    msgs = run_ranks(_mismatched_splits, 2, timeout_s=90)
    assert "disagree on the split sizes" in msgs[1], msgs


def _one_rank_cannot(rank: int, world: int) -> tuple[bool, bool]:
    import recscale.comm.shared_memory as sm

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    g = dist.new_group(list(range(world)))
    if rank == 1:  # as on another host, or with /dev/shm full: this rank cannot take part
        sm.shared_memory_supported = lambda directory="/dev/shm": False
    enabled = enable_shared_memory(g, timeout_s=30.0)
    x = torch.arange(4 * world, dtype=torch.float32) + 100 * rank
    got = all_to_all(x, [4] * world, [4] * world, g)
    want = torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + 100 * s for s in range(world)])
    return enabled, bool(torch.equal(got, want))


def test_every_rank_falls_back_to_gloo_when_one_cannot_share_memory() -> None:
    for enabled, exchanged in run_ranks(_one_rank_cannot, 3, timeout_s=90):
        assert not enabled and exchanged
