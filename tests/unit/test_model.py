"""Llama-style Transformer and sampling: each test names the bug it would catch."""

from __future__ import annotations

import pytest
import torch

from loomtrain.config import ModelConfig
from loomtrain.models import RMSNorm, Transformer, apply_rotary, count_params, generate, rope_cache


def tiny(**overrides) -> ModelConfig:
    fields = dict(vocab_size=32, dim=32, n_heads=4, n_layers=2, max_seq_len=16) | overrides
    return ModelConfig(**fields)


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


def test_forward_returns_logits_batch_seq_vocab():
    model = build(tiny())
    logits = model(torch.randint(0, 32, (3, 10)))
    assert logits.shape == (3, 10, 32)
    assert logits.dtype == torch.float32


def test_changing_token_t_never_changes_logits_before_t():
    model = build(tiny()).eval()
    tokens = torch.randint(0, 32, (2, 16))
    t = 7
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 32
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
    assert not torch.allclose(before[:, t], after[:, t])


def test_tied_output_is_the_embedding_parameter_and_counted_once():
    tied, untied = build(tiny(tie_embeddings=True)), build(tiny())
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert count_params(untied) - count_params(tied) == 32 * 32
    assert "output.weight" in tied.state_dict()


def test_grouped_query_attention_runs_and_has_fewer_params():
    full, grouped = build(tiny()), build(tiny(n_kv_heads=1))
    assert grouped.layers["0"].attention.wk.weight.shape == (8, 32)
    assert grouped(torch.randint(0, 32, (2, 16))).shape == (2, 16, 32)
    head_dim = 8
    assert count_params(full) - count_params(grouped) == 2 * 2 * 32 * (4 - 1) * head_dim


def test_input_longer_than_max_seq_len_raises_naming_the_field():
    model = build(tiny())
    with pytest.raises(ValueError, match="model.max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_zero_vocab_size_raises_instead_of_building_empty_embedding():
    with pytest.raises(ValueError, match="model.vocab_size"):
        Transformer(tiny(vocab_size=0))


def test_same_seed_gives_identical_weights_and_other_seed_does_not():
    a, b, c = build(tiny(), 1), build(tiny(), 1), build(tiny(), 2)
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_residual_projections_start_smaller_than_other_linears():
    cfg = tiny(dim=256, n_layers=8, ffn_hidden_dim=512)
    model = build(cfg)
    layer = model.layers["0"]
    expected = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert layer.attention.wo.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(layer.ffn_norm.weight, torch.ones(256))


def test_rope_tables_are_not_saved_and_come_back_after_meta_init():
    cfg = tiny()
    assert not any("rope" in key for key in build(cfg).state_dict())
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    torch.testing.assert_close(model.rope_cos, cos)
    torch.testing.assert_close(model.rope_sin, sin)


def test_rmsnorm_matches_hand_formula_and_keeps_bf16_dtype():
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 9.0)
    torch.testing.assert_close(norm(x), expected)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_rope_attention_score_depends_only_on_relative_position():
    seq, head_dim = 12, 16
    cos, sin = rope_cache(head_dim, seq, theta=10000.0)
    q, k = torch.randn(2, head_dim)
    q_rot = apply_rotary(q.expand(1, 1, seq, head_dim), cos, sin)[0, 0]
    k_rot = apply_rotary(k.expand(1, 1, seq, head_dim), cos, sin)[0, 0]
    scores = q_rot @ k_rot.T
    for offset in range(-seq + 1, seq):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(scores[0, 0], scores[0, 3])


def test_dropout_only_in_training_mode():
    model = build(tiny(dropout=0.5))
    tokens = torch.randint(0, 32, (2, 16))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))


def test_generate_returns_prompt_plus_new_tokens_past_max_seq_len():
    model = build(tiny())
    prompt = torch.randint(0, 32, (1, 5))
    out = generate(model, prompt, max_new_tokens=20, max_seq_len=16, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 25)
    assert torch.equal(out[:, :5], prompt)
    assert model.training


def test_generate_top_k_1_equals_argmax_decoding():
    model = build(tiny()).eval()
    ids = torch.randint(0, 32, (1, 4))
    out = generate(model, ids, max_new_tokens=14, max_seq_len=16, temperature=0.7, top_k=1)
    for _ in range(14):
        next_id = model(ids[:, -16:])[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(out, ids)


def test_generate_rejects_nonpositive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        generate(build(tiny()), torch.zeros(1, 1, dtype=torch.long), 1, 16, temperature=0.0)
