"""Megatron tensor parallelism, with optional Megatron sequence parallelism: the layers and
collectives (the plan that applies them to a model is ``models/parallelize.py``).

Sources: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism" (2019) §3: a linear layer's weight is split by output features (column
parallel) or by input features (row parallel); an MLP or attention block is a column-parallel
layer followed by a row-parallel one, so it needs one all-reduce in forward (operator ``g``) and
one in backward (its conjugate ``f``). Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (2022) §4.2.2: with sequence parallelism the norms and residuals
hold a slice of the sequence, ``g`` becomes a reduce-scatter along the sequence and ``f`` an
all-gather (and their conjugates in backward), at the same communication volume.

Every sharded weight uses the chunk layout of ``torch.chunk`` and DTensor ``Shard(dim)``: rank
``r`` of ``t`` holds indices ``[r·c, (r+1)·c)`` of the split dimension, ``c = ceil(size / t)``,
so trailing ranks may hold fewer. Parameters keep their names (``weight``), so ``state_dict``
keys are those of the unsharded model.

Communication is done by ``torch.autograd.Function`` s, one per pair of conjugate operators;
each collective is recorded in an optional :class:`~loomtrain.distributed.traffic.Traffic`
under a mesh axis name (default ``"tp"``). Shapes use ``B`` batch, ``S`` sequence, ``t`` the
tensor-parallel degree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loomtrain.distributed.parallel_dims import shard_range
from loomtrain.distributed.traffic import Traffic

SEQ_DIM = 1


def shard_of(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``dim`` (chunk layout), as a new contiguous tensor."""
    start, end = shard_range(tensor.shape[dim], dist.get_world_size(group), dist.get_rank(group))
    return tensor.detach().narrow(dim, start, end - start).clone()


def _record(traffic: Traffic | None, kind: str, axis: str, nbytes: int, n: int) -> None:
    if traffic is not None:
        getattr(traffic, kind)(axis, nbytes, n)


def _all_reduce_(x: torch.Tensor, group, traffic: Traffic | None, axis: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place; ``x`` must be contiguous."""
    n = dist.get_world_size(group)
    if n > 1:
        dist.all_reduce(x, op=op, group=group)
        _record(traffic, "all_reduce", axis, x.numel() * x.element_size(), n)
    return x


def _all_reduce(x: torch.Tensor, group, traffic: Traffic | None, axis: str) -> torch.Tensor:
    # On a copy: the input may be saved by autograd or aliased by other uses of the same gradient.
    return _all_reduce_(x.clone(memory_format=torch.contiguous_format), group, traffic, axis)


def _all_gather(x: torch.Tensor, dim: int, group, traffic: Traffic | None, axis: str) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    # The single-tensor collective concatenates along dim 0; other dims are moved there and back.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    _record(traffic, "all_gather", axis, out.numel() * out.element_size(), n)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, traffic: Traffic | None, axis: str) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by parallel.tensor_parallel_degree={n}; "
            "sequence parallelism splits every sequence evenly over the tensor-parallel ranks: "
            "make training.seq_len a multiple of it or set parallel.tp_mode='tensor_parallel'"
        )
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    _record(traffic, "reduce_scatter", axis, front.numel() * front.element_size(), n)
    return out.movedim(0, dim).contiguous()


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, traffic, axis):
        ctx.comm = (group, traffic, axis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, *ctx.comm), None, None, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group, traffic, axis):
        return _all_reduce(x, group, traffic, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's ``f``: all-gather along ``dim`` in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, dim, group, traffic, axis):
        ctx.comm = (dim, group, traffic, axis)
        return _all_gather(x, dim, group, traffic, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.comm), None, None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's ``g``: reduce-scatter along ``dim`` in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, dim, group, traffic, axis):
        ctx.comm = (dim, group, traffic, axis)
        return _reduce_scatter(x, dim, group, traffic, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.comm), None, None, None, None


def copy_to_parallel(x: torch.Tensor, group, traffic: Traffic | None = None, axis: str = "tp") -> torch.Tensor:
    """Megatron ``f`` (§3, Fig. 3): ``x`` unchanged; backward all-reduces its gradient, 2·(t−1)/t·|x| bytes."""
    return _CopyToParallel.apply(x, group, traffic, axis)


def reduce_from_parallel(x: torch.Tensor, group, traffic: Traffic | None = None, axis: str = "tp") -> torch.Tensor:
    """Megatron ``g``: the sum of ``x`` over the group, 2·(t−1)/t·|x| bytes; backward passes the gradient."""
    return _ReduceFromParallel.apply(x, group, traffic, axis)


def gather_along(x: torch.Tensor, dim: int, group, traffic: Traffic | None = None, axis: str = "tp") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order), contiguous: ``[.., s, ..]`` →
    ``[.., t·s, ..]``, (t−1)/t of the output's bytes. Backward reduce-scatters the gradient along ``dim``."""
    return _GatherFromSequence.apply(x, dim, group, traffic, axis)


def reduce_scatter_along(
    x: torch.Tensor, dim: int, group, traffic: Traffic | None = None, axis: str = "tp"
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's part along ``dim``, contiguous: ``[.., s, ..]`` →
    ``[.., s/t, ..]``, (t−1)/t of the input's bytes. Backward all-gathers the gradient along ``dim``.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size.
    """
    return _ScatterToSequence.apply(x, dim, group, traffic, axis)


def enter_parallel_region(
    x: torch.Tensor, group, sequence_parallel: bool, traffic: Traffic | None = None, axis: str = "tp"
) -> torch.Tensor:
    """Activations into the tensor-parallel region (``f``): replicated ``[B, S, D]`` pass as they
    are, sequence-sharded ``[B, S/t, D]`` are all-gathered along ``S``; both come out ``[B, S, D]``."""
    if sequence_parallel:
        return gather_along(x, SEQ_DIM, group, traffic, axis)
    return copy_to_parallel(x, group, traffic, axis)


def leave_parallel_region(
    x: torch.Tensor, group, sequence_parallel: bool, traffic: Traffic | None = None, axis: str = "tp"
) -> torch.Tensor:
    """Partial sums ``[B, S, D]`` out of the tensor-parallel region (``g``): all-reduced to
    ``[B, S, D]``, or reduce-scattered along ``S`` to ``[B, S/t, D]`` (sequence parallel)."""
    if sequence_parallel:
        return reduce_scatter_along(x, SEQ_DIM, group, traffic, axis)
    return reduce_from_parallel(x, group, traffic, axis)


class _TensorParallelModule(nn.Module):
    """A sharded ``weight`` and the communication settings shared by the layers below."""

    def __init__(
        self,
        weight: nn.Parameter,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        traffic: Traffic | None = None,
        axis: str = "tp",
    ):
        super().__init__()
        self.weight = weight
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.traffic = traffic
        self.axis = axis

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return enter_parallel_region(x, self.group, self.sequence_parallel, self.traffic, self.axis)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return leave_parallel_region(x, self.group, self.sequence_parallel, self.traffic, self.axis)

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, sequence_parallel={self.sequence_parallel}, axis={self.axis!r}"


def _reject_bias(linear: nn.Linear) -> None:
    if linear.bias is not None:
        raise ValueError("tensor-parallel linear layers take no bias; build the nn.Linear with bias=False")


class ColumnParallelLinear(_TensorParallelModule):
    """``y = x Wᵀ`` with ``W`` split by output features (Megatron §3, the first GEMM of a block).

    ``weight`` ``[out_local, in]`` holds this rank's rows of the full ``[out, in]`` weight (chunk
    layout, ``out_local = ceil(out/t)`` or fewer on trailing ranks).

    Shapes: ``x`` ``[B, S, in]`` (sequence parallel: ``[B, S/t, in]``) → ``[B, S, out_local]``.

    Communication with ``enter=True`` (``f`` on the input), per call, ``M = B·S·in``
    elements of the input's dtype:

    - tensor parallel: forward none; backward all-reduces the input gradient, 2·(t−1)/t·M.
    - sequence parallel: forward all-gathers the input along ``S``, (t−1)/t·M; backward
      reduce-scatters its gradient, (t−1)/t·M. The gathered input is kept for the weight
      gradient (Korthikanti et al. re-gather it in backward instead, saving memory).

    With ``enter=False`` the layer does no communication: the caller has applied
    ``f`` once for several layers that read the same input (``wq``, ``wk``, ``wv``).
    """

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup, *, enter: bool = True, **comm):
        super().__init__(weight, group, **comm)
        self.enter_input = enter

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup,
        *,
        enter: bool = True,
        sequence_parallel: bool = False,
        traffic: Traffic | None = None,
        axis: str = "tp",
    ) -> ColumnParallelLinear:
        """This rank's column-parallel part of ``linear`` (its weight is copied, not shared).

        Raises:
            ValueError: ``linear`` has a bias.
        """
        _reject_bias(linear)
        weight = nn.Parameter(shard_of(linear.weight, 0, group), requires_grad=linear.weight.requires_grad)
        return cls(
            weight,
            group,
            enter=enter,
            sequence_parallel=sequence_parallel,
            traffic=traffic,
            axis=axis,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_input:
            x = self.enter(x)
        return F.linear(x, self.weight)


class RowParallelLinear(_TensorParallelModule):
    """``y = x Wᵀ`` with ``W`` split by input features (Megatron §3, the second GEMM of a block).

    ``weight`` ``[out, in_local]`` holds this rank's columns of the full ``[out, in]`` weight
    (chunk layout, matching the output features of the column-parallel layer before it).

    Shapes: ``x`` ``[B, S, in_local]`` → ``[B, S, out]`` (sequence parallel: ``[B, S/t, out]``).

    Communication per call, ``M = B·S·out`` elements of the output's dtype:

    - tensor parallel: forward all-reduces the partial products (``g``), 2·(t−1)/t·M;
      backward none.
    - sequence parallel: forward reduce-scatters them along ``S``, (t−1)/t·M; backward
      all-gathers the output gradient, (t−1)/t·M.

    Raises (in forward):
        ValueError: sequence parallel and ``S`` not divisible by ``t``.
    """

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        traffic: Traffic | None = None,
        axis: str = "tp",
    ) -> RowParallelLinear:
        """This rank's row-parallel part of ``linear`` (its weight is copied, not shared).

        Raises:
            ValueError: ``linear`` has a bias.
        """
        _reject_bias(linear)
        weight = nn.Parameter(shard_of(linear.weight, 1, group), requires_grad=linear.weight.requires_grad)
        return cls(weight, group, sequence_parallel=sequence_parallel, traffic=traffic, axis=axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave(F.linear(x, self.weight))


class VocabParallelEmbedding(_TensorParallelModule):
    """Token embedding with the vocabulary split over the ranks (Megatron §3, input embedding).

    ``weight`` ``[V_local, D]`` holds rows ``[vocab_start, vocab_start + V_local)`` of the full
    ``[V, D]`` table (chunk layout). A rank looks up the tokens in its range and writes zero rows
    for the others; summing over the ranks gives every token its row.

    Shapes: ``tokens`` ``LongTensor[B, S]`` (every rank the same) → ``[B, S, D]`` (sequence
    parallel: ``[B, S/t, D]``, this rank's slice of the sequence).

    Communication per call, ``M = B·S·D`` elements of the weight's dtype:

    - tensor parallel: forward all-reduce, 2·(t−1)/t·M; backward none.
    - sequence parallel: forward reduce-scatter along ``S``, (t−1)/t·M; backward all-gather
      of the output gradient, (t−1)/t·M.

    Raises (in forward):
        ValueError: sequence parallel and ``S`` not divisible by ``t``.
    """

    def __init__(self, weight: nn.Parameter, group: dist.ProcessGroup, vocab_start: int, **comm):
        super().__init__(weight, group, **comm)
        self.vocab_start = vocab_start

    @classmethod
    def from_embedding(
        cls,
        emb: nn.Embedding,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        traffic: Traffic | None = None,
        axis: str = "tp",
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``emb`` (copied, not shared).

        Raises:
            ValueError: the chunk layout leaves some rank without rows (vocabulary too small).
        """
        vocab, n = emb.num_embeddings, dist.get_world_size(group)
        check_vocab_split(vocab, n)
        start, _ = shard_range(vocab, n, dist.get_rank(group))
        weight = nn.Parameter(shard_of(emb.weight, 0, group), requires_grad=emb.weight.requires_grad)
        return cls(weight, group, start, sequence_parallel=sequence_parallel, traffic=traffic, axis=axis)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.leave(rows.masked_fill(outside.unsqueeze(-1), 0.0))


def check_vocab_split(vocab: int, n: int) -> None:
    """Refuse a vocabulary whose chunk layout over ``n`` ranks leaves the last rank no rows.

    Raises:
        ValueError: ``vocab`` too small for ``n`` ranks.
    """
    if shard_range(vocab, n, n - 1)[0] >= vocab:
        raise ValueError(
            f"model.vocab_size={vocab} leaves the last of parallel.tensor_parallel_degree={n} ranks no "
            "vocabulary rows; lower the degree"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, traffic, axis):
        x = logits.detach().to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
        v_local = x.shape[-1]
        # One MAX all-reduce gives the row maxima and, appended, the largest local vocabulary
        # size: rank 0's ceil(V/t), from which this rank's first id follows (chunk layout).
        head = torch.cat([x.max(dim=-1).values, x.new_tensor([v_local])])
        head = _all_reduce_(head, group, traffic, axis, op=dist.ReduceOp.MAX)
        row_max, per_rank = head[:-1], head[-1].long()
        local = target.reshape(-1) - dist.get_rank(group) * per_rank
        inside = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        picked = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0.0)
        sum_exp, target_logit = _all_reduce_(torch.stack([exp.sum(dim=-1), picked]), group, traffic, axis)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, inside)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        scale = grad / softmax.shape[0]
        grad_logits = softmax * scale
        rows = torch.arange(softmax.shape[0], device=softmax.device)[inside]
        grad_logits[rows, local[inside]] -= scale
        return grad_logits.reshape(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup,
    traffic: Traffic | None = None,
    axis: str = "tp",
) -> torch.Tensor:
    """Mean cross-entropy of vocabulary-split logits, without gathering them (Megatron §3).

    Every rank holds a slice of the vocabulary in the chunk layout (the output of a
    :class:`ColumnParallelLinear` over the vocabulary). With ``m`` the global row maximum, the
    loss of a token is ``log Σ_v exp(x_v − m) − (x_target − m)``; the maximum, the sums of
    exponentials and the target logit (held by one rank, zero on the others) are combined by
    two all-reduces: one (MAX) of ``N + 1`` floats, one (SUM) of ``2N`` floats, ``N`` tokens.
    Backward needs no communication: ``(softmax_local − onehot_local) · grad / N``.

    Shapes: ``logits`` ``[..., V_local]``, ``target`` ``LongTensor[...]`` of global ids →
    a float32 scalar, equal to ``F.cross_entropy`` of the full logits (no ignore index, no
    label smoothing). The gradient has the logits' dtype; the computation is in float32.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group, traffic, axis)


def all_reduce_grad_hook(
    param: nn.Parameter, group: dist.ProcessGroup, traffic: Traffic | None = None, axis: str = "tp"
) -> torch.utils.hooks.RemovableHandle:
    """Sum ``param``'s gradient over ``group`` before it is accumulated into ``.grad``.

    For a parameter replicated over the tensor-parallel ranks but applied to different data on
    each: the norm weights under sequence parallelism, which see one slice of the sequence per
    rank (Korthikanti et al. §4.2.2). Each backward costs 2·(t−1)/t of the parameter's bytes.

    Returns:
        The hook's handle (``.remove()`` detaches it).
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad, group, traffic, axis)

    return param.register_hook(hook)
