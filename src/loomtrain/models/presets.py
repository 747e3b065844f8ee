"""Published Llama shapes by name: ``--model.preset=llama3-8b``.

A preset fills the shape fields of the ``[model]`` section that the user did not give; a field
given in the TOML file or as ``--model.key=value`` wins. One field is derived rather than copied
when the user changes the width: the SwiGLU width keeps the preset's ratio to ``dim`` (3.5 for
Llama 3 8B), rounded up to ``multiple_of``, unless ``ffn_hidden_dim`` is given too. So
``--model.preset=llama3-8b --model.n_layers=2 --model.dim=64`` is Llama 3 8B at reduced depth
and width (FFN 224), small enough for a CPU test.

Sources (see docs/presets.md for the table):

- Llama 2: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models" (2023),
  Table 1 (context 4k, grouped-query attention for 70B); widths, layers and heads from Meta's
  ``params.json`` and the Hugging Face ``config.json`` of ``meta-llama/Llama-2-{7,13,70}b-hf``.
- Llama 3 8B, 70B, 405B: Llama Team, "The Llama 3 Herd of Models" (2024), Table 3 (layers,
  model dimension, attention heads, 8 key/value heads, RoPE θ = 500,000) and §3.4.1 (8K-token
  pre-training context); FFN widths and the 128,256-token vocabulary from the Hugging Face
  ``config.json`` (``intermediate_size``, ``vocab_size``), the same as Meta's ``params.json``
  (``ffn_dim_multiplier`` 1.3, 1.3, 1.2 with ``multiple_of`` 1024, 4096, 4096).
- Llama 3.2 1B, 3B: the Hugging Face ``config.json`` of ``meta-llama/Llama-3.2-{1,3}B`` (tied
  embeddings) and the Llama 3.2 model card (parameter counts).

``max_seq_len`` is the pre-training context (4096 for Llama 2, 8192 for Llama 3): the 128K
context of the released Llama 3.1 and 3.2 weights comes from a long-context stage with a
rescaling of the RoPE frequencies (Hugging Face ``rope_scaling`` type ``llama3``) that
loomtrain's rotary embedding does not implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loomtrain.config import ModelConfig

_LLAMA2 = {"n_kv_heads": None, "vocab_size": 32000, "max_seq_len": 4096, "rope_theta": 10000.0, "norm_eps": 1e-5}
_LLAMA3 = {"n_kv_heads": 8, "vocab_size": 128256, "max_seq_len": 8192, "rope_theta": 500000.0, "norm_eps": 1e-5}


@dataclass(frozen=True)
class Preset:
    """A published model shape.

    Attributes:
        shape: ``ModelConfig`` field → value (``n_layers``, ``dim``, ``n_heads``, ``n_kv_heads``,
            ``ffn_hidden_dim``, ``vocab_size``, ``max_seq_len``, ``rope_theta``, ``norm_eps``,
            ``tie_embeddings``).
        published_params: the parameter count its publisher gives (elements, not bytes).
        source: where the shape and the count were published.
    """

    shape: dict[str, Any]
    published_params: float
    source: str


def _shape(base: dict[str, Any], n_layers: int, dim: int, n_heads: int, ffn: int, **extra: Any) -> dict[str, Any]:
    return {**base, "n_layers": n_layers, "dim": dim, "n_heads": n_heads, "ffn_hidden_dim": ffn,
            "tie_embeddings": False, **extra}  # fmt: skip


_L2, _L3 = "Llama 2 paper Table 1; HF meta-llama/", "Llama 3 paper Table 3; HF meta-llama/"
PRESETS: dict[str, Preset] = {
    "llama2-7b": Preset(_shape(_LLAMA2, 32, 4096, 32, 11008), 6.74e9, _L2 + "Llama-2-7b-hf"),
    "llama2-13b": Preset(_shape(_LLAMA2, 40, 5120, 40, 13824), 13.0e9, _L2 + "Llama-2-13b-hf"),
    "llama2-70b": Preset(_shape(_LLAMA2, 80, 8192, 64, 28672, n_kv_heads=8), 69.0e9, _L2 + "Llama-2-70b-hf"),
    "llama3-8b": Preset(_shape(_LLAMA3, 32, 4096, 32, 14336), 8.03e9, _L3 + "Meta-Llama-3-8B"),
    "llama3-70b": Preset(_shape(_LLAMA3, 80, 8192, 64, 28672), 70.6e9, _L3 + "Meta-Llama-3-70B"),
    "llama3-405b": Preset(_shape(_LLAMA3, 126, 16384, 128, 53248), 406e9, _L3 + "Llama-3.1-405B"),
    "llama3.2-1b": Preset(
        _shape(_LLAMA3, 16, 2048, 32, 8192, tie_embeddings=True),
        1.23e9,
        "Llama 3.2 model card; HF meta-llama/Llama-3.2-1B",
    ),
    "llama3.2-3b": Preset(
        _shape(_LLAMA3, 28, 3072, 24, 8192, tie_embeddings=True),
        3.21e9,
        "Llama 3.2 model card; HF meta-llama/Llama-3.2-3B",
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: no such preset; the message lists the known names.
    """
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def fill_from_preset(fields: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` section ``fields`` (as given by the user) with ``fields["preset"]``'s shape
    filled in where the user gave no value.

    When the user gives ``dim`` but not ``ffn_hidden_dim``, the SwiGLU width is the preset's
    scaled by ``dim / preset dim``, rounded up to ``multiple_of`` (given, or the field's default),
    so a reduced model keeps the preset's FFN-to-width ratio.

    Raises:
        ValueError: unknown preset, or a preset together with ``init_from`` (both choose the shape).
    """
    preset = get_preset(fields["preset"])
    if fields.get("init_from") is not None:
        raise ValueError(
            f"model.preset={fields['preset']!r} and model.init_from={fields['init_from']!r} both choose the model's "
            "shape; drop one of them"
        )
    filled = {**preset.shape, **fields}
    width = fields.get("dim", preset.shape["dim"])
    step = fields.get("multiple_of", ModelConfig.model_fields["multiple_of"].default)
    # A non-integer or non-positive dim/multiple_of is left for the fields' own validation to report.
    if "ffn_hidden_dim" not in fields and _positive_ints(width, step) and width != preset.shape["dim"]:
        ffn, dim = preset.shape["ffn_hidden_dim"], preset.shape["dim"]
        filled["ffn_hidden_dim"] = -(-ffn * width // (dim * step)) * step
    return filled


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def preset_config(name: str, **fields: Any) -> ModelConfig:
    """``ModelConfig`` of preset ``name``, with ``fields`` given explicitly (they win).

    Raises:
        ValueError: as :func:`fill_from_preset`, or an invalid field (pydantic's ValidationError).
    """
    return ModelConfig(preset=name, **fields)


def param_count(cfg: ModelConfig) -> int:
    """Parameters (elements) of :class:`~loomtrain.models.llama.Transformer` built from ``cfg``,
    counted from the shapes without building it (a 405B model counts in microseconds).

    With ``d = dim``, ``q = n_heads·head_dim``, ``k = kv_heads·head_dim``, ``f = hidden_dim``,
    ``L = n_layers`` and ``V = vocab_size``::

        L · (d·q + 2·d·k + q·d      # wq; wk, wv; wo
             + 3·d·f                # SwiGLU w1, w2, w3
             + 2·d)                 # the two RMSNorm weights
        + d + V·d + V·d             # final norm, embedding, output head (once if tied)

    ``tests/unit/test_presets.py`` checks it against ``count_params`` of built models.
    """
    d, q, k = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layer = d * q + 2 * d * k + q * d + 3 * d * cfg.hidden_dim + 2 * d
    heads = 1 if cfg.tie_embeddings else 2
    return cfg.n_layers * layer + d + heads * cfg.vocab_size * d


def preset_param_count(name: str) -> int:
    """Parameters (elements) of preset ``name`` as loomtrain builds it (:func:`param_count`).

    Raises:
        ValueError: unknown preset.
    """
    return param_count(preset_config(name))
