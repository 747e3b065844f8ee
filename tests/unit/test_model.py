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
    """Catches: an output head of the wrong width, a dropped batch or position axis, or logits
    returned in a 16-bit dtype (the loss would be computed in low precision)."""
    model = build(tiny())
    logits = model(torch.randint(0, 32, (3, 10)))
    assert logits.shape == (3, 10, 32)
    assert logits.dtype == torch.float32


def test_changing_token_t_never_changes_logits_before_t():
    """Catches: attention that is not causal (a future token leaks into earlier logits, so the
    model learns to copy), or a position whose logits ignore its own token."""
    model = build(tiny()).eval()
    tokens = torch.randint(0, 32, (2, 16))
    t = 7
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % 32
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
    assert not torch.allclose(before[:, t], after[:, t])


def test_tied_output_is_the_embedding_parameter_and_counted_once():
    """Catches: tying by copying the values (the two matrices would drift apart in training),
    the shared matrix counted twice in the parameter count (wrong MFU), or the head missing
    from the state dict (a checkpoint could not restore it)."""
    tied, untied = build(tiny(tie_embeddings=True)), build(tiny())
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert count_params(untied) - count_params(tied) == 32 * 32
    assert "output.weight" in tied.state_dict()


def test_grouped_query_attention_runs_and_has_fewer_params():
    """Catches: key/value projections sized for every query head instead of ``n_kv_heads``, or
    query heads paired with the wrong key/value head: query head ``h`` must use kv head
    ``h // (n_heads / n_kv_heads)`` (consecutive groups, Ainslie et al. 2023), the grouping that
    tensor parallelism's contiguous head shards assume. Checked against plain multi-head
    attention whose k/v weights repeat each kv head for its group."""
    full, grouped = build(tiny()), build(tiny(n_kv_heads=2))
    head_dim = 8
    assert grouped.layers["0"].attention.wk.weight.shape == (2 * head_dim, 32)
    assert count_params(full) - count_params(grouped) == 2 * 2 * 32 * (4 - 2) * head_dim
    state = grouped.state_dict()
    for key, weight in state.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # kv head j serves query heads 2j and 2j+1: repeat each head's rows in place.
            state[key] = weight.view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(4 * head_dim, 32)
    full.load_state_dict(state)
    tokens = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(grouped(tokens), full(tokens))


def test_input_longer_than_max_seq_len_raises_naming_the_field():
    """Catches: an input past ``model.max_seq_len`` running on with truncated rotary tables (a
    shape error deep inside attention, or silently wrong positions) instead of a clear error."""
    model = build(tiny())
    with pytest.raises(ValueError, match="model.max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_zero_vocab_size_raises_instead_of_building_empty_embedding():
    """Catches: a model built before ``vocab_size`` was taken from the tokenizer, with an
    empty embedding that fails only at the first lookup."""
    with pytest.raises(ValueError, match="model.vocab_size"):
        Transformer(tiny(vocab_size=0))


def test_same_seed_gives_identical_weights_and_other_seed_does_not():
    """Catches: initialisation that does not draw from ``torch.manual_seed``'s generator (ranks
    would start from different weights, runs would not reproduce), or that ignores the seed."""
    a, b, c = build(tiny(), 1), build(tiny(), 1), build(tiny(), 2)
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(tensor, b.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_residual_projections_start_smaller_than_other_linears():
    """Catches: the residual projections (``wo``, ``w2``) initialised at the plain 0.02 or with
    the wrong depth factor (GPT-2's ``0.02 / sqrt(2 · n_layers)``), other linears not at 0.02, or
    norm weights not starting at 1."""
    cfg = tiny(dim=256, n_layers=8, ffn_hidden_dim=512)
    model = build(cfg)
    layer = model.layers["0"]
    expected = 0.02 / (2 * cfg.n_layers) ** 0.5
    assert layer.attention.wo.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(expected, rel=0.05)
    for weight in (layer.attention.wq.weight, layer.feed_forward.w1.weight, model.output.weight):
        assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(layer.ffn_norm.weight, torch.ones(256))


def test_rope_tables_are_not_saved_and_come_back_after_meta_init():
    """Catches: rotary tables saved in checkpoints (persistent buffers), or left as uninitialised
    memory after a meta-device build and ``to_empty`` because ``init_weights`` does not
    recompute them."""
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
    """Catches: a norm by the mean instead of the root mean square, ``eps`` outside the root, the
    weight not applied, bf16 input computed in bf16 (the mean of squares rounded; the result
    must equal the float32 computation rounded once) or returned as float32."""
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 9.0)
    torch.testing.assert_close(norm(x), expected)
    # Rounding the same inputs' mean of squares and product to bf16 changes about a third of
    # the outputs (measured), so only a float32 computation gives exactly this.
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)


def test_rope_attention_score_depends_only_on_relative_position():
    """Catches: rotary tables and rotation that disagree on the pairing of dimensions (scores
    would depend on absolute positions), or no rotation at all (scores independent of distance)."""
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
    """Catches: dropout active in eval mode (validation and sampling would be noisy) or never
    applied in training."""
    model = build(tiny(dropout=0.5))
    tokens = torch.randint(0, 32, (2, 16))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))


def test_generate_returns_prompt_plus_new_tokens_past_max_seq_len():
    """Catches: a context not cropped to ``max_seq_len`` (generation past it would raise), the
    prompt altered in the output, or the model left in eval mode after sampling."""
    model = build(tiny())
    prompt = torch.randint(0, 32, (1, 5))
    out = generate(model, prompt, max_new_tokens=20, max_seq_len=16, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 25)
    assert torch.equal(out[:, :5], prompt)
    assert model.training


def test_generate_top_k_1_equals_argmax_decoding():
    """Catches: top-k that keeps the wrong logits (``top_k=1`` must be greedy), or a context crop
    other than the last ``max_seq_len`` tokens (18 tokens exceed the 16 the model takes)."""
    model = build(tiny()).eval()
    ids = torch.randint(0, 32, (1, 4))
    out = generate(model, ids, max_new_tokens=14, max_seq_len=16, temperature=0.7, top_k=1)
    for _ in range(14):
        next_id = model(ids[:, -16:])[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(out, ids)


def test_generate_rejects_nonpositive_temperature():
    """Catches: ``temperature=0`` dividing the logits by zero (nan probabilities, a crash deep in
    ``multinomial``) instead of an error that points to ``top_k=1``."""
    with pytest.raises(ValueError, match="temperature"):
        generate(build(tiny()), torch.zeros(1, 1, dtype=torch.long), 1, 16, temperature=0.0)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are ``logits`` at every position."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*ids.shape, -1)


def test_generate_samples_from_softmax_of_top_k_logits_over_temperature():
    """Catches: temperature not applied (or applied inversely), top-k keeping other tokens than
    the k most likely (or only the most likely), or draws not from the softmax of what is kept.
    At T=1 the kept probabilities would be 0.09/0.24/0.67 instead of 0.19/0.31/0.51."""
    logits = torch.arange(6.0)
    prompts = torch.zeros(4000, 1, dtype=torch.long)  # one draw per row: 4000 draws from one step
    gen = torch.Generator().manual_seed(0)
    out = generate(FixedLogits(logits), prompts, 1, 16, temperature=2.0, top_k=3, generator=gen)
    frequencies = torch.bincount(out[:, 1], minlength=6) / len(prompts)
    expected = torch.cat([torch.zeros(3), torch.softmax(logits[3:] / 2.0, dim=0)])
    # The sampling error's standard deviation is under 0.008 at 4000 draws; the seed fixes it.
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.03)
