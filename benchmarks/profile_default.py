"""Where a default-job step goes: ``train()`` under cProfile on rank 0, per step, by piece.

Runs the default job (``configs/shakespeare_char.toml``, no evaluation before the last step, no
checkpoint, no sample) on ``--nproc`` spawned gloo processes, one torch thread each, the global
batch split over them, for ``--steps`` steps with rank 0 under ``cProfile``. Prints the
milliseconds per step spent inside each piece of the loop (cumulative time of the function
that does it, over the steps), and the profiler's own wall time per step; cProfile slows
Python-heavy code, so compare pieces within a run, not with unprofiled tokens/s. Writes
``benchmarks/results/profile_default_<nproc>.json``.

    python benchmarks/profile_default.py [--nproc 2 --steps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
from pathlib import Path

import torch
from bench_default import rank_config

from loomtrain.distributed.spawn import spawn
from loomtrain.trainer import train

ROOT = Path(__file__).resolve().parent.parent
# piece -> (file suffix, function name): the function whose cumulative time is the piece's.
PIECES = {
    "train_step": ("loomtrain/trainer.py", "train_step"),
    "forward_backward": ("distributed/parallel_model.py", "forward_backward"),
    "forward_loss": ("distributed/parallel_model.py", "loss"),
    "gradient_sync_wait": ("distributed/data_parallel.py", "finish_gradient_sync"),
    "gradient_hooks": ("distributed/data_parallel.py", "on_ready"),
    "clipping": ("distributed/data_parallel.py", "prepare_step"),
    "optimizer": ("torch/optim/adam.py", "step"),
    "preemption_check": ("distributed/preemption.py", "agreed"),
    "logged_steps": ("loomtrain/trainer.py", "_log_step"),
    "data": ("data/loader.py", "next_step"),
}


def profiled_run(steps: int, stats_path: str, out_dir: str) -> None:
    """Rank 0's cProfile of one default-job run, dumped to ``stats_path``."""
    torch.set_num_threads(1)
    cfg = rank_config(steps, out_dir)
    profile = cProfile.Profile()
    profile.enable()
    train(cfg)
    profile.disable()
    if torch.distributed.get_rank() == 0:
        profile.dump_stats(stats_path)


def per_step_ms(stats_path: str, steps: int) -> dict[str, float]:
    """Milliseconds per step of each of ``PIECES`` (0 for one not called)."""
    table = pstats.Stats(stats_path).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    out = {}
    for piece, (suffix, name) in PIECES.items():
        cum = sum(v[3] for (file, _, fn), v in table.items() if fn == name and file.endswith(suffix))
        out[piece] = 1e3 * cum / steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        stats = str(Path(tmp) / "rank0.prof")
        spawn(profiled_run, args.nproc, args.steps, stats, tmp, timeout_s=1200)
        result = {"nproc": args.nproc, "steps": args.steps, "ms_per_step": per_step_ms(stats, args.steps)}
    path = ROOT / "benchmarks" / "results" / f"profile_default_{args.nproc}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for piece, ms in result["ms_per_step"].items():
        print(f"{piece}: {ms:.2f} ms/step")


if __name__ == "__main__":
    main()
