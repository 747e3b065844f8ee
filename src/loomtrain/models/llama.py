"""Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

The model is plain PyTorch (``nn.Linear``, ``nn.Embedding``) with torchtitan's module names
(``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``, ``norm``, ``output``), so
that tensor, pipeline and data parallelism can be applied from outside by name. Nothing here
knows about process groups.

Sources: Touvron et al., "LLaMA" (2023) §2.2 for the architecture; Zhang & Sennrich (2019) for
RMSNorm; Su et al., "RoFormer" (2021) §3.2-3.4 for rotary embeddings; Shazeer, "GLU Variants
Improve Transformer" (2020) for SwiGLU; Ainslie et al., "GQA" (2023) for grouped-query
attention; Radford et al., GPT-2 (2019) §2.3 for the scaled residual initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loomtrain.config import ModelConfig

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / rms(x) * weight``.

    Computed in at least float32 (float64 stays float64) and cast back to the input dtype, so
    that bf16 activations under autocast do not lose the small mean of squares to rounding.

    Shapes: ``x`` ``[..., dim]`` → same shape and dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles (RoFormer §3.2), float32.

    Frequency ``i`` (of ``head_dim/2``) is ``theta^(-2i/head_dim)``; position ``m`` rotates pair
    ``i`` by ``m·freq_i``. Each table is ``[max_seq_len, head_dim]``: the ``head_dim/2`` angles
    written twice, matching the rotate-half layout of :func:`apply_rotary`.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query or key vectors by their position's angles (RoFormer §3.4).

    Rotate-half convention (GPT-NeoX, Hugging Face Llama): dimension ``j`` of the first half is
    paired with dimension ``j + head_dim/2``, rather than adjacent pairs ``(2j, 2j+1)`` as in
    the paper; the two are the same rotation up to a fixed permutation of the head's weights.

    Shapes: ``x`` ``[B, H, S, head_dim]``; ``cos``, ``sin`` ``[S, head_dim]`` → ``x``'s shape and
    dtype. The rotation is done in float32.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention of rotated queries and keys over their heads.

    A module of its own so that sequence parallelism (Ulysses) can wrap it from outside: it
    is the only part of a block that mixes positions.

    Shapes: ``q`` ``[B, Hq, S, head_dim]``, ``k``, ``v`` ``[B, Hkv, S, head_dim]`` with ``Hq`` a
    multiple of ``Hkv`` → ``[B, Hq, S, head_dim]``.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
        )


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped key/value heads (GQA) and rotary positions.

    ``n_kv_heads`` key/value heads are shared by ``n_heads / n_kv_heads`` query heads each.
    Heads are found with ``view(..., -1, head_dim)``, so a column-sharded ``wq``/``wk``/``wv``
    (tensor parallelism) works without changes here; the sequence length is read from the
    projections' output, so a projection that gathers a sequence-sharded input (Megatron
    sequence parallelism) works too.

    Shapes: ``x`` ``[B, S, dim]`` → ``[B, S, dim]``; ``cos``, ``sin`` ``[≥ S, head_dim]``, the
    angles from the first position of ``x`` on (the first ``S`` are used).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.core = CoreAttention(cfg.dropout)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        batch, seq = q.shape[:2]
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = cos[:seq], sin[:seq]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core(q, k, v)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``.

    Shapes: ``x`` ``[B, S, dim]`` → ``[B, S, dim]``; hidden width ``cfg.hidden_dim``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attention(norm(x))``, ``out = h + feed_forward(norm(h))``.

    Shapes: ``x`` ``[B, S, dim]`` → ``[B, S, dim]``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only language model (Llama architecture, Touvron et al. 2023 §2.2).

    ``forward(tokens)`` maps token ids ``LongTensor[B, S]`` to next-token logits
    ``FloatTensor[B, S, vocab_size]``; the loss is computed by the caller. With
    ``cfg.tie_embeddings`` the output head's weight is the embedding's Parameter object.

    The rotary tables are non-persistent buffers: they are not in ``state_dict`` and are
    recomputed by :meth:`init_weights`, so a model built on the meta device and moved with
    ``to_empty`` gets them back. Keep the model in float32 and get bf16 from autocast or a
    mixed-precision policy: ``model.to(torch.bfloat16)`` would round the tables too.

    Raises:
        ValueError: ``cfg.vocab_size`` is 0 (not yet taken from the tokenizer).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(f"model.vocab_size={cfg.vocab_size}; set it from the tokenizer before building the model")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keyed by the layer's index in the whole model, so a pipeline stage that keeps only some
        # layers still names them (and their checkpoint entries) as the whole model does.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and the rotary tables in place.

        Linears and the embedding: normal, std 0.02. Residual output projections (``wo``,
        ``w2``): std ``0.02 / sqrt(2·n_layers)``, because each layer adds two residual branches
        and the sum's variance should not grow with depth (GPT-2, Radford et al. 2019 §2.3).
        Norm weights: 1. Deterministic under ``torch.manual_seed``.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=INIT_STD)
        for layer in self.layers.values():
            attn, ffn = layer.attention, layer.feed_forward
            for linear in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
                nn.init.normal_(linear.weight, std=INIT_STD)
            for linear in (attn.wo, ffn.w2):
                nn.init.normal_(linear.weight, std=residual_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        cos, sin = rope_cache(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, layers: Sequence[str] | None = None) -> torch.Tensor:
        """Logits for every position, or the hidden states of a run over some layers.

        ``tokens``: token ids ``LongTensor[B, S]`` (embedded first) or hidden states
        ``[B, S, dim]`` from the layers before (passed straight to the first layer run).
        ``start_pos`` is the position of ``tokens[:, 0]`` in its sequence: 0 for a whole
        sequence, the slice's offset when a rank holds a slice of it (sequence parallelism).
        ``layers``: keys of the blocks to run, in order (default: all blocks present). The
        output head runs when the last block of the whole model was run and the head is present;
        otherwise the hidden states ``[B, S, dim]`` are returned. A model whose ``tok_embeddings``,
        ``norm`` and ``output`` were set to ``None`` and some of whose layers were deleted (a
        pipeline stage) runs its part this way.

        Shapes: ``tokens`` ``LongTensor[B, S]`` → ``FloatTensor[B, S, vocab_size]``.

        Raises:
            ValueError: ``start_pos + S`` exceeds ``cfg.max_seq_len``.
        """
        end = start_pos + tokens.shape[1]
        if end > self.cfg.max_seq_len:
            raise ValueError(
                f"input reaches position {end} but model.max_seq_len={self.cfg.max_seq_len}; "
                "crop the input or raise model.max_seq_len"
            )
        # From start_pos on: each attention takes as many positions as its projections give,
        # which is more than x holds when x is a sequence slice that a projection gathers.
        cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        keys = list(self.layers.keys()) if layers is None else list(layers)
        for key in keys:
            h = self.layers[key](h, cos, sin)
        if self.output is None or (keys and keys[-1] != str(self.cfg.n_layers - 1)):
            return h
        return self.output(self.norm(h))
