"""Hierarchical collectives, HierarchicalHook, AutoHook and the collective benchmark.

Four gloo processes on this machine play two hosts of two ranks, laid out as {0,1},{2,3}
("contiguous"), {0,2},{1,3} ("strided") and, for the collectives, {0,3},{1,2} ("crossed": the
inter-host groups list the hosts in different orders), so nothing assumes that a host holds
consecutive ranks. Topologies are built directly, with made-up link figures.

Tolerances: sums of integer-valued fp32 are exact in any order, so those must match bit for
bit; sums of random fp32 differ from the flat order by rounding only, 1e-6 relative; data
movement (all-gather, all-to-all) is exact. PowerSGD at full rank reconstructs each matrix
through a QR factorization: 1e-5 relative.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loomtrain.collective_bench import bus_factor, format_table, main_worker, parse_bytes, run_collective_bench
from loomtrain.compression import PowerSGDHook, TopKHook
from loomtrain.distributed.collectives import (
    AutoHook,
    CostModel,
    HierarchicalHook,
    calibrated_choice,
    even_plan,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_all_to_all,
    hierarchical_reduce_scatter,
    new_host_groups,
    row_aligned_plan,
)
from loomtrain.distributed.data_parallel import AllReduceHook, GradBucket, apply_data_parallel
from loomtrain.distributed.topology import Topology
from loomtrain.distributed.traffic import INTER_HOST_AXIS, all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from tests.distributed.checks import check_result, run_checks, spawn_once

LAYOUTS = {"contiguous": ((0, 1), (2, 3)), "strided": ((0, 2), (1, 3)), "crossed": ((0, 3), (1, 2))}
HOOK_LAYOUTS = ("contiguous", "strided")
PER_PARAM = 1e-9  # bucket_size_mb: every parameter gets a bucket of its own
TOPK_RATIO = 0.25
# Auto's test links: 100 Mbit/s between hosts, 1 GB/s inside; latencies as on a LAN.
SLOW_INTER = {"inter_bw": 12.5e6, "intra_bw": 1e9, "inter_lat": 2e-4, "intra_lat": 2e-5}


def topology(hosts, inter_bw=12.5e6, intra_bw=1e9, inter_lat=2e-4, intra_lat=2e-5) -> Topology:
    """A Topology of ``hosts`` with the given link figures (bytes/s, seconds)."""
    hosts = tuple(sorted(tuple(sorted(h)) for h in hosts))
    n = len(hosts)
    bandwidth = tuple(tuple(intra_bw if i == j else inter_bw for j in range(n)) for i in range(n))
    latency = tuple(tuple(intra_lat if i == j else inter_lat for j in range(n)) for i in range(n))
    return Topology(hosts, tuple(f"host{i}" for i in range(n)), tuple(f"10.0.0.{i}" for i in range(n)),
                    bandwidth, latency)  # fmt: skip


def odd_model() -> nn.Module:
    """Buckets of 58 elements in all, none of whose parameters splits evenly in 2 or 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def even_rows_model() -> nn.Module:
    """Every parameter's row count is even, so its row-aligned cut in 2 is at half its rows."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4))


# Bucket sizes of big_model at 0.5 MiB buckets (reverse registration order): its small
# parameters together, then the 1 MiB weight alone.
BIG_BUCKET_BYTES = (4 * (3 + 3 * 512 + 512), 4 * 512 * 512)


def big_model() -> nn.Module:
    """A 1 MiB weight (its own bucket at 0.5 MiB buckets) beside 8 KiB of small parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 3))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(5, model[0].in_features, generator=torch.Generator().manual_seed(100 * step + rank))
    return model(x).square().sum()


def reduced_grads(model_fn, hook, bucket_mb: float, steps=(0,), after_step=None) -> dict[str, torch.Tensor]:
    """The averaged gradients of ``model_fn()`` under ``hook`` after the last of ``steps``
    (one backward each); ``after_step(step)`` runs after each."""
    model = model_fn()
    hook.setup([list(range(dist.get_world_size()))])
    sync = apply_data_parallel(model, dist.group.WORLD, bucket_mb, hook)
    for step in steps:
        sync.zero_grad()
        loss_of(model, dist.get_rank(), step).backward()
        sync.finish_gradient_sync()
        if after_step is not None:
            after_step(step)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    sync.remove()
    return grads


def assert_grads(got: dict, want: dict, rtol: float, atol: float = 0.0) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


# ---------------------------------------------------------------------------- checks in the spawn


def check_all_reduce(groups) -> None:
    rank = dist.get_rank()
    for numel in (1, 3, 5, 7, 13, 64, 1001):  # 1001: not divisible by P = 2 nor by H·P = 4
        gen = torch.Generator().manual_seed(1000 * rank + numel)
        for t in (torch.randint(-1000, 1000, (numel,), generator=gen).float(), torch.randn(numel, generator=gen)):
            flat = t.clone()
            dist.all_reduce(flat)
            got = hierarchical_all_reduce(t.clone(), groups)
            if t.round().equal(t):
                assert got.equal(flat), f"integer-valued all-reduce of {numel} differs"
            torch.testing.assert_close(got, flat, rtol=1e-6, atol=1e-6, msg=f"all-reduce of {numel}")


def check_other_collectives(groups) -> None:
    rank, n, k = dist.get_rank(), 4, 3
    gen = torch.Generator().manual_seed(rank)
    t = torch.randint(-1000, 1000, (n * k,), generator=gen).float()
    flat, got = torch.empty(k), torch.empty(k)
    dist.reduce_scatter_single(flat, t.clone())
    assert hierarchical_reduce_scatter(got, t.clone(), groups).equal(flat), "reduce-scatter"
    part = torch.randn(k, generator=gen)
    flat, got = torch.empty(n * k), torch.empty(n * k)
    dist.all_gather_single(flat, part)
    assert hierarchical_all_gather(got, part, groups).equal(flat), "all-gather"
    t = torch.randn(n * k, generator=gen)
    dist.all_to_all_single(flat, t)
    assert hierarchical_all_to_all(got, t, groups).equal(flat), "all-to-all"


def check_dense_hook(layout: str) -> dict:
    topo = topology(LAYOUTS[layout])
    want = reduced_grads(odd_model, AllReduceHook(), 1.0)
    hook = HierarchicalHook(topo)
    got = reduced_grads(odd_model, hook, 1.0)
    assert_grads(got, want, rtol=1e-6, atol=1e-7)
    return {"bytes": hook.bytes_sent, "inter": hook.traffic.bytes[INTER_HOST_AXIS], "dense": hook.dense_bytes}


def local_grads(model_fn, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own gradient (no data parallelism)."""
    model = model_fn()
    loss_of(model, rank, 0).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def topk_reference(hosts) -> tuple[dict[str, torch.Tensor], int]:
    """By hand: each host's mean gradient, cut in 2 row blocks, Top-K of each block on each
    host, averaged over hosts; and the inter-host bytes of one rank (its block's all-gather of
    (index, value) pairs per parameter)."""
    grads = [local_grads(even_rows_model, r) for r in range(4)]
    reference, inter = {}, 0
    for name, g in grads[0].items():
        rows = g.shape[0]
        host_means = [sum(grads[r][name] for r in host).reshape(rows, -1) / 2 for host in hosts]
        out = torch.zeros_like(host_means[0])
        for block in range(2):
            sl = slice(block * rows // 2, (block + 1) * rows // 2)
            k = math.ceil(TOPK_RATIO * host_means[0][sl].numel())
            for mean in host_means:
                part = mean[sl].reshape(-1)
                keep = torch.zeros_like(part)
                idx = part.abs().topk(k).indices
                keep[idx] = part[idx]
                out[sl] += keep.view_as(mean[sl]) / 2
        inter += all_gather_bytes(2 * 8 * k, 2)
        reference[name] = out.view_as(g)
    return reference, inter


def check_topk_hook(layout: str) -> None:
    hook = HierarchicalHook(topology(LAYOUTS[layout]), TopKHook(TOPK_RATIO))
    got = reduced_grads(even_rows_model, hook, PER_PARAM)
    want, inter = topk_reference(LAYOUTS[layout])
    assert_grads(got, want, rtol=1e-6, atol=1e-7)
    assert hook.traffic.bytes[INTER_HOST_AXIS] == inter, (hook.traffic.bytes[INTER_HOST_AXIS], inter)


def check_powersgd_hook(layout: str) -> tuple[int, int]:
    """Returns (this rank's local index, its inter-host bytes)."""
    want = reduced_grads(odd_model, AllReduceHook(), 1.0)
    hook = HierarchicalHook(topology(LAYOUTS[layout]), PowerSGDHook(rank=1000, min_compress_numel=0))
    got = reduced_grads(odd_model, hook, 1.0)
    assert_grads(got, want, rtol=1e-5, atol=1e-5)
    # One bucket, [b2 3 | w2 3×5 | b1 5 | w1 5×7] = 58 elements: the cut nearest 29 on a row
    # boundary is 30 (w1's rows start at 23, 30, ...), so each rank puts 2 × 30 on the wire.
    intra = 2 * reduce_scatter_bytes(2 * 30 * 4, 2)
    inter = hook.traffic.bytes[INTER_HOST_AXIS]
    assert hook.bytes_sent == inter + intra, (hook.bytes_sent, inter, intra)
    local = next(host.index(dist.get_rank()) for host in LAYOUTS[layout] if dist.get_rank() in host)
    return local, inter


def check_auto_one_host() -> list[str]:
    hook = AutoHook(topology([range(4)]))
    got = reduced_grads(big_model, hook, 0.5)
    assert_grads(got, reduced_grads(big_model, AllReduceHook(), 0.5), rtol=0.0)
    return [hook.choice(2**e) for e in range(10, 29, 2)]


def check_auto_slow_link() -> tuple[dict[int, str], dict]:
    hook = AutoHook(topology(LAYOUTS["contiguous"], **SLOW_INTER))
    got = reduced_grads(big_model, hook, 0.5)
    assert_grads(got, reduced_grads(big_model, AllReduceHook(), 0.5), rtol=1e-6, atol=1e-7)
    return dict(hook.paths), hook.winners


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def check_uneven_hosts() -> tuple[int, int]:
    """Three ranks on one host, one on the other: flat; returns (warnings, inter-host bytes)."""
    counter = _Count()
    logging.getLogger("loomtrain.distributed.collectives").addHandler(counter)
    hook = HierarchicalHook(topology([(0, 1, 2), (3,)]))
    try:
        got = reduced_grads(odd_model, hook, 1.0)
    finally:
        logging.getLogger("loomtrain.distributed.collectives").removeHandler(counter)
    assert_grads(got, reduced_grads(odd_model, AllReduceHook(), 1.0), rtol=0.0)
    return counter.count, hook.traffic.bytes[INTER_HOST_AXIS]


def check_topk_state_round_trip() -> None:
    """Two steps with one hook; the second again with a fresh hook loaded from the first's
    state after step 0: the second step's gradients must agree bit for bit."""
    topo, saved = topology(LAYOUTS["contiguous"]), {}
    first = HierarchicalHook(topo, TopKHook(TOPK_RATIO))

    def save(step: int) -> None:
        if step == 0:
            saved.update(copy.deepcopy(first.state_dict()))

    want = reduced_grads(even_rows_model, first, PER_PARAM, steps=(0, 1), after_step=save)
    assert saved["residuals"] and all(r.numel() < 48 for r in saved["residuals"].values()), "residuals of pieces"
    second = HierarchicalHook(topo, TopKHook(TOPK_RATIO))
    second.load_state_dict(saved)
    assert second.method == "topk" and second.inner.steps == 1
    assert_grads(reduced_grads(even_rows_model, second, PER_PARAM, steps=(1,)), want, rtol=0.0)


def check_bench() -> list[dict]:
    topo = topology(LAYOUTS["contiguous"], **SLOW_INTER)
    return run_collective_bench(topo, sizes=[1024, 2**20], min_iters=1, max_seconds_per_point=0.0, max_iters=1,
                                link_rate_bytes_per_s=12.5e6)  # fmt: skip


def check_main_worker() -> dict | None:
    with tempfile.TemporaryDirectory(prefix="loomtrain-bench-") as d:
        path = Path(d) / "rows.json"
        flags = "--ops all_reduce,all_to_all --min-bytes 1K --max-bytes 4K --iters 1 --max-seconds 0"
        main_worker([*flags.split(), "--link-rate", "100mbit", "--probe-budget", "0.5", "--json", str(path)])
        return json.loads(path.read_text()) if dist.get_rank() == 0 else None


def hierarchical_checks() -> dict:
    """Every check, in one spawn of 4 ranks (group creation is collective: all ranks create
    every layout's groups, in the same order)."""
    groups = {name: new_host_groups(hosts) for name, hosts in LAYOUTS.items()}
    checks = {}
    for name in LAYOUTS:
        checks[f"all_reduce {name}"] = lambda g=groups[name]: check_all_reduce(g)
        checks[f"others {name}"] = lambda g=groups[name]: check_other_collectives(g)
    for name in HOOK_LAYOUTS:
        checks[f"dense hook {name}"] = lambda n=name: check_dense_hook(n)
        checks[f"topk hook {name}"] = lambda n=name: check_topk_hook(n)
        checks[f"powersgd hook {name}"] = lambda n=name: check_powersgd_hook(n)
    checks.update({
        "auto one host": check_auto_one_host, "auto slow link": check_auto_slow_link,
        "uneven hosts": check_uneven_hosts, "topk state": check_topk_state_round_trip,
        "bench": check_bench, "main_worker": check_main_worker,
    })  # fmt: skip
    return run_checks(checks)


def results() -> list[dict]:
    return spawn_once(hierarchical_checks, 4, timeout_s=240)


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchical_all_reduce_equals_flat(layout):
    """Catches: a padded tail summed into real elements or lost (sizes not divisible by P or
    H·P), shards all-reduced over the wrong ranks, pieces gathered back out of order, and any
    assumption that a host holds consecutive ranks."""
    for rank in range(4):
        check_result(results(), f"all_reduce {layout}", rank)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchical_reduce_scatter_all_gather_all_to_all_equal_flat(layout):
    """Catches: chunks reordered by host instead of by inter-group rank (wrong in the crossed
    layout, where inter groups list hosts in different orders), a rank receiving another's
    chunk, and all-to-all chunks put back in host-major rather than flat order."""
    for rank in range(4):
        check_result(results(), f"others {layout}", rank)


@pytest.mark.parametrize("layout", HOOK_LAYOUTS)
def test_hierarchical_hook_equals_allreduce(layout):
    """Catches: a gradient divided by P·H twice or not by P (the average would be off by a
    factor), a padded piece written back into the bucket, and bytes crossing hosts counted
    with the intra-host ones (inter must be the 29-element shard's all-reduce only)."""
    for rank in range(4):
        got = check_result(results(), f"dense hook {layout}", rank)
        shard_bytes = 29 * 4  # 58 fp32 elements, even cut in 2
        assert got["inter"] == all_reduce_bytes(shard_bytes, 2)
        assert got["bytes"] == got["inter"] + 2 * reduce_scatter_bytes(2 * shard_bytes, 2)
        assert got["dense"] == all_reduce_bytes(58 * 4, 4)


@pytest.mark.parametrize("layout", HOOK_LAYOUTS)
def test_hierarchical_topk_compresses_only_across_hosts(layout):
    """Catches: Top-K applied to each rank's own gradient before the intra-host sum (it must
    see the host's sum), blocks selected over the wrong rows, and inter-host bytes that are
    not the compressed all-gather's."""
    for rank in range(4):
        check_result(results(), f"topk hook {layout}", rank)


@pytest.mark.parametrize("layout", HOOK_LAYOUTS)
def test_hierarchical_powersgd_full_rank_equals_dense(layout):
    """Catches: a bucket cut inside a row or a piece's matrices pointing at the wrong
    elements (PowerSGD at full rank is exact only on true row blocks), a piece handed over as
    one flat row (PowerSGD would send it dense), and PowerSGD's second all-reduce (issued in
    wait()) missing from the inter-host bytes."""
    # PowerSGD's volume over 2 hosts, fp32 (all-reduce of m bytes on 2 ranks sends m): piece 0
    # holds b2 [3,1], w2 [3,5], b1 [5,1], w1's row 0 [1,7]: P of w2 (3·3) with the dense 3+5+7,
    # then Q of w2 (5·3); piece 1 holds w1's rows 1-4 [4,7]: P (4·4), then Q (7·4).
    volume = {0: 4 * (9 + 15 + 15), 1: 4 * (16 + 28)}
    for rank in range(4):
        local, inter = check_result(results(), f"powersgd hook {layout}", rank)
        assert inter == volume[local], (rank, inter, volume[local])


def test_auto_on_one_host_is_flat():
    """Catches: the hierarchical path taken on a single host (pointless extra collectives)."""
    for rank in range(4):
        assert set(check_result(results(), "auto one host", rank)) == {"flat"}


def test_auto_follows_the_timings_identically_on_every_rank():
    """Catches: a choice that differs between ranks (they would issue different collectives
    and hang) or follows the cost model against the set-up timings: here the topology claims
    a slow inter-host link that this one machine does not have, so only measured wins count."""
    got = [check_result(results(), "auto slow link", rank) for rank in range(4)]
    assert all(g == got[0] for g in got)
    paths, winners = got[0]
    model = CostModel.from_topology(topology(LAYOUTS["contiguous"], **SLOW_INTER))
    (mine,) = winners.values()
    for index, size in enumerate(BIG_BUCKET_BYTES):
        assert paths[index] == calibrated_choice(size, mine, model, 0.1)


def test_calibrated_choice_needs_every_larger_measurement_and_the_model():
    """Catches: hierarchical taken for a size where a larger calibrated size measured flat
    faster, for a size above the calibration without the model's agreement, or with no
    measurement at all."""
    model = CostModel.from_topology(topology(LAYOUTS["contiguous"], **SLOW_INTER))
    winners = {2**16: "flat", 2**18: "hierarchical", 2**20: "hierarchical"}
    assert calibrated_choice(2**15, winners, model, 0.1) == "flat"
    assert calibrated_choice(2**17, winners, model, 0.1) == "hierarchical"
    assert calibrated_choice(2**24, winners, model, 0.1) == "hierarchical"
    assert calibrated_choice(2**24, {**winners, 2**20: "flat"}, model, 0.1) == "flat"
    assert calibrated_choice(2**17, {2**18: "hierarchical", 2**20: "flat"}, model, 0.1) == "flat"
    assert calibrated_choice(2**24, {}, model, 0.1) == "flat"
    same = CostModel.from_topology(topology(LAYOUTS["contiguous"], intra_bw=12.5e6, intra_lat=2e-4))
    assert calibrated_choice(2**24, winners, same, 0.1) == "flat"


def test_uneven_hosts_fall_back_to_flat_with_one_warning():
    """Catches: a hierarchical split of hosts of unequal size (would hang or mis-sum), a
    warning per bucket instead of one, and flat bytes counted as crossing hosts for ranks
    whose ring successor is on their own host (ranks 0 and 1 of host {0,1,2})."""
    for rank in range(4):
        warnings, inter = check_result(results(), "uneven hosts", rank)
        assert warnings == 1
        assert (inter > 0) == (rank in (2, 3)), (rank, inter)


def test_hierarchical_topk_state_round_trips():
    """Catches: residuals not delegated to the inner hook (an empty state, or a load that is
    ignored), or shaped like the whole bucket instead of the piece (dropped at load with a
    warning): the resumed step would differ."""
    check_result(results(), "topk state")


def test_collective_bench_rows():
    """Catches: busbw not by nccl-tests' factors, link_fraction against the wrong rate, an
    auto row that ran another path than it chose, and a table that drops rows."""
    rows = check_result(results(), "bench")
    assert len(rows) == 4 * 2 * 3
    model = CostModel.from_topology(topology(LAYOUTS["contiguous"], **SLOW_INTER))
    for r in rows:
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["op"], 4))
        assert r["link_fraction"] == pytest.approx(r["busbw"] / 12.5e6)
        if r["mode"] != "auto":
            assert r["path"] == r["mode"], r
        elif r["op"] != "all_reduce":  # all-reduce follows the set-up timings (calibrated_choice)
            assert r["path"] == model.choice(r["op"], r["bytes"]), r
    assert len(format_table(rows).splitlines()) == len(rows) + 2


def test_collective_bench_main_worker_writes_json():
    """Catches: flags parsed into the wrong units (--link-rate in bits, sizes), and the JSON
    not written by rank 0."""
    written = check_result(results(), "main_worker")
    rows = written["rows"]
    assert [r["bytes"] for r in rows if r["mode"] == "flat" and r["op"] == "all_reduce"] == [1024, 4096]
    assert all(r["link_fraction"] == pytest.approx(r["busbw"] / 12.5e6) for r in rows)
    assert len(rows) == 2 * 2 * 3 and written["topology"]["hosts"]


# ---------------------------------------------------------------------------- no processes


def test_cost_model_formulas():
    """Catches: the hierarchical inter-host phase charged per rank instead of sharing the host
    link (P rings of S/P), or the flat ring counted with H instead of n = H·P steps."""
    topo = topology(LAYOUTS["contiguous"], inter_bw=1e7, intra_bw=1e9, inter_lat=1e-3, intra_lat=1e-5)
    got = CostModel.from_topology(topo).predict_seconds("all_reduce", 10**6)
    assert got["flat"] == pytest.approx(6e-3 + 1.5e6 / 1e7)
    assert got["hierarchical"] == pytest.approx(2e-5 + 1e6 / 1e9 + 2e-3 + 1e6 / 1e7)


def test_cost_model_choices():
    """Catches: hierarchical chosen where it cannot win clearly: latency-bound messages, an
    intra-host link no faster than the inter-host one (the Horovod issue 328 situation), an
    all-to-all (its win would rest on latency alone: the same bytes cross hosts), a single host."""
    sizes = [2**e for e in range(10, 29, 2)]
    slow = CostModel.from_topology(topology(LAYOUTS["contiguous"], **SLOW_INTER))
    # Well bandwidth-bound once each ring step's S/4 >= 8·a_e·b_e = 20000 bytes: from 256 KiB on.
    assert [slow.choice("all_reduce", s) for s in sizes] == ["flat"] * 4 + ["hierarchical"] * 6
    same = CostModel.from_topology(topology(LAYOUTS["contiguous"], intra_bw=12.5e6, intra_lat=2e-4))
    assert {same.choice("all_reduce", s) for s in sizes} == {"flat"}
    assert {slow.choice("all_to_all", s) for s in sizes} == {"flat"}
    one_host = CostModel.from_topology(topology([range(4)]))
    assert {one_host.choice(op, s) for op in ("all_reduce", "reduce_scatter") for s in sizes} == {"flat"}


def test_auto_without_measured_links_is_flat():
    """Catches: a topology without a link probe crashing the hook instead of reducing flat."""
    bare = Topology(((0, 1), (2, 3)), ("a", "b"), ("a", "b"))
    hook = AutoHook(bare)
    assert hook.choice(2**28) == "flat"
    with pytest.raises(ValueError, match="probe"):
        hook.predict_seconds(2**20)


def _cuts_inside_rows(plan, buffer, matrices) -> list[int]:
    starts = {}
    for m in matrices:
        offsets = torch.arange(buffer.numel()).as_strided(m.shape, m.stride(), m.storage_offset())
        for row in offsets.reshape(-1, m.shape[-1]).tolist():
            starts[row[0]] = len(row)
    return [c for c in plan.bounds if any(s < c < s + n for s, n in starts.items())]


def test_row_aligned_plan_cuts_only_between_rows():
    """Catches: a cut inside a matrix row (PowerSGD would compress a torn matrix), pieces that
    do not cover the buffer, and ZeRO's strided [n, rows, cols] matrices mishandled."""
    bucket = GradBucket(0, torch.zeros(58), [], [], [], matrices=[])
    buffer = bucket.buffer
    dp = [buffer[0:3].view(3, 1), buffer[3:18].view(3, 5), buffer[18:23].view(5, 1), buffer[23:58].view(5, 7)]
    zero = [buffer.view(2, 29)[:, 0:9].unflatten(1, (3, 3)), buffer.view(2, 29)[:, 9:29].unflatten(1, (4, 5))]
    for matrices in (dp, zero):
        for parts in (2, 3, 4):
            plan = row_aligned_plan(buffer, matrices, parts)
            assert plan.bounds[0] == 0 and plan.bounds[-1] == 58 and list(plan.bounds) == sorted(plan.bounds)
            assert _cuts_inside_rows(plan, buffer, matrices) == []
            blocks = [b for i in range(parts) for b in plan.piece_matrices(i, buffer[slice(*plan.piece(i))])]
            assert sum(b.numel() for b in blocks) == 58
    assert even_plan(58, 4).bounds == (0, 15, 30, 45, 58)


def test_parse_bytes_names_the_flag():
    """Catches: binary prefixes read as decimal, and an error that does not name the flag."""
    assert parse_bytes("64K", "--max-bytes") == 65536 and parse_bytes("1MiB", "--max-bytes") == 2**20
    with pytest.raises(ValueError, match="--max-bytes"):
        parse_bytes("lots", "--max-bytes")
