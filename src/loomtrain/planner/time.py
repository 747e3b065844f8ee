"""Seconds per training step of a parallel layout on a cluster: the time half of the planner's cost model.

Arithmetic on an :class:`~loomtrain.planner.arch.Architecture`, a
:class:`~loomtrain.planner.memory.Layout` and a :class:`Cluster`; nothing is built or run. One step of
one pipeline (every data-parallel replica runs the same) is

    step = m · (t_f + t_b) / (1 - bubble) + exposed data-parallel all-reduce + optimizer step
           + passes over the gradients + the trainer's logging collectives

with ``m`` micro-batches, ``t_f`` and ``t_b`` the forward and backward of one micro-batch on the
slowest pipeline stage (its GEMMs, its memory-bound elementwise kernels, its tensor-parallel
all-reduces, Ulysses all-to-alls, ZeRO-3 gathers and its point-to-point sends), and ``bubble`` the
schedule's idle share from :func:`loomtrain.distributed.pipeline.schedule.theoretical_bubble`. Sources:

- GEMMs and attention: the shared layer cost model, :mod:`loomtrain.planner.cost` (the math-or-memory
  bound of NVIDIA DU-09799-001 ch. 2 with ch. 5's wave quantization), at ``gemm_efficiency`` of the
  peak: the largest rate cuBLAS reaches on the device, measured (the device table's MAMF).
- Backward: two GEMMs per forward GEMM (Kaplan et al. 2020 §2.1); full recomputation runs each block's
  forward again in backward (Narayanan et al. SC 2021 §5.1: the ``96`` instead of ``72``).
- Tensor parallelism: Megatron's two all-reduces of ``b·s·h`` per block in forward and two in
  backward (Shoeybi et al. 2019 §3; Narayanan et al. §3.3), ring all-reduce moving ``2(t - 1)/t`` of the
  buffer per rank (Patarasuk & Yuan 2009; NCCL's busbw convention, nccl-tests doc/PERFORMANCE.md).
  Megatron sequence parallelism replaces each all-reduce by a reduce-scatter and an all-gather of the
  same total volume (Korthikanti et al. 2022 §4.2.2): the same time.
- Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses §3): an all-to-all of ``q``,
  ``k``, ``v`` before attention and one of its output after, each rank sending ``(sp - 1)/sp`` of its
  share; the same again in backward.
- Pipeline point-to-point: one activation ``b·s·h`` forward and one gradient backward per stage
  boundary, split over the ``t`` ranks' own network cards (Narayanan et al. §4.1 scatter/gather).
  Priced as blocking sends inside ``t_f`` and ``t_b`` (Megatron-LM 2021's, and an upper bound for
  loomtrain's non-blocking ones); where ranks share cores (a calibrated CPU spec) the pipeline is
  instead replayed with each boundary's send overlapping compute (:func:`shared_pipeline_seconds`).
- A host with one network link for all its devices (``Cluster.inter_shared_by_host``: an emulated
  cluster's shaped veth) rather than a card per GPU: the host's ranks that cross it at once share its
  rate, ``min(stride, devices_per_host)`` ring streams (or stage sends) for groups of ranks ``stride``
  apart, every rank of the host for an all-to-all.
- Data parallelism, ZeRO 0-2: a ring all-reduce of the gradients (ZeRO 1-2: reduce-scatter plus
  all-gather, the same volume; Rajbhandari et al. 2020 §7), overlapped with the last micro-batch's
  backward (the only backward after which every gradient is final), the rest exposed; all of it
  exposed where the layout does not overlap it (``Layout.overlap_grad_reduce``: Megatron-LM's
  ``train_step`` of 2021 all-reduced after ``forward_backward_func`` returned).
- Gradient accumulation: each micro-batch after the first adds its weight gradients into the
  accumulated ones (PyTorch's ``AccumulateGrad`` takes the first micro-batch's gradient as it is and
  adds the others in place; Megatron-LM's local DDP adds every micro-batch's into its ``main_grad``
  buffer), a memory-bound pass reading both and writing the sum: ``3 · grad_bytes`` per parameter of
  the stage, inside each micro-batch's backward. At ``b = 1``, ``s = 2048`` it is ~5 % of a
  micro-batch (6 bytes against ``8 · b · s`` FLOP per parameter, 2 TB/s against 268 TFLOP/s).
- ZeRO-3 (Rajbhandari et al. §7.2.2: ``3Ψ`` against data parallelism's ``2Ψ``): every micro-batch
  all-gathers the stage's parameters for its forward, again for a recomputed forward, again for its
  backward, and reduce-scatters its gradients, over the ``dp_shard · sp`` ranks, layer by layer; prefetching
  overlaps them with compute (DeepSpeed's ``stage3_prefetch_bucket_size``, ``overlap_comm``), so a
  micro-batch's forward takes the longer of its compute and its gathers, its backward likewise.
- loomtrain's passes over its gradients (:func:`grad_passes_seconds`) and its trainer's logging
  collectives (:func:`logging_seconds`), counted from its code; 0 for the published runs.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, replace

from loomtrain.distributed.pipeline.schedule import build_schedule, shared_core_makespan, theoretical_bubble
from loomtrain.planner.arch import Architecture
from loomtrain.planner.cost import DEVICES, Device, Gemm, attention_times, head_times, layer_gemms
from loomtrain.planner.memory import Layout, Precision, device_params, layers_per_chunk

# A measured collective: (op, group size, ((message bytes, seconds), ...) sorted by size).
CollectiveCurve = tuple[str, int, tuple[tuple[float, float], ...]]


@dataclass(frozen=True)
class Cluster:
    """Hosts of identical devices joined by one network (a heterogeneous spec is reduced to one of
    these by :meth:`loomtrain.planner.cluster.ClusterSpec.to_cluster`).

    Attributes:
        device: the GPU (:class:`~loomtrain.planner.cost.Device`: dense 16-bit peak, HBM bandwidth and
            capacity, SMs); its ``efficiency`` is replaced by ``gemm_efficiency``.
        gemm_efficiency: the share of the peak the best-shaped large GEMM reaches (measured).
        devices_per_host: GPUs joined by the intra-host link.
        intra_bytes_per_s, inter_bytes_per_s: link bandwidth per GPU and direction, bytes/s, inside a
            host and between hosts (per GPU: each GPU has its own network card); with
            ``inter_shared_by_host``, ``inter_bytes_per_s`` is the host's instead.
        inter_shared_by_host: whether a host has one network link, shared by its devices
            (``inter_bytes_per_s`` bytes/s per host and direction), instead of one per device: a
            collective with ``k`` of the host's ranks crossing the link at once gets
            ``inter_bytes_per_s / k`` per rank (:meth:`link`; an emulated cluster's one shaped veth
            per host, ``[network] host_gb_per_s``).
        link_efficiency: the share of a link's bandwidth a large collective reaches (busbw / link).
        intra_latency_s, inter_latency_s: seconds per ring step of a collective, or per send.
        hosts: hosts in the cluster (0: as many as a layout needs, for the published comparisons).
        name, source: label, and where the figures come from.
        group_links: measured ``(group size, busbw bytes/s, latency s)`` of collectives inside a host,
            by group size (a calibrated spec, ``planner/calibrate.py``); empty: the intra-host link
            serves every group size.
        collective_curves: measured ``(op, group size, ((bytes, seconds), ...))`` of each collective
            of :data:`~loomtrain.distributed.collectives.OPS` inside a host, by message size (bytes
            as nccl-tests count them: the all-reduced buffer, the reduce-scatter's input, the
            all-gather's output, the all-to-all's buffer); empty: the ring formulas price them from
            :meth:`link`.
        core_share: the share of a core each rank holds while every rank computes (a calibrated CPU
            spec: ``min(1, cores / ranks)``; 1 for GPUs). Below 1 the spec's rates are measured at
            that share, and a rank's idle time, the pipeline bubble, is not lost: the ranks it shares
            cores with run faster meanwhile (:func:`shared_pipeline_seconds`).
        comm_overlap: whether the data-parallel and ZeRO-3 collectives can run under compute. True for
            GPUs (the copy engines and NCCL's kernels run beside the compute kernels); False for CPU
            ranks that occupy every core, where gloo's reductions and the kernel's socket copies
            take the cores the compute needs, so the collectives add to the step.

    Raises:
        ValueError: a size or bandwidth not positive, or an efficiency outside (0, 1].
    """

    device: Device
    gemm_efficiency: float
    devices_per_host: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    link_efficiency: float
    intra_latency_s: float
    inter_latency_s: float
    hosts: int = 0
    name: str = ""
    source: str = ""
    group_links: tuple[tuple[int, float, float], ...] = ()
    comm_overlap: bool = True
    collective_curves: tuple[CollectiveCurve, ...] = ()
    core_share: float = 1.0
    inter_shared_by_host: bool = False

    def __post_init__(self) -> None:
        for field in ("devices_per_host", "intra_bytes_per_s", "inter_bytes_per_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Cluster.{field}={getattr(self, field)} must be positive")
        for field in ("gemm_efficiency", "link_efficiency", "core_share"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Cluster.{field}={getattr(self, field)} must be in (0, 1]")

    @property
    def sms(self) -> int:
        """Streaming multiprocessors per device (the waves of a GEMM)."""
        return self.device.sms

    @property
    def gpus(self) -> int:
        """Devices in the cluster (0: unbounded)."""
        return self.hosts * self.devices_per_host

    @property
    def compute_device(self) -> Device:
        """The device as the cost model prices it: efficiency ``gemm_efficiency``."""
        return replace(self.device, efficiency=self.gemm_efficiency)

    def link(self, streams: int, size: int = 0) -> tuple[float, float]:
        """``(achievable bytes/s, latency s)`` of the link one rank of a group of ``size`` ranks uses.
        ``streams``: 0 when the group stays inside a host; otherwise the host's ranks that send over
        the network at once (:func:`_host_streams`), which share a host's one link
        (:attr:`inter_shared_by_host`) and each have their own otherwise. Inside a host, the measured
        figures of the largest measured group size up to ``size`` (the smallest measured one below
        it) where :attr:`group_links` has any."""
        if streams:
            share = streams if self.inter_shared_by_host else 1
            return self.inter_bytes_per_s / share * self.link_efficiency, self.inter_latency_s
        if self.group_links:
            fitting = [g for g in self.group_links if g[0] <= size] or [min(self.group_links)]
            _, busbw, latency = max(fitting)
            return busbw * self.link_efficiency, latency
        return self.intra_bytes_per_s * self.link_efficiency, self.intra_latency_s

    def measured_curve(self, op: str, size: int, streams: int) -> tuple[tuple[float, float], ...]:
        """The measured ``(bytes, seconds)`` curve that prices ``op`` over ``size`` ranks: inside a host
        (``streams`` 0) where :attr:`collective_curves` has ``op``, the one of the largest measured
        group size up to ``size`` (the smallest measured one below it); else empty."""
        curves = [] if streams else [(g, points) for o, g, points in self.collective_curves if o == op]
        return max([c for c in curves if c[0] <= size] or [min(curves)])[1] if curves else ()

    def collective_seconds(self, op: str, nbytes: float, size: int, streams: int) -> float:
        """Seconds of one ``op`` of ``nbytes`` (nccl-tests' message size, :attr:`collective_curves`)
        over a group of ``size`` ranks, ``streams`` of a host's ranks crossing the network at once
        (0: inside a host; :meth:`link`): inside a host where :attr:`collective_curves` has ``op``, its
        measured curve of the largest measured group size up to ``size`` (:func:`curve_seconds`);
        otherwise the ring formulas on :meth:`link` (all-reduce: :func:`ring_all_reduce_seconds`;
        reduce-scatter, all-gather: :func:`ring_gather_seconds`; all-to-all: each rank sends
        ``(n - 1)/n`` of the buffer, one message per peer). 0 for one rank."""
        if size <= 1:
            return 0.0
        points = self.measured_curve(op, size, streams)
        if points:
            return curve_seconds(points, nbytes)
        bandwidth, latency = self.link(streams, size)
        if op == "all_reduce":
            return ring_all_reduce_seconds(nbytes, size, bandwidth, latency)
        if op == "all_to_all":
            return (size - 1) / size * nbytes / bandwidth + (size - 1) * latency
        return ring_gather_seconds(nbytes, size, bandwidth, latency)


def curve_seconds(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Seconds of a collective of ``nbytes`` from measured ``(bytes, seconds)`` points sorted by
    size: linear between points; below the smallest, its time (a latency floor); beyond the largest,
    the last segment's seconds per byte on (a bandwidth-bound message grows linearly)."""
    if nbytes <= points[0][0] or len(points) == 1:
        return points[0][1] if nbytes <= points[0][0] else points[0][1] * nbytes / points[0][0]
    i = min(max(bisect.bisect_left([b for b, _ in points], nbytes), 1), len(points) - 1)
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    return t0 + (nbytes - b0) * max(t1 - t0, 0.0) / (b1 - b0)


def _mamf_share(name: str) -> float:
    return DEVICES[name].mamf_flops_per_s / DEVICES[name].peak_flops_per_s


# DGX A100 (NVIDIA DGX A100 System Architecture whitepaper, and the A100 datasheet): 8 A100 SXM per
# host through NVSwitch, eight 200 Gb/s HDR InfiniBand cards, one per GPU. The link figures are
# measured NCCL bus bandwidths (so link_efficiency is 1): 230 GB/s for an all-reduce of the 8 GPUs
# of a host (NCCL maintainer, NVIDIA/nccl-tests issue #149: "~20GB/s effective" per 25 GB/s NVLink,
# 240 GB/s, "other bottlenecks on the GPUs limits it to ~230GB/s"), 24 GB/s per HDR card (NCCL
# maintainer, NVIDIA/nccl issue #412: "24GB/s inter-node" for one 200G HDR NIC; NVIDIA/nccl issue
# #812: 192 GB/s all-reduce busbw between DGX A100s, 8 cards). GEMM ceiling: the device table's
# MAMF (267.9 of 312 TFLOP/s, CUDA 12.1). Latencies: docs/planner.md "Time model".
# configs/clusters/dgx_a100.toml holds the same figures (a test keeps them equal).
DGX_A100 = Cluster(
    device=DEVICES["a100"],
    gemm_efficiency=_mamf_share("a100"),
    devices_per_host=8,
    intra_bytes_per_s=230e9,
    inter_bytes_per_s=24e9,
    link_efficiency=1.0,
    intra_latency_s=5e-6,
    inter_latency_s=10e-6,
    name="dgx-a100",
    source="DGX A100 whitepaper; NCCL busbw: nccl-tests #149 (NVLink 230 GB/s), nccl #412 (24 GB/s per HDR card); "
    "ml-engineering MAMF table (A100 SXM 267.9 TFLOP/s bf16)",
)
# DGX H100 (NVIDIA DGX H100 user guide / H100 datasheet): 8 H100 SXM5, fourth-generation NVLink
# 900 GB/s per GPU both directions together (450 GB/s each way), eight ConnectX-7 400 Gb/s
# InfiniBand cards (50 GB/s per GPU each way); MAMF 792.1 of 989.4 TFLOP/s.
DGX_H100 = replace(
    DGX_A100,
    device=DEVICES["h100"],
    gemm_efficiency=_mamf_share("h100"),
    intra_bytes_per_s=450e9,
    inter_bytes_per_s=50e9,
    link_efficiency=0.8,  # line rates: NCCL's ~20 % protocol overhead (nccl-tests issue #212, about H100)
    name="dgx-h100",
    source="DGX H100 user guide; H100 datasheet; ml-engineering MAMF table (H100 SXM 792.1 TFLOP/s bf16)",
)


def gemm_seconds(m: int, k: int, n: int, cluster: Cluster, batch: int = 1) -> float:
    """Seconds of ``batch`` independent ``m × k`` by ``k × n`` 16-bit products in one kernel on one of
    ``cluster``'s devices, wave-quantized (:meth:`loomtrain.planner.cost.Gemm.seconds`).

    Raises:
        ValueError: a dimension or ``batch`` below 1.
    """
    return Gemm(m, k, n, batch).seconds(cluster.compute_device, waves=True)


def elementwise_bytes(arch: Architecture, layout: Layout) -> float:
    """HBM bytes the non-GEMM kernels of one block's forward move on one rank, per micro-batch.

    Each kernel reads its inputs and writes its output once, 16-bit elements, 1-byte dropout masks
    (the fused kernels of Megatron-LM as Korthikanti et al. 2022 §4.1 list their tensors). Per
    token, ``gpt``: two LayerNorms (``2·4h``), two bias-dropout-adds (``2·7h``: two inputs, an
    output, a mask), bias-GeLU (``16h/t``: read and write ``4h/t``), softmax (``4as/t``) and its
    dropout (``5as/t``). ``llama``: the kernels loomtrain's eager block launches
    (``models/llama.py``), in 16-bit elements ``×2``: two RMSNorms of four kernels each (``pow`` 2,
    ``mean`` 1, two ``mul`` 2 each: ``2·7h``), two residual adds (``2·3h``), the rotary embedding of
    ``q`` and ``k`` (negate 1, concatenate 2, two ``mul`` 2 each, add 3: ``10(h + kv)/t``), the
    attention output's copy to contiguous (``2h/t``), SiLU and the product (``5f/t``); the fused
    attention kernel's scores never reach memory. Backward moves
    twice as much (it reads the saved input and the output gradient, writes the input gradient).
    Ulysses ``sp`` divides the tokens; Megatron sequence parallelism divides the norms' and residual
    adds' by ``t`` (they run on a ``1/t`` slice of the sequence: Korthikanti et al. 2022 §4.2.2);
    elements of ``precision.activation_bytes`` other than 2 (an fp32 run) scale the bytes.
    """
    s, t, h, a = layout.seq_len, layout.tp, arch.hidden, arch.n_heads
    sigma = t if layout.sequence_parallel else 1
    if arch.family == "gpt":
        per_token = (8 * h + 14 * h) / sigma + 16 * h / t + 9 * a * s / t
    else:
        per_token = 2 * (20 * h / sigma + (12 * h + 10 * arch.kv_width + 5 * arch.ffn_hidden) / t)
    return per_token * layout.micro_batch * s / layout.sp * layout.precision.activation_bytes / 2


def ring_all_reduce_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks``: each rank sends ``2(n - 1)/n`` of the
    buffer over ``2(n - 1)`` steps (Patarasuk & Yuan 2009). 0 for one rank."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bandwidth + steps * latency


def ring_gather_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose whole result is ``nbytes``: each rank
    sends ``(n - 1)/n`` of it in ``n - 1`` steps; half a ring all-reduce. 0 for one rank."""
    return ring_all_reduce_seconds(nbytes, ranks, bandwidth, latency) / 2


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by part (all on the slowest pipeline stage).

    Attributes:
        forward, backward: one micro-batch's forward and backward (recomputation included), with
            their GEMMs, elementwise kernels, tensor-parallel all-reduces, all-to-alls, ZeRO-3 gathers
            beyond what compute hides, and point-to-point sends as blocking ones (on shared cores
            ``pipeline`` replays the sends overlapped instead).
        tp_comm: the tensor-parallel all-reduces and Ulysses all-to-alls inside ``forward + backward``.
        p2p: the point-to-point sends inside ``forward + backward``.
        pipeline: the micro-batches on one pipeline, :func:`pipeline_seconds` (on shared cores
            :func:`shared_pipeline_seconds`).
        bubble: the schedule's idle share of ``pipeline`` on dedicated devices (its formula,
            :func:`~loomtrain.distributed.pipeline.schedule.theoretical_bubble`).
        dp_exposed: the data-parallel all-reduce not hidden behind the last backward.
        optimizer: the optimizer step (memory-bound: every state read and written once).
        zero3_comm: one micro-batch's ZeRO-3 gathers and reduce-scatter (overlapped with compute).
        grad_accumulation: the step's gradient accumulation (:func:`grad_accumulation_seconds`),
            spread over the micro-batches' backwards inside ``pipeline``.
        grad_passes: the passes over gradients and ZeRO's copies (:func:`grad_passes_seconds`).
        logging: the trainer's collectives of a logged step, per step (:func:`logging_seconds`).
    """

    forward: float
    backward: float
    tp_comm: float
    p2p: float
    pipeline: float
    bubble: float
    dp_exposed: float
    optimizer: float
    zero3_comm: float = 0.0
    grad_accumulation: float = 0.0
    grad_passes: float = 0.0
    logging: float = 0.0

    @property
    def total(self) -> float:
        """Seconds per step."""
        return self.pipeline + self.dp_exposed + self.optimizer + self.grad_passes + self.logging


def _host_streams(stride: int, size: int, cluster: Cluster) -> int:
    """The host's ranks that send over the network at once in a ring (or pipeline send) over groups of
    ``size`` ranks ``stride`` apart (ranks numbered tp fastest, then sp, dp, pp, hosts holding
    consecutive ranks); 0 when a group stays inside a host. A host's ranks belong to
    ``min(stride, devices_per_host)`` such groups, and each group's ring crosses a host boundary
    with one stream per direction (its stage boundary with one send per rank of the stage)."""
    if size == 1 or stride * size <= cluster.devices_per_host:
        return 0
    return min(stride, cluster.devices_per_host)


def activation_bytes(arch: Architecture, layout: Layout) -> float:
    """Bytes of one ``b·(s/sp)·h`` activation of a micro-batch on one rank (``precision.activation_bytes``
    each): what a tensor-parallel all-reduce moves, what a stage sends (over ``t``), the size the
    elementwise kernels stream."""
    return layout.micro_batch * layout.seq_len / layout.sp * arch.hidden * layout.precision.activation_bytes


def stage_blocks(arch: Architecture, layout: Layout) -> int:
    """Blocks on one pipeline rank: ``layers_per_chunk · virtual_stages``.

    Raises:
        ValueError: as :func:`~loomtrain.planner.memory.layers_per_chunk`.
    """
    return layers_per_chunk(arch, layout) * layout.virtual_stages


def tp_all_reduce_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """One of Megatron's per-block tensor-parallel all-reduces: ``b·s·h/sp`` activations of
    ``precision.activation_bytes`` over the ``tp`` ranks (inter-host when ``tp`` exceeds a host)."""
    return cluster.collective_seconds("all_reduce", activation_bytes(arch, layout), layout.tp,
                                      _host_streams(1, layout.tp, cluster))  # fmt: skip


def all_to_all_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """Ulysses' four all-to-alls of one block's forward on one rank (``sequence_parallel.py``): ``q``
    and the attention output of ``b·(s/sp)·h/t`` elements, ``k`` and ``v`` of ``b·(s/sp)·kv/t``
    (:meth:`Cluster.collective_seconds`). 0 without ``sp``. Across hosts every rank of a host sends
    over the network at once (each has peers on other hosts), not one ring stream per group."""
    sp = layout.sp
    tokens = layout.micro_batch * layout.seq_len / sp * layout.precision.activation_bytes / layout.tp
    streams = cluster.devices_per_host if _host_streams(layout.tp, sp, cluster) else 0
    return sum(2 * cluster.collective_seconds("all_to_all", tokens * width, sp, streams)
               for width in (arch.hidden, arch.kv_width))  # fmt: skip


def vocab_parallel_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's tensor-parallel collectives outside the
    blocks on the last stage: the vocabulary-parallel embedding's all-reduce of ``b·(s/sp)·h``
    activations (with ``pp = 1``, the head's stage holds it too) and the cross-entropy's two
    all-reduces of ``N + 1`` and ``2N`` fp32 values (``N = b·s/sp`` tokens) in forward, the head
    input's gradient all-reduce of ``b·(s/sp)·h`` in backward (Shoeybi et al. 2019 §3: the parallel
    input and output embeddings, the output fused with the cross-entropy; ``tensor_parallel.py``'s
    ``vocab_parallel_cross_entropy``). ``(0, 0)`` without ``tp``."""
    t = layout.tp
    if t == 1:
        return 0.0, 0.0
    streams, tokens = _host_streams(1, t, cluster), layout.micro_batch * layout.seq_len / layout.sp
    activation = cluster.collective_seconds("all_reduce", activation_bytes(arch, layout), t, streams)
    loss = sum(cluster.collective_seconds("all_reduce", 4 * n, t, streams) for n in (tokens + 1, 2 * tokens))
    return loss + (activation if layout.pp == 1 else 0.0), activation


def loss_bytes_per_logit(arch: Architecture, layout: Layout) -> tuple[int, int]:
    """``(forward, backward)`` memory bytes the cross-entropy moves per logit on one rank, each kernel
    reading its inputs and writing its output once, in float32 as both implementations compute it.

    ``gpt`` (Megatron-LM 2021: ``output.float()``, then ``vocab_parallel_cross_entropy``, also at
    ``t = 1``): forward the fp32 copy (2 + 4), the row maximum (4), ``sub_`` (8), ``exp`` (8), the row
    sum (4) and ``div_`` to the saved softmax (8); backward the ``mul_`` by the output gradient (8)
    and the cast back (4 + 2). ``llama`` (loomtrain, ``distributed/parallel_model.py``): the fp32 copy
    of 16-bit logits (``2 + 4`` each way, none for fp32); with ``tp = 1`` ``F.cross_entropy``:
    ``log_softmax`` (8) forward, the zero-filled gradient (4) and ``log_softmax``'s backward (12);
    with ``tp > 1`` ``vocab_parallel_cross_entropy``: maximum (4), shift (8), ``exp`` (8), sum (4),
    ``div_`` (8) forward, the scaled softmax (8) backward."""
    if arch.family == "gpt":
        return 38, 14
    cast = 6 if layout.precision.activation_bytes < 4 else 0
    forward, backward = (8, 16) if layout.tp == 1 else (32, 8)
    return forward + cast, backward + cast


def loss_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's cross-entropy on the last stage: the
    ``b·(s/sp)·V/t`` logits of a rank streamed through :func:`loss_bytes_per_logit`'s kernels at the
    memory rate of one fp32 logit tensor (:meth:`~loomtrain.planner.cost.Device.memory_rate`). For
    GPT at 1.7B, micro-batch 16, that is 87 GB, 1.5 % of the step; for Llama 3's 128K vocabulary it
    grows with ``V/h``."""
    logits = layout.micro_batch * layout.seq_len / layout.sp * arch.vocab_size / layout.tp
    rate = cluster.device.memory_rate(4 * logits)
    forward, backward = loss_bytes_per_logit(arch, layout)
    return logits * forward / rate, logits * backward / rate


def p2p_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """One stage-to-stage send of a micro-batch's ``b·s·h`` activation (or its gradient), each of the
    ``tp`` ranks sending ``1/t`` of it over its own link (Narayanan et al. §4.1); 0 without ``pp``.
    Inter-host when the pipeline group leaves a host, where the stage's ranks on one host (up to
    ``tp·sp·dp``) send at once (:func:`_host_streams`)."""
    if layout.pp == 1:
        return 0.0
    return _send_seconds(arch, layout, cluster, _host_streams(layout.tp * layout.sp * layout.dp, layout.pp, cluster))


def _send_seconds(arch: Architecture, layout: Layout, cluster: Cluster, streams: int) -> float:
    """One rank's share (``1/tp``) of a micro-batch's activation sent to the next stage over the link
    of ``streams`` (:meth:`Cluster.link`)."""
    bandwidth, latency = cluster.link(streams, 2)
    return activation_bytes(arch, layout) / layout.tp / bandwidth + latency


def boundary_sends(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, ...]:
    """Seconds of one send across each pipeline boundary ``r`` (ranks ``r`` and ``(r + 1) % pp``; the
    last is the interleaved schedule's wrap), as :func:`p2p_seconds` prices one, but over the link
    that boundary uses: the network where the two stages' ranks (``tp·sp·dp`` apart, hosts holding
    consecutive ranks) sit on different hosts, with as many streams as the stage has ranks crossing
    (at most a host's devices). pp 4 over 2 hosts of 2 crosses at its middle boundary and at the
    wrap only; dp 3 × pp 2 on hosts of 4 crosses with 2 of the stage's 3 ranks."""
    stride, hosts = layout.tp * layout.sp * layout.dp, cluster.devices_per_host

    def seconds(r: int) -> float:
        first, second = r * stride, (r + 1) % layout.pp * stride
        crossing = sum((first + o) // hosts != (second + o) // hosts for o in range(stride))
        return _send_seconds(arch, layout, cluster, min(crossing, hosts))

    return tuple(seconds(r) for r in range(layout.pp))


def fan_out_bytes(arch: Architecture, layout: Layout) -> float:
    """Bytes of the gradient sums autograd adds in one block's backward on one rank, per
    micro-batch: where a tensor feeds ``k`` kernels, its gradient is the sum of ``k`` (``k - 1``
    additions, each reading two and writing one). ``llama``, as ``models/llama.py`` runs it, per
    token: the normed inputs of ``wq, wk, wv`` (2) and of ``w1, w3`` (1), the block's input and its
    middle ``h`` (the norm and the residual add: 1 each), each RMSNorm's input (``pow`` and the
    product: 1 each), the rotary embedding's ``q`` and ``k`` (the product and the half rotation: 1
    each, ``(h + kv)/t``); ``3·(4h/σ + 3h + (h + kv)/t)`` elements (``σ = t`` under Megatron
    sequence parallelism): the norms' and the rotation's in fp32 (they compute in fp32), the others
    in the residual stream's element (the norms return its dtype). 9 per block; the own-run model's
    backward dispatches 37 (and the final norm's), beside its 39 gradient accumulations. ``gpt``: 0
    (the published runs are priced without them).
    """
    if arch.family == "gpt":
        return 0.0
    s, t, h = layout.seq_len, layout.tp, arch.hidden
    sigma = t if layout.sequence_parallel else 1
    fp32_elements = 2 * h / sigma + (h + arch.kv_width) / t
    residual_elements = 2 * h / sigma + 3 * h
    per_token = 3 * (4 * fp32_elements + layout.precision.residual_bytes * residual_elements)
    return per_token * layout.micro_batch * s / layout.sp


def layer_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    """``(forward, backward, tp_comm)`` seconds of one block for one micro-batch on one rank.

    It depends on the layout's ``seq_len``, ``micro_batch``, ``tp``, ``sp``, ``recompute`` and
    ``precision`` only, and is computed once per such tuple (the layout search asks for it thousands
    of times).

    Forward: the cost model's GEMMs (``b·s/sp`` tokens) and attention core (full ``s``, ``a/(t·sp)``
    heads), :func:`elementwise_bytes` over the memory bandwidth at the size of one ``b·(s/sp)·h``
    activation (:meth:`~loomtrain.planner.cost.Device.memory_rate`), two all-reduces and the all-to-alls.
    Backward: the GEMMs' backward, twice the elementwise traffic and the gradient sums
    (:func:`fan_out_bytes`) at that rate, the same communication, and under
    ``recompute="full"`` the whole forward again (Narayanan et al. §5.1); ``selective`` recomputes
    the attention core only (Korthikanti et al. §5).

    Raises:
        ValueError: ``tp`` (or ``tp·sp``) does not divide the heads, the key/value heads or the MLP.
    """
    block = Layout(seq_len=layout.seq_len, micro_batch=layout.micro_batch, tp=layout.tp, sp=layout.sp,
                   recompute=layout.recompute, precision=layout.precision,
                   overlap_tp_backward=layout.overlap_tp_backward,
                   sequence_parallel=layout.sequence_parallel)  # fmt: skip
    return _layer_seconds(arch, block, cluster)


@functools.lru_cache(maxsize=4096)
def _layer_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    dev, t, b = cluster.compute_device, layout.tp, layout.micro_batch
    gemms = layer_gemms(arch, layout.seq_len // layout.sp, b, t)
    attention, attention_backward = attention_times(arch, layout.seq_len, b, t * layout.sp, dev, waves=True)
    gemm_f = sum(g.seconds(dev, True) for g in gemms) + attention
    gemm_b = sum(g.input_grad().seconds(dev, True) + g.weight_grad().seconds(dev, True) for g in gemms)
    rate = cluster.device.memory_rate(activation_bytes(arch, layout))
    elementwise, sums = elementwise_bytes(arch, layout) / rate, fan_out_bytes(arch, layout) / rate
    all_to_all = all_to_all_seconds(arch, layout, cluster)
    comm = 2 * tp_all_reduce_seconds(arch, layout, cluster) + all_to_all
    forward = gemm_f + elementwise + comm
    tp_backward = all_to_all + tp_backward_seconds(arch, layout, cluster)
    backward = gemm_b + attention_backward + 2 * elementwise + sums + tp_backward
    tp_comm = 2 * comm
    if layout.recompute == "full":
        backward += forward
        tp_comm += comm
    elif layout.recompute == "selective":
        backward += attention
    return forward, backward, tp_comm


def tp_backward_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """Seconds the backward of one block waits for its two tensor-parallel collectives (the input
    gradients of the attention's and the MLP's column-parallel linears, those whose input is the
    whole ``h``): both whole, or with ``layout.overlap_tp_backward`` what each exceeds of the
    weight-gradient GEMMs of its linears, which run meanwhile (Korthikanti et al. 2022 §6)."""
    all_reduce = tp_all_reduce_seconds(arch, layout, cluster)
    if not layout.overlap_tp_backward or layout.tp == 1:
        return 2 * all_reduce
    dev, gemms = cluster.compute_device, layer_gemms(arch, layout.seq_len // layout.sp, layout.micro_batch, layout.tp)
    split = next(i for i, g in enumerate(gemms) if g.k != arch.hidden)  # the attention's output projection
    sides = (gemms[:split], [g for g in gemms[split:] if g.k == arch.hidden])
    return sum(max(0.0, all_reduce - sum(g.weight_grad().seconds(dev, True) for g in side)) for side in sides)


def zero3_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one micro-batch's ZeRO-3 collectives on the stage: the
    parameters all-gathered (``precision.param_bytes`` each) for forward, for the recomputed forward
    and for backward, the gradients reduce-scattered (``grad_bytes``), over the ``shard_ranks``
    (``dp_shard · sp``, ``tp`` apart), one collective per block (each paying the ring's latency).
    ``(0, 0)`` below stage 3."""
    n = layout.shard_ranks
    if layout.zero_stage < 3 or n == 1:
        return 0.0, 0.0
    layers = stage_blocks(arch, layout)
    per_layer = device_params(arch, layout) / layers
    streams, p = _host_streams(layout.tp, n, cluster), layout.precision
    gather = layers * cluster.collective_seconds("all_gather", per_layer * p.param_bytes, n, streams)
    scatter = layers * cluster.collective_seconds("reduce_scatter", per_layer * p.grad_bytes, n, streams)
    gathers_in_backward = 2 if layout.recompute == "full" else 1
    return gather, gathers_in_backward * gather + scatter


def weight_prefetch_seconds(arch: Architecture, layout: Layout, cluster: Cluster, compute: float, gathers: float,
                            backward: bool) -> float:  # fmt: skip
    """Seconds of one pass (forward, or backward when ``backward``) over the stage's blocks under
    ZeRO-3 that gathers one weight matrix ahead (``Layout.zero3_prefetch == "weight"``; under
    ``"block"`` a pass takes ``max(compute, gathers)``): ``compute`` and ``gathers`` are the pass's
    block compute and ZeRO-3 collectives in seconds (:func:`zero3_seconds`). In launch order
    (reversed in backward) weight ``i``'s slot takes
    ``max(c_i, g_{i+1})``, where ``c_i`` is its share of the block's compute (in proportion to its
    GEMM's time) and ``g_i`` its share of the block's collectives (in proportion to its elements),
    plus the first gather, which nothing hides. Where compute and gathers are of one length, the
    weights' unequal sizes (GPT: 3h², h², 4h², 4h²) make each slot wait on the larger of two
    neighbours: 15/12 of either for GPT-3 (the forward of the published ZeRO-3 rows at 4 sequences
    per GPU). The backward is simplified to four reversed slots carrying the block's backward
    compute (with a recomputed forward, if any), its gathers and its reduce-scatter; DeepSpeed
    runs a recomputed forward in launch order first and reduce-scatters in its own buckets.
    The weight granularity prices DeepSpeed's prefetch rule (``Layout.zero3_prefetch``), not a
    figure fitted to the rows."""
    if gathers == 0:
        return compute
    blocks = stage_blocks(arch, layout)
    gemms = layer_gemms(arch, layout.seq_len // layout.sp, layout.micro_batch, layout.tp)
    seconds = [g.seconds(cluster.compute_device, True) for g in gemms]
    elements = [g.n * g.k for g in gemms]
    c = [compute / blocks * t / sum(seconds) for t in seconds]
    g = [gathers / blocks * e / sum(elements) for e in elements]
    if backward:
        c, g = c[::-1], g[::-1]
    slots = sum(max(c[i], g[(i + 1) % len(c)]) for i in range(len(c)))
    # the first weight's gather is exposed; the pass's last weight has no next gather to wait on
    return g[0] + blocks * slots - max(c[-1], g[0]) + c[-1]


def micro_batch_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float, float, float]:
    """``(forward, backward, tp_comm, p2p)`` of one micro-batch on the last pipeline stage, the slowest:
    ``layers_per_chunk · virtual_stages`` blocks, the head and its tensor-parallel collectives
    (:func:`vocab_parallel_seconds`), one send each way; under ZeRO-3 each pass's blocks
    overlap their gathers (:func:`zero3_seconds`): the longer of the two under ``Layout.zero3_prefetch
    == "block"``, :func:`weight_prefetch_seconds` (the head and loss not overlapped) under
    ``"weight"``; their sum where ``cluster.comm_overlap`` is false.

    Raises:
        ValueError: as :func:`layer_seconds` and :func:`~loomtrain.planner.memory.layers_per_chunk`.
    """
    layers = stage_blocks(arch, layout)
    layer_f, layer_b, layer_tp = layer_seconds(arch, layout, cluster)
    head = head_times(arch, layout.seq_len // layout.sp, layout.micro_batch, cluster.compute_device, layout.tp, True)
    send = p2p_seconds(arch, layout, cluster) * layout.virtual_stages
    gather_f, gather_b = zero3_seconds(arch, layout, cluster)
    vocab_f, vocab_b = vocab_parallel_seconds(arch, layout, cluster)
    loss_f, loss_b = loss_seconds(arch, layout, cluster)
    rest_f, rest_b = head.forward + loss_f + vocab_f, head.backward + loss_b + vocab_b
    if not cluster.comm_overlap:  # unhidden: one after the other
        forward, backward = layers * layer_f + rest_f + gather_f, layers * layer_b + rest_b + gather_b
    elif layout.zero3_prefetch == "weight":
        forward = weight_prefetch_seconds(arch, layout, cluster, layers * layer_f, gather_f, False) + rest_f
        backward = weight_prefetch_seconds(arch, layout, cluster, layers * layer_b, gather_b, True) + rest_b
    else:
        forward, backward = max(layers * layer_f + rest_f, gather_f), max(layers * layer_b + rest_b, gather_b)
    forward, backward = forward + send, backward + send
    return forward, backward, layers * layer_tp + vocab_f + vocab_b, 2 * send


def dp_all_reduce_seconds(arch: Architecture, layout: Layout, cluster: Cluster, params: float) -> float:
    """The gradient sync of a step over the ranks that average gradients (``grad_ranks``: ``dp · sp``,
    ``tp`` apart): ZeRO 0, an all-reduce of all of ``params``' gradients; ZeRO 1-2 as
    ``distributed/zero.py`` runs them, block by block:
    the gradients all-reduced (stage 1) or reduce-scattered (stage 2; Rajbhandari et al. 2020 §7) and
    the updated parameters all-gathered before the next forward; ZeRO-3 with ``dp_replicate > 1``
    (HSDP), an all-reduce of the ``1/shard_ranks`` shard over the replicas; 0 otherwise. Each
    collective is priced by :meth:`Cluster.collective_seconds` (measured curves where the spec has them)."""
    grad_bytes = params * layout.precision.grad_bytes
    shard = layout.shard_ranks
    if layout.zero_stage == 3:
        ranks, stride, grad_bytes = layout.dp_replicate, layout.tp * shard, grad_bytes / shard
    else:
        ranks, stride = layout.grad_ranks, layout.tp
    streams = _host_streams(stride, ranks, cluster)
    if layout.zero_stage not in (1, 2):
        return cluster.collective_seconds("all_reduce", grad_bytes, ranks, streams)
    units = stage_blocks(arch, layout)
    reduce = "all_reduce" if layout.zero_stage == 1 else "reduce_scatter"
    per_unit = (grad_bytes / units, params * layout.precision.param_bytes / units)
    ops = zip((reduce, "all_gather"), per_unit, strict=True)
    return units * sum(cluster.collective_seconds(op, n, ranks, streams) for op, n in ops)


def largest_matrix(arch: Architecture, layout: Layout) -> float:
    """Elements of the largest weight matrix on one tensor-parallel rank, ``h · max(f, h) / t``:
    the tensor whose size sets the memory rate of the passes over all parameters."""
    return arch.hidden * max(arch.ffn_hidden, arch.hidden) / layout.tp


# Bytes of an element of the tensors PyTorch's AdamW steps in loomtrain: fp32 parameters or masters,
# their fp32 gradients (ZeRO's zero_layout.master_grad casts them), the two fp32 moments.
OPTIMIZER_ELEMENT_BYTES = 4
# Passes PyTorch's AdamW makes over those elements per parameter (torch/optim/adam.py, decoupled
# weight decay on): weight decay (read, write the weight), lerp_ (read the momentum and the gradient,
# write the momentum), the variance's mul_ (2) and addcmul_ (3), the denominator's sqrt, / and +ε
# (2 each), addcdiv_ (read the weight, the momentum and the denominator, write the weight).
ADAMW_PASSES = 20


def optimizer_bytes_per_param(precision: Precision, fused: bool) -> float:
    """Bytes one AdamW step moves per parameter. Fused (``fused``: apex's FusedAdam, one kernel, as
    Megatron-LM runs it): the parameter, the gradient and the optimizer state read, the parameter
    and the state written, ``2P + G + 2K``. Else PyTorch's AdamW as loomtrain runs it (its for-each
    variant makes the same passes): :data:`ADAMW_PASSES` over fp32 elements whatever the precision
    (it steps fp32 parameters, or fp32 masters with fp32 gradients), 80 bytes; the casts around
    it are :func:`grad_passes_seconds`'. fp32: 28 fused. Without weight decay it would be 72."""
    if fused:
        return 2 * precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes
    return ADAMW_PASSES * OPTIMIZER_ELEMENT_BYTES


def optimizer_seconds(arch: Architecture, layout: Layout, cluster: Cluster, params: float) -> float:
    """The optimizer step over this rank's shard, memory-bound, tensor by tensor (ZeRO keeps each
    tensor's rows): :func:`optimizer_bytes_per_param` per parameter at the optimizer's rate for the
    largest tensor (:meth:`~loomtrain.planner.cost.Device.optimizer_rate`: an MLP matrix, ``h·f/t``
    elements, over the ZeRO shard)."""
    p = layout.precision
    split = layout.shard_ranks if layout.zero_stage >= 1 else 1
    per_param = optimizer_bytes_per_param(p, layout.fused_optimizer)
    element = p.param_bytes if layout.fused_optimizer else OPTIMIZER_ELEMENT_BYTES
    largest = largest_matrix(arch, layout) / split * element
    return params / split * per_param / cluster.device.optimizer_rate(largest)


def grad_passes_seconds(arch: Architecture, layout: Layout, cluster: Cluster, params: float) -> float:
    """Seconds per step one rank spends on the memory-bound passes around the gradient sync, as
    ``distributed/data_parallel.py``, ``zero.py`` and ``clip.py`` run them, at the memory rate of the
    largest tensor (:func:`optimizer_seconds`). Over the ``G = params · grad_bytes`` of the stage's
    gradient: without ZeRO the buckets zeroed (``G``) and, for ``dp · sp > 1``, divided before
    the sum all-reduce (read and write, ``2G``); under ZeRO each unit's gradients copied into the
    rank-major buffer (``2G``) and divided (``2G``). Then clipping over the rank's gradient (``G``,
    or its ``1/shard_ranks`` shard under ZeRO): the norm reads it, the scale reads and writes it
    (``3×``; Megatron-LM and loomtrain clip every step, 1.0 by default). ZeRO's parameter copies: each
    all-gather's own shard packed and the whole parameters unpacked (``2·P/shard_ranks + 2·P``,
    ``P = params · param_bytes``), once per step under stages 1-2, for every gather of every
    micro-batch under stage 3 (:func:`zero3_seconds`' count), where ``layout.zero_gather_copies``
    (loomtrain's ZeRO). A few percent of a CPU step: dp 2 of the own-run model moves 300 MB, 19 ms
    at this machine's calibrated 16 GB/s (in-place passes over 50 MB measured 12-13 ms)."""
    p, n = layout.precision, layout.shard_ranks
    grads = params * p.grad_bytes
    rate = cluster.device.memory_rate(largest_matrix(arch, layout) * p.grad_bytes)
    averaged = 2 * grads if layout.grad_ranks > 1 else 0.0
    if layout.zero_stage == 0:
        return (grads + averaged + 3 * grads) / rate
    gathers = layout.n_micro * (2 + (layout.recompute == "full")) if layout.zero_stage == 3 else 1
    if n == 1 or not layout.zero_gather_copies:
        gathers = 0
    copies = gathers * params * p.param_bytes * (2 / n + 2)
    return (2 * grads + averaged + 3 * grads / n + copies) / rate


def grad_accumulation_seconds(arch: Architecture, layout: Layout, cluster: Cluster, params: float) -> float:
    """Seconds per step one rank spends adding micro-batch gradients into the accumulated ones:
    in-place additions over the ``params`` the stage computes with (whole under every ZeRO stage:
    ``distributed/zero.py`` reduces at the last micro-batch), each reading the accumulated and the
    fresh gradient and writing the sum, ``3 · grad_bytes`` per parameter, memory-bound at the rate of
    the largest tensor (an MLP matrix, ``h·f/t``). ``n_micro`` of them without ZeRO where the
    layout's ``zeroed_grad_buffers`` (autograd adds even the first micro-batch's gradient into the
    zeroed buffer), else ``n_micro - 1`` (the first one is written)."""
    grad_bytes = layout.precision.grad_bytes
    rate = cluster.device.memory_rate(largest_matrix(arch, layout) * grad_bytes)
    additions = layout.n_micro if layout.zeroed_grad_buffers and layout.zero_stage == 0 else layout.n_micro - 1
    return additions * params * 3 * grad_bytes / rate


# The all-reduces of one logged step of loomtrain's trainer over all ranks (metrics.py's step_record:
# the peak memory's maximum and the bytes sent per axis; on a CPU also the gradient-overlap timer's
# totals, profiling.py's overlap_figures: the timer is off on CUDA), beside the loss's mean over the
# gradient ranks (trainer.py's _log_step). Each carries a few numbers.
LOG_WORLD_ALL_REDUCES = 2
LOG_MESSAGE_BYTES = 64


def logging_seconds(layout: Layout, cluster: Cluster) -> float:
    """Seconds per step of loomtrain's logging collectives: every ``layout.log_interval`` steps,
    :data:`LOG_WORLD_ALL_REDUCES` all-reduces over all ranks (one more on a calibrated device, a
    CPU, where gloo runs and the overlap timer is on) and one over the ``grad_ranks``, each of
    :data:`LOG_MESSAGE_BYTES`: latency-bound, :func:`small_all_reduce_seconds` (on this machine's
    gloo 1-2 ms over 2 ranks, 6 ms over 4 on 2 cores; a width-64 model's dp 4 step measured 41 ms
    against 16 ms priced without them). 0 where ``log_interval`` is 0 (the published runs). Not in
    loomtrain's own tokens/s, which times the training step alone."""
    if not layout.log_interval:
        return 0.0
    world_calls = LOG_WORLD_ALL_REDUCES + bool(cluster.device.gemm_curve)
    world = world_calls * small_all_reduce_seconds(layout.gpus, 1, cluster)
    return (world + small_all_reduce_seconds(layout.grad_ranks, layout.tp, cluster)) / layout.log_interval


def small_all_reduce_seconds(ranks: int, stride: int, cluster: Cluster) -> float:
    """Seconds of an all-reduce of :data:`LOG_MESSAGE_BYTES` over ``ranks`` ranks ``stride`` apart:
    the measured curve's smallest message where the spec has one inside a host, else
    ``2·⌈log2 n⌉`` link latencies (a tree's reduce and broadcast, as NCCL runs small messages:
    NCCL 2.4's double binary trees; a ring's ``2(n - 1)`` steps would price 1,024 GPUs 20 ms). 0
    for one rank."""
    if ranks <= 1:
        return 0.0
    streams = _host_streams(stride, ranks, cluster)
    points = cluster.measured_curve("all_reduce", ranks, streams)
    if points:
        return curve_seconds(points, LOG_MESSAGE_BYTES)
    return 2 * math.ceil(math.log2(ranks)) * cluster.link(streams, ranks)[1]


def pipeline_seconds(n_micro: int, forward: float, backward: float, bubble: float) -> float:
    """Seconds of a step's micro-batches on one pipeline of dedicated devices: ``m (t_f + t_b) /
    (1 - bubble)``, the schedule's idle share of the critical path (ranks that share cores:
    :func:`shared_pipeline_seconds`)."""
    return n_micro * (forward + backward) / (1 - bubble)


def shared_pipeline_seconds(arch: Architecture, layout: Layout, cluster: Cluster, forward: float,
                            backward: float) -> float:  # fmt: skip
    """Seconds of a step's micro-batches on one pipeline whose ranks share cores (``core_share < 1``):
    the schedule replayed by :func:`~loomtrain.distributed.pipeline.schedule.shared_core_makespan`
    with ``forward`` and ``backward`` (a micro-batch on a rank, at the shared rate) less their blocking
    sends, each boundary's send (:func:`boundary_sends`) a delay that overlaps compute, as
    loomtrain's ``isend``s with receives posted ahead run (``pipeline/p2p.py``), and a rank's idle
    time lent to the ranks it shares cores with: every rank's, as on one machine whose cores all
    ranks share (an emulated cluster's hosts are namespaces of one machine; separate hosts would
    each lend only their own cores, which this does not model). Measured on 2 emulated hosts of 2
    ranks over a 100 Mbit/s link (docs/planner.md "Emulated cluster"): the blocking form priced
    pp 4 +25 % and pp 2 × dp 2 +44 %; this replay priced them −9 % and −14 % in the rerun."""
    send = p2p_seconds(arch, layout, cluster) * layout.virtual_stages
    schedule = build_schedule(layout.schedule, layout.pp, layout.n_micro, layout.virtual_stages)
    return shared_core_makespan(schedule, layout.pp, layout.virtual_stages, forward - send, backward - send,
                                boundary_sends(arch, layout, cluster), cluster.core_share)  # fmt: skip


def step_time(arch: Architecture, layout: Layout, cluster: Cluster) -> StepTime:
    """Seconds of one training step of ``arch`` with ``layout`` on ``cluster`` (module docstring).

    The data-parallel all-reduce overlaps the last micro-batch's backward on the stage (buckets of
    finished gradients go out while earlier layers still compute); what exceeds it is exposed. All
    of it is, where ``cluster.comm_overlap`` or ``layout.overlap_grad_reduce`` is false.

    Raises:
        ValueError: as :func:`micro_batch_seconds`.
        ScheduleError: a schedule configuration :func:`theoretical_bubble` refuses.
    """
    forward, backward, tp_comm, p2p = micro_batch_seconds(arch, layout, cluster)
    params = device_params(arch, layout)
    accumulation = grad_accumulation_seconds(arch, layout, cluster, params)
    accumulating = backward + accumulation / layout.n_micro
    bubble = theoretical_bubble(
        layout.schedule, layout.pp, layout.n_micro, layout.virtual_stages, forward, accumulating
    )
    dp = dp_all_reduce_seconds(arch, layout, cluster, params)
    if layout.pp > 1 and cluster.core_share < 1:
        pipeline = shared_pipeline_seconds(arch, layout, cluster, forward, accumulating)
    else:
        pipeline = pipeline_seconds(layout.n_micro, forward, accumulating, bubble)
    return StepTime(
        forward=forward,
        backward=backward,
        tp_comm=tp_comm,
        p2p=p2p,
        pipeline=pipeline,
        bubble=bubble,
        dp_exposed=max(0.0, dp - backward) if cluster.comm_overlap and layout.overlap_grad_reduce else dp,
        optimizer=optimizer_seconds(arch, layout, cluster, params),
        zero3_comm=sum(zero3_seconds(arch, layout, cluster)),
        grad_accumulation=accumulation,
        grad_passes=grad_passes_seconds(arch, layout, cluster, params),
        logging=logging_seconds(layout, cluster),
    )


def flops_per_step(arch: Architecture, layout: Layout) -> float:
    """FLOPs of one step over all replicas, recomputation included (what achieved FLOP/s counts).

    Global batch ``B = dp · n_micro · micro_batch`` sequences of ``s`` tokens. ``gpt``: Narayanan
    et al. (SC 2021) §5.1 eq. (3), ``96 B s l h² (1 + s/(6h) + V/(16 l h))`` under full
    recomputation, ``72 B s l h² (1 + s/(6h)) + 6 B s h V`` otherwise (no extra forward). ``llama``:
    ``models/flops.py``'s count (``3 ×`` the forward's matmuls, both attention products over the full
    square), plus one more forward of the blocks under full recomputation.
    """
    batch = layout.dp * layout.n_micro * layout.micro_batch
    s, h, n_layers, vocab = layout.seq_len, arch.hidden, arch.n_layers, arch.vocab_size
    passes = 4 if layout.recompute == "full" else 3
    if arch.family == "gpt":
        return passes * 24 * batch * s * n_layers * h * h * (1 + s / (6 * h)) + 6 * batch * s * h * vocab
    block = 2 * h * (2 * h + 2 * arch.kv_width) + 6 * h * arch.ffn_hidden + 4 * s * h
    return batch * s * (passes * n_layers * block + 3 * 2 * h * vocab)


def tflops_per_gpu(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """Predicted achieved TFLOP/s per GPU: :func:`flops_per_step` over :func:`step_time` and the
    layout's GPUs (Narayanan et al.'s Table 1 metric).

    Raises:
        ValueError, ScheduleError: as :func:`step_time`.
    """
    return flops_per_step(arch, layout) / (step_time(arch, layout, cluster).total * layout.gpus) / 1e12
