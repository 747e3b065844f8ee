"""FLOP counting, peak device throughput and MFU: each test names the bug it would catch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from loomtrain import hardware
from loomtrain.config import ModelConfig
from loomtrain.models import Transformer, count_params, flops_per_step, flops_per_token


@pytest.mark.parametrize(
    "cfg",
    [ModelConfig(vocab_size=65), ModelConfig(vocab_size=65, n_kv_heads=2, tie_embeddings=True)],
    ids=["default", "gqa_tied"],
)
def test_flops_per_token_equals_torch_flop_counter(cfg):
    """Catches: any matmul miscounted in ``flops_per_token``: key/value projections counted at
    ``n_heads`` under grouped-query attention, a missing output head or attention term, a tied head
    dropped, or a backward not counted at twice the forward. The counter counts only matmuls, as
    the formula does, so the two agree exactly; a 5 % tolerance would let the output head (1 % of
    this model) go missing unnoticed."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch, seq = 2, cfg.max_seq_len
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    counter = FlopCounterMode(display=False)
    # FlopCounterMode has no formula for the CPU flash-attention kernel; the math backend
    # runs attention as matmuls, which it counts.
    with sdpa_kernel(SDPBackend.MATH), counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    measured = counter.get_total_flops() / (batch * seq)
    assert flops_per_token(cfg, seq) == pytest.approx(measured, rel=1e-9)


def test_flops_per_step_is_tokens_times_flops_per_token():
    """Catches: ``flops_per_step`` multiplying by something other than the tokens of the step
    (e.g. sequences, or tokens times ``seq_len`` again)."""
    cfg = ModelConfig(vocab_size=65)
    assert flops_per_step(cfg, 64, 768) == 768 * flops_per_token(cfg, 64)


def test_attention_flops_grow_with_seq_len():
    """Catches: an attention term that ignores ``seq_len`` (or grows with it at the wrong rate):
    doubling the context adds exactly the two ``s × s`` attention matmuls per layer, three times
    over for training."""
    cfg = ModelConfig(vocab_size=65)
    extra = flops_per_token(cfg, 128) - flops_per_token(cfg, 64)
    assert extra == 3 * cfg.n_layers * 2 * 2 * 64 * cfg.dim


def test_count_params_exclude_embedding_drops_only_the_lookup_table():
    """Catches: ``exclude_embedding`` also dropping an untied output head (only the lookup table is
    embedding), or dropping nothing."""
    cfg = ModelConfig(vocab_size=65)
    model = Transformer(cfg)
    assert count_params(model) - count_params(model, exclude_embedding=True) == 65 * 128


def test_gpu_names_match_the_most_specific_datasheet_entry():
    """Catches: a GPU matched to a less specific table entry (an H100 PCIe given the SXM peak, an
    L40S or L4 matched by prefix), TF32 and FP32 peaks swapped, or an unknown GPU or dtype given
    a figure instead of ``None`` (which makes the caller measure it)."""
    peak = hardware.gpu_peak_flops_per_s
    assert peak("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989.4e12
    assert peak("NVIDIA H100 PCIe", torch.bfloat16, tf32=False) == 756e12
    assert peak("NVIDIA L40S", torch.bfloat16, tf32=False) == 362.05e12
    assert peak("NVIDIA L4", torch.bfloat16, tf32=False) == 121e12
    assert peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5e12
    assert peak("Some Future GPU", torch.bfloat16, tf32=False) is None
    assert peak("NVIDIA H100 80GB HBM3", torch.float64, tf32=False) is None


def test_mfu_is_achieved_over_peak():
    """Catches: an inverted or mis-scaled MFU ratio, or a zero peak dividing by zero instead of a
    clear error."""
    assert hardware.mfu(6e9, 1000.0, 12e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_flops_per_s"):
        hardware.mfu(6e9, 1000.0, 0.0)
