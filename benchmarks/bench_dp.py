"""Our data parallelism vs torch DistributedDataParallel: median step time, world size 2, gloo.

Same model (the default Shakespeare "baby GPT", 0.8 M parameters, unless --dim/--layers say
otherwise), same data, same bucket size. The two run in the same processes, interleaved in
rounds, so machine noise hits both alike. Writes ``benchmarks/results/dp.json`` and prints
``ratio`` (ours / DDP; lower is better) last.

    python benchmarks/bench_dp.py [--rounds 6 --steps 25 --layers 4 --dim 128]
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
from torch.nn.parallel import DistributedDataParallel as DDP

from loomtrain.config import ModelConfig
from loomtrain.distributed.data_parallel import apply_data_parallel
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer

RESULTS = Path(__file__).resolve().parent / "results" / "dp.json"


def build(impl: str, cfg: ModelConfig, bucket_mb: float):
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if impl == "ours":
        sync = apply_data_parallel(model, dist.group.WORLD, bucket_mb)
        return model, opt, sync
    return DDP(model, bucket_cap_mb=bucket_mb), opt, None


def step(net, opt, sync, tokens: torch.Tensor) -> None:
    loss = F.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if sync is not None:
        sync.finish_gradient_sync()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    if sync is not None:
        sync.zero_grad()
    else:
        opt.zero_grad(set_to_none=False)


def worker(args: dict) -> dict:
    cfg = ModelConfig(n_layers=args["layers"], n_heads=4, dim=args["dim"], max_seq_len=64, vocab_size=65)

    def run(impl):
        def one_step(i: int) -> None:
            g = torch.Generator().manual_seed(i)
            step(*impl, torch.randint(0, cfg.vocab_size, (args["batch"], cfg.max_seq_len + 1), generator=g))

        return one_step

    runs = {name: run(build(name, cfg, args["bucket_mb"])) for name in ("ours", "ddp")}
    for one_step in runs.values():
        for i in range(3):  # warm-up
            one_step(i)
    return interleaved_rounds(runs, args["rounds"], args["steps"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=6, help="micro-batch per rank")
    p.add_argument("--bucket-mb", type=float, default=0.25)
    args = vars(p.parse_args())
    times = spawn(worker, 2, args, timeout_s=1200)[0]
    ours, ddp = statistics.median(times["ours"]), statistics.median(times["ddp"])
    result = {
        "ours_step_s": ours,
        "ddp_step_s": ddp,
        "ratio": ours / ddp,
        "world_size": 2,
        "backend": "gloo",
        "steps_timed_each": len(times["ours"]),
        "config": args,
        "torch": torch.__version__,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ours {ours * 1e3:.2f} ms/step, DDP {ddp * 1e3:.2f} ms/step (median of {len(times['ours'])} each)")
    print(f"ratio {ours / ddp:.3f}")


if __name__ == "__main__":
    main()
