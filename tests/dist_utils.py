"""Spawning N gloo ranks on 127.0.0.1 for tests: free port, timeouts, no leaked processes."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from recscale.comm.local_processes import free_port, start_local_processes


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except Exception:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 120.0, allow_missing: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return each rank's result
    (``None`` for a rank that exited without one, when ``allow_missing``)."""
    with tempfile.TemporaryDirectory() as out_dir:
        # Forked from a server that imported torch and the sharded collection once: a spawned
        # rank spends 2-3 s importing them, most of a small distributed test.
        ctx = start_local_processes(_worker, (world, free_port(), fn, args, out_dir), world, join=False,
                                    preload=("recscale.sharding.collection",))
        try:
            import time

            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s")
        except Exception:
            errs = sorted(Path(out_dir).glob("*.err"))
            detail = "\n".join(e.read_text() for e in errs)
            raise AssertionError(f"distributed test failed:\n{detail}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        paths = [Path(out_dir) / f"rank{r}.pt" for r in range(world)]
        return [torch.load(p, weights_only=False) if p.exists() or not allow_missing else None for p in paths]
