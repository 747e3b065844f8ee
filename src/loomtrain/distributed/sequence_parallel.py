"""DeepSpeed-Ulysses sequence parallelism: attention over the full sequence from sequence slices.

Source: Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models" (2023), §3. Each of the ``sp`` ranks of a group holds
``S/sp`` consecutive positions of every sequence: rank ``r`` runs
``model(tokens[:, r·S/sp:(r+1)·S/sp], start_pos=r·S/sp)``. Everything in a block except the
attention core works position by position, so only the core needs other ranks' positions.
Before it, an all-to-all turns the rotated ``q``, ``k``, ``v`` from [local positions, all heads]
into [all positions, a share of the heads]; attention runs per head over the whole sequence;
a second all-to-all turns the output back. Parameters are replicated over ``sp``, so their
gradients are averaged over the sequence-parallel ranks like over data-parallel ones.

Communication: each all-to-all keeps ``1/sp`` of this rank's tensor and sends the rest, so with
heads divisible by ``sp`` it sends ``(sp−1)/sp`` of the local tensor's bytes (paper §3.1).
One attention layer issues four in forward (``q``, ``k``, ``v``, output) and the four reverse
ones in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.distributed.traffic import Traffic


def head_counts(n_heads: int, sp: int) -> list[int]:
    """Heads per sequence-parallel rank: ``ceil(n_heads/sp)`` on the first ``n_heads % sp`` ranks,
    ``floor(n_heads/sp)`` on the rest, in rank order (rank 0 takes the first heads)."""
    return [n_heads // sp + (1 if r < n_heads % sp else 0) for r in range(sp)]


def _seq_to_heads(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, s, hd]`` (this rank's positions, all heads) → ``[B, counts[r], sp·s, hd]``."""
    rank, sp = dist.get_rank(group), len(counts)
    batch, _, seq, head_dim = x.shape
    # all_to_all_single splits dim 0, so the heads go first: rank j's heads are then contiguous.
    send = x.transpose(0, 1).contiguous()
    recv = send.new_empty(sp * counts[rank], batch, seq, head_dim)
    dist.all_to_all_single(recv, send, [counts[rank]] * sp, counts, group=group)
    # recv holds source rank i's positions at block i: concatenating blocks in rank order
    # restores the sequence.
    recv = recv.view(sp, counts[rank], batch, seq, head_dim).permute(2, 1, 0, 3, 4)
    return recv.reshape(batch, counts[rank], sp * seq, head_dim)


def _heads_to_seq(y: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, counts[r], S, hd]`` (all positions, this rank's heads) → ``[B, sum(counts), S/sp, hd]``."""
    sp = len(counts)
    batch, heads, seq, head_dim = y.shape
    local_seq = seq // sp
    send = y.reshape(batch, heads, sp, local_seq, head_dim).permute(2, 1, 0, 3, 4).contiguous()
    recv = send.new_empty(sum(counts), batch, local_seq, head_dim)
    dist.all_to_all_single(recv, send.view(sp * heads, batch, local_seq, head_dim), counts, [heads] * sp, group=group)
    return recv.transpose(0, 1)


def _exchange(
    x: torch.Tensor, to_heads: bool, counts: list[int], group: dist.ProcessGroup, traffic: Traffic | None, axis: str
) -> torch.Tensor:
    rank, sp = dist.get_rank(group), len(counts)
    if traffic is not None:
        kept = x.numel() * counts[rank] // sum(counts) if to_heads else x.numel() // sp
        traffic.all_to_all(axis, (x.numel() - kept) * x.element_size())
    return _seq_to_heads(x, counts, group) if to_heads else _heads_to_seq(x, counts, group)


class _AllToAll(torch.autograd.Function):
    """All-to-all between the sequence-sharded and the head-sharded layout.

    ``to_heads=True``: ``[B, H, S/sp, hd]`` → ``[B, counts[r], S, hd]``; ``False``: the reverse.
    The backward pass is the reverse all-to-all of the incoming gradient: the map only moves
    elements, so its adjoint moves them back.
    """

    @staticmethod
    def forward(ctx, x, to_heads: bool, counts: list[int], group, traffic: Traffic | None, axis: str):
        ctx.reverse = (not to_heads, counts, group, traffic, axis)
        return _exchange(x, to_heads, counts, group, traffic, axis)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, *ctx.reverse), None, None, None, None, None


class UlyssesAttention(nn.Module):
    """Wraps a core attention module so that it sees the whole sequence for a share of the heads.

    ``core`` is called as ``core(q, k, v)`` with ``q`` ``[B, hq, S, hd]`` and ``k``, ``v``
    ``[B, hkv, S, hd]`` for this rank's heads and must treat heads independently (causal SDPA
    does). Heads split with :func:`head_counts`, so ``H`` need not be divisible by ``sp``.

    Grouped-query attention: when ``Hq`` and ``Hkv`` are both divisible by ``sp``, every rank's
    ``Hq/sp`` query heads use exactly its ``Hkv/sp`` key/value heads, and ``k``, ``v`` are split
    by ``sp`` as they are (``Hq/Hkv`` times fewer bytes than ``q``). Otherwise a rank's query
    heads may need key/value heads another rank is given, so ``k`` and ``v`` are repeated to
    ``Hq`` heads first and split like ``q``: more traffic, but correct for any head counts.

    Shapes: ``q`` ``[B, Hq, S/sp, hd]``, ``k``, ``v`` ``[B, Hkv, S/sp, hd]``, positions
    ``[r·S/sp, (r+1)·S/sp)`` of the sequence on group rank ``r``, already rotated (RoPE is
    applied before the all-to-all) → ``[B, Hq, S/sp, hd]``. Every rank must hold the same
    number of positions.

    Bytes (recorded on ``traffic[axis]``): forward sends ``(sp−1)/sp`` of the local ``q``, ``k``,
    ``v`` and output tensors' bytes (exactly, for head counts divisible by ``sp``; the part
    addressed to other ranks in general); backward sends the same again.

    Raises:
        ValueError: fewer query heads than ranks (a rank would have no heads).
    """

    def __init__(self, core: nn.Module, group: dist.ProcessGroup, traffic: Traffic | None = None, axis: str = "sp"):
        super().__init__()
        self.core = core
        self.group = group
        self.traffic = traffic
        self.axis = axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sp, n_heads, n_kv = dist.get_world_size(self.group), q.shape[1], k.shape[1]
        if n_heads < sp:
            raise ValueError(
                f"model.n_heads={n_heads} is smaller than parallel.sequence_parallel_degree={sp}; Ulysses gives "
                "each rank whole heads, so use sequence_parallel_degree <= n_heads"
            )
        q_counts = head_counts(n_heads, sp)
        if n_heads % sp == 0 and n_kv % sp == 0:
            kv_counts = head_counts(n_kv, sp)
        else:
            k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
            kv_counts = q_counts
        q = self._all_to_all(q, True, q_counts)
        k, v = (self._all_to_all(t, True, kv_counts) for t in (k, v))
        return self._all_to_all(self.core(q, k, v), False, q_counts)

    def _all_to_all(self, x: torch.Tensor, to_heads: bool, counts: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, to_heads, counts, self.group, self.traffic, self.axis)
