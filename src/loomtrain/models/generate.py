"""Autoregressive sampling with temperature and top-k (Fan et al., "Hierarchical Neural Story
Generation", 2018)."""

from __future__ import annotations

import torch
from torch import nn


def _sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from ``logits`` ``[B, V]`` → ``LongTensor[B, 1]``."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    max_seq_len: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend ``prompt_ids`` by ``max_new_tokens`` sampled tokens.

    Each step feeds the last ``max_seq_len`` tokens (the model's context) through ``model``
    without a key/value cache, divides the last position's logits by ``temperature``, keeps the
    ``top_k`` largest (all if ``None``) and samples from their softmax. ``top_k=1`` is greedy
    decoding. The model runs in eval mode (no dropout) and its previous mode is restored.

    Shapes: ``prompt_ids`` ``LongTensor[B, T]`` (usually ``B = 1``) on the model's device →
    ``LongTensor[B, T + max_new_tokens]``, the prompt followed by the new tokens.

    Raises:
        ValueError: ``temperature <= 0``, ``top_k < 1``, ``max_new_tokens < 0`` or an empty
            prompt.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0; use top_k=1 for greedy decoding")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if prompt_ids.shape[-1] == 0:
        raise ValueError("prompt_ids is empty; give at least one token")
    was_training = model.training
    model.eval()
    try:
        ids = prompt_ids
        for _ in range(max_new_tokens):
            logits = model(ids[:, -max_seq_len:])[:, -1, :]
            ids = torch.cat([ids, _sample_next(logits, temperature, top_k, generator)], dim=1)
    finally:
        model.train(was_training)
    return ids
