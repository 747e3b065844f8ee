"""Published training runs the time model is checked against, and the comparison table.

Megatron-LM Table 1: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC 2021, arXiv:2104.04473), Table 1 (weak scaling on Selene, DGX A100 80 GB, 16-bit,
vocabulary 51,200, sequence 2,048, full activation recomputation; §5.1). The paper does not list
the micro-batch size or the schedule of these runs; the comparison takes ``b = 1`` and the
non-interleaved 1F1B schedule, and says so.

Run ``python -m loomtrain.planner.published`` to print the comparison.
"""

from __future__ import annotations

from typing import NamedTuple

from loomtrain.planner.arch import gpt
from loomtrain.planner.memory import MIXED_ADAM, Layout
from loomtrain.planner.time import DGX_A100, tflops_per_gpu


class PublishedRun(NamedTuple):
    """One row of Table 1: ``params_b`` (billions), ``heads``, ``hidden``, ``layers``, ``tp``, ``pp``,
    ``gpus``, ``batch`` (global, sequences) and ``tflops`` (achieved TFLOP/s per GPU)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float


MEGATRON_TABLE1 = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def layout_of(run: PublishedRun, micro_batch: int = 1) -> Layout:
    """The :class:`Layout` of a Table 1 row: ``dp = gpus / (tp · pp)``, ``n_micro = batch / (dp · b)``,
    1F1B, full recomputation, fp16 mixed-precision Adam.

    Raises:
        ValueError: the GPUs or the batch do not divide as the row needs.
    """
    dp = run.gpus // (run.tp * run.pp)
    if dp * run.tp * run.pp != run.gpus or run.batch % (dp * micro_batch):
        raise ValueError(f"{run}: gpus must divide by tp·pp and batch by dp·micro_batch={micro_batch}")
    n_micro = run.batch // (dp * micro_batch)
    return Layout(seq_len=2048, micro_batch=micro_batch, dp=dp, tp=run.tp, pp=run.pp, n_micro=n_micro,
                  recompute="full", precision=MIXED_ADAM)  # fmt: skip


def predict(run: PublishedRun) -> float:
    """Predicted TFLOP/s per GPU of ``run`` on :data:`~loomtrain.planner.time.DGX_A100`."""
    arch = gpt(run.layers, run.hidden, run.heads, name=f"gpt-{run.params_b}b")
    return tflops_per_gpu(arch, layout_of(run), DGX_A100)


def errors(runs: tuple[PublishedRun, ...] = MEGATRON_TABLE1) -> list[float]:
    """Relative error ``(predicted - published) / published`` of each row."""
    return [(predict(run) - run.tflops) / run.tflops for run in runs]


def mape(relative_errors: list[float]) -> float:
    """Mean absolute percentage error, percent."""
    return 100 * sum(abs(e) for e in relative_errors) / len(relative_errors)


def constant_predictor_errors(runs: tuple[PublishedRun, ...] = MEGATRON_TABLE1) -> list[float]:
    """Relative errors of the best constant guess that knows the answers: the mean published value."""
    mean = sum(run.tflops for run in runs) / len(runs)
    return [(mean - run.tflops) / run.tflops for run in runs]


def main() -> None:
    """Print Table 1 beside the predictions, then the MAPE of the model and of the constant predictor."""
    print("| params (B) | t | p | GPUs | batch | published TFLOP/s | predicted | error |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run, error in zip(MEGATRON_TABLE1, errors(), strict=True):
        print(f"| {run.params_b} | {run.tp} | {run.pp} | {run.gpus} | {run.batch} | {run.tflops:.0f} | "
              f"{predict(run):.1f} | {100 * error:+.1f} % |")  # fmt: skip
    worst = max(errors(), key=abs)
    print(f"MAPE {mape(errors()):.1f} % (worst row {100 * worst:+.1f} %); "
          f"constant predictor (mean) MAPE {mape(constant_predictor_errors()):.1f} %")  # fmt: skip


if __name__ == "__main__":
    main()
