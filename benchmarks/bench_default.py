"""The default job's speed against a plain PyTorch loop: is a second process worth a second core?

In one run, interleaved in rounds whose order alternates (so drifts in machine load hit each
alike), ``--steps`` steps each, one torch thread per process (as ``make train``):

- ``plain_b12``, ``plain_b6``: a plain single-process loop (nanoGPT-style: random windows of
  the training text, forward, backward, clipping, AdamW) of the same model at batch 12 and 6;
- ``loomtrain_1proc``: ``loomtrain train`` on the default config, one process, batch 12;
- ``loomtrain_2proc``: the same on two data-parallel processes, 6 samples per rank;
- ``ddp_2proc``: the plain loop at batch 6 on two processes wrapped in torch's
  ``DistributedDataParallel`` (gloo, its default 25 MiB buckets): the peer, what torch's own
  data parallelism makes of the same two cores;
- ``plain_b6_x2``: two plain loops at batch 6 at once, independent (no communication): the sum
  of their tokens/s is what two processes can reach on this machine at all, the ceiling for
  any 2-process data parallelism here.

Tokens/s: tokens trained from step ``WARMUP`` to the last step before the final one, over the
wall seconds between them, everything in the loop included (for loomtrain the times of its
``metrics.jsonl`` records, logged every 10 steps; the final step's evaluation and start-up
are outside the span on both sides). Per configuration the median over rounds. Writes
``benchmarks/results/default.json`` and prints, last, the 2-process run over the plain loop
at batch 12 (the number a user sees).

    python benchmarks/bench_default.py [--rounds 3 --steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from loomtrain.config import Config, load_config
from loomtrain.data.corpus import load_corpus
from loomtrain.data.tokenizer import build_tokenizer, encode_to_tensor
from loomtrain.distributed.spawn import free_port
from loomtrain.models import Transformer
from loomtrain.optim import build_optimizer, lr_at, set_lr

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
RESULTS = ROOT / "benchmarks" / "results" / "default.json"
WARMUP = 10
LAST_BEFORE_FINAL = 10  # steps before the final one of the last timed record (the log interval)
RUNS = {
    "plain_b12": ("plain", 12),
    "plain_b6": ("plain", 6),
    "loomtrain_1proc": (1, 12),
    "loomtrain_2proc": (2, 6),
    "ddp_2proc": ("ddp", 6),
    "plain_b6_x2": ("plain_x2", 6),
}


def plain_loop(batch: int, steps: int, ddp: bool = False) -> float:
    """Tokens/s of a plain loop of the default model at ``batch`` (this process, one thread);
    with ``ddp`` (a rank of ``torchrun``-style environment variables) the model is wrapped in
    ``DistributedDataParallel`` and the figure is the whole group's tokens/s seen by this rank."""
    torch.set_num_threads(1)
    cfg = load_config(CONFIG)
    train_text, val_text = load_corpus(cfg.data)
    tok = build_tokenizer(cfg.data.tokenizer, train_text + val_text, cfg.data.bpe_vocab_size)
    tokens = encode_to_tensor(tok, train_text)
    cfg.model.vocab_size = tok.vocab_size
    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg.training)
    world, rank = 1, 0
    if ddp:
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        model = DistributedDataParallel(model)
    seq, gen = cfg.training.seq_len, torch.Generator().manual_seed(rank)
    for step in range(steps - LAST_BEFORE_FINAL):  # the loomtrain runs' span
        if step == WARMUP:
            start = time.perf_counter()
        ix = torch.randint(len(tokens) - seq - 1, (batch,), generator=gen)
        window = torch.stack([tokens[i : i + seq + 1] for i in ix.tolist()])
        set_lr(opt, lr_at(step, cfg.training))
        loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rate = world * batch * seq * (steps - LAST_BEFORE_FINAL - WARMUP) / (time.perf_counter() - start)
    if ddp:
        dist.destroy_process_group()
    return rate


def job_overrides(steps: int, micro_batch: int) -> list[str]:
    """The default job for ``steps`` steps at ``micro_batch`` per rank, with no evaluation
    before the last step, no checkpoint and no sample (``section.field=value`` overrides)."""
    return [f"training.steps={steps}", f"training.micro_batch_size={micro_batch}",
            f"training.eval_interval={steps + 1}", "checkpoint.enabled=false", "sample.max_new_tokens=0"]  # fmt: skip


def rank_config(steps: int, out_dir: str) -> Config:
    """The default job of :func:`job_overrides` for this process group: the global batch split
    over its ranks, the run written under ``out_dir`` (overwritten)."""
    micro_batch = load_config(CONFIG).training.global_batch_size // dist.get_world_size()
    return load_config(CONFIG, [f"run.out_dir={out_dir}", "run.overwrite=true", *job_overrides(steps, micro_batch)])


def loomtrain_run(nproc: int, micro_batch: int, steps: int, out_dir: str) -> float:
    """Tokens/s of ``loomtrain train`` on the default config, from its ``metrics.jsonl``."""
    name = f"bench_default_{nproc}"
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", str(CONFIG), "--nproc", str(nproc),
           "--overwrite", f"--run.out_dir={out_dir}", f"--run.name={name}",
           *(f"--{o}" for o in job_overrides(steps, micro_batch))]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = [json.loads(line) for line in (Path(out_dir) / name / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "time" in r}
    first, last = WARMUP, steps - LAST_BEFORE_FINAL
    training = load_config(CONFIG).training
    return training.global_batch_size * training.seq_len * (last - first) / (times[last] - times[first])


def plain_processes(batch: int, steps: int, copies: int, ddp: bool = False) -> float:
    """Summed tokens/s of ``copies`` plain loops running at once, each in its own process; with
    ``ddp`` they are the ranks of one DDP group and rank 0's figure (the group's) is returned."""
    cmd = [sys.executable, __file__, "--plain", str(batch), "--steps", str(steps), *(["--ddp"] if ddp else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(copies), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**env, "RANK": str(r)})
             for r in range(copies)]  # fmt: skip
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a plain loop failed: exit codes {[p.returncode for p in procs]}")
    rates = [float(out.strip().splitlines()[-1]) for out in outs]
    return rates[0] if ddp else sum(rates)


def one(run: str, steps: int, out_dir: str) -> float:
    kind, batch = RUNS[run]
    if kind in ("plain", "plain_x2", "ddp"):
        return plain_processes(batch, steps, 1 if kind == "plain" else 2, ddp=kind == "ddp")
    return loomtrain_run(kind, batch, steps, out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--plain", type=int, help=argparse.SUPPRESS)  # one plain loop at this batch (internal)
    p.add_argument("--ddp", action="store_true", help=argparse.SUPPRESS)  # that loop as a DDP rank (internal)
    args = p.parse_args()
    if args.plain:
        print(plain_loop(args.plain, args.steps, args.ddp))
        return
    names, rates = list(RUNS), {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                rates[name].append(one(name, args.steps, out_dir))
                print(f"round {r} {name}: {rates[name][-1]:,.0f} tokens/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    result = {
        "config": {"rounds": args.rounds, "steps": args.steps}, "torch": torch.__version__, "cpus": os.cpu_count(),
        "tokens_per_s": med, "tokens_per_s_each_round": rates,
        "loomtrain_2proc_over_plain_b6": med["loomtrain_2proc"] / med["plain_b6"],
        "loomtrain_2proc_over_plain_b12": med["loomtrain_2proc"] / med["plain_b12"],
        "loomtrain_1proc_over_plain_b12": med["loomtrain_1proc"] / med["plain_b12"],
        "loomtrain_2proc_over_loomtrain_1proc": med["loomtrain_2proc"] / med["loomtrain_1proc"],
        "two_process_ceiling_over_plain_b12": med["plain_b6_x2"] / med["plain_b12"],
        "loomtrain_2proc_over_two_process_ceiling": med["loomtrain_2proc"] / med["plain_b6_x2"],
        "loomtrain_2proc_over_ddp_2proc": med["loomtrain_2proc"] / med["ddp_2proc"],
        "ddp_2proc_over_plain_b12": med["ddp_2proc"] / med["plain_b12"],
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, rate in med.items():
        print(f"{name}: {rate:,.0f} tokens/s")
    for key in ("loomtrain_1proc_over_plain_b12", "loomtrain_2proc_over_loomtrain_1proc",
                "two_process_ceiling_over_plain_b12", "loomtrain_2proc_over_two_process_ceiling",
                "ddp_2proc_over_plain_b12", "loomtrain_2proc_over_ddp_2proc",
                "loomtrain_2proc_over_plain_b6", "loomtrain_2proc_over_plain_b12"):  # fmt: skip
        print(f"{key}: {result[key]:.3f}")


if __name__ == "__main__":
    main()
