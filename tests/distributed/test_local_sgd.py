"""Local SGD, DiLoCo and streaming DiLoCo (``distributed/local_sgd.py``) on real 2-process gloo
groups (one spawn for local SGD/DiLoCo, one for streaming), and their config checks in-process.

Tolerance: 1e-6 relative (fp32). With SGD + momentum as the inner optimizer and no clipping,
every inner update is linear in the gradient, so local SGD with H = 1 applies the same update
as synchronous DP and differs from it only in the order of float sums (~1e-7 over a few steps).
A wrong average, a delta of the wrong sign, a skipped or extra outer step moves the parameters
by ~1e-2. AdamW inner steps are compared only between modes that share them exactly.
"""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.config import ConfigError, DataParallelConfig, ModelConfig, load_config
from loomtrain.distributed.collectives import HierarchicalHook, ReplicaSplitHook
from loomtrain.distributed.data_parallel import AllReduceHook, apply_data_parallel
from loomtrain.distributed.local_sgd import (
    LocalOnlyHook,
    OuterSync,
    StreamingOuterSync,
    block_fragment,
    block_fragments,
    build_outer_sync,
    check_identical,
    flatten,
    fragment_runs,
    outer_group,
    outer_reducer,
    payload_hook,
    replicas_sync_inside,
    write_flat,
)
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.distributed.topology import Topology
from loomtrain.distributed.traffic import GRADIENT_AXIS, INTER_HOST_AXIS, all_gather_bytes, all_reduce_bytes
from loomtrain.models import Transformer
from tests.distributed.checks import check_result, run_checks, spawn_once
from tests.distributed.test_hierarchical import topology

CFG = ModelConfig(n_layers=1, n_heads=2, dim=16, max_seq_len=8, vocab_size=32)
CFG2 = ModelConfig(n_layers=2, n_heads=2, dim=16, max_seq_len=8, vocab_size=32)  # streaming: up to 2 fragments
# 4 blocks: 2 strided fragments (blocks 0, 2 and 1, 3) differ from 2 sequential ones (0-1 and 2-3).
CFG4 = ModelConfig(n_layers=4, n_heads=2, dim=16, max_seq_len=8, vocab_size=32)
STEPS, RTOL = 7, 1e-6
# Streaming DiLoCo whose outer gradients sum the same in any layout: bf16 rounds each element
# alone (int8's scales span a chunk of the rows a rank holds).
STREAMING = ["--data_parallel.fragments=2", "--data_parallel.overlap_steps=1", "--data_parallel.outer_grad_dtype=bf16"]
# 3 fragments of test_pipeline's 8 blocks (0-2, 3-5, 6-7): a pp 2 stage (blocks 0-3 or 4-7) holds
# one fragment whole, part of another and none of the third.
STREAMING_F3 = ["--data_parallel.fragments=3", *STREAMING[1:]]
# Strided, the same 3 fragments of 8 blocks are 0, 3, 6 / 1, 4, 7 / 2, 5: each pp 2 stage holds part of every one.
STRIDED_F3 = [*STREAMING_F3, "--data_parallel.fragment_pattern=strided"]
INT8 = ["--data_parallel.outer_grad_dtype=int8"]
# 4 one-rank replicas on 2 hosts of 2 ranks, the outer all-reduce hierarchical over them.
HIER = ["--data_parallel.comm_hook=hierarchical"]
TWO_HOSTS = topology([(0, 1), (2, 3)])
# 2D tensor parallelism with the least work that still runs every 2D layer: 1 block, one
# micro-batch of 2 sequences per rank and step (test_pipeline's model otherwise); GRID1 on a 1×1
# grid (tp 1), GRID4 on a 2×2 grid (tp 4).
GRID1 = ["--parallel.tp_mode=2d", "--model.n_layers=1", "--training.global_batch_size=4"]
GRID4 = ["--parallel.tensor_parallel_degree=4", *GRID1]
# The same 2×2 grids as 2 replicas over dp_replicate (a dp_shard group of one rank each): ZeRO inside.
GRID4_R2 = [*GRID4, "--parallel.data_parallel_replicate_degree=2"]
# Streaming DiLoCo on the grid: 2 blocks in 2 fragments, overlap τ = 1, fp32 outer gradients (bf16
# would round the two layouts' slightly different sums to different values).
GRID_STREAMING = ["--model.n_layers=2", "--data_parallel.fragments=2", "--data_parallel.overlap_steps=1"]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``: 2 sequences of 8 tokens, different per rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_model(optimizer: str, hook=None, cfg: ModelConfig = CFG):
    torch.manual_seed(0)
    model = Transformer(cfg)
    sync = apply_data_parallel(model, dist.group.WORLD, hook=hook)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, sync, opt


def inner_step(model, sync, opt, step: int) -> float:
    """One optimizer step on this rank's batch; returns the loss averaged over ranks."""
    x, y = batch(dist.get_rank(), step)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    sync.finish_gradient_sync()
    opt.step()
    sync.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def train_sync(optimizer: str) -> tuple[list[float], torch.Tensor]:
    model, sync, opt = make_model(optimizer)
    losses = [inner_step(model, sync, opt, s) for s in range(STEPS)]
    return losses, flatten(list(model.parameters()))


def train_local(optimizer: str, mode: str, h: int, lr: float = 0.7, momentum: float = 0.9, start=None):
    """``STEPS`` steps of local SGD/DiLoCo; ``start``: ``(step, state)`` to resume from. Returns the
    losses, the final parameters, the replicas' largest parameter difference right after each
    outer step and right before it, the dp bytes sent before each outer step, the outer sync."""
    model, sync, opt = make_model(optimizer, LocalOnlyHook())
    params = list(model.parameters())
    outer = OuterSync(params, opt, dist.group.WORLD, mode, h, lr, momentum, hook=sync.hook)
    first = 0
    if start is not None:
        first, state = start
        outer.load_state_dict(state)
    losses, after, before, sent = [], [], [], []
    for s in range(first, STEPS):
        losses.append(inner_step(model, sync, opt, s))
        spread, sent_so_far = gathered_spread(params), sync.hook.traffic.bytes[GRADIENT_AXIS]
        if outer.after_inner_step(force=s == STEPS - 1):
            before.append(spread)
            after.append(gathered_spread(params))
            sent.append(sent_so_far)
    return losses, flatten(params), after, before, sent, outer


def gathered_spread(params) -> float:
    """Largest difference between the two ranks' parameters, a list or one flat tensor (a collective)."""
    flat = flatten(params) if isinstance(params, list) else params
    both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(both, flat)
    return (both[0] - both[1]).abs().max().item()


def h1_equals_sync():
    sync_losses, sync_params = train_sync("sgd")
    local_losses, local_params, *_ = train_local("sgd", "local_sgd", 1)
    return sync_losses, sync_params, local_losses, local_params


def diloco_lr1_equals_local_sgd():
    local_losses, local_params, *_ = train_local("adamw", "local_sgd", 3)
    diloco_losses, diloco_params, *_ = train_local("adamw", "diloco", 3, lr=1.0, momentum=0.0)
    return local_losses, local_params, diloco_losses, diloco_params


def replicas_after_outer_steps():
    _, _, after, before, sent, outer = train_local("adamw", "diloco", 3)
    return (
        after,
        before,
        sent,
        outer.hook.bytes_sent,
        outer.hook.dense_bytes,
        outer.outer_steps,
        outer.global_flat.numel(),
    )


def nesterov_outer_step():
    """Two outer steps from hand-set replicas θ_g − d_r against the formula of DiLoCo's outer
    Nesterov SGD on Δ = mean_r d_r: ``b ← μ·b + Δ; θ ← θ − lr·(Δ + μ·b)``."""
    model, _, opt = make_model("adamw", LocalOnlyHook())
    params = list(model.parameters())
    outer = OuterSync(params, opt, dist.group.WORLD, "diloco", 1, 0.7, 0.9)
    theta, buf, rank = flatten(params), None, dist.get_rank()
    for k in range(2):
        d = torch.linspace(-1, 1, theta.numel()) * (rank + 1) * (k + 1) * 1e-2
        write_flat(theta - d, params)
        outer.outer_step()
        delta = torch.linspace(-1, 1, theta.numel()) * 1.5 * (k + 1) * 1e-2  # mean over ranks of (r + 1)
        buf = delta if buf is None else 0.9 * buf + delta
        theta = theta - 0.7 * (delta + 0.9 * buf)
    return flatten(params), theta


def swapped_elements_refused_in_chunks():
    """Two elements swapped on rank 1 (same plain sum), fingerprinted 7 elements at a time."""
    flat = torch.arange(20, dtype=torch.float32)
    check_identical(flat, dist.group.WORLD, "the same tensor", chunk=7)
    if dist.get_rank() == 1:
        flat[[2, 15]] = flat[[15, 2]]
    try:
        check_identical(flat, dist.group.WORLD, "a permuted tensor", chunk=7)
    except RuntimeError as e:
        return str(e)
    return None


def different_init_refused():
    torch.manual_seed(0)
    model = Transformer(CFG)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.norm.weight[3] += 1e-3
    opt = torch.optim.AdamW(model.parameters())
    try:
        OuterSync(list(model.parameters()), opt, dist.group.WORLD, "local_sgd", 2)
    except RuntimeError as e:
        return str(e)
    return None


def resume_mid_phase():
    """The run stopped after 4 steps (1 step into its second inner phase of 3) and resumed
    into a fresh model, optimizer and outer sync, against the uninterrupted run."""
    whole_losses, whole_params, *_ = train_local("adamw", "diloco", 3)
    model, sync, opt = make_model("adamw", LocalOnlyHook())
    outer = OuterSync(list(model.parameters()), opt, dist.group.WORLD, "diloco", 3)
    for s in range(4):
        inner_step(model, sync, opt, s)
        outer.after_inner_step()
    state = copy.deepcopy(outer.state_dict())
    resumed_losses, resumed_params, *_ = train_local("adamw", "diloco", 3, start=(4, state))
    return whole_losses[4:], whole_params, resumed_losses, resumed_params, state["inner_done"]


def all_checks() -> dict:
    return run_checks({
        "h1_equals_sync": h1_equals_sync,
        "diloco_lr1_equals_local_sgd": diloco_lr1_equals_local_sgd,
        "replicas_after_outer_steps": replicas_after_outer_steps,
        "nesterov_outer_step": nesterov_outer_step,
        "different_init_refused": different_init_refused,
        "swapped_elements_refused_in_chunks": swapped_elements_refused_in_chunks,
        "resume_mid_phase": resume_mid_phase,
        # The references of the replicas of dp_shard ranks (4 processes, below): one rank per replica.
        "local_sgd_h2": lambda: train_local_tp("local_sgd", [], 2, evaluate=True),
        "diloco_h2": lambda: train_local_tp("diloco", [], 2, evaluate=True),
        "streaming_h2": lambda: train_local_tp("streaming_diloco", STREAMING, 2, evaluate=True),
        "diloco_int8_h2": lambda: train_local_tp("diloco", INT8, 2, evaluate=True),
        # 2D tp's model, loss and checkpoint layout on a 1×1 grid (the 2×2 grid needs 8 processes: slow).
        "sync_grid1": lambda: train_local_tp("sync", GRID1),
        "local_sgd_grid1": lambda: train_local_tp("local_sgd", GRID1),
        "diloco_h2_grid1": lambda: train_local_tp("diloco", GRID1, 2, evaluate=True, finish=True),
        "streaming_h2_grid1": lambda: train_local_tp("streaming_diloco", [*GRID1, *GRID_STREAMING], 2, True, True),
    })  # fmt: skip


def streaming(model, opt, hook, **settings) -> StreamingOuterSync:
    cfg = DataParallelConfig(mode="streaming_diloco", **settings)
    return StreamingOuterSync(list(model.named_parameters()), opt, dist.group.WORLD, cfg, hook)


def streaming_f1_equals_diloco():
    """DiLoCo and streaming DiLoCo with F = 1, τ = 0, fp32 (H = 3, 7 AdamW steps, the last one
    forced): each run's losses, final parameters, outer steps and bytes sent."""
    runs = []
    for mode in ("diloco", "streaming_diloco"):
        model, sync, opt = make_model("adamw", LocalOnlyHook(), CFG2)
        if mode == "diloco":
            outer = OuterSync(list(model.parameters()), opt, dist.group.WORLD, mode, 3, hook=sync.hook)
        else:
            outer = streaming(model, opt, sync.hook, inner_steps=3, fragments=1, overlap_steps=0)
        losses = []
        for s in range(STEPS):
            losses.append(inner_step(model, sync, opt, s))
            outer.after_inner_step(force=s == STEPS - 1)
        runs.append((losses, flatten(list(model.parameters())), outer.outer_steps, sync.hook.bytes_sent))
    return runs


def streaming_run(dtype: str, overlap: int, stop: int = STEPS, start=None, pattern: str = "sequential",
                  cfg: ModelConfig = CFG2) -> dict:  # fmt: skip
    """Streaming DiLoCo with F = 2 fragments (``pattern``) of ``cfg``'s blocks, H = 4 (offsets 0
    and 2), the last of ``STEPS`` steps forced. Per step, after the outer sync's turn: each
    fragment's replica spread and θ_global spread, the bytes sent, whether θ_global's fragment
    changed. ``stop`` ends early and returns the state instead; ``start`` = ``(step, state)``
    resumes."""
    model, sync, opt = make_model("adamw", LocalOnlyHook(), cfg)
    outer = streaming(model, opt, sync.hook, inner_steps=4, fragments=2, overlap_steps=overlap, outer_grad_dtype=dtype,
                      fragment_pattern=pattern)  # fmt: skip
    params, first = list(model.parameters()), 0
    if start is not None:
        first, state = start
        outer.load_state_dict(state)
    rec = {"losses": [], "spread": [], "global_spread": [], "sent": [], "moved": []}
    for s in range(first, stop):
        rec["losses"].append(inner_step(model, sync, opt, s))
        sent, theta = outer.hook.bytes_sent, outer.global_flat.clone()
        outer.after_inner_step(force=s == STEPS - 1)
        rec["sent"].append(outer.hook.bytes_sent - sent)
        rec["spread"].append([gathered_spread(outer.fragment_params(f)) for f in range(len(outer.runs))])
        rec["global_spread"].append(gathered_spread(outer.global_flat))
        rec["moved"].append([any(not torch.equal(outer.global_flat[e], theta[e]) for _, e in runs)
                             for runs in outer.runs])  # fmt: skip
    rec["numels"] = [sum(e.stop - e.start for _, e in runs) for runs in outer.runs]
    rec["params"] = flatten(params)
    if stop < STEPS:
        rec["state"] = copy.deepcopy(outer.state_dict())
        rec["in_flight"] = len(outer.pending)
    return rec


def streaming_resume_in_flight(pattern: str = "sequential", cfg: ModelConfig = CFG2):
    """bf16, τ = 1: stopped after step 2 (fragment 1's all-reduce in flight), resumed into a
    fresh model, optimizer and outer sync, against the uninterrupted run."""
    whole = streaming_run("bf16", 1, pattern=pattern, cfg=cfg)
    stopped = streaming_run("bf16", 1, stop=2, pattern=pattern, cfg=cfg)
    resumed = streaming_run("bf16", 1, start=(2, stopped["state"]), pattern=pattern, cfg=cfg)
    return whole, stopped["in_flight"], resumed


def strided_sync_averages() -> list[list[tuple[float, float]]]:
    """Strided streaming with outer lr 1 and no momentum (a sync then sets the fragment to the
    replicas' mean, as local SGD does), F = 2 of 4 blocks, H = 4, τ = 0, fp32, the last of
    ``STEPS`` steps forced. Per step and fragment: the largest difference of this rank's
    fragment after the outer sync's turn from the replicas' mean before it, and from its own
    values before it."""
    model, sync, opt = make_model("adamw", LocalOnlyHook(), CFG4)
    outer = streaming(model, opt, sync.hook, inner_steps=4, fragments=2, overlap_steps=0, outer_lr=1.0,
                      outer_momentum=0.0, fragment_pattern="strided")  # fmt: skip
    out = []
    for s in range(STEPS):
        inner_step(model, sync, opt, s)
        before = [flatten(outer.fragment_params(f)) for f in range(2)]
        means = [x.clone() for x in before]
        for x in means:
            dist.all_reduce(x)
            x.div_(dist.get_world_size())
        outer.after_inner_step(force=s == STEPS - 1)
        after = [flatten(outer.fragment_params(f)) for f in range(2)]
        out.append([((a - m).abs().max().item(), (a - b).abs().max().item())
                    for a, m, b in zip(after, means, before, strict=True)])  # fmt: skip
    return out


def strided_state_refused_by_sequential():
    """A strided run's checkpoint state loaded by a sequential run of the same F: the error."""
    state = streaming_run("fp32", 0, stop=2, pattern="strided", cfg=CFG4)["state"]
    model, sync, opt = make_model("adamw", LocalOnlyHook(), CFG4)
    outer = streaming(model, opt, sync.hook, inner_steps=4, fragments=2, overlap_steps=0)
    try:
        outer.load_state_dict(state)
    except ValueError as err:
        return str(err)
    return None


def diloco_quantized():
    """DiLoCo built by ``build_outer_sync`` with fp32 and with int8 outer gradients (H = 3, 7 AdamW
    steps, the last forced): the outer sync's class and fragments, the final parameters, the bytes
    sent, and the replicas' parameter spread at the end."""
    runs, outers = {}, {}
    for dtype in ("fp32", "int8"):
        model, sync, opt = make_model("adamw", LocalOnlyHook(), CFG2)
        cfg = DataParallelConfig(mode="diloco", inner_steps=3, outer_grad_dtype=dtype)
        outer = build_outer_sync(cfg, model, opt, dist.group.WORLD, sync.hook)
        for s in range(STEPS):
            inner_step(model, sync, opt, s)
            outer.after_inner_step(force=s == STEPS - 1)
        params, outers[dtype] = flatten(list(model.parameters())), outer
        runs[dtype] = {"kind": type(outer).__name__, "fragments": len(getattr(outer, "runs", [None])),
                       "outer_steps": outer.outer_steps, "params": params, "sent": sync.hook.bytes_sent,
                       "spread": gathered_spread(params)}  # fmt: skip
    refused = []
    for into, source in (("fp32", "int8"), ("int8", "fp32")):
        try:
            outers[into].load_state_dict(outers[source].state_dict())
        except ValueError as err:
            refused.append(str(err))
    runs["refused"] = refused
    return runs


def streaming_checks() -> dict:
    return run_checks({
        "f1_equals_diloco": streaming_f1_equals_diloco,
        "diloco_quantized": diloco_quantized,
        "offsets_fp32": lambda: streaming_run("fp32", 0),
        "overlap_bf16": lambda: streaming_run("bf16", 1),
        "overlap_int8": lambda: streaming_run("int8", 1),
        "resume_in_flight": streaming_resume_in_flight,
        "strided_fp32": lambda: streaming_run("fp32", 0, pattern="strided", cfg=CFG4),
        "sequential_fp32_4_blocks": lambda: streaming_run("fp32", 0, cfg=CFG4),
        "strided_resume_in_flight": lambda: streaming_resume_in_flight("strided", CFG4),
        "strided_state_refused": strided_state_refused_by_sequential,
        "strided_sync_averages": strided_sync_averages,
    })  # fmt: skip


def results():
    return spawn_once(all_checks, 2, timeout_s=120)


def streaming_results():
    return spawn_once(streaming_checks, 2, timeout_s=120)


def assert_rel(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= RTOL, f"relative difference {rel:.2e} > {RTOL}"


@pytest.mark.parametrize("rank", [0, 1])
def test_local_sgd_h1_equals_sync_dp(rank):
    """Catches: inner steps that still all-reduce gradients or outer steps that average
    wrongly (a sum instead of a mean, a stale θ_global, the delta's sign flipped): with SGD +
    momentum, local SGD at H = 1 must reproduce synchronous DP's losses and parameters."""
    sync_losses, sync_params, local_losses, local_params = check_result(results(), "h1_equals_sync", rank)
    assert_rel(torch.tensor(local_losses), torch.tensor(sync_losses))
    assert_rel(local_params, sync_params)


def test_diloco_with_outer_lr_1_and_no_momentum_equals_local_sgd():
    """Catches: a DiLoCo outer step in the wrong direction (torchtitan #1507), on the wrong
    delta, or with hidden momentum: with outer lr 1 and momentum 0 it must be local SGD."""
    local_losses, local_params, diloco_losses, diloco_params = check_result(results(), "diloco_lr1_equals_local_sgd")
    assert_rel(torch.tensor(diloco_losses), torch.tensor(local_losses))
    assert_rel(diloco_params, local_params)


def test_replicas_identical_after_each_outer_step_and_only_outer_steps_communicate():
    """Catches: a replica that does not take θ_global after an outer step, inner steps that
    all-reduce (the replicas would never differ before an outer step), an outer step skipped
    or the final one not forced (7 steps at H = 3: outer steps after steps 3, 6 and 7), and a
    byte count that is not one fp32 all-reduce of the parameters per outer step."""
    after, before, sent, total, dense, outer_steps, numel = check_result(results(), "replicas_after_outer_steps")
    assert outer_steps == 3
    assert after == [0.0] * 3
    assert all(spread > 0 for spread in before)
    one = all_reduce_bytes(4 * numel, 2)
    assert sent == [0, one, 2 * one] and total == dense == 3 * one


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_delta():
    """Catches: momentum applied without Nesterov's look-ahead, a buffer not kept between outer
    steps, the outer gradient taken as mean θ_local − θ_global (stepping away from the replicas)."""
    got, want = check_result(results(), "nesterov_outer_step")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_replicas_started_with_different_weights_are_refused():
    """Catches: replicas initialised differently (one element off, or two elements swapped
    across fingerprint chunks) training on silently: their average would not be a model any of
    them trained."""
    for rank in (0, 1):
        message = check_result(results(), "different_init_refused", rank)
        assert message is not None and "differs across the dp replicas" in message
        message = check_result(results(), "swapped_elements_refused_in_chunks", rank)
        assert message is not None and "a permuted tensor differs" in message


def test_resume_inside_an_inner_phase_continues_the_run_exactly():
    """Catches: θ_global, the outer momentum, the inner step counter, θ_local or the inner
    optimizer's moments missing from the outer sync's state: the resumed steps' losses and the
    final parameters would differ from the uninterrupted run's."""
    whole_losses, whole_params, resumed_losses, resumed_params, inner_done = check_result(results(), "resume_mid_phase")
    assert inner_done == 1
    assert resumed_losses == whole_losses
    assert torch.equal(resumed_params, whole_params)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--data_parallel.zero_stage=1"], "data_parallel.zero_stage=1"),
        (["--parallel.sequence_parallel_degree=2"], "parallel.sequence_parallel_degree=2"),
        (["--compression.method=int8"], "compression.method='int8'"),
        (["--balance.data=true"], "balance.data=True"),
    ],
)
def test_local_modes_refuse_what_they_do_not_compose_with(overrides, field):
    """Catches: a local mode accepted with ZeRO when every dp rank is a replica (nothing to
    shard over), Ulysses sp, compression or data balancing, which would run with a gradient
    synchronizer or replica layout the outer sync ignores; or async's replicas of several ranks
    (dp_shard with ZeRO, tp, 2D tp, a pipeline), replicas of dp_shard ranks with ZeRO (also
    streaming's, also with 1D or 2D tp), streaming and quantized DiLoCo on pipelines, or the
    sync-family modes with 2D tp, refused where they compose."""
    with pytest.raises(ConfigError, match=re.escape(f"data_parallel.mode='local_sgd' with {field}")):
        load_config(None, ["--data_parallel.mode=local_sgd", *overrides])
    replicas = ["--parallel.data_parallel_replicate_degree=2", "--data_parallel.zero_stage=3"]
    assert load_config(None, ["--data_parallel.mode=diloco", *replicas]).data_parallel.zero_stage == 3
    tp2 = ["--parallel.tensor_parallel_degree=2"]  # ZeRO inside tp replicas: masters on (dp_shard_sp, tp)
    assert load_config(None, ["--data_parallel.mode=diloco", *replicas, *tp2]).data_parallel.zero_stage == 3
    grid = ["--parallel.tensor_parallel_degree=4", "--parallel.tp_mode=2d", "--model.dim=64", "--model.n_heads=4"]
    for mode in ("local_sgd", "diloco", "streaming_diloco", "async"):  # ZeRO inside 2D replicas: masters on dp_shard_sp
        assert load_config(None, [f"--data_parallel.mode={mode}", *replicas, *grid]).data_parallel.zero_stage == 3
    assert load_config(None, ["--data_parallel.mode=streaming_diloco", *replicas]).data_parallel.zero_stage == 3
    for layout in ([replicas[0]], replicas, ["--parallel.tensor_parallel_degree=2"]):  # async: replica 0 serves
        assert load_config(None, ["--data_parallel.mode=async", *layout]).data_parallel.mode == "async"
    for mode in (["--data_parallel.mode=streaming_diloco"],
                 ["--data_parallel.mode=diloco", "--data_parallel.outer_grad_dtype=int8"]):  # fmt: skip
        pp2 = load_config(None, [*mode, "--parallel.pipeline_parallel_degree=2"])  # each stage syncs its part
        assert pp2.parallel.pipeline_parallel_degree == 2
    assert (
        load_config(
            None, ["--data_parallel.mode=async", "--parallel.pipeline_parallel_degree=2"]
        ).parallel.pipeline_parallel_degree
        == 2
    )
    for mode in ("local_sgd", "diloco", "streaming_diloco"):  # each rank's 2D blocks averaged over its dp group
        assert load_config(None, [f"--data_parallel.mode={mode}", *grid]).parallel.tp_mode == "2d"
    assert load_config(None, ["--data_parallel.mode=async", *grid]).parallel.tp_mode == "2d"


def test_mode_defaults_and_misplaced_settings():
    """Catches: H defaults that are not the documented ones, and outer settings or H given to a
    mode that ignores them without a word."""
    assert load_config(None, ["--data_parallel.mode=diloco"]).data_parallel.resolved_inner_steps == 500
    assert load_config(None, ["--data_parallel.mode=local_sgd"]).data_parallel.resolved_inner_steps == 8
    with pytest.raises(ConfigError, match="data_parallel.outer_lr only applies to data_parallel.mode='diloco'"):
        load_config(None, ["--data_parallel.mode=local_sgd", "--data_parallel.outer_lr=1"])
    with pytest.raises(ConfigError, match="data_parallel.inner_steps only applies"):
        load_config(None, ["--data_parallel.inner_steps=4"])


def test_streaming_diloco_with_one_fragment_and_no_overlap_is_diloco():
    """Catches: a streaming schedule that syncs at other steps than DiLoCo's (an off-by-one
    offset, a missing forced last sync), a fragment that does not cover the whole model, or an
    outer step that differs from DiLoCo's (momentum per fragment mixed up, a mix with α where τ =
    0 must replace): with F = 1, τ = 0, fp32 it must be DiLoCo bit for bit."""
    diloco, streaming = check_result(streaming_results(), "f1_equals_diloco")
    assert streaming[0] == diloco[0]
    assert torch.equal(streaming[1], diloco[1])
    assert streaming[2:] == diloco[2:] and diloco[2] == 3


def test_streaming_fragments_sync_at_their_own_offsets():
    """Catches: fragments synced together or at the wrong offset, a sync that leaves the
    replicas apart on its fragment or touches the other one: at H = 4, F = 2, τ = 0 fragment 1
    syncs after steps 2 and 6, fragment 0 after step 4, both after the forced step 7."""
    rec = check_result(streaming_results(), "offsets_fp32")
    synced = [[spread == 0.0 for spread in step] for step in rec["spread"]]
    assert synced == [[False, False], [False, True], [False, False], [True, False], [False, False],
                      [False, True], [True, True]]  # fmt: skip
    assert rec["global_spread"] == [0.0] * STEPS


def test_streaming_sync_sends_one_fragment_and_bf16_halves_it():
    """Catches: a fragment sync that sends the whole model (or the wrong fragment), bytes not
    counted, and bf16/int8 outer gradients that still travel as fp32: each sync sends its own
    fragment's fp32 all-reduce (about 1/F of a full one), bf16 exactly half of that, int8
    about a quarter; the forced last sync sends the whole model."""
    results = streaming_results()
    fp32, bf16, int8 = (check_result(results, name) for name in ("offsets_fp32", "overlap_bf16", "overlap_int8"))
    n0, n1 = fp32["numels"]
    full = all_reduce_bytes(4 * (n0 + n1), 2)
    assert fp32["sent"] == [0, all_reduce_bytes(4 * n1, 2), 0, all_reduce_bytes(4 * n0, 2), 0,
                            all_reduce_bytes(4 * n1, 2), full]  # fmt: skip
    assert all(0.4 < fp32["sent"][t] / full < 0.6 for t in (1, 3, 5))
    assert bf16["sent"][1] == all_gather_bytes(2 * 2 * n1, 2) == fp32["sent"][1] // 2
    assert [b * 2 for b in bf16["sent"]] == fp32["sent"]
    assert all(0 < i8 < 0.3 * f32 for i8, f32 in zip(int8["sent"], fp32["sent"], strict=True) if f32)


def test_streaming_overlapped_sync_lands_tau_steps_later_on_every_replica():
    """Catches: an overlapped all-reduce applied at once (or never), θ_global differing across
    replicas after a quantized sum (a rank adding its own unquantized outer gradient instead of
    its decoded payload), and a mix that leaves the replicas' fragment equal (α ignored): at τ =
    1 fragment 1's outer step lands at step 3, fragment 0's at 5, both at the forced step 7."""
    for name in ("overlap_bf16", "overlap_int8"):
        rec = check_result(streaming_results(), name)
        assert rec["moved"] == [[False, False], [False, False], [False, True], [False, False], [True, False],
                                [False, False], [True, True]], name  # fmt: skip
        assert rec["global_spread"] == [0.0] * STEPS, name
        assert rec["spread"][2][1] > 0 and rec["spread"][-1] == [0.0, 0.0], name


def test_streaming_resume_with_an_all_reduce_in_flight_continues_exactly():
    """Catches: an in-flight all-reduce dropped or applied early at a checkpoint, or its step
    lost: resumed after step 2 with fragment 1's sync in flight, the run must reproduce the
    uninterrupted one's losses and final parameters bit for bit."""
    whole, in_flight, resumed = check_result(streaming_results(), "resume_in_flight")
    assert in_flight == 1
    assert resumed["losses"] == whole["losses"][2:]
    assert torch.equal(resumed["params"], whole["params"])


def test_diloco_sends_int8_outer_gradients_and_stays_close_to_fp32():
    """Catches: data_parallel.outer_grad_dtype accepted for plain DiLoCo but ignored (fp32 bytes
    sent), quantized outer gradients summed differently on the two replicas (their parameters would
    drift apart), a quantization error far beyond int8's (a wrong scale or a dropped block), or a
    checkpoint of one dtype resumed by the other with its state silently dropped (the two count
    inner steps differently).
    int8 with a scale per 1,024 elements keeps a relative error of about 1/254 of each block's
    largest value per replica, so the parameters after 2 outer steps (lr 0.7, momentum 0.9) stay
    within 1e-2 relative of fp32's, and far from equal to them."""
    runs = check_result(streaming_results(), "diloco_quantized")
    fp32, int8 = runs["fp32"], runs["int8"]
    assert (fp32["kind"], int8["kind"], int8["fragments"]) == ("OuterSync", "StreamingOuterSync", 1)
    assert fp32["outer_steps"] == int8["outer_steps"] == 3
    assert int8["spread"] == 0.0, "replicas differ after the quantized outer step"
    assert 3.5 < fp32["sent"] / int8["sent"] < 4.0
    rel = ((int8["params"] - fp32["params"]).norm() / fp32["params"].norm()).item()
    assert 1e-7 < rel < 1e-2, rel
    assert len(runs["refused"]) == 2 and all("resume with the outer_grad_dtype" in m for m in runs["refused"])


def test_outer_grad_dtype_is_refused_for_modes_without_an_outer_gradient_exchange_it_could_change():
    """Catches: outer_grad_dtype given to local SGD (plain averaging, not implemented quantized) or
    sync DP, which would ignore it without a word."""
    for mode in ("sync", "local_sgd"):
        with pytest.raises(ConfigError, match=re.escape("data_parallel.outer_grad_dtype='int8' only applies to")):
            load_config(None, [f"--data_parallel.mode={mode}", "--data_parallel.outer_grad_dtype=int8"])
    assert load_config(None, ["--data_parallel.mode=diloco", "--data_parallel.outer_grad_dtype=int8"])


def test_streaming_defaults():
    """Catches: defaults that are not the documented ones (H = 100, 3 blocks per fragment, τ = 1,
    α = 0.5, fp32 outer gradients)."""
    dp = load_config(None, ["--data_parallel.mode=streaming_diloco"]).data_parallel
    assert dp.resolved_inner_steps == 100
    assert (dp.resolved_fragments(24), dp.resolved_fragments(4), dp.resolved_fragments(1)) == (8, 2, 1)
    assert (dp.overlap_steps, dp.mixing_alpha, dp.outer_grad_dtype) == (1, 0.5, "fp32")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--data_parallel.fragments=5"], "data_parallel.fragments=5 is more than model.n_layers=4"),
        (["--data_parallel.inner_steps=1", "--data_parallel.overlap_steps=0"],
         "data_parallel.fragments=2 is more than data_parallel.inner_steps=1"),
        (["--data_parallel.inner_steps=4", "--data_parallel.overlap_steps=4"],
         "data_parallel.overlap_steps=4 is not below data_parallel.inner_steps=4"),
        (["--data_parallel.overlap_steps=0", "--data_parallel.mixing_alpha=0.3"],
         "data_parallel.mixing_alpha=0.3 only applies with data_parallel.overlap_steps >= 1"),
        (["--data_parallel.outer_grad_dtype=fp8"], "outer_grad_dtype"),
        (["--data_parallel.zero_stage=1"], "data_parallel.mode='streaming_diloco' with data_parallel.zero_stage=1"),
    ],
)  # fmt: skip
def test_streaming_refuses_bad_settings(overrides, message):
    """Catches: more fragments than blocks or than sync steps per period, an overlap so long a
    fragment's next sync starts before its last one landed, α given where nothing mixes, an
    outer-gradient dtype we do not implement, and streaming with ZeRO, all accepted silently."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["--data_parallel.mode=streaming_diloco", *overrides])


def test_streaming_settings_refused_for_other_modes():
    """Catches: fragments/overlap settings given to diloco, which ignores them without a word."""
    with pytest.raises(ConfigError, match=re.escape("data_parallel.fragments only applies to data_parallel.mode='st")):
        load_config(None, ["--data_parallel.mode=diloco", "--data_parallel.fragments=2"])


def train_local_tp(
    mode: str,
    extra: list[str],
    inner_steps: int = 1,
    evaluate: bool = False,
    finish: bool = False,
    topology: Topology | None = None,
) -> dict[str, torch.Tensor]:
    """``STEPS`` (3) steps of ``test_pipeline``'s 8-layer model with SGD + momentum and no
    clipping on this group's layout; ``mode`` ``sync`` (the gradient all-reduce) or a local
    mode with H = ``inner_steps`` (each replica keeps its gradient, the outer sync averages
    every H steps). With ``evaluate``, an evaluation inside ``global_weights`` after each step,
    as the trainer's; with ``finish``, an outer step forced after the last step, as the
    trainer's; ``topology``: the job's hosts, as the trainer discovers them (for
    ``data_parallel.comm_hook``). Rank's replica's full parameters, gathered over tp and ZeRO's
    shards."""
    from loomtrain.models.parallelize import parallelize_llama
    from loomtrain.trainer import train_step
    from tests.distributed.test_pipeline import BASE, CPU, STEPS, batches

    cfg = load_config(None, [*BASE, "--training.grad_clip=0", f"--data_parallel.mode={mode}", *extra,
                             *([] if mode == "sync" else [f"--data_parallel.inner_steps={inner_steps}"])])  # fmt: skip
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    dp = cfg.data_parallel
    own = mode != "sync" and not replicas_sync_inside(dp, dims)  # as the trainer chooses
    hook = LocalOnlyHook() if own else AllReduceHook()
    pm = parallelize_llama(model, dims, cfg, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    pm.sync.attach_optimizer(optimizer)
    outer = build_outer_sync(dp, model, optimizer, outer_group(dp, dims), hook, pm.sync.after_step, cfg.model.n_layers,
                             outer_reducer(dp, dims, topology))  # fmt: skip
    t = cfg.training
    for step in range(STEPS):
        mine = batches(step, t.global_batch_size, dims.dp_rank, dims.dp, t.micro_batch_size)
        train_step(pm, optimizer, mine, cfg, CPU)
        if outer is not None:
            outer.after_inner_step(force=finish and step + 1 == STEPS)
            if evaluate:
                with outer.global_weights():
                    pm.eval_loss(mine, contextlib.nullcontext, CPU)
    pm.sync.remove()
    return {name: p.detach().clone() for name, p in pm.full_model().named_parameters()}


def zero(stage: int) -> list[str]:
    return [f"--data_parallel.zero_stage={stage}"]


def split_outer_sum() -> tuple[torch.Tensor, int]:
    """Local SGD (θ_global becomes the replicas' mean) over replicas {0, 1} and {2, 3}, whose
    ranks hold equal parameters, the outer all-reduce split over each replica's 2 ranks: 7
    elements (one pad element in the second chunk), replica r's parameters shifted by r + 1.
    This rank's parameters after the outer step and the bytes it sent."""
    rank = dist.get_rank()
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    inside = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(7))
    outer = OuterSync([param], torch.optim.SGD([param], lr=0.1), across[rank % 2], "local_sgd", 1,
                      reducer=ReplicaSplitHook(inside[rank // 2]))  # fmt: skip
    with torch.no_grad():
        param.add_(rank // 2 + 1.0)
    outer.outer_step()
    return param.detach().clone(), outer.hook.bytes_sent


def hierarchical_outer_sum(dtype: str) -> tuple[torch.Tensor, int]:
    """Local SGD over 4 one-rank replicas on 2 hosts of 2 (``TWO_HOSTS``), the outer gradient
    averaged by the hierarchical hook with a ``dtype`` payload across hosts: 7 elements, rank
    r's parameters shifted by r. This rank's parameters after the outer step and the bytes it
    sent across hosts."""
    rank = dist.get_rank()
    reducer = HierarchicalHook(TWO_HOSTS, payload_hook(dtype))
    reducer.setup([[0, 1, 2, 3]])
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(7))
    outer = OuterSync([param], torch.optim.SGD([param], lr=0.1), dist.group.WORLD, "local_sgd", 1, reducer=reducer)
    with torch.no_grad():
        param.add_(float(rank))
    outer.outer_step()
    return param.detach().clone(), outer.hook.traffic.bytes[INTER_HOST_AXIS]


def local_tp_cases() -> dict:
    tp2, pp2 = ["--parallel.tensor_parallel_degree=2"], ["--parallel.pipeline_parallel_degree=2"]
    sp = ["--parallel.tp_mode=sequence_parallel"]  # Megatron SP on the tp ranks
    r2 = ["--parallel.data_parallel_replicate_degree=2"]  # 2 replicas of 2 dp_shard ranks
    return run_checks({
        "split_outer_sum": split_outer_sum,
        "hierarchical_outer_sum": lambda: hierarchical_outer_sum("fp32"),
        "hierarchical_outer_sum_int8": lambda: hierarchical_outer_sum("int8"),
        "local_sgd_dp4_hier": lambda: train_local_tp("local_sgd", HIER, topology=TWO_HOSTS),
        "diloco_h2_dp4": lambda: train_local_tp("diloco", [], 2, True, True),
        "diloco_int8_h2_dp4": lambda: train_local_tp("diloco", INT8, 2, True, True),
        "diloco_int8_h2_dp4_hier": lambda: train_local_tp("diloco", [*INT8, *HIER], 2, True, True, TWO_HOSTS),
        "sync_pp2": lambda: train_local_tp("sync", pp2),
        "local_sgd_pp2": lambda: train_local_tp("local_sgd", pp2),
        "sync_tp2": lambda: train_local_tp("sync", tp2),
        "sync_tp2_sp": lambda: train_local_tp("sync", [*tp2, *sp]),
        "local_sgd_tp2_sp": lambda: train_local_tp("local_sgd", [*tp2, *sp]),
        "local_sgd_tp2": lambda: train_local_tp("local_sgd", tp2),
        "diloco_tp2": lambda: train_local_tp("diloco", [*tp2, "--data_parallel.outer_lr=1",
                                                        "--data_parallel.outer_momentum=0"]),
        "local_sgd_r2_tp2_zero1": lambda: train_local_tp("local_sgd", [*r2, *tp2, *zero(1)]),
        "diloco_r2_tp2_zero3": lambda: train_local_tp("diloco", [*r2, *tp2, *zero(3), "--data_parallel.outer_lr=1",
                                                                 "--data_parallel.outer_momentum=0"]),
        "sync_dp4": lambda: train_local_tp("sync", []),
        "local_sgd_r2": lambda: train_local_tp("local_sgd", r2),
        "local_sgd_r2_zero1": lambda: train_local_tp("local_sgd", [*r2, "--data_parallel.zero_stage=1"]),
        "diloco_r2_zero3": lambda: train_local_tp("diloco", [*r2, "--data_parallel.zero_stage=3",
                                                             "--data_parallel.outer_lr=1",
                                                             "--data_parallel.outer_momentum=0"]),
        "local_sgd_h2_r2": lambda: train_local_tp("local_sgd", r2, 2, evaluate=True),
        "diloco_h2_r2_zero1": lambda: train_local_tp("diloco", [*r2, "--data_parallel.zero_stage=1"], 2, True),
        "diloco_h2_r2_zero3": lambda: train_local_tp("diloco", [*r2, "--data_parallel.zero_stage=3"], 2, True),
        "streaming_h2_r2_zero1": lambda: train_local_tp("streaming_diloco", [*r2, *zero(1), *STREAMING], 2, True),
        "streaming_h2_r2_zero3": lambda: train_local_tp("streaming_diloco", [*r2, *zero(3), *STREAMING], 2, True),
        "diloco_int8_h2_r2_zero3": lambda: train_local_tp("diloco", [*r2, *zero(3), *INT8], 2, True),
        "streaming_f3_h3_r2": lambda: train_local_tp("streaming_diloco", [*r2, *STREAMING_F3], 3, True),
        "streaming_f3_h3_pp2": lambda: train_local_tp("streaming_diloco", [*pp2, *STREAMING_F3], 3, True),
        "strided_f3_h3_r2": lambda: train_local_tp("streaming_diloco", [*r2, *STRIDED_F3], 3, True),
        "strided_f3_h3_pp2": lambda: train_local_tp("streaming_diloco", [*pp2, *STRIDED_F3], 3, True),
    })  # fmt: skip


def test_local_sgd_and_diloco_with_tensor_or_pipeline_parallel_replicas_equal_sync():
    """Catches: the outer sync averaging over the wrong group when each replica is a tp or pp
    group (over tp ranks, mixing different shards, across pipeline stages, or over the whole
    world), a shard or stage missing from the outer step, or a replica's parts diverging: at
    tp 2 × dp 2 and pp 2 × dp 2 (4 processes), local SGD with H = 1 and DiLoCo with outer lr 1,
    no momentum (both exactly an average of the replicas after each step) must equal synchronous
    training of the same layout with SGD + momentum (1e-5 relative); local SGD also with Megatron
    SP on the tp ranks (catches its norm weights' sum over tp lost: the replicas' norm weights
    would move by one tp rank's sequence slice alone). Also with 2 replicas of 2
    dp_shard ranks each (plain DP, ZeRO-1, ZeRO-3 inside a replica) against sync dp 4: catches
    the inner gradient averaged over the whole dp group (or not at all), the outer step summing
    different rows of ZeRO's masters (over dp_shard instead of dp_replicate), or ZeRO's full
    copies not refreshed after the outer step wrote its masters. And 2 replicas of tp 2 with
    ZeRO-1 or ZeRO-3 inside (a shard group of one rank; its masters on the replica's own
    ``(dp_shard_sp, tp)`` mesh) against sync tp 2 × dp 2: catches ZeRO's tp masters outer-synced
    over the wrong group (over tp, mixing shards) or their full copies not refreshed after an
    outer step."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    want = check_result(got, "sync_pp2")
    params = check_result(got, "local_sgd_pp2")
    assert params.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"local_sgd_pp2: {key}")
    for reference, names in (("sync_tp2", ("local_sgd_tp2", "diloco_tp2", "local_sgd_r2_tp2_zero1",
                                           "diloco_r2_tp2_zero3")), ("sync_tp2_sp", ("local_sgd_tp2_sp",)),
                             ("sync_dp4", ("local_sgd_r2", "local_sgd_r2_zero1", "diloco_r2_zero3",
                                           "local_sgd_dp4_hier"))):  # fmt: skip
        want = check_result(got, reference)
        for name in names:
            params = check_result(got, name)
            assert params.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def local_tp_zero_cases() -> dict:
    tp2, r2 = ["--parallel.tensor_parallel_degree=2"], ["--parallel.data_parallel_replicate_degree=2"]
    return run_checks({  # tp 2 × dp 4 = 8 processes; the local modes as 2 replicas of tp 2 × 2 dp_shard ranks
        "sync_tp2_dp4": lambda: train_local_tp("sync", tp2),
        "local_sgd_r2_tp2_zero1": lambda: train_local_tp("local_sgd", [*r2, *tp2, *zero(1)]),
        "diloco_r2_tp2_zero3": lambda: train_local_tp("diloco", [*r2, *tp2, *zero(3), "--data_parallel.outer_lr=1",
                                                                 "--data_parallel.outer_momentum=0"]),
    })  # fmt: skip


@pytest.mark.slow  # 8 processes on 2 cores: ~2 min under load (start-up most of it)
def test_zero_with_tensor_parallel_inside_replicas_equals_sync():
    """Catches: ZeRO-1 or ZeRO-3 inside replicas of tp 2 × 2 dp_shard ranks whose shards are cut
    over the wrong ranks (over dp_replicate, or over tp: its masters on ZeRO's replica-local
    ``(dp_shard_sp, tp)`` mesh), whose inner gradient is averaged beyond the replica, or whose
    outer step mixes different rows or tp shards: local SGD (H = 1) and DiLoCo (outer lr 1, no
    momentum) must equal synchronous tp 2 × dp 4 with SGD + momentum within 1e-5 relative."""
    got = spawn_once(local_tp_zero_cases, 8, timeout_s=400)
    want = check_result(got, "sync_tp2_dp4")
    for name in ("local_sgd_r2_tp2_zero1", "diloco_r2_tp2_zero3"):
        params = check_result(got, name)
        assert params.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def local_tp2d_cases() -> dict:
    return run_checks({  # 2D tp on a 2×2 grid (tp 4) × dp 2: 8 processes
        "sync_2d": lambda: train_local_tp("sync", GRID4),
        "local_sgd_2d": lambda: train_local_tp("local_sgd", GRID4),
        "diloco_h2_2d": lambda: train_local_tp("diloco", GRID4, 2, evaluate=True, finish=True),
        "streaming_h2_2d": lambda: train_local_tp("streaming_diloco", [*GRID4, *GRID_STREAMING], 2, True, True),
        # 2 replicas of a 2×2 grid with ZeRO over a dp_shard group of one rank (GRID4_R2).
        "local_sgd_r2_2d_zero1": lambda: train_local_tp("local_sgd", [*GRID4_R2, *zero(1)]),
        "diloco_r2_2d_zero3": lambda: train_local_tp("diloco", [*GRID4_R2, *zero(3), "--data_parallel.outer_lr=1",
                                                                "--data_parallel.outer_momentum=0"]),
        "diloco_h2_r2_2d_zero1": lambda: train_local_tp("diloco", [*GRID4_R2, *zero(1)], 2, True, True),
        "streaming_h2_r2_2d_zero1": lambda: train_local_tp("streaming_diloco", [*GRID4_R2, *GRID_STREAMING, *zero(1)],
                                                           2, True, True),
    })  # fmt: skip


def assert_local_modes_with_2d_tp(got: list, sync: str, local_sgd: str, diloco: str) -> None:
    """``local_sgd`` equals ``sync`` within 1e-6 relative on rank 0; ``diloco``'s replicas are
    bitwise identical on every rank (each gathered its replica's full model) and moved from
    ``sync`` by the outer optimizer (> 1e-4)."""
    want, params = check_result(got, sync), check_result(got, local_sgd)
    assert params.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(params[key], want[key], rtol=1e-6, atol=1e-7, msg=f"{local_sgd}: {key}")
    replicas = [check_result(got, diloco, rank) for rank in range(len(got))]
    for rank, other in enumerate(replicas[1:], 1):
        assert other.keys() == want.keys()
        for key in want:
            assert torch.equal(other[key], replicas[0][key]), (diloco, rank, key)
    assert max((replicas[0][k] - want[k]).abs().max().item() for k in want) > 1e-4, diloco


def test_local_modes_with_2d_tensor_parallel_model_on_a_1x1_grid():
    """Catches: the local modes refused with ``parallel.tp_mode="2d"`` again, or failing on
    2D tp's own modules rather than on its communication: its grid model (2D linears, norms,
    embedding, head) left out of the outer step, its grid loss (``cross_entropy_2d``) or
    ``GridParallelModel``'s evaluation and full-model gather misbehaving under
    ``LocalOnlyHook`` or inside ``global_weights``. A 1×1 grid × dp 2 (the 2-process spawn):
    local SGD with H = 1 must equal synchronous DP of the same layout (SGD + momentum, no
    clipping, 1e-6 relative) and DiLoCo (H = 2, outer Nesterov, ending on an outer step) must
    leave both replicas bitwise identical. The grid's collectives are all over one rank here:
    whether they stay off the dp axis is the 8-process test below."""
    assert_local_modes_with_2d_tp(results(), "sync_grid1", "local_sgd_grid1", "diloco_h2_grid1")


@pytest.mark.slow  # 8 processes on 2 cores: ~2.5 min under load (start-up most of it)
def test_streaming_diloco_with_2d_grid_replicas_equals_one_rank_grids():
    """Catches: streaming DiLoCo's fragments cut wrongly from a 2D grid's blocks (each grid rank
    holds a block of every parameter, named as the whole model's), a fragment's sync over grid
    ranks instead of the dp group, or its overlapped landing applied to another fragment: on a
    2×2 grid × dp 2 (2 blocks, 2 fragments, H = 2, τ = 1, fp32, an evaluation inside
    ``global_weights`` after each step, ending on a forced outer step) the gathered model must
    equal the same run on a 1×1 grid × dp 2 (2 processes) within 1e-5 relative or 1e-6
    absolute (the grid reorders the float sums)."""
    want = check_result(results(), "streaming_h2_grid1")
    got = check_result(spawn_once(local_tp2d_cases, 8, timeout_s=300), "streaming_h2_2d")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow  # 8 processes on 2 cores: ~2.5 min under load (start-up most of it)
def test_local_modes_with_2d_tensor_parallel_replicas():
    """Catches: a local mode with 2D tp (Optimus/SUMMA, ``parallel.tp_mode="2d"``) inside each
    replica whose outer sync averages over the wrong group (over grid ranks, mixing different
    blocks: refused at once by the replicas' identity check; or over the whole world), a grid
    block left out of the outer step, or a 2D reduction that relied on the dp gradient hook:
    the norm weights' sum over a grid column (their own gradient hook) or SUMMA's reduces along
    grid rows and columns, lost with the dp all-reduce, would leave a replica's norm weights or
    blocks with part of their gradient. tp 4 (2×2 grid) × dp 2, 8 processes, 1 block: local SGD
    with H = 1 must equal synchronous DP of the same 2D layout with SGD + momentum and no
    clipping (1e-6 relative: the same update up to the order of float sums); DiLoCo (H = 2,
    outer Nesterov, an evaluation inside ``global_weights`` after each step, ending on a forced
    outer step) must leave the two replicas bitwise identical (every rank gathers its replica's
    full model) and away from where synchronous DP went (> 1e-4)."""
    assert_local_modes_with_2d_tp(
        spawn_once(local_tp2d_cases, 8, timeout_s=300), "sync_2d", "local_sgd_2d", "diloco_h2_2d"
    )


@pytest.mark.slow  # 8 processes on 2 cores: shares the spawn of the 2D tests above (its 4 cases add ~6 s)
def test_zero_with_2d_tensor_parallel_inside_replicas():
    """Catches: ZeRO inside replicas of a 2×2 grid of 2D tp (``tp_mode="2d"``, 2 replicas over
    ``dp_replicate``, a ``dp_shard`` group of one rank) whose masters are cut over the wrong ranks
    (over ``dp_replicate`` as in HSDP: the replicas would average their gradients every step; over
    all dp ranks: each replica would hold half the rows), or whose outer step sums over the grid
    instead of ``dp_replicate`` (mixing different blocks; the latter two are refused at once by
    the replicas' identity check). Local SGD (H = 1) with ZeRO-1 and DiLoCo (outer lr 1, no
    momentum) with ZeRO-3 must equal synchronous 2D × dp 2 with SGD + momentum within 1e-5
    relative; DiLoCo with ZeRO-1 at H = 2 (outer Nesterov, an evaluation inside
    ``global_weights`` after each step, ending on a forced outer step) and streaming DiLoCo with
    ZeRO-1 (the settings of the streaming test above) must equal the same runs without ZeRO
    (each dp rank a replica of one grid) within 1e-5: H = 1 cannot tell a gradient averaged
    across the replicas from an outer average of their parameters."""
    got = spawn_once(local_tp2d_cases, 8, timeout_s=300)
    for reference, name in (("sync_2d", "local_sgd_r2_2d_zero1"), ("sync_2d", "diloco_r2_2d_zero3"),
                            ("diloco_h2_2d", "diloco_h2_r2_2d_zero1"),
                            ("streaming_h2_2d", "streaming_h2_r2_2d_zero1")):  # fmt: skip
        want, params = check_result(got, reference), check_result(got, name)
        assert params.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_replicas_of_dp_shard_ranks_equal_one_rank_per_replica():
    """Catches: a replica of 2 dp_shard ranks (plain DP, ZeRO-1, ZeRO-3 inside) whose inner
    gradient is averaged over the whole dp group instead of the replica, an outer step over
    dp_shard instead of dp_replicate, or ZeRO's full copies left holding θ_global after an
    evaluation inside ``global_weights`` (or θ_local after an outer step). With H = 2, 2 replicas
    of 2 ranks (4 processes) must equal 2 replicas of 1 rank (2 processes) that each take both
    ranks' samples (SGD + momentum; DiLoCo with its default outer Nesterov), within 1e-5: a
    replica's mean gradient is the same, and every difference above changes the trajectory."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    for reference, names in (("local_sgd_h2", ("local_sgd_h2_r2",)),
                             ("diloco_h2", ("diloco_h2_r2_zero1", "diloco_h2_r2_zero3")),
                             ("streaming_h2", ("streaming_h2_r2_zero1", "streaming_h2_r2_zero3"))):  # fmt: skip
        want = check_result(results(), reference)
        for name in names:
            params = check_result(got, name)
            assert params.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def test_outer_all_reduce_split_over_a_replicas_ranks():
    """Catches: replicas of several plain-DP ranks each all-reducing the whole model across the
    replicas (k times the bytes between hosts where a replica is a host), a chunk summed with
    another position's chunk, or the padding of an uneven split leaking into the model: every rank
    must end on the replicas' mean, having sent one all-reduce of its piece (elements 0-3 or 4-6
    of 7) and one all-gather inside its replica (of 2 padded 4-element pieces)."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    torch.manual_seed(0)
    mean = torch.randn(7) + 1.5
    for rank in range(4):
        params, sent = check_result(got, "split_outer_sum", rank)
        torch.testing.assert_close(params, mean)
        piece = 4 * (4 if rank % 2 == 0 else 3)  # bytes of this rank's piece: across 16 or 12 bytes, not 28
        assert sent == all_reduce_bytes(piece, 2) + all_gather_bytes(2 * 4 * 4, 2)


def test_outer_all_reduce_of_one_rank_replicas_hierarchical_over_hosts():
    """Catches: ``data_parallel.comm_hook`` ignored by the outer step of one-rank replicas (each
    rank would send 1.5 model-sizes across hosts in a flat ring of 4 over 2 hosts instead of
    0.5), a host's partial sum counted twice or lost, or an int8 payload quantized per rank
    but decoded as a host's sum: 4 replicas on 2 hosts × 2, the hierarchical hook must give every
    rank the replicas' mean (fp32: within float rounding; int8: within its quantization error)
    having sent across hosts only its half of the host's sum (4 or 3 of 7 elements, fp32: 16 or 12
    bytes; int8: those elements and one fp32 scale); and local SGD (H = 1) through it must train
    exactly as synchronous dp 4 (checked with the other layouts above)."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    torch.manual_seed(0)
    mean = torch.randn(7) + 1.5
    for rank in range(4):
        elements = 4 if rank % 2 == 0 else 3  # this rank's piece of the host's reduce-scatter
        params, across = check_result(got, "hierarchical_outer_sum", rank)
        torch.testing.assert_close(params, mean)
        assert across == all_reduce_bytes(4 * elements, 2)
        params, across = check_result(got, "hierarchical_outer_sum_int8", rank)
        torch.testing.assert_close(params, mean, rtol=0, atol=0.05)  # int8: |x| ≤ 5, 1/127 of it per step
        assert across == all_gather_bytes(2 * (4 + elements), 2)


def test_int8_outer_gradients_across_hosts_stay_as_close_as_flat_ones():
    """Catches: DiLoCo's int8 outer gradients through the hierarchical hook quantizing the wrong
    values (a host's sum as if a replica's, a piece cut inside an int8 chunk's scale) or giving
    replicas different sums, or ``comm_hook`` ignored (the run would equal flat int8's bit for
    bit): 4 one-rank replicas on 2 hosts × 2, H = 2 (an outer step after steps 2 and 3), every
    replica must end bitwise identical and as close to fp32 DiLoCo as flat int8 is, within 2x its
    largest error."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    fp32, flat = check_result(got, "diloco_h2_dp4"), check_result(got, "diloco_int8_h2_dp4")
    hier = [check_result(got, "diloco_int8_h2_dp4_hier", rank) for rank in range(4)]
    flat_error = max((flat[k] - fp32[k]).abs().max().item() for k in fp32)
    assert flat_error > 0  # int8 moved the flat run: the bound below is not vacuous
    # Host sums quantize differently from each replica's delta: equal would mean comm_hook was ignored.
    assert any(not torch.equal(hier[0][key], flat[key]) for key in fp32)
    for key in fp32:
        assert all(torch.equal(h[key], hier[0][key]) for h in hier[1:]), key
        assert (hier[0][key] - fp32[key]).abs().max().item() <= 2 * flat_error, key


def test_int8_outer_gradients_of_zero_sharded_replicas_stay_close_to_one_rank_replicas():
    """Catches: int8 outer gradients of ZeRO rows encoded with the whole tensors' sizes (the
    payload's scales and values would be cut at the wrong places: garbage, or a size error), or
    summed over dp_shard instead of dp_replicate. DiLoCo, H = 2, 2 replicas of 2 ZeRO-3 ranks:
    int8's per-chunk scales fall elsewhere than with 2 one-rank replicas (a rank quantizes its
    own rows), so the two differ by quantization error; each must stay as close to fp32 DiLoCo
    as the other, within 2x the one-rank replicas' largest error."""
    fp32, one_rank = check_result(results(), "diloco_h2"), check_result(results(), "diloco_int8_h2")
    sharded = check_result(spawn_once(local_tp_cases, 4, timeout_s=300), "diloco_int8_h2_r2_zero3")
    assert sharded.keys() == fp32.keys()
    error = {name: max((run[k] - fp32[k]).abs().max().item() for k in fp32)
             for name, run in (("one_rank", one_rank), ("sharded", sharded))}  # fmt: skip
    assert 0 < error["sharded"] <= 2 * error["one_rank"], error


def test_streaming_diloco_with_pipeline_replicas_equals_whole_model_replicas():
    """Catches: streaming DiLoCo on pipeline stages cutting fragments from the stage's own
    blocks (each stage would count other fragments and sync them at other steps; before, a
    stage holding none of a fragment crashed on its missing span), a stage's part of a fragment
    left out of that fragment's outer step, or the sync averaging across stages. 3 fragments of
    8 blocks (0-2, 3-5, 6-7), H = 3, overlap 1, bf16 outer gradients: 2 replicas that are each a
    pp 2 pipeline (4 processes; every stage holds one fragment whole, part of one and none of
    one) must equal 2 replicas that are each 2 plain-DP ranks of the whole model, the same
    samples per replica (SGD + momentum, an evaluation inside ``global_weights`` after each step),
    within 1e-5 relative: bf16 rounds each element alone, so the split cannot change a sum."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    want, params = check_result(got, "streaming_f3_h3_r2"), check_result(got, "streaming_f3_h3_pp2")
    assert params.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"streaming pp2: {key}")


def test_strided_streaming_diloco_with_pipeline_replicas_equals_whole_model_replicas():
    """Catches: strided fragments on pipeline stages cut from the stage's own block count (a
    stage would number its blocks from 0 and put them in other fragments than the whole model
    does), a stage's blocks of one fragment synced only in part (one run of several), or a
    pattern setting that changes nothing. 3 strided fragments of 8 blocks (0, 3, 6 / 1, 4, 7 /
    2, 5), so each pp 2 stage holds part of every fragment; H = 3, overlap 1, bf16, as the
    sequential test above: 2 pp 2 replicas must equal 2 replicas of 2 plain-DP ranks within
    1e-5 relative, and differ from the sequential fragments' run by far more (at 3 steps the
    blocks sync at other steps)."""
    got = spawn_once(local_tp_cases, 4, timeout_s=300)
    want, params = check_result(got, "strided_f3_h3_r2"), check_result(got, "strided_f3_h3_pp2")
    assert params.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(params[key], want[key], rtol=1e-5, atol=1e-7, msg=f"strided pp2: {key}")
    sequential = check_result(got, "streaming_f3_h3_r2")
    assert max((want[k] - sequential[k]).abs().max().item() for k in want) > 1e-4


def test_strided_fragments_take_every_f_th_block():
    """Catches: strided fragments built as sequential ones (block i in ⌊i·F/B⌋ instead of i mod
    F), the embedding or the final norm and head put elsewhere than with block 0's and the last
    block's fragment, a pipeline stage numbering its blocks from 0 instead of model-wide, and
    runs that drop, repeat or misplace parameters or elements (a strided fragment is several
    ranges of the flat parameters, not one). 5 blocks, F = 3: strided 0, 1, 2, 0, 1 (head: 1),
    sequential 0, 0, 1, 1, 2 (head: 2)."""
    named = [(name, p.numel()) for name, p in Transformer(CFG.model_copy(update={"n_layers": 5})).named_parameters()]
    names, numels = [name for name, _ in named], [n for _, n in named]
    assert [block_fragment(i, 3, 5, "strided") for i in range(5)] == [0, 1, 2, 0, 1]
    assert [block_fragment(i, 3, 5, "sequential") for i in range(5)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="neither 'sequential' nor 'strided'"):
        block_fragment(0, 3, 5, "interleaved")
    per_block = len([n for n in names if n.startswith("layers.0.")])
    fragment_of = block_fragments(names, 3, 5, "strided")
    want = [0] + [f for f in (0, 1, 2, 0, 1) for _ in range(per_block)] + [1, 1]  # embedding; blocks; norm, head
    assert fragment_of == want
    assert block_fragments(names, 3, 5)[-2:] == [2, 2]
    # The last pp stage of blocks 3-4: model-wide indices 3 and 4, fragments 0 and 1; it holds none of 2.
    stage = [n for n in names if not n.startswith(("tok_", "layers.0.", "layers.1.", "layers.2."))]
    assert block_fragments(stage, 3, 5, "strided") == [0] * per_block + [1] * (per_block + 2)
    runs = fragment_runs(fragment_of, numels, 3)
    assert [len(r) for r in runs] == [2, 2, 1]
    pieces = sorted((p.start, p.stop, e.start, e.stop) for r in runs for p, e in r)
    prefix = [sum(numels[:i]) for i in range(len(numels) + 1)]
    assert all(e0 == prefix[p0] and e1 == prefix[p1] for p0, p1, e0, e1 in pieces)  # a run's elements are its params'
    bounds = [p0 for p0, *_ in pieces] + [pieces[-1][1]]
    assert bounds[0] == 0 and bounds[-1] == len(names) and [p1 for _, p1, *_ in pieces] == bounds[1:]  # tiled
    stage_runs = fragment_runs(block_fragments(stage, 3, 5, "strided"), numels[-len(stage) :], 3)
    assert stage_runs[2] == [(slice(0, 0), slice(0, 0))]  # the empty fragment keeps one empty view


def test_strided_streaming_syncs_each_fragment_whole_and_differs_from_sequential():
    """Catches: a strided fragment synced only in part (one of its runs left out of the
    all-reduce or of the outer step: the replicas would stay apart on it), a run's outer
    gradient written into another run's parameters (θ_global or the replicas would diverge),
    a strided checkpoint resumed with its in-flight sync lost or misplaced, or by a
    sequential run (its momenta would be those of other blocks), and a pattern that changes
    nothing. 4 blocks, F = 2 (fragment 0: embedding, blocks 0 and 2; fragment 1: blocks 1 and 3,
    norm, head), H = 4, τ = 0, fp32: each fragment's replicas are identical right after its own
    sync, at sequential's steps, θ_global is identical on both replicas, each sync sends its
    fragment's fp32 all-reduce; the final parameters differ from sequential's; with bf16 and
    τ = 1, a resume with an all-reduce in flight continues bit for bit."""
    results = streaming_results()
    rec, sequential = check_result(results, "strided_fp32"), check_result(results, "sequential_fp32_4_blocks")
    synced = [[spread == 0.0 for spread in step] for step in rec["spread"]]
    assert synced == [[False, False], [False, True], [False, False], [True, False], [False, False],
                      [False, True], [True, True]]  # fmt: skip
    assert rec["global_spread"] == [0.0] * STEPS
    n0, n1 = rec["numels"]
    assert rec["sent"] == [0, all_reduce_bytes(4 * n1, 2), 0, all_reduce_bytes(4 * n0, 2), 0,
                           all_reduce_bytes(4 * n1, 2), all_reduce_bytes(4 * (n0 + n1), 2)]  # fmt: skip
    assert (rec["params"] - sequential["params"]).abs().max().item() > 1e-4
    whole, in_flight, resumed = check_result(results, "strided_resume_in_flight")
    assert in_flight == 1 and resumed["losses"] == whole["losses"][2:]
    assert torch.equal(resumed["params"], whole["params"])
    message = check_result(results, "strided_state_refused")
    assert message is not None and "data_parallel.fragment_pattern='strided'" in message


def test_strided_sync_with_outer_lr_1_averages_each_whole_fragment():
    """Catches: a strided fragment's outer gradient assembled from its runs in another order
    than its parameters (θ_global,f − θ_local,f pairing elements of different blocks), a run's
    result written into another run's parameters, or a sync that touches the other fragment:
    with outer lr 1 and no momentum a fragment's sync must set it to the mean of the replicas
    (within 1e-6: fp32 rounding of θ_global − (θ_global − mean)) and leave the other fragment
    bit for bit as it was; both fragments sync at the forced last step."""
    steps = check_result(streaming_results(), "strided_sync_averages")
    synced = [[False, False], [False, True], [False, False], [True, False], [False, False], [False, True], [True, True]]
    for step, (record, want) in enumerate(zip(steps, synced, strict=True)):
        for fragment, ((to_mean, to_own), sync) in enumerate(zip(record, want, strict=True)):
            if sync:
                assert to_mean < 1e-6 < to_own, (step, fragment, to_mean, to_own)
            else:
                assert to_own == 0.0, (step, fragment)


def test_fragment_pattern_is_a_streaming_setting():
    """Catches: fragment_pattern given to diloco (one fragment: nothing to stride) accepted and
    ignored, a default other than the paper's sequential pattern, or an unknown pattern."""
    assert load_config(None, ["--data_parallel.mode=streaming_diloco"]).data_parallel.fragment_pattern == "sequential"
    strided = ["--data_parallel.mode=streaming_diloco", "--data_parallel.fragment_pattern=strided"]
    assert load_config(None, strided).data_parallel.fragment_pattern == "strided"
    with pytest.raises(ConfigError, match=re.escape("data_parallel.fragment_pattern only applies to data_parallel.mo")):
        load_config(None, ["--data_parallel.mode=diloco", "--data_parallel.fragment_pattern=strided"])
    with pytest.raises(ConfigError, match="fragment_pattern"):
        load_config(None, ["--data_parallel.mode=streaming_diloco", "--data_parallel.fragment_pattern=interleaved"])
