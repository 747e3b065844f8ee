"""The time model against Megatron-LM's published runs (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473): Tables 1 and 2 (22 rows), and the
rankings of Fig. 13 (tensor versus pipeline parallelism, a 162.2B GPT on 64 A100s, batch 32 and 128) and
Fig. 16 (micro-batch size, a 91B GPT at t = p = 8, batch 128 and 512). The shapes of the figures' models are
those of Megatron-LM's examples/sc21/run_figure_13.sh (32 layers, hidden 20480, 128 heads, micro-batch 1)
and run_figure_16.sh (32 layers, hidden 15360, 128 heads). No constant of the model is fitted to these.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loomtrain.planner.arch import gpt
from loomtrain.planner.memory import MIXED_ADAM, Layout
from loomtrain.planner.published import (
    MEGATRON_RUNS,
    MEGATRON_TABLE2,
    SELENE,
    constant_predictor_errors,
    errors,
    held_out_errors,
    layout_of,
    mape,
    megatron_layout,
    predict,
)
from loomtrain.planner.time import layer_seconds, tflops_per_gpu, weight_prefetch_seconds

FIG13 = gpt(32, 20480, 128)
FIG16 = gpt(32, 15360, 128)


def _megatron(arch, tp: int, pp: int, batch: int, micro_batch: int = 1) -> float:
    return tflops_per_gpu(arch, megatron_layout(64 // (tp * pp), tp, pp, batch // micro_batch, micro_batch), SELENE)


@pytest.mark.parametrize("run", MEGATRON_TABLE2, ids=lambda r: f"{r.table}-{r.params_b}B-{r.gpus}")
def test_table2_rows_are_consistent(run):
    """Catches: a mistyped Table 2 row: the shape must give the row's parameter count (eq. 2, to 0.1 B),
    the GPUs must divide into t·p replicas, and ZeRO-3's micro-batch times its GPUs must be the batch
    (one micro-batch per step, no model parallelism)."""
    assert gpt(run.layers, run.hidden, run.heads).param_count() / 1e9 == pytest.approx(run.params_b, abs=0.06)
    layout = layout_of(run)
    assert layout.dp * layout.n_micro * layout.micro_batch == run.batch and layout.gpus == run.gpus
    assert run.zero_stage == 0 or (layout.n_micro == 1 and run.tp == run.pp == 1)


def test_22_rows_are_within_10_percent_mape_no_row_off_by_20_percent_and_beat_the_best_constant():
    """Catches: a time model no better than a constant guess across Tables 1 and 2 (44-171 TFLOP/s;
    the best constant's MAPE is 28.5 %), or one off the issue's targets: 10 % MAPE (4.5 % on SELENE)
    and no row worse than 20 % (worst +16.4 %, the 530B ZeRO-3 row at 4 sequences per GPU). Fails
    with DeepSpeed's ZeRO-3 priced as block prefetch (+35 % and +41 % on the rows at 4 sequences
    per GPU, where compute and gathers are of one length)."""
    errs = errors(MEGATRON_RUNS)
    assert len(errs) == 22
    assert mape(errs) < 10 < mape(constant_predictor_errors(MEGATRON_RUNS))
    assert max(abs(e) for e in errs) < 0.20


def test_weight_prefetch_waits_on_the_larger_neighbour():
    """Catches: ZeRO-3 that gathers one weight ahead (DeepSpeed's) priced as a block prefetch (the
    longer of a pass's compute and gathers), its backward not run in reverse order, or the first
    gather taken as hidden. On a roofline device where every GEMM is math-bound, a GPT block's four
    weights (3h², h², 4h², 4h²) split both compute and gathers 3:1:4:4; with both 12 units a block,
    each slot waits on the larger of its compute and the next weight's gather: 3 + 4 + 4 + 4 = 15
    a block, and over 4 blocks 4 · 15, plus the first gather (3; backward 4), less the last slot's
    wait (4; backward 4) and plus its compute (4; backward 3): 63 in both directions, where block
    prefetch takes 48. Compute-bound, a pass is its compute plus the first weight's gather."""
    arch = gpt(4, 1024, 16)
    layout = Layout(seq_len=1024, micro_batch=8, dp=8, zero_stage=3, precision=MIXED_ADAM, zero3_prefetch="weight")
    roofline = replace(SELENE, device=replace(SELENE.device, sms=0, memory_bytes_per_s=1e18))
    for backward in (False, True):
        assert weight_prefetch_seconds(arch, layout, roofline, 48.0, 48.0, backward) == pytest.approx(63.0)
        assert weight_prefetch_seconds(arch, layout, roofline, 4800.0, 48.0, backward) == pytest.approx(
            4800.0 + (4.0 if backward else 3.0)
        )
        assert weight_prefetch_seconds(arch, layout, roofline, 48.0, 0.0, backward) == 48.0
    with pytest.raises(ValueError, match="zero3_prefetch"):
        Layout(seq_len=1024, zero3_prefetch="layer")


def test_held_out_korthikanti_runs_are_within_10_percent_mape():
    """Catches: a model that matches Tables 1 and 2 only: Korthikanti et al. 2022's Table 5 iteration
    times (22B-1T, full and selective recomputation, 5.9 % MAPE), which no constant of the model was
    taken from, must be predicted within 10 % MAPE too."""
    errs = held_out_errors()
    assert len(errs) == 9 and mape(errs) < 10


@pytest.mark.parametrize(
    ("recompute", "sequence_parallel", "forward_ms", "combined_ms", "tolerance"),
    [("none", False, 7.7, 19.6, 0.05), ("none", True, 7.2, 19.0, 0.05), ("full", False, 7.7, 27.2, 0.05),
     ("selective", False, 7.7, 20.9, 0.05), ("selective", True, 7.2, 20.3, 0.10)],
)  # fmt: skip
def test_a_22b_layer_takes_the_time_korthikanti_table4_measured(recompute, sequence_parallel, forward_ms,
                                                                 combined_ms, tolerance):  # fmt: skip
    """Catches: a block priced off at the layer level (the 22B layer, t 8, micro-batch 4, measured
    on Selene, Korthikanti et al. 2022 Table 4): forward within 2 %, forward + backward within 5 %
    (10 % for selective with sequence parallelism, whose backward all-gathers the input again: not
    priced). Fails without the backward all-reduce under the weight-gradient GEMMs (combined +11 %)
    or with Megatron SP's norms and dropouts priced on the whole sequence (SP forward +8 %)."""
    layout = Layout(seq_len=2048, micro_batch=4, tp=8, recompute=recompute, sequence_parallel=sequence_parallel,
                    precision=MIXED_ADAM, overlap_tp_backward=True)  # fmt: skip
    forward, backward, _ = layer_seconds(gpt(48, 6144, 64), layout, SELENE)
    assert 1e3 * forward == pytest.approx(forward_ms, rel=0.02)
    assert 1e3 * (forward + backward) == pytest.approx(combined_ms, rel=tolerance)


def test_best_constant_predictor_is_the_mape_minimising_constant():
    """Catches: a baseline weaker than the best constant (e.g. the mean, which MAPE does not favour):
    no published value or midpoint may give a lower MAPE than the one used."""
    values = sorted(r.tflops for r in MEGATRON_RUNS)
    best = mape(constant_predictor_errors(MEGATRON_RUNS))
    for c in values + [(a + b) / 2 for a, b in zip(values, values[1:], strict=False)]:
        assert best <= 100 * sum(abs(c - v) / v for v in values) / len(values) + 1e-9


@pytest.mark.parametrize("batch", [32, 128])
def test_fig13_best_split_of_64_gpus_is_t8_p8_and_a_bad_split_costs_2x(batch):
    """Catches: a model that prefers tensor parallelism across hosts (its all-reduces on InfiniBand) or deep
    pipelines (their bubble): of (p, t) = (2, 32) ... (32, 2), t = p = 8 must be the best (Fig. 13), and the
    worst split must lose at least half the throughput (the paper: ~75 against ~165 TFLOP/s at batch 128)."""
    splits = {(t, 64 // t): _megatron(FIG13, t, 64 // t, batch) for t in (32, 16, 8, 4, 2)}
    assert max(splits, key=splits.get) == (8, 8)
    assert min(splits.values()) <= 0.5 * splits[(8, 8)]


def test_fig16_micro_batch_2_is_best_for_91b_at_t8_p8():
    """Catches: a model blind to the micro-batch trade-off (bigger GEMMs against a bigger pipeline bubble):
    micro-batch 2 must be the best of 1, 2, 4, 8 at batch 512 and at batch 128 (Fig. 16; at 128 the
    model had b = 1 and 2 level until it priced gradient accumulation, which b = 1 pays twice as often)."""
    for batch in (512, 128):
        throughput = {b: _megatron(FIG16, 8, 8, batch, b) for b in (1, 2, 4, 8)}
        assert max(throughput, key=throughput.get) == 2, batch


def test_zero3_falls_behind_ptd_p_as_gpus_double():
    """Catches: ZeRO-3's cross-host parameter traffic left unpriced: doubling the GPUs at a fixed batch must
    cut ZeRO-3's throughput per GPU roughly in half while PTD-P's stays within 10 % (Table 2, §5.2)."""
    pred = {(r.table, r.params_b, r.gpus): r for r in MEGATRON_TABLE2}
    zero = [predict(pred[("Table 2 ZeRO-3", 174.6, n)]) for n in (384, 768, 1536)]
    ptd = [predict(pred[("Table 2 PTD-P", 174.6, n)]) for n in (384, 768, 1536)]
    assert zero[2] < 0.35 * zero[0] and ptd[2] > 0.9 * ptd[0]
