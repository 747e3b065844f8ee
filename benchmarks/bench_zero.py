"""Our ZeRO vs torch's: stage 1 vs ``ZeroRedundancyOptimizer`` (with DDP), stage 2 vs FSDP2
with ``reshard_after_forward=False``, stage 3 vs FSDP2 (``fully_shard``).

Same model (8 layers × width 512 by default, 25.4 M parameters), same data, AdamW, global-norm
clipping at 1.0, fp32, gloo, world sizes 2 and 4. Ours and the peer run in the same processes,
interleaved in rounds, so machine noise hits both alike. Per stage and world size the result
holds both median step times (a step lasts until its slowest rank finishes), their ratio
(ours / peer; lower is better) and each one's per-rank peak model-state bytes (parameters,
gradients and optimizer state held after the optimizer step, distinct storages); ours also
reports the bytes its collectives' buffer pool holds between steps (``BufferPool``).

Stage 2's peer: torch has no ZeRO-2 proper. FSDP2 without resharding after forward (FSDP1's
SHARD_GRAD_OP) communicates as ZeRO-2 does (gradients reduce-scattered, parameters gathered
once per step) but frees the full parameters after backward, so it holds less model state
between steps than ZeRO-2, which keeps them (Rajbhandari et al. 2020, §5.2: P_os+g).

Writes ``benchmarks/results/zero.json`` and prints every stage's ratio last.

    python benchmarks/bench_zero.py [--rounds 5 --steps 3 --layers 8 --dim 512 --batch 2]
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from loomtrain.config import ModelConfig
from loomtrain.distributed.spawn import spawn
from loomtrain.distributed.sync import model_state_bytes
from loomtrain.distributed.zero import apply_zero
from loomtrain.models import Transformer

RESULTS = Path(__file__).resolve().parent / "results" / "zero.json"
PEERS = {1: "zero_redundancy_optimizer", 2: "fsdp2_no_reshard_after_forward", 3: "fsdp2"}
LR = 1e-4


class Impl:
    """A model, optimizer and step function; ``peak`` is the largest model-state bytes seen."""

    def __init__(self, net, model, opt, sync=None, state_opt=None):
        self.net, self.model, self.opt, self.sync = net, model, opt, sync
        self.state_opt = state_opt or opt
        self.peak = self.pool_bytes = 0

    def step(self, tokens: torch.Tensor) -> None:
        loss = F.cross_entropy(self.net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if self.sync is not None:
            self.sync.finish_gradient_sync()
            self.sync.prepare_step(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if self.sync is not None:
            self.sync.after_step()
            self.sync.zero_grad()
            self.peak = sum(self.sync.state_bytes().values())
            self.pool_bytes = self.sync.buffers.nbytes
        else:
            params = list(self.model.parameters())
            held = model_state_bytes(params, [p.grad for p in params], self.state_opt)
            self.peak = max(self.peak, sum(held.values()))
            self.opt.zero_grad()


def build(impl: str, stage: int, cfg: ModelConfig) -> Impl:
    torch.manual_seed(0)
    model = Transformer(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    if impl == "ours":
        sync = apply_zero(model, mesh["dp"], stage, model.layers.values())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        sync.attach_optimizer(opt)
        return Impl(model, model, opt, sync)
    if stage > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=stage == 3)
        return Impl(model, model, torch.optim.AdamW(model.parameters(), lr=LR))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return Impl(DDP(model), model, opt, state_opt=opt.optim)


def worker(stage: int, args: dict) -> dict:
    cfg = ModelConfig(n_layers=args["layers"], n_heads=8, dim=args["dim"], max_seq_len=64, vocab_size=65)
    impls = {name: build(name, stage, cfg) for name in ("ours", "peer")}

    def run(impl: Impl):
        def one_step(i: int) -> None:
            g = torch.Generator().manual_seed(i * 100 + dist.get_rank())
            impl.step(torch.randint(0, cfg.vocab_size, (args["batch"], cfg.max_seq_len + 1), generator=g))

        return one_step

    runs = {name: run(impl) for name, impl in impls.items()}
    for one_step in runs.values():
        one_step(0)  # warm-up
    times = interleaved_rounds(runs, args["rounds"], args["steps"])
    peaks = torch.tensor([impls["ours"].peak, impls["peer"].peak], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return {"times": times, "ours_state_bytes": int(peaks[0]), "peer_state_bytes": int(peaks[1]),
            "ours_pool_bytes": impls["ours"].pool_bytes}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = vars(p.parse_args())
    result: dict = {"backend": "gloo", "dtype": "fp32", "config": args, "torch": torch.__version__}
    for world in args["worlds"]:
        for stage in args["stages"]:
            r = spawn(worker, world, stage, args, timeout_s=1800)[0]
            ours, peer = statistics.median(r["times"]["ours"]), statistics.median(r["times"]["peer"])
            result[f"world_{world}_stage_{stage}"] = {
                "peer": PEERS[stage], "ours_step_s": ours, "peer_step_s": peer, "ratio": ours / peer,
                "ours_state_bytes": r["ours_state_bytes"], "peer_state_bytes": r["peer_state_bytes"],
                "ours_pool_bytes": r["ours_pool_bytes"],
                "steps_timed_each": len(r["times"]["ours"]),
            }  # fmt: skip
            print(
                f"world {world} stage {stage}: ours {ours:.3f} s/step, {PEERS[stage]} {peer:.3f} s/step, "
                f"ratio {ours / peer:.3f}; state bytes/rank ours {r['ours_state_bytes']:,}, "
                f"peer {r['peer_state_bytes']:,}"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for key, r in result.items():
        if key.startswith("world_"):
            print(f"{key}: ratio (ours / {r['peer']}) {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
