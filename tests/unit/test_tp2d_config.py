"""The pre-launch refusal of shapes that a q × q grid of 2D tensor parallelism cannot split."""

from __future__ import annotations

import pytest

from loomtrain.config import ModelConfig
from loomtrain.distributed.tensor_parallel_2d import check_2d_shapes, padded_vocab
from loomtrain.models.tp2d import check_tp2d_config

GOOD = ModelConfig(n_heads=8, n_kv_heads=4, dim=64, ffn_hidden_dim=96, vocab_size=65)


def test_a_valid_grid_returns_its_side():
    """Catches: a valid q × q degree refused, or the side computed wrongly (q² returned, or a
    float square root rounding 16 to 3.999…)."""
    assert check_tp2d_config(GOOD, 16, micro_batch_size=8) == 4
    assert check_tp2d_config(GOOD, 4, micro_batch_size=2) == 2
    assert check_tp2d_config(GOOD, 1, micro_batch_size=1) == 1


@pytest.mark.parametrize(("tp", "nearest"), [(8, "4 (2×2) and 9 (3×3)"), (2, "1 (1×1) and 4 (2×2)"),
                                             (12, "9 (3×3) and 16 (4×4)"), (0, "1 (1×1) and 4 (2×2)")])  # fmt: skip
def test_a_degree_that_is_not_a_perfect_square_is_refused_with_the_nearest_sizes(tp, nearest):
    """Catches: tp = 8 accepted (a 2 × 4 grid would break SUMMA's square blocks), or refused
    without naming the field or the valid sizes next to it."""
    with pytest.raises(ValueError, match="parallel.tensor_parallel_degree") as err:
        check_tp2d_config(GOOD, tp, micro_batch_size=4)
    assert nearest in str(err.value)


@pytest.mark.parametrize(
    ("update", "batch", "field"),
    [
        ({"dim": 66, "n_heads": 6, "n_kv_heads": 6}, 4, "model.dim=66"),
        ({"n_heads": 2, "n_kv_heads": 2, "dim": 32}, 4, "model.n_heads=2"),
        ({"n_kv_heads": 2}, 4, "model.n_kv_heads=2"),
        ({"ffn_hidden_dim": 102}, 4, "model.ffn_hidden_dim=102"),
        ({}, 6, "training.micro_batch_size=6"),
        ({"tie_embeddings": True}, 4, "model.tie_embeddings"),
    ],
)
def test_each_indivisible_field_is_named(update, batch, field):
    """Catches: a hidden size, head count, kv head count, SwiGLU width or micro-batch that q = 4
    does not divide let through to fail inside a collective, or refused without the field."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as err:
        check_tp2d_config(GOOD.model_copy(update=update), 16, micro_batch_size=batch)
    assert "multiple of 4" in str(err.value) or "set it to false" in str(err.value)


def test_every_problem_is_reported_at_once():
    """Catches: only the first offending field reported, so the user fixes one per launch."""
    with pytest.raises(ValueError) as err:
        check_2d_shapes(9, dim=64, n_heads=8, n_kv_heads=4, ffn_hidden_dim=100, micro_batch_size=4)
    for field in ("model.dim=64", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden_dim=100",
                  "training.micro_batch_size=4"):  # fmt: skip
        assert field in str(err.value)


def test_the_vocabulary_is_padded_not_refused():
    """Catches: a vocabulary not divisible by q refused (it is padded), or padded past the next multiple."""
    assert check_tp2d_config(GOOD.model_copy(update={"vocab_size": 50257}), 4, micro_batch_size=2) == 2
    assert [padded_vocab(v, 4) for v in (64, 65, 67, 68)] == [64, 68, 68, 68]
