"""Seconds per training step of a parallel layout on a cluster: the time half of the planner's cost model.

Arithmetic on an :class:`~loomtrain.planner.arch.Architecture`, a
:class:`~loomtrain.planner.memory.Layout` and a :class:`Cluster`; nothing is built or run. One step of
one pipeline (every data-parallel replica runs the same) is

    step = m · (t_f + t_b) / (1 - bubble) + exposed data-parallel all-reduce + optimizer step

with ``m`` micro-batches, ``t_f`` and ``t_b`` the forward and backward of one micro-batch on the
slowest pipeline stage (its GEMMs, its memory-bound elementwise kernels, its tensor-parallel
all-reduces and its point-to-point sends), and ``bubble`` the schedule's idle share from
:func:`loomtrain.distributed.pipeline.schedule.theoretical_bubble`. Sources:

- GEMM time: the math-or-memory bound of NVIDIA's "Matrix Multiplication Background User's Guide"
  (DU-09799-001) ch. 2, as :class:`~loomtrain.distributed.pipeline.emulated.Kernel` computes it, with
  the same guide's wave quantization (ch. 5 "Dimension Quantization Effects": a GEMM runs in whole
  waves of one ``256 × 128`` output tile per SM) and a ceiling of the largest rate cuBLAS reaches on
  the device, measured (``Cluster.gemm_efficiency``). The efficiency of a GEMM therefore depends on
  its size: small or odd-sized GEMMs lose to partial waves and to memory traffic.
- Backward: two GEMMs per forward GEMM, ``dX = dY Wᵀ`` and ``dW = Xᵀ dY`` (Kaplan et al. 2020 §2.1);
  full recomputation runs each block's forward again in backward (Narayanan et al. SC 2021 §5.1:
  the ``96`` instead of ``72`` in their FLOP count).
- Tensor parallelism: Megatron's two all-reduces of ``b·s·h`` per block in forward and two in
  backward (Shoeybi et al. 2019 §3, Fig. 4; Narayanan et al. §3.3), ring all-reduce moving
  ``2(t - 1)/t`` of the buffer per rank (Patarasuk & Yuan 2009; NCCL's busbw convention,
  nccl-tests doc/PERFORMANCE.md).
- Pipeline point-to-point: one activation ``b·s·h`` forward and one gradient backward per stage
  boundary, split over the ``t`` ranks' own network cards (Narayanan et al. §4.1 scatter/gather).
- Data parallelism: a ring all-reduce of the gradients, overlapped with the last micro-batch's
  backward (the only backward after which every gradient is final), the rest exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loomtrain.distributed.pipeline.emulated import BYTES_BF16, DEVICES, Device, Kernel
from loomtrain.distributed.pipeline.schedule import theoretical_bubble
from loomtrain.planner.arch import Architecture
from loomtrain.planner.memory import Layout, device_params, layers_per_chunk

# Output tile of one thread block in NVIDIA's guide (DU-09799-001 ch. 5, its running example on A100).
TILE_M, TILE_N = 256, 128
# Rows and columns of one tensor-core MMA on A100 and H100 for 16-bit inputs (m16n8k16: 16 × 8; the
# guide's ch. 4 advises multiples of 8, of 64 for best efficiency): the padding of a dimension below a tile.
MMA_GRAIN = 16


@dataclass(frozen=True)
class Cluster:
    """Hosts of identical devices joined by one network.

    Attributes:
        device: the GPU (:class:`~loomtrain.distributed.pipeline.emulated.Device`: dense 16-bit peak,
            FLOP/s, and HBM bandwidth, bytes/s); its ``efficiency`` is ignored here.
        sms: streaming multiprocessors per device (the waves of :func:`gemm_seconds`).
        gemm_efficiency: the share of the peak the best-shaped large GEMM reaches (measured).
        devices_per_host: GPUs joined by the intra-host link.
        intra_bytes_per_s, inter_bytes_per_s: link bandwidth per GPU and direction, bytes/s, inside a
            host and between hosts (per GPU: each GPU has its own network card).
        link_efficiency: the share of a link's bandwidth a large collective reaches (busbw / link).
        intra_latency_s, inter_latency_s: seconds per ring step of a collective, or per send.
        name, source: label, and where the figures come from.

    Raises:
        ValueError: a size or bandwidth not positive, or an efficiency outside (0, 1].
    """

    device: Device
    sms: int
    gemm_efficiency: float
    devices_per_host: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    link_efficiency: float
    intra_latency_s: float
    inter_latency_s: float
    name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("sms", "devices_per_host", "intra_bytes_per_s", "inter_bytes_per_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Cluster.{field}={getattr(self, field)} must be positive")
        for field in ("gemm_efficiency", "link_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Cluster.{field}={getattr(self, field)} must be in (0, 1]")

    def link(self, spans_hosts: bool) -> tuple[float, float]:
        """``(achievable bytes/s, latency s)`` of the link a group uses: inter-host if it spans hosts."""
        if spans_hosts:
            return self.inter_bytes_per_s * self.link_efficiency, self.inter_latency_s
        return self.intra_bytes_per_s * self.link_efficiency, self.intra_latency_s


# DGX A100 (NVIDIA DGX A100 System Architecture whitepaper, and the A100 datasheet): 8 A100 SXM per
# host, 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper), third-generation NVLink
# 600 GB/s per GPU in both directions together (300 GB/s each way) through NVSwitch, eight
# 200 Gb/s HDR InfiniBand cards (25 GB/s per GPU each way). GEMM ceiling: 267.9 of 312 TFLOP/s for
# bf16 (85.9 %), the "Maximum Achievable Matmul FLOPS" table of Bekman's ml-engineering
# (compute/accelerator/README.md, A100 SXM, CUDA 12.1). link_efficiency and the latencies are
# assumptions (see docs/planner.md "Time model"), not measurements.
DGX_A100 = Cluster(
    device=DEVICES["a100"],
    sms=108,
    gemm_efficiency=267.9 / 312.0,
    devices_per_host=8,
    intra_bytes_per_s=300e9,
    inter_bytes_per_s=25e9,
    link_efficiency=0.8,
    intra_latency_s=5e-6,
    inter_latency_s=10e-6,
    name="dgx-a100",
    source="DGX A100 whitepaper; A100 datasheet; ml-engineering MAMF table (A100 SXM 267.9 TFLOP/s bf16)",
)


def _round_up(value: int, grain: int) -> int:
    return math.ceil(value / grain) * grain


def gemm_seconds(m: int, k: int, n: int, cluster: Cluster, batch: int = 1) -> float:
    """Seconds of ``batch`` independent ``m × k`` by ``k × n`` 16-bit products in one kernel.

    The ``ceil(m/256)·ceil(n/128)·batch`` output tiles run in whole waves of ``cluster.sms`` tiles
    (NVIDIA DU-09799-001 ch. 5), so the math time is that of the padded FLOPs,
    ``2k · 256 · 128 · sms · waves``, at ``peak · gemm_efficiency``; a dimension smaller than its tile
    gets a tile of its own size rounded up to the 16-element tensor-core grain (cuBLAS keeps smaller
    tile configurations for such shapes). The memory time is the bf16 operands and result over HBM
    bandwidth; the larger wins (:class:`Kernel`).

    Raises:
        ValueError: a dimension or ``batch`` below 1.
    """
    if min(m, k, n, batch) < 1:
        raise ValueError(f"GEMM m={m} k={k} n={n} batch={batch}: every size must be at least 1")
    tile_m, tile_n = min(TILE_M, _round_up(m, MMA_GRAIN)), min(TILE_N, _round_up(n, MMA_GRAIN))
    tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * batch
    waves = math.ceil(tiles / cluster.sms)
    padded_flops = 2 * k * tile_m * tile_n * cluster.sms * waves
    traffic = BYTES_BF16 * batch * (m * k + k * n + m * n)
    dev = replace(cluster.device, efficiency=cluster.gemm_efficiency)
    return Kernel(padded_flops, traffic).seconds(dev)


def layer_gemms(arch: Architecture, layout: Layout) -> list[tuple[int, int, int, int]]:
    """The forward GEMMs of one block on one tensor-parallel rank, as ``(m, k, n, batch)``.

    ``T = b·s`` tokens of the micro-batch; ``q = h/t`` this rank's query width, ``kv`` its key and
    value width, ``f`` the MLP width, ``d`` the head width. QKV ``(T, h, q + 2kv)``; scores
    ``Q Kᵀ`` ``(s, d, s)`` and their product with ``V`` ``(s, s, d)`` for each of ``b·a/t`` heads;
    output projection ``(T, q, h)``; MLP ``(T, h, f/t)`` and ``(T, f/t, h)`` for ``gpt``, SwiGLU's
    ``w1`` and ``w3`` as one ``(T, h, 2f/t)`` and ``w2`` ``(T, f/t, h)`` for ``llama``. Their
    FLOPs sum to ``models/flops.py``'s forward per token times ``T`` (without the head).

    Raises:
        ValueError: ``tp`` does not divide the heads, the key/value heads or ``ffn_hidden``.
    """
    t, s, d = layout.tp, layout.seq_len, arch.head_dim
    if arch.n_kv_heads % t or arch.ffn_hidden % t:
        raise ValueError(f"Layout.tp={t} must divide n_kv_heads={arch.n_kv_heads} and ffn_hidden={arch.ffn_hidden}")
    tokens, h, f = layout.micro_batch * s, arch.hidden, arch.ffn_hidden // t
    q, kv, heads = h // t, arch.kv_width // t, layout.micro_batch * arch.n_heads // t
    mlp_in = 2 * f if arch.family == "llama" else f
    return [
        (tokens, h, q + 2 * kv, 1),
        (s, d, s, heads),
        (s, s, d, heads),
        (tokens, q, h, 1),
        (tokens, h, mlp_in, 1),
        (tokens, f, h, 1),
    ]


def gemm_pass_seconds(gemms: list[tuple[int, int, int, int]], cluster: Cluster) -> tuple[float, float]:
    """``(forward, backward)`` seconds of a list of ``(m, k, n, batch)`` GEMMs: backward runs
    ``dX = dY Wᵀ`` as ``(m, n, k)`` and ``dW = Xᵀ dY`` as ``(k, m, n)`` for each (Kaplan et al. §2.1)."""
    forward = sum(gemm_seconds(m, k, n, cluster, batch) for m, k, n, batch in gemms)
    backward = sum(
        gemm_seconds(m, n, k, cluster, batch) + gemm_seconds(k, m, n, cluster, batch) for m, k, n, batch in gemms
    )
    return forward, backward


def elementwise_bytes(arch: Architecture, layout: Layout) -> float:
    """HBM bytes the non-GEMM kernels of one block's forward move on one rank, per micro-batch.

    Each kernel reads its inputs and writes its output once, 16-bit elements, 1-byte dropout masks
    (the fused kernels of Megatron-LM as Korthikanti et al. 2022 §4.1 list their tensors). Per
    token, ``gpt``: two LayerNorms (``2·4h``), two bias-dropout-adds (``2·7h``: two inputs, an
    output, a mask), bias-GeLU (``16h/t``: read and write ``4h/t``), softmax (``4as/t``) and its
    dropout (``5as/t``). ``llama``: two RMSNorms (``2·4h``), two residual adds (``2·6h``), SiLU and
    the product (``2·6f/t``); the fused attention kernel's scores never reach memory. Backward moves
    twice as much (it reads the saved input and the output gradient, writes the input gradient).
    """
    s, t, h, a = layout.seq_len, layout.tp, arch.hidden, arch.n_heads
    if arch.family == "gpt":
        per_token = 8 * h + 14 * h + 16 * h / t + 9 * a * s / t
    else:
        per_token = 8 * h + 12 * h + 12 * arch.ffn_hidden / t
    return per_token * layout.micro_batch * s


def ring_all_reduce_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks``: each rank sends ``2(n - 1)/n`` of the
    buffer over ``2(n - 1)`` steps (Patarasuk & Yuan 2009). 0 for one rank."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps / ranks * nbytes / bandwidth + steps * latency


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by part (all on the slowest pipeline stage).

    Attributes:
        forward, backward: one micro-batch's forward and backward (recomputation included), with
            their GEMMs, elementwise kernels, tensor-parallel all-reduces and point-to-point sends.
        tp_comm: the tensor-parallel all-reduces inside ``forward + backward``.
        p2p: the point-to-point sends inside ``forward + backward``.
        pipeline: ``m (forward + backward) / (1 - bubble)``.
        bubble: the schedule's idle share of ``pipeline``.
        dp_exposed: the data-parallel all-reduce not hidden behind the last backward.
        optimizer: the optimizer step (memory-bound: every state read and written once).
    """

    forward: float
    backward: float
    tp_comm: float
    p2p: float
    pipeline: float
    bubble: float
    dp_exposed: float
    optimizer: float

    @property
    def total(self) -> float:
        """Seconds per step."""
        return self.pipeline + self.dp_exposed + self.optimizer


def tp_all_reduce_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """One of Megatron's per-block tensor-parallel all-reduces: ``b·s·h`` activations of
    ``precision.activation_bytes`` over the ``tp`` ranks (inter-host when ``tp`` exceeds a host)."""
    nbytes = layout.micro_batch * layout.seq_len * arch.hidden * layout.precision.activation_bytes
    bandwidth, latency = cluster.link(layout.tp > cluster.devices_per_host)
    return ring_all_reduce_seconds(nbytes, layout.tp, bandwidth, latency)


def p2p_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> float:
    """One stage-to-stage send of a micro-batch's ``b·s·h`` activation (or its gradient), each of the
    ``tp`` ranks sending ``1/t`` of it over its own link (Narayanan et al. §4.1); 0 without ``pp``.
    Inter-host when the model-parallel ranks of a replica outgrow a host."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.micro_batch * layout.seq_len * arch.hidden * layout.precision.activation_bytes / layout.tp
    bandwidth, latency = cluster.link(layout.tp * layout.dp * layout.pp > cluster.devices_per_host)
    return nbytes / bandwidth + latency


def layer_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float, float]:
    """``(forward, backward, tp_comm)`` seconds of one block for one micro-batch on one rank.

    Forward: :func:`layer_gemms`, :func:`elementwise_bytes` over HBM bandwidth, two all-reduces.
    Backward: the GEMMs' backward, twice the elementwise traffic, two all-reduces, and under
    ``recompute="full"`` the whole forward again (Narayanan et al. §5.1); ``selective`` recomputes
    the attention core (scores and their product with ``V``) only (Korthikanti et al. §5).
    """
    gemms = layer_gemms(arch, layout)
    gemm_f, gemm_b = gemm_pass_seconds(gemms, cluster)
    elementwise = elementwise_bytes(arch, layout) / cluster.device.memory_bytes_per_s
    all_reduce = tp_all_reduce_seconds(arch, layout, cluster)
    forward = gemm_f + elementwise + 2 * all_reduce
    backward = gemm_b + 2 * elementwise + 2 * all_reduce
    tp_comm = 4 * all_reduce
    if layout.recompute == "full":
        backward += forward
        tp_comm += 2 * all_reduce
    elif layout.recompute == "selective":
        backward += gemm_pass_seconds(gemms[1:3], cluster)[0]
    return forward, backward, tp_comm


def head_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """``(forward, backward)`` of the output head, ``(b·s, h, V/t)`` (vocabulary-parallel), never recomputed."""
    tokens = layout.micro_batch * layout.seq_len
    return gemm_pass_seconds([(tokens, arch.hidden, math.ceil(arch.vocab_size / layout.tp), 1)], cluster)


def micro_batch_seconds(arch: Architecture, layout: Layout, cluster: Cluster) -> tuple[float, float, float, float]:
    """``(forward, backward, tp_comm, p2p)`` of one micro-batch on the last pipeline stage, the slowest:
    ``layers_per_chunk · virtual_stages`` blocks, the head, and one send each way.

    Raises:
        ValueError: as :func:`layer_gemms` and :func:`~loomtrain.planner.memory.layers_per_chunk`.
    """
    layers = layers_per_chunk(arch, layout) * layout.virtual_stages
    layer_f, layer_b, layer_tp = layer_seconds(arch, layout, cluster)
    head_f, head_b = head_seconds(arch, layout, cluster)
    send = p2p_seconds(arch, layout, cluster) * layout.virtual_stages
    forward = layers * layer_f + head_f + send
    backward = layers * layer_b + head_b + send
    return forward, backward, layers * layer_tp, 2 * send


def dp_all_reduce_seconds(arch: Architecture, layout: Layout, cluster: Cluster, params: float) -> float:
    """The gradient all-reduce (ZeRO 1-2: reduce-scatter plus all-gather, the same volume) of
    ``params`` elements of ``precision.grad_bytes`` over ``dp`` ranks, strided by ``tp``."""
    bandwidth, latency = cluster.link(layout.tp * layout.dp > cluster.devices_per_host)
    return ring_all_reduce_seconds(params * layout.precision.grad_bytes, layout.dp, bandwidth, latency)


def optimizer_seconds(layout: Layout, cluster: Cluster, params: float) -> float:
    """The optimizer step over this rank's shard, memory-bound: parameters, gradients and optimizer
    states read, parameters and optimizer states written, once each."""
    p = layout.precision
    shard = params / (layout.dp if layout.zero_stage >= 1 else 1)
    per_param = 2 * p.param_bytes + p.grad_bytes + 2 * p.optimizer_bytes
    return shard * per_param / cluster.device.memory_bytes_per_s


def _check_modelled(layout: Layout) -> None:
    unmodelled = {
        "sp": layout.sp > 1,
        "sequence_parallel": layout.sequence_parallel,
        "zero_stage": layout.zero_stage == 3,
    }
    named = [name for name, on in unmodelled.items() if on]
    if named:
        raise ValueError(
            f"Layout.{', Layout.'.join(named)}: not in the time model yet (Ulysses sp, Megatron sequence "
            "parallelism and ZeRO-3 parameter gathers); use sp=1, sequence_parallel=False, zero_stage<=2"
        )


def step_time(arch: Architecture, layout: Layout, cluster: Cluster) -> StepTime:
    """Seconds of one training step of ``arch`` with ``layout`` on ``cluster`` (module docstring).

    The data-parallel all-reduce overlaps the last micro-batch's backward on the stage (buckets of
    finished gradients go out while earlier layers still compute); what exceeds it is exposed.

    Raises:
        ValueError: an unmodelled layout (Ulysses ``sp``, Megatron sequence parallelism, ZeRO-3), or
            as :func:`micro_batch_seconds`.
        ScheduleError: a schedule configuration :func:`theoretical_bubble` refuses.
    """
    _check_modelled(layout)
    forward, backward, tp_comm, p2p = micro_batch_seconds(arch, layout, cluster)
    bubble = theoretical_bubble(layout.schedule, layout.pp, layout.n_micro, layout.virtual_stages, forward, backward)
    params = device_params(arch, layout)
    dp = dp_all_reduce_seconds(arch, layout, cluster, params)
    return StepTime(
        forward=forward,
        backward=backward,
        tp_comm=tp_comm,
        p2p=p2p,
        pipeline=layout.n_micro * (forward + backward) / (1 - bubble),
        bubble=bubble,
        dp_exposed=max(0.0, dp - backward),
        optimizer=optimizer_seconds(layout, cluster, params),
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
    ``dp · tp · pp`` GPUs (Narayanan et al.'s Table 1 metric).

    Raises:
        ValueError, ScheduleError: as :func:`step_time`.
    """
    gpus = layout.dp * layout.tp * layout.pp
    return flops_per_step(arch, layout) / (step_time(arch, layout, cluster).total * gpus) / 1e12
