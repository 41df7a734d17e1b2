"""Running a command from a test without ever waiting on it forever or leaving processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from contextlib import suppress
from typing import Any


def run(args: Sequence[str], *, timeout: float, check: bool = False, capture_output: bool = False,
        **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose command gets its own process group, killed whole when it times
    out or exits: ``subprocess.run`` kills only the child, and a grandchild still holding its
    pipes (a worker, a rank, a compiler) would keep it waiting for their end."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with subprocess.Popen(list(args), start_new_session=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            kill_group(proc.pid)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def kill_group(pgid: int) -> None:
    """Kill every process of the group a ``start_new_session=True`` child leads."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
