"""Published training runs the time model is checked against, and the comparison table.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC 2021, arXiv:2104.04473), on Selene (DGX A100 80 GB), 16-bit, vocabulary 51,200, sequence 2,048,
full activation recomputation (§5.1: the FLOP count of eq. 3 assumes it):

- Table 1 (weak scaling, GPT 1.7B to 1T on 32 to 3072 GPUs). The paper does not list the micro-batch
  size, the schedule or the data-parallel implementation of these runs; the script that produced
  the table does (Megatron-LM ``examples/sc21/run_table_1.sh``, with ``CONFIG.sh``: fp16, static loss
  scale, full recomputation): micro-batch 16, 16, 16, 8, 4, 2, 2, 1, 1, 1; the interleaved schedule
  for 76.1B, 145.6B, 310.1B and 529.6B (5, 5, 3 and 1 layers per virtual stage: 3, 2, 2 and 3 chunks
  per pipeline rank); ``--DDP-impl torch`` (PyTorch DDP, its all-reduce under the backward) for the
  rows without a pipeline, ``local`` for the others.
- Megatron-LM's local DDP (``--DDP-impl local``: Table 1 from 39.1B, Table 2's PTD-P rows, Figs. 13
  and 16) all-reduced the data-parallel gradients after the last micro-batch's backward, not under
  it: its ``train_step`` (2021) called ``allreduce_gradients()`` after ``forward_backward_func``
  returned (``Layout.overlap_grad_reduce = False``).
- Table 2 (§5.2: the 174.6B and 529.6B models, DeepSpeed ZeRO-3 without model parallelism against
  PTD-P, batch fixed while the GPUs double). Columns: model-parallel size (1 for ZeRO-3; 96 = t 8 × p 12
  for 174.6B and 280 = t 8 × p 35 for 529.6B under PTD-P), batch, GPUs, micro-batch (ZeRO-3: 4, 2, 1
  per GPU, one micro-batch per step; PTD-P: 1) and TFLOP/s per GPU. Read from the paper's Table 2 as
  transcribed in two independent secondary sources (cli99/llm-analysis examples/megatron-lm/
  run_train.sh and run_train_zero.sh, which reproduce the table's training days, and a paper summary
  in the public code index); the (t, p) split of PTD-P is from the first (the table gives only the
  product).

Run ``python -m loomtrain.planner.published`` to print the comparison.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from typing import NamedTuple

from loomtrain.planner.arch import Architecture, gpt
from loomtrain.planner.memory import MIXED_ADAM, Layout
from loomtrain.planner.time import DGX_A100, step_time, tflops_per_gpu


class PublishedRun(NamedTuple):
    """One row: ``params_b`` (billions), ``heads``, ``hidden``, ``layers``, ``tp``, ``pp``, ``gpus``,
    ``batch`` (global, sequences), ``tflops`` (achieved TFLOP/s per GPU), ``micro_batch`` (``b``),
    ``zero_stage`` (3: DeepSpeed ZeRO-3 over all GPUs), ``table`` (where the row is from),
    ``virtual_stages`` (chunks per pipeline rank: above 1, the interleaved schedule) and
    ``torch_ddp`` (PyTorch DDP, whose all-reduce runs under the backward; else Megatron-LM's local
    DDP, after it)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    micro_batch: int = 1
    zero_stage: int = 0
    table: str = "Table 1"
    virtual_stages: int = 1
    torch_ddp: bool = False


MEGATRON_TABLE1 = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, micro_batch=16, torch_ddp=True),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, micro_batch=16, torch_ddp=True),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, micro_batch=16, torch_ddp=True),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, micro_batch=8, torch_ddp=True),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, micro_batch=4),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, micro_batch=2, virtual_stages=3),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, micro_batch=2, virtual_stages=2),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, virtual_stages=2),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, virtual_stages=3),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)  # micro-batch, virtual stages and DDP: Megatron-LM examples/sc21/run_table_1.sh
_175B, _530B = (174.6, 96, 12288, 96), (529.6, 128, 20480, 105)
MEGATRON_TABLE2 = (
    PublishedRun(*_175B, 1, 1, 384, 1536, 144, 4, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_175B, 1, 1, 768, 1536, 88, 2, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_175B, 1, 1, 1536, 1536, 44, 1, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_530B, 1, 1, 640, 2560, 138, 4, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_530B, 1, 1, 1120, 2240, 98, 2, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_530B, 1, 1, 2240, 2240, 48, 1, 3, "Table 2 ZeRO-3"),
    PublishedRun(*_175B, 8, 12, 384, 1536, 153, table="Table 2 PTD-P"),
    PublishedRun(*_175B, 8, 12, 768, 1536, 149, table="Table 2 PTD-P"),
    PublishedRun(*_175B, 8, 12, 1536, 1536, 141, table="Table 2 PTD-P"),
    PublishedRun(*_530B, 8, 35, 560, 2240, 171, table="Table 2 PTD-P"),
    PublishedRun(*_530B, 8, 35, 1120, 2240, 167, table="Table 2 PTD-P"),
    PublishedRun(*_530B, 8, 35, 2240, 2240, 159, table="Table 2 PTD-P"),
)
MEGATRON_RUNS = MEGATRON_TABLE1 + MEGATRON_TABLE2

# The runs' cluster: DGX A100 (time.DGX_A100's measured links and elementwise rate) with the GEMM
# ceiling that the software of the runs' time reached, not today's: 230 TFLOP/s fp16 on an A100
# 80GB SXM with NGC PyTorch 22.07 in 2022, the nearest measurement to the 2021-22 runs found (Mu Li,
# github.com/mli/transformers-benchmarks README, "Matrix Multiplication FP32 / FP16 116 / 230", the
# best of n x n x n for n up to 8,192). DGX_A100's 267.9 is a 2024 measurement (CUDA 12.1) over a
# search of shapes; docs/planner.md gives the comparison with both.
SELENE = replace(
    DGX_A100,
    gemm_efficiency=230e12 / DGX_A100.device.peak_flops_per_s,
    name="selene-2022",
    source=DGX_A100.source + "; GEMM 230 TFLOP/s fp16 (mli/transformers-benchmarks, NGC 22.07)",
)


class HeldOutRun(NamedTuple):
    """A published iteration time the model was not built or tuned on: Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models" (MLSys 2023, arXiv:2205.05198), Table 3
    (shapes and layouts) and Table 5 (seconds per iteration), on Selene (DGX A100 80 GB), sequence
    2,048, vocabulary 51,200, tensor parallelism 8, the interleaved schedule with 3 chunks for 175B
    and 530B, no data parallelism except the §6.3 530B run on 2,240 GPUs (its all-reduce not
    overlapped). ``recompute``: ``"full"`` (tensor parallelism alone, the paper's baseline) or
    ``"selective"`` (with sequence parallelism, "present work"). Table 5 agrees with the authors'
    Megatron-LM README of 2022-05-19 (MFU and HFU)."""

    name: str
    heads: int
    hidden: int
    layers: int
    pp: int
    dp: int
    batch: int
    micro_batch: int
    virtual_stages: int
    recompute: str
    seconds: float


_22B, _K175, _K530, _1T = (64, 6144, 48, 1), (96, 12288, 96, 8), (128, 20480, 105, 35), (160, 25600, 128, 64)
KORTHIKANTI_TABLE5 = tuple(
    HeldOutRun(name, *shape, dp, batch, b, v, recompute, seconds)
    for name, shape, dp, batch, b, v, (full, selective) in (
        ("22B", _22B, 1, 4, 4, 1, (1.42, 1.10)),
        ("175B", _K175, 1, 64, 1, 3, (18.13, 13.75)),
        ("530B", _K530, 1, 280, 1, 3, (49.05, 37.83)),
        ("1T", _1T, 1, 512, 1, 1, (94.42, 71.49)),
        ("530B dp 8", _K530, 8, 2240, 1, 3, (None, 39.15)),
    )
    for recompute, seconds in (("full", full), ("selective", selective))
    if seconds is not None
)


def megatron_layout(dp: int, tp: int, pp: int, n_micro: int, micro_batch: int = 1, zero_stage: int = 0,
                    virtual_stages: int = 1, torch_ddp: bool = False) -> Layout:  # fmt: skip
    """A layout as Narayanan et al. ran it: sequence 2,048, full recomputation, fp16 mixed-precision
    Adam, 1F1B (interleaved with ``virtual_stages > 1``), the data-parallel all-reduce under the
    backward with ``torch_ddp``, after it otherwise (module docstring); ZeRO without loomtrain's
    parameter copies (``Layout.zero_gather_copies``: DeepSpeed's are not known) and with DeepSpeed's
    prefetch of one weight ahead (``Layout.zero3_prefetch``), apex's fused Adam
    (``Layout.fused_optimizer``), the first micro-batch's gradients written (``zeroed_grad_buffers``
    False: how Megatron-LM 2021 held them is not modelled)."""
    schedule = "interleaved_1f1b" if virtual_stages > 1 else "1f1b"
    return Layout(seq_len=2048, micro_batch=micro_batch, dp=dp, tp=tp, pp=pp, n_micro=n_micro, recompute="full",
                  precision=MIXED_ADAM, zero_stage=zero_stage, schedule=schedule, virtual_stages=virtual_stages,
                  overlap_grad_reduce=torch_ddp, zero_gather_copies=False, fused_optimizer=True,
                  zeroed_grad_buffers=False, zero3_prefetch="weight")  # fmt: skip


def layout_of(run: PublishedRun, micro_batch: int | None = None) -> Layout:
    """The :func:`megatron_layout` of a row: ``dp = gpus / (tp · pp)``, ``n_micro = batch / (dp · b)``
    with ``b`` the row's micro-batch unless ``micro_batch`` is given, the row's ZeRO stage over all of
    ``dp`` (DeepSpeed's ZeRO-3 rows have no data-parallel all-reduce: their reduce-scatters are
    priced with ZeRO-3's gathers), schedule and DDP.

    Raises:
        ValueError: the GPUs or the batch do not divide as the row needs.
    """
    micro_batch = micro_batch or run.micro_batch
    dp = run.gpus // (run.tp * run.pp)
    if dp * run.tp * run.pp != run.gpus or run.batch % (dp * micro_batch):
        raise ValueError(f"{run}: gpus must divide by tp·pp and batch by dp·micro_batch={micro_batch}")
    n_micro = run.batch // (dp * micro_batch)
    return megatron_layout(dp, run.tp, run.pp, n_micro, micro_batch, run.zero_stage, run.virtual_stages, run.torch_ddp)


def held_out_layout(run: HeldOutRun) -> Layout:
    """The layout of a :class:`HeldOutRun`: tensor parallelism 8, Megatron sequence parallelism with
    selective recomputation, fp16 mixed-precision Adam, 1F1B (interleaved with ``virtual_stages > 1``),
    the data-parallel all-reduce after the backward (§6.3: "we do not use any overlapping"), the
    tensor-parallel collectives of the backward under the weight-gradient GEMMs (§6: "we overlap
    all-reduce communication with the linear weight's gradient computation"), apex's fused Adam."""
    return Layout(seq_len=2048, micro_batch=run.micro_batch, dp=run.dp, tp=8, pp=run.pp,
                  n_micro=run.batch // (run.dp * run.micro_batch), recompute=run.recompute,
                  sequence_parallel=run.recompute == "selective", precision=MIXED_ADAM,
                  schedule="interleaved_1f1b" if run.virtual_stages > 1 else "1f1b",
                  virtual_stages=run.virtual_stages, overlap_grad_reduce=False, overlap_tp_backward=True,
                  fused_optimizer=True, zeroed_grad_buffers=False)  # fmt: skip


def held_out_errors(runs: tuple[HeldOutRun, ...] = KORTHIKANTI_TABLE5) -> list[float]:
    """Relative throughput error of each held-out run, ``published seconds / predicted seconds - 1``
    (positive: predicted faster, the sign of :func:`errors`)."""
    return [run.seconds / step_time(_arch(run), held_out_layout(run), SELENE).total - 1 for run in runs]


def _arch(run: PublishedRun | HeldOutRun) -> Architecture:
    return gpt(run.layers, run.hidden, run.heads)


def predict(run: PublishedRun) -> float:
    """Predicted TFLOP/s per GPU of ``run`` on :data:`SELENE`."""
    return tflops_per_gpu(_arch(run), layout_of(run), SELENE)


def errors(runs: tuple[PublishedRun, ...] = MEGATRON_RUNS) -> list[float]:
    """Relative error ``(predicted - published) / published`` of each row."""
    return [(predict(run) - run.tflops) / run.tflops for run in runs]


def mape(relative_errors: list[float]) -> float:
    """Mean absolute percentage error, percent."""
    return 100 * sum(abs(e) for e in relative_errors) / len(relative_errors)


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two equally long sequences (Kendall, "A New Measure of Rank Correlation",
    Biometrika 1938): (concordant − discordant) pairs over all pairs; a tie in either counts as neither.

    Raises:
        ValueError: lengths differ or fewer than 2 items.
    """
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"kendall_tau needs two sequences of one length >= 2 (got {len(a)} and {len(b)})")
    signs = [(a[i] - a[j]) * (b[i] - b[j]) for i, j in itertools.combinations(range(len(a)), 2)]
    return (sum(s > 0 for s in signs) - sum(s < 0 for s in signs)) / len(signs)


def separated_tau(predicted: list[float], rounds: list[list[float]]) -> tuple[float, int]:
    """Kendall's τ-a (:func:`kendall_tau`) of ``predicted`` against the measurements, over the
    pairs the measurements order on their own: those where every round of one item (``rounds[i]``,
    one measured value per round) is below every round of the other. A pair whose rounds
    interleave is within the measurement's own noise; its order is a coin toss. Returns τ over
    the separated pairs (by their measured medians) and their number.

    Raises:
        ValueError: lengths differ, an item without rounds, or no separated pair.
    """
    if len(predicted) != len(rounds) or not all(rounds):
        raise ValueError(f"separated_tau needs one non-empty list of rounds per prediction (got {len(predicted)} "
                         f"predictions, {len(rounds)} lists)")  # fmt: skip
    pairs = [(i, j) for i, j in itertools.combinations(range(len(rounds)), 2)
             if max(rounds[i]) < min(rounds[j]) or max(rounds[j]) < min(rounds[i])]  # fmt: skip
    if not pairs:
        raise ValueError("no pair of items is separated by its measurements: τ is undefined")
    median = [statistics.median(r) for r in rounds]
    signs = [(predicted[i] - predicted[j]) * (median[i] - median[j]) for i, j in pairs]
    return (sum(s > 0 for s in signs) - sum(s < 0 for s in signs)) / len(pairs), len(pairs)


def between_rounds_tau(rounds: list[list[float]]) -> float:
    """How well the measurement agrees with itself: the mean Kendall τ-a (:func:`kendall_tau`)
    between every two rounds' orders of the items (``rounds[i]``: item ``i``'s value in each
    round). Where the rounds order the items at τ 0.4 against one another, a prediction's τ against
    their median measures that noise as much as the prediction (the median of the rounds is steadier
    than one round, so this is a guide, not a ceiling).

    Raises:
        ValueError: items with different numbers of rounds, fewer than 2 rounds or 2 items.
    """
    counts = {len(r) for r in rounds}
    if len(counts) != 1 or counts.pop() < 2:
        raise ValueError(f"between_rounds_tau needs the same number (>= 2) of rounds for every item "
                         f"(got {[len(r) for r in rounds]})")  # fmt: skip
    columns = list(zip(*rounds, strict=True))
    return statistics.fmean(kendall_tau(list(a), list(b)) for a, b in itertools.combinations(columns, 2))


def constant_predictor_errors(runs: tuple[PublishedRun, ...] = MEGATRON_RUNS) -> list[float]:
    """Relative errors of the best constant guess that knows the answers: the constant ``c`` that
    minimises the MAPE ``Σ |c - y|/y``, a weighted median of the published values ``y`` (weights
    ``1/y``); the minimum of a convex piecewise-linear function lies at one of the ``y``."""
    best = min((run.tflops for run in runs), key=lambda c: sum(abs(c - r.tflops) / r.tflops for r in runs))
    return [(best - run.tflops) / run.tflops for run in runs]


def table_rows(runs: tuple[PublishedRun, ...] = MEGATRON_RUNS) -> list[dict]:
    """One dict per row: the published figures, the prediction and the relative error."""
    return [
        {"table": r.table, "params_b": r.params_b, "tp": r.tp, "pp": r.pp, "gpus": r.gpus, "batch": r.batch,
         "micro_batch": r.micro_batch, "zero_stage": r.zero_stage, "published_tflops": r.tflops,
         "predicted_tflops": round(predict(r), 1), "error": round((predict(r) - r.tflops) / r.tflops, 4)}
        for r in runs
    ]  # fmt: skip


def held_out_rows(runs: tuple[HeldOutRun, ...] = KORTHIKANTI_TABLE5) -> list[dict]:
    """One dict per held-out run: its layout, published and predicted seconds per iteration, error."""
    return [
        {"model": r.name, "recompute": r.recompute, "pp": r.pp, "dp": r.dp, "batch": r.batch,
         "micro_batch": r.micro_batch, "published_s": r.seconds, "predicted_s": round(r.seconds / (1 + e), 2),
         "error": round(e, 4)}
        for r, e in zip(runs, held_out_errors(runs), strict=True)
    ]  # fmt: skip


def main() -> None:
    """Print Tables 1 and 2 beside the predictions, then the MAPE of the model and of the constant predictor."""
    print("| table | params (B) | t | p | GPUs | batch | b | published TFLOP/s | predicted | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in table_rows():
        print(f"| {row['table']} | {row['params_b']} | {row['tp']} | {row['pp']} | {row['gpus']} | {row['batch']} | "
              f"{row['micro_batch']} | {row['published_tflops']:.0f} | {row['predicted_tflops']:.1f} | "
              f"{100 * row['error']:+.1f} % |")  # fmt: skip
    errs = errors()
    worst = max(errs, key=abs)
    print("\n| held out: Korthikanti Table 5 | recompute | p | d | published s | predicted s | error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in held_out_rows():
        print(f"| {row['model']} | {row['recompute']} | {row['pp']} | {row['dp']} | {row['published_s']:.2f} | "
              f"{row['predicted_s']:.2f} | {100 * row['error']:+.1f} % |")  # fmt: skip
    held = held_out_errors()
    print(f"held-out MAPE {mape(held):.1f} % (worst {100 * max(held, key=abs):+.1f} %)")
    print(f"{len(errs)}-row MAPE {mape(errs):.1f} % (worst row {100 * worst:+.1f} %); "
          f"best constant predictor MAPE {mape(constant_predictor_errors()):.1f} %")  # fmt: skip


if __name__ == "__main__":
    main()
