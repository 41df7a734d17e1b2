"""Session set-up shared by every test file."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

import pytest

_TRACE_STREAM = pytest.StashKey["object"]()


def pytest_configure(config: pytest.Config) -> None:
    """If the run is stopped from outside (a CI time limit sends SIGTERM), print where every
    thread was first: a hang then names its line in the log."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None or not hasattr(signal, "SIGTERM"):
        return
    with capman.global_and_fixture_disabled():
        stream = os.fdopen(os.dup(2), "w")
    config.stash[_TRACE_STREAM] = stream
    faulthandler.register(signal.SIGTERM, file=stream, all_threads=True, chain=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    stream = config.stash.get(_TRACE_STREAM, None)
    if stream is not None:
        faulthandler.unregister(signal.SIGTERM)
        stream.close()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load from the cache) the native kernels before any test runs: tests that start
    training or benchmark subprocesses under a time limit must not spend it compiling, on a fresh
    machine. Said on the terminal, since a first build takes a while."""
    from recscale.checkpoint.native import quantize_kernels
    from recscale.embedding import native
    from recscale.model.native import interaction_kernels

    capman = session.config.pluginmanager.getplugin("capturemanager")
    t0 = time.monotonic()
    if capman is not None:
        with capman.global_and_fixture_disabled():
            ok = _build_all(native.load, interaction_kernels, quantize_kernels)
    else:
        ok = _build_all(native.load, interaction_kernels, quantize_kernels)
    print(f"native kernels: embedding {'ready' if ok[0] else 'unavailable'}, interaction "
          f"{'ready' if ok[1] else 'unavailable'}, quantizer {'ready' if ok[2] else 'unavailable'} "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    _start_rank_server()


# What the tests' local ranks import, loaded once in the server they fork from: the sharded
# collection, the planner's timing worker, and torch._dynamo, which a torch.optim optimizer
# imports on its first use (2-3 s in every rank that trains).
RANK_PRELOAD = ("recscale.sharding.collection", "recscale.planner.measure", "dist_utils", "torch._dynamo")


def _start_rank_server() -> None:
    """Start the server that local ranks fork from (``recscale.comm.local_processes``) now,
    with ``RANK_PRELOAD``: it preloads only what its first user names, and whichever test
    forks ranks first would otherwise decide that for the whole run."""
    from multiprocessing import forkserver

    from recscale.comm.local_processes import PRELOAD, local_context, start_method

    if start_method() == "forkserver":
        local_context().set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *RANK_PRELOAD])))
        forkserver.ensure_running()


def _build_all(*loaders) -> tuple[bool, ...]:
    return tuple(load() is not None for load in loaders)



# Tests plan on the built-in CPU description or an explicit topology: no process measures the
# machine on first use (a user's first multi-rank run does, once; see planner.hardware).
os.environ.setdefault("RECSCALE_CALIBRATE", "off")


@pytest.fixture(autouse=True)
def _simulator_prices_on_presets(monkeypatch):
    """The simulator prices a calibrated base's dense compute, loop and ranks' meetings on this
    machine's cached measurement where there is one; tests see the built-in figures instead, as
    a fresh machine (CI) does, so that their results do not depend on what was measured here."""
    import recscale.sim.calibrate as calibrate

    monkeypatch.setattr(calibrate, "cached_compute", lambda: None)
