"""``loomtrain plan --calibrate`` (planner/calibrate.py) and what its specs add to the cost model:
devices described in a spec, a measured GEMM curve, collective figures by group size, fp32 element
sizes; and two search fixes (world sizes tp·sp does not divide, ties)."""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from loomtrain.config import ModelConfig
from loomtrain.distributed.collectives import OPS
from loomtrain.distributed.pipeline.schedule import build_schedule, shared_core_makespan
from loomtrain.models.llama import TransformerBlock, rope_cache
from loomtrain.planner import calibrate as calibrate_module
from loomtrain.planner.arch import from_model_config
from loomtrain.planner.calibrate import (
    CURVE_BYTES,
    DISTURBED_MARK,
    cached_spec_path,
    disturbance,
    local_spec,
    measure_spec,
    spec_toml,
)
from loomtrain.planner.cli import cmd_plan
from loomtrain.planner.cluster import ClusterSpecError, parse_cluster_spec
from loomtrain.planner.cost import DEVICES, Gemm, attention_kernels, attention_times
from loomtrain.planner.memory import MIXED_ADAM, RECOMPUTE, Layout, device_params, precision_for
from loomtrain.planner.published import (
    KORTHIKANTI_TABLE5,
    MEGATRON_RUNS,
    between_rounds_tau,
    held_out_layout,
    kendall_tau,
    layout_of,
    separated_tau,
)
from loomtrain.planner.search import search
from loomtrain.planner.time import (
    DGX_A100,
    curve_seconds,
    dp_all_reduce_seconds,
    elementwise_bytes,
    fan_out_bytes,
    grad_passes_seconds,
    largest_matrix,
    layer_seconds,
    optimizer_bytes_per_param,
    optimizer_seconds,
    pipeline_seconds,
    ring_all_reduce_seconds,
    ring_gather_seconds,
    step_time,
    zero3_seconds,
)

CPU = {"name": "box", "peak_tflops": 0.1, "memory_gb_per_s": 20, "memory_gib": 8, "element_bytes": 4,
       "gemm_curve": [[1e6, 0.01], [1e8, 0.05], [1e10, 0.1]]}  # fmt: skip
HOST = {"count": 1, "devices_per_host": 4, "device": "box", "intra_gb_per_s": 1, "intra_latency_us": 100,
        "group_sizes": [2, 4], "group_gb_per_s": [2.0, 1.0], "group_latency_us": [50, 120]}  # fmt: skip
NETWORK = {"inter_gb_per_s": 1, "inter_latency_us": 100, "link_efficiency": 1.0}


def spec(**host):
    return parse_cluster_spec({"devices": [CPU], "hosts": [{**HOST, **host}], "network": NETWORK}, where="s")


def test_spec_devices_and_group_links_reach_the_time_model():
    """Catches: a [[devices]] entry or the per-group-size figures parsed but not priced (the cost model
    falling back to the intra-host link, or to bf16 bytes for an fp32 device)."""
    cluster = spec().to_cluster()
    assert cluster.device.name == "box" and cluster.device.element_bytes == 4 and cluster.gpus == 4
    assert cluster.device.memory_bytes == 8 * 2**30
    assert cluster.link(0, 2) == (2e9, 50e-6) and cluster.link(0, 4) == (1e9, 120e-6)
    assert cluster.link(0, 3) == (2e9, 50e-6), "a group of 3 takes the largest measured size below it"
    assert cluster.link(1, 2) == (1e9, 100e-6), "across hosts the network serves every group"
    assert DGX_A100.link(0, 8) == (230e9, 5e-6), "specs without group figures are unchanged"


def test_collectives_add_to_the_step_where_they_cannot_hide():
    """Catches: `comm_overlap = false` (CPU ranks on every core) parsed but ignored, so the gradient
    all-reduce and ZeRO-3's gathers stay hidden under compute; or applied to the layouts that have
    no such collective (one replica: nothing changes)."""
    arch = from_model_config(_model())
    hidden, exposed = spec().to_cluster(), spec(comm_overlap=False).to_cluster()
    assert hidden.comm_overlap and not exposed.comm_overlap
    for zero in (0, 3):
        layout = Layout(seq_len=64, micro_batch=2, dp=4, n_micro=2, zero_stage=zero, precision=precision_for("fp32", 0))
        a, b = step_time(arch, layout, hidden), step_time(arch, layout, exposed)
        params = device_params(arch, layout)
        all_reduce = dp_all_reduce_seconds(arch, layout, exposed, params)
        gathers = layout.n_micro * sum(zero3_seconds(arch, layout, exposed))
        assert b.total == pytest.approx(a.total - a.dp_exposed + all_reduce + gathers) and b.total > a.total
    alone = Layout(seq_len=64, micro_batch=2, n_micro=2, precision=precision_for("fp32", 0))
    assert step_time(arch, alone, hidden).total == step_time(arch, alone, exposed).total
    with pytest.raises(ClusterSpecError, match=r"s.hosts\[0\].comm_overlap='no': give true or false"):
        spec(comm_overlap="no")


@pytest.mark.parametrize(
    ("devices", "host", "message"),
    [
        ([{**CPU, "element_bytes": 3}], {}, r"s.devices\[0\].element_bytes=3: give 1, 2, 4 or 8"),
        ([{**CPU, "gemm_curve": [[1e6]]}], {}, r"s.devices\[0\].gemm_curve=.*\[FLOPs, TFLOP/s\] pairs"),
        ([{**CPU, "attention_curve": [[1e6, float("inf")]]}], {}, r"attention_curve=.*positive and finite"),
        ([{**CPU, "memory_curve": [[True, 1.0]]}], {}, r"memory_curve=\[\[True, 1.0\]\]: give"),
        ([{**CPU, "name": "a100"}], {}, r"s.devices\[0\].name='a100' is already a device"),
        ([{**CPU, "speed": 1}], {}, r"s.devices\[0\]: unknown field\(s\) speed"),
        ([CPU], {"group_gb_per_s": [1.0]}, r"s.hosts\[0\].group_gb_per_s=\[1.0\]: give a list of 2 numbers"),
        ([CPU], {"group_sizes": [1, 4]}, r"s.hosts\[0\].group_sizes=\[1, 4\]: give a list of distinct"),
        ([CPU], {"device": "boxx"}, r"s.hosts\[0\].device='boxx' is unknown.* or a \[\[devices\]\] name \(box\)"),
        ([{**CPU, "peak_tflops": 0.05}], {}, r"s.devices\[0\].gemm_curve has a rate above peak_tflops=0.05"),
        ([CPU], {"group_sizes": [2, 8]}, r"s.hosts\[0\].group_sizes=\[2, 8\]: .* at most devices_per_host=4"),
    ],
)
def test_bad_device_and_group_fields_are_named(devices, host, message):
    """Catches: a malformed measured spec accepted (a curve point without its rate, an infinite rate
    (a fresh user's break test: a NaN plan ranked first) or a boolean size, 3-byte elements,
    a device shadowing the datasheet table, group lists of unequal length, a curve faster than the
    peak (MFU above 100 %), a group larger than its host) or an error not naming the field."""
    with pytest.raises(ClusterSpecError, match=message):
        parse_cluster_spec({"devices": devices, "hosts": [{**HOST, **host}], "network": NETWORK}, where="s")
    partial = {k: v for k, v in HOST.items() if k != "group_latency_us"}
    with pytest.raises(ClusterSpecError, match="give all of group_sizes, group_gb_per_s, group_latency_us"):
        parse_cluster_spec({"devices": [CPU], "hosts": [partial], "network": NETWORK}, where="s")


def test_gemm_rate_follows_the_measured_curve():
    """Catches: a calibrated device priced at its peak for every GEMM (small GEMMs reach a fraction of
    it on a CPU), an interpolation that leaves the measured range, or GPUs losing their roofline."""
    dev = spec().to_cluster().compute_device
    assert dev.gemm_rate(1e8) == pytest.approx(0.05e12) and dev.gemm_rate(1e7) == pytest.approx(0.03e12)
    assert dev.gemm_rate(1e3) == pytest.approx(0.01e12) and dev.gemm_rate(1e13) == pytest.approx(0.1e12)
    assert Gemm(100, 100, 50).seconds(dev) == pytest.approx(1e6 / 0.01e12)
    a100 = replace(DEVICES["a100"], efficiency=0.5)
    assert a100.gemm_rate(1.0) == a100.gemm_rate(1e15) == 0.5 * a100.peak_flops_per_s


def test_fp32_runs_move_twice_the_elementwise_bytes():
    """Catches: an fp32 CPU run's norms, residuals and SwiGLU priced as if their tensors were 16-bit."""
    arch = from_model_config(_model())
    fp32 = Layout(seq_len=64, precision=precision_for("fp32", 0))
    bf16 = Layout(seq_len=64, precision=precision_for("bf16", 1, "bf16"))
    assert elementwise_bytes(arch, fp32) == 2 * elementwise_bytes(arch, bf16)


def _model():
    from loomtrain.config import ModelConfig

    return ModelConfig(n_layers=4, dim=128, n_heads=4, vocab_size=65, max_seq_len=64)


def test_calibrate_measures_this_machine_and_the_cache_serves_it(tmp_path, monkeypatch, capsys):
    """Catches: `plan --calibrate` writing a spec its own loader refuses, missing the group figures,
    the GEMM or the optimizer curve, or `--parallel.auto`'s local_spec measuring again instead of
    reading the cache."""
    monkeypatch.setenv("LOOMTRAIN_CACHE_DIR", str(tmp_path))
    assert cmd_plan(["--calibrate", "--ranks", "2"]) == 0
    path = cached_spec_path(2)
    assert str(path) in capsys.readouterr().out
    before = (path.stat().st_mtime_ns, path.read_text())
    cluster = local_spec(2).to_cluster()
    assert (path.stat().st_mtime_ns, path.read_text()) == before
    assert cluster.gpus == 2 and [g[0] for g in cluster.group_links] == [2]
    busbw, latency = cluster.link(0, 2)
    assert busbw > 1e6 and 0 < latency < 0.1
    curve = cluster.device.gemm_curve
    assert len(curve) >= 5 and all(rate > 1e8 for _, rate in curve)
    assert len(cluster.device.attention_curve) == 4 and all(rate > 1e8 for _, rate in cluster.device.attention_curve)
    assert cluster.device.memory_bytes_per_s > 1e8 and cluster.device.element_bytes == 4
    assert [size for size, _ in cluster.device.memory_curve] == [2**20, 2**22, 2**24]
    optimizer = cluster.device.optimizer_curve
    assert [size for size, _ in optimizer] == [2**20, 2**22, 2**24] and all(rate > 1e8 for _, rate in optimizer)
    assert {(op, g) for op, g, _ in cluster.collective_curves} == {(op, 2) for op in OPS}
    assert all(len(points) == len(CURVE_BYTES) and min(t for _, t in points) > 0
               for _, _, points in cluster.collective_curves)  # fmt: skip
    layout = Layout(seq_len=64, micro_batch=2, dp=2, n_micro=3, precision=precision_for("fp32", 0))
    assert 0 < step_time(from_model_config(_model()), layout, cluster).total < 10
    assert cmd_plan(["--calibrate", "--ranks", "3"]) == 2 and "power of two" in capsys.readouterr().err
    assert os.path.exists(path)


def test_a_one_rank_spec_has_no_group_figures_and_loads():
    """Catches: `--parallel.auto` on one process failing because the calibrated spec of one rank (no
    collective to measure) writes empty group lists its own loader refuses."""
    measured = {"curve": [(1e6, 1e10), (1e9, 5e10)], "memory": [(1e6, 2e10), (1.6e7, 1e10)], "collectives": {}}
    cluster = parse_cluster_spec(tomllib.loads(spec_toml(measured, 1)), where="one").to_cluster()
    assert cluster.gpus == 1 and cluster.group_links == () and cluster.device.gemm_rate(1e9) == pytest.approx(5e10)
    two = {**measured, "collectives": {2: (1e9, 1e-4)}}
    assert parse_cluster_spec(tomllib.loads(spec_toml(two, 2)), where="two").to_cluster().link(0, 2) == (1e9, 1e-4)


def test_a_disturbed_calibration_is_marked_and_not_cached(tmp_path, monkeypatch):
    """Catches: a spec measured while other processes held the cores (it priced every own run 60-100 %
    too slow) cached for a week and used by every later `--parallel.auto`, also when `plan
    --calibrate` wrote the cache (an explicit --out still keeps it), or a fair share misjudged
    for more ranks than cores (4 ranks on 2 cores hold half a core each, undisturbed)."""
    assert disturbance(0.97, 2, 2) == "" and disturbance(0.48, 4, 2) == ""
    assert "held 45% of a core" in disturbance(0.45, 2, 2) and disturbance(0.3, 4, 2)
    measured = {
        "curve": [(1e6, 1e10), (1e9, 5e10)],
        "memory": [(1e6, 2e10), (1.6e7, 1e10)],
        "collectives": {2: (1e9, 1e-4)},
    }
    quiet, busy = spec_toml({**measured, "cpu_share": 1.0}, 2), spec_toml({**measured, "cpu_share": 0.3}, 2)
    assert not quiet.startswith(DISTURBED_MARK) and busy.startswith(DISTURBED_MARK)
    monkeypatch.setenv("LOOMTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_module, "calibrate", lambda ranks: busy)  # a loaded machine, on demand
    assert local_spec(2).to_cluster().gpus == 2 and not cached_spec_path(2).exists()
    assert measure_spec(2)[1] is False  # the own-run benchmark measures again on this answer
    assert cmd_plan(["--calibrate", "--ranks", "2"]) == 0 and not cached_spec_path(2).exists()
    assert cmd_plan(["--calibrate", "--ranks", "2", "--out", str(tmp_path / "kept.toml")]) == 0
    assert (tmp_path / "kept.toml").read_text() == busy
    monkeypatch.setattr(calibrate_module, "calibrate", lambda ranks: quiet)
    assert local_spec(2).to_cluster().gpus == 2 and cached_spec_path(2).read_text() == quiet
    assert measure_spec(2)[1] is True


def test_search_keeps_to_the_world_size_and_breaks_ties_by_less_recomputation_and_zero():
    """Catches: layouts for another GPU count (tp = 2 listed for 3 GPUs), and recomputation or a
    higher ZeRO stage chosen when predicted free (hidden under communication or compute), which
    they are not on a real machine."""
    arch = from_model_config(_model())
    result = search(arch, spec().to_cluster(), 12, seq_len=64, world=3, precision=precision_for("fp32", 0))
    assert result.plans and all(p.layout.gpus == 3 for p in result.plans)
    keys = [(p.step.total, RECOMPUTE.index(p.layout.recompute), p.layout.zero_stage) for p in result.plans]
    assert keys == sorted(keys) and len({k[0] for k in keys}) < len(keys), "the case must contain ties"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top", "-2"], "--top=-2 must be at least 1"),
        (["--gpus", "0"], "--gpus=0 must be at least 1"),
        (["--seq-len", "0"], "--seq-len=0 must be at least 1"),
        (["--memory-fraction", "5"], "--memory-fraction=5.0 must be in (0, 1]"),
    ],
)
def test_plan_refuses_numbers_out_of_range(argv, message, capsys):
    """Catches: `--top -2` slicing off the last rows, `--gpus 0` or `--seq-len 0` read as "the
    default", a memory fraction above 1 (found by a fresh user's break test)."""
    assert cmd_plan(["--model", "llama3-8b", "--cluster", "dgx-a100", "--global-batch", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_calibrate_refuses_a_bad_out_path_or_too_many_ranks_before_measuring(tmp_path, capsys):
    """Catches: a directory, a path under a file, a directory that refuses files though access() allows
    them (/proc for root: found by a fresh user only after the whole measurement, with a temporary
    file's name in the error), or 1,024 measuring processes found only after the measurement (or as a
    traceback): the checks run first and answer with exit code 2."""
    (tmp_path / "file").write_text("")
    cases = [(tmp_path, "is a directory"), (tmp_path / "file" / "spec.toml", "is not a directory")]
    if os.path.isdir("/proc"):
        cases.append((Path("/proc/spec.toml"), "cannot create a file in /proc"))
    for out, message in cases:
        assert cmd_plan(["--calibrate", "--ranks", "2", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert cmd_plan(["--calibrate", "--ranks", "1024"]) == 2
    assert "processes per core" in capsys.readouterr().err


def test_kendall_tau():
    """Catches: τ that counts ties as agreement, or is not symmetric in sign (the own-run ranking check)."""
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="one length"):
        kendall_tau([1], [1])


def test_separated_tau_counts_only_pairs_the_rounds_order():
    """Catches: pairs whose measured rounds interleave (within the measurement's own noise)
    counted as if ordered, or a separated pair's order read from the wrong item: items 0 and 1
    overlap (1.0-1.2 against 1.1-1.3) and are left out; of the other two pairs, the prediction
    orders (0, 2) right and (1, 2) wrong, so τ = 0 over 2 pairs."""
    rounds = [[1.0, 1.2], [1.1, 1.3], [2.0, 2.1]]
    assert separated_tau([1.0, 3.0, 2.0], rounds) == (0.0, 2)
    assert separated_tau([1.0, 1.5, 2.0], rounds) == (1.0, 2)
    with pytest.raises(ValueError, match="no pair"):
        separated_tau([1.0, 2.0], [[1.0, 2.0], [1.5, 2.5]])


def test_between_rounds_tau_is_the_measurements_agreement_with_themselves():
    """Catches: the rounds' agreement read per item instead of per round (``rounds[i]`` holds item
    ``i``'s rounds), or one pair of rounds taken for the mean: rounds 0 and 1 order the three items
    alike (τ 1), round 2 swaps the first two (τ 1/3 against each), so the mean is 5/9."""
    rounds = [[1.0, 1.1, 2.0], [2.0, 2.1, 1.5], [3.0, 3.1, 3.2]]
    assert between_rounds_tau(rounds) == pytest.approx(5 / 9)
    with pytest.raises(ValueError, match="same number"):
        between_rounds_tau([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="same number"):
        between_rounds_tau([[1.0], [2.0]])


def _curves(**seconds_by_op):
    """``[[hosts.collectives]]`` tables of group size 2 at 64 KiB and 1 MiB: ``op=(t64k, t1m)`` in µs."""
    return [{"op": op, "group_size": 2, "bytes": [65536, 1048576], "microseconds": list(t)}
            for op, t in seconds_by_op.items()]  # fmt: skip


def test_collective_curves_price_each_op_between_and_beyond_their_sizes():
    """Catches: a measured curve parsed but not read (the ring formula pricing gloo's 1 MiB all-reduce
    at 4 ranks at 4 ms where 7 ms was measured), interpolation off between sizes, a small message
    priced below the smallest measured one's time, or a large one not growing at the last
    segment's rate."""
    points = ((65536.0, 1e-3), (1048576.0, 3e-3))
    assert curve_seconds(points, 1024) == 1e-3 and curve_seconds(points, 65536 + 491520) == pytest.approx(2e-3)
    assert curve_seconds(points, 1048576 + 983040) == pytest.approx(5e-3)
    cluster = spec(collectives=_curves(all_reduce=(1000, 3000), all_to_all=(400, 900))).to_cluster()
    assert cluster.collective_seconds("all_reduce", 1048576, 2, 0) == pytest.approx(3e-3)
    assert cluster.collective_seconds("all_reduce", 1048576, 4, 0) == pytest.approx(3e-3)  # largest measured <= 4
    ring = ring_all_reduce_seconds(1048576, 2, *cluster.link(1, 2))
    assert cluster.collective_seconds("all_reduce", 1048576, 2, 1) == pytest.approx(ring)  # across hosts: the network
    gather = ring_gather_seconds(1048576, 2, *cluster.link(0, 2))
    assert cluster.collective_seconds("all_gather", 1048576, 2, 0) == pytest.approx(gather)  # no curve: the ring
    assert cluster.collective_seconds("all_reduce", 1048576, 1, 0) == 0.0


def test_zero_and_ulysses_are_priced_from_the_collectives_they_run():
    """Catches: ZeRO's gradient sync priced as one all-reduce when zero.py runs stage 1 as an all-reduce
    plus an all-gather and stage 2 as a reduce-scatter plus an all-gather (gloo's reduce-scatter here
    is slower than half an all-reduce), or Ulysses' all-to-alls priced with all-reduce figures (the
    planner chose sp = 4 at world 4, priced 1.07 s, measured 2.4 s)."""
    arch = from_model_config(_model())
    slow = spec(collectives=_curves(all_reduce=(1000, 2000), reduce_scatter=(1000, 4000), all_gather=(500, 1000)))
    fast = spec(collectives=_curves(all_reduce=(1000, 2000), reduce_scatter=(500, 1000), all_gather=(500, 1000)))
    zero1 = Layout(seq_len=64, micro_batch=2, dp=2, zero_stage=1, precision=precision_for("fp32", 1))
    zero2 = replace(zero1, zero_stage=2, precision=precision_for("fp32", 2))
    params = device_params(arch, zero1)
    per_layer = params * 4 / arch.n_layers  # one block's fp32 gradients (and parameters), ~0.8 MB

    def at(t64k_us: float, t1m_us: float) -> float:
        return curve_seconds(((65536.0, t64k_us * 1e-6), (1048576.0, t1m_us * 1e-6)), per_layer)

    for cluster in (slow, fast):  # stage 1: an all-reduce and an all-gather per block, whatever the reduce-scatter
        expected = arch.n_layers * (at(1000, 2000) + at(500, 1000))
        assert dp_all_reduce_seconds(arch, zero1, cluster.to_cluster(), params) == pytest.approx(expected)
    for cluster, scatter in ((slow, at(1000, 4000)), (fast, at(500, 1000))):
        expected = arch.n_layers * (scatter + at(500, 1000))
        assert dp_all_reduce_seconds(arch, zero2, cluster.to_cluster(), params) == pytest.approx(expected)
    sp2 = Layout(seq_len=64, micro_batch=2, sp=2, precision=precision_for("fp32", 0))
    cheap, dear = (spec(collectives=_curves(all_to_all=t)).to_cluster() for t in ((10, 20), (5000, 9000)))
    assert layer_seconds(arch, sp2, dear)[2] - layer_seconds(arch, sp2, cheap)[2] == pytest.approx(
        2 * 4 * (5000 - 10) * 1e-6)  # two passes of four all-to-alls, each below 64 KiB  # fmt: skip


def test_collective_tables_are_checked_and_heterogeneous_hosts_take_the_slowest():
    """Catches: a misspelled op, a group larger than its host, sizes out of order or a missing time
    accepted silently, and a heterogeneous cluster priced at its fastest host's collectives."""
    for bad, field in (({"op": "allreduce"}, "op"), ({"group_size": 8}, "group_size"),
                       ({"bytes": [1048576, 65536]}, "bytes"), ({"microseconds": [1]}, "microseconds"),
                       ({"seconds": [1, 2]}, "unknown field")):  # fmt: skip
        with pytest.raises(ClusterSpecError, match=field):
            spec(collectives=[{**_curves(all_reduce=(1, 2))[0], **bad}])
    with pytest.raises(ClusterSpecError, match="one table per"):
        spec(collectives=_curves(all_reduce=(1, 2)) * 2)
    fast = {**HOST, "collectives": _curves(all_reduce=(100, 200))}
    slow = {**HOST, "collectives": _curves(all_reduce=(300, 150))}
    both = parse_cluster_spec({"devices": [CPU], "hosts": [fast, slow], "network": NETWORK}, where="s").to_cluster()
    assert both.collective_curves == (("all_reduce", 2, ((65536.0, 3e-4), (1048576.0, 2e-4))),)


def test_elementwise_kernels_are_priced_at_the_activation_size():
    """Catches: a small model's norms and SwiGLU (1 MiB activations that stay in cache, measured
    28 GB/s) priced at the 16 MiB figure (5 GB/s) the old calibration reported for every size,
    which overpriced them 4x against a profiled step."""
    curve = [[2**20, 40.0], [2**24, 10.0]]
    doc = {"devices": [{**CPU, "memory_curve": curve}], "hosts": [HOST], "network": NETWORK}
    flat, curved = spec().to_cluster(), parse_cluster_spec(doc, where="s").to_cluster()
    assert curved.device.memory_rate(2**20) == 40e9 and curved.device.memory_rate(2**22) == pytest.approx(25e9)
    assert curved.device.memory_rate(1.0) == 40e9 and flat.device.memory_rate(2**20) == 20e9
    arch = from_model_config(_model())  # width 128: 2 x 64 tokens x 128 x 4 bytes = 64 KiB activations
    layout = Layout(seq_len=64, micro_batch=2, precision=precision_for("fp32", 0))
    elementwise = elementwise_bytes(arch, layout)
    gap = layer_seconds(arch, layout, flat)[0] - layer_seconds(arch, layout, curved)[0]
    assert gap == pytest.approx(elementwise / 20e9 - elementwise / 40e9)
    with pytest.raises(ClusterSpecError, match="memory_curve"):
        parse_cluster_spec({"devices": [{**CPU, "memory_curve": [[0, 1]]}], "hosts": [HOST], "network": NETWORK})


def test_the_attention_kernel_is_priced_at_its_measured_rate_per_head():
    """Catches: a calibrated CPU's fused attention priced at the GEMM curve (this machine's SDPA at
    128 tokens: 0.09 TFLOP/s against the GEMMs' 0.21, a 7 ms gap per micro-batch of the own-run
    model), the curve read at all heads' FLOPs instead of one head's (its rate follows the sequence
    length), or GPUs without a curve losing their roofline."""
    per_head = 3.0 * 4 * 64 * 64 * 32  # forward and backward of one head: s = 64, head size 32
    doc = {"devices": [{**CPU, "attention_curve": [[per_head, 0.004], [4 * per_head, 0.008]]}], "hosts": [HOST],
           "network": NETWORK}  # fmt: skip
    dev = parse_cluster_spec(doc, where="s").to_cluster().compute_device
    arch = from_model_config(_model())  # 4 heads of 32
    forward, backward = attention_times(arch, 64, 2, 1, dev)
    assert forward == pytest.approx(8 * per_head / 3 / 0.004e12) and backward == pytest.approx(2 * forward)
    assert attention_times(arch, 64, 2, 2, dev)[0] == pytest.approx(forward / 2), "tp halves the heads, not the rate"
    plain = spec().to_cluster().compute_device
    assert attention_times(arch, 64, 2, 1, plain)[0] == attention_kernels(arch, 64, 2, 1, 4)[0].seconds(plain)
    with pytest.raises(ClusterSpecError, match="attention_curve"):
        parse_cluster_spec({"devices": [{**CPU, "attention_curve": [[1e6]]}], "hosts": [HOST], "network": NETWORK})


def test_the_passes_over_gradients_are_priced_per_zero_stage():
    """Catches: the step's memory-bound gradient passes left out (zeroing, averaging and clipping: 19 ms
    of dp 2's step in the own-run model), ZeRO's gradient packing and parameter unpacking left out or
    counted once where stage 3 gathers every micro-batch, or loomtrain's copies charged to the
    published DeepSpeed runs (``zero_gather_copies``)."""
    arch, cluster = from_model_config(_model()), spec().to_cluster()  # 20 GB/s at every size
    fp32 = precision_for("fp32", 0)
    params = device_params(arch, Layout(seq_len=64))
    grads, rate = params * 4, 20e9

    def passes(**layout) -> float:
        return grad_passes_seconds(arch, Layout(seq_len=64, precision=fp32, **layout), cluster, params)

    assert passes() == pytest.approx(4 * grads / rate)  # zeroed, clipped
    assert passes(dp=2) == pytest.approx(6 * grads / rate)  # and averaged
    zero1 = (2 * grads + 2 * grads + 3 * grads / 2 + params * 4 * (2 / 2 + 2)) / rate
    assert passes(dp=2, zero_stage=1) == pytest.approx(zero1)
    zero3 = passes(dp=2, zero_stage=3, n_micro=3, recompute="full")
    assert zero3 - zero1 == pytest.approx((3 * 3 - 1) * params * 4 * 3 / rate)
    assert passes(dp=2, zero_stage=3, zero_gather_copies=False) == pytest.approx((4 * grads + 1.5 * grads) / rate)
    layout = Layout(seq_len=64, dp=2, precision=fp32)
    assert step_time(arch, layout, cluster).grad_passes == pytest.approx(6 * grads / rate)


def test_the_optimizer_is_priced_by_its_passes_at_its_measured_rate():
    """Catches: loomtrain's PyTorch AdamW priced as one fused pass (28 bytes per fp32 parameter where
    it makes 80: the own-run model's step measured 40 ms, priced 25), the published Megatron runs
    losing their fused Adam, or a calibrated ``optimizer_curve`` parsed but not read (its passes meet
    each tensor in cache: 26 GB/s here against the elementwise 15)."""
    fp32 = precision_for("fp32", 0)
    assert optimizer_bytes_per_param(fp32, fused=True) == 28 and optimizer_bytes_per_param(fp32, fused=False) == 80
    # loomtrain's ZeRO steps fp32 masters with fp32 gradients: the same 80 bytes; fused, the paper's 30
    assert optimizer_bytes_per_param(MIXED_ADAM, False) == 80 and optimizer_bytes_per_param(MIXED_ADAM, True) == 30
    published = [layout_of(run) for run in MEGATRON_RUNS] + [held_out_layout(run) for run in KORTHIKANTI_TABLE5]
    assert all(lay.fused_optimizer and not lay.zeroed_grad_buffers for lay in published)
    arch = from_model_config(_model())
    params = device_params(arch, Layout(seq_len=64))
    doc = {"devices": [{**CPU, "optimizer_curve": [[2**16, 40.0], [2**20, 30.0]]}], "hosts": [HOST],
           "network": NETWORK}  # fmt: skip
    curved, flat = parse_cluster_spec(doc, where="s").to_cluster(), spec().to_cluster()
    largest = largest_matrix(arch, Layout(seq_len=64)) * 4  # 128 x 512 fp32: 256 KiB
    rate = curved.device.optimizer_rate(largest)
    assert 30e9 < rate < 40e9 and flat.device.optimizer_rate(largest) == 20e9
    layout = Layout(seq_len=64, precision=fp32)
    assert optimizer_seconds(arch, layout, curved, params) == pytest.approx(params * 80 / rate)
    assert optimizer_seconds(arch, replace(layout, fused_optimizer=True), flat, params) == pytest.approx(
        params * 28 / 20e9
    )
    with pytest.raises(ClusterSpecError, match="optimizer_curve"):
        parse_cluster_spec({"devices": [{**CPU, "optimizer_curve": [[-1, 1]]}], "hosts": [HOST], "network": NETWORK})


def test_the_optimizer_byte_count_follows_pytorchs_adamw():
    """Catches: the count of :func:`optimizer_bytes_per_param` drifting from what PyTorch's AdamW runs
    (a pass added or fused in another torch version): every tensor each operation of one step reads
    and writes, recorded at the dispatcher, for one fp32 parameter of ``n`` elements."""
    n, moved = 4096, []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {id(t): t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            reads = sum(t.numel() * t.element_size() for t in inputs.values() if t.numel() == n)
            writes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.numel() == n)  # fmt: skip
            moved.append(reads + writes)
            return out

    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1)
    optimizer.step()  # the first step builds the moments
    moved.clear()
    with Count():
        optimizer.step()
    assert sum(moved) == n * optimizer_bytes_per_param(precision_for("fp32", 0), fused=False)


class _Adds(TorchDispatchMode):
    """Records the bytes each ``aten.add`` moves (two inputs read, one output written)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_):
            self.moved += 3 * max(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def test_the_gradient_sums_of_a_block_are_counted_as_autograd_adds_them():
    """Catches: the gradient sums autograd adds where one activation feeds several kernels left out of
    the backward (the own-run model's backward: 37 per micro-batch, about a quarter of its
    elementwise traffic), or their count drifting from ``models/llama.py`` (a kernel added or fused):
    every ``add`` of one block's backward, weights frozen so that no gradient accumulates, grouped
    query attention so that ``k``'s width differs from ``q``'s."""
    cfg = ModelConfig(n_layers=1, dim=64, n_heads=4, n_kv_heads=2, vocab_size=32, max_seq_len=16)
    block = TransformerBlock(cfg).requires_grad_(False)
    cos, sin = rope_cache(cfg.head_dim, 16, 10000.0)
    x = torch.randn(2, 16, 64, requires_grad=True)
    out = block(x, cos, sin)
    with _Adds() as adds:
        out.backward(torch.randn_like(out))
    layout = Layout(seq_len=16, micro_batch=2, precision=precision_for("fp32", 0))
    assert adds.moved == fan_out_bytes(from_model_config(cfg), layout) > 0


def test_calibration_times_kernels_on_operands_out_of_cache(monkeypatch):
    """Catches: the GEMM and elementwise timings reusing one set of operands call after call (they
    stay in a core's caches and time 10-50 % faster than a step's kernels, which meet each weight
    after the rest of the model: the own-run model's GEMMs ran at 0.17-0.19 TFLOP/s in its step
    against 0.20-0.21 so timed), a pool smaller than asked, pools of many ranks taking more than
    their share of the host's memory, or the mix's inputs accumulating gradients across its calls
    (a traffic a block's inputs do not have, uncounted: the rate came out 13 % low)."""
    monkeypatch.setattr(calibrate_module, "GEMM_SIZES", (16,))
    monkeypatch.setattr(calibrate_module, "_mean_seconds", lambda run, **_: [run() for _ in range(3)] and 1.0)
    multiplied, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: multiplied.append(a.data_ptr()) or mm(a, b))
    calibrate_module.measure_gemm_curve(pool=8 * 2**10)  # 4 or more sets of operands per shape
    assert len(multiplied) == 6 and len(set(multiplied)) == 6  # 3 calls per shape, each on its own set
    rotated, rotate = [], calibrate_module.apply_rotary
    monkeypatch.setattr(calibrate_module, "apply_rotary", lambda t, *a: rotated.append(t._base) or rotate(t, *a))
    calibrate_module.measure_memory_bandwidth(8, pool=2**20)
    assert len({id(q) for q in rotated}) > 2 and all(q.grad is None for q in rotated)
    x, w = torch.randn(4, 3), torch.randn(3, 2, requires_grad=True)
    pool = calibrate_module._operand_pool(lambda: (x, w), 300, 1000)
    sets = [pool() for _ in range(5)]
    assert len({s[0].data_ptr() for s in sets}) == 4 and sets[4][0].data_ptr() == sets[0][0].data_ptr()
    assert all(torch.equal(s[0], x) and s[1].is_leaf and s[1].requires_grad for s in sets)
    assert calibrate_module._operand_pool(lambda: (x,), 5000, 1000)()[0] is x  # at least one set
    monkeypatch.setattr(calibrate_module, "host_memory_bytes", lambda: 24 * 2**30)
    assert calibrate_module.pool_bytes(2) == calibrate_module.POOL_BYTES
    assert calibrate_module.pool_bytes(16) == 96 * 2**20


def test_ranks_sharing_cores_do_not_lose_the_pipeline_bubble(monkeypatch):
    """Catches: the bubble priced as idle time when ranks share cores (pp 2 x dp 2, 4 ranks on 2 cores,
    measured 1.10 s where 1.34 s was priced: an idle stage's core runs the other stage's ranks),
    sharing assumed where each rank has its own core (pp 2 at world 2 measured as priced), or a
    calibrated spec of more ranks than cores not saying so."""
    assert pipeline_seconds(4, 0.1, 0.2, 0.2) == pytest.approx(1.5)
    pp2, pp4 = build_schedule("1f1b", 2, 4), build_schedule("1f1b", 4, 4)
    # pp 2's idle ranks lend their cores: the work at the shared rate
    assert shared_core_makespan(pp2, 2, 1, 0.1, 0.2, core_share=0.5) == pytest.approx(1.2)
    # pp 4's fill and drain leave cores idle beyond what the busy ranks can use: above its work (1.2),
    # below its dedicated-core 1F1B at the shared rate (2.1)
    assert 1.2 < shared_core_makespan(pp4, 4, 1, 0.1, 0.2, core_share=0.5) < 0.75 * 2.1
    monkeypatch.setattr(calibrate_module, "usable_cpus", lambda: 2)
    measured = {"curve": [(1e6, 1e10)], "memory": [(1e6, 1e10)], "collectives": {2: (1e9, 1e-4)}}
    shares = [
        parse_cluster_spec(tomllib.loads(spec_toml(measured, r)), where="c").to_cluster().core_share for r in (2, 4)
    ]
    assert shares == [1.0, 0.5]
    with pytest.raises(ClusterSpecError, match="core_share"):
        spec(core_share=0)


def test_kernel_timings_are_priced_at_the_ranks_fair_share_of_a_core(monkeypatch):
    """Catches: a rank's kernels timed by the wall clock while it holds more than its share of a core
    (the ranks' windows do not line up: 4 ranks on 2 cores measured their last GEMM shapes at up to a
    whole core each, 0.047 TFLOP/s where computing together they ran 0.033), the CPU time not divided
    by the share, a rank that held less than its share timed on its CPU time alone (the time it lost
    to the rest of the machine, which a run loses too, would go unpriced), or a compute curve that
    does not pass the share on."""

    def half_busy() -> None:  # 10 ms of CPU, then 10 ms asleep: half a core
        end = time.process_time() + 0.01
        while time.process_time() < end:
            pass
        time.sleep(0.01)

    def timed(share: float | None) -> float:
        return calibrate_module._mean_seconds(half_busy, window_s=0.2, share=share)

    assert timed(None) == pytest.approx(0.02, rel=0.3)
    assert timed(0.25) == pytest.approx(0.04, rel=0.3)  # held twice its share: timed as if it had held a quarter
    assert timed(0.5) == pytest.approx(0.02, rel=0.3) and timed(1.0) == pytest.approx(0.02, rel=0.3)  # wall
    assert calibrate_module.fair_share(4, 2) == 0.5 and calibrate_module.fair_share(2, 4) == 1.0
    shares: list[float | None] = []
    monkeypatch.setattr(calibrate_module, "_mean_seconds", lambda run, share=None, **_: shares.append(share) or 1.0)
    monkeypatch.setattr(calibrate_module, "GEMM_SIZES", (16,))
    monkeypatch.setattr(calibrate_module, "EAGER_ROWS", (8,))
    monkeypatch.setattr(calibrate_module, "ATTENTION_SEQ_LENS", (8,))
    calibrate_module.measure_gemm_curve(pool=2**12, share=0.25)
    calibrate_module.measure_memory_curve(pool=2**20, share=0.25)
    calibrate_module.measure_attention_curve(share=0.25)
    calibrate_module.measure_optimizer_curve(pool=2**12, share=0.25)
    assert shares == [0.25] * 5
