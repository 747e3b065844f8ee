"""The one layer cost model of loomtrain: devices, kernels, and the GEMMs and attention of a transformer block.

Both users price work with it: the emulated pipeline of ``--simulate.device``
(``distributed/pipeline/emulated.py``: its stages wait the time given here) and the planner's time
model (``planner/time.py``: a whole training step). Pure arithmetic on an
:class:`~loomtrain.planner.arch.Architecture` (or a :class:`~loomtrain.config.ModelConfig`, read by field
name); nothing here builds a model.

Kernel time. A kernel of ``flops`` FLOP moving ``bytes`` bytes takes
``max(flops / (peak · efficiency), bytes / bandwidth)``: the math-or-memory bound of NVIDIA's "Matrix
Multiplication Background User's Guide" (DU-09799-001, ch. 2 "Math and Memory Bounds"). A GEMM
``M × K`` by ``K × N`` is ``2 M K N`` FLOP and ``2 (M K + K N + M N)`` bytes in bf16. ``efficiency`` is
the device's (1.0 in the device table: the bound itself). With ``waves=True`` a GEMM also pays the same
guide's wave quantization (ch. 5 "Dimension Quantization Effects"): its ``256 × 128`` output tiles run in
whole waves of one tile per SM, so the math time is that of the padded FLOPs (a dimension below its
tile gets a tile of its own size, rounded up to the 16-element tensor-core grain). The emulated
pipeline prices the bound alone; the planner adds waves and a measured efficiency ceiling.

A block on one tensor-parallel rank (``t``), ``T = b·s`` tokens, width ``h``, query width ``q = h/t``,
key/value width ``kv`` (grouped-query attention, ``/t``), MLP width ``f/t``, the weight GEMMs the
implementation launches:

- ``llama`` (loomtrain's :class:`~loomtrain.models.llama.TransformerBlock`: one ``nn.Linear`` each):
  ``wq`` ``(T, h, q)``, ``wk`` and ``wv`` ``(T, h, kv)``, ``wo`` ``(T, q, h)``, SwiGLU ``w1`` and ``w3``
  ``(T, h, f)``, ``w2`` ``(T, f, h)``; attention is one fused kernel (``scaled_dot_product_attention``,
  FlashAttention: Dao et al. 2022, the ``s × s`` scores never reach memory);
- ``gpt`` (Megatron-LM as Narayanan et al. SC 2021 ran it): fused QKV ``(T, h, 3q)``, output
  ``(T, q, h)``, MLP ``(T, h, f)`` and ``(T, f, h)``; attention is two batched GEMMs per head, scores
  ``Q Kᵀ`` ``(s, d, s)`` and their product with ``V`` ``(s, s, d)``, the scores written to memory
  (no FlashAttention in 2021; the memory model's ``5as/h`` term of Korthikanti et al. says the same).

Both attention forms count ``Q Kᵀ`` and ``P V`` over the full square, as ``models/flops.py`` does.
Backward of a weight GEMM ``Y = X W`` is two GEMMs of the forward's FLOPs (Kaplan et al. 2020 §2.1):
``dX = dY Wᵀ`` (input gradient, a zero-bubble ``B``) and ``dW = Xᵀ dY`` (weight gradient, ``W``).
Attention's backward is all input gradient: twice its forward FLOPs, reading ``Q``, ``K``, ``V``, the
output and its gradient and writing ``dQ``, ``dK``, ``dV`` when fused; two GEMMs per forward GEMM when not.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from loomtrain.hardware import GPU_PEAKS
from loomtrain.planner.arch import Architecture, from_model_config

BYTES_BF16 = 2
# Output tile of one thread block in NVIDIA's guide (DU-09799-001 ch. 5, its running example on A100).
TILE_M, TILE_N = 256, 128
# Rows and columns of one tensor-core MMA on A100 and H100 for 16-bit inputs (m16n8k16; the guide's
# ch. 4 advises multiples of 8): the padding of a dimension smaller than a tile.
MMA_GRAIN = 16
GIB = 2**30


@dataclass(frozen=True)
class Device:
    """A GPU kind: what ``--simulate.device`` emulates and what a cluster spec's hosts hold.

    Attributes:
        name: the table key (``a100``, ``h100``).
        peak_flops_per_s: dense bf16 tensor FLOP/s (datasheet).
        memory_bytes_per_s: HBM bandwidth, bytes/s (datasheet).
        efficiency: share of the peak a math-bound kernel reaches (1.0: the roofline itself).
        source: where the figures come from.
        sms: streaming multiprocessors (the waves of a GEMM); 0 when unknown.
        memory_bytes: HBM capacity, bytes.
        gpu_name: the name :data:`loomtrain.hardware.GPU_PEAKS` knows the GPU by (peaks per dtype).
        mamf_flops_per_s: the largest bf16 GEMM rate measured on the device (0: not measured).
        element_bytes: bytes per element of the dtype the device computes in (2: bf16; a calibrated
            CPU: 4, fp32).
        gemm_curve: measured ``(flops, flop_per_s)`` points of GEMMs by size, sorted by FLOPs (a
            calibrated device, ``planner/calibrate.py``); empty: the roofline prices GEMMs.
        memory_curve: measured ``(tensor bytes, bytes/s)`` points of eager elementwise kernels by
            the size of the tensors they stream, sorted by size (a calibrated CPU: a 1 MiB tensor
            stays in cache, a 16 MiB one does not); empty: ``memory_bytes_per_s`` at every size.
        attention_curve: measured ``(flops, flop_per_s)`` points of the fused attention kernel,
            forward and backward together, by the FLOPs of one head of one sequence as
            :func:`attention_kernels` counts them (its rate follows the sequence length, not the
            number of heads); a calibrated CPU, whose attention kernel runs at half its GEMM rate
            or less. Empty: the roofline prices it.
        optimizer_curve: measured ``(tensor bytes, bytes/s)`` points of PyTorch's AdamW step by the
            size of the parameter tensors it updates, bytes counted as
            :func:`~loomtrain.planner.time.optimizer_bytes_per_param` counts them (a calibrated CPU,
            whose separate passes over one tensor meet it in cache after the first); empty:
            ``memory_curve``'s rate.
    """

    name: str
    peak_flops_per_s: float
    memory_bytes_per_s: float
    efficiency: float = 1.0
    source: str = ""
    sms: int = 0
    memory_bytes: float = 0.0
    gpu_name: str = ""
    mamf_flops_per_s: float = 0.0
    element_bytes: int = BYTES_BF16
    gemm_curve: tuple[tuple[float, float], ...] = ()
    memory_curve: tuple[tuple[float, float], ...] = ()
    attention_curve: tuple[tuple[float, float], ...] = ()
    optimizer_curve: tuple[tuple[float, float], ...] = ()

    def gemm_rate(self, flops: float) -> float:
        """FLOP/s of a kernel of ``flops`` FLOP: the measured curve interpolated linearly in
        ``log(flops)`` (held flat beyond its ends) times ``efficiency``; without a curve, the peak times
        ``efficiency``."""
        if not self.gemm_curve:
            return self.peak_flops_per_s * self.efficiency
        return log_interpolate(self.gemm_curve, flops) * self.efficiency

    def memory_rate(self, tensor_bytes: float) -> float:
        """Bytes/s of elementwise kernels over tensors of ``tensor_bytes``: the measured curve
        interpolated linearly in ``log(bytes)`` (flat beyond its ends); without one, ``memory_bytes_per_s``."""
        return log_interpolate(self.memory_curve, tensor_bytes) if self.memory_curve else self.memory_bytes_per_s

    def optimizer_rate(self, tensor_bytes: float) -> float:
        """Bytes/s of the optimizer step over parameter tensors of ``tensor_bytes``: the measured
        ``optimizer_curve`` interpolated as :meth:`memory_rate` interpolates; without one, :meth:`memory_rate`."""
        if not self.optimizer_curve:
            return self.memory_rate(tensor_bytes)
        return log_interpolate(self.optimizer_curve, tensor_bytes)

    def peak(self, dtype: str) -> float:
        """Dense datasheet FLOP/s for ``dtype`` (``bf16``, ``fp16``, ``tf32``, ``fp32``), from
        :data:`loomtrain.hardware.GPU_PEAKS`, the table MFU figures use.

        Raises:
            ValueError: an unknown dtype, or a device not in that table.
        """
        peaks = dict(GPU_PEAKS).get(self.gpu_name)
        if peaks is None or dtype not in peaks._fields:
            raise ValueError(f"device {self.name!r}: no datasheet peak for dtype={dtype!r} (bf16, fp16, tf32, fp32)")
        return getattr(peaks, dtype) * 1e12


def log_interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """The ``y`` of sorted ``(x, y)`` points at ``x``, linear in ``log(x)`` between points and held
    flat beyond the ends (a measured rate curve, read between its measured sizes)."""
    xs = [math.log(p) for p, _ in curve]
    at = math.log(max(x, 1.0))
    i = min(max(bisect.bisect_left(xs, at), 1), len(xs) - 1)
    y0, y1 = curve[i - 1][1], curve[i][1]
    share = min(max((at - xs[i - 1]) / ((xs[i] - xs[i - 1]) or 1.0), 0.0), 1.0)
    return y0 + share * (y1 - y0)


def _datasheet_peak(gpu_name: str) -> float:
    return dict(GPU_PEAKS)[gpu_name].bf16 * 1e12


# Peaks from hardware.GPU_PEAKS (the vendors' datasheets, dense: half the sparse figure). SMs: the
# NVIDIA A100 Tensor Core GPU Architecture whitepaper (108) and the H100 whitepaper (SXM5: 132).
# MAMF: the "Maximum Achievable Matmul FLOPS" table of S. Bekman's Machine Learning Engineering
# (github.com/stas00/ml-engineering, compute/accelerator/README.md; CUDA 12.1): A100 SXM 267.9,
# H100 SXM 792.1 TFLOP/s bf16. The A100's elementwise rate is measured, not the datasheet's: the
# scale kernel (one read, one write, as most of a block's elementwise kernels) of RRZE-HPC's
# gpu-benches gpu-stream on an A100 SXM4 80GB, 1,737 GB/s (85 % of 2,039; its triad 1,794, read
# 1,776), one figure at every size (github.com/RRZE-HPC/gpu-benches, gpu-stream/a100_80.txt).
DEVICES: dict[str, Device] = {
    "a100": Device("a100", _datasheet_peak("A100"), 2.039e12,
                   source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOP/s dense, 2,039 GB/s; "
                          "elementwise 1,737 GB/s measured (RRZE-HPC gpu-benches gpu-stream, scale)",
                   sms=108, memory_bytes=80 * GIB, gpu_name="A100", mamf_flops_per_s=267.9e12,
                   memory_curve=((float(GIB), 1.737e12),)),
    "h100": Device("h100", _datasheet_peak("H100"), 3.35e12,
                   source="NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 989.4 TFLOP/s dense, 3.35 TB/s",
                   sms=132, memory_bytes=80 * GIB, gpu_name="H100", mamf_flops_per_s=792.1e12),
}  # fmt: skip


def device(name: str, field: str = "simulate.device") -> Device:
    """The device called ``name`` (case-insensitive) in :data:`DEVICES`.

    Raises:
        ValueError: an unknown name; the message names ``field`` and lists the known ones.
    """
    found = DEVICES.get(str(name).lower())
    if found is None:
        raise ValueError(f"{field}={name!r} is unknown; choose one of {', '.join(DEVICES)}")
    return found


@dataclass(frozen=True)
class Kernel:
    """Work of one kernel: ``flops`` FLOP, ``bytes`` bytes of memory traffic."""

    flops: float
    bytes: float

    def seconds(self, dev: Device) -> float:
        """The math-or-memory bound of this kernel on ``dev``, in seconds."""
        return max(self.flops / dev.gemm_rate(self.flops), self.bytes / dev.memory_bytes_per_s)


def _round_up(value: int, grain: int) -> int:
    return math.ceil(value / grain) * grain


@dataclass(frozen=True)
class Gemm:
    """``batch`` independent products of an ``m × k`` by a ``k × n`` bf16 matrix, one kernel.

    Raises:
        ValueError: a size below 1.
    """

    m: int
    k: int
    n: int
    batch: int = 1

    def __post_init__(self) -> None:
        if min(self.m, self.k, self.n, self.batch) < 1:
            raise ValueError(f"GEMM m={self.m} k={self.k} n={self.n} batch={self.batch}: every size must be at least 1")

    @property
    def flops(self) -> float:
        """``2 m k n · batch``."""
        return 2 * self.m * self.k * self.n * self.batch

    def seconds(self, dev: Device, waves: bool = False) -> float:
        """The math-or-memory bound on ``dev`` (module docstring), with wave quantization if ``waves``
        and the device's SM count is known; seconds."""
        traffic = dev.element_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)
        flops = self.flops
        if waves and dev.sms:
            tile_m, tile_n = min(TILE_M, _round_up(self.m, MMA_GRAIN)), min(TILE_N, _round_up(self.n, MMA_GRAIN))
            tiles = math.ceil(self.m / tile_m) * math.ceil(self.n / tile_n) * self.batch
            flops = 2 * self.k * tile_m * tile_n * dev.sms * math.ceil(tiles / dev.sms)
        return Kernel(flops, traffic).seconds(dev)

    def input_grad(self) -> Gemm:
        """``dX = dY Wᵀ`` of ``Y = X W``: ``m × n`` by ``n × k``."""
        return Gemm(self.m, self.n, self.k, self.batch)

    def weight_grad(self) -> Gemm:
        """``dW = Xᵀ dY`` of ``Y = X W``: ``k × m`` by ``m × n``."""
        return Gemm(self.k, self.m, self.n, self.batch)


@dataclass(frozen=True)
class ActionTimes:
    """Seconds of one micro-batch's actions on one stage: ``forward``, ``input_grad`` (a split
    schedule's ``B``) and ``weight_grad`` (its ``W``); a whole backward is their sum."""

    forward: float
    input_grad: float
    weight_grad: float

    @property
    def backward(self) -> float:
        """The whole backward, seconds."""
        return self.input_grad + self.weight_grad

    def __add__(self, other: ActionTimes) -> ActionTimes:
        """Both pieces of work one after the other (a stage's blocks and its head)."""
        return ActionTimes(self.forward + other.forward, self.input_grad + other.input_grad,
                           self.weight_grad + other.weight_grad)  # fmt: skip

    def __mul__(self, count: float) -> ActionTimes:
        """``count`` equal pieces of work one after the other (a stage's blocks)."""
        return ActionTimes(self.forward * count, self.input_grad * count, self.weight_grad * count)


def as_architecture(model: Architecture | Any) -> Architecture:
    """``model`` itself, or the ``llama`` :class:`Architecture` of a ``ModelConfig``.

    Raises:
        ValueError: as :func:`~loomtrain.planner.arch.from_model_config`.
    """
    return model if isinstance(model, Architecture) else from_model_config(model)


def _tp_shares(arch: Architecture, tp: int) -> tuple[int, int, int]:
    if arch.n_heads % tp or arch.n_kv_heads % tp or arch.ffn_hidden % tp:
        raise ValueError(
            f"Layout.tp={tp} must divide n_heads={arch.n_heads}, n_kv_heads={arch.n_kv_heads} and "
            f"ffn_hidden={arch.ffn_hidden}"
        )
    return arch.hidden // tp, arch.kv_width // tp, arch.ffn_hidden // tp


def layer_gemms(model: Architecture | Any, seq_len: int, micro_batch: int, tp: int = 1) -> list[Gemm]:
    """The weight GEMMs of one block on one tensor-parallel rank, in launch order (module docstring).

    Raises:
        ValueError: ``tp`` does not divide the heads, the key/value heads or the MLP width.
    """
    arch = as_architecture(model)
    q, kv, f = _tp_shares(arch, tp)
    tokens, h = micro_batch * seq_len, arch.hidden
    if arch.family == "gpt":
        return [Gemm(tokens, h, 3 * q), Gemm(tokens, q, h), Gemm(tokens, h, f), Gemm(tokens, f, h)]
    return [Gemm(tokens, h, q), Gemm(tokens, h, kv), Gemm(tokens, h, kv), Gemm(tokens, q, h),
            Gemm(tokens, h, f), Gemm(tokens, h, f), Gemm(tokens, f, h)]  # fmt: skip


def attention_gemms(model: Architecture | Any, seq_len: int, micro_batch: int, tp: int = 1) -> list[Gemm]:
    """Unfused attention (``gpt``): ``Q Kᵀ`` ``(s, d, s)`` and ``P V`` ``(s, s, d)``, batched over the
    ``b·a/t`` heads of one rank. Empty for ``llama`` (fused: :func:`attention_kernels`).

    Raises:
        ValueError: as :func:`layer_gemms`.
    """
    arch = as_architecture(model)
    _tp_shares(arch, tp)
    if arch.family != "gpt":
        return []
    s, d, heads = seq_len, arch.head_dim, micro_batch * arch.n_heads // tp
    return [Gemm(s, d, s, heads), Gemm(s, s, d, heads)]


def attention_kernels(model: Architecture | Any, seq_len: int, micro_batch: int, tp: int = 1,
                      element_bytes: int = BYTES_BF16) -> tuple[Kernel, Kernel]:  # fmt: skip
    """One block's fused attention on one rank, ``(forward, backward)``: ``Q Kᵀ`` and ``P V`` per sequence
    and head (``2 · 2 s² d`` FLOP), moving ``Q``, ``K``, ``V``, output (forward) and those, the output
    gradient and ``dQ``, ``dK``, ``dV`` (backward, twice the FLOPs); ``element_bytes`` each (bf16: 2),
    every head counted in full. Zero work for ``gpt`` (unfused: :func:`attention_gemms`).

    Raises:
        ValueError: as :func:`layer_gemms`.
    """
    arch = as_architecture(model)
    _tp_shares(arch, tp)
    if arch.family == "gpt":
        return Kernel(0.0, 0.0), Kernel(0.0, 0.0)
    heads, s, d = micro_batch * arch.n_heads // tp, seq_len, arch.head_dim
    flops = heads * 2 * 2 * s * s * d
    tensor = heads * s * d * element_bytes
    return Kernel(flops, 4 * tensor), Kernel(2 * flops, 8 * tensor)


def attention_times(arch: Architecture, seq_len: int, micro_batch: int, tp: int, dev: Device,
                    waves: bool = False) -> tuple[float, float]:  # fmt: skip
    """``(forward, backward)`` seconds of one block's attention core (fused kernel or its two GEMMs).
    The fused kernel at ``dev.attention_curve``'s rate for the forward and backward FLOPs of one
    head's sequence where the device has that curve, else at the roofline (:meth:`Kernel.seconds`)."""
    fused, fused_backward = attention_kernels(arch, seq_len, micro_batch, tp, dev.element_bytes)
    gemms = attention_gemms(arch, seq_len, micro_batch, tp)
    fused_f, fused_b = fused.seconds(dev), fused_backward.seconds(dev)
    if dev.attention_curve and fused.flops:
        heads = micro_batch * arch.n_heads // tp
        rate = log_interpolate(dev.attention_curve, (fused.flops + fused_backward.flops) / heads)
        fused_f, fused_b = fused.flops / rate, fused_backward.flops / rate
    forward = fused_f + sum(g.seconds(dev, waves) for g in gemms)
    backward = fused_b + sum(g.input_grad().seconds(dev, waves) + g.weight_grad().seconds(dev, waves) for g in gemms)
    return forward, backward


def block_times(model: Architecture | Any, seq_len: int, micro_batch: int, dev: Device, tp: int = 1,
                waves: bool = False) -> ActionTimes:  # fmt: skip
    """GEMM and attention seconds of one block for one micro-batch on one rank (elementwise kernels and
    communication are the planner's additions: ``planner/time.py``).

    Raises:
        ValueError: as :func:`layer_gemms`.
    """
    arch = as_architecture(model)
    weights = layer_gemms(arch, seq_len, micro_batch, tp)
    attention, attention_backward = attention_times(arch, seq_len, micro_batch, tp, dev, waves)
    return ActionTimes(
        forward=sum(g.seconds(dev, waves) for g in weights) + attention,
        input_grad=sum(g.input_grad().seconds(dev, waves) for g in weights) + attention_backward,
        weight_grad=sum(g.weight_grad().seconds(dev, waves) for g in weights),
    )


def head_gemm(model: Architecture | Any, seq_len: int, micro_batch: int, tp: int = 1) -> Gemm:
    """The output head ``(b·s, h, ⌈V/t⌉)`` (vocabulary-parallel under tensor parallelism)."""
    arch = as_architecture(model)
    return Gemm(micro_batch * seq_len, arch.hidden, math.ceil(arch.vocab_size / tp))


def head_times(model: Architecture | Any, seq_len: int, micro_batch: int, dev: Device, tp: int = 1,
               waves: bool = False) -> ActionTimes:  # fmt: skip
    """Seconds of the output head's GEMM and its two backward GEMMs."""
    g = head_gemm(model, seq_len, micro_batch, tp)
    return ActionTimes(g.seconds(dev, waves), g.input_grad().seconds(dev, waves), g.weight_grad().seconds(dev, waves))


def stage_times(model: Architecture | Any, n_layers: int, last: bool, seq_len: int, micro_batch: int,
                dev: Device, tp: int = 1, waves: bool = False) -> ActionTimes:  # fmt: skip
    """Action times of a stage of ``n_layers`` blocks, with the output head if ``last``, for
    ``micro_batch`` sequences of ``seq_len`` on one tensor-parallel rank.

    Raises:
        ValueError: as :func:`layer_gemms`.
    """
    arch = as_architecture(model)
    times = block_times(arch, seq_len, micro_batch, dev, tp, waves) * n_layers
    return times + head_times(arch, seq_len, micro_batch, dev, tp, waves) if last else times


def block_forward_flops(model: Architecture | Any, seq_len: int, micro_batch: int, tp: int = 1) -> float:
    """Forward FLOPs of one block on one rank: its weight GEMMs and attention (either form)."""
    arch = as_architecture(model)
    fused, _ = attention_kernels(arch, seq_len, micro_batch, tp)
    gemms = layer_gemms(arch, seq_len, micro_batch, tp) + attention_gemms(arch, seq_len, micro_batch, tp)
    return sum(g.flops for g in gemms) + fused.flops
