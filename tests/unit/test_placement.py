"""Rank placement from a topology, the placement report, rank-order validation and the Topology
file, checked without processes (hand-written topologies; the mesh's rank array needs no
process group). Discovery itself runs in ``tests/distributed/test_topology.py``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from dataclasses import replace

import pytest
import torch

from loomtrain.config import ConfigError, ParallelConfig
from loomtrain.distributed.parallel_dims import MESH_AXES, ORDERED_AXES, Axis, ParallelDims
from loomtrain.distributed.topology import (
    Topology,
    _probe_pairs,
    host_address,
    host_key,
    place_ranks,
    placement_report,
)

INTERLEAVED = ((0, 2), (1, 3))  # SLURM's cyclic distribution: rank r on node r mod 2
CONTIGUOUS = ((0, 1), (2, 3))  # torchrun's numbering: node n holds n·2, n·2 + 1


def topology(hosts, bandwidth=None, latency=None) -> Topology:
    return Topology(
        hosts=hosts,
        host_keys=tuple(f"node{i}/boot/{4026531840 + i}" for i in range(len(hosts))),
        addresses=tuple(f"10.0.0.{i + 1}" for i in range(len(hosts))),
        link_bandwidth=bandwidth,
        link_latency=latency,
    )


def placed(hosts, **degrees) -> tuple[ParallelDims, Topology]:
    topo = topology(hosts)
    dims = ParallelDims(world_size=topo.world_size, **degrees)
    return replace(dims, rank_order=place_ranks(topo, dims)), topo


def hosts_of_groups(dims: ParallelDims, topo: Topology, axis: Axis) -> list[set[int]]:
    """The hosts of each group of ``axis``, read from the rank array itself (not axis_groups)."""
    ranks = dims.mesh_ranks()
    dim = MESH_AXES.index(axis)
    groups = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    return [{topo.host_of(r) for r in group} for group in groups]


# ---------------------------------------------------------------------------- placement


def test_placement_keeps_tp_inside_a_host_when_ranks_are_interleaved():
    """Catches: a mesh that ignores rank_order (tp groups (0, 1), (2, 3) would span both
    interleaved hosts, so every tensor-parallel all-reduce would cross the network) and a
    placement that is not host-major."""
    dims, topo = placed(INTERLEAVED, dp=2, tp=2)
    assert all(len(h) == 1 for h in hosts_of_groups(dims, topo, Axis.TP)), dims.mesh_ranks().tolist()
    unplaced = ParallelDims(dp=2, tp=2, world_size=4)
    assert any(len(h) == 2 for h in hosts_of_groups(unplaced, topo, Axis.TP)), "placement would not matter here"


def test_placed_order_keeps_every_group_ascending_so_group_ranks_match_coordinates():
    """Catches: a placement that lists some group's ranks descending (torch's new_group sorts
    them, so DTensor's coordinate and the group rank would disagree and shards would be
    swapped); here the replica groups of HSDP on 2 × 4 interleaved ranks, whose tp blocks
    taken host by host would give (0, 4, 1, 5)."""
    hosts = ((0, 2, 4, 6), (1, 3, 5, 7))
    dims, topo = placed(hosts, dp=4, dp_replicate=4, tp=2)
    for axis in ORDERED_AXES:
        for group in dims.axis_groups(axis):
            assert group == sorted(group), f"{axis} group {group} of {dims.rank_order}"
    assert all(len(h) == 1 for h in hosts_of_groups(dims, topo, Axis.TP))


def test_placement_of_contiguous_hosts_is_the_launch_order():
    """Catches: placement reordering ranks that torchrun already numbered host-major (a
    needless permutation that changes which rank reads which data)."""
    topo = topology(CONTIGUOUS)
    assert place_ranks(topo, ParallelDims(dp=2, tp=2, world_size=4)) == (0, 1, 2, 3)


def test_placement_falls_back_to_the_launch_order_when_no_order_keeps_groups_ascending():
    """Catches: a placement returning an order that ParallelDims refuses (hosts (0, 3) and
    (1, 2) cannot have tp inside a host with both dp groups ascending)."""
    topo = topology(((0, 3), (1, 2)))
    dims = ParallelDims(dp=2, tp=2, world_size=4)
    order = place_ranks(topo, dims)
    assert order == (0, 1, 2, 3)
    assert "ascending" in placement_report(replace(dims, rank_order=order), topo)


# ---------------------------------------------------------------------------- report


def test_report_says_tp_stays_inside_and_replicas_cross():
    """Catches: a report that misreads the groups (tp said to cross after placement, or the
    replica axis said to stay inside) or warns about an axis allowed to cross hosts."""
    dims, topo = placed(INTERLEAVED, dp=2, dp_replicate=2, tp=2)
    assert placement_report(dims, topo).splitlines() == [
        "tp 2: inside one host",
        "dp_replicate 2: crosses hosts (2 hosts per group)",
    ]


def test_report_warns_when_tp_does_not_fit_a_host():
    """Catches: a tp group silently spanning hosts (tp 4 on 2 ranks per host) without a
    warning that names the axis, the reason and the setting to change."""
    topo = topology(CONTIGUOUS)
    report = placement_report(ParallelDims(dp=1, tp=4, world_size=4), topo)
    assert "tp 4: crosses hosts (2 hosts per group)" in report.splitlines()
    warning = [line for line in report.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "tp 4 does not fit 2 ranks per host" in warning[0], report
    assert "parallel.tensor_parallel_degree" in warning[0]


def test_report_tells_to_place_ranks_when_the_order_is_not_host_major():
    """Catches: a crossing tp group blamed on its size when placement would fix it."""
    topo = topology(INTERLEAVED)
    report = placement_report(ParallelDims(dp=2, dp_replicate=2, tp=2, world_size=4), topo)
    assert "place_ranks" in report and "warning: tp 2 crosses hosts" in report, report


def test_report_refuses_a_topology_of_another_world_size():
    """Catches: a report over a stale topology (other job) reading ranks that do not exist."""
    with pytest.raises(ValueError, match="ranks"):
        placement_report(ParallelDims(dp=8, world_size=8), topology(CONTIGUOUS))


# ---------------------------------------------------------------------------- rank_order


@pytest.mark.parametrize(
    "order",
    [(0, 1, 2), (0, 1, 1, 2), (1, 2, 3, 4), (3, 2, 1, 0)],
    ids=["short", "duplicate", "out_of_range", "descending_groups"],
)
def test_invalid_rank_order_is_refused_naming_it(order):
    """Catches: a rank_order that drops, repeats or invents a rank (ranks left out of the mesh
    or placed twice), or one whose groups descend (group ranks, which new_group sorts, would
    disagree with DTensor's coordinates)."""
    with pytest.raises(ConfigError, match="rank_order"):
        ParallelDims(dp=2, tp=2, world_size=4, rank_order=order)


def test_mesh_ranks_lay_the_order_out_row_major():
    """Catches: mesh_ranks with axes in another order than [pp, dp_replicate, dp_shard, sp, tp],
    or ignoring rank_order; and the identity order changing when rank_order is None."""
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert torch.equal(dims.mesh_ranks(), torch.arange(8).view(2, 1, 2, 1, 2))
    order = (0, 2, 1, 3, 4, 6, 5, 7)
    moved = replace(dims, rank_order=list(order))
    assert moved.rank_order == order and hash(moved)  # a list is kept as a hashable tuple
    assert moved.mesh_ranks().flatten().tolist() == list(order)
    assert moved.axis_groups(Axis.TP) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert moved.axis_groups(Axis.PP) == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_from_config_passes_rank_order_through():
    """Catches: from_config dropping rank_order (the trainer's placement silently unused)."""
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_degree=2), 4, rank_order=[0, 2, 1, 3])
    assert dims.rank_order == (0, 2, 1, 3)


# ---------------------------------------------------------------------------- Topology


def test_topology_save_load_round_trip_keeps_nan(tmp_path):
    """Catches: unmeasured (nan) links lost or turned into numbers by the JSON round trip, and
    nested tuples coming back as lists (a loaded topology unequal to the saved one)."""
    nan = math.nan
    topo = replace(
        topology(INTERLEAVED, bandwidth=((nan, 1.25e8), (1.2e8, 3e9)), latency=((nan, 1e-4), (2e-4, 5e-6))),
        gpu_p2p=((True, False), (False, True)),
    )
    topo.save(tmp_path / "topology.json")
    loaded = Topology.load(tmp_path / "topology.json")
    assert json.dumps(loaded.to_dict()) == json.dumps(topo.to_dict())
    assert math.isnan(loaded.link_bandwidth[0][0]) and isinstance(loaded.hosts[0], tuple)
    assert loaded.inter_host_bandwidth() == 1.2e8 and loaded.intra_host_bandwidth() == 3e9


def test_describe_gives_hosts_and_links_in_human_units():
    """Catches: describe() dropping a host or its ranks, or printing bandwidth in the wrong
    unit (1.25e8 bytes/s is 1000 Mbit/s, 125 MB/s) or latency without its unit."""
    nan = math.nan
    text = topology(INTERLEAVED, ((nan, 1.25e8), (1.25e8, nan)), ((nan, 2.5e-4), (2.5e-4, nan))).describe()
    assert "host 0: ranks 0,2" in text and "host 1: ranks 1,3" in text and "10.0.0.2" in text
    assert "1000.0 Mbit/s (125.0 MB/s)" in text and "250 us" in text
    assert "not probed" in topology(INTERLEAVED).describe()


def test_probe_pairs_cover_every_ordered_host_pair_and_each_multi_rank_host():
    """Catches: a probe that measures a pair twice or skips one (a nan left in the matrix), uses
    another rank than a host's first, or probes inside a host of one rank."""
    pairs = _probe_pairs(((0, 3), (1,), (2, 4)))
    assert pairs == [(0, 0, 0, 3), (0, 1, 0, 1), (0, 2, 0, 2), (1, 0, 1, 0), (1, 2, 1, 2),
                     (2, 0, 2, 0), (2, 1, 2, 1), (2, 2, 2, 4)]  # fmt: skip


# ---------------------------------------------------------------------------- host identity


def test_host_key_names_hostname_and_network_namespace():
    """Catches: a key without the network namespace (emulated hosts on one machine would all
    look like one host) or without the hostname."""
    key = host_key()
    assert key.startswith(socket.gethostname() + "/")
    if os.path.exists("/proc/self/ns/net"):
        assert key.endswith("/" + str(os.stat("/proc/self/ns/net").st_ino))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCGIFADDR and 'lo' are Linux's")
def test_host_address_reads_the_named_interface(monkeypatch):
    """Catches: GLOO_SOCKET_IFNAME ignored (a host reported by an address its peers do not
    use) and a ^-exclusion list taken for an interface name."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert host_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "^lo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert host_address() == "127.0.0.1"  # by the route to MASTER_ADDR
