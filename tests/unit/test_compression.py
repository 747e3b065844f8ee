"""Compressors in one process: what each keeps of a tensor, and that error feedback loses nothing.

Tolerances: the int8 bound is the rounding bound ``scale/2`` (plus fp32 roundoff of the
division, 1e-6 relative); sums over steps are fp32 with 1e-5 relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

from loomtrain.compression import CastHook, Int8Hook, PowerSGDHook, SignHook, TopKHook, build_comm_hook
from loomtrain.compression.feedback import ErrorFeedback
from loomtrain.compression.powersgd import orthonormalize
from loomtrain.compression.quantize import dequantize_int8, dequantize_sign, quantize_int8, quantize_sign
from loomtrain.compression.topk import topk_indices
from loomtrain.config import CompressionConfig, ConfigError, load_config
from loomtrain.distributed.data_parallel import AllReduceHook

CHUNK = 64


def varied(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude changes by orders of magnitude from chunk to chunk."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    return x * torch.logspace(-4, 2, numel).view(-1)[torch.randperm(numel, generator=g)]


@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_int8_error_within_half_a_step_of_each_chunks_scale(numel):
    """Catches: one scale for all chunks, truncation instead of rounding, a chunk's tail lost."""
    x = varied(numel)
    q, scale = quantize_int8(x, CHUNK)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.numel() == -(-numel // CHUNK)
    err = (dequantize_int8(q, scale, CHUNK) - x).abs()
    bound = scale.repeat_interleave(CHUNK)[:numel] / 2
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()


def test_int8_all_zero_chunk_stays_zero():
    """Catches: a division by a zero scale turning silence into nan."""
    x = torch.zeros(2 * CHUNK)
    x[CHUNK:] = 1.0
    q, scale = quantize_int8(x, CHUNK)
    assert torch.equal(dequantize_int8(q, scale, CHUNK), x)


@pytest.mark.parametrize("numel", [5, 64, 1001])
def test_sign_keeps_signs_and_each_chunks_mean_magnitude(numel):
    """Catches: bits packed in the wrong order, padding counted in a chunk's mean, 1 byte per sign."""
    x = varied(numel, seed=1)
    bits, scale = quantize_sign(x, CHUNK)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-numel // 8)
    y = dequantize_sign(bits, scale, numel, CHUNK)
    assert torch.equal(y > 0, x >= 0)
    for c in range(scale.numel()):
        part = slice(c * CHUNK, (c + 1) * CHUNK)
        torch.testing.assert_close(y[part].abs(), x[part].abs().mean().expand_as(y[part]), rtol=1e-6, atol=0)


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    """Catches: selection by signed value instead of magnitude, or the wrong count."""
    x = varied(500, seed=2)
    for k in (1, 7, 500):
        got = topk_indices(x, k)
        assert got.numel() == k == got.unique().numel()
        want = x.abs().argsort(descending=True)[:k]
        assert set(got.tolist()) == set(want.tolist())


def test_orthonormalize_gives_an_orthonormal_basis_of_the_columns():
    """Catches: a basis that is not orthonormal (PowerSGD's P̂·P̂ᵀ would then not be a
    projection and would over- or under-count the gradient) or spans other columns."""
    g = torch.Generator().manual_seed(3)
    # 4 columns of rank 3 (a zero gradient direction, as a fresh parameter can give): the basis
    # must still be orthonormal, not nan.
    p = torch.randn(24, 2, generator=g) @ torch.randn(2, 3, generator=g)
    p = torch.cat([p, torch.randn(24, 1, generator=g)], dim=1)
    basis = orthonormalize(p)
    assert basis.shape == p.shape
    torch.testing.assert_close(basis.T @ basis, torch.eye(p.shape[1]), rtol=0, atol=1e-5)
    torch.testing.assert_close(basis @ (basis.T @ p), p, rtol=1e-4, atol=1e-5)


def _send_int8(x):
    return dequantize_int8(*quantize_int8(x, CHUNK), CHUNK)


def _send_sign(x):
    return dequantize_sign(*quantize_sign(x, CHUNK), x.numel(), CHUNK)


def _send_topk(x):
    sent = torch.zeros_like(x)
    idx = topk_indices(x, 10)
    sent[idx] = x[idx]
    return sent


@pytest.mark.parametrize("send", [_send_int8, _send_sign, _send_topk])
def test_error_feedback_sent_plus_residual_is_sum_of_gradients(send):
    """Catches: a residual not updated with what was sent, or reset between steps, which loses
    gradient mass for good."""
    fb = ErrorFeedback()
    total_sent = torch.zeros(300)
    total_grad = torch.zeros(300)
    for step in range(6):
        grad = varied(300, seed=10 + step)
        total_grad += grad
        delta = fb.accumulate(0, grad)
        sent = send(delta)
        delta.sub_(sent)
        total_sent += sent
    torch.testing.assert_close(total_sent + fb.residuals[0], total_grad, rtol=1e-5, atol=1e-5)


def test_residual_of_another_shape_restarts_at_zero():
    """Catches: a residual from a checkpoint with another bucket layout added to a gradient it
    does not belong to (a shape error, or silent broadcasting)."""
    fb = ErrorFeedback()
    fb.residuals[0] = torch.ones(3)
    assert torch.equal(fb.accumulate(0, torch.full((4,), 2.0)), torch.full((4,), 2.0))


@pytest.mark.parametrize(
    ("method", "kind"),
    [("none", AllReduceHook), ("bf16", CastHook), ("fp16", CastHook), ("int8", Int8Hook), ("sign", SignHook),
     ("topk", TopKHook), ("powersgd", PowerSGDHook)],
)  # fmt: skip
def test_build_comm_hook_picks_the_configured_compressor(method, kind):
    """Catches: a config method wired to the wrong hook."""
    assert type(build_comm_hook(CompressionConfig(method=method))) is kind


def test_topk_warmup_ramp_shrinks_the_density_geometrically_to_the_ratio():
    """Catches: a ramp that starts dense (all-reduce) instead of sparse, grows instead of
    shrinking, or never reaches the configured ratio (DGC §3.4's exponential schedule)."""
    hook = build_comm_hook(CompressionConfig(method="topk", topk_ratio=0.01, warmup_steps=4, topk_warmup_density=0.25))
    assert hook._k(10_000) == 2500 and hook._k(100) == 100  # step 0; below min_compress_numel: whole
    densities = []
    for _ in range(6):
        assert not hook.warming_up
        densities.append(hook.density())
        hook.on_step_end()
    want = [0.25 * 0.04 ** (t / 4) for t in range(4)] + [0.01, 0.01]
    assert densities == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    "overrides",
    [["--compression.warmup_steps=5", "--compression.topk_warmup_density=0.005"],
     ["--compression.warmup_steps=30", "--training.steps=30", "--compression.topk_warmup_density=0.25"],
     ["--compression.topk_warmup_density=0.25"],
     ["--compression.warmup_steps=5", "--compression.topk_warmup_density=0.25", "--compression.method=powersgd"]],
)  # fmt: skip
def test_topk_warmup_density_needs_topk_a_warmup_and_more_than_the_ratio(overrides):
    """Catches: a "ramp" that would send less during warm-up than after it, one over zero
    steps (silently ignored) or over the whole run (it would never reach the ratio), or one
    given to a method that has no density."""
    with pytest.raises(ConfigError, match="compression.topk_warmup_density|compression.warmup_steps=30"):
        load_config(None, ["--compression.method=topk", *overrides])


def test_powersgd_dtype_reaches_the_hook():
    """Catches: compression.powersgd_dtype accepted by the config but not passed on, so the
    factors still travel in fp32."""
    hook = build_comm_hook(CompressionConfig(method="powersgd", powersgd_dtype="bf16"))
    assert hook.wire_dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("override", "field"),
    [("--compression.topk_ratio=0", "compression.topk_ratio"),
     ("--compression.powersgd_rank=0", "compression.powersgd_rank"),
     ("--compression.method=gzip", "compression.method"),
     ("--compression.momentum_correction=0.9", "compression.momentum_correction"),
     ("--compression.warmup_steps=5", "compression.warmup_steps"),
     ("--compression.powersgd_dtype=bf16", "compression.powersgd_dtype"),
     ("--compression.method=powersgd --compression.powersgd_dtype=fp16", "compression.powersgd_dtype"),
     ("--compression.topk_warmup_density=0.5", "compression.topk_warmup_density")],
)  # fmt: skip
def test_bad_compression_settings_name_the_field(override, field):
    """Catches: a compression setting that is silently ignored or fails later inside training."""
    with pytest.raises(ConfigError, match=field):
        load_config(None, override.split())
