"""``loomtrain plan --calibrate``: a cluster spec of this machine, by measurement.

The planner prices a layout from a device's achievable GEMM rate, its memory bandwidth, and the
bandwidth and latency of the collectives its groups run (docs/planner.md "Time model"). For the GPUs
of the device table those come from datasheets and published measurements; for the machine at hand
they are measured here, the way the ranks of a run would see them: ``ranks`` processes (one torch
thread each, as loomtrain's workers run) measure at the same time, so that a rank's share of a shared
CPU (4 ranks on 2 cores get about half a core each) is what is measured.

What each rank measures, all ranks at once:

- **GEMM rate by size**: ``fp32`` ``n × n`` products for ``n`` in :data:`GEMM_SIZES`, and thin ones
  (``n × n`` by ``n × n/8``, the shape of a key/value projection): the mean time per call over a
  :data:`WINDOW_S` window of calls back to back (:func:`_mean_seconds` says why not a median), each
  call on the next operands of a pool (:func:`_operand_pool`), as a step meets its weights. The
  planner reads this curve by FLOPs (:meth:`~loomtrain.planner.cost.Device.gemm_rate`): the
  efficiency-by-size curve of issue #19, measured instead of derived from waves.
- **The fused attention kernel's rate by size** (:func:`measure_attention_curve`): causal
  ``scaled_dot_product_attention``, forward and backward, at the sequence lengths of
  :data:`ATTENTION_SEQ_LENS`; on a CPU it runs at half the GEMM rate or less (a 128-token
  sequence: 0.09 TFLOP/s against the GEMMs' 0.21 here), which the GEMM curve would miss.
- **Memory bandwidth by tensor size** of eager elementwise kernels (:func:`measure_memory_curve`): an
  RMSNorm and a SwiGLU product, forward and backward, over tensors of 1 to 16 MiB (a small model's
  activations stay in the CPU's caches, a large one's do not), bytes counted as the time model counts
  a block's, each call on the next inputs of a pool.
- **PyTorch's AdamW step by parameter tensor size** (:func:`measure_optimizer_curve`): over fp32
  tensors of 1 to 16 MiB, bytes counted as the time model counts them; its separate passes over one
  tensor meet it in cache after the first, which the elementwise rate would miss (the own-run
  model's step took 40 ms against 70 priced at that rate).
- **Collectives per group size** ``g`` (each power of two from 2 to ``ranks``): the ranks split into
  ``ranks/g`` groups of consecutive ranks, which all-reduce at once (as a layout's tensor-parallel
  groups do): the latency from a 4-byte all-reduce over its ``2(g-1)`` ring steps, the bus bandwidth
  from a :data:`COLLECTIVE_BYTES` one with nccl-tests' convention (``busbw = S/t · 2(g-1)/g``,
  nccl-tests doc/PERFORMANCE.md). Because busbw is measured, the spec's ``link_efficiency`` is 1.
  And the time of each collective the planner prices (all-reduce, reduce-scatter, all-gather,
  all-to-all) at each of :data:`CURVE_BYTES`, the curves the time model reads
  (:meth:`~loomtrain.planner.time.Cluster.collective_seconds`): two points and a ring formula
  mispriced gloo here (a 1 MiB all-reduce over 4 ranks took 7 ms against the formula's 4, and
  a 64 KiB one as long as the 1 MiB one). Each call follows a compute burst, as in a step
  (:func:`_timed_collective`).
- **Whether collectives hide under compute** (``comm_overlap``): not when the ranks take every
  core, as gloo's reductions and the kernel's socket copies then run on the cores the compute
  needs (on the own-run check, docs/planner.md, pricing them unhidden took the error from 13.5 %
  to 10.5 %).

A figure is the mean over ranks (they share the machine's cores, so their rates are each other's
complement). About 22 s for 2 ranks and 55 s for 4 on a 2-core machine.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.cache import cache_dir, write_atomic
from loomtrain.collective_bench import bus_factor, collective_buffers, flat_op
from loomtrain.distributed.collectives import OPS
from loomtrain.hardware import device_name, usable_cpus
from loomtrain.models.llama import apply_rotary, rope_cache
from loomtrain.planner.arch import Architecture
from loomtrain.planner.cluster import ClusterSpec, load_cluster_spec, parse_cluster_spec
from loomtrain.planner.memory import FP32_ADAM, Layout
from loomtrain.planner.time import elementwise_bytes, optimizer_bytes_per_param

GEMM_SIZES = (64, 128, 256, 512, 1024)
# The attention kernel's timed shapes: (batch · heads) sequences of these lengths, head size 64.
ATTENTION_SEQ_LENS, ATTENTION_HEADS, ATTENTION_HEAD_DIM = (64, 128, 256, 512), 16, 64
# Each figure is a mean over this many seconds of back-to-back calls (at least MIN_CALLS): several
# of Linux CFS's scheduling periods (6-24 ms; sched(7)), so an oversubscribed core's sharing shows.
WINDOW_S = 0.25
MIN_CALLS = 3
# Calls of each timed collective (a fixed count: a window would let ranks disagree on it and hang).
COLLECTIVE_CALLS = 20
# Calls of a curve's collective by message size: about 0.1 s of calls or more at this machine's
# 0.5-2 ms per small message (fewer calls left the 4 KiB figure twice the 64 KiB one); 32 MiB takes
# 20-90 ms a call here.
CURVE_CALLS = {4 * 2**10: 100, 64 * 2**10: 100, 2**20: 50, 8 * 2**20: 20, 32 * 2**20: 5}
# The compute before each timed collective of a curve (m, k, n of a GEMM): _timed_collective.
BURST_SHAPE = (512, 512, 1024)
# Collectives in a new group before it is timed (gloo connects a group's pairs lazily, on first use).
GROUP_WARMUP_CALLS = 10
log = logging.getLogger(__name__)
# The eager elementwise mix's tensors: rows of width 1,024, fp32 (1, 4 and 16 MiB each): a micro-batch's
# activations, from cache-resident (this machine: 1 MiB of L2 per core, 32 MiB of L3) to beyond the caches.
EAGER_ROWS, EAGER_WIDTH = (256, 1024, 4096), 1024
# The heads and the SwiGLU width of that mix: heads of 64 (the own-run model's, GPT-3's), an MLP
# 2.69 times the width (Llama 2 7B's 11,008 of 4,096).
EAGER_HEAD_DIM, EAGER_FFN = 64, 2752
# Calls of the elementwise mix before its timing window: the allocator reaches the state a training
# loop's steady state has (glibc raises its mmap threshold after the first frees; the first calls
# page-fault every output and measured 3-9 GB/s where later ones reach 16-20).
EAGER_WARMUP_S = 0.5
COLLECTIVE_BYTES = 8 * 2**20
# Bytes of the operand pools the GEMM and elementwise timings cycle through (_operand_pool): about a
# rank's share of the last-level cache this machine reports (480 MiB for 2 cores), so that operands
# come from memory, as a step's weights do: between two uses of one weight it moves the rest of the
# model, its gradients and AdamW's states (the own-run model: 208 MB). Reused call after call they
# stayed in the caches and timed 10-50 % fast; a 64 MiB pool left the 512-wide GEMMs 5 % faster than 256.
POOL_BYTES = 256 * 2**20
# A rank's pool takes at most this share of its part of the host's memory (16 ranks on a 24 GiB
# host: 96 MiB each; the measuring ranks hold about twice their pool at the peak).
POOL_MEMORY_SHARE = 1 / 16
# Message sizes of the measured collective curves: a small model's tensor-parallel activations (64 KiB
# to 1 MiB) up to gradient buckets (loomtrain's are 25 MiB by default; larger messages continue the
# last segment's bandwidth). Larger messages cost more per byte here: extrapolated from 8 MiB, a
# 48.6 MiB all-reduce over 4 ranks was priced 65 ms and took 77-87 ms.
CURVE_BYTES = tuple(CURVE_CALLS)
LATENCY_BYTES = 4
# A rank holding less than this share of its fair share of a core while measuring was disturbed.
UNDISTURBED_SHARE = 0.8
# Marks a spec measured while other processes used the cores (its first line); such a spec is not cached.
DISTURBED_MARK = "# DISTURBED:"
# The most measuring processes per core calibrate starts (more would take minutes to spawn and mean little).
MAX_RANKS_PER_CORE = 8
# Seconds a calibration may take per rank a core runs (a rank alone on a core measures for about 25 s).
TIMEOUT_PER_CORE_S = 120.0
# A calibrated spec older than this is measured again (software and load change).
MAX_AGE_DAYS = 7


def _mean_seconds(run, window_s: float = WINDOW_S, calls: int | None = None, warmup_s: float = 0.0,
                  share: float | None = None) -> float:  # fmt: skip
    """Mean seconds per call of ``run`` called back to back for ``window_s`` (at least
    :data:`MIN_CALLS` times), or exactly ``calls`` times (a collective: every rank must make the same
    calls), after one call or, with ``warmup_s``, calls for that long. A mean over a window longer
    than the scheduler's time slice, not a median of single calls: a call short enough to fit in one
    slice runs at full speed even when more processes than cores share the machine, and the median
    would report that speed.

    With ``share`` (of a core), a rank that held more than ``share`` is timed as if it had held
    exactly that: the seconds are the larger of the wall time and the calls' CPU time over
    ``share``. The ranks' windows do not line up: one that measures while others build their
    operands or have finished holds more than its share (4 ranks on 2 cores, 2026-12-04: up to a
    whole core in the last GEMM shapes, whose rates came out 0.047 TFLOP/s where the ranks computing
    together ran 0.033), and its wall time would price every rank's kernels that fast. A rank that
    held less keeps its wall time: a run's ranks lose the same time to whatever else the cores run
    (where that is other processes, :func:`disturbance` marks the spec)."""
    start = time.perf_counter()
    run()  # the first call at a shape allocates and picks kernels
    while time.perf_counter() - start < warmup_s:
        run()
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while done < (calls or MIN_CALLS) or (calls is None and time.perf_counter() - start < window_s):
        run()
        done += 1
    wall = time.perf_counter() - start
    return (wall if share is None else max(wall, (time.process_time() - cpu) / share)) / done


def _gemm_shapes() -> list[tuple[int, int, int]]:
    return [(n, n, n) for n in GEMM_SIZES] + [(n, n, max(8, n // 8)) for n in GEMM_SIZES]


def pool_bytes(ranks: int) -> float:
    """Bytes of each rank's operand pools: :data:`POOL_BYTES`, or :data:`POOL_MEMORY_SHARE` of the
    host memory over ``ranks`` where that is less."""
    return min(POOL_BYTES, host_memory_bytes() / ranks * POOL_MEMORY_SHARE)


def _operand_pool(make, nbytes: float, pool: float = POOL_BYTES):
    """A call without arguments that returns the next of ``ceil(pool / nbytes)`` sets of operands
    ``make()`` builds (``nbytes`` each), round and round: a timed kernel then reads operands it has
    not touched for ``pool`` bytes of other traffic, as a training step's kernels read
    weights and activations out of a core's caches. The same operands call after call would stay in
    them: in the own-run model (docs/planner.md) the GEMMs ran at 0.17-0.19 TFLOP/s and the
    elementwise kernels at about 13 GB/s against 0.20 and 19.7 timed on reused operands."""
    first = make()
    copies = [tuple(_copy(t) for t in first) for _ in range(max(1, math.ceil(pool / nbytes)) - 1)]
    return itertools.cycle([first, *copies]).__next__


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in its own storage, a leaf that requires grad where ``t`` does (cloning is
    memory-bound; drawing every pool set from ``randn`` took most of a 4-rank calibration)."""
    return t.detach().clone().requires_grad_(t.requires_grad)


def measure_gemm_curve(pool: float = POOL_BYTES, share: float | None = None) -> list[tuple[float, float]]:
    """``[(flops, flop_per_s), ...]`` of fp32 GEMMs of :func:`_gemm_shapes` on this process, sorted by FLOPs
    (shapes of equal FLOPs averaged), each call on the next operands of an :func:`_operand_pool` of
    ``pool`` bytes, at ``share`` of a core (:func:`_mean_seconds`; None: as the process ran)."""
    rates: dict[float, list[float]] = {}
    for m, k, n in _gemm_shapes():
        make = lambda m=m, k=k, n=n: (torch.randn(m, k), torch.randn(k, n))  # noqa: E731
        operands = _operand_pool(make, 4.0 * (m * k + k * n), pool)
        flops = 2.0 * m * k * n
        rates.setdefault(flops, []).append(flops / _mean_seconds(lambda o=operands: torch.mm(*o()), share=share))
    return [(flops, statistics.fmean(r)) for flops, r in sorted(rates.items())]


def measure_attention_curve(share: float | None = None) -> list[tuple[float, float]]:
    """``[(flops of one head, flop_per_s), ...]`` of causal ``scaled_dot_product_attention``,
    forward and backward, on :data:`ATTENTION_HEADS` fp32 sequences of each of
    :data:`ATTENTION_SEQ_LENS` tokens, FLOPs counted as the time model counts them
    (``planner/cost.py``'s ``attention_kernels``: ``4 s² d`` per head forward, twice that
    backward, every score counted), at ``share`` of a core (:func:`_mean_seconds`)."""
    points = []
    for s in ATTENTION_SEQ_LENS:
        q, k, v = (torch.randn(1, ATTENTION_HEADS, s, ATTENTION_HEAD_DIM, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, ATTENTION_HEADS, s, ATTENTION_HEAD_DIM)
        flops = 3.0 * 4 * s * s * ATTENTION_HEAD_DIM
        seconds = _mean_seconds(
            lambda q=q, k=k, v=v, g=grad: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g),
            share=share,
        )
        points.append((flops, ATTENTION_HEADS * flops / seconds))
    return points


def measure_memory_curve(pool: float = POOL_BYTES, share: float | None = None) -> list[tuple[float, float]]:
    """``[(tensor bytes, bytes/s), ...]`` of :func:`measure_memory_bandwidth` for each of :data:`EAGER_ROWS`."""
    return [(rows * EAGER_WIDTH * 4.0, measure_memory_bandwidth(rows, pool, share)) for rows in EAGER_ROWS]


def measure_memory_bandwidth(rows: int, pool: float = POOL_BYTES, share: float | None = None) -> float:
    """Bytes/s of a Llama block's eager elementwise kernels with autograd, as ``models/llama.py``
    runs them on a ``rows``-token sequence of width :data:`EAGER_WIDTH` (heads of
    :data:`EAGER_HEAD_DIM`, SwiGLU width :data:`EAGER_FFN`), fp32, forward and backward, each
    output freshly allocated, each call on the next inputs of an :func:`_operand_pool` of ``pool``
    bytes, timed after :data:`EAGER_WARMUP_S` of calls, at ``share`` of a core
    (:func:`_mean_seconds`): two RMSNorms, the rotary embedding of the queries and keys on their
    head-major views, the attention output's copy back to token-major, two residual adds, SiLU and
    the gate product.

    Bytes are the time model's count for this block (``planner/time.py``'s ``elementwise_bytes``,
    ``32h + 10·kv + 5f`` elements per token forward, backward twice that, and the gradient sums of
    the mix's fan-outs as ``fan_out_bytes`` counts a block's: ``18h``).
    Not STREAM's preallocated ``c = a + b``: the rate takes in what these kernels pay beyond their
    bytes (strided head-major views, allocation, autograd), so that the time model's byte count
    prices them at what they take.
    """
    h, heads = EAGER_WIDTH, EAGER_WIDTH // EAGER_HEAD_DIM
    weight = torch.ones(h, requires_grad=True)
    cos, sin = rope_cache(EAGER_HEAD_DIM, rows, 10000.0)

    def inputs() -> tuple[torch.Tensor, ...]:
        x = torch.randn(rows, h, requires_grad=True)
        q, k = (torch.randn(1, rows, heads, EAGER_HEAD_DIM, requires_grad=True) for _ in range(2))
        attention = torch.randn(1, heads, rows, EAGER_HEAD_DIM, requires_grad=True)
        return x, q, k, attention, *(torch.randn(rows, EAGER_FFN, requires_grad=True) for _ in range(2))

    # Each input and the gradient autograd writes for it: twice the inputs' bytes.
    next_inputs = _operand_pool(inputs, 2 * 4.0 * rows * (4 * h + 2 * EAGER_FFN), pool)
    grads = [torch.ones(rows, h), *(torch.ones(1, heads, rows, EAGER_HEAD_DIM) for _ in range(2)),
             torch.ones(rows, h), torch.ones(rows, EAGER_FFN)]  # fmt: skip

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * weight

    def forward(x, q, k, attention, a, b) -> list[torch.Tensor]:
        rotated = [apply_rotary(t.transpose(1, 2), cos, sin) for t in (q, k)]
        hidden = x + attention.transpose(1, 2).reshape(rows, h)
        return [norm(x), *rotated, hidden + norm(hidden), F.silu(a) * b]

    block = Architecture("llama", 1, h, heads, heads, EAGER_FFN, 1, rows, False)
    forward_bytes = elementwise_bytes(block, Layout(seq_len=rows, precision=FP32_ADAM))
    # A step's forward keeps every block's outputs for its backward, so its kernels write to memory
    # not touched since the last step's backward: the mix runs the forwards of as many blocks as
    # move ``pool`` bytes, keeping their outputs, then their backward (one at a time, each output
    # landed in memory just freed: a norm timed 25 GB/s, 11 keeping its outputs).
    depth = max(1, math.ceil(pool / forward_bytes))

    def step() -> None:
        sets = [next_inputs() for _ in range(depth)]
        torch.autograd.backward([out for inputs in sets for out in forward(*inputs)], grads * depth)
        for t in itertools.chain.from_iterable(sets):
            t.grad = None  # a block's inputs are not leaves: nothing accumulates into them

    # The mix's own gradient sums (fan_out_bytes counts a block's): x and hidden feed three kernels
    # each (pow, the product, the add), q and k two (the rotation's halves and the product).
    sums = 3 * 6 * h * rows * 4.0
    return depth * (3 * forward_bytes + sums) / _mean_seconds(step, warmup_s=EAGER_WARMUP_S, share=share)


def measure_optimizer_curve(pool: float = POOL_BYTES, share: float | None = None) -> list[tuple[float, float]]:
    """``[(tensor bytes, bytes/s), ...]``: :func:`measure_optimizer_rate` for fp32 parameter tensors
    of each of :data:`EAGER_ROWS` rows of :data:`EAGER_WIDTH`."""
    return [(rows * EAGER_WIDTH * 4.0, measure_optimizer_rate(rows * EAGER_WIDTH, pool, share)) for rows in EAGER_ROWS]


def measure_optimizer_rate(numel: int, pool: float = POOL_BYTES, share: float | None = None) -> float:
    """Bytes/s of ``torch.optim.AdamW`` (weight decay on, as loomtrain's matrices have it) stepping
    parameters of ``numel`` fp32 elements each, as many as fill ``pool`` bytes with their
    gradients and moments (a step meets each from memory), bytes counted by
    :func:`~loomtrain.planner.time.optimizer_bytes_per_param` (80 per parameter), at ``share`` of a
    core (:func:`_mean_seconds`)."""
    count, values = max(1, math.ceil(pool / (4.0 * numel * 4))), torch.randn(numel)
    params = [torch.nn.Parameter(values.clone()) for _ in range(count)]
    for param in params:
        param.grad = values.clone()
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    moved = count * numel * optimizer_bytes_per_param(FP32_ADAM, fused=False)
    return moved / _mean_seconds(optimizer.step, share=share)


def _groups(ranks: int, size: int) -> list[list[int]]:
    return [list(range(start, start + size)) for start in range(0, ranks, size)]


def _timed_all_reduce(nbytes: int, group) -> float:
    """Mean seconds of a barrier (all ranks start together) and an all-reduce of ``nbytes`` in ``group``."""
    buf = torch.zeros(max(1, nbytes // 4))

    def run() -> None:
        dist.barrier()
        dist.all_reduce(buf, group=group)

    return _mean_seconds(run, calls=COLLECTIVE_CALLS)


def _timed_collective(op: str, nbytes: int, size: int, group) -> float:
    """Mean seconds of one ``op`` in ``group`` (``size`` ranks) on the fp32 buffers of
    :func:`~loomtrain.collective_bench.collective_buffers` whose message is ``nbytes`` (nccl-tests'
    size, rounded down to whole ``4·size``-byte chunks), as a training step meets it: each of
    :data:`CURVE_CALLS` calls follows a compute burst (:func:`_burst`), and the burst's own mean,
    timed alone over as many calls with every rank computing, is taken off. The burst evicts the
    buffers from the core's cache and the ranks finish it at different moments, as they finish a
    block: back to back (nccl-tests' way), a 1 MiB all-reduce over 2 ranks here took 0.8-2.5 ms,
    after 3.5-14 ms of GEMMs 2.3-3.5 ms, and tensor-parallel layouts, whose all-reduces all follow
    compute, were priced 20-24 % fast. Not a barrier before each call with the barrier's own mean
    taken off: at 2 ranks a barrier's time varies by as much as a small message takes."""
    out, t, _ = collective_buffers(op, nbytes, size)
    run, burst, calls = flat_op(op, group), _burst(), CURVE_CALLS[nbytes]
    dist.barrier()
    alone = _mean_seconds(burst, calls=calls)
    dist.barrier()
    both = _mean_seconds(lambda: (burst(), run(out, t)), calls=calls)
    return max(both - alone, 1e-7)


def _burst():
    """A GEMM of :data:`BURST_SHAPE` (fp32, about 2.5 ms on a core here; its 5 MB of operands and
    output are more than a core's L2) as a call without arguments."""
    m, k, n = BURST_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    return lambda: torch.mm(a, b)


def measure_collectives(ranks: int) -> tuple[dict[int, tuple[float, float]], dict[tuple[str, int], list]]:
    """``({group size: (busbw bytes/s, latency s per ring step)}, {(op, group size): [(bytes, seconds),
    ...]})``: the all-reduce's ring figures and each op's curve over :data:`CURVE_BYTES`, every
    group of a size measuring at once.

    Collective over the default process group (every rank must call it).
    """
    found, curves = {}, {}
    for size in (2**i for i in range(1, int(math.log2(ranks)) + 1)):
        groups = [dist.new_group(g) for g in _groups(ranks, size)]
        mine = groups[dist.get_rank() // size]
        for _ in range(GROUP_WARMUP_CALLS):
            dist.all_reduce(torch.zeros(1), group=mine)
        steps = 2 * (size - 1)
        barrier = _mean_seconds(dist.barrier, calls=COLLECTIVE_CALLS)
        latency = max(_timed_all_reduce(LATENCY_BYTES, mine) - barrier, 1e-7) / steps
        seconds = max(_timed_all_reduce(COLLECTIVE_BYTES, mine) - barrier - steps * latency, 1e-9)
        found[size] = (COLLECTIVE_BYTES / seconds * bus_factor("all_reduce", size), latency)
        for op in OPS:
            curves[op, size] = [(float(n), _timed_collective(op, n, size, mine)) for n in CURVE_BYTES]
    return found, curves


def _rank_measurements(ranks: int) -> dict:
    """What one rank measures (module docstring); runs inside :func:`loomtrain.distributed.spawn.spawn`."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    pool, fair = pool_bytes(ranks), fair_share(ranks)
    curve = measure_gemm_curve(pool, fair)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    dist.barrier()
    memory, attention = measure_memory_curve(pool, fair), measure_attention_curve(fair)
    optimizer = measure_optimizer_curve(pool, fair)
    collectives, curves = measure_collectives(ranks)
    return {"curve": curve, "memory": memory, "attention": attention, "optimizer": optimizer,
            "collectives": collectives, "curves": curves, "cpu_share": share}  # fmt: skip


def _mean(values) -> float:
    return statistics.fmean(values)


def _pointwise_mean(per_rank: list[dict], key: str) -> list[tuple[float, float]]:
    """The mean over ranks of each point of the measured ``(size, rate)`` curve ``key``."""
    return [(size, _mean(r[key][i][1] for r in per_rank)) for i, (size, _) in enumerate(per_rank[0][key])]


def combine(per_rank: list[dict]) -> dict:
    """The ranks' measurements as one: each figure the mean over ranks (``curve`` point by point)."""
    curve, memory, attention, optimizer = (
        _pointwise_mean(per_rank, key) for key in ("curve", "memory", "attention", "optimizer")
    )
    sizes = sorted(per_rank[0]["collectives"])
    collectives = {g: tuple(_mean(r["collectives"][g][j] for r in per_rank) for j in (0, 1)) for g in sizes}
    curves = {key: _pointwise_mean([r["curves"] for r in per_rank], key) for key in per_rank[0]["curves"]}
    return {"curve": curve, "memory": memory, "attention": attention, "optimizer": optimizer,
            "collectives": collectives, "curves": curves,
            "cpu_share": min(r.get("cpu_share", 1.0) for r in per_rank)}  # fmt: skip


def fair_share(ranks: int, cores: int | None = None) -> float:
    """The share of a core each of ``ranks`` processes holds while all compute on ``cores`` (this
    machine's usable CPUs where None): ``min(1, cores / ranks)``."""
    return min(1.0, (cores or usable_cpus()) / ranks)


def disturbance(cpu_share: float, ranks: int, cores: int) -> str:
    """Why a calibration was disturbed (empty: it was not): a rank held less than
    :data:`UNDISTURBED_SHARE` of its fair share of a core, ``min(1, cores / ranks)``, while it
    measured GEMMs (CPU time over wall time), so other processes were using the cores and every
    figure is too slow for the machine's own runs."""
    fair = fair_share(ranks, cores)
    if cpu_share >= UNDISTURBED_SHARE * fair:
        return ""
    return (f"a rank held {cpu_share:.0%} of a core while measuring, against a fair share of {fair:.0%}: other "
            "processes were using the cores; measure again on a quiet machine")  # fmt: skip


def host_memory_bytes() -> float:
    """MemTotal of ``/proc/meminfo`` (bytes), or the physical pages × page size where it is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_lines(measured: dict, ranks: int, name: str) -> list[str]:
    curve = measured["curve"]
    points = _tflops_points(curve)
    memory = _gb_points(measured["memory"])
    return ["[[devices]]", f'name = "{name}-cpu"',
            f"peak_tflops = {max(r for _, r in curve) / 1e12:.6g}    # fastest measured fp32 GEMM",
            f"memory_gb_per_s = {measured['memory'][-1][1] / 1e9:.4g}    # eager elementwise kernels, per rank, "
            "largest tensors",
            f"memory_curve = [{memory}]    # [tensor bytes, GB/s]",
            f"memory_gib = {host_memory_bytes() / ranks / 2**30:.4g}    # host memory / ranks",
            "element_bytes = 4    # fp32", f"gemm_curve = [{points}]    # [FLOPs, TFLOP/s]",
            *_optional_curve("attention_curve", _tflops_points(measured.get("attention", [])),
                             "[FLOPs, TFLOP/s] of causal SDPA, forward and backward"),
            *_optional_curve("optimizer_curve", _gb_points(measured.get("optimizer", [])),
                             "[tensor bytes, GB/s] of PyTorch's AdamW step")]  # fmt: skip


def _gb_points(curve: list[tuple[float, float]]) -> str:
    """``(bytes, bytes/s)`` points as the spec's ``[tensor bytes, GB/s]`` list items."""
    return ", ".join(f"[{size:.0f}, {rate / 1e9:.4g}]" for size, rate in curve)


def _optional_curve(field: str, points: str, comment: str) -> list[str]:
    """The device's ``field`` line of ``points`` (spec list items); none when nothing was measured."""
    return [f"{field} = [{points}]    # {comment}"] if points else []


def _tflops_points(curve: list[tuple[float, float]]) -> str:
    """``(flops, flop_per_s)`` points as the spec's ``[FLOPs, TFLOP/s]`` list items."""
    return ", ".join(f"[{f:.4g}, {r / 1e12:.6g}]" for f, r in curve)


def _link_lines(collectives: dict[int, tuple[float, float]]) -> tuple[list[str], list[str]]:
    """The host's link and group lines, and the network's: the largest group's figures stand in for
    the network (one host: nothing crosses hosts); one rank measured none (any figure serves)."""
    sizes = sorted(collectives)
    busbw, latency = collectives[sizes[-1]] if sizes else (1e12, 0.0)
    link = [f"{busbw / 1e9:.4g}", f"{latency * 1e6:.4g}"]
    host = [f"intra_gb_per_s = {link[0]}    # all-reduce busbw of the largest group", f"intra_latency_us = {link[1]}"]
    if sizes:
        host += [f"group_sizes = {sizes}",
                 f"group_gb_per_s = [{', '.join(f'{collectives[g][0] / 1e9:.4g}' for g in sizes)}]",
                 f"group_latency_us = [{', '.join(f'{collectives[g][1] * 1e6:.4g}' for g in sizes)}]"]  # fmt: skip
    network = ["[network]    # one host: the loopback figures stand in", f"inter_gb_per_s = {link[0]}",
               f"inter_latency_us = {link[1]}",
               "link_efficiency = 1.0    # busbw is measured, not a link rate"]  # fmt: skip
    return host, network


def _curve_lines(curves: dict[tuple[str, int], list]) -> list[str]:
    """``[[hosts.collectives]]`` tables of the measured collective curves."""
    lines = []
    for (op, size), points in sorted(curves.items()):
        lines += ["[[hosts.collectives]]    # measured mean seconds of one collective by message size",
                  f'op = "{op}"', f"group_size = {size}", f"bytes = [{', '.join(f'{n:.0f}' for n, _ in points)}]",
                  f"microseconds = [{', '.join(f'{t * 1e6:.4g}' for _, t in points)}]", ""]  # fmt: skip
    return lines


def spec_toml(measured: dict, ranks: int, name: str = "local") -> str:
    """The cluster spec (``planner/cluster.py`` format) of ``ranks`` processes on this machine, from
    :func:`combine`'s figures."""
    when = datetime.now(UTC).isoformat(timespec="seconds")
    host, network = _link_lines(measured["collectives"])
    reason = disturbance(measured.get("cpu_share", 1.0), ranks, usable_cpus())
    lines = [
        *([f"{DISTURBED_MARK} {reason}"] if reason else []),
        f"# Measured by `loomtrain plan --calibrate --ranks {ranks}` on {when}: one device is one of {ranks}",
        f"# processes (one torch thread each) on this machine ({os.cpu_count()} logical CPUs), measuring at once.",
        f'name = "{name}"',
        f'source = "measured {when} on {device_name(torch.device("cpu"))}, torch {torch.__version__}, {ranks} ranks"',
        "", *_device_lines(measured, ranks, name), "",
        "[[hosts]]", "count = 1", f"devices_per_host = {ranks}", f'device = "{name}-cpu"', *host,
        f"comm_overlap = {'true' if ranks < usable_cpus() else 'false'}    # a core left for gloo's threads?",
        f"core_share = {min(1.0, usable_cpus() / ranks):.4g}    # of a core, per rank while all compute", "",
        *_curve_lines(measured.get("curves", {})), *network, "",
    ]  # fmt: skip
    return "\n".join(lines)


def calibrate(ranks: int, timeout_s: float | None = None) -> str:
    """Measure ``ranks`` processes on this machine and return their cluster spec as TOML text.
    ``timeout_s`` (seconds, for every rank to finish): by default :data:`TIMEOUT_PER_CORE_S` times
    the ranks per core, at least that (4 ranks on 2 cores measure for about 55 s).

    Raises:
        ValueError: ``ranks`` below 1 or not a power of two (the group sizes halve it).
        RuntimeError, TimeoutError: a measuring process failed or hung (from ``spawn``).
    """
    if ranks < 1 or ranks & (ranks - 1):
        raise ValueError(f"--ranks={ranks}: give a power of two (1, 2, 4, ...)")
    if ranks > MAX_RANKS_PER_CORE * usable_cpus():
        raise ValueError(f"--ranks={ranks}: more than {MAX_RANKS_PER_CORE} processes per core of this machine's "
                         f"{usable_cpus()}; a run of so many would not be worth planning here")  # fmt: skip
    from loomtrain.distributed.spawn import spawn

    timeout_s = timeout_s or TIMEOUT_PER_CORE_S * max(1.0, ranks / usable_cpus())
    return spec_toml(combine(spawn(_rank_measurements, ranks, ranks, timeout_s=timeout_s)), ranks)


def cached_spec_path(ranks: int) -> Path:
    """Where :func:`local_spec` keeps the spec of ``ranks`` processes: the loomtrain cache directory."""
    return cache_dir() / f"cluster-local-{ranks}.toml"


def write_spec(path: Path, text: str) -> None:
    """Write a spec atomically (parent directories made), readable by all (0644: a spec is meant to
    be shared; ``write_atomic``'s temporary file is 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())
    path.chmod(0o644)


def cache_spec(ranks: int, text: str) -> bool:
    """Keep ``text`` as the cached spec of ``ranks`` processes, unless the measurement was disturbed
    (:func:`disturbance`): a spec of a loaded machine would price every run for a week too slow.
    Returns whether it was cached."""
    if text.startswith(DISTURBED_MARK):
        log.warning("this machine's spec was measured while other processes used the cores (%s); it is used "
                    "for this run only, not cached", text.splitlines()[0])  # fmt: skip
        return False
    write_spec(cached_spec_path(ranks), text)
    return True


def local_spec(ranks: int, refresh: bool = False) -> ClusterSpec:
    """The measured spec of ``ranks`` processes on this machine: the cached one when younger than
    :data:`MAX_AGE_DAYS` (and not ``refresh``), else measured now (:func:`calibrate`) and cached
    (:func:`cache_spec`: not when the measurement was disturbed).

    Raises:
        as :func:`calibrate`.
    """
    path = cached_spec_path(ranks)
    if not refresh and path.is_file() and time.time() - path.stat().st_mtime < MAX_AGE_DAYS * 86400:
        return load_cluster_spec(str(path))
    return measure_spec(ranks)[0]


def measure_spec(ranks: int) -> tuple[ClusterSpec, bool]:
    """The spec of ``ranks`` processes on this machine measured now (:func:`calibrate`), and whether it
    was cached (:func:`cache_spec`: not when the measurement was disturbed).

    Raises:
        as :func:`calibrate`.
    """
    text = calibrate(ranks)
    cached = cache_spec(ranks, text)
    return parse_cluster_spec(tomllib.loads(text), where=cached_spec_path(ranks).name), cached
