"""Activation checkpointing (``training.activation_checkpointing``) against the plain model, on
every parallel layout it composes with, and its activation memory against the formula.

Gradients: for each layout (dp 2, ZeRO-2 and ZeRO-3 over dp 2, tp 2, tp 2 with Megatron
sequence parallelism, pp 2, Ulysses sp 2, dp 2 with dropout, dp 2 with grouped key/value
heads) the gradients of a step (8 sequences, 2 per micro-batch: 2 micro-batches per rank under
dp 2, 4 otherwise), and the parameters after a second step, with ``full`` and ``selective``
recomputation equal those without, within 1e-6 relative (fp32). The
recomputation repeats the forward's operations on the same inputs with the same RNG state, so
they match bit for bit in practice; a recomputation with other parameters (ZeRO's sharded
masters instead of its gathered tensors), other dropout masks, or a gradient accumulated twice
is off by far more.

Memory: the bytes one block saves for backward (``SavedTensorCounter``), through the model
``parallelize_llama`` built, equal :func:`block_activation_bytes` exactly, and fall from
``none`` to ``selective`` to ``full``.
"""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomtrain.config import load_config
from loomtrain.distributed.activation_checkpoint import SavedTensorCounter, apply_activation_checkpointing
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.models import Transformer
from loomtrain.models.llama import CoreAttention, TransformerBlock, rope_cache
from loomtrain.models.parallelize import block_activation_bytes, checkpointed_modules, parallelize_llama
from loomtrain.trainer import train_step
from tests.distributed.checks import check_result, run_checks, spawn_once
from tests.distributed.test_pipeline import batches

CPU = torch.device("cpu")
MODES = ("none", "full", "selective")
BASE = [
    "--model.n_layers=2", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16", "--model.vocab_size=64",
    "--training.seq_len=16", "--training.micro_batch_size=2", "--training.global_batch_size=8",
    "--training.grad_clip=0.85",
]  # fmt: skip
TP2 = "--parallel.tensor_parallel_degree=2"
LAYOUTS = {
    "dp2": [],
    "dp2_zero2": ["--data_parallel.zero_stage=2"],
    "dp2_zero3": ["--data_parallel.zero_stage=3"],
    "tp2": [TP2],
    "tp2_megatron_sp": [TP2, "--parallel.tp_mode=sequence_parallel"],
    "pp2": ["--parallel.pipeline_parallel_degree=2"],
    "ulysses2": ["--parallel.sequence_parallel_degree=2"],
    "dp2_dropout": ["--model.dropout=0.1"],
    "dp2_gqa": ["--model.n_heads=4", "--model.n_kv_heads=2"],
}
# Layouts whose block's saved bytes block_activation_bytes covers (tp without sequence parallelism).
MEMORY_LAYOUTS = ("dp2", "tp2", "dp2_dropout", "dp2_gqa")
RTOL = 1e-6


def _local(grad: torch.Tensor) -> torch.Tensor:
    return (grad.to_local() if isinstance(grad, DTensor) else grad).detach().clone()


def _block_saved_bytes(model: Transformer, cfg, dims: ParallelDims) -> int:
    """Bytes the first block this rank holds saves for backward in one forward of a random
    micro-batch (this rank's slice of the sequence under Megatron sequence parallelism)."""
    t = cfg.training
    seq = t.seq_len // (dims.tp if cfg.parallel.tp_mode == "sequence_parallel" else 1)
    x = torch.randn(t.micro_batch_size, seq, cfg.model.dim, requires_grad=True)
    block = next(iter(model.layers.values()))
    with SavedTensorCounter([*model.parameters(), *model.buffers()]) as counter:
        block(x, model.rope_cos, model.rope_sin)
    return counter.bytes


def train_case(extra: list[str], mode: str) -> dict:
    """Two SGD steps of the layout ``extra`` with recomputation ``mode``: this rank's gradients
    of the first step (ZeRO: its master shards'), its full parameters after the second, and
    what ZeRO-3 still holds gathered and whether its masters are registered again."""
    cfg = load_config(None, [*BASE, *extra, f"--training.activation_checkpointing={mode}"])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    pm = parallelize_llama(model, dims, cfg, AllReduceHook())
    saved = _block_saved_bytes(model, cfg, dims) if cfg.data_parallel.zero_stage == 0 else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    pm.sync.attach_optimizer(optimizer)
    t = cfg.training
    step = partial(batches, global_batch=t.global_batch_size, dp_rank=dims.dp_rank, dp=dims.dp,
                   micro=t.micro_batch_size)  # fmt: skip
    pm.forward_backward(step(0), 1.0, contextlib.nullcontext, CPU)
    pm.sync.finish_gradient_sync()
    grads = {name: _local(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    if pm.sync.prepare_step(t.grad_clip):
        optimizer.step()
        pm.sync.after_step()
    pm.sync.zero_grad()
    train_step(pm, optimizer, step(1), cfg, CPU)
    out = {"grads": grads, "saved_bytes": saved}
    if cfg.data_parallel.zero_stage == 3:
        out["gathered_bytes"] = sum(p.untyped_storage().nbytes() for p in pm.sync.full_params())
        out["masters_registered"] = all(isinstance(p, DTensor) for p in model.parameters())
    pm.sync.remove()
    out["params"] = {name: p.detach().clone() for name, p in pm.full_model().named_parameters()}
    return out


def run_all() -> dict:
    """Every layout × mode as a check of its own (:func:`run_checks`), on every rank."""
    return run_checks({f"{name}/{mode}": partial(train_case, extra, mode) for name, extra in LAYOUTS.items()
                       for mode in MODES})  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return spawn_once(run_all, 2, timeout_s=300)


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=0.0, msg=f"{what}: {key}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recomputed_gradients_equal_plain(results, layout):
    """Catches: a recomputation that runs with other parameters than the forward (ZeRO's
    sharded masters, or full tensors it has freed), draws new dropout masks, misses the tp or
    Ulysses collectives of the region or repeats a pipeline stage's layers; a gradient
    accumulated twice (fired twice into data-parallel buckets or ZeRO's reduction) or lost."""
    for rank in range(2):
        plain = check_result(results, f"{layout}/none", rank)
        for mode in ("full", "selective"):
            got = check_result(results, f"{layout}/{mode}", rank)
            _assert_close(got["grads"], plain["grads"], f"{layout}/{mode} rank {rank} gradients")
            _assert_close(got["params"], plain["params"], f"{layout}/{mode} rank {rank} parameters")


def test_zero3_recompute_frees_what_it_gathers(results):
    """Catches: a recomputation under ZeRO-3 that leaves a block's gathered parameters
    allocated after the step (a leak of a full copy per block), or leaves the full tensors
    registered in the module instead of the sharded masters the optimizer steps."""
    for mode in MODES:
        for rank in range(2):
            got = check_result(results, f"dp2_zero3/{mode}", rank)
            assert got["gathered_bytes"] == 0, (mode, rank)
            assert got["masters_registered"], (mode, rank)


@pytest.mark.parametrize("layout", MEMORY_LAYOUTS)
def test_saved_bytes_match_formula(results, layout):
    """Catches: ``parallelize_llama`` recomputing the wrong modules (or none) for a mode, a
    checkpointed region that still keeps its inner activations, and a formula in the docs
    that does not describe what the block saves (fused and math attention kernels, grouped
    key/value heads, tensor-parallel shares)."""
    cfg = load_config(None, [*BASE, *LAYOUTS[layout]])
    tp = ParallelDims.from_config(cfg.parallel, 2).tp
    saved = {mode: check_result(results, f"{layout}/{mode}")["saved_bytes"] for mode in MODES}
    assert saved == {mode: block_activation_bytes(cfg, mode, tp) for mode in MODES}
    assert saved["full"] < saved["selective"] < saved["none"]


def test_counter_counts_storages_once_and_checkpoint_inputs():
    """Catches: a counter that counts a tensor once per operation saving it (a block's input is
    saved by its norm twice) or per view, counts the parameters, or misses the inputs a
    checkpointed region keeps (full recomputation would count 0 bytes)."""
    cfg = load_config(None, BASE)
    torch.manual_seed(0)
    block = TransformerBlock(cfg.model)
    cos, sin = rope_cache(cfg.model.head_dim, 16, cfg.model.rope_theta)
    x = torch.randn(2, 16, 32, requires_grad=True)
    with SavedTensorCounter(block.parameters()) as counter:
        y = x * 2
        (y * y.view(2, 16, 32)).sum()
    assert (counter.bytes, counter.tensors) == (y.numel() * 4, 1)
    apply_activation_checkpointing([block])
    with SavedTensorCounter([*block.parameters(), cos, sin]) as counter:
        block(x, cos, sin)
    assert counter.bytes == x.numel() * 4


def test_checkpointing_twice_is_refused():
    """Catches: applying activation checkpointing to a module twice, which would recompute its
    forward twice in backward."""
    model = Transformer(load_config(None, BASE).model)
    cores = checkpointed_modules(model, "selective")
    assert len(cores) == 2 and all(isinstance(m, CoreAttention) for m in cores)
    apply_activation_checkpointing(cores)
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        apply_activation_checkpointing(cores[:1])
