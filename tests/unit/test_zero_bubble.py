"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 §2.1) as a schedule, the split of a
stage's backward into B (input gradient) and W (weight gradient) on a real autograd graph, and the
emulated-device cost model; all in one process."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loomtrain.config import ConfigError, ModelConfig, load_config
from loomtrain.distributed.pipeline.emulated import (
    DEVICES,
    EmulatedStages,
    Gemm,
    attention_kernels,
    device,
    emulated_loss,
    layer_gemms,
    stage_times,
)
from loomtrain.distributed.pipeline.schedule import (
    Action,
    ScheduleError,
    bubble_fraction,
    build_schedule,
    check_schedule,
    format_schedule,
    peak_in_flight,
    simulate,
    theoretical_bubble,
)
from loomtrain.distributed.pipeline.split_backward import backward_input
from loomtrain.models import Transformer
from loomtrain.models.flops import flops_per_token

ZB_CONFIGS = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in sorted({pp, pp + 1, 2 * pp, 3 * pp + 1})]
# (forward, whole backward, weight gradient): equal F, B, W; W cheaper than B; W dearer than B; F
# cheaper than B (the last two are where the paper's equal-time formula no longer holds).
TIMES = [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 2.0, 1.3), (0.5, 2.0, 1.0), (2.0, 2.0, 1.0)]


def _idle_and_fraction(schedule, pp, **times) -> tuple[float, float]:
    timeline = simulate(schedule, pp, **times)
    busy = [[(start, end) for _, start, end in lane] for lane in timeline]
    window = max(end for lane in busy for _, end in lane)
    idle = sum(window - sum(end - start for start, end in lane) for lane in busy) / pp
    return idle, bubble_fraction(busy)


@pytest.mark.parametrize(("pp", "m"), ZB_CONFIGS)
def test_zb_h1_is_complete_causal_deadlock_free_and_keeps_1f1b_peak(pp, m):
    """Catches a ZB-H1 that hangs, runs a W before its B, drops a W (a gradient never accumulates) or
    defers so many W that a rank holds more than pp micro-batches' graphs (1F1B's peak memory)."""
    schedule = build_schedule("zb_h1", pp, m)
    check_schedule(schedule, pp, m)
    assert all(len(actions) == 3 * m for actions in schedule)
    assert [peak_in_flight(actions) for actions in schedule] == [pp] * pp
    assert peak_in_flight(build_schedule("1f1b", pp, m)[0]) == pp


@pytest.mark.parametrize(("pp", "m"), [(pp, m) for pp, m in ZB_CONFIGS if pp > 1])
@pytest.mark.parametrize(("t_f", "t_bw", "t_w"), TIMES)
def test_zb_h1_simulated_bubble_equals_theory(pp, m, t_f, t_bw, t_w):
    """Catches a W order that leaves the cooldown gaps open (bubble above the paper's
    (p-1)(T_F+T_B-T_W)), or a theoretical_bubble that ignores the times it is given."""
    schedule = build_schedule("zb_h1", pp, m)
    _, fraction = _idle_and_fraction(schedule, pp, forward_time=t_f, backward_time=t_bw, weight_time=t_w)
    want = theoretical_bubble("zb_h1", pp, m, forward_time=t_f, backward_time=t_bw, weight_time=t_w)
    assert fraction == pytest.approx(want, abs=1e-9)


def test_zb_h1_bubble_is_a_third_of_1f1b_at_pp4_m8():
    """Catches a zero-bubble schedule that is correct but no better than 1F1B: with T_F = T_B = T_W the
    idle time per rank is a third of 1F1B's (Qi et al. §2.1), 0.33 <= 0.4; as a share of the (shorter)
    step that is 1/9 against 3/11, i.e. 0.41 of 1F1B's bubble fraction."""
    idle_zb, fraction_zb = _idle_and_fraction(build_schedule("zb_h1", 4, 8), 4, backward_time=2.0, weight_time=1.0)
    idle_1f1b, fraction_1f1b = _idle_and_fraction(build_schedule("1f1b", 4, 8), 4, backward_time=2.0)
    assert idle_zb / idle_1f1b == pytest.approx(1 / 3)
    assert idle_zb <= 0.4 * idle_1f1b
    assert (fraction_zb, fraction_1f1b) == (pytest.approx(1 / 9), pytest.approx(3 / 11))


def test_zb_h1_order_follows_the_paper():
    """Catches W deferred on the wrong ranks: rank r runs W(k - r) right after B(k), so the first rank
    runs each W at once and the last rank defers pp - 1 of them into the cooldown."""
    lines = format_schedule(build_schedule("zb_h1", 4, 8)).splitlines()
    assert lines[0].split()[2:10] == "F0s0 F1s0 F2s0 F3s0 B0s0 W0s0 F4s0 B1s0".split()
    assert (
        lines[3].split()[2:]
        == (
            "F0s3 B0s3 F1s3 B1s3 F2s3 B2s3 F3s3 B3s3 W0s3 F4s3 B4s3 W1s3 F5s3 B5s3 W2s3 F6s3 B6s3 W3s3 "
            "F7s3 B7s3 W4s3 W5s3 W6s3 W7s3"
        ).split()
    )


def test_check_catches_weight_gradient_before_input_gradient_and_a_missing_one():
    """Catches a W run before its B (the graph has no kept gradient yet) and a W never run (its
    micro-batch's weight gradients lost)."""
    schedule = [list(actions) for actions in build_schedule("zb_h1", 2, 2)]
    i = schedule[0].index(Action("W", 0, 0))
    schedule[0].insert(0, schedule[0].pop(i))
    with pytest.raises(ScheduleError, match="rank 0 runs W0s0 before B0s0"):
        check_schedule(schedule, 2, 2)
    schedule = [list(actions) for actions in build_schedule("zb_h1", 2, 2)]
    schedule[1].remove(Action("W", 1, 1))
    with pytest.raises(ScheduleError, match="missing: W1s1"):
        check_schedule(schedule, 2, 2)


def test_zb_h1_refuses_fewer_micro_batches_than_stages_naming_the_fix():
    """Catches a ZB-H1 built with m < pp, whose bubble the paper's formula does not describe."""
    with pytest.raises(ScheduleError) as error:
        build_schedule("zb_h1", 4, 3)
    assert "parallel.pipeline_schedule='zb_h1'" in str(error.value)
    assert "training.global_batch_size" in str(error.value)


# ----- split backward on a real graph ---------------------------------------------------------------


def _model() -> Transformer:
    cfg = load_config(None, ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=16",
                             "--model.vocab_size=64", "--training.seq_len=16"])  # fmt: skip
    torch.manual_seed(0)
    return Transformer(cfg.model)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _stage_backward(kind: str, split: bool) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """Two micro-batches through a stage (``first``: tokens in; ``middle``: hidden states in and out;
    ``last``: loss out); with ``split``: B1 B2 W1 W2 and no parameter gradient after the B's."""
    model, torch_gen = _model(), torch.Generator().manual_seed(1)
    layers = {"first": ["0"], "middle": ["0", "1"], "last": ["1"]}[kind]
    dxs, weights = [], []
    for _ in range(2):
        if kind == "first":
            x = torch.randint(0, 64, (2, 16), generator=torch_gen)
        else:
            x = torch.randn(2, 16, 32, generator=torch_gen).requires_grad_()
        out = model(x, 0, layers=layers)
        grad = torch.randn(out.shape, generator=torch_gen)
        if kind == "last":
            out, grad = F.cross_entropy(out.flatten(0, 1), grad.argmax(-1).flatten()) * 0.25, None
        if split:
            dx, w = backward_input(out, x, grad)
            weights.append(w)
        else:
            out.backward(grad)
            dx = x.grad
        dxs.append(dx)
    assert not split or not _grads(model), "B accumulated parameter gradients"
    for w in weights:
        w.run()
    return dxs, _grads(model)


@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_split_backward_equals_plain_backward_bit_for_bit(kind):
    """Catches a B that computes or accumulates weight gradients (they would count twice), a W that
    recomputes part of the input path into .grad (doubling earlier layers' gradients), a W that misses
    a parameter, or gradients of two micro-batches not summed into .grad."""
    dxs_plain, plain = _stage_backward(kind, split=False)
    dxs_split, split = _stage_backward(kind, split=True)
    assert plain.keys() == split.keys() and plain
    for name in plain:
        torch.testing.assert_close(split[name], plain[name], rtol=0, atol=0, msg=name)
    for a, b in zip(dxs_plain, dxs_split, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


class _Marked(torch.autograd.Function):
    """Identity that saves a marker tensor for backward, so a test can see when the graph is freed."""

    @staticmethod
    def forward(ctx, x, marker):
        ctx.save_for_backward(marker)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_weight_gradient_frees_the_saved_graph_and_runs_once():
    """Catches a W that keeps its micro-batch's graph (saved activations) alive after it ran, which
    would make ZB-H1 hold every micro-batch like GPipe, and a W run twice (gradients doubled)."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    marker = torch.ones(1000)
    alive = weakref.ref(marker)
    x = torch.randn(3, 4, requires_grad=True)
    out = second(_Marked.apply(first(x), marker))
    dx, w = backward_input(out, x, torch.ones_like(out))
    del out, marker
    gc.collect()
    assert alive() is not None, "B released the graph that W needs"
    w.run()
    del w
    gc.collect()
    assert alive() is None
    assert first.weight.grad is not None and second.weight.grad is not None
    _, again = backward_input(second(first(x)), x, torch.ones(3, 4))
    again.run()
    with pytest.raises(RuntimeError, match="already ran"):
        again.run()


def test_split_backward_refuses_a_weight_used_twice_in_a_stage():
    """Catches a silently doubled gradient: with a weight shared by two layers of a stage, W from the
    later use would run back through the input path to the earlier use."""
    shared = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = shared(torch.relu(shared(x)))
    with pytest.raises(RuntimeError, match="shared inside a pipeline stage"):
        backward_input(out, x, torch.ones_like(out))


# ----- emulated devices -----------------------------------------------------------------------------


def _big() -> ModelConfig:
    return ModelConfig(dim=8192, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, n_layers=80, vocab_size=32000,
                       max_seq_len=4096)  # fmt: skip


def test_gemm_time_is_the_math_or_memory_bound():
    """Catches a cost model that prices a thin (memory-bound) GEMM by its FLOPs or a square one by bytes:
    NVIDIA's math-or-memory bound, with the datasheet figures of the H100 SXM."""
    h100 = DEVICES["h100"]
    assert h100.peak_flops_per_s == 989.4e12 and DEVICES["a100"].peak_flops_per_s == 312e12
    square = Gemm(8192, 8192, 8192)
    assert square.seconds(h100) == pytest.approx(2 * 8192**3 / 989.4e12)
    thin = Gemm(1, 8192, 8192)
    assert thin.seconds(h100) == pytest.approx(2 * (8192 + 8192**2 + 8192) / 3.35e12)


def test_stage_forward_time_matches_the_project_flop_count_when_compute_bound():
    """Catches a GEMM missing from (or counted twice in) the emulated layer: at 4096 tokens every GEMM
    is compute-bound, so a stage's forward time is models/flops.py's forward FLOPs over the peak."""
    cfg, h100, tokens = _big(), DEVICES["h100"], 4096
    per_token = [flops_per_token(cfg.model_copy(update={"n_layers": n}), tokens) / 3 for n in (1, 2)]
    layer_flops = (per_token[1] - per_token[0]) * tokens
    head_flops = (per_token[0] * tokens) - layer_flops
    times = stage_times(cfg, 10, True, tokens, 1, h100)
    assert times.forward == pytest.approx((10 * layer_flops + head_flops) / h100.peak_flops_per_s)
    # B = W plus the attention backward (no weights there), twice its forward when compute-bound.
    attention, _ = attention_kernels(cfg, tokens, 1)
    assert times.input_grad - times.weight_grad == pytest.approx(10 * 2 * attention.seconds(h100))
    assert times.weight_grad == pytest.approx(
        sum(g.seconds(h100) for g in layer_gemms(cfg, tokens, 1)) * 10
        + Gemm(tokens, cfg.dim, cfg.vocab_size).seconds(h100)
    )


def test_unknown_device_names_the_flag_and_the_choices():
    """Catches a typo in --simulate.device surfacing as a KeyError deep in a run."""
    with pytest.raises(ValueError, match=r"simulate.device='v100' is unknown; choose one of a100, h100"):
        device("v100")
    assert device("H100") is DEVICES["h100"]


def test_emulated_stage_sends_real_shapes_and_defers_its_weight_gradient_to_w():
    """Catches an emulated stage whose output is not the real activation shape (transfers would be the
    wrong size) or whose weight-gradient wait runs in B (a zero-bubble run would then show 1F1B's
    bubble): the stage parameter gets its gradient only in W."""
    cfg = ModelConfig(dim=64, n_heads=4, n_layers=4, vocab_size=128, max_seq_len=32)
    stages = EmulatedStages(cfg, {1: ["1"], 3: ["3"]}, 4, seq_len=32, micro_batch=2, dev=DEVICES["a100"])
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    out = stages(x, 0, layers=["1"])
    assert out.shape == (2, 32, 64) and out.dtype == torch.bfloat16
    dx, w = backward_input(out, x, torch.ones_like(out))
    assert dx.shape == x.shape and stages.weights["1"].grad is None
    w.run()
    assert stages.weights["1"].grad is not None
    last = stages(torch.randn(2, 32, 64, dtype=torch.bfloat16), 0, layers=["3"])
    emulated_loss(last, torch.zeros(2, 32, dtype=torch.long)).backward()
    assert stages.weights["3"].grad is not None


def test_config_refuses_zb_h1_with_fewer_micro_batches_than_stages_before_launch():
    """Catches a ZB-H1 batch layout that passes the config check and fails only once every rank has
    started (at the executor's schedule build)."""
    cfg = load_config(None, ["--model.n_layers=8", "--parallel.pipeline_parallel_degree=4",
                             "--parallel.pipeline_schedule=zb_h1", "--training.global_batch_size=4",
                             "--training.micro_batch_size=1"])  # fmt: skip
    cfg.validate_batch(1)
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule='zb_h1' needs at least"):
        cfg.validate_batch(2)
