"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.config import TrainingConfig


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay (Loshchilov & Hutter, ICLR 2019) on matrices and
    embeddings only; norms' gains are not decayed, since shrinking them towards zero has no
    regularising meaning."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_at(step: int, cfg: TrainingConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``decay_steps`` (default: all steps)
    (Loshchilov & Hutter, "SGDR", ICLR 2017), constant after.

    A pure function of the step, so the schedule needs no state of its own in checkpoints.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    end = cfg.decay_steps or cfg.steps
    if step >= end:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, end - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm_(
    sharded: list[torch.Tensor],
    replicated: list[torch.Tensor],
    max_norm: float,
    reduce_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so the global L2 norm of the full gradient is at most
    ``max_norm``, by ``min(1, max_norm / (norm + 1e-6))`` (the rule of
    ``torch.nn.utils.clip_grad_norm_``; ``max_norm <= 0`` only measures); returns the norm
    before clipping.

    This rank holds parts of the full gradient: ``sharded`` ones are split over ``tp_group``
    (tensor parallelism: their squares are summed over it), ``replicated`` ones are the same
    on every tp rank (counted once). With ``reduce_group`` (ZeRO: each rank holds other rows
    of every tensor) both sums of squares are first summed over that group: one all-reduce of
    two floats, and one of one float over tp. With ``pp_group`` (pipeline: each rank holds other
    layers) both are then summed over the pipeline ranks too.
    """
    grads = sharded + replicated
    squares = torch.zeros(2, dtype=torch.float32, device=grads[0].device if grads else None)
    for i, part in enumerate((sharded, replicated)):
        for g in part:
            squares[i] += g.float().pow(2).sum()
    for group in (reduce_group, pp_group):
        if group is not None:
            dist.all_reduce(squares, group=group)
    if tp_group is not None:
        shard_sum = squares[:1].clone()
        dist.all_reduce(shard_sum, group=tp_group)
        squares[0] = shard_sum[0]
    norm = squares.sum().sqrt()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm
