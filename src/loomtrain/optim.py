"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
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
