"""Process groups for one job: the world, the ranks of one host, and the ranks across hosts.

Launched by ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT in the
environment) or by tests that pass rank and world size explicitly. gloo on CPU, NCCL on CUDA.
Every collective inherits the group's timeout, so a dead or hung peer ends the job with an
error instead of a hang.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recscale.comm.errors import DistributedError
from recscale.comm.shared_memory import close_shared_memory, enable_shared_memory, shared_memory_wanted

__all__ = ["DistributedError", "ProcessGroups", "Topology", "destroy_process_groups", "env_topology", "finish_process_groups",
           "init_process_groups"]


@dataclass(frozen=True)
class Topology:
    """World size, this rank, and how ranks group into hosts (consecutive ranks share a host)."""

    world_size: int = 1
    rank: int = 0
    ranks_per_host: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.ranks_per_host < 1 or self.world_size % self.ranks_per_host:
            raise ValueError(
                f"ranks_per_host {self.ranks_per_host} must divide the world size {self.world_size}"
            )

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def ranks_of_host(self, host: int) -> list[int]:
        return list(range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host))


@dataclass
class ProcessGroups:
    """The groups a job uses. ``embedding`` carries sparse all-to-alls, ``embedding_grads`` the
    data-parallel row-gradient gathers, ``dense`` the gradient all-reduce: separate groups keep
    the order of collectives on each group identical on every rank even when several are issued
    during backward."""

    topology: Topology
    embedding: dist.ProcessGroup | None
    embedding_grads: dist.ProcessGroup | None
    dense: dist.ProcessGroup | None
    intra_host: dist.ProcessGroup | None
    cross_host: dist.ProcessGroup | None
    device: torch.device
    timeout_s: float

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def rank(self) -> int:
        return self.topology.rank


def env_topology(ranks_per_host: int = 0) -> Topology:
    """Topology from torchrun's environment; ``ranks_per_host`` 0 means LOCAL_WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    per_host = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Topology(world, rank, per_host)


def init_process_groups(
    topology: Topology,
    timeout_s: float = 300.0,
    init_method: str | None = None,
    device: torch.device | None = None,
    shared_memory: bool = True,
) -> ProcessGroups:
    """Start (or join) the default group and build the sub-groups.

    On CPU, when every rank is on one host, the embedding exchanges go through shared memory
    (``recscale.comm.shared_memory``) unless ``shared_memory`` is off or the environment sets
    ``RECSCALE_SHARED_MEMORY=0``."""
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        if device.index is None:  # "cuda" (train.device): this rank's GPU; set_device needs an index
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if topology.world_size == 1 and not dist.is_initialized():
        return ProcessGroups(topology, None, None, None, None, None, device, timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        store = _attempt_store(topology, timeout) if init_method is None else None
        dist.init_process_group(
            backend,
            init_method=None if store is not None else init_method or "env://",
            store=store,
            rank=topology.rank,
            world_size=topology.world_size,
            timeout=timeout,
        )
    everyone = list(range(topology.world_size))
    embedding = dist.new_group(everyone, timeout=timeout, backend=backend)
    embedding_grads = dist.new_group(everyone, timeout=timeout, backend=backend)
    dense = dist.new_group(everyone, timeout=timeout, backend=backend)
    intra = cross = None
    # new_group must be called by every rank for every group, in the same order.
    for host in range(topology.num_hosts):
        g = dist.new_group(topology.ranks_of_host(host), timeout=timeout, backend=backend)
        if host == topology.host_of(topology.rank):
            intra = g
    for local in range(topology.ranks_per_host):
        members = [h * topology.ranks_per_host + local for h in range(topology.num_hosts)]
        g = dist.new_group(members, timeout=timeout, backend=backend)
        if local == topology.rank % topology.ranks_per_host:
            cross = g
    if device.type == "cpu" and shared_memory and shared_memory_wanted():
        for g in (embedding, embedding_grads):
            enable_shared_memory(g, timeout_s)
    return ProcessGroups(topology, embedding, embedding_grads, dense, intra, cross, device, timeout_s)


def _attempt_store(topology: Topology, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun with restarts: the launcher's store, with keys of this attempt only. torchrun
    keeps one store for every attempt of a job, and gloo would otherwise read the addresses the
    ranks of a dead attempt left there and fail to connect. (The count is per host: across hosts
    a host restarted for another's failure keeps its count; see docs/checkpointing.md.) None
    outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", topology.rank, topology.world_size, timeout=timeout))
    return dist.PrefixStore(f"recscale/attempt{attempt}", store)


def destroy_process_groups() -> None:
    close_shared_memory()
    if dist.is_initialized():
        dist.destroy_process_group()


def finish_process_groups() -> None:
    """End a job that succeeded: wait until every rank is done (no peer's collective is still in
    flight toward this rank), destroy the groups, and free their objects now. A group that
    outlives them (held in a reference cycle of the model) is otherwise freed while the
    interpreter shuts down, and gloo's worker threads then abort the process ("terminate called
    without an active exception") after its work is done. A failed job only destroys: a barrier
    with a peer that will never come would hang until the timeout."""
    if dist.is_initialized():
        dist.barrier()
    destroy_process_groups()
    gc.collect()
