"""Local ranks forked from a preloaded server: results come back, errors surface, nothing leaks."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from recscale.comm.local_processes import start_local_processes, start_method


def _write_rank(rank: int, out_dir: str) -> None:
    # A forked rank starts with no inherited thread pool: it can set its own threads.
    torch.set_num_threads(1)
    Path(out_dir, f"r{rank}").write_text(f"{rank} {torch.get_num_threads()} {multiprocessing.get_start_method()}")


def _fail_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 was given a bad shard")


def test_every_rank_runs_and_returns(tmp_path):
    start_local_processes(_write_rank, (str(tmp_path),), 3)
    got = sorted(p.read_text() for p in tmp_path.iterdir())
    assert got == [f"{r} 1 {start_method()}" for r in range(3)]
    if sys.platform.startswith("linux"):
        assert start_method() == "forkserver"


def test_an_error_in_one_rank_is_raised_with_its_message():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 was given a bad shard"):
        start_local_processes(_fail_on_rank_1, (), 2)
    assert not multiprocessing.active_children()
