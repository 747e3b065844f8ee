"""Architecture descriptions for the planner: a model's shape as data, and its parameter count.

Two families: ``llama`` (our :class:`~loomtrain.models.llama.Transformer`: RMSNorm, SwiGLU,
rotary positions, grouped-query attention, no biases) and ``gpt`` (GPT-3 as Megatron-LM trains it:
LayerNorm with bias, GELU MLP of width ``4h``, learned positions, biases on every linear, output
head tied to the embedding). The planner reads only these fields; it never builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FAMILIES = ("llama", "gpt")


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape.

    Attributes:
        family: ``llama`` or ``gpt`` (module docstring).
        n_layers: transformer blocks (``L``).
        hidden: model width (``h``).
        n_heads: query heads (``a``).
        n_kv_heads: key/value heads (grouped-query attention); ``n_heads`` for ``gpt``.
        ffn_hidden: MLP width (``f``): the SwiGLU width for ``llama``, ``4h`` for ``gpt``.
        vocab_size: embedding rows (``V``).
        max_seq_len: positions; ``gpt`` learns one embedding row per position.
        tie_embeddings: the output head is the embedding matrix.
        name: label for reports.

    Raises:
        ValueError: an unknown ``family``, a non-positive size, ``hidden`` not divisible by
            ``n_heads``, or ``n_heads`` not divisible by ``n_kv_heads``.
    """

    family: Literal["llama", "gpt"]
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Architecture.family={self.family!r}; choose one of {', '.join(FAMILIES)}")
        sizes = ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len")
        for field in sizes:
            if getattr(self, field) < 1:
                raise ValueError(f"Architecture.{field}={getattr(self, field)} must be at least 1")
        if self.hidden % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Architecture: hidden={self.hidden} must be divisible by n_heads={self.n_heads}, and n_heads by "
                f"n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``h / a``."""
        return self.hidden // self.n_heads

    @property
    def kv_width(self) -> int:
        """Key (and value) projection width ``k = n_kv_heads · head_dim``."""
        return self.n_kv_heads * self.head_dim

    def layer_params(self) -> tuple[int, int]:
        """Parameters (elements) of one block: ``(split, replicated)`` under tensor parallelism.

        ``split``: the weight matrices, and for ``gpt`` the biases of the column-parallel linears
        (QKV, first MLP linear), which Megatron tensor parallelism divides by ``t``. ``replicated``:
        norm weights (and biases), and for ``gpt`` the biases of the row-parallel linears (attention
        output, second MLP linear), kept whole on every tensor-parallel rank.

        ``llama`` (no biases): ``split = 2h² + 2hk + 3hf``, ``replicated = 2h``.
        ``gpt``: ``split = 4h² + 2hf + 3h + f`` and ``replicated = 6h`` (two LayerNorms of weight
        and bias, two output biases); with ``f = 4h`` the sum is Narayanan et al. (SC 2021, §5.1)'s
        ``12h² + 13h`` per layer.
        """
        h, k, f = self.hidden, self.kv_width, self.ffn_hidden
        if self.family == "llama":
            return 2 * h * h + 2 * h * k + 3 * h * f, 2 * h
        return 4 * h * h + 2 * h * f + 3 * h + f, 6 * h

    def embedding_params(self) -> int:
        """Token embedding (``Vh``), plus ``gpt``'s learned positions (``max_seq_len · h``)."""
        positions = self.max_seq_len * self.hidden if self.family == "gpt" else 0
        return self.vocab_size * self.hidden + positions

    def head_params(self) -> int:
        """Final norm (``h`` for RMSNorm, ``2h`` for LayerNorm) and the output head (``Vh`` unless tied)."""
        norm = self.hidden if self.family == "llama" else 2 * self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab_size * self.hidden)

    def param_count(self) -> int:
        """Parameters (elements) of the whole model: ``L · (split + replicated)`` + embedding + head.

        For ``llama`` this is :func:`loomtrain.models.presets.param_count` derived independently
        (tests/unit/test_planner_memory.py checks they agree); for ``gpt`` it is Narayanan et al.
        (SC 2021) §5.1's ``12Lh²(1 + 13/(12h) + (V + s)/(12Lh))`` plus the final LayerNorm's ``2h``.
        """
        split, replicated = self.layer_params()
        return self.n_layers * (split + replicated) + self.embedding_params() + self.head_params()


def from_model_config(cfg: Any, name: str = "") -> Architecture:
    """The ``llama`` description of a :class:`~loomtrain.config.ModelConfig` (read by field name,
    so this module does not import the model package).

    Raises:
        ValueError: ``cfg.vocab_size`` is 0 (taken from the tokenizer at run time; give it here).
    """
    if cfg.vocab_size <= 0:
        raise ValueError("model.vocab_size=0; the planner needs the vocabulary size: set model.vocab_size")
    return Architecture(
        family="llama",
        n_layers=cfg.n_layers,
        hidden=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.kv_heads,
        ffn_hidden=cfg.hidden_dim,
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_seq_len,
        tie_embeddings=cfg.tie_embeddings,
        name=name or (cfg.preset or ""),
    )


def gpt(
    n_layers: int, hidden: int, n_heads: int, vocab_size: int = 51200, seq_len: int = 2048, name: str = ""
) -> Architecture:
    """A GPT-3-style shape as Megatron-LM trains it: MLP width ``4h``, tied head, learned positions.

    Defaults: Megatron's padded GPT-2 vocabulary of 51,200 and a 2,048-token context (Narayanan et
    al., SC 2021, §5.1: "All models use a vocabulary size of 51,200 ... and a sequence length of 2048").

    Raises:
        ValueError: as :class:`Architecture`.
    """
    return Architecture("gpt", n_layers, hidden, n_heads, n_heads, 4 * hidden, vocab_size, seq_len, True, name)


# Brown et al., "Language Models are Few-Shot Learners" (2020), Table 2.1 (n_layers, d_model,
# n_heads; context 2048) with GPT-2's 50,257-token vocabulary (§2.1: the GPT-2 tokenizer).
GPT3_175B = gpt(96, 12288, 96, vocab_size=50257, name="gpt3-175b")

# Planner-side presets for shapes loomtrain's model class cannot build (GPT-3: LayerNorm, GELU, learned
# positions). The Llama presets live in loomtrain.models.presets (they are ModelConfig shapes).
ARCH_PRESETS: dict[str, Architecture] = {"gpt3-175b": GPT3_175B}
