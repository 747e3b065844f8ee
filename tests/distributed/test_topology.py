"""Topology discovery and a placed mesh on 4 gloo processes on this machine (one host).

One spawn runs every check (:func:`tests.distributed.checks.run_checks`); the parent tests
read each check's result. Discovery across hosts (network namespaces) is tested in
``tests/integration/test_multihost.py``.
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from loomtrain.distributed.parallel_dims import Axis, ParallelDims, sharded_dtensor
from loomtrain.distributed.topology import discover_topology
from tests.distributed.checks import check_result, run_checks, spawn_once

WORLD = 4
BUDGET_S = 3.0
PLACED_ORDER = (0, 2, 1, 3)  # what place_ranks gives for tp 2 on hosts (0, 2) and (1, 3)


def _discover() -> dict:
    start = time.perf_counter()
    topo = discover_topology(probe_budget_s=BUDGET_S)
    return {"seconds": time.perf_counter() - start, "json": json.dumps(topo.to_dict()), "topology": topo}


def _placed_mesh() -> dict:
    """The tp and dp groups and coordinates of a mesh built from a non-identity order, and a
    DTensor sharded over tp by the rank's tp coordinate, gathered back."""
    dims = ParallelDims(dp=2, tp=2, world_size=WORLD, rank_order=PLACED_ORDER)
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    local = full.chunk(dims.tp)[dims.rank(Axis.TP)].clone()
    gathered = sharded_dtensor(local, dims.mesh[str(Axis.TP)], [Shard(0)], full.shape).full_tensor()
    return {
        "mesh_ranks": dims.mesh_ranks().tolist(),
        "tp_group": dist.get_process_group_ranks(dims.group(Axis.TP)),
        "dp_group": dist.get_process_group_ranks(dims.group(Axis.DP_SHARD)),
        "tp_rank": dims.rank(Axis.TP),
        "dp_rank": dims.dp_rank,
        "full_equal": bool(torch.equal(gathered, full)),
    }


def topology_checks() -> dict:
    return run_checks(
        {
            "discover": _discover,
            "unprobed": lambda: discover_topology(probe=False),
            "placed_mesh": _placed_mesh,
        }
    )


def results() -> list[dict]:
    return spawn_once(topology_checks, WORLD, timeout_s=120)


def test_discovery_finds_one_host_with_every_rank():
    """Catches: ranks of one machine split into several hosts (a key that differs per process,
    e.g. including the pid) or hosts not ordered by rank."""
    topo = check_result(results(), "discover")["topology"]
    assert topo.hosts == ((0, 1, 2, 3),)
    assert len(topo.host_keys) == 1 and len(topo.addresses) == 1
    assert topo.addresses[0] == "127.0.0.1"  # the spawn helper's MASTER_ADDR, reached over loopback


def test_every_rank_holds_the_same_topology():
    """Catches: each rank keeping its own measurements instead of rank 0's broadcast (ranks
    would then decide placement or collectives differently and deadlock)."""
    texts = {check_result(results(), "discover", rank)["json"] for rank in range(WORLD)}
    assert len(texts) == 1, texts


def test_probe_measures_the_link_inside_the_host_within_the_budget():
    """Catches: a probe that leaves the diagonal unmeasured (nan) on a host with several
    ranks, reports a zero or negative figure (a timer or unit error), or overruns its budget
    (a growth loop that does not stop at 16 MiB or at the target time)."""
    got = check_result(results(), "discover")
    topo = got["topology"]
    bandwidth, latency = topo.link_bandwidth[0][0], topo.link_latency[0][0]
    assert math.isfinite(bandwidth) and bandwidth > 0, bandwidth
    assert math.isfinite(latency) and latency > 0, latency
    assert topo.gpu_p2p is None  # CPU-only processes
    # A runaway growth loop overruns by far more than a loaded CI machine's jitter (5x margin).
    slowest = max(check_result(results(), "discover", rank)["seconds"] for rank in range(WORLD))
    assert slowest < 5 * BUDGET_S, f"discovery took {slowest:.2f} s, budget {BUDGET_S} s"


def test_discovery_without_probe_measures_nothing():
    """Catches: probe=False still sending probe traffic or inventing link figures."""
    topo = check_result(results(), "unprobed")
    assert topo.hosts == ((0, 1, 2, 3),) and topo.link_bandwidth is None and topo.link_latency is None


def test_mesh_from_rank_order_builds_the_groups_mesh_ranks_says():
    """Catches: a mesh built from the identity order while mesh_ranks reports the placed one
    (tp would then run over (0, 1) and (2, 3), across hosts), and group ranks that disagree
    with the mesh coordinates (DTensor's gathered tensor would come back permuted)."""
    for rank in range(WORLD):
        got = check_result(results(), "placed_mesh", rank)
        ranks = got["mesh_ranks"]  # [pp, dp_replicate, dp_shard, sp, tp] = [1, 1, 2, 1, 2]
        rows = [ranks[0][0][d][0] for d in range(2)]
        mine = next(row for row in rows if rank in row)
        assert mine == [0, 2] or mine == [1, 3], rows
        assert got["tp_group"] == mine, f"rank {rank}: {got['tp_group']} != {mine}"
        assert got["tp_rank"] == mine.index(rank), f"rank {rank}"
        column = [row[got["tp_rank"]] for row in rows]
        assert got["dp_group"] == column and got["dp_rank"] == column.index(rank), f"rank {rank}"
        assert got["full_equal"], f"rank {rank}: DTensor gathered over tp came back permuted"
