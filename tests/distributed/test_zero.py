"""ZeRO stages 1-3 against plain data parallelism, resharded checkpoints, memory, fp16 scaling.

Tolerances: parameters within 1e-5 relative of stage 0 (fp32; the only difference is the
order of floating-point sums in all-reduce vs reduce-scatter). The five-step comparison uses
SGD with momentum for the reason given in test_data_parallel.py (Adam's first step turns a
1e-8 sum-order difference in a near-zero gradient into a large relative one); the checkpoint
test uses AdamW, since its moments are what must survive resharding.
"""

from __future__ import annotations

import contextlib
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from loomtrain.checkpoint import CheckpointManager, TrainState
from loomtrain.config import Config, ConfigError, ModelConfig, TrainingConfig, load_config
from loomtrain.distributed.data_parallel import apply_data_parallel
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.distributed.parallel_model import ParallelModel
from loomtrain.distributed.spawn import spawn
from loomtrain.distributed.sync import GradientSync
from loomtrain.distributed.traffic import Traffic
from loomtrain.distributed.zero import apply_zero
from loomtrain.models import Transformer
from loomtrain.optim import build_optimizer
from loomtrain.trainer import train_step
from tests.distributed.checks import check_result, run_checks
from tests.distributed.test_data_parallel import WithUnused

# vocab 50 and hidden 96 are not divisible by 4 ranks' rows evenly in every case (50 = 4·13 − 2):
# the uneven-shard padding path is exercised.
MODEL = ModelConfig(n_layers=2, n_heads=4, dim=32, max_seq_len=16, vocab_size=50)
MB, SEQ, ACCUM, STEPS = 2, 16, 2, 5
RTOL = 1e-5
CPU = torch.device("cpu")


def config(grad_clip: float) -> Config:
    training = TrainingConfig(seq_len=SEQ, grad_clip=grad_clip, lr=3e-3, warmup_steps=0, weight_decay=0.1)
    return Config(model=MODEL, training=training)


def micro_batches(step: int, world: int, accum: int):
    """This rank's micro-batches of a global batch that does not depend on the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = 4 * MB
    tokens = torch.randint(0, MODEL.vocab_size, (rows, SEQ + 1), generator=g)
    per = rows // (world * accum)
    rank = dist.get_rank()
    return [
        (tokens[s : s + per, :-1], tokens[s : s + per, 1:]) for s in ((a * world + rank) * per for a in range(accum))
    ]


def build(stage: int, mp: MixedPrecision | None = None, scaler: DynamicLossScaler | None = None):
    torch.manual_seed(0)
    model = Transformer(MODEL)
    if stage == 0:
        return model, apply_data_parallel(model, dist.group.WORLD, 0.01)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return model, apply_zero(model, mesh["dp"], stage, model.layers.values(), mp, scaler=scaler)


def run_step(model, sync, opt, batches, cfg: Config) -> float:
    """One training step of the trainer's own ``train_step`` on a data-parallel-only layout."""
    dims = ParallelDims(dp=dist.get_world_size(), world_size=dist.get_world_size())
    return train_step(
        ParallelModel(model, sync, dims, {}, Traffic(), lambda: Transformer(MODEL)), opt, batches, cfg, CPU
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def sgd_run(stage: int, world: int, mp: MixedPrecision | None = None) -> dict[str, torch.Tensor]:
    model, sync = build(stage, mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    sync.attach_optimizer(opt)
    cfg = config(grad_clip=0.05)  # small enough that clipping is active on every step
    for step in range(STEPS):
        run_step(model, sync, opt, micro_batches(step, world, ACCUM), cfg)
    return {n: full(p) for n, p in model.named_parameters()}


# (param_dtype, reduce_dtype) pairs whose model-state bytes are checked.
PRECISIONS = (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"))


def adam_state_bytes(stage: int, precision: tuple[str, str]) -> dict[str, int]:
    mp = MixedPrecision.from_names(*precision)
    model, sync = build(stage, mp)
    opt = build_optimizer(model, config(1.0).training)
    sync.attach_optimizer(opt)
    run_step(model, sync, opt, micro_batches(0, dist.get_world_size(), 1), config(1.0))
    return sync.state_bytes()


def fp16_overflow_skips_step() -> tuple[bool, float, float, bool]:
    scaler = DynamicLossScaler(init_scale=1024.0)
    model, sync = build(2, MixedPrecision.from_names("fp16", "fp32"), scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync.attach_optimizer(opt)
    before = [full(p) for p in model.parameters()]
    for x, y in micro_batches(0, dist.get_world_size(), 1):
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        (loss * sync.loss_scale).backward()
    sync.finish_gradient_sync()
    if dist.get_rank() == 0:  # an overflow on one rank's shard only must still skip everywhere
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    stepped = sync.prepare_step(1.0)
    if stepped:
        opt.step()
        sync.after_step()
    sync.zero_grad()
    unchanged = all(torch.equal(b, full(p)) for b, p in zip(before, model.parameters(), strict=True))
    return stepped, 1024.0, scaler.scale, unchanged


def local_step_matches_dtensor_step(stage: int) -> tuple[bool, bool, bool]:
    """AdamW (with weight decay) on the masters' local shards and on the DTensors themselves,
    3 steps from the same start: (parameters equal bit for bit, moments equal bit for bit,
    every moment a DTensor placed like its parameter between steps)."""
    runs = []
    for local in (True, False):
        model, sync = build(stage)
        opt = build_optimizer(model, config(1.0).training)
        (sync.attach_optimizer if local else partial(GradientSync.attach_optimizer, sync))(opt)
        for step in range(3):
            run_step(model, sync, opt, micro_batches(step, dist.get_world_size(), 1), config(1.0))
        runs.append((list(model.parameters()), opt))
    (params, opt), (ref_params, ref_opt) = runs
    same_params = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(params, ref_params, strict=True))
    moments = [(opt.state[p][k], ref_opt.state[q][k]) for p, q in zip(params, ref_params, strict=True)
               for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    same_moments = all(torch.equal(a.to_local(), b.to_local()) for a, b in moments)
    placed = all(isinstance(p, DTensor) and opt.state[p]["exp_avg"].placements == p.placements for p in params)
    return same_params, same_moments, placed


CKPT_STEPS = 2


def unused_parameter_grads(stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = WithUnused()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    sync = apply_zero(model, mesh["dp"], stage, [])
    model(torch.full((2, 4), float(dist.get_rank()))).sum().backward()
    sync.finish_gradient_sync()
    return full(model.used.weight.grad), full(model.unused.weight.grad)


def hooked_parameter_grad(stage: int) -> torch.Tensor:
    """The reduced gradient of a weight with a gradient hook (times 3) under ``stage``."""
    torch.manual_seed(0)
    model = WithUnused()
    model.used.weight.register_hook(lambda g: 3 * g)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    sync = apply_zero(model, mesh["dp"], stage, [])
    model(torch.full((2, 4), float(dist.get_rank()))).sum().backward()
    sync.finish_gradient_sync()
    return full(model.used.weight.grad)


def bytes_check(stage: int, precision: tuple[str, str]) -> str:
    return f"state bytes stage {stage} {'/'.join(precision)}"


def zero_checks(world: int, ckpt_dir: str) -> dict:
    """Everything one world size checks, in one spawn (process start-up dominates the time),
    each a check of its own (:func:`run_checks`): one that raises fails only the tests reading it.
    World size 4 writes the stage-3 checkpoint that world size 2 then loads."""
    bf16 = {reduce: MixedPrecision.from_names("bf16", reduce) for reduce in ("fp32", "bf16")}
    checks = {f"sgd stage {stage}": partial(sgd_run, stage, world) for stage in (0, 1, 2, 3)}
    checks["bf16 stage 1 reduce fp32"] = partial(sgd_run, 1, world, bf16["fp32"])
    checks |= {f"bf16 stage {stage} reduce bf16": partial(sgd_run, stage, world, bf16["bf16"]) for stage in (1, 2, 3)}
    checks |= {bytes_check(s, p): partial(adam_state_bytes, s, p) for s in (1, 2, 3) for p in PRECISIONS}
    checks["n_params"] = lambda: sum(p.numel() for p in Transformer(MODEL).parameters())
    if world == 4:
        checks["save"] = partial(save_then_continue, ckpt_dir, 3, CKPT_STEPS)
    if world == 2:
        checks["fp16 overflow"] = fp16_overflow_skips_step
        checks |= {f"unused stage {stage}": partial(unused_parameter_grads, stage) for stage in (1, 2, 3)}
        checks |= {f"hooked stage {stage}": partial(hooked_parameter_grad, stage) for stage in (1, 3)}
        checks |= {f"local step stage {stage}": partial(local_step_matches_dtensor_step, stage) for stage in (1, 3)}
        for stage in (3, 1):
            checks[f"load stage {stage}"] = partial(load_then_continue, ckpt_dir, (stage,), CKPT_STEPS)
    return run_checks(checks)


@pytest.fixture(scope="module")
def ckpt_dir():
    with tempfile.TemporaryDirectory(prefix="loomtrain-zero-ckpt-") as d:
        yield d


@pytest.fixture(scope="module")
def world4(ckpt_dir):
    return spawn(zero_checks, 4, 4, ckpt_dir)


@pytest.fixture(scope="module")
def world2(ckpt_dir, request):
    # After world4: it writes the checkpoint loaded here. Should world4's spawn itself crash,
    # world 2's checks still run (its load checks then fail on the missing checkpoint).
    with contextlib.suppress(Exception):
        request.getfixturevalue("world4")
    return spawn(zero_checks, 2, 2, ckpt_dir)


@pytest.fixture(params=[2, 4])
def checks(request):
    return request.param, request.getfixturevalue(f"world{request.param}")


def test_stages_match_plain_data_parallel_with_accumulation_and_clipping(checks):
    """Catches: a shard reduced or applied to the wrong rows (uneven dim 0 especially), a
    missing or doubled average, clipping by a rank-local norm, accumulation lost in no_sync."""
    world, results = checks
    for rank in range(world):
        ref = check_result(results, "sgd stage 0", rank)
        for stage in (1, 2, 3):
            got = check_result(results, f"sgd stage {stage}", rank)
            for name, want in ref.items():
                torch.testing.assert_close(
                    got[name], want, rtol=RTOL, atol=1e-7,
                    msg=lambda m, where=f"stage {stage} world {world} rank {rank} {name}": f"{where}: {m}",
                )  # fmt: skip


def test_bf16_reduction_matches_fp32_reduction(checks):
    """Catches: a bf16 gradient shard applied to the wrong rows or never turned into the
    masters' fp32 ``.grad``. bf16 parameters in every run; reducing and holding gradients in
    bf16 only rounds them (8 bits of mantissa): parameters after 5 steps agree within 1e-3 of
    each tensor's largest magnitude (measured: up to 1.6e-4), where a misplaced shard is O(1)."""
    world, results = checks
    ref = check_result(results, "bf16 stage 1 reduce fp32")
    for stage in (1, 2, 3):
        got = check_result(results, f"bf16 stage {stage} reduce bf16")
        for name, want in ref.items():
            err = ((got[name] - want).abs().max() / want.abs().max()).item()
            assert err <= 1e-3, f"stage {stage} world {world} {name}: {err:.2e}"


def formula_bytes(stage: int, precision: tuple[str, str], psi: int, n: int) -> float:
    """Per-rank persistent model-state bytes for Ψ parameters on N ranks, Adam, as held here.

    bf16 parameters and bf16 reduction, the paper's mixed precision (Rajbhandari et al. §3.1,
    §5: 2 bytes of parameters, 2 of gradients, K = 12 of fp32 master and moments): stage 1 =
    2Ψ bf16 params + 2Ψ bf16 gradients + 12Ψ/N = 4Ψ + 12Ψ/N, stage 2 = 2Ψ + 14Ψ/N, both the
    paper's. Stage 3 = 14Ψ/N, 2Ψ/N below the paper's 16Ψ/N: no bf16 parameter shard is kept
    next to the fp32 master, gathers convert the master on the fly. The masters' transient
    fp32 gradient copy (4Ψ/N, alive only around the optimizer step) is not counted.
    bf16 parameters, fp32 reduction (the default reduce dtype): the fp32 gradient is held, so
    stage 1 = 6Ψ + 12Ψ/N, stage 2 = 2Ψ + 16Ψ/N, stage 3 = 16Ψ/N.
    fp32 (the master is the parameter itself, K = 8): stage 1 = 8Ψ + 8Ψ/N,
    stage 2 = 4Ψ + 12Ψ/N, stage 3 = 16Ψ/N.
    """
    per_param = {
        ("fp32", "fp32"): {1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n},
        ("bf16", "fp32"): {1: 6 + 12 / n, 2: 2 + 16 / n, 3: 16 / n},
        ("bf16", "bf16"): {1: 4 + 12 / n, 2: 2 + 14 / n, 3: 14 / n},
    }
    return per_param[precision][stage] * psi


def paper_bytes(stage: int, psi: int, n: int) -> float:
    """The paper's mixed-precision Adam figures (§5, K = 12)."""
    return {1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage] * psi


def test_model_state_bytes_match_zero_formulas(checks):
    """Catches: state held twice (a master next to an identical full copy, unfreed stage-3
    parameters or gradients, full gradients kept in stage 2, an fp32 gradient kept in the
    bf16-reduce configuration)."""
    world, results = checks
    psi = check_result(results, "n_params")
    for stage, precision in ((s, p) for s in (1, 2, 3) for p in PRECISIONS):
        measured = check_result(results, bytes_check(stage, precision))
        total = sum(measured.values())
        want = formula_bytes(stage, precision, psi, world)
        where = f"stage {stage} {precision} world {world}: {measured}"
        assert abs(total - want) <= 0.05 * want, f"{where} vs {want:.0f}"
        if precision == ("bf16", "bf16"):
            paper = paper_bytes(stage, psi, world)
            assert total <= 1.05 * paper, f"{where} vs paper {paper:.0f}"


def test_fp16_overflow_skips_step_and_halves_scale(checks):
    """Catches: a step applied with inf gradients, a scale not lowered, ranks that disagree."""
    world, results = checks
    if world != 2:
        pytest.skip("checked at world size 2")
    for rank in range(world):
        stepped, before, after, unchanged = check_result(results, "fp16 overflow", rank)
        assert not stepped and after == before / 2 and unchanged


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Full parameters and Adam moments by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = full(opt.state[p][key])
    return out


def adam_setup(stage: int):
    model, sync = build(stage)
    opt = build_optimizer(model, config(1.0).training)
    sync.attach_optimizer(opt)
    return model, sync, opt


def global_step_loss(model, sync, opt, step: int) -> float:
    world = dist.get_world_size()
    local = run_step(model, sync, opt, micro_batches(step, world, 1), config(1.0))
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def save_then_continue(ckpt_dir: str, stage: int, steps: int) -> tuple[dict, float]:
    model, sync, opt = adam_setup(stage)
    for step in range(steps):
        global_step_loss(model, sync, opt, step)
    CheckpointManager(Path(ckpt_dir), keep_last=1).save(steps, model, opt, TrainState(steps, {}))
    state = snapshot(model, opt)
    return state, global_step_loss(model, sync, opt, steps)


def load_then_continue(ckpt_dir: str, stages: tuple[int, ...], steps: int) -> dict[int, tuple[dict, float]]:
    out = {}
    for stage in stages:
        model, sync, opt = adam_setup(stage)
        path = Path(ckpt_dir) / f"step_{steps:08d}"
        CheckpointManager(Path(ckpt_dir), keep_last=1).load(path, model, opt)
        out[stage] = snapshot(model, opt), global_step_loss(model, sync, opt, steps)
    return out


def test_stage3_checkpoint_reshards_to_other_world_sizes_and_stages(world4, world2, ckpt_dir):
    """Catches: shards saved under the wrong global offsets, padding written into the
    checkpoint, moments not resharded, a stage 1-2 full copy not refreshed after loading.

    Saved at world size 4 (stage 3); loaded at world size 2 (stages 3 and 1) and in one
    process (stage 0). Parameters and moments must be bit-identical after loading; the next
    step's loss (the global mean over the same 8 sequences) within 1e-5 relative of the run
    that never stopped.
    """
    saved, loss_next = check_result(world4, "save")
    loaded = {f"world 2 stage {k}": check_result(world2, f"load stage {k}")[k] for k in (3, 1)}
    loaded["1 process"] = spawn(load_then_continue, 1, ckpt_dir, (0,), CKPT_STEPS)[0][0]
    for where, (state, loss) in loaded.items():
        assert state.keys() == saved.keys()
        for key, want in saved.items():
            torch.testing.assert_close(state[key], want, rtol=0, atol=0, msg=lambda m, k=f"{where} {key}": f"{k}: {m}")
        assert loss == pytest.approx(loss_next, rel=1e-5), where


def test_optimizer_steps_local_shards_exactly_as_it_would_step_dtensors(world2):
    """Catches: the local-shard step (``LocalShardStep``) updating other memory than the
    masters' (parameters or moments would then differ from the DTensor step), or leaving
    plain tensors in the optimizer state, which DCP would save as replicated and so mix up
    the ranks' shards on resume."""
    for stage in (1, 3):
        same_params, same_moments, placed = check_result(world2, f"local step stage {stage}")
        assert same_params, f"stage {stage}: parameters differ from the DTensor step's"
        assert same_moments, f"stage {stage}: AdamW moments differ from the DTensor step's"
        assert placed, f"stage {stage}: optimizer state is not DTensors placed like the masters"


def test_bad_zero_settings_are_refused_by_the_config():
    """Catches: a stage out of range, or a 16-bit param_dtype silently ignored by stage 0."""
    with pytest.raises(ConfigError, match="data_parallel.zero_stage"):
        load_config(None, ["--data_parallel.zero_stage=4"])
    with pytest.raises(ConfigError, match="data_parallel.zero_stage >= 1"):
        load_config(None, ["--data_parallel.param_dtype=bf16"])


def test_unused_parameter_is_reduced_as_zero_instead_of_hanging(world2):
    """Catches: a unit whose reduction waits forever for a gradient that never comes."""
    for stage in (1, 2, 3):
        used, unused = check_result(world2, f"unused stage {stage}")
        assert torch.count_nonzero(unused) == 0, stage
        assert torch.allclose(used, torch.full_like(used, 0.5 * 2)), stage  # mean of inputs 0 and 1, batch 2


def test_gradient_hooks_move_to_the_compute_tensor(world2):
    """Catches: a parameter's gradient hook lost when ZeRO-3 computes with a new full tensor
    (2D and Megatron SP norm weights sum their gradient over tp ranks in such a hook; without
    it each rank would step on its own part, a gap of 3e-6 in a 4-step loss that the trainer
    tests cannot see). Stage 1 (fp32) computes with the parameter itself."""
    for stage in (1, 3):
        grad = check_result(world2, f"hooked stage {stage}")
        assert torch.allclose(grad, torch.full_like(grad, 3 * 0.5 * 2)), stage  # 3 × the unhooked mean
