"""Megatron tensor (and sequence) parallel layers and model against the unsharded single process.

Every rank builds the unsharded layer or model from the same seed, runs it as the reference,
then shards a copy and runs that. Outputs, input gradients and weight gradients must match the
reference's matching slice (chunk layout) within RTOL of the reference tensor's largest entry
(fp32; only the order of floating-point sums differs). One spawn per world size runs every
check (spawning costs seconds), each reporting its own result (``checks.run_checks``); the tests
then read the results of theirs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loomtrain.config import ModelConfig
from loomtrain.distributed.parallel_dims import shard_range
from loomtrain.distributed.spawn import spawn
from loomtrain.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from loomtrain.distributed.traffic import Traffic
from loomtrain.models import Transformer
from loomtrain.models.parallelize import apply_tensor_parallel
from tests.distributed.checks import check_result, run_checks

RTOL = 1e-5
B, S = 2, 8
# Uneven splits at tp=4: 10 features → 3,3,3,1; vocabulary 65 → 17,17,17,14; hidden 90 → 23,23,23,21.
IN, OUT, VOCAB, DIM = 12, 10, 65, 16
BASE = ModelConfig(n_layers=2, n_heads=4, dim=32, ffn_hidden_dim=90, max_seq_len=16, vocab_size=VOCAB)
MODELS = {
    "untied": BASE,
    "tied": BASE.model_copy(update={"tie_embeddings": True}),
    "gqa": BASE.model_copy(update={"n_kv_heads": 2}),
}
WORLDS = [2, 4]


def part(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's chunk-layout slice of ``t`` along ``dim``."""
    start, end = shard_range(t.shape[dim], dist.get_world_size(), dist.get_rank())
    return t.narrow(dim, start, end - start)


def seq_part(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """The sequence slice a rank holds under sequence parallelism, else all of ``t``."""
    return part(t, 1) if sp else t


def backward_with(y: torch.Tensor, grad: torch.Tensor) -> None:
    (y * grad).sum().backward()


def check_column(sp: bool) -> dict:
    full = nn.Linear(IN, OUT, bias=False)
    x, gy = torch.randn(B, S, IN, requires_grad=True), torch.randn(B, S, OUT)
    want = full(x)
    backward_with(want, gy)
    layer = ColumnParallelLinear.from_linear(full, dist.group.WORLD, sequence_parallel=sp)
    x_local = seq_part(x.detach(), sp).clone().requires_grad_()
    y = layer(x_local)
    backward_with(y, part(gy, 2))
    return {
        "output": (y, part(want, 2)),
        "input grad": (x_local.grad, seq_part(x.grad, sp)),
        "weight grad": (layer.weight.grad, part(full.weight.grad, 0)),
    }


def check_row(sp: bool) -> dict:
    full = nn.Linear(OUT, IN, bias=False)
    x, gy = torch.randn(B, S, OUT, requires_grad=True), torch.randn(B, S, IN)
    want = full(x)
    backward_with(want, gy)
    layer = RowParallelLinear.from_linear(full, dist.group.WORLD, sequence_parallel=sp)
    x_local = part(x.detach(), 2).clone().requires_grad_()
    y = layer(x_local)
    backward_with(y, seq_part(gy, sp))
    return {
        "output": (y, seq_part(want, sp)),
        "input grad": (x_local.grad, part(x.grad, 2)),
        "weight grad": (layer.weight.grad, part(full.weight.grad, 1)),
    }


def check_embedding(sp: bool) -> dict:
    full = nn.Embedding(VOCAB, DIM)
    tokens, gy = torch.randint(0, VOCAB, (B, S)), torch.randn(B, S, DIM)
    want = full(tokens)
    backward_with(want, gy)
    layer = VocabParallelEmbedding.from_embedding(full, dist.group.WORLD, sequence_parallel=sp)
    y = layer(tokens)
    backward_with(y, seq_part(gy, sp))
    return {"output": (y, seq_part(want, sp)), "weight grad": (layer.weight.grad, part(full.weight.grad, 0))}


def check_cross_entropy() -> dict:
    logits, target = (3 * torch.randn(B, S, VOCAB)).requires_grad_(), torch.randint(0, VOCAB, (B, S))
    want = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    want.backward()
    local = part(logits.detach(), 2).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, dist.group.WORLD)
    loss.backward()
    return {"loss": (loss, want), "logits grad": (local.grad, part(logits.grad, 2))}


def check_model(cfg: ModelConfig, sp: bool) -> dict:
    ref = Transformer(cfg)
    model = copy.deepcopy(ref)
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    shards = apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    loss = vocab_parallel_cross_entropy(model(x), y, dist.group.WORLD)
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    checks = {"loss": (loss, ref_loss)}
    for name, p in model.named_parameters():
        want = ref_grads[name].grad
        checks[name] = (p.grad, part(want, shards[name]) if name in shards else want)
    facts = {
        "tied": model.output.weight is model.tok_embeddings.weight,
        "same keys": set(model.state_dict()) == set(ref.state_dict()),
        "shards": shards,
    }
    return {"checks": checks, "facts": facts}


def block_traffic(sp: bool) -> int:
    """Bytes on the ``tp`` axis for one forward and backward of one block."""
    model, traffic = Transformer(BASE), Traffic()
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp, traffic=traffic)
    h = seq_part(torch.randn(B, S, BASE.dim), sp).requires_grad_()
    model.layers["0"](h, model.rope_cos[:S], model.rope_sin[:S]).sum().backward()
    return traffic.bytes["tp"]


def error_message(cfg: ModelConfig, seq: int, sp: bool) -> str:
    model = Transformer(cfg)
    try:
        apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
        model(torch.zeros(1, seq, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "no error"


def seeded(seed: int, check: Callable, *args) -> Callable[[], object]:
    """``check(*args)`` after seeding torch's generator with ``seed`` (the same on every rank)."""

    def run():
        torch.manual_seed(seed)
        return check(*args)

    return run


def mode(sp: bool) -> str:
    return "sp" if sp else "tp"


def run_all() -> dict:
    """Every check on this rank, each a check of its own (:func:`run_checks`) seeded the same
    way on all ranks."""
    world = dist.get_world_size()
    checks = {}
    for sp in (False, True):
        for name, check in (("column", check_column), ("row", check_row), ("embedding", check_embedding)):
            checks[f"{name} {mode(sp)}"] = seeded(1, check, sp)
        for name, cfg in MODELS.items():
            if cfg.kv_heads % world == 0:
                checks[f"model {name} {mode(sp)}"] = seeded(0, check_model, cfg, sp)
    checks["cross entropy"] = seeded(2, check_cross_entropy)
    if world == 2:
        checks["traffic"] = seeded(3, lambda: {sp: block_traffic(sp) for sp in (False, True)})
    if world == 4:
        checks["error heads"] = partial(error_message, ModelConfig(n_heads=6, dim=48, vocab_size=VOCAB), 8, False)
        checks["error kv heads"] = partial(error_message, MODELS["gqa"], 8, False)
        checks["error sequence"] = partial(error_message, BASE, 6, True)
    return run_checks(checks)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"tp{w}")
def results(request) -> tuple[int, list[dict]]:
    return request.param, spawn(run_all, request.param, timeout_s=120)


def assert_matches(checks: dict, what: str) -> None:
    for name, (got, want) in checks.items():
        assert got.shape == want.shape, f"{what} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        err = (got.detach() - want.detach()).abs().max().item()
        scale = want.detach().abs().max().item()
        assert err <= RTOL * scale, f"{what} {name}: max error {err:.3g} > {RTOL} × {scale:.3g}"


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("layer", ["column", "row", "embedding"])
def test_layer_matches_unsharded(results, layer, sp):
    """Catches: a wrong shard layout (uneven chunk), a missing or doubled collective in forward
    (output) or backward (input gradient: f's all-reduce, the gather's reduce-scatter), and a
    lookup that does not zero out-of-range tokens (embedding)."""
    world, ranks = results
    for rank in range(world):
        assert_matches(check_result(ranks, f"{layer} {mode(sp)}", rank), f"rank {rank} {layer}")


def test_vocab_parallel_cross_entropy_matches_full(results):
    """Catches: a local instead of global max or normaliser, a target logit counted on the
    wrong rank (vocabulary offset of an uneven split), and an unscaled backward."""
    world, ranks = results
    for rank in range(world):
        out = check_result(ranks, "cross entropy", rank)
        loss = out["loss"][0]
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert_matches(out, f"rank {rank} cross entropy")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("variant", list(MODELS))
def test_model_matches_single_process(results, variant, sp):
    """Catches: heads split across ranks (GQA), a replicated gradient left partial (norm
    weights under sequence parallelism need their all-reduce hook), tied embeddings untied
    (the output head's gradient lost), changed state_dict keys, a shard map that misses a
    parameter or names the wrong dim."""
    world, ranks = results
    if MODELS[variant].kv_heads % world:
        pytest.skip(f"{variant}: kv heads not divisible by tp={world}")
    for rank in range(world):
        result = check_result(ranks, f"model {variant} {mode(sp)}", rank)
        assert_matches(result["checks"], f"rank {rank} {variant}")
        facts = result["facts"]
        assert facts["same keys"]
        assert facts["tied"] == (variant == "tied")
        assert facts["shards"]["layers.1.attention.wo.weight"] == 1
        assert facts["shards"]["tok_embeddings.weight"] == 0


def test_block_traffic_is_megatrons(results):
    """Catches: a ``f`` applied once per projection (wq, wk, wv each all-reducing their input
    gradient), a collective missing from the ``tp`` traffic count. Megatron (Korthikanti et
    al. 2022, Table 2 / §4.2.2): per block, 4 collectives of b·s·h elements, 8·b·s·h·(t−1)/t
    elements in all, in either mode; sequence parallelism adds only the all-reduce of the two
    norm weights' gradients, 2·2·h·(t−1)/t elements."""
    world, ranks = results
    if world != 2:
        pytest.skip("measured at tp=2")
    t, h, fp32 = world, BASE.dim, 4
    megatron = 8 * B * S * h * (t - 1) // t * fp32
    norms = 2 * 2 * h * (t - 1) // t * fp32
    for rank in range(world):
        assert check_result(ranks, "traffic", rank) == {False: megatron, True: megatron + norms}


def test_invalid_degrees_rejected(results):
    """Catches: a split that leaves a rank part of a head, and a sequence that cannot be split
    evenly under sequence parallelism (silently wrong shapes otherwise)."""
    world, ranks = results
    if world != 4:
        pytest.skip("checked at tp=4")
    heads, kv_heads, sequence = (check_result(ranks, f"error {what}") for what in ("heads", "kv heads", "sequence"))
    assert "model.n_heads=6 is not divisible by parallel.tensor_parallel_degree=4" in heads
    assert "model.n_kv_heads=2 is not divisible by parallel.tensor_parallel_degree=4" in kv_heads
    assert "sequence length 6 is not divisible by parallel.tensor_parallel_degree=4" in sequence
