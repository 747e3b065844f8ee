"""Model presets (`--model.preset=llama3-8b`): each test names the bug it would catch."""

from __future__ import annotations

import pytest

from loomtrain.config import ConfigError, load_config
from loomtrain.models import Transformer, count_params
from loomtrain.models.presets import PRESETS, param_count, preset_config, preset_param_count


def test_unknown_preset_names_the_field_and_lists_the_known_ones():
    """Catches: a typo'd preset silently training the default model, or an error that does not say which names
    exist."""
    with pytest.raises(ConfigError, match="model.preset='llama3-9b' is unknown") as err:
        load_config(None, ["--model.preset=llama3-9b"])
    assert all(name in str(err.value) for name in PRESETS)


def test_preset_fills_unset_fields_and_given_fields_win():
    """Catches: the preset overwriting what the user gave (a reduced test model trained at full size), a given
    `dim` leaving the full-size FFN width (64 × 14336), or preset values dropped where the user gave nothing."""
    model = load_config(None, ["--model.preset=llama3-8b", "--model.n_layers=2", "--model.dim=64",
                               "--model.n_heads=16", "--model.vocab_size=0"]).model  # fmt: skip
    assert (model.n_layers, model.dim, model.n_heads, model.vocab_size) == (2, 64, 16, 0)
    assert (model.kv_heads, model.rope_theta, model.norm_eps, model.max_seq_len) == (8, 500000.0, 1e-5, 8192)
    assert model.hidden_dim == 224  # 14336 / 4096 = 3.5 × 64
    assert load_config(None, ["--model.preset=llama3-8b", "--model.dim=64", "--model.n_heads=16",
                              "--model.ffn_hidden_dim=100"]).model.hidden_dim == 100  # fmt: skip
    full = load_config(None, ["--model.preset=llama3-70b"]).model
    assert (full.n_layers, full.dim, full.n_heads, full.kv_heads, full.hidden_dim) == (80, 8192, 64, 8, 28672)


def test_resolved_config_reloads_to_the_same_model(tmp_path):
    """Catches: a run's saved config.toml that reloads to another shape (the preset applied twice, or the
    derived FFN width recomputed differently on resume)."""
    cfg = load_config(None, ["--model.preset=llama3.2-1b", "--model.n_layers=1", "--model.dim=256"])
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    assert load_config(tmp_path / "config.toml").model == cfg.model


def test_preset_with_init_from_or_unfitting_width_is_refused_with_the_fix():
    """Catches: a preset silently replaced by an HF checkpoint's shape, and a reduced width whose heads no longer
    divide it failing without saying that the heads came from the preset."""
    with pytest.raises(ConfigError, match="both choose the model's shape"):
        load_config(None, ["--model.preset=llama3-8b", "--model.init_from=hf:/models/llama"])
    with pytest.raises(ConfigError, match="model.n_heads=32.*model.preset='llama3-8b' sets the heads"):
        load_config(None, ["--model.preset=llama3-8b", "--model.dim=48"])


@pytest.mark.parametrize("name", ["llama2-7b", "llama3-8b", "llama3.2-1b"])
def test_param_count_equals_the_built_models_count(name):
    """Catches: the shape formula drifting from the model it describes (grouped-query k/v widths of Llama 3, the
    tied head of Llama 3.2 counted twice, norms left out), which would make the published-size check vacuous."""
    cfg = preset_config(name, n_layers=2, dim=64, n_heads=16, vocab_size=100, max_seq_len=16)
    assert param_count(cfg) == count_params(Transformer(cfg))


def test_parameter_counts_match_the_published_sizes():
    """Catches: a wrong published shape (FFN width, kv heads, vocabulary, tied embeddings of Llama 3.2) or a model
    that builds other parameters than Meta's: loomtrain's count must be within 1 % of the size its publisher gives
    (8.03B for Llama 3 8B, ...)."""
    for name, preset in PRESETS.items():
        assert preset_param_count(name) == pytest.approx(preset.published_params, rel=0.01), name
    assert preset_param_count("llama3-8b") == 8_030_261_248  # the exact count of Meta-Llama-3-8B's weights
    assert preset_config("llama3.2-1b").tie_embeddings and not preset_config("llama3-8b").tie_embeddings
