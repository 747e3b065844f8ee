"""The planner's time model against real loomtrain runs on this machine (issue #19, "own runs").

For each configuration of :data:`CONFIGS` (world 2 and 4: data parallelism, ZeRO 1 and 3, tensor
parallelism, the pipeline, recomputation) it predicts the step time from a spec of this machine
(``loomtrain plan --calibrate --ranks N``, one per world size, measured afresh before each round, and
again as long as disturbed: :func:`quiet_spec`), then runs ``loomtrain train`` for :data:`STEPS`
steps and measures the median step time after :data:`WARMUP` steps (from the times of its
``metrics.jsonl`` records, one per step); the prediction is the median over the rounds' specs, the
measurement the median over the rounds' runs. The model is a Llama of :data:`MODEL` (large enough that
GEMMs, not Python overhead, dominate a step). Reported: each configuration's predicted and measured
seconds and their error, the mean absolute percentage error, and Kendall's τ between the predicted
and measured orders (Kendall 1938, τ-a: concordant minus discordant pairs over all pairs), beside the
τ between the rounds' own orders (how well the measurement agrees with itself). ``--parallel.auto``
at world 2 and 4 runs in every round too, among the configurations, on that round's spec: the
median of its runs against the fastest median of the grid at that world size.

    python benchmarks/planner_own_runs.py       # 28 minutes on the 2-core EPYC machine (2026-12-05)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loomtrain.config import load_config
from loomtrain.planner.arch import from_model_config
from loomtrain.planner.auto import vocab_size
from loomtrain.planner.calibrate import measure_spec
from loomtrain.planner.cluster import ClusterSpec
from loomtrain.planner.memory import Layout, precision_for
from loomtrain.planner.published import between_rounds_tau, kendall_tau, separated_tau
from loomtrain.planner.time import step_time

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
# Characters of the complete plays (the default job's tokenizer): the model's vocabulary.
MODEL = {"dim": 512, "n_heads": 8, "n_layers": 4, "max_seq_len": 128}
SEQ_LEN, GLOBAL_BATCH = 128, 16
STEPS, WARMUP = 12, 4
# Rounds in alternating order; the median of 3 stands when the machine drifts during one (dp 2
# measured 0.685 s in the first of two rounds and 0.752 s in the second, 2026-12-04 12:42).
ROUNDS = 3
# name: (world, overrides): each a layout loomtrain runs and the planner prices.
CONFIGS = {
    "dp2": (2, {}),
    "dp2_zero1": (2, {"data_parallel.zero_stage": 1}),
    "dp2_zero3": (2, {"data_parallel.zero_stage": 3}),
    "dp2_full_recompute": (2, {"training.activation_checkpointing": "full"}),
    "tp2": (2, {"parallel.tensor_parallel_degree": 2}),
    "pp2_1f1b_m4": (2, {"parallel.pipeline_parallel_degree": 2}),
    "dp4": (4, {"training.micro_batch_size": 2}),
    "tp2_dp2": (4, {"parallel.tensor_parallel_degree": 2}),
    "pp2_dp2": (4, {"parallel.pipeline_parallel_degree": 2, "training.micro_batch_size": 2}),
    "tp4": (4, {"parallel.tensor_parallel_degree": 4}),
}
# --parallel.auto at each world size of the grid: the planner picks the layout and micro-batch size.
AUTO = {f"auto{w}": (w, {"parallel.auto": "true", "training.micro_batch_size": None}) for w in (2, 4)}
# Layouts outside the benchmark's grid, run by name (``planner_own_runs.py sp2_mb2 sp2 sp2_mb8``): Ulysses
# at world 2 over the micro-batch sizes, which the planner once priced 25 % fast (sp 2 at micro-batch 8).
CHECKS = {
    "sp2_mb2": (2, {"parallel.sequence_parallel_degree": 2, "training.micro_batch_size": 2}),
    "sp2": (2, {"parallel.sequence_parallel_degree": 2}),
    "sp2_mb8": (2, {"parallel.sequence_parallel_degree": 2, "training.micro_batch_size": 8}),
}
KNOWN = {**CONFIGS, **CHECKS, **AUTO}


def base_overrides(steps: int = STEPS) -> dict:
    """The own-run job: :data:`MODEL`, one record per step, no evaluation, checkpoint or sample."""
    return {**{f"model.{k}": v for k, v in MODEL.items()}, "training.seq_len": SEQ_LEN,
            "training.global_batch_size": GLOBAL_BATCH, "training.micro_batch_size": 4, "training.steps": steps,
            "training.log_interval": 1, "training.eval_interval": steps + 1, "training.warmup_steps": 0,
            "checkpoint.enabled": "false", "sample.max_new_tokens": 0}  # fmt: skip


def layout_of(world: int, overrides: dict, vocab_size: int):
    """The planner's ``(Architecture, Layout)`` of one configuration."""
    cfg = load_config(CONFIG, [f"--{k}={v}" for k, v in {**base_overrides(), **overrides}.items()])
    cfg.model.vocab_size = vocab_size
    par, training = cfg.parallel, cfg.training
    tp, pp = par.tensor_parallel_degree, par.pipeline_parallel_degree
    dp = world // (tp * pp * par.sequence_parallel_degree)
    zero = cfg.data_parallel.zero_stage
    layout = Layout(seq_len=training.seq_len, micro_batch=training.micro_batch_size, dp=dp, tp=tp, pp=pp,
                    sp=par.sequence_parallel_degree, zero_stage=zero,
                    n_micro=training.global_batch_size // (dp * training.micro_batch_size),
                    schedule=par.pipeline_schedule, virtual_stages=par.virtual_stages,
                    recompute=training.activation_checkpointing, log_interval=training.log_interval,
                    precision=precision_for(training.dtype, zero))  # fmt: skip
    return from_model_config(cfg.model, "own-run"), layout


def run_step_seconds(world: int, overrides: dict, out_dir: str, name: str, where: list[str] | None = None,
                     env: dict[str, str] | None = None, steps: int = STEPS,
                     warmup: int = WARMUP) -> tuple[float, str]:  # fmt: skip
    """Median seconds per step of a real ``loomtrain train`` run, steps ``warmup``..``steps - 1``,
    and what it printed. ``where``: the launcher's placement arguments (default ``--nproc world``;
    e.g. ``--cluster NAME``); ``env``: variables added to the run's environment."""
    args = [f"--{k}={v}" for k, v in {**base_overrides(steps), **overrides}.items() if v is not None]
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", str(CONFIG), *(where or ["--nproc", str(world)]),
           "--overwrite", f"--run.out_dir={out_dir}", f"--run.name={name}", *args]  # fmt: skip
    done = subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True)  # fmt: skip
    records = [json.loads(line) for line in (Path(out_dir) / name / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "time" in r}
    return statistics.median(times[s] - times[s - 1] for s in range(warmup + 1, steps)), done.stdout


def auto_line(printed: str, label: str) -> str:
    """The launcher's ``chosen:`` or ``runner-up:`` line of ``--parallel.auto``."""
    return next(line.strip() for line in printed.splitlines() if line.strip().startswith(f"{label}:"))


def own_runs(names: list[str] | None = None, rounds: int = ROUNDS, auto: bool = False) -> dict:
    """Predicted and measured step seconds of each configuration (the median over ``rounds`` rounds,
    run in alternating order), their MAPE, Kendall τ and the rounds' τ among themselves; with
    ``auto``, ``--parallel.auto`` at each world size run in every round as well (:func:`auto_rows`)."""
    names, vocab, rows = [n for n in names or CONFIGS if n not in AUTO], vocab_size(load_config(CONFIG)), []
    layouts = {name: layout_of(*KNOWN[name], vocab) for name in names}
    worlds = sorted({KNOWN[n][0] for n in names})
    order = names + ([f"auto{w}" for w in worlds] if auto else [])
    measured: dict[str, list[float]] = {name: [] for name in order}
    predicted: dict[str, list[float]] = {name: [] for name in names}
    chosen: dict[str, list[str]] = {name: [] for name in order if name in AUTO}
    specs: dict[int, ClusterSpec] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(rounds):
            # Each round's spec measured just before its runs (the machine's speed drifts 10-20 % over
            # an afternoon, and calibrations an hour apart put the GEMM rate at 0.146 and 0.187 TFLOP/s
            # while the runs moved 1 %); cached, so --parallel.auto plans on this round's spec.
            specs = {w: quiet_spec(w, fallback=specs.get(w)) for w in worlds}
            clusters = {w: spec.to_cluster() for w, spec in specs.items()}
            for name in order if r % 2 == 0 else order[::-1]:
                seconds, printed = run_step_seconds(*KNOWN[name], out_dir, name)
                measured[name].append(seconds)
                if name in AUTO:
                    chosen[name].append(auto_line(printed, "chosen"))
                    print(f"round {r} {name}: measured {seconds:.3f} s ({chosen[name][-1]})", flush=True)
                    continue
                predicted[name].append(step_time(*layouts[name], clusters[KNOWN[name][0]]).total)
                print(f"round {r} {name}: predicted {predicted[name][-1]:.3f} s, measured {seconds:.3f} s", flush=True)
    for name in names:
        world = KNOWN[name][0]
        prediction, median = statistics.median(predicted[name]), statistics.median(measured[name])
        rows.append({"config": name, "world": world, "predicted_s": round(prediction, 4),
                     "predicted_each_round_s": [round(p, 4) for p in predicted[name]], "measured_s": round(median, 4),
                     "measured_each_round_s": [round(m, 4) for m in measured[name]],
                     "error": round(prediction / median - 1, 4)})  # fmt: skip
        print(f"{name:>20} world {world}: predicted {prediction:.3f} s, measured {median:.3f} s "
              f"({100 * (prediction / median - 1):+.1f} %)", flush=True)  # fmt: skip
    mape = statistics.fmean(abs(r["error"]) for r in rows)
    tau = kendall_tau([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    result = {"rows": rows, "mape": round(mape, 4), "kendall_tau": round(tau, 3), **separated(rows)}
    if rounds > 1:
        result["kendall_tau_between_rounds"] = round(between_rounds_tau([r["measured_each_round_s"] for r in rows]), 3)
    if auto:
        result["auto"] = auto_rows(rows, {name: (measured[name], chosen[name]) for name in chosen})
    return result


def quiet_spec(ranks: int, tries: int = 3, fallback: ClusterSpec | None = None) -> ClusterSpec:
    """This machine's spec of ``ranks`` ranks measured now and cached; measured again, up to ``tries``
    times, as long as the measurement was disturbed (a spec measured under load priced every layout
    20 % slow, 2026-12-04 13:22); after that ``fallback`` (the last round's spec), said so, where given.

    Raises:
        SystemExit: ``tries`` calibrations in a row were disturbed and there is no ``fallback``.
    """
    for _ in range(tries):
        spec, quiet = measure_spec(ranks)
        if quiet:
            return spec
    if fallback is not None:
        print(f"{tries} calibrations of {ranks} ranks were disturbed: this round keeps the last one's spec", flush=True)
        return fallback
    raise SystemExit(f"{tries} calibrations of {ranks} ranks were disturbed by other processes: rerun when quiet")


def separated(rows: list[dict]) -> dict:
    """Kendall τ over the pairs of ``rows`` whose measured rounds do not overlap
    (:func:`~loomtrain.planner.published.separated_tau`) and how many pairs that is, of all."""
    tau, pairs = separated_tau([r["predicted_s"] for r in rows], [r["measured_each_round_s"] for r in rows])
    return {"kendall_tau_separated": round(tau, 3), "separated_pairs": pairs,
            "pairs": len(rows) * (len(rows) - 1) // 2}  # fmt: skip


def auto_rows(rows: list[dict], runs: dict[str, tuple[list[float], list[str]]]) -> list[dict]:
    """``--parallel.auto`` against the grid: for each ``runs`` entry (``auto<world>``: its seconds and
    printed choice in each round), the median of its rounds against the fastest median of the
    configurations of ``rows`` at that world size, as a tokens/s ratio (the same tokens per step)."""
    out = []
    for name, (seconds, chosen) in runs.items():
        world, median = KNOWN[name][0], statistics.median(seconds)
        best = min((r for r in rows if r["world"] == world), key=lambda r: r["measured_s"])
        ratio = best["measured_s"] / median
        out.append({"world": world, "chosen_each_round": chosen, "measured_s": round(median, 4),
                    "measured_each_round_s": [round(s, 4) for s in seconds], "best_grid_config": best["config"],
                    "best_grid_measured_s": best["measured_s"],
                    "tokens_per_s_over_best_grid": round(ratio, 3)})  # fmt: skip
        each = ", ".join(f"{s:.3f}" for s in seconds)
        print(f"auto world {world}: {median:.3f} s (rounds {each}; {chosen[-1]}); best of the grid "
              f"{best['config']} {best['measured_s']:.3f} s: tokens/s ratio {ratio:.3f}", flush=True)  # fmt: skip
    return out


if __name__ == "__main__":
    unknown = [name for name in sys.argv[1:] if name not in KNOWN]
    if unknown:
        sys.exit(f"unknown configuration {', '.join(unknown)}: give names among {', '.join(KNOWN)}")
    result = own_runs(sys.argv[1:] or None, auto=not sys.argv[1:])
    print(f"MAPE {100 * result['mape']:.1f} %, Kendall tau {result['kendall_tau']:.3f}, between the rounds "
          f"{result.get('kendall_tau_between_rounds')}")  # fmt: skip
