"""Bytes per device of a parallel layout: model states by ZeRO stage, activations, micro-batches in flight.

Every function is arithmetic on an :class:`~loomtrain.planner.arch.Architecture` and a
:class:`Layout`; nothing is built or run. The figures are for pipeline rank 0, the rank that holds
the most micro-batches in flight (Korthikanti et al. 2022 §4.2.3: "the first stage") and the
embedding. Sources:

- Model states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (SC 2020), §3.1 (mixed-precision Adam: ``2Ψ + 2Ψ + KΨ`` bytes, ``K = 12``) and §5.1-5.3
  (``P_os``, ``P_os+g``, ``P_os+g+p`` divide the optimizer states, then the gradients, then the
  parameters by the data-parallel degree ``N_d``).
- GPT activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys 2023), §4.1 (the terms of one layer), §4.2 (tensor and sequence parallelism), §4.3
  (selective recomputation), §4.2.3 (pipeline: the first stage holds ``L`` layers' worth under 1F1B).
- Llama activations: derived here for loomtrain's own block (:func:`llama_layer_activation_bytes`).
- Micro-batches in flight: loomtrain's schedules (``distributed/pipeline/schedule.py``).

Not modelled: activations of the embedding, final norm, output head and loss; temporary buffers
(gathered ZeRO-3 parameters, communication buckets); allocator fragmentation; CUDA context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from loomtrain.planner.arch import Architecture

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
ZERO3_PREFETCH = ("block", "weight")
FP32_BYTES = 4


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state.

    Attributes:
        param_bytes: the parameters forward reads, per parameter (the ZeRO paper's 2 for fp16).
        grad_bytes: gradients, per parameter.
        optimizer_bytes: optimizer state per parameter, the ZeRO paper's ``K`` (fp32 master copy,
            Adam momentum and variance: 12; without a master copy: 8).
        activation_bytes: ``e``, the element size of linear inputs and outputs in forward.
        residual_bytes: ``r``, the element size of the residual stream (a block's input).
        autocast_copies: forward runs under ``torch.autocast``: it casts fp32 weights and each
            linear's fp32 input to ``activation_bytes``, and autograd keeps every cast copy until
            that micro-batch's backward.
        stage3_param_bytes: per parameter, the parameter shard ZeRO-3 keeps besides the optimizer
            state (``None``: ``param_bytes``, as the paper's ``P_os+g+p``; 0 when the fp32 master in
            ``optimizer_bytes`` is the only shard, as loomtrain's ZeRO-3 with 16-bit parameters).
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    residual_bytes: int
    autocast_copies: bool = False
    stage3_param_bytes: int | None = None


# ZeRO §3.1: fp16 parameters and gradients, fp32 master, momentum and variance (K = 12).
MIXED_ADAM = Precision(2, 2, 12, 2, 2)
# loomtrain's default (training.dtype="fp32"): fp32 parameters and gradients, AdamW's two fp32 moments.
FP32_ADAM = Precision(4, 4, 8, 4, 4)
# training.dtype="bf16": the same states, forward under bf16 autocast; the residual stays fp32
# because the embedding's fp32 output is added to every block's bf16 branch outputs.
AUTOCAST_BF16_ADAM = Precision(4, 4, 8, 2, 4, autocast_copies=True)


@dataclass(frozen=True)
class Layout:
    """One parallel configuration of a training step.

    Attributes:
        seq_len: tokens per sequence (``s``). micro_batch: sequences per micro-batch (``b``).
        dp, tp, pp, sp: data-, tensor-, pipeline- and Ulysses sequence-parallel degrees.
        dp_replicate: replicas of the ZeRO shard group (HSDP): ``dp = dp_replicate · dp_shard``, ZeRO
            shards over the ``dp_shard`` ranks only (1: ZeRO over all of ``dp``).
        sequence_parallel: Megatron sequence parallelism on the ``tp`` ranks (norms, dropouts and
            residuals hold ``s/t`` positions).
        zero_stage: 0 (replicated), 1 (``P_os``), 2 (``P_os+g``), 3 (``P_os+g+p``) over ``dp`` ranks.
        n_micro: micro-batches per step on each pipeline. schedule: one of :data:`SCHEDULES`.
        virtual_stages: chunks per pipeline rank (``interleaved_1f1b``).
        recompute: ``none``, ``selective`` (the attention core) or ``full`` (whole blocks).
        precision: element sizes (:class:`Precision`).
        overlap_grad_reduce: the data-parallel gradient reduction runs under the last micro-batch's
            backward as its buckets fill (loomtrain's sync, torch DDP; Megatron-core's flag of this
            name); False: after it (Megatron-LM's local DDP of 2021, the published runs').
        overlap_tp_backward: each tensor-parallel collective of the backward (the input gradient's
            all-reduce, or Megatron SP's all-gather) runs under the weight-gradient GEMMs of the
            linears whose input it serves (Megatron-LM from 2022: Korthikanti et al. 2022 §6);
            False: after them (Megatron-LM 2021, loomtrain).
        zero_gather_copies: ZeRO copies each all-gather's own shard into the send buffer and the
            gathered buffer into the parameters (loomtrain's ``zero_layout.py``); False: the gathers
            land in the parameters' storage (the published DeepSpeed runs, whose copies, if any,
            are not known: :func:`~loomtrain.planner.time.grad_passes_seconds`).
        fused_optimizer: the optimizer updates each element in one kernel (apex's FusedAdam, as
            Megatron-LM runs it: the published runs); False: PyTorch's AdamW as loomtrain runs it,
            a pass per operation (:func:`~loomtrain.planner.time.optimizer_bytes_per_param`).
        zeroed_grad_buffers: without ZeRO the gradients are views of buckets zeroed after each step
            (loomtrain's ``distributed/data_parallel.py``), so every micro-batch's gradient is added
            into them, the first into zeros (:func:`~loomtrain.planner.time.grad_accumulation_seconds`;
            loomtrain's ZeRO drops its gradients instead); False: the first micro-batch's gradients
            are written (how the published runs are priced).
        zero3_prefetch: how far ahead ZeRO-3 gathers parameters while the ranks compute
            (:func:`~loomtrain.planner.time.weight_prefetch_seconds`): ``block``, the next block's whole
            parameters (loomtrain's ``distributed/zero.py`` and FSDP2 prefetch a block), so a pass takes
            the longer of its compute and its gathers; ``weight``, the next weight matrix only (DeepSpeed
            v0.3.13's ZeRO-3, the release before the paper's arXiv v1: its prefetch bucket,
            ``stage3_prefetch_bucket_size``, 5·10⁷ elements by default, holds less than one GPT-3
            weight, and it prefetches only while no gather is in flight), so each weight's compute
            hides only the next weight's gather.
        log_interval: loomtrain's trainer logs every ``log_interval`` steps (``training.log_interval``),
            each logged step a few small collectives (:func:`~loomtrain.planner.time.logging_seconds`);
            0: none priced (the published runs, whose logging is not known).

    Raises:
        ValueError: a degree or size below 1, a negative ``log_interval``, an unknown ``zero_stage``, ``schedule``,
            ``recompute`` or ``zero3_prefetch``, ``dp_replicate`` not dividing ``dp``, or ``virtual_stages > 1`` without
            ``interleaved_1f1b``.
    """

    seq_len: int
    micro_batch: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    n_micro: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    precision: Precision = field(default=FP32_ADAM)
    overlap_grad_reduce: bool = True
    overlap_tp_backward: bool = False
    zero_gather_copies: bool = True
    fused_optimizer: bool = False
    zeroed_grad_buffers: bool = True
    zero3_prefetch: str = "block"
    log_interval: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "dp", "tp", "pp", "sp", "dp_replicate", "n_micro", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name}={getattr(self, name)} must be at least 1")
        if self.log_interval < 0:
            raise ValueError(f"Layout.log_interval={self.log_interval} must be 0 (no logging priced) or more")
        if self.dp % self.dp_replicate:
            raise ValueError(f"Layout.dp_replicate={self.dp_replicate} must divide dp={self.dp}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero_stage={self.zero_stage}; choose 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout.schedule={self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.zero3_prefetch not in ZERO3_PREFETCH:
            choices = ", ".join(ZERO3_PREFETCH)
            raise ValueError(f"Layout.zero3_prefetch={self.zero3_prefetch!r}; choose one of {choices}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute={self.recompute!r}; choose one of {', '.join(RECOMPUTE)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(
                f"Layout.virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b', not {self.schedule!r}"
            )

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks of a ZeRO shard group: ``dp / dp_replicate``."""
        return self.dp // self.dp_replicate

    @property
    def grad_ranks(self) -> int:
        """Ranks that average each gradient: ``dp · sp`` (Ulysses' ranks hold the same weights and
        see different tokens, so they average gradients as data parallelism does: loomtrain's
        ``dp_sp`` axis, DeepSpeed-Ulysses' ZeRO over data × sequence parallel ranks)."""
        return self.dp * self.sp

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards over: ``dp_shard · sp`` (loomtrain's ``dp_shard_sp`` axis)."""
        return self.dp_shard * self.sp

    @property
    def gpus(self) -> int:
        """Devices of the layout: ``dp · tp · pp · sp``."""
        return self.dp * self.tp * self.pp * self.sp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on pipeline rank 0 of one data-parallel replica, by kind.

    Attributes:
        params, grads, optimizer: model states (:func:`model_state_bytes`).
        activations: saved for backward at the peak (layers held × :func:`layer_activation_bytes`).
        autocast_copies: cast weight copies held by in-flight micro-batches (0 without autocast).
        params_per_device: parameters (elements) this rank's layers hold before ZeRO sharding.
        layers_in_flight: block-forwards whose activations are held at the peak.
        logits: the loss's logits at their peak on the last stage (:func:`logits_bytes`).
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    autocast_copies: float
    params_per_device: float
    layers_in_flight: int
    logits: float = 0.0

    @property
    def total(self) -> float:
        """Sum of all kinds, bytes."""
        return self.params + self.grads + self.optimizer + self.activations + self.autocast_copies + self.logits


def logits_bytes(arch: Architecture, layout: Layout) -> float:
    """Peak bytes of one micro-batch's logits at the loss, on one rank of the last stage, for the
    ``b · (s/sp) · V/t`` logits, as loomtrain's ``parallel_model.py`` computes the loss (measured with
    an allocation tracker on PyTorch's dispatch, per logit): ``F.cross_entropy`` (Llama at
    ``t = 1``) peaks in backward at 12 bytes, the saved fp32 log-softmax, its output gradient and the
    input gradient alive together (its forward: 8 in fp32, 10 in bf16); the vocabulary-parallel
    cross-entropy (``t > 1``, and GPT's Megatron-LM loss at every ``t``) in forward at the logits, their
    fp32 copy (16-bit runs), the shifted logits and their exponentials: 14 bytes in bf16, 12 in fp32.
    Llama 3's 128K vocabulary at ``b = 4``, ``s = 8192``, ``t = 1``: 50 GB, more than its 8B model's
    blocks hold."""
    logits = layout.micro_batch * layout.seq_len / layout.sp * arch.vocab_size / layout.tp
    if layout.tp == 1 and arch.family != "gpt":
        return 12 * logits
    element = layout.precision.activation_bytes
    return logits * (element + (4 if element < 4 else 0) + 8)


def model_state_bytes(n_params: float, n_d: int, zero_stage: int, precision: Precision) -> tuple[float, float, float]:
    """``(parameters, gradients, optimizer states)`` in bytes on one device (ZeRO §3.1, §5).

    With ``Ψ = n_params`` and ``N_d = n_d``: stage 0 keeps ``PΨ``, ``GΨ``, ``KΨ``; stage 1
    (``P_os``) divides ``KΨ`` by ``N_d``; stage 2 (``P_os+g``) also ``GΨ``; stage 3 (``P_os+g+p``)
    also ``PΨ``. With ``MIXED_ADAM`` the sum is the paper's ``(2 + 2 + K)Ψ``, ``4Ψ + KΨ/N_d``,
    ``2Ψ + (2 + K)Ψ/N_d`` and ``(2 + 2 + K)Ψ/N_d``.

    Raises:
        ValueError: ``n_d`` below 1 or ``zero_stage`` not in 0-3.
    """
    if n_d < 1 or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"n_d={n_d} must be at least 1 and zero_stage={zero_stage} one of 0, 1, 2, 3")
    optimizer = precision.optimizer_bytes * n_params / (n_d if zero_stage >= 1 else 1)
    grads = precision.grad_bytes * n_params / (n_d if zero_stage >= 2 else 1)
    params = precision.param_bytes * n_params
    if zero_stage == 3:
        shard = precision.param_bytes if precision.stage3_param_bytes is None else precision.stage3_param_bytes
        params = shard * n_params / n_d
    return params, grads, optimizer


_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def precision_for(
    training_dtype: str, zero_stage: int, param_dtype: str = "fp32", reduce_dtype: str = "fp32"
) -> Precision:
    """The :class:`Precision` of a loomtrain run with AdamW, from its config fields
    (``training.dtype``, ``data_parallel.zero_stage``, ``param_dtype``, ``reduce_dtype``).

    Stage 0: fp32 parameters and gradients, two fp32 moments (``K = 8``), forward in fp32 or under
    bf16 autocast. ZeRO (stage ≥ 1, docs/zero.md "Memory: measured against the formulas"):
    parameters in ``param_dtype``, gradients held in ``reduce_dtype``, an fp32 master added to the
    moments when ``param_dtype`` is 16-bit (``K = 12``), and at stage 3 the master as the only
    parameter shard; 16-bit parameters make the forward and the residual 16-bit, fp32 parameters
    with ``training.dtype="bf16"`` run under autocast.

    Raises:
        ValueError: an unknown dtype name, or 16-bit ``param_dtype``/``reduce_dtype`` at stage 0.
    """
    for name, value in (("training.dtype", training_dtype), ("data_parallel.param_dtype", param_dtype),
                        ("data_parallel.reduce_dtype", reduce_dtype)):  # fmt: skip
        if value not in _DTYPE_BYTES:
            raise ValueError(f"{name}={value!r}; choose one of {', '.join(_DTYPE_BYTES)}")
    if zero_stage == 0 and (param_dtype, reduce_dtype) != ("fp32", "fp32"):
        raise ValueError("data_parallel.param_dtype/reduce_dtype other than fp32 need data_parallel.zero_stage >= 1")
    p, g = _DTYPE_BYTES[param_dtype], _DTYPE_BYTES[reduce_dtype]
    if p < FP32_BYTES:
        return Precision(p, g, 12, p, p, stage3_param_bytes=0)
    if training_dtype == "bf16":
        return Precision(p, g, 8, 2, FP32_BYTES, autocast_copies=True)
    return Precision(p, g, 8, FP32_BYTES, FP32_BYTES)


def in_flight(schedule: str, pp: int, n_micro: int, v: int = 1) -> int:
    """Chunk-forwards whose activations pipeline rank 0 holds at its peak under loomtrain's ``schedule``.

    A chunk holds ``L / (pp · v)`` layers. ``gpipe``: all ``m = n_micro`` forwards run before any
    backward: ``m``. ``1f1b`` (Narayanan et al. SC 2021 §2.2.1): a warm-up of ``pp - 1`` forwards,
    then one more before the first backward: ``min(pp, m)``. ``zb_h1`` (Qi et al. ICLR 2024 §2.1):
    1F1B's order with rank 0's ``W`` right after its ``B``, counting a micro-batch from ``F`` to
    ``W``: ``min(pp, m)``. ``interleaved_1f1b`` (§2.2.2, Megatron's warm-up ``2(pp - 1) + (v - 1)pp``,
    all ``mv`` forwards when ``m = pp``): ``min(2(pp - 1) + (v - 1)pp + 1, mv)``, which is
    Korthikanti et al. §4.2.3's ``L(1 + (pp - 1)/(pp·v))`` layers.

    Raises:
        ValueError: an unknown ``schedule`` or a size below 1.
    """
    if schedule not in SCHEDULES or min(pp, n_micro, v) < 1:
        raise ValueError(f"schedule={schedule!r} pp={pp} n_micro={n_micro} v={v}: unknown schedule or size below 1")
    if schedule == "gpipe":
        return n_micro * v
    if schedule in ("1f1b", "zb_h1"):
        return min(pp, n_micro)
    total = n_micro * v
    warmup = total if n_micro == pp else min(2 * (pp - 1) + (v - 1) * pp, total)
    return min(warmup + 1, total)


# Korthikanti et al. §4.1, one GPT layer in fp16 with 1-byte dropout masks, bytes per sbh:
# (term, bytes, split) with split "tp" (heads or MLP columns, divided by t) or "seq" (replicated
# over tensor-parallel ranks unless sequence parallelism divides it by t).
_GPT_SBH_TERMS = (
    ("QKV input (LayerNorm output)", 2, "seq"),
    ("Q and K for QK^T", 4, "tp"),
    ("V for the attention over values", 2, "tp"),
    ("output projection input", 2, "tp"),
    ("attention dropout mask", 1, "seq"),
    ("MLP first linear input", 2, "seq"),
    ("GeLU input", 8, "tp"),
    ("MLP second linear input", 8, "tp"),
    ("MLP dropout mask", 1, "seq"),
    ("two LayerNorm inputs", 4, "seq"),
)
# §4.1: softmax output (2as²b), its dropout mask (as²b) and the dropped scores (2as²b), split by t.
_GPT_SCORE_BYTES = 5


def gpt_layer_activation_bytes(arch: Architecture, layout: Layout) -> float:
    """Bytes one GPT layer saves for backward per micro-batch on one tensor-parallel rank.

    Korthikanti et al. 2022 §4 (fp16, 1-byte dropout masks, unfused attention), summed from the
    terms of §4.1 (``_GPT_SBH_TERMS``) rather than copied, which gives their Table 2: without
    parallelism ``sbh(34 + 5as/h)``; tensor parallel ``sbh(10 + 24/t + 5as/(ht))``; with sequence
    parallelism ``sbh(34/t + 5as/(ht))``; selective recomputation drops the ``5as/(ht)`` term
    (``sbh(10 + 24/t)``, ``sbh·34/t``); full recomputation keeps the layer input, ``2sbh`` (``/t``
    with sequence parallelism, which stores it sharded). Ulysses ``sp`` divides ``s``.

    Raises:
        ValueError: ``tp`` or ``sp`` does not divide the heads.
    """
    _check_heads(arch, layout)
    s, b, h, t = layout.seq_len / layout.sp, layout.micro_batch, arch.hidden, layout.tp
    seq_split = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return 2 * s * b * h / seq_split
    per_sbh = sum(nbytes / (t if split == "tp" else seq_split) for _, nbytes, split in _GPT_SBH_TERMS)
    scores = 0.0 if layout.recompute == "selective" else _GPT_SCORE_BYTES * arch.n_heads * s * s * b / t
    return per_sbh * s * b * h + scores


def llama_layer_activation_bytes(arch: Architecture, layout: Layout) -> float:
    """Bytes one loomtrain Llama block saves for backward per micro-batch on one rank.

    Derived by going through :class:`~loomtrain.models.llama.TransformerBlock`'s operations as
    Korthikanti et al. §4.1 do for GPT. ``s`` sequence (divided by Ulysses ``sp``), ``b``
    micro-batch, ``h`` width, ``k`` key/value width, ``f`` SwiGLU width, ``a`` heads, ``t`` tensor
    parallel; ``e`` = ``precision.activation_bytes``, ``r`` = ``precision.residual_bytes``:

    - each RMSNorm (two per block) computes in fp32: ``pow`` and the product keep the fp32 input
      (the residual itself when it is fp32, else an fp32 copy: ``4sbh``), ``rsqrt`` its output
      ``1/rms`` (``4sb``), the weight product ``x/rms`` (``4sbh``); the norm's output is kept by
      the linears that read it: once (``e·sbh``) when it is already in the compute dtype, but
      under autocast (fp32 residual) each linear keeps its own cast copy, autocast caching casts of
      leaf tensors only: three for ``wq``, ``wk``, ``wv``, two for ``w1``, ``w3`` (``c = 5`` copies
      per block, else ``c = 2``);
    - the rotary embedding keeps only its ``cos``/``sin`` tables (buffers, not activations);
    - scaled-dot-product attention, fused kernel (flash/efficient, ``dropout = 0``): rotated ``q``
      and ``k``, ``v``, its output, which ``wo`` reads in place, and the fp32 log-sum-exp:
      ``e(2sbh + 2sbk)/t + 4abs/t``; no ``s × s`` scores;
    - SwiGLU: ``w1 x`` (SiLU's input), ``silu(w1 x)`` and ``w3 x`` (the product's inputs), the
      product (``w2``'s input): ``4e·sbf/t``;
    - residual adds and ``dropout = 0`` keep nothing.

    ``none``: ``2(8sbh + 4sb)/σ + c·e·sbh + (e(2sbh + 2sbk + 4sbf) + 4abs)/t`` with ``σ = t`` under
    Megatron sequence parallelism (norms hold ``s/t`` positions; the linears keep the gathered
    input whole) and 1 otherwise. ``selective`` recomputes the attention core: no log-sum-exp
    (the core's inputs and output stay, being the inputs of the core and of ``wo``). ``full``: the
    block input, ``r·sbh/σ``. In fp32 (``e = r = 4``) this is ``block_activation_bytes`` of
    ``models/parallelize.py``; tests/unit/test_planner_memory.py checks fp32 and bf16 against
    bytes counted on a real block.

    Raises:
        ValueError: ``tp`` does not divide the key/value heads, or ``tp``/``sp`` the heads.
    """
    _check_heads(arch, layout)
    s, b, t = layout.seq_len / layout.sp, layout.micro_batch, layout.tp
    h, k, f, a = arch.hidden, arch.kv_width, arch.ffn_hidden, arch.n_heads
    e, r = layout.precision.activation_bytes, layout.precision.residual_bytes
    sigma = t if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return r * s * b * h / sigma
    copies = 5 if layout.precision.autocast_copies else 2
    norms = 2 * (2 * FP32_BYTES * h + FP32_BYTES) / sigma + copies * e * h
    lse = 0 if layout.recompute == "selective" else FP32_BYTES * a
    split = (e * (2 * h + 2 * k + 4 * f) + lse) / t
    return s * b * (norms + split)


def _check_heads(arch: Architecture, layout: Layout) -> None:
    if arch.n_kv_heads % layout.tp or arch.n_heads % (layout.tp * layout.sp):
        raise ValueError(
            f"Layout.tp={layout.tp} must divide n_kv_heads={arch.n_kv_heads}, and tp × sp={layout.tp * layout.sp} "
            f"n_heads={arch.n_heads}"
        )


def layer_activation_bytes(arch: Architecture, layout: Layout) -> float:
    """Bytes one block saves per micro-batch on one rank: :func:`gpt_layer_activation_bytes` or
    :func:`llama_layer_activation_bytes` by ``arch.family``.

    Raises:
        ValueError: as those functions.
    """
    if arch.family == "gpt":
        return gpt_layer_activation_bytes(arch, layout)
    return llama_layer_activation_bytes(arch, layout)


def layers_per_chunk(arch: Architecture, layout: Layout) -> int:
    """Blocks in one pipeline chunk of rank 0: ``ceil(L / (pp · v))`` (the larger share when uneven).

    Raises:
        ValueError: fewer blocks than pipeline stages.
    """
    stages = layout.pp * layout.virtual_stages
    if arch.n_layers < stages:
        raise ValueError(f"n_layers={arch.n_layers} is fewer than pp × virtual_stages={stages}; use fewer stages")
    return math.ceil(arch.n_layers / stages)


def device_params(arch: Architecture, layout: Layout) -> float:
    """Parameters (elements) on pipeline rank 0 of one tensor-parallel group, before ZeRO sharding:
    its blocks (matrices ``/t``, norms whole), the embedding (vocabulary-parallel, ``/t``), and the
    final norm and head when ``pp = 1``.

    Raises:
        ValueError: as :func:`layers_per_chunk`.
    """
    split, replicated = arch.layer_params()
    layers = layers_per_chunk(arch, layout) * layout.virtual_stages
    params = layers * (split / layout.tp + replicated) + arch.embedding_params() / layout.tp
    return params + (arch.head_params() / layout.tp if layout.pp == 1 else 0)


def estimate(arch: Architecture, layout: Layout) -> MemoryEstimate:
    """Bytes on pipeline rank 0 for ``arch`` trained with ``layout`` (see :class:`MemoryEstimate`),
    with the last stage's :func:`logits_bytes` added: with ``pp = 1`` rank 0 is the last stage; with
    more stages the sum bounds both ends (the last stage holds no more activations than rank 0 and
    a head of the embedding's size).

    Activations: :func:`in_flight` chunk-forwards × :func:`layers_per_chunk` × per-layer bytes,
    plus, under full recomputation, one block's unrecomputed activations (the block backward is
    recomputing). Model states: :func:`model_state_bytes` of :func:`device_params` over
    ``N_d = shard_ranks`` (``dp_shard · sp``), except that with several micro-batches the gradients
    are whole under every stage (``distributed/zero.py`` accumulates them under ``no_sync`` and
    reduces at the last micro-batch; DeepSpeed's ZeRO-2 reduces every micro-batch instead).
    Autocast copies: each in-flight chunk keeps its blocks' weight matrices cast to
    ``activation_bytes`` (none under full recomputation, which drops them with the rest).

    Raises:
        ValueError: as the functions it calls.
    """
    n_params = device_params(arch, layout)
    params, grads, optimizer = model_state_bytes(n_params, layout.shard_ranks, layout.zero_stage, layout.precision)
    if layout.n_micro > 1:  # loomtrain's ZeRO accumulates whole gradients and reduces at the last micro-batch
        grads = max(grads, layout.precision.grad_bytes * n_params)
    chunks = in_flight(layout.schedule, layout.pp, layout.n_micro, layout.virtual_stages)
    layers = chunks * layers_per_chunk(arch, layout)
    activations = layers * layer_activation_bytes(arch, layout)
    copies = 0.0
    if layout.recompute == "full":
        # The block being recomputed in backward holds its whole activations again, one at a time;
        # the cast weight copies live inside the recomputed region and are dropped after forward.
        activations += layer_activation_bytes(arch, replace(layout, recompute="none"))
    elif layout.precision.autocast_copies:
        copies = layers * arch.layer_params()[0] / layout.tp * layout.precision.activation_bytes
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        autocast_copies=copies,
        params_per_device=n_params,
        layers_in_flight=layers,
        logits=logits_bytes(arch, layout),
    )
