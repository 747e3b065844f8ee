"""ZeRO 1-3 on top of 2D tensor parallelism: per-rank model-state bytes of dp 2 × 2D (q = 2, 8
gloo processes) at ZeRO stages 0-3 against the formula, and against stage 0 of the same run.

Each stage is a short training run of the trainer (``--steps`` steps); the figures are the run
summary's ``param_bytes``, ``grad_bytes`` and ``optim_bytes`` (the largest on any rank, counted
by the synchronizer: distinct storages at a step's end). The formula, per rank, in fp32 with
AdamW (two moments) and ``P_mat`` matrix elements and ``P_norm`` norm-weight elements in the
model: 2D holds ``E = P_mat/q² + P_norm/q`` elements (a norm weight is split over a grid row
only), ZeRO divides by ``dp`` the optimizer state from stage 1, the gradients from stage 2 and
the parameters at stage 3 (Rajbhandari et al. 2020, §5): params ``4E`` (``4E/dp`` at stage 3),
grads ``4E`` (``4E/dp`` from stage 2), optimizer ``8E`` (``8E/dp`` from stage 1) plus AdamW's
step counters (one 4-byte scalar per parameter tensor, not divided). The vocabulary must split
evenly over ``q`` and the widths over ``q·dp`` (the defaults do) for the formula to be exact.

Writes ``benchmarks/results/tp2d_zero.json`` and prints the stage-3 / stage-0 ratio of all
model state last.

    python benchmarks/bench_tp2d_zero.py [--dim 128 --layers 2 --heads 4 --steps 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from loomtrain.config import load_config
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.planner.auto import vocab_size

RESULTS = Path(__file__).resolve().parent / "results" / "tp2d_zero.json"
Q, DP = 2, 2
KEYS = ("param_bytes", "grad_bytes", "optim_bytes")


def overrides(args: argparse.Namespace, stage: int, out: str) -> list[str]:
    return [
        f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", f"--model.n_heads={args.heads}",
        "--model.max_seq_len=32", "--training.seq_len=32", "--training.micro_batch_size=2",
        "--training.global_batch_size=4", f"--training.steps={args.steps}", "--training.eval_interval=1000",
        "--sample.max_new_tokens=0", "--metrics.progress_bar=false", f"--checkpoint.interval={args.steps + 1}",
        f"--parallel.tensor_parallel_degree={Q * Q}", "--parallel.tp_mode=2d",
        f"--data_parallel.zero_stage={stage}", f"--run.out_dir={out}", f"--run.name=zero{stage}",
    ]  # fmt: skip


def run(cli: list[str]) -> dict:
    from loomtrain.trainer import train

    return train(load_config(None, cli))


def formula(args: argparse.Namespace, stage: int) -> dict[str, int]:
    """Per-rank bytes of the module docstring's formula."""
    cfg = load_config(None, overrides(args, stage, "unused"))
    model = Transformer(cfg.model.model_copy(update={"vocab_size": vocab_size(cfg)}))
    params = list(model.parameters())
    elements = sum(p.numel() // (Q * Q if p.dim() == 2 else Q) for p in params)
    steps = 4 * len(params)  # AdamW's step count per parameter, a float32 scalar on every rank
    return {
        "param_bytes": 4 * elements // (DP if stage == 3 else 1),
        "grad_bytes": 4 * elements // (DP if stage >= 2 else 1),
        "optim_bytes": 8 * elements // (DP if stage >= 1 else 1) + steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="loomtrain-bench-tp2d-zero-") as out:
        for stage in (0, 1, 2, 3):
            summary = spawn(run, Q * Q * DP, overrides(args, stage, out), timeout_s=600)[0]
            rows[stage] = {"measured": {k: summary[k] for k in KEYS}, "formula": formula(args, stage)}
    print(f"{'stage':>5} | {'params B':>9} | {'grads B':>9} | {'optimizer B':>11} | formula | total / stage 0")
    base = sum(rows[0]["measured"].values())
    for stage, row in rows.items():
        m = row["measured"]
        same = "equal" if m == row["formula"] else f"differs: {row['formula']}"
        ratio = sum(m.values()) / base
        sizes = f"{m['param_bytes']:>9,} | {m['grad_bytes']:>9,} | {m['optim_bytes']:>11,}"
        print(f"{stage:>5} | {sizes} | {same} | {ratio:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    layout = {"q": Q, "dp": DP, "world": Q * Q * DP, **vars(args)}
    RESULTS.write_text(json.dumps({"layout": layout, "stages": rows}, indent=1))
    print(f"stage-3 / stage-0 model state per rank: {sum(rows[3]['measured'].values()) / base:.3f}")


if __name__ == "__main__":
    main()
