"""Parameter and FLOP counts: the one place in loomtrain where FLOPs are counted.

Throughput and MFU figures everywhere else call :func:`flops_per_token` or
:func:`flops_per_step`, so that every report uses the same definition.
"""

from __future__ import annotations

from torch import nn

from loomtrain.config import ModelConfig

# One multiply-add is two floating-point operations.
FLOP_PER_MAC = 2
# Backward costs twice the forward for every matmul: one product for the input's gradient,
# one for the weight's (Kaplan et al. 2020 §2.1).
TRAIN_FORWARD_MULTIPLE = 3


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of distinct parameters (elements) of ``model``.

    A Parameter shared by two modules (tied input and output embeddings) is counted once. A
    sharded parameter (DTensor) counts its global size.

    Args:
        exclude_embedding: leave out the weights of every ``nn.Embedding`` (the lookup
            tables), as Kaplan et al. (2020) §2.1 do for their ``N``. With tied embeddings this
            also leaves out the output head, which is the same tensor.
    """
    params = {id(p): p for p in model.parameters()}
    if exclude_embedding:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOP per token (forward and backward) of :class:`~loomtrain.models.llama.Transformer`.

    Every matmul is counted at 2 FLOP per multiply-add; norms, softmax, rotary and other
    elementwise work are left out, as is the embedding lookup (a gather, 0 FLOP). With
    ``d = cfg.dim``, ``d_kv = kv_heads·head_dim``, ``f = cfg.hidden_dim``, ``L = n_layers``,
    ``V = vocab_size`` and ``s = seq_len``, the forward per token is::

        L · [ 2·d·(2·d + 2·d_kv)      # wq, wo; wk, wv (grouped-query aware)
            + 2·3·d·f                 # SwiGLU w1, w2, w3
            + 2·2·s·d ]               # scores Q·Kᵀ and their product with V
        + 2·d·V                       # output head

    and training is 3 × forward (Kaplan et al., "Scaling Laws for Neural Language Models"
    (2020) §2.1: the backward pass costs two forwards). Kaplan's forward ``2N + 2·n_layer·
    n_ctx·d_attn`` has the weight matmuls above as its ``2N`` but counts only one of the two
    ``s × s`` attention matmuls; we count both, over the full square rather than the causal
    half, as Chowdhery et al., "PaLM" (2022) Appendix B (``6N + 12·L·H·Q·T`` for training),
    nanoGPT's MFU estimate and ``torch.utils.flop_counter`` do.

    Returns:
        FLOP per token, float.
    """
    d, f = cfg.dim, cfg.hidden_dim
    d_kv = cfg.kv_heads * cfg.head_dim
    projections = FLOP_PER_MAC * d * (2 * d + 2 * d_kv)
    swiglu = FLOP_PER_MAC * 3 * d * f
    attention = FLOP_PER_MAC * 2 * seq_len * d
    head = FLOP_PER_MAC * d * cfg.vocab_size
    forward = cfg.n_layers * (projections + swiglu + attention) + head
    return float(TRAIN_FORWARD_MULTIPLE * forward)


def flops_per_step(cfg: ModelConfig, seq_len: int, tokens: int) -> float:
    """Training FLOP for ``tokens`` tokens in sequences of ``seq_len``: ``tokens × flops_per_token``."""
    return flops_per_token(cfg, seq_len) * tokens
