"""Llama-style decoder, its FLOP count and sampling."""

from loomtrain.models.flops import count_params, flops_per_step, flops_per_token
from loomtrain.models.generate import generate
from loomtrain.models.llama import (
    Attention,
    CoreAttention,
    FeedForward,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rotary,
    rope_cache,
)

__all__ = [
    "Attention",
    "CoreAttention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rotary",
    "count_params",
    "flops_per_step",
    "flops_per_token",
    "generate",
    "rope_cache",
]
