"""The validation loss of the same weights at any world size: dp 2 (plain and ZeRO-3, with an
uneven share of 3 micro-batches), tp 2 and pp 2 against one process (a one-rank group in the
test's own process, which costs no spawn).

Every layout evaluates the same ``training.eval_batches`` micro-batches, and the ranks' means
are weighted by their tokens. Tolerance: dp 2 within 1e-9 relative (each micro-batch's loss is
computed identically; only the order of the float64 sums differs); tp 2 and pp 2 within 1e-5
relative (a vocab-parallel log-sum-exp and split matmuls sum fp32 in other orders; 4e-8
measured). Validation samples drawn per dp rank, as before, moved dp 2 by 1.9e-3 here.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from loomtrain.config import load_config
from loomtrain.data import Data
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.models import Transformer
from loomtrain.models.parallelize import parallelize_llama
from loomtrain.trainer import evaluate
from tests.distributed.checks import check_result, run_checks, spawn_once

BASE = [
    "--model.n_layers=2", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16", "--model.vocab_size=64",
    "--training.seq_len=16", "--training.micro_batch_size=2", "--training.global_batch_size=8",
    "--training.eval_batches=3",
]  # fmt: skip
WORLD2 = {
    "dp2": [],
    "dp2_zero3": ["--data_parallel.zero_stage=3"],
    "tp2": ["--parallel.tensor_parallel_degree=2"],
    "pp2": ["--parallel.pipeline_parallel_degree=2"],
}


def validation_tokens() -> torch.Tensor:
    """40 windows of 16 tokens with structure (a repeated ramp plus noise), so windows differ in loss."""
    g = torch.Generator().manual_seed(7)
    ramp = torch.arange(40 * 16 + 1) % 64
    return torch.where(torch.rand(ramp.shape, generator=g) < 0.3, torch.randint(0, 64, ramp.shape, generator=g), ramp)


def val_loss(extra: tuple[str, ...]) -> float:
    """:func:`evaluate` of the seed-0 model on this process group's layout."""
    cfg = load_config(None, [*BASE, *extra])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    torch.manual_seed(0)
    pm = parallelize_llama(Transformer(cfg.model), dims, cfg, AllReduceHook())
    tokens = validation_tokens()
    return evaluate(pm, Data(None, tokens, tokens), cfg, torch.device("cpu"))


def one_process_loss() -> float:
    """:func:`val_loss` at world size 1, in this process (a one-rank gloo group, removed after),
    on one thread like the spawned ranks (another thread count may round the matmuls otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return val_loss(())
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def run(cases: tuple[tuple[str, tuple[str, ...]], ...]) -> dict:
    """Each case's :func:`val_loss` by name (``cases``: pairs, hashable for ``spawn_once``)."""
    return run_checks({name: partial(val_loss, extra) for name, extra in cases})


def test_val_loss_does_not_depend_on_world_size():
    """Catches: validation micro-batches drawn per dp rank (dp 2 evaluates other and twice as many
    samples as one process, so val_loss changes with the world size), an uneven share averaged
    unweighted, and a ZeRO-3 rank with fewer micro-batches leaving the others waiting in a
    parameter all-gather (the spawn would time out)."""
    one = one_process_loss()
    two = spawn_once(run, 2, tuple((k, tuple(v)) for k, v in WORLD2.items()), timeout_s=120)
    for name in WORLD2:
        rtol = 1e-9 if name.startswith("dp") else 1e-5
        for rank in (0, 1):
            got = check_result(two, name, rank)
            assert math.isclose(got, one, rel_tol=rtol), (name, rank, got, one)
