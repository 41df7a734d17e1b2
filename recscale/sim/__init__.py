"""Predict a training step on a cluster by simulating every rank (``recscale simulate``)."""

from recscale.sim.api import simulate
from recscale.sim.topology import ClusterTopology, TopologyError, load_topology

__all__ = ["ClusterTopology", "TopologyError", "load_topology", "simulate"]
