"""Hugging Face ``transformers`` Llama checkpoints in and out: ``--model.init_from=hf:DIR`` and
``loomtrain export --to hf``.

What maps to what (loomtrain name → ``LlamaForCausalLM`` name; every tensor is copied as is):

==============================  =============================================
``tok_embeddings.weight``       ``model.embed_tokens.weight``
``layers.i.attention.wq|wk|wv|wo``  ``model.layers.i.self_attn.q_proj|k_proj|v_proj|o_proj``
``layers.i.feed_forward.w1|w3|w2``  ``model.layers.i.mlp.gate_proj|up_proj|down_proj``
``layers.i.attention_norm``     ``model.layers.i.input_layernorm``
``layers.i.ffn_norm``           ``model.layers.i.post_attention_layernorm``
``norm.weight``                 ``model.norm.weight``
``output.weight``               ``lm_head.weight`` (absent when the embeddings are tied)
==============================  =============================================

Rotary embedding: RoFormer (Su et al. 2021, §3.4) rotates adjacent pairs ``(2j, 2j+1)``; Meta's
original Llama checkpoints do so, and ``transformers``' conversion script permutes the rows of
``wq`` and ``wk`` into the rotate-half layout (pair ``j`` with ``j + head_dim/2``) that its
``apply_rotary_pos_emb`` uses. loomtrain's ``apply_rotary`` uses rotate-half too, with the same
frequencies ``theta^(-2j/head_dim)``, so q/k rows are copied unpermuted both ways; grouped-query
attention needs nothing either, as both keep the ``n_kv_heads`` key/value heads contiguous.

Config fields (``ModelConfig`` → ``LlamaConfig``): ``dim``→``hidden_size``, ``n_layers``→
``num_hidden_layers``, ``n_heads``→``num_attention_heads``, ``n_kv_heads``→``num_key_value_heads``,
``hidden_dim``→``intermediate_size``, ``vocab_size``, ``max_seq_len``→``max_position_embeddings``,
``rope_theta``, ``norm_eps``→``rms_norm_eps``, ``tie_embeddings``→``tie_word_embeddings``.
Source of the HF side: ``transformers/models/llama/modeling_llama.py`` and
``configuration_llama.py`` (transformers 5.x).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from loomtrain.checkpoint import find_latest_checkpoint, list_checkpoints, load_model_weights, verify_checkpoint
from loomtrain.config import Config, ConfigError, ModelConfig, load_config
from loomtrain.data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer, load_tokenizer
from loomtrain.models import Transformer

if TYPE_CHECKING:
    from transformers import LlamaConfig

_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_FROM_HF_TOP = {hf: ours for ours, hf in _TOP_NAMES.items()}
_FROM_HF_BLOCK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Older transformers saved the rotary frequencies as a buffer; loomtrain recomputes them.
_HF_SKIPPED = re.compile(r"rotary_emb\.inv_freq$")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def hf_name(name: str) -> str:
    """The ``LlamaForCausalLM`` name of loomtrain parameter ``name`` (table in the module docstring).

    Raises:
        KeyError: ``name`` is not a parameter of loomtrain's Llama.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise KeyError(f"parameter {name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}"


def loomtrain_name(name: str) -> str:
    """The loomtrain name of ``LlamaForCausalLM`` tensor ``name``; inverse of :func:`hf_name`.

    Raises:
        KeyError: ``name`` is not a tensor of Hugging Face's Llama.
    """
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    match = _HF_LAYER.match(name)
    if match is None or match[2] not in _FROM_HF_BLOCK:
        raise KeyError(f"tensor {name!r} is not part of a Hugging Face Llama model")
    return f"layers.{match[1]}.{_FROM_HF_BLOCK[match[2]]}"


def to_hf_state_dict(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """loomtrain's ``state_dict`` renamed for ``LlamaForCausalLM``, tensors unchanged (contiguous).

    Shapes are the same on both sides: embedding and head ``[vocab_size, dim]``, ``wq``/``wo``
    ``[n_heads·head_dim, dim]``/``[dim, n_heads·head_dim]``, ``wk``/``wv`` ``[n_kv_heads·head_dim,
    dim]``, ``w1``/``w3`` ``[hidden_dim, dim]``, ``w2`` ``[dim, hidden_dim]``, norms ``[dim]``.
    ``tied``: the output head is the embedding, so ``lm_head.weight`` is left out (as
    ``save_pretrained`` does; safetensors stores no shared tensors).

    Raises:
        KeyError: a name without a Hugging Face counterpart.
    """
    return {hf_name(k): v.detach().contiguous() for k, v in state.items() if not (tied and k == "output.weight")}


def from_hf_state_dict(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` ``state_dict`` renamed for loomtrain's ``Transformer`` (shapes as
    in :func:`to_hf_state_dict`, tensors unchanged).

    ``tied``: ``output.weight`` is the embedding (``lm_head.weight`` may be absent). Saved
    rotary-frequency buffers are dropped.

    Raises:
        KeyError: a tensor that is not part of Hugging Face's Llama.
    """
    ours = {loomtrain_name(k): v for k, v in state.items() if not _HF_SKIPPED.search(k)}
    if tied:
        ours["output.weight"] = ours["tok_embeddings.weight"]
    return ours


def check_llama_able(m: ModelConfig) -> None:
    """Refuse a model that ``LlamaForCausalLM`` would not reproduce.

    Every shape field maps (module docstring). Dropout does not: HF Llama drops only attention
    probabilities (``attention_dropout``), loomtrain also the attention and MLP outputs.

    Raises:
        ConfigError: ``model.dropout`` above 0.
    """
    if m.dropout > 0:
        raise ConfigError(
            f"model.dropout={m.dropout}: Hugging Face Llama has no dropout on the attention and MLP outputs, "
            "so it cannot express this model; export supports runs trained with model.dropout=0"
        )


def llama_config(m: ModelConfig) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` of loomtrain model ``m`` (fp32, no special token ids).

    Raises:
        ConfigError: see :func:`check_llama_able`; ``model.vocab_size`` still 0.
    """
    from transformers import LlamaConfig

    check_llama_able(m)
    if m.vocab_size <= 0:
        raise ConfigError("model.vocab_size=0: take it from the run's tokenizer before exporting")
    return LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim, hidden_act="silu",
        max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, architectures=["LlamaForCausalLM"], dtype="float32",
    )  # fmt: skip


def _rope(hf: LlamaConfig) -> tuple[str, float]:
    """(rope type, theta) of an HF config: ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` with ``rope_scaling``."""
    params = getattr(hf, "rope_parameters", None) or {
        **(getattr(hf, "rope_scaling", None) or {}),
        "rope_theta": getattr(hf, "rope_theta", 10000.0),
    }
    return params.get("rope_type", params.get("type", "default")), float(params["rope_theta"])


def _unsupported(hf: LlamaConfig) -> list[str]:
    """The fields of HF Llama config ``hf`` that loomtrain's model cannot reproduce."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope_type = _rope(hf)[0]
    checks = [
        (hf.hidden_act != "silu", f"hidden_act={hf.hidden_act!r} (loomtrain's SwiGLU uses 'silu')"),
        (getattr(hf, "attention_bias", False), "attention_bias=true (loomtrain's projections have no bias)"),
        (getattr(hf, "mlp_bias", False), "mlp_bias=true (loomtrain's MLP has no bias)"),
        (head_dim * hf.num_attention_heads != hf.hidden_size, f"head_dim={head_dim} is not hidden_size/num_heads"),
        (rope_type != "default", f"rope_type={rope_type!r} (loomtrain's rotary embedding is the unscaled 'default')"),
    ]
    return [what for bad, what in checks if bad]


def model_fields(hf: LlamaConfig) -> dict:
    """The ``ModelConfig`` fields (shapes, rotary base, norm epsilon, tying) of HF Llama config ``hf``."""
    return {
        "dim": hf.hidden_size, "n_layers": hf.num_hidden_layers, "n_heads": hf.num_attention_heads,
        "n_kv_heads": hf.num_key_value_heads or hf.num_attention_heads, "ffn_hidden_dim": hf.intermediate_size,
        "vocab_size": hf.vocab_size, "rope_theta": _rope(hf)[1], "norm_eps": hf.rms_norm_eps,
        "max_seq_len": hf.max_position_embeddings, "tie_embeddings": bool(hf.tie_word_embeddings),
    }  # fmt: skip


def _init_dir(init_from: str) -> Path:
    return Path(init_from.removeprefix("hf:"))


def read_hf_config(init_from: str) -> LlamaConfig:
    """The ``LlamaConfig`` of ``model.init_from`` (``hf:DIR``), checked to fit loomtrain's model.

    Raises:
        ConfigError: naming ``model.init_from``: no ``DIR/config.json``, a model type other
            than ``llama``, or a Llama feature loomtrain's model lacks (:func:`_unsupported`).
    """
    path = _init_dir(init_from) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.init_from={init_from!r}: {path} does not exist; give a directory written by "
            "transformers' save_pretrained (config.json + model.safetensors)"
        )
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type != "llama":
        raise ConfigError(
            f"model.init_from={init_from!r} holds a {model_type!r} model; only Llama (model_type 'llama') maps "
            "onto loomtrain's model"
        )
    from transformers import LlamaConfig

    hf = LlamaConfig.from_pretrained(path.parent)
    problems = _unsupported(hf)
    if problems:
        raise ConfigError(f"model.init_from={init_from!r} is not a Llama loomtrain can run: {'; '.join(problems)}")
    return hf


def resolve_init_from(cfg: Config) -> Config:
    """``cfg`` with its model section's shapes taken from ``model.init_from`` (unchanged without it).

    Runs before any process group exists (``loomtrain train`` does it right after parsing), so
    the world checks and the saved ``config.toml`` see the checkpoint's shapes. The rest of the
    config is validated again against them.

    Raises:
        ConfigError: see :func:`read_hf_config`; the new shapes break another setting (e.g.
            heads not divisible by ``parallel.tensor_parallel_degree``).
    """
    if cfg.model.init_from is None:
        return cfg
    fields = model_fields(read_hf_config(cfg.model.init_from))
    data = cfg.model_dump()
    data["model"].update(fields)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise ConfigError(f"model.init_from={cfg.model.init_from!r} sets {fields}, which fails: {reasons}") from None


def _weight_files(init_from: str) -> list[Path]:
    """The safetensors files of ``hf:DIR``: the shards of its index, or ``model.safetensors``.

    Raises:
        ConfigError: neither exists.
    """
    directory = _init_dir(init_from)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if not (directory / SAFETENSORS_FILE).is_file():
        raise ConfigError(
            f"model.init_from={init_from!r}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {directory}; "
            "save the model with save_pretrained(..., safe_serialization=True)"
        )
    return [directory / SAFETENSORS_FILE]


def _hf_tensors(init_from: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every tensor of ``hf:DIR``, one at a time (peak memory: one tensor)."""
    for path in _weight_files(init_from):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


@torch.no_grad()
def load_hf_weights(model: Transformer, init_from: str) -> None:
    """Copy the weights of ``init_from`` (``hf:DIR``) into the whole, unsharded ``model`` in place.

    Tensors are renamed (:func:`loomtrain_name`), cast to the parameters' dtype and device and
    checked name by name and shape by shape; ``model.cfg`` must have been resolved from the same
    directory (:func:`resolve_init_from`).

    Raises:
        ConfigError: naming ``model.init_from``: a tensor that is missing, unknown, or of
            another shape than the model's.
    """
    targets = model.state_dict(keep_vars=True)  # both names of a tied weight
    loaded: set[str] = set()
    for key, tensor in _hf_tensors(init_from):
        if _HF_SKIPPED.search(key):
            continue
        name = _target_name(key, targets, init_from)
        if targets[name].shape != tensor.shape:
            raise ConfigError(
                f"model.init_from={init_from!r}: {key} has shape {list(tensor.shape)}, the model's {name} "
                f"{list(targets[name].shape)}; resolve the config from the checkpoint (resolve_init_from)"
            )
        targets[name].copy_(tensor)
        loaded.add(name)
    missing = set(targets) - loaded - ({"output.weight"} if model.cfg.tie_embeddings else set())
    if missing:
        raise ConfigError(f"model.init_from={init_from!r} lacks {sorted(map(hf_name, missing))[:3]}")


def _target_name(key: str, targets: dict, init_from: str) -> str:
    try:
        name = loomtrain_name(key)
    except KeyError:
        name = None
    if name not in targets:
        raise ConfigError(f"model.init_from={init_from!r}: tensor {key} has no place in loomtrain's Llama")
    return name


def _char_tokenizer(chars: list[str]) -> RustTokenizer:
    """A word-level model over single characters: each code point is its own pre-token (the
    pattern ``[\\s\\S]`` matches one, newlines included) and decoding joins them unspaced."""
    tok = RustTokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def hf_tokenizer(tok: Tokenizer) -> RustTokenizer:
    """``tok`` as a ``tokenizers.Tokenizer`` with the same ids: BPE as it is, the character
    tokenizer as a word-level model over its characters.

    Raises:
        TypeError: another kind of tokenizer.
    """
    if isinstance(tok, BPETokenizer):
        return tok.hf
    if isinstance(tok, CharTokenizer):
        return _char_tokenizer(tok.chars)
    raise TypeError(f"no Hugging Face form for tokenizer kind {tok.kind!r}")


def save_hf_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    """Write ``tok`` into ``out`` as a ``PreTrainedTokenizerFast`` (``tokenizer.json``,
    ``tokenizer_config.json``) that ``AutoTokenizer.from_pretrained(out)`` loads. Spaces are not
    "cleaned up" on decoding, so decoding gives back the encoded text exactly."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=hf_tokenizer(tok), clean_up_tokenization_spaces=False, model_max_length=max_len
    )
    fast.save_pretrained(str(out))


def checkpoint_state_dict(checkpoint: Path, m: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole model's weights (fp32, CPU) from a DCP checkpoint of any layout, in this process.

    The model is built on the meta device and given uninitialised CPU storage, which the
    checkpoint then fills: DCP reshards tp/pp/ZeRO shards into full tensors by name.

    Raises:
        ValueError: the checkpoint's parameter names do not fit ``m``.
    """
    with torch.device("meta"):
        model = Transformer(m)
    model.to_empty(device="cpu")
    load_model_weights(checkpoint, model)
    return model.state_dict()


def _run_config(run: Path) -> Config:
    if not (run / "config.toml").is_file():
        raise ConfigError(f"--run={str(run)!r} is not a run directory (no config.toml); give runs/<name>")
    return load_config(run / "config.toml")


def _checkpoint(run: Path, step: int | None) -> Path:
    """The checkpoint to export: ``step``'s, or the newest complete one.

    Raises:
        ConfigError: no such checkpoint, or it is incomplete or corrupted.
    """
    directory = run / "checkpoints"
    if step is None:
        latest = find_latest_checkpoint(directory)
        if latest is None:
            raise ConfigError(f"--run={str(run)!r} has no complete checkpoint in {directory}")
        return latest
    path = directory / f"step_{step:08d}"
    problem = verify_checkpoint(path) if path.is_dir() else "it does not exist"
    if problem:
        raise ConfigError(
            f"--step={step}: checkpoint {path} cannot be exported ({problem}); the run has steps "
            f"{[int(p.name.removeprefix('step_')) for p in list_checkpoints(directory)]}"
        )
    return path


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out={str(out)!r} exists and is not an empty directory; give a new directory")


def export_hf(run: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write run ``run``'s checkpoint (``step``, default the newest complete one) into ``out`` as
    a Hugging Face Llama: ``config.json``, ``model.safetensors`` (fp32) and the tokenizer, which
    ``AutoModelForCausalLM.from_pretrained(out)`` and ``AutoTokenizer.from_pretrained(out)``
    load. Returns the checkpoint exported.

    Raises:
        ConfigError: ``run`` is not a run directory; its model is not expressible as HF Llama
            (:func:`check_llama_able`); no such checkpoint, or one that does not fit the run's
            config; ``out`` exists and is not empty.
    """
    run, out = Path(run), Path(out)
    cfg = _run_config(run)
    check_llama_able(cfg.model)
    checkpoint = _checkpoint(run, step)
    _check_out(out)
    tokenizer = load_tokenizer(run / "tokenizer")
    cfg.model.vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    try:
        weights = checkpoint_state_dict(checkpoint, cfg.model)
    except ValueError as err:  # checkpoint names that the run's own config does not produce
        raise ConfigError(f"--run={str(run)!r}: {err}") from None
    state = to_hf_state_dict(weights, cfg.model.tie_embeddings)
    out.mkdir(parents=True, exist_ok=True)
    llama_config(cfg.model).save_pretrained(str(out))
    save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    save_hf_tokenizer(tokenizer, out, cfg.model.max_seq_len)
    return checkpoint
