"""Start several ranks on this machine as local processes, quickly.

Calibration, validation and tests start short-lived local ranks dozens of times. Spawned
afresh, each process imports torch and recscale itself: 2-3 s a rank on two cores, most of a
short probe's wall time. Here every rank forks from one server process (multiprocessing's
*forkserver*) that imported them once. The server only imports modules before it forks: no
thread pool, process group or open file is inherited, so the ranks start as clean as spawned
ones. Where there is no forkserver (Windows), ranks are spawned.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import torch.multiprocessing as mp

# What every local rank needs; the function's own module is added at the first start.
PRELOAD = ("torch", "torch.distributed")


def start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _set_preload(modules: Sequence[str]) -> None:
    # Takes effect only when the server starts (the first start in this process); an import
    # that fails there is skipped by multiprocessing, and the rank imports it itself.
    if start_method() == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *modules])))


def local_context():
    """The multiprocessing context of ``start_local_processes``' ranks (for helpers such as a
    ``Barrier`` shared with them)."""
    return mp.get_context(start_method())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for local ranks to meet on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_processes(fn: Callable, args: tuple, nprocs: int, join: bool = True, preload: Sequence[str] = ()):
    """``fn(i, *args)`` in ``nprocs`` local processes, as ``torch.multiprocessing.start_processes``
    (an error in any one is raised here; ``join=False`` returns its context to join)."""
    _set_preload([fn.__module__, *preload])
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method=start_method())
