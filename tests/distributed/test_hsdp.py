"""HSDP (``dp_replicate × dp_shard``) and weighted gradient averages, against plain data parallelism.

HSDP shards ZeRO's state over ``dp_shard`` (× ``sp``) and replicates it over ``dp_replicate``;
the gradient is reduce-scattered (or all-reduced, stage 1) within a replica group and then
averaged over the groups. The data every dp rank reads is the same as plain dp, so after 3
SGD steps with momentum and clipping every parameter must equal plain data parallelism's at
the same dp degree, within 1e-5 relative, 1e-7 absolute (fp32; only the order of the sums
differs). A checkpoint written under HSDP must load into another layout bit for bit.

Rank weights (``GradientSync.set_rank_weight``): ranks that processed different numbers of
samples average their per-sample-mean gradients weighted by those numbers, which equals the
gradient of the mean loss over all samples in one process (1e-6 relative).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.checkpoint import CheckpointManager
from loomtrain.config import load_config
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.models.parallelize import parallelize_llama
from tests.distributed.test_pipeline import BASE, assert_same, run_cases, train_params

REPLICATE = "--parallel.data_parallel_replicate_degree=2"
TP2 = "--parallel.tensor_parallel_degree=2"
WORLD4 = {
    "dp4": [],
    **{f"hsdp2x2_zero{z}": [REPLICATE, f"--data_parallel.zero_stage={z}"] for z in (1, 2, 3)},
    "dp2_tp2": [TP2],
    "hsdp2x1_tp2_zero3": [REPLICATE, TP2, "--data_parallel.zero_stage=3"],
}


def test_hsdp_equals_plain_data_parallel():
    """Catches: a shard not averaged over the replica groups (each group would follow its own
    half of the data), averaged twice, a gradient norm or overflow check summed over replicas
    that hold copies, replicas that start from different weights, and master DTensors placed
    wrongly on the 3-D (replicate, shard, tp) mesh."""
    got = spawn(run_cases, 4, WORLD4, timeout_s=600)[0]
    for name in WORLD4:
        want = got["dp2_tp2"] if "tp2" in name else got["dp4"]
        assert_same(got[name], want, name)


def save_hsdp_then_load_plain(ckpt_dir: str) -> tuple[dict, dict]:
    """Train HSDP ZeRO-3 for a step, save, load into dp 4 ZeRO-1; both full parameter sets."""
    saved = train_params([REPLICATE, "--data_parallel.zero_stage=3", f"--run.out_dir={ckpt_dir}"], save=True)
    cfg = load_config(None, [*BASE, "--data_parallel.zero_stage=1"])
    torch.manual_seed(1)  # other initial weights: the load must overwrite all of them
    model = Transformer(cfg.model)
    pm = parallelize_llama(model, ParallelDims.from_config(cfg.parallel, 4), cfg, AllReduceHook())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    CheckpointManager(Path(ckpt_dir), keep_last=1).load(Path(ckpt_dir) / "step_00000003", model, optimizer, pm)
    pm.sync.after_step()
    pm.sync.remove()
    loaded = {name: p.detach().clone() for name, p in pm.full_model().named_parameters()}
    return saved, loaded


# Slow (make test-all, about 19 s): DCP resharding of ZeRO's master DTensors runs in make test
# through test_zero.py's stage-3 reshard; this adds HSDP's Replicate placement.
@pytest.mark.slow
def test_hsdp_checkpoint_loads_into_another_layout():
    """Catches: replicated master shards written twice or with the wrong global offsets, and a
    checkpoint that only loads back into the layout that wrote it."""
    with tempfile.TemporaryDirectory(prefix="loomtrain-hsdp-") as d:
        saved, loaded = spawn(save_hsdp_then_load_plain, 4, d, timeout_s=300)[0]
    assert_same(loaded, saved, "HSDP zero3 → dp4 zero1")


def weighted_gradients(zero_stage: int) -> tuple[dict, dict]:
    """Rank r processes r + 1 sequences (1 and 3 at world size 2) and weighs its gradient by
    that count; returns the averaged gradient and the one-process gradient of all 4 sequences."""
    cfg = load_config(None, [*BASE, f"--data_parallel.zero_stage={zero_stage}"])
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    reference = Transformer(cfg.model)
    F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    pm = parallelize_llama(model, ParallelDims.from_config(cfg.parallel, 2), cfg, AllReduceHook())
    rank = dist.get_rank()
    mine = tokens[:1] if rank == 0 else tokens[1:]
    pm.sync.set_rank_weight(len(mine))
    loss = F.cross_entropy(model(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten())
    (loss * pm.sync.loss_scale).backward()
    pm.sync.finish_gradient_sync()
    pm.sync.prepare_step(0.0)
    got = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
           for n, p in model.named_parameters()}  # fmt: skip
    return got, {n: p.grad for n, p in reference.named_parameters()}


def test_rank_weights_give_the_sample_weighted_average():
    """Catches: a plain mean over ranks when ranks processed different numbers of samples (the
    rank with 1 sequence would count as much as the one with 3), a weight applied twice or
    not at all, in plain data parallelism and under ZeRO."""
    for stage in (0, 2):
        got, want = spawn(weighted_gradients, 2, stage)[0]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=f"stage {stage} {name}")


def negative_weight_on_rank_1() -> str:
    cfg = load_config(None, BASE)
    pm = parallelize_llama(Transformer(cfg.model), ParallelDims.from_config(cfg.parallel, 2), cfg, AllReduceHook())
    try:
        pm.sync.set_rank_weight(-1.0 if dist.get_rank() == 1 else 1.0)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_negative_rank_weight_is_refused_on_every_rank():
    """Catches: a bad weight refused by its own rank only, before the collective, leaving the
    other ranks waiting in it until the timeout."""
    errors = spawn(negative_weight_on_rank_1, 2)
    assert all("negative rank weight" in e for e in errors), errors
