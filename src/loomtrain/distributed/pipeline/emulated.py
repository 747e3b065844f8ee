"""Emulated devices for pipeline stages: every forward and backward waits the time a cost model gives
for a named GPU instead of computing, while the executor, the schedule and the point-to-point
transfers (real tensors of the real activation shape) run for real. Waiting takes almost no CPU, so
more ranks than cores can run with device-like timing; what is real still costs CPU (on gloo, posting
a send or a receive takes 0.2-0.5 ms on a 2-core machine), so actions must be long against that (see
docs/pipeline.md, "Emulated devices"). A test instrument: its times are a model's, not measurements.

Cost model. A transformer layer is its matmuls; norms, softmax and other elementwise work are left
out, as in ``models/flops.py``. A kernel of ``flops`` FLOP moving ``bytes`` bytes takes
``max(flops / (peak · efficiency), bytes / bandwidth)``: the math-or-memory bound of NVIDIA's "Matrix
Multiplication Background User's Guide" (DU-09799-001, ch. 2 "Math and Memory Bounds"), so a GEMM of
few tokens is priced by reading its weight. A GEMM ``M × K`` by ``K × N`` is ``2 M K N`` FLOP and
``2 (M K + K N + M N)`` bytes in bf16. ``efficiency`` is 1.0 unless given: the guide's bound itself,
which real kernels approach but do not reach.

Backward of a weight GEMM ``Y = X W`` is two GEMMs of the forward's FLOPs (Kaplan et al. 2020 §2.1):
``dX = dY Wᵀ`` (the input gradient, a zero-bubble ``B``) and ``dW = Xᵀ dY`` (the weight gradient,
``W``). Attention is one fused kernel per layer (FlashAttention, Dao et al. 2022: the ``s × s``
scores never reach memory): ``Q Kᵀ`` and ``P V`` over the full square as ``models/flops.py`` counts
them, moving ``Q``, ``K``, ``V`` and the output; its backward, twice the FLOPs and reading those
and the output gradient to write ``dQ``, ``dK``, ``dV``, is all input gradient (no weights).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loomtrain.config import ModelConfig
from loomtrain.hardware import gpu_peak_flops_per_s

BYTES_BF16 = 2
# The last part of a wait spins instead of sleeping: a process woken from sleep on a busy machine may
# wait milliseconds for a core, which would stretch every emulated action by a random amount.
SPIN_S = 0.0005


def wait(seconds: float) -> None:
    """Return ``seconds`` from now: sleep, then spin the last :data:`SPIN_S` (a few ms of CPU per action)."""
    deadline = time.perf_counter() + seconds
    time.sleep(max(0.0, seconds - SPIN_S))
    while time.perf_counter() < deadline:
        pass


@dataclass(frozen=True)
class Device:
    """An emulated GPU.

    Attributes:
        name: what ``--simulate.device`` calls it. peak_flops_per_s: dense bf16 tensor FLOP/s.
        memory_bytes_per_s: HBM bandwidth, bytes/s. efficiency: share of the peak a math-bound GEMM
            reaches (1.0: the roofline itself).
        source: where the figures come from.
    """

    name: str
    peak_flops_per_s: float
    memory_bytes_per_s: float
    efficiency: float = 1.0
    source: str = ""


def _datasheet_peak(name: str) -> float:
    peak = gpu_peak_flops_per_s(name, torch.bfloat16, tf32=False)
    if peak is None:
        raise KeyError(f"no datasheet peak for {name!r} in hardware.GPU_PEAKS")
    return peak


# Peaks from hardware.GPU_PEAKS (the vendors' datasheets, dense: half the sparse figure).
DEVICES: dict[str, Device] = {
    "a100": Device("a100", _datasheet_peak("A100"), 2.039e12,
                   source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: BF16 312 TFLOP/s dense, 2,039 GB/s"),
    "h100": Device("h100", _datasheet_peak("H100"), 3.35e12,
                   source="NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 989.4 TFLOP/s dense, 3.35 TB/s"),
}  # fmt: skip


def device(name: str) -> Device:
    """The emulated device called ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    found = DEVICES.get(name.lower())
    if found is None:
        raise ValueError(f"simulate.device={name!r} is unknown; choose one of {', '.join(DEVICES)}")
    return found


@dataclass(frozen=True)
class Kernel:
    """Work of one kernel: ``flops`` FLOP, ``bytes`` bytes of memory traffic."""

    flops: float
    bytes: float

    def seconds(self, dev: Device) -> float:
        """The math-or-memory bound of this kernel on ``dev``, in seconds."""
        return max(self.flops / (dev.peak_flops_per_s * dev.efficiency), self.bytes / dev.memory_bytes_per_s)


@dataclass(frozen=True)
class Gemm:
    """The product of an ``m × k`` by a ``k × n`` bf16 matrix."""

    m: int
    k: int
    n: int

    def seconds(self, dev: Device) -> float:
        """The math-or-memory bound of this product on ``dev``, in seconds."""
        traffic = BYTES_BF16 * (self.m * self.k + self.k * self.n + self.m * self.n)
        return Kernel(2 * self.m * self.k * self.n, traffic).seconds(dev)

    def input_grad(self) -> Gemm:
        """``dX = dY Wᵀ`` of ``Y = X W``: ``m × n`` by ``n × k``."""
        return Gemm(self.m, self.n, self.k)

    def weight_grad(self) -> Gemm:
        """``dW = Xᵀ dY`` of ``Y = X W``: ``k × m`` by ``m × n``."""
        return Gemm(self.k, self.m, self.n)


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


def layer_gemms(cfg: ModelConfig, seq_len: int, micro_batch: int) -> list[Gemm]:
    """The weight GEMMs of one transformer block, ``tokens × in`` by ``in × out`` (``tokens =
    micro_batch · seq_len``): ``wq``, ``wk``, ``wv``, ``wo`` (grouped-query aware) and SwiGLU's
    ``w1``, ``w3``, ``w2``."""
    tokens, d, f = micro_batch * seq_len, cfg.dim, cfg.hidden_dim
    d_kv = cfg.kv_heads * cfg.head_dim
    return [Gemm(tokens, d, d), Gemm(tokens, d, d_kv), Gemm(tokens, d, d_kv), Gemm(tokens, d, d),
            Gemm(tokens, d, f), Gemm(tokens, d, f), Gemm(tokens, f, d)]  # fmt: skip


def attention_kernels(cfg: ModelConfig, seq_len: int, micro_batch: int) -> tuple[Kernel, Kernel]:
    """One block's fused attention, ``(forward, backward)``: ``Q Kᵀ`` and ``P V`` per sequence and head
    (``2 · 2 s² hd`` FLOP), moving ``Q``, ``K``, ``V``, output (forward) and those, the output gradient
    and ``dQ``, ``dK``, ``dV`` (backward, twice the FLOPs); bf16, every head counted in full."""
    heads, s, hd = micro_batch * cfg.n_heads, seq_len, cfg.head_dim
    flops = heads * 2 * 2 * s * s * hd
    tensor = heads * s * hd * BYTES_BF16
    return Kernel(flops, 4 * tensor), Kernel(2 * flops, 8 * tensor)


def stage_times(cfg: ModelConfig, n_layers: int, last: bool, seq_len: int, micro_batch: int,
                dev: Device) -> ActionTimes:  # fmt: skip
    """Action times of a stage of ``n_layers`` blocks, with the output head if ``last`` (a
    ``tokens × dim`` by ``dim × vocab`` weight GEMM), for ``micro_batch`` sequences of ``seq_len``."""
    weights = layer_gemms(cfg, seq_len, micro_batch) * n_layers
    if last:
        weights.append(Gemm(micro_batch * seq_len, cfg.dim, cfg.vocab_size))
    attention, attention_backward = attention_kernels(cfg, seq_len, micro_batch)
    return ActionTimes(
        forward=sum(g.seconds(dev) for g in weights) + n_layers * attention.seconds(dev),
        input_grad=sum(g.input_grad().seconds(dev) for g in weights) + n_layers * attention_backward.seconds(dev),
        weight_grad=sum(g.weight_grad().seconds(dev) for g in weights),
    )


class _Wait(torch.autograd.Function):
    """Identity whose backward waits ``seconds``: the emulated cost of the gradient that passes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        wait(ctx.seconds)
        return grad, None


class _Join(torch.autograd.Function):
    """``h`` unchanged, made to depend on the stage's parameter ``w`` (zero gradient)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w_shape = w.shape
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.w_shape)


class EmulatedStages(nn.Module):
    """A pipeline rank's stages on an emulated device, called like the pruned model by the executor.

    Each stage's forward waits its :func:`stage_times` forward time and returns a ``[B, S, dim]``
    tensor (``dtype``): the shape the real stage sends, so transfers are real-sized. The last stage
    returns that too, not logits (its head's time is in its forward time); use :func:`emulated_loss`.
    Backward waits the input-gradient time on the path to the stage input and the weight-gradient
    time on the path to the stage's one-element parameter, so a split backward (``zb_h1``) waits each
    part in its own action and a whole backward waits their sum.

    Args:
        cfg: the emulated model. stage_layers: ``{stage: [layer keys]}`` of this rank. n_stages: all
            stages of the pipeline. seq_len, micro_batch: the shape of a micro-batch. dev: the device.
        with_head: the last stage also pays the output head (False: equal stages, the premise of the
            schedules' bubble formulas).

    Raises:
        ValueError: a stage without layers.
    """

    def __init__(self, cfg: ModelConfig, stage_layers: dict[int, list[str]], n_stages: int, seq_len: int,
                 micro_batch: int, dev: Device, dtype: torch.dtype = torch.bfloat16,
                 with_head: bool = True):  # fmt: skip
        super().__init__()
        if any(not layers for layers in stage_layers.values()):
            raise ValueError(f"every pipeline stage needs at least one layer, got {stage_layers}")
        self.cfg, self.dev, self.dtype = cfg, dev, dtype
        self.stage_of = {tuple(layers): stage for stage, layers in stage_layers.items()}
        self.times = {stage: stage_times(cfg, len(layers), with_head and stage == n_stages - 1, seq_len, micro_batch,
                                         dev) for stage, layers in stage_layers.items()}  # fmt: skip
        self.weights = nn.ParameterDict({str(s): nn.Parameter(torch.zeros(1)) for s in stage_layers})
        self._embedded: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, x: torch.Tensor, start_pos: int = 0, layers: Sequence[str] | None = None) -> torch.Tensor:
        """Wait the forward time of the stage running ``layers``; ``x`` is ``LongTensor[B, S]`` tokens
        or ``[B, S, dim]`` hidden states. Returns ``[B, S, dim]``.

        Raises:
            KeyError: ``layers`` is not one of this rank's stages.
        """
        stage = self.stage_of[tuple(layers or ())]
        times = self.times[stage]
        wait(times.forward)
        h = x if x.is_floating_point() else self._embedding(tuple(x.shape))
        weight = _Wait.apply(self.weights[str(stage)], times.weight_grad)
        return _Wait.apply(_Join.apply(h, weight), times.input_grad)

    def _embedding(self, shape: tuple[int, ...]) -> torch.Tensor:
        # One zero tensor per token shape, never written: allocating it per forward would add CPU time.
        if shape not in self._embedded:
            self._embedded[shape] = torch.zeros(*shape, self.cfg.dim, dtype=self.dtype)
        return self._embedded[shape]


class _Loss(torch.autograd.Function):
    """A zero scalar whose gradient is the incoming one broadcast (a view, no copy) to ``out``'s shape."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = out.shape, out.dtype
        return out.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.dtype).expand(ctx.shape)


def emulated_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of an emulated last stage: a zero scalar (``targets`` unused) that costs no CPU time, so
    the stage's time is only what the cost model gave (the head and loss are in its forward time).
    Its gradient reaches the stage as a ``[B, S, dim]`` tensor like a real one."""
    return _Loss.apply(out)
