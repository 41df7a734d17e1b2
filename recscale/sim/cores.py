"""How a CPU host's cores divide among the ranks on it, and what each rank's compute gets.

A rank trains on ``threads`` threads. The cores it can have are its host's cores over the
ranks that share them (``cores_per_host`` over ``ranks_per_host``, or every rank of the
cluster over ``shared_cores`` where emulated hosts run on one machine). The simulator's
dense calibration times one thread and the planner's calibration times the threads one of
its ranks gets, so:

- the work of an operator's arithmetic (FLOPs, values written) spreads over the cores the
  rank's threads really run on, ``min(threads, cores / ranks)``; with fewer cores than
  ranks every rank gets ``cores / ranks`` of one;
- an operator's fixed cost (launch, autograd, Python) runs on one thread however many there
  are, slowed only where ranks outnumber cores (``serial_stretch``);
- work off the training threads (a loader worker process) runs beside them only where the
  ranks' threads leave a core free (``spare_cores``); else it takes their time.

Where the host's cores are not given (0), each rank is taken to have a core per thread and
one to spare, the planner's assumption for dedicated hosts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreShare:
    ranks: int  # ranks sharing the pool of cores
    cores: int  # cores of the pool; 0: not given (a core per thread and one to spare)
    threads: int  # training threads per rank

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.threads < 1 or self.cores < 0:
            raise ValueError(f"core share: ranks ({self.ranks}) and threads ({self.threads}) must be >= 1, "
                             f"cores ({self.cores}) >= 0")

    @property
    def per_rank(self) -> float:
        """Cores a rank can have (its threads' count where the pool is not given)."""
        return self.cores / self.ranks if self.cores else float(self.threads)

    @property
    def parallel(self) -> float:
        """Cores a rank's arithmetic runs on: its threads, at most its share of the cores
        (below one core when ranks outnumber cores)."""
        return min(float(self.threads), self.per_rank)

    @property
    def serial_stretch(self) -> float:
        """How much slower one thread's work runs than on a core of its own."""
        return max(1.0, 1.0 / self.per_rank)

    @property
    def spare_cores(self) -> float:
        """Cores of the pool the ranks' training threads leave free (inf: not given)."""
        return self.cores - self.ranks * self.threads if self.cores else float("inf")
