"""Emulated hosts: a multi-host torchrun job on one Linux machine over shaped links."""

from recscale.cluster.launch import ClusterResult, ClusterSpec, run_cluster
from recscale.cluster.network import ClusterError, CrossTraffic, EmulatedNetwork, LinkShape, LinkTraffic, unavailable_reason

__all__ = [
    "ClusterError", "ClusterResult", "CrossTraffic", "ClusterSpec", "EmulatedNetwork", "LinkShape", "LinkTraffic",
    "run_cluster", "unavailable_reason",
]
