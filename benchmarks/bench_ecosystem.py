"""Activation checkpointing and ``torch.compile``: what each costs and what it buys, on the
default job's model and on a wider one, data parallel over 2 processes (gloo, fp32, CPU).

Activation memory: the bytes one micro-batch's forward (model and loss) leaves saved for
backward on a rank, counted exactly (``SavedTensorCounter``: distinct storages, parameters and
buffers excluded), per ``training.activation_checkpointing`` mode, and one block's share
against :func:`~loomtrain.models.parallelize.block_activation_bytes`.

Step time: AdamW steps (global-norm clipping at 1.0) of the three modes, then of the eager
and the compiled model (``training.compile``, no recomputation), each set interleaved in
rounds of alternating order (``timing.py``); median seconds of the slowest rank, ratios to
``none`` (recomputation's cost) and compiled tokens/s over eager tokens/s; and the median CPU
seconds of a step (the busiest rank's process, all threads), which other jobs on a shared
machine disturb less than wall time. The compiled model's
first step, which compiles, is timed on its own, with an empty inductor cache (a cold compile,
as on a fresh machine; a warm cache makes it several times shorter). Writes ``benchmarks/results/ecosystem.json``.

    python benchmarks/bench_ecosystem.py [--rounds 3 --steps 4 --wide-dim 512 --wide-layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from timing import interleaved_rounds

from loomtrain.config import Config, load_config
from loomtrain.distributed.activation_checkpoint import SavedTensorCounter
from loomtrain.distributed.data_parallel import AllReduceHook
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.distributed.parallel_model import ParallelModel
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.models.parallelize import block_activation_bytes, parallelize_llama
from loomtrain.trainer import train_step

RESULTS = Path(__file__).resolve().parent / "results" / "ecosystem.json"
CPU = torch.device("cpu")
MODES = ("none", "full", "selective")
# The default job (configs/shakespeare_char.toml): its model and batch; 65 characters.
DEFAULT_JOB = ["--model.n_layers=4", "--model.n_heads=4", "--model.dim=128", "--model.max_seq_len=64",
               "--model.vocab_size=65", "--training.seq_len=64", "--training.global_batch_size=12",
               "--training.micro_batch_size=6"]  # fmt: skip


class Run:
    """One parallelized model with its optimizer and this rank's fixed micro-batches."""

    def __init__(self, overrides: list[str]):
        self.cfg: Config = load_config(None, overrides)
        dims = ParallelDims.from_config(self.cfg.parallel, dist.get_world_size())
        torch.manual_seed(0)
        self.model = Transformer(self.cfg.model)
        self.pm: ParallelModel = parallelize_llama(self.model, dims, self.cfg, AllReduceHook())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.pm.sync.attach_optimizer(self.optimizer)
        t, m = self.cfg.training, self.cfg.model
        per_rank = t.global_batch_size // dims.dp
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        tokens = torch.randint(0, m.vocab_size, (per_rank, t.seq_len + 1), generator=gen)
        self.micro = [(x[:, :-1], x[:, 1:]) for x in tokens.split(t.micro_batch_size)]
        self.cpu_s: list[float] = []  # CPU seconds of this process (all threads) per step

    def step(self) -> None:
        start = time.process_time()
        train_step(self.pm, self.optimizer, self.micro, self.cfg, CPU)
        self.cpu_s.append(time.process_time() - start)

    def saved_bytes(self) -> dict[str, int]:
        """Bytes one micro-batch's forward saves: whole model with loss, and its first block."""
        excluded = [*self.model.parameters(), *self.model.buffers()]
        x, y = self.micro[0]
        with SavedTensorCounter(excluded) as whole:
            self.pm.loss(x, y)
        h = torch.randn(*x.shape, self.cfg.model.dim, requires_grad=True)
        with SavedTensorCounter(excluded) as block:
            self.model.layers["0"](h, self.model.rope_cos, self.model.rope_sin)
        return {"model_bytes": whole.bytes, "block_bytes": block.bytes}


def _timed(runs: dict[str, Run], rounds: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds per step (slowest rank) and median CPU seconds per step (the
    busiest rank's process, all threads: less sensitive than wall time to other jobs on the
    machine) of each run, interleaved."""
    for run in runs.values():
        run.step()  # warm-up: allocations, optimizer state
        run.cpu_s.clear()
    times = interleaved_rounds({name: lambda i, run=run: run.step() for name, run in runs.items()}, rounds, steps)
    cpu = torch.tensor([statistics.median(run.cpu_s) for run in runs.values()])
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return {name: statistics.median(t) for name, t in times.items()}, dict(zip(runs, cpu.tolist(), strict=True))


def measure_recomputation(model: list[str], rounds: int, steps: int) -> dict:
    runs = {mode: Run([*model, f"--training.activation_checkpointing={mode}"]) for mode in MODES}
    memory = {mode: run.saved_bytes() for mode, run in runs.items()}
    cfg = runs["none"].cfg
    for mode in MODES:
        memory[mode]["block_formula_bytes"] = block_activation_bytes(cfg, mode)
    seconds, cpu = _timed(runs, rounds, steps)
    return {"memory": memory, "step_s": seconds, "step_ratio_to_none": {m: seconds[m] / seconds["none"] for m in MODES},
            "step_cpu_s": cpu, "cpu_ratio_to_none": {m: cpu[m] / cpu["none"] for m in MODES}}  # fmt: skip


def measure_compile(model: list[str], rounds: int, steps: int) -> dict:
    runs = {"eager": Run(model), "compiled": Run([*model, "--training.compile=true"])}
    dist.barrier()
    start = time.perf_counter()
    runs["compiled"].step()  # compiles the block's forward and backward
    first = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    seconds, cpu = _timed(runs, rounds, steps)
    t = runs["eager"].cfg.training
    tokens = {name: t.global_batch_size * t.seq_len / s for name, s in seconds.items()}
    return {"first_compiled_step_s": first.item(), "step_s": seconds, "tokens_per_s": tokens,
            "compiled_over_eager_tokens_per_s": tokens["compiled"] / tokens["eager"], "step_cpu_s": cpu,
            "eager_over_compiled_cpu_s": cpu["eager"] / cpu["compiled"]}  # fmt: skip


def worker(args: argparse.Namespace) -> dict:
    wide = [*DEFAULT_JOB, f"--model.dim={args.wide_dim}", f"--model.n_layers={args.wide_layers}",
            f"--model.n_heads={args.wide_heads}"]  # fmt: skip
    out = {}
    for name, model in (("default_job", DEFAULT_JOB), ("wide", wide)):
        out[name] = {
            "recomputation": measure_recomputation(model, args.rounds, args.steps),
            "compile": measure_compile(model, args.rounds, args.steps),
        }
    return out


def _print(result: dict) -> None:
    for name, r in result.items():
        rec, comp = r["recomputation"], r["compile"]
        for mode in MODES:
            mem = rec["memory"][mode]
            print(f"{name:>11} {mode:>9}: {mem['model_bytes']:>11,} B saved per micro-batch, block "
                  f"{mem['block_bytes']:>9,} B (formula {mem['block_formula_bytes']:>9,}), step "
                  f"{rec['step_s'][mode] * 1e3:7.1f} ms = {rec['step_ratio_to_none'][mode]:.2f}x none, CPU "
                  f"{rec['cpu_ratio_to_none'][mode]:.2f}x")  # fmt: skip
        print(f"{name:>11}   compile: first step {comp['first_compiled_step_s']:.1f} s; eager "
              f"{comp['tokens_per_s']['eager']:,.0f} tok/s, compiled {comp['tokens_per_s']['compiled']:,.0f} tok/s: "
              f"{comp['compiled_over_eager_tokens_per_s']:.2f}x; CPU per step eager/compiled "
              f"{comp['eager_over_compiled_cpu_s']:.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wide-dim", type=int, default=512)
    parser.add_argument("--wide-layers", type=int, default=4)
    parser.add_argument("--wide-heads", type=int, default=8)
    args = parser.parse_args()
    # Two ranks on the machine's cores: one compile thread each, not a pool of workers per rank.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="loomtrain-inductor-") as cache:
        # An empty inductor cache: the first compiled step is a cold compile, as on a fresh machine.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        result = spawn(worker, 2, args, timeout_s=3600)[0]
    _print(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**result, "config": vars(args), "world_size": 2}, indent=2))


if __name__ == "__main__":
    main()
