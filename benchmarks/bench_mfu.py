"""Model FLOP utilisation of one device on a realistic Llama-style model (bf16 autocast, SDPA).

Times forward, backward and an AdamW step of one process on ``--device`` (on CUDA: the flash
SDPA kernel is required, so a silent fall-back to the math kernel fails the run instead of
lowering the figure). MFU = achieved model FLOP/s / device peak (Chowdhery et al., "PaLM"
2022, Appendix B), with ``models.flops.flops_per_token`` (forward + backward matmuls) and
``hardware.peak_flops_per_s`` (datasheet peak for known GPUs, a measured matmul peak
otherwise). Writes the JSON given by ``--out`` and prints MFU last.

    python benchmarks/bench_mfu.py --device cuda --layers 16 --dim 2048 --heads 16 --seq 2048 --batch 8
    python benchmarks/bench_mfu.py --device cpu --layers 2 --dim 64 --heads 4 --seq 64 --batch 2 --steps 2  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loomtrain.config import ModelConfig
from loomtrain.hardware import device_name, mfu, peak_flops_per_s, synchronize
from loomtrain.models import Transformer, count_params, flops_per_token

RESULTS = Path(__file__).resolve().parent / "results" / "mfu.json"


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        n_layers=args.layers, n_heads=args.heads, dim=args.dim, max_seq_len=args.seq, vocab_size=args.vocab
    )


def step_seconds(args: argparse.Namespace, device: torch.device) -> tuple[list[float], int]:
    """Seconds of each timed training step (after ``--warmup`` untimed ones), and the parameter count."""
    torch.manual_seed(0)
    model = Transformer(model_config(args)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    # On CUDA only the flash kernel is allowed: a fall-back would measure another code path.
    kernel = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()
    times = []
    for i in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        with kernel, torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, count_params(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    device = torch.device(args.device)
    times, n_params = step_seconds(args, device)
    seconds = statistics.median(times)
    tokens_per_s = args.batch * args.seq / seconds
    fpt = flops_per_token(model_config(args), args.seq)
    peak = peak_flops_per_s(device, torch.bfloat16)
    result = {
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "n_params": n_params,
        "median_step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "peak_flops_per_s": peak,
        "mfu": mfu(fpt, tokens_per_s, peak),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{result['device']}: {n_params / 1e6:.1f} M parameters, {seconds * 1e3:.1f} ms/step, "
          f"{tokens_per_s:,.0f} tokens/s")  # fmt: skip
    print(f"MFU {result['mfu']:.1%} of a {peak / 1e9:,.0f} GFLOP/s peak")


if __name__ == "__main__":
    main()
