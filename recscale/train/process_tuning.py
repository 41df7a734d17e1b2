"""Process-wide tuning of a training process, in one place: how many CPUs it may use, how many
of them train and how many load data, how OpenMP threads wait, and how freed memory is kept.

``train.tune_process = false`` turns all of it off (PyTorch's and the OS's defaults apply, and
``train.threads`` / ``data.num_workers`` are taken as given, "auto" workers meaning none).

- **CPUs**: the CPUs this process may really use are its affinity mask
  (``os.sched_getaffinity``: taskset, a container's cpuset) capped by a cgroup CPU quota
  (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``: a container limited to 2 CPUs on a 64-core host
  gets 2). Ranks of one host split them evenly.
- **Threads and workers** (``size_threads``): a loader worker process needs one CPU of its own,
  or it fights the training threads for theirs; with one worker the loader feeds a CPU's worth
  of batches, more than twice the trainer's rate. With 2 CPUs or fewer per rank, loading in the
  training process (between steps) and training on every CPU measured faster than one worker
  plus one training thread; with more, one worker loads and training gets the rest.
- **OpenMP waiting**: PyTorch's OpenMP threads spin for a while after each parallel region.
  When another process is busy on one of the CPUs, a spinning thread holds its CPU time slice
  while the thread the region waits for sits descheduled, so every region costs a time slice:
  the Criteo 10k run took 4-28 s instead of 0.3-0.8 s. ``OMP_WAIT_POLICY=PASSIVE`` makes idle threads sleep instead;
  it has to be set before torch is imported (``prefer_passive_openmp``, called by the CLI), and a
  value the user set is kept.
- **Memory**: glibc keeps freed buffers for the next step (``recscale.host_memory``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Container, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from recscale.host_cpus import CpuBudget, usable_cpus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Workers = int | Literal["auto"]
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
# Set by prefer_passive_openmp when it chose the policy (not the user), for the log line.
_CHOSEN_ENV = "RECSCALE_OMP_WAIT_POLICY_SET"


@dataclass(frozen=True)
class ThreadPlan:
    """Training threads and loader worker processes of one rank."""

    threads: int
    workers: int
    reason: str


# ---------------------------------------------------------------------- sizing
def size_threads(cpus: int, local_ranks: int, threads: int, workers: Workers) -> ThreadPlan:
    """Threads and loader workers of one of ``local_ranks`` ranks sharing ``cpus`` CPUs.

    ``threads`` 0 and ``workers`` "auto" are sized here; values set by the user are kept. Auto
    workers: 0 when the rank's share is 2 CPUs or fewer (loading in-process measured faster than
    a worker taking a training thread's CPU), else 1. Auto threads: the share less the workers,
    at least 1."""
    if cpus < 1 or local_ranks < 1:
        raise ValueError(f"cpus and local_ranks must be >= 1, got {cpus} and {local_ranks}")
    share = max(1, cpus // local_ranks)
    w = (0 if share <= 2 else 1) if workers == "auto" else int(workers)
    t = threads if threads > 0 else max(1, share - w)
    reason = f"{share} CPU{'s' if share != 1 else ''} per rank"
    if t + w > share:
        reason += f", oversubscribed by train.threads / data.num_workers ({t} + {w} > {share})"
    return ThreadPlan(t, w, reason)


# ---------------------------------------------------------------------- OpenMP
def tuning_requested(config_path: str | None, overrides: Sequence[str]) -> bool:
    """``train.tune_process`` as the config file and ``--set`` overrides give it, read without
    importing torch (the OpenMP setting must be in place before torch loads); malformed input
    is left for the config loader to report."""
    value: object = True
    if config_path:
        try:
            value = tomllib.loads(Path(config_path).read_text()).get("train", {}).get("tune_process", True)
        except (OSError, tomllib.TOMLDecodeError, AttributeError):
            pass
    for item in overrides:
        key, _, text = item.partition("=")
        if key.strip() == "train.tune_process":
            value = text.strip()
    return value not in (False, "false")


def prefer_passive_openmp(environ: MutableMapping[str, str] = os.environ, loaded: Container[str] = sys.modules) -> bool:
    """Make OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a
    policy or torch is already ``loaded`` (then it is too late). Returns whether it was set."""
    if WAIT_POLICY_ENV in environ or "torch" in loaded:
        return False
    environ[WAIT_POLICY_ENV] = "PASSIVE"
    environ[_CHOSEN_ENV] = "1"
    return True


def openmp_wait_description(environ: Mapping[str, str] = os.environ) -> str:
    policy = environ.get(WAIT_POLICY_ENV)
    if policy is None:
        return "OpenMP threads spin when idle (torch was imported before OMP_WAIT_POLICY=PASSIVE could be set)"
    who = "" if environ.get(_CHOSEN_ENV) == "1" else " (set by the user)"
    return f"OMP_WAIT_POLICY={policy}{who}"


# ---------------------------------------------------------------------- applying
def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class ProcessTuning:
    """What ``tune_process`` decided; ``describe()`` is its one log line."""

    enabled: bool
    budget: CpuBudget
    plan: ThreadPlan
    retain_memory: bool
    memory_retained: bool = False

    def describe(self) -> str:
        if not self.enabled:
            return (f"process tuning off (train.tune_process = false): {_count(self.plan.threads, 'torch thread')}, "
                    f"{_count(self.plan.workers, 'loader worker')}")
        memory = "freed host memory kept for reuse" if self.memory_retained else "allocator unchanged"
        return (
            f"process: {_count(self.budget.cpus, 'usable CPU')} ({self.budget.reason}); "
            f"{_count(self.plan.threads, 'training thread')} + {_count(self.plan.workers, 'loader worker')} "
            f"({self.plan.reason}); {openmp_wait_description()}; {memory}"
        )

    def after_build(self) -> None:
        """Once the model is built (its one-off temporaries went back to the OS): keep freed
        host memory in the process for the next step."""
        if self.enabled and self.retain_memory:
            from recscale.host_memory import retain_freed_memory

            self.memory_retained = retain_freed_memory()


def tune_process(threads: int, workers: Workers, local_ranks: int, enabled: bool = True,
                 retain_memory: bool = True, set_threads: Callable[[int], None] | None = None) -> ProcessTuning:
    """Size and set the torch threads for this rank; the loader workers are ``plan.workers``."""
    import torch

    budget = usable_cpus()
    if enabled:
        plan = size_threads(budget.cpus, local_ranks, threads, workers)
    else:
        plan = ThreadPlan(threads or torch.get_num_threads(), 0 if workers == "auto" else int(workers), "as configured")
    if enabled or threads:
        (set_threads or torch.set_num_threads)(plan.threads)
    return ProcessTuning(enabled, budget, plan, retain_memory)
