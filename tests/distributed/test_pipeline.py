"""Pipeline parallelism against one process: after 3 optimizer steps (SGD with momentum;
gradient clipping at 0.85, active on the first step, whose norm is 0.86) every parameter
equals the single-process model's, for each schedule at pp = 2 and 4 (ZB-H1's split backward
included), interleaved with v = 2,
fewer micro-batches than stages, split by time and by explicit boundaries; pp × dp with ZeRO
stages 0 to 3, and with lossless Top-K compression in the data-parallel reduction, equals dp
alone at the same dp; pp × Ulysses and pp × Megatron tensor and sequence parallelism
(activations between stages are sequence slices) equal one process.

Tolerance: 1e-5 relative, 1e-7 absolute (fp32). A pipeline runs the same operations on the
same micro-batches in the same order as one process (backwards visit micro-batches in order in
every schedule here), so it matches bit for bit or nearly; a lost or doubled gradient, a wrong
stage order or a mis-routed activation moves a parameter by far more after one step. pp × dp
is compared with dp alone, which the data-parallel tests compare with one process: the
data-parallel average sums in another order.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loomtrain.checkpoint import CheckpointManager, TrainState
from loomtrain.config import load_config
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.models.parallelize import parallelize_llama
from loomtrain.trainer import train_step
from tests.distributed.checks import CheckFailed, check_result, passed, run_checks

CPU = torch.device("cpu")
STEPS = 3
BASE = [
    "--model.n_layers=8", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16", "--model.vocab_size=64",
    "--training.seq_len=16", "--training.micro_batch_size=2", "--training.global_batch_size=8",
    "--training.grad_clip=0.85",
]  # fmt: skip
PP = "--parallel.pipeline_parallel_degree"
INTERLEAVED = ["--parallel.pipeline_schedule=interleaved_1f1b", "--parallel.virtual_stages=2"]
ZB_H1 = "--parallel.pipeline_schedule=zb_h1"

WORLD2 = {
    "dp2": [],
    "pp2_gpipe": [f"{PP}=2", "--parallel.pipeline_schedule=gpipe"],
    "pp2_1f1b": [f"{PP}=2"],
    "pp2_interleaved_v2": [f"{PP}=2", *INTERLEAVED],
    "pp2_zb_h1": [f"{PP}=2", ZB_H1],
    "pp2_split_by_time": [f"{PP}=2", "--parallel.pipeline_split=time"],
    "pp2_boundaries": [f"{PP}=2", "--parallel.stage_boundaries=[1]"],
}
WORLD4 = {
    "pp4_gpipe": [f"{PP}=4", "--parallel.pipeline_schedule=gpipe"],
    "pp4_1f1b": [f"{PP}=4"],
    "pp4_interleaved_v2": [f"{PP}=4", *INTERLEAVED],
    "pp4_zb_h1": [f"{PP}=4", ZB_H1],
    "pp4_1f1b_m2": [f"{PP}=4", "--training.global_batch_size=4"],
    "pp4_gpipe_m1": [f"{PP}=4", "--parallel.pipeline_schedule=gpipe", "--training.global_batch_size=2"],
    **{f"pp2_dp2_zero{z}": [f"{PP}=2", f"--data_parallel.zero_stage={z}"] for z in (0, 1, 2, 3)},
    "pp2_dp2_zb_h1_zero3": [f"{PP}=2", ZB_H1, "--data_parallel.zero_stage=3"],
    "pp2_dp2_topk_lossless": [f"{PP}=2", "--compression.method=topk", "--compression.topk_ratio=1.0"],
    "pp2_ulysses2": [f"{PP}=2", "--parallel.sequence_parallel_degree=2"],
    "pp2_tp2_megatron_sp": [f"{PP}=2", "--parallel.tensor_parallel_degree=2", "--parallel.tp_mode=sequence_parallel"],
    "pp2_dp2_interleaved_zero3": [f"{PP}=2", *INTERLEAVED, "--data_parallel.zero_stage=3",
                                  "--training.global_batch_size=8"],
}  # fmt: skip


def batches(step: int, global_batch: int, dp_rank: int, dp: int, micro: int):
    """This dp rank's micro-batches ``[(x, y)]`` of a step's global batch (same on every layout)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (global_batch, 17), generator=g)
    mine = tokens.chunk(dp)[dp_rank]
    return [(t[:, :-1], t[:, 1:]) for t in mine.split(micro)]


def train_params(extra: list[str], save: bool = False) -> dict[str, torch.Tensor]:
    """Full parameters after ``STEPS`` trainer steps on this process group's layout; with
    ``save``, a checkpoint of step ``STEPS`` is written to ``run.out_dir`` first."""
    cfg = load_config(None, [*BASE, *extra])
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    pm = parallelize_llama(model, dims, cfg, AllReduceHook())
    # SGD, unlike Adam, is not invariant to the gradient's scale: a wrong loss factor shows.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    pm.sync.attach_optimizer(optimizer)
    t = cfg.training
    for step in range(STEPS):
        train_step(pm, optimizer, batches(step, t.global_batch_size, dims.dp_rank, dims.dp, t.micro_batch_size),
                   cfg, CPU)  # fmt: skip
    if save:
        CheckpointManager(Path(cfg.run.out_dir), keep_last=1).save(STEPS, model, optimizer, TrainState(STEPS, {}), pm)
    pm.sync.remove()
    return {name: p.detach().clone() for name, p in pm.full_model().named_parameters()}


def run_cases(cases: dict[str, list[str]]) -> dict[str, dict[str, torch.Tensor] | CheckFailed]:
    """Each case's :func:`train_params`, by case name, on rank 0 (``{}`` on the others). Each
    case is a check of its own (:func:`run_checks`): a case that raises is a ``CheckFailed``
    in its place (naming every rank it raised on), which :func:`assert_same` reports, and the
    other cases still run."""
    out = run_checks({name: partial(train_params, extra) for name, extra in cases.items()})
    return out if dist.get_rank() == 0 else {}


def global_batch(extra: list[str]) -> str:
    return next((a.split("=")[1] for a in extra if "global_batch_size" in a), "8")


def reference_case(extra: list[str]) -> str:
    """The name of the single-process case with ``extra``'s global batch size."""
    return f"1 process, global batch {global_batch(extra)}"


@pytest.fixture(scope="module")
def reference():
    """Single-process parameters per global batch size (the layouts' only other difference)."""
    cases = {
        reference_case(e): [f"--training.global_batch_size={global_batch(e)}"]
        for e in (*WORLD2.values(), *WORLD4.values())
    }
    return spawn(run_cases, 1, cases, timeout_s=300)


@pytest.fixture(scope="module")
def world2():
    return spawn(run_cases, 2, WORLD2, timeout_s=600)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], name: str) -> None:
    """``got`` equals ``want`` (1e-5 relative, 1e-7 absolute); either may be a case of
    :func:`run_cases` that raised, which fails the test naming that case."""
    got, want = passed(got), passed(want)
    assert got.keys() == want.keys(), name
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_pipeline_parameters_equal_single_process_pp2(reference, world2):
    """Catches: a schedule that skips, repeats or misorders a micro-batch's forward or backward;
    activations or gradients sent to the wrong stage; a gradient norm not summed over pipeline
    ranks; a time-balanced split that differs between ranks; a ZB-H1 W that drops, doubles or
    never runs a micro-batch's weight gradient, or a B that sends a wrong input gradient."""
    for name, extra in WORLD2.items():
        if name != "dp2":
            assert_same(check_result(world2, name), check_result(reference, reference_case(extra)), name)


def test_pipeline_parameters_equal_single_process_pp4_and_pp2_dp2(reference, world2):
    """Catches, besides the pp = 2 bugs: a hang or wrong result with fewer micro-batches than
    stages; with pp × dp, gradients reduced before a stage's last backward, twice, or not at all
    (ZeRO 0-3; stage 3 also re-gathering stale parameters prefetched in the previous step; with
    ZB-H1, a reduction started at a B, which accumulates no gradient, instead of the last W)."""
    got = spawn(run_cases, 4, WORLD4, timeout_s=600)
    for name, extra in WORLD4.items():
        want = check_result(world2, "dp2") if "dp2" in name else check_result(reference, reference_case(extra))
        assert_same(check_result(got, name), want, name)
