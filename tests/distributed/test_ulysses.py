"""Ulysses sequence parallelism against one process that sees the whole sequence.

Tolerance: 1e-5 relative (atol 1e-7 for near-zero entries), fp32. Attention over the gathered
sequence is the same computation as in one process; only the order of sums in the gradient
averaging over ranks differs.

One spawn per world size (2 and 4) runs every case, each reporting its own result
(``checks.run_checks``); the tests read the results of theirs.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.config import ModelConfig
from loomtrain.distributed.sequence_parallel import UlyssesAttention
from loomtrain.distributed.traffic import Traffic
from loomtrain.models import Transformer
from loomtrain.models.llama import CoreAttention
from loomtrain.models.parallelize import apply_ulysses
from tests.distributed.checks import check_result, run_checks, spawn_once

RTOL, ATOL = 1e-5, 1e-7
B, S, HEAD_DIM = 2, 8, 4
# (Hq, Hkv): even heads; 6 heads (uneven over 4 ranks); GQA whose kv heads do not split over 4
# ranks (repeated to Hq) but do over 2; GQA that splits over both.
ATTENTION_CASES = [(4, 4), (6, 6), (4, 2), (8, 4)]
MODELS = {
    "even": ModelConfig(n_layers=2, n_heads=4, dim=32, max_seq_len=32, vocab_size=48),
    "uneven": ModelConfig(n_layers=2, n_heads=6, dim=48, max_seq_len=32, vocab_size=48),
    "gqa": ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, dim=32, max_seq_len=32, vocab_size=48),
}
SEQ = 16


def attention_inputs(n_heads: int, n_kv: int) -> list[torch.Tensor]:
    """Global q, k, v and the gradient of the output, the same on every rank."""
    g = torch.Generator().manual_seed(n_heads * 10 + n_kv)
    shapes = [(B, n_heads, S, HEAD_DIM), (B, n_kv, S, HEAD_DIM), (B, n_kv, S, HEAD_DIM), (B, n_heads, S, HEAD_DIM)]
    return [torch.randn(shape, generator=g) for shape in shapes]


def token_batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 48, (B, seq + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def local_slice(seq: int, rank: int, sp: int) -> slice:
    return slice(rank * seq // sp, (rank + 1) * seq // sp)


def ulysses_attention(n_heads: int, n_kv: int) -> dict:
    sp, rank = dist.get_world_size(), dist.get_rank()
    sl = local_slice(S, rank, sp)
    q, k, v, grad_out = (t[:, :, sl] for t in attention_inputs(n_heads, n_kv))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    traffic = Traffic()
    out = UlyssesAttention(CoreAttention(0.0), dist.group.WORLD, traffic)(q, k, v)
    forward_bytes = traffic.snapshot()["sp"]
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "grads": [q.grad, k.grad, v.grad], "bytes": (forward_bytes, traffic.bytes["sp"])}


def ulysses_model(cfg: ModelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    sp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Transformer(cfg)
    apply_ulysses(model, dist.group.WORLD)
    x, y = token_batch(SEQ)
    sl = local_slice(SEQ, rank, sp)
    loss = F.cross_entropy(model(x[:, sl], start_pos=sl.start).flatten(0, 1), y[:, sl].flatten())
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= sp
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def too_few_heads_message() -> str:
    sp = dist.get_world_size()
    q, k, v, _ = (t[:, : sp - 1, : S // sp] for t in attention_inputs(4, 4))
    try:
        UlyssesAttention(CoreAttention(0.0), dist.group.WORLD)(q, k, v)
    except ValueError as e:
        return str(e)
    return "accepted"


def attention_check(n_heads: int, n_kv: int) -> str:
    return f"attention Hq={n_heads} Hkv={n_kv}"


def all_cases() -> dict:
    """Every case, each a check of its own (:func:`run_checks`): one that raises fails only the
    tests reading it."""
    checks = {attention_check(*case): partial(ulysses_attention, *case) for case in ATTENTION_CASES}
    checks |= {f"model {name}": partial(ulysses_model, cfg) for name, cfg in MODELS.items()}
    checks["too few heads"] = too_few_heads_message
    return run_checks(checks)


def results(sp: int) -> list[dict]:
    """:func:`all_cases` on ``sp`` ranks, spawned once per ``sp`` for all the tests."""
    return spawn_once(all_cases, sp, timeout_s=120.0)


def reference_attention(n_heads: int, n_kv: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, grad_out = attention_inputs(n_heads, n_kv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = CoreAttention(0.0)(q, k, v)
    (out * grad_out).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def reference_model(cfg: ModelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Transformer(cfg)
    x, y = token_batch(SEQ)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_equals_full_sequence_slice(sp, case):
    """Catches: heads or positions sent to the wrong rank (blocks concatenated in the wrong
    order), a backward that is not the reverse all-to-all, uneven head counts mis-split, GQA
    ranks attending with key/value heads of other query groups."""
    want_out, want_grads = reference_attention(*case)
    for rank in range(sp):
        sl = local_slice(S, rank, sp)
        got = check_result(results(sp), attention_check(*case), rank)
        torch.testing.assert_close(got["out"], want_out[:, :, sl], rtol=RTOL, atol=ATOL)
        for name, got_grad, want_grad in zip("qkv", got["grads"], want_grads, strict=True):
            torch.testing.assert_close(
                got_grad, want_grad[:, :, sl], rtol=RTOL, atol=ATOL, msg=lambda m, n=name, r=rank: f"d{n} rank {r}: {m}"
            )


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformer_loss_and_grads_equal_single_process(sp, name):
    """Catches: RoPE positions not offset by start_pos (each rank rotating as if at position 0),
    causal masking applied per slice instead of over the whole sequence, a core left unwrapped,
    gradients of the all-to-all lost in backward."""
    want_loss, want_grads = reference_model(MODELS[name])
    ranks = [check_result(results(sp), f"model {name}", rank) for rank in range(sp)]
    assert sum(loss for loss, _ in ranks) / sp == pytest.approx(want_loss, rel=RTOL)
    for _, grads in ranks:
        for param, want in want_grads.items():
            torch.testing.assert_close(
                grads[param], want, rtol=RTOL, atol=ATOL, msg=lambda m, p=param: f"grad {p} (sp {sp}): {m}"
            )


@pytest.mark.parametrize("sp", [2, 4])
def test_all_to_all_bytes_match_formula(sp):
    """Catches: traffic not recorded in backward, or counting the part a rank keeps for itself.
    Formula (Ulysses §3.1): each of 4 forward and 4 backward all-to-alls sends (sp−1)/sp of the
    local tensor; with GQA that splits, k and v are Hq/Hkv times smaller than q."""
    local = B * (S // sp) * HEAD_DIM * 4
    for n_heads, n_kv in [(4, 4), (8, 4)]:
        per_direction = (sp - 1) * local * (2 * n_heads + 2 * n_kv) // sp
        for rank in range(sp):
            got = check_result(results(sp), attention_check(n_heads, n_kv), rank)["bytes"]
            assert got == (per_direction, 2 * per_direction), f"rank {rank}"


@pytest.mark.parametrize("sp", [2, 4])
def test_fewer_heads_than_ranks_is_rejected(sp):
    """Catches: a rank left with no heads going on to a shape error inside the all-to-all."""
    for rank in range(sp):
        assert check_result(results(sp), "too few heads", rank).startswith(f"model.n_heads={sp - 1} is smaller than")
