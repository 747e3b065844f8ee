"""The Hugging Face Llama mapping in one process: weights by name, the rotary convention, GQA,
tied embeddings, sharded safetensors, the config fields both ways, and the tokenizers.

Tolerance for logits: ``1e-5`` absolute (fp32). Both models compute the same function; only
the order of float sums differs (~5e-7 here, weights of std 0.2 so logits are O(1)). A q/k
permutation for the interleaved rotary convention, or swapped GQA heads, moves logits by ~1e-1.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from loomtrain.config import ConfigError, ModelConfig
from loomtrain.data import BPETokenizer, CharTokenizer
from loomtrain.interop.hf import (
    from_hf_state_dict,
    llama_config,
    load_hf_weights,
    model_fields,
    save_hf_tokenizer,
    to_hf_state_dict,
)
from loomtrain.models import Transformer

LOGIT_ATOL = 1e-5
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=80, max_position_embeddings=32, rope_theta=5e5, rms_norm_eps=1e-6)  # fmt: skip
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\tSpeak, speak.  é!\n"


def random_hf(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return model


def max_logit_diff(hf: LlamaForCausalLM, ours: Transformer) -> float:
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, SHAPE["max_position_embeddings"]),
                           generator=torch.Generator().manual_seed(1))  # fmt: skip
    with torch.no_grad():
        return (hf(tokens).logits - ours.eval()(tokens)).abs().max().item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mapped_weights_give_hf_logits(tied):
    """Catches: q/k rows permuted for the interleaved rotary convention (loomtrain and HF both
    rotate halves), GQA key/value heads mapped in the wrong order, gate/up projections swapped,
    input and post-attention norms swapped, and a tied head not tied after the mapping."""
    hf = random_hf(tied)
    ours = Transformer(ModelConfig(**model_fields(hf.config)))
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), tied))
    assert max_logit_diff(hf, ours) <= LOGIT_ATOL
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    exported = to_hf_state_dict(ours.state_dict(), tied)
    assert exported.keys() == {k for k in hf.state_dict() if not (tied and k == "lm_head.weight")}
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in exported.items())


def test_config_fields_round_trip():
    """Catches: a field lost or renamed between ModelConfig and LlamaConfig (rotary base, norm
    epsilon, GQA heads, SwiGLU width, tying), which would load but compute another model."""
    m = ModelConfig(n_layers=3, n_heads=4, n_kv_heads=2, dim=64, ffn_hidden_dim=96, max_seq_len=48, vocab_size=70,
                    tie_embeddings=True, rope_theta=5e5, norm_eps=1e-6)  # fmt: skip
    back = model_fields(llama_config(m))
    assert ModelConfig(**back).model_dump() == m.model_dump()
    assert model_fields(LlamaConfig(**SHAPE))["rope_theta"] == SHAPE["rope_theta"]


def test_dropout_is_not_llama():
    """Catches: exporting a model trained with residual dropout, which HF Llama cannot express."""
    with pytest.raises(ConfigError, match="model.dropout=0.1"):
        llama_config(ModelConfig(vocab_size=70, dropout=0.1))


def test_load_hf_weights_from_sharded_checkpoint(tmp_path):
    """Catches: a sharded checkpoint (model.safetensors.index.json) read only in part, a tied
    checkpoint (no lm_head) refused, and weights loaded into a model of other shapes without
    a ConfigError naming model.init_from."""
    hf = random_hf(tied=True)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    m = ModelConfig(**model_fields(hf.config), init_from=f"hf:{tmp_path}")
    ours = Transformer(m)
    load_hf_weights(ours, m.init_from)
    assert max_logit_diff(hf, ours) <= LOGIT_ATOL
    wrong = Transformer(m.model_copy(update={"n_kv_heads": 4}))
    with pytest.raises(ConfigError, match="model.init_from=.*k_proj.weight has shape"):
        load_hf_weights(wrong, m.init_from)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_exported_tokenizer_gives_the_same_ids(kind, tmp_path):
    """Catches: an exported tokenizer whose ids differ from loomtrain's (byte-level BPE with an
    added prefix space, characters merged by a pre-tokenizer) or whose decoding inserts or
    cleans up spaces, so that text does not survive encode → decode."""
    tok = CharTokenizer.from_text(TEXT) if kind == "char" else BPETokenizer.train(TEXT * 4, 300)
    save_hf_tokenizer(tok, tmp_path, max_len=64)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ids = hf(TEXT)["input_ids"]
    assert ids == tok.encode(TEXT)
    assert hf.decode(ids) == TEXT
    assert len(hf) == tok.vocab_size
