"""The planner's time model (src/loomtrain/planner/time.py) and its check against Megatron-LM's Table 1.

Published numbers: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021, arXiv:2104.04473), Table 1 and §5.1 (eq. 2 parameter count, eq. 3 FLOPs), held in
src/loomtrain/planner/published.py with where they were read.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loomtrain.models.flops import flops_per_step as model_flops_per_step
from loomtrain.models.flops import flops_per_token
from loomtrain.models.presets import preset_config
from loomtrain.planner.arch import from_model_config, gpt
from loomtrain.planner.cost import TILE_M, TILE_N, block_forward_flops, head_times
from loomtrain.planner.memory import MIXED_ADAM, Layout, device_params
from loomtrain.planner.published import MEGATRON_TABLE1, layout_of
from loomtrain.planner.time import (
    DGX_A100,
    LOG_WORLD_ALL_REDUCES,
    all_to_all_seconds,
    boundary_sends,
    dp_all_reduce_seconds,
    flops_per_step,
    gemm_seconds,
    layer_seconds,
    logging_seconds,
    loss_seconds,
    micro_batch_seconds,
    p2p_seconds,
    pipeline_seconds,
    ring_all_reduce_seconds,
    shared_pipeline_seconds,
    step_time,
    tp_all_reduce_seconds,
    vocab_parallel_seconds,
    zero3_seconds,
)

GPT_18B = gpt(40, 6144, 48)


def _layout(**fields) -> Layout:
    base = dict(seq_len=2048, micro_batch=1, dp=4, tp=8, pp=4, n_micro=16, recompute="full", precision=MIXED_ADAM)
    return Layout(**{**base, **fields})


def test_wave_quantization_one_tile_past_a_full_wave_costs_a_second_wave():
    """Catches: a GEMM priced by its useful FLOPs only (no partial-wave loss), or a wave count off by one:
    one output tile more than the SMs hold must take twice the time of exactly one full wave."""
    k, rows, cols = 8192, 27, 4  # 27 × 4 = 108 tiles: one full wave on the A100's 108 SMs
    assert rows * cols == DGX_A100.sms
    full = gemm_seconds(TILE_M * rows, k, TILE_N * cols, DGX_A100)
    plus_one_row = gemm_seconds(TILE_M * rows + 1, k, TILE_N * cols, DGX_A100)
    assert plus_one_row == pytest.approx(2 * full, rel=1e-9)
    peak = DGX_A100.device.peak_flops_per_s * DGX_A100.gemm_efficiency
    assert full == pytest.approx(2 * TILE_M * rows * k * TILE_N * cols / peak, rel=1e-9)


def test_skinny_gemm_is_priced_by_its_memory_traffic():
    """Catches: a memory-bound GEMM (one token against a large weight) priced at the math rate, which
    would make small micro-batches look free."""
    m, k, n = 1, 8192, 8192
    expected = 2 * (m * k + k * n + m * n) / DGX_A100.device.memory_bytes_per_s
    assert gemm_seconds(m, k, n, DGX_A100) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpt_layer_gemms_sum_to_the_papers_forward_flops(tp):
    """Catches: a wrong GEMM shape in a block (a missing head split, the MLP width, QKV's 3h): the
    forward FLOPs of one block over all tp ranks must be Narayanan et al. §5.1's 24bsh² + 4bs²h."""
    b, s, h = 2, 2048, GPT_18B.hidden
    flops = block_forward_flops(GPT_18B, s, b, tp) * tp
    assert flops == pytest.approx(24 * b * s * h * h + 4 * b * s * s * h, rel=1e-12)


def test_llama_flops_match_models_flops_py():
    """Catches: the planner's Llama FLOPs drifting from the one definition in models/flops.py (GQA widths,
    SwiGLU's three matrices, the head), which every MFU figure uses."""
    cfg = preset_config("llama3-8b", vocab_size=128256)
    arch = from_model_config(cfg)
    layout = Layout(seq_len=8192, micro_batch=1, dp=2, n_micro=3, recompute="none")
    tokens = 2 * 3 * 8192
    assert flops_per_step(arch, layout) == pytest.approx(model_flops_per_step(cfg, 8192, tokens), rel=1e-12)
    gemm_flops = block_forward_flops(arch, 8192, 1)
    head = 2 * cfg.dim * cfg.vocab_size
    assert gemm_flops * cfg.n_layers + head * 8192 == pytest.approx(flops_per_token(cfg, 8192) / 3 * 8192)


@pytest.mark.parametrize(("ranks", "factor"), [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_buffer(ranks, factor):
    """Catches: an all-reduce priced at the algbw (the buffer once) or at 2× for every group size
    instead of the ring's 2(n - 1)/n per rank."""
    assert ring_all_reduce_seconds(1e9, ranks, 1e11, 0.0) == pytest.approx(factor * 1e9 / 1e11)
    assert ring_all_reduce_seconds(1e9, 1, 1e11, 1.0) == 0.0


@pytest.mark.parametrize(("recompute", "count"), [("none", 4), ("full", 6)])
def test_tensor_parallel_all_reduces_per_block(recompute, count):
    """Catches: the tp all-reduce count per block per micro-batch (Megatron: two in forward, two in
    backward) wrong, or full recomputation not repeating the forward's two."""
    layout = _layout(recompute=recompute)
    st = step_time(GPT_18B, layout, DGX_A100)
    blocks = GPT_18B.n_layers // layout.pp
    outside = sum(vocab_parallel_seconds(GPT_18B, layout, DGX_A100))
    assert st.tp_comm == pytest.approx(count * blocks * tp_all_reduce_seconds(GPT_18B, layout, DGX_A100) + outside)


def test_vocabulary_parallel_embedding_and_loss_all_reduces_are_priced():
    """Catches: the all-reduces outside the blocks left out (loomtrain's tp runs 4 more per micro-batch:
    the embedding's, the cross-entropy's two, the head input's gradient; tp 2 and tp 4 own runs
    measured 10-20 % slower than priced without them), or the embedding's counted on a last
    pipeline stage that does not hold it."""
    activation = tp_all_reduce_seconds(GPT_18B, _layout(), DGX_A100)
    forward, backward = vocab_parallel_seconds(GPT_18B, _layout(), DGX_A100)  # pp 4: the head's stage only
    assert backward == pytest.approx(activation) and 0 < forward < activation
    whole = vocab_parallel_seconds(GPT_18B, _layout(pp=1, dp=16), DGX_A100)
    assert whole == pytest.approx((forward + activation, backward))
    assert vocab_parallel_seconds(GPT_18B, _layout(tp=1, dp=32), DGX_A100) == (0.0, 0.0)


def test_the_cross_entropy_streams_the_logits_on_the_last_stage_only():
    """Catches: the loss kernels left out (Megatron-LM's fp32 cross-entropy of 1.7B's 16 × 2048 ×
    51,200 logits per micro-batch moves 87 GB, 43 ms at 2,039 GB/s; Llama 3's 128K vocabulary makes
    it larger) or priced on a stage without the head: the last stage's micro-batch takes exactly the
    loss's seconds more than the same stage without it, and they scale with b·s·V/t."""
    arch, layout = gpt(24, 2304, 24), _layout(micro_batch=16, dp=32, tp=1, pp=1, n_micro=1)
    forward, backward = loss_seconds(arch, layout, DGX_A100)
    logits = 16 * 2048 * 51200
    assert forward + backward == pytest.approx(logits * 52 / DGX_A100.device.memory_rate(0))
    halved = loss_seconds(arch, replace(layout, tp=2), DGX_A100)
    assert halved == pytest.approx((forward / 2, backward / 2))
    twice = replace(arch, vocab_size=2 * 51200)  # the head's GEMMs and the loss double, nothing else moves
    head = head_times(arch, 2048, 16, DGX_A100.compute_device, 1, True)
    grown = [t - u for t, u in zip(micro_batch_seconds(twice, layout, DGX_A100)[:2],
                                   micro_batch_seconds(arch, layout, DGX_A100)[:2], strict=True)]  # fmt: skip
    assert grown == pytest.approx([head.forward + forward, head.backward + backward], rel=0.02)
    llama = from_model_config(preset_config("llama3-8b"))
    bf16 = replace(layout, precision=replace(MIXED_ADAM, activation_bytes=2))
    assert sum(loss_seconds(llama, bf16, DGX_A100)) > sum(loss_seconds(llama, replace(bf16, precision=replace(
        MIXED_ADAM, activation_bytes=4)), DGX_A100))  # fmt: skip


def test_pipeline_time_is_m_plus_p_minus_1_micro_batches_under_1f1b():
    """Catches: the bubble dropped or counted twice: 1F1B takes (m + p - 1)(t_f + t_b) (Narayanan et al.
    §2.2.1), and the interleaved schedule's bubble is smaller by its v."""
    layout = _layout()
    st = step_time(GPT_18B, layout, DGX_A100)
    assert st.pipeline == pytest.approx((16 + 4 - 1) * (st.forward + st.backward + st.grad_accumulation / 16))
    assert st.bubble == pytest.approx(3 / 19)
    interleaved = step_time(GPT_18B, _layout(schedule="interleaved_1f1b", virtual_stages=2), DGX_A100)
    assert interleaved.bubble == pytest.approx(3 / (2 * 16 + 3))


def test_micro_batches_after_the_first_pay_a_gradient_accumulation_pass():
    """Catches: gradient accumulation left out (each micro-batch after the first adds its weight
    gradients into the accumulated ones: read both, write the sum, 3 · 2 bytes per 16-bit parameter
    of the stage; at b = 1, s = 2048 ~5 % of a micro-batch, which every pipelined Megatron row was
    predicted too fast without), charged for the first micro-batch too where it is written, or
    charged per ZeRO shard (the stage's whole gradients accumulate: ZeRO reduces at the last
    micro-batch); and loomtrain's zeroed buckets (``zeroed_grad_buffers``, no ZeRO) priced without
    the first micro-batch's addition (autograd adds it into the zeros: 1 of dp 2's 2 additions in
    the own-run model's profiled step)."""
    written = {"zeroed_grad_buffers": False}
    one = step_time(GPT_18B, _layout(n_micro=1, **written), DGX_A100)
    assert one.grad_accumulation == 0
    st = step_time(GPT_18B, _layout(**written), DGX_A100)
    params = device_params(GPT_18B, _layout())
    pass_seconds = params * 6 / DGX_A100.device.memory_rate(0)
    assert st.grad_accumulation == pytest.approx(15 * pass_seconds)
    assert 0.03 < st.grad_accumulation / 16 / st.backward < 0.1
    zero2 = step_time(GPT_18B, _layout(zero_stage=2), DGX_A100)
    assert zero2.grad_accumulation == pytest.approx(st.grad_accumulation)
    assert step_time(GPT_18B, _layout(), DGX_A100).grad_accumulation == pytest.approx(16 * pass_seconds)
    assert step_time(GPT_18B, _layout(n_micro=1), DGX_A100).grad_accumulation == pytest.approx(pass_seconds)


def test_tensor_parallelism_across_hosts_is_slower_than_inside_one():
    """Catches: the link choice ignoring host boundaries: tp = 16 on 8-GPU hosts must ride InfiniBand,
    so per-block all-reduces get slower than tp = 8 on NVLink though each rank moves less."""
    inside = tp_all_reduce_seconds(GPT_18B, _layout(tp=8), DGX_A100)
    across = tp_all_reduce_seconds(GPT_18B, _layout(tp=16), DGX_A100)
    assert across > 5 * inside


def test_data_parallel_all_reduce_hides_behind_the_last_backward_only():
    """Catches: the gradient all-reduce either always exposed or always hidden: with ample bandwidth it
    fits under the last micro-batch's backward (0 exposed); with little, all but that backward shows."""
    layout = _layout(dp=64, pp=1, n_micro=4)
    fast = step_time(GPT_18B, layout, replace(DGX_A100, inter_bytes_per_s=1e15))
    assert fast.dp_exposed == 0.0
    slow_cluster = replace(DGX_A100, inter_bytes_per_s=1e9)
    slow = step_time(GPT_18B, layout, slow_cluster)
    params_bytes = 2 * (GPT_18B.param_count() / 8)
    all_reduce = 2 * 63 / 64 * params_bytes / (1e9 * DGX_A100.link_efficiency)
    assert slow.dp_exposed == pytest.approx(all_reduce - slow.backward, rel=0.01)


def test_more_micro_batches_shrink_the_bubble_and_raise_throughput():
    """Catches: a sign error in the bubble term: at fixed micro-batch size, more micro-batches per step
    must lower the idle share and raise the predicted TFLOP/s per GPU."""
    shares = [step_time(GPT_18B, _layout(n_micro=m), DGX_A100) for m in (4, 16, 64)]
    assert shares[0].bubble > shares[1].bubble > shares[2].bubble
    per_step = [st.pipeline / m for st, m in zip(shares, (4, 16, 64), strict=True)]
    assert per_step[0] > per_step[1] > per_step[2]


def test_zero3_gathers_three_times_and_reduce_scatters_once_per_micro_batch():
    """Catches: ZeRO-3 priced as plain data parallelism (no per-micro-batch parameter gathers), the
    recomputed forward's second gather dropped, or the gathers added to compute instead of overlapping
    it (Rajbhandari et al. §7.2.2; DeepSpeed prefetch): a comm-bound micro-batch takes its gathers' time."""
    layout = _layout(dp=64, tp=1, pp=1, n_micro=1, zero_stage=3)
    gather_f, gather_b = zero3_seconds(GPT_18B, layout, DGX_A100)
    bandwidth = DGX_A100.inter_bytes_per_s * DGX_A100.link_efficiency
    volume = 63 / 64 * 2 * GPT_18B.param_count() / bandwidth
    latency = GPT_18B.n_layers * 63 * DGX_A100.inter_latency_s
    assert gather_f == pytest.approx(volume + latency, rel=1e-3)
    assert gather_b == pytest.approx(3 * gather_f, rel=1e-3)
    st = step_time(GPT_18B, layout, DGX_A100)
    assert st.forward == pytest.approx(gather_f) and st.backward == pytest.approx(gather_b)
    assert zero3_seconds(GPT_18B, replace(layout, zero_stage=2), DGX_A100) == (0.0, 0.0)


def test_ulysses_all_to_all_moves_sp_minus_1_over_sp_of_qkv_and_output():
    """Catches: Ulysses sp priced without its all-to-alls, or with the whole q, k, v and output instead of the
    (sp - 1)/sp share each rank sends (Jacobs et al. 2023 §3); none without sp."""
    layout = _layout(tp=1, pp=1, dp=1, sp=4)
    expected = 3 / 4 * 2048 / 4 * 4 * GPT_18B.hidden * 2 / (DGX_A100.intra_bytes_per_s * DGX_A100.link_efficiency)
    assert all_to_all_seconds(GPT_18B, layout, DGX_A100) == pytest.approx(expected + 12 * DGX_A100.intra_latency_s)
    assert all_to_all_seconds(GPT_18B, replace(layout, sp=1), DGX_A100) == 0.0


# 2 hosts × 2 devices whose network is 1 GB/s each way: per device, or one link per host (shared).
PER_DEVICE_2X2 = replace(DGX_A100, hosts=2, devices_per_host=2, inter_bytes_per_s=1e9)
SHARED_2X2 = replace(PER_DEVICE_2X2, inter_shared_by_host=True)
LATENCY = DGX_A100.inter_latency_s


def _crossings(cluster) -> dict[str, float]:
    """Seconds of the collectives that cross the 2 × 2 cluster's hosts: dp all-reduces of 1e6
    16-bit gradients over 4 consecutive ranks (stride 1) and over 2 ranks 2 apart (tp 2 × dp 2), a
    stage send of tp 2 × pp 2 and of pp 4, Ulysses' all-to-alls of sp 4."""
    return {
        "dp4": dp_all_reduce_seconds(GPT_18B, _layout(dp=4, tp=1, pp=1), cluster, 1e6),
        "tp2_dp2": dp_all_reduce_seconds(GPT_18B, _layout(dp=2, tp=2, pp=1), cluster, 1e6),
        "tp2_pp2": p2p_seconds(GPT_18B, _layout(dp=1, tp=2, pp=2), cluster),
        "pp4": p2p_seconds(GPT_18B, _layout(dp=1, tp=1, pp=4), cluster),
        "sp4": all_to_all_seconds(GPT_18B, _layout(dp=1, tp=1, pp=1, sp=4), cluster),
    }


def _hand_crossings(rates: dict[str, float]) -> dict[str, float]:
    """The same by hand, at ``rates[name]`` bytes/s per rank before ``link_efficiency``."""
    rate = {name: r * DGX_A100.link_efficiency for name, r in rates.items()}
    activation = 2048 * GPT_18B.hidden * 2  # b · s · h 16-bit activations
    return {
        "dp4": 2 * 3 / 4 * 2e6 / rate["dp4"] + 6 * LATENCY,
        "tp2_dp2": 2 * 1 / 2 * 2e6 / rate["tp2_dp2"] + 2 * LATENCY,
        "tp2_pp2": activation / 2 / rate["tp2_pp2"] + LATENCY,
        "pp4": activation / rate["pp4"] + LATENCY,
        "sp4": 4 * (3 / 4 * activation / 4 / rate["sp4"] + 3 * LATENCY),  # q, k, v, output; kv = hidden
    }


def test_a_shared_host_link_is_split_among_the_host_ranks_crossing_it_at_once():
    """Catches: a host's one link (an emulated cluster's veth, `host_gb_per_s`) priced as a card per
    rank, or halved for every crossing: a ring over 4 consecutive ranks (dp 4) and pp 4's stage send
    cross it with one stream each way and get the whole 1 GB/s; tp 2 × dp 2's two dp pairs (stride 2)
    and tp 2 × pp 2's two tp ranks' sends cross at once and get half each; Ulysses' all-to-all sends
    from both of a host's ranks, half each (the 2 × error the emulated-cluster runs measured)."""
    half = {"dp4": 1e9, "tp2_dp2": 0.5e9, "tp2_pp2": 0.5e9, "pp4": 1e9, "sp4": 0.5e9}
    assert _crossings(SHARED_2X2) == pytest.approx(_hand_crossings(half), rel=1e-12)


def test_a_network_card_per_device_gives_every_crossing_the_whole_rate():
    """Catches: the shared-link split leaking into per-device specs (`inter_gb_per_s`, every DGX
    figure): each rank has its own 1 GB/s whatever the other ranks of its host send, as before."""
    crossings = _crossings(PER_DEVICE_2X2)
    assert crossings == pytest.approx(_hand_crossings(dict.fromkeys(crossings, 1e9)), rel=1e-12)


def test_each_pipeline_boundary_sends_over_the_link_between_its_stages_hosts():
    """Catches: every stage send priced at the network's rate when only some boundaries leave a host:
    pp 4 over 2 hosts of 2 crosses at its middle boundary (ranks 1, 2) and the wrap (3, 0) only;
    pp 2 × dp 2 (stages 2 ranks apart) crosses at both, its host's 2 ranks sending at once; pp 2 on
    one host of 2 crosses at neither (its wrap, rank 1 to rank 0, stays inside); dp 3 × pp 2 on
    hosts of 4 crosses with 2 of the stage's 3 ranks (ranks 1 and 2 to 4 and 5), not judged by its
    first rank alone (0 to 3, inside)."""
    intra = p2p_seconds(GPT_18B, _layout(dp=1, tp=1, pp=2), replace(SHARED_2X2, hosts=1, devices_per_host=4))
    inter = p2p_seconds(GPT_18B, _layout(dp=1, tp=1, pp=4), SHARED_2X2)
    assert boundary_sends(GPT_18B, _layout(dp=1, tp=1, pp=4), SHARED_2X2) == pytest.approx((intra, inter, intra, inter))
    shared = p2p_seconds(GPT_18B, _layout(dp=2, tp=1, pp=2), SHARED_2X2)
    assert boundary_sends(GPT_18B, _layout(dp=2, tp=1, pp=2), SHARED_2X2) == pytest.approx((shared, shared))
    assert shared > 1.9 * inter - LATENCY
    assert boundary_sends(GPT_18B, _layout(dp=1, tp=1, pp=2), replace(SHARED_2X2, hosts=1)) == pytest.approx(
        (intra, intra))  # fmt: skip
    hosts_of_4 = replace(SHARED_2X2, devices_per_host=4)
    straddling = boundary_sends(GPT_18B, _layout(dp=3, tp=1, pp=2), hosts_of_4)[0]
    assert straddling == pytest.approx(shared)


def test_ranks_that_share_cores_replay_their_pipeline_with_overlapped_sends():
    """Catches: a pipeline on shared cores priced as blocking sends on every micro-batch (the
    emulated cluster measured pp 4 at 1.128 s where that form priced 1.406 s), or its idle ranks'
    cores not lent: at half a core per rank over a 100 MB/s host link (sends of 0.25 s at the middle
    boundary) the step lies between the ranks' work without the sends (the floor: the cores all
    ranks' work needs at the shared rate) and that work with half of every micro-batch's sends
    still blocking (the earlier form priced all of them: 3.25 s, this 2.09 s), far below the
    dedicated-core schedule; with free sends the replay at core share 1 is the 1F1B formula."""
    layout = _layout(dp=1, tp=1, pp=4, n_micro=4, recompute="none")
    shared = replace(SHARED_2X2, core_share=0.5, inter_bytes_per_s=1e8)
    st = step_time(GPT_18B, layout, shared)
    with_sends = 4 * (st.forward + st.backward + st.grad_accumulation / 4)
    assert with_sends - 4 * st.p2p <= st.pipeline < with_sends - 2 * st.p2p
    assert st.pipeline < 0.7 * pipeline_seconds(4, st.forward, st.backward + st.grad_accumulation / 4, st.bubble)
    free = replace(DGX_A100, intra_bytes_per_s=1e30, intra_latency_s=0.0)
    one = step_time(GPT_18B, layout, free)
    accumulating = one.backward + one.grad_accumulation / 4
    assert shared_pipeline_seconds(GPT_18B, layout, free, one.forward, accumulating) == pytest.approx(
        one.pipeline, rel=1e-9)  # fmt: skip


@pytest.mark.parametrize("run", MEGATRON_TABLE1, ids=lambda r: f"{r.params_b}B")
def test_table1_rows_are_consistent_with_the_papers_parameter_formula(run):
    """Catches: a mistyped Table 1 row (layers, hidden size): eq. 2 of the paper,
    12lh²(1 + 13/(12h) + (V + s)/(12lh)), must give the row's parameter count to its printed 0.1 B;
    and a mistyped run_table_1.sh setting: the micro-batches must make the batch, and an interleaved
    row's chunks must split the layers evenly with micro-batches a multiple of p (Megatron-LM's
    interleaved schedule refuses anything else)."""
    arch = gpt(run.layers, run.hidden, run.heads)
    assert arch.param_count() / 1e9 == pytest.approx(run.params_b, abs=0.06)
    layout = layout_of(run)
    assert run.gpus % (run.tp * run.pp) == 0 and layout.n_micro * layout.dp * layout.micro_batch == run.batch
    if run.virtual_stages > 1:
        assert run.layers % (run.pp * run.virtual_stages) == 0 and layout.n_micro % run.pp == 0


def test_full_recomputation_adds_exactly_one_forward_to_the_backward():
    """Catches: recomputation priced as its GEMMs only (dropping the repeated all-reduces and elementwise
    kernels) or not at all: a block's backward under full recomputation is its backward without it
    plus its whole forward (Narayanan et al. §5.1)."""
    forward, plain, _ = layer_seconds(GPT_18B, _layout(recompute="none"), DGX_A100)
    _, recomputed, _ = layer_seconds(GPT_18B, _layout(recompute="full"), DGX_A100)
    assert recomputed == pytest.approx(plain + forward, rel=1e-12)


def test_logging_collectives_are_priced_per_logged_step_over_their_groups():
    """Catches: the trainer's logging all-reduces priced over the wrong groups (all ranks, ``sp``
    included, for the world's; the loss's mean over the gradient ranks only: none at tp 8, whose
    gradient group is one rank), the overlap timer's all-reduce counted off a CPU (or not on one),
    small messages priced by a ring's ``2(n - 1)`` latencies instead of a tree's ``2·log2 n``, not
    spread over ``log_interval`` steps, or priced for the published runs (``log_interval`` 0)."""
    assert step_time(GPT_18B, _layout(), DGX_A100).logging == 0
    latency = DGX_A100.inter_latency_s
    layout = _layout(log_interval=4, tp=8, dp=1, pp=2, sp=2)  # 32 ranks, a gradient group of sp = 2
    world, grad = 2 * 5 * latency, 2 * 1 * latency
    assert logging_seconds(layout, DGX_A100) == pytest.approx((LOG_WORLD_ALL_REDUCES * world + grad) / 4)
    one_grad_rank = replace(layout, sp=1)
    assert logging_seconds(one_grad_rank, DGX_A100) == pytest.approx(LOG_WORLD_ALL_REDUCES * 2 * 4 * latency / 4)
    curve = (("all_reduce", 2, ((4096.0, 1e-3), (2**20, 3e-3))),)
    cpu = replace(DGX_A100, devices_per_host=2, collective_curves=curve,
                  device=replace(DGX_A100.device, gemm_curve=((1e6, 1e11),)))  # fmt: skip
    timer_on = LOG_WORLD_ALL_REDUCES + 1  # and the loss's mean over the same 2 ranks
    assert logging_seconds(Layout(seq_len=64, dp=2, log_interval=1), cpu) == pytest.approx((timer_on + 1) * 1e-3)
    st = step_time(GPT_18B, layout, DGX_A100)
    assert st.total == pytest.approx(st.pipeline + st.dp_exposed + st.optimizer + st.grad_passes + st.logging)
    with pytest.raises(ValueError, match="log_interval"):
        _layout(log_interval=-1)
