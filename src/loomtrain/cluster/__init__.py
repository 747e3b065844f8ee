"""Test instruments: an emulated multi-host cluster on one Linux machine (network namespaces,
veth pairs, a bridge, links shaped with tc). See ``docs/cluster.md``."""

from loomtrain.cluster.emulated import (
    Cluster,
    ClusterError,
    ClusterSpec,
    cluster_down,
    cluster_up,
    emulated_cluster,
    load_cluster,
    missing_requirements,
    rate_bytes_per_s,
)

__all__ = [
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "cluster_down",
    "cluster_up",
    "emulated_cluster",
    "load_cluster",
    "missing_requirements",
    "rate_bytes_per_s",
]
