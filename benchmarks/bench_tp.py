"""Tensor and sequence parallelism: bytes per transformer layer against the formulas, and our
tensor parallelism's step time against torch's DTensor ``parallelize_module``.

Bytes: one micro-batch (``b`` sequences of ``s`` tokens, width ``h``, fp32) forward and backward
through models of 1 and 2 layers; the difference is one layer's traffic, as recorded where
each collective is issued. Compared with

- Megatron tensor parallelism (Korthikanti et al. 2022, §4.2.2): 4 all-reduces of ``b·s·h``
  elements per layer (2 forward, 2 backward), i.e. ``8·b·s·h·(t−1)/t`` elements sent per rank;
- Megatron sequence parallelism: the same volume as 4 all-gathers and 4 reduce-scatters, plus
  the all-reduce of the two norm weights' gradients, ``2·2·h·(t−1)/t`` elements (each rank's
  norms saw a slice of the sequence, so their weight gradients are partial sums);
- Ulysses (Jacobs et al. 2023, §3.2): 4 all-to-alls forward (q, k, v, output) and 4 backward,
  each of the local ``b·(s/sp)·h`` tensor, of which ``(sp−1)/sp`` leaves the rank:
  ``8·b·s·h·(sp−1)/sp²`` elements per rank (the paper's ``4·b·s·h/sp`` per link, both directions).

Step time: tp = 2 on 2 processes, the same model (4 layers × width 512 by default), data and
AdamW step; ours (column/row linears, vocab-parallel embedding and cross-entropy) against
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` and torch's ``loss_parallel``;
interleaved rounds of alternating order (``timing.py``), median step seconds of the slowest
rank, ratio ours / torch (lower is better).
Writes ``benchmarks/results/tp.json`` and prints the step-time ratio last.

    python benchmarks/bench_tp.py [--rounds 5 --steps 4 --layers 4 --dim 512 --batch 4 --seq 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import interleaved_rounds
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from loomtrain.config import ModelConfig
from loomtrain.distributed.spawn import spawn
from loomtrain.distributed.tensor_parallel import vocab_parallel_cross_entropy
from loomtrain.distributed.traffic import Traffic
from loomtrain.models import Transformer
from loomtrain.models.parallelize import apply_tensor_parallel, apply_ulysses

RESULTS = Path(__file__).resolve().parent / "results" / "tp.json"
FP32 = 4


def _model_cfg(layers: int, dim: int, heads: int, seq: int, vocab: int) -> ModelConfig:
    return ModelConfig(n_layers=layers, n_heads=heads, dim=dim, max_seq_len=seq, vocab_size=vocab)


def _one_micro_batch_bytes(mode: str, layers: int, b: int, s: int, h: int) -> dict[str, int]:
    """Bytes this rank sent in one forward and backward of a ``layers``-layer model."""
    torch.manual_seed(0)
    model = Transformer(_model_cfg(layers, h, 8, s, 64))
    group, n, traffic = dist.group.WORLD, dist.get_world_size(), Traffic()
    tokens = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if mode == "ulysses":
        apply_ulysses(model, group, traffic=traffic)
        part = s // n
        cut = slice(dist.get_rank() * part, (dist.get_rank() + 1) * part)
        logits = model(x[:, cut], start_pos=cut.start)
        loss = F.cross_entropy(logits.flatten(0, 1), y[:, cut].flatten())
    else:
        apply_tensor_parallel(model, group, sequence_parallel=mode == "sequence_parallel", traffic=traffic)
        loss = vocab_parallel_cross_entropy(model(x), y, group, traffic)
    loss.backward()
    return traffic.snapshot()


def measure_bytes(b: int, s: int, h: int) -> list[dict]:
    rows = []
    n = dist.get_world_size()
    for mode, axis in (("tensor_parallel", "tp"), ("sequence_parallel", "tp"), ("ulysses", "sp")):
        one, two = (_one_micro_batch_bytes(mode, layers, b, s, h).get(axis, 0) for layers in (1, 2))
        per_layer = two - one
        if mode == "ulysses":
            formula = 8 * b * s * h * (n - 1) // (n * n) * FP32
        else:
            formula = 8 * b * s * h * (n - 1) // n * FP32
        if mode == "sequence_parallel":
            # Plus the all-reduce of the two norm weights' gradients (each rank saw a slice of the sequence).
            formula += 2 * 2 * h * (n - 1) // n * FP32
        rows.append({"mode": mode, "degree": n, "b": b, "s": s, "h": h, "measured_bytes_per_layer": per_layer,
                     "formula_bytes_per_layer": formula})  # fmt: skip
    return rows


class _Step:
    """One AdamW training step of a tensor-parallel model; ``loss_fn(logits, y)``."""

    def __init__(self, model, loss_fn, ctx=None):
        self.model, self.loss_fn, self.ctx = model, loss_fn, ctx
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.ctx is None:
            self.loss_fn(self.model(x), y).backward()
        else:
            with self.ctx():
                self.loss_fn(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()


def _ours(cfg: ModelConfig) -> _Step:
    torch.manual_seed(0)
    model = Transformer(cfg)
    group = dist.group.WORLD
    apply_tensor_parallel(model, group)
    return _Step(model, lambda logits, y: vocab_parallel_cross_entropy(logits, y, group))


def _torch_peer(cfg: ModelConfig) -> _Step:
    torch.manual_seed(0)
    model = Transformer(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan)
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return _Step(model, loss_fn, loss_parallel)


def time_steps(cfg: ModelConfig, b: int, rounds: int, steps: int) -> dict:
    impls = {"ours": _ours(cfg), "torch": _torch_peer(cfg)}
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.max_seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for step in impls.values():
        step(x, y)  # warm-up: allocations, first-touch of optimizer state
    runs = {name: lambda i, step=step: step(x, y) for name, step in impls.items()}
    times = interleaved_rounds(runs, rounds, steps)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(args: argparse.Namespace) -> dict:
    out = {"bytes": measure_bytes(args.batch, args.seq, args.dim)}
    if dist.get_world_size() == 2:
        cfg = _model_cfg(args.layers, args.dim, args.heads, args.seq, args.vocab)
        out["step"] = time_steps(cfg, args.batch, args.rounds, args.steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    rows, step = [], None
    for world in (2, 4):
        result = spawn(worker, world, args, timeout_s=1800)[0]
        rows += result["bytes"]
        step = result.get("step", step)
    for r in rows:
        print(
            f"{r['mode']:>18} degree {r['degree']}: {r['measured_bytes_per_layer']:>10,} bytes/layer measured, "
            f"{r['formula_bytes_per_layer']:>10,} by the formula"
        )
    ratio = step["ours"] / step["torch"]
    summary = {
        "bytes_per_layer": rows,
        "all_bytes_match_formula": all(r["measured_bytes_per_layer"] == r["formula_bytes_per_layer"] for r in rows),
        "step_time_tp2": {"ours_s": step["ours"], "torch_parallelize_module_s": step["torch"], "ratio": ratio},
        "config": vars(args),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))
    print(f"step time at tp=2: ours {step['ours']:.4f} s, torch {step['torch']:.4f} s")
    print(f"tp step-time ratio (ours / torch parallelize_module): {ratio:.3f}")


if __name__ == "__main__":
    main()
