"""The training loop. Reads top to bottom: set-up, data, model, resume, steps, summary.

Runs inside a launched process group (torchrun, ``loomtrain train --nproc N``, or the test
spawn helper); one process is also fine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loomtrain.checkpoint import CheckpointManager, TrainState, find_latest_checkpoint
from loomtrain.config import Config, ConfigError
from loomtrain.data import (
    DistributedBatchLoader,
    build_tokenizer,
    encode_to_tensor,
    eval_batches,
    load_corpus,
    load_tokenizer,
)
from loomtrain.distributed.data_parallel import COMM_HOOKS, GradientSynchronizer, apply_data_parallel
from loomtrain.distributed.parallel_dims import ParallelDims
from loomtrain.generation import sample
from loomtrain.hardware import mfu, peak_flops_per_s
from loomtrain.metrics import MetricsProcessor, peak_memory_bytes
from loomtrain.models import Transformer, count_params, flops_per_token
from loomtrain.optim import build_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)


def select_device(cfg: Config) -> torch.device:
    """CUDA (this process's local GPU) when asked or available under ``device="auto"``, else CPU."""
    want_cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("run.device='cuda' but no CUDA device is visible; use run.device='cpu' or 'auto'")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(cfg: Config, device: torch.device) -> None:
    """Join the process group that the launcher described in the environment (if not yet
    joined), with the configured collective timeout; one thread per process on CPU."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from loomtrain.distributed.spawn import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group(
        backend,
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        timeout=timedelta(seconds=cfg.distributed.timeout_s),
    )


def check_run_dir(cfg: Config) -> None:
    """Refuse to start over a run that has checkpoints, unless resuming or overwriting.

    Raises:
        ConfigError: ``<run>/checkpoints`` holds a checkpoint, ``checkpoint.resume="never"``
            and ``run.overwrite`` is false.
    """
    if cfg.run.overwrite or cfg.checkpoint.resume != "never":
        return
    latest = find_latest_checkpoint(cfg.run_dir / "checkpoints", warn=False)
    if latest is not None:
        raise ConfigError(
            f"run directory {cfg.run_dir} already has checkpoint {latest.name}; pass --resume auto to "
            "continue it, --overwrite to start over, or --run.name=<new name>"
        )


def prepare_run_dir(cfg: Config) -> None:
    """Rank 0: apply ``run.overwrite``, create the directory, write the resolved config."""
    if cfg.run.overwrite and cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(cfg.to_toml())


@dataclass
class Data:
    """Token streams (1-D int64) and the tokenizer of a run."""

    tokenizer: object
    train: torch.Tensor
    val: torch.Tensor


def build_data(cfg: Config) -> Data:
    """Read the corpus; rank 0 builds (or, on resume, reuses) the tokenizer saved in the run
    directory, which every rank then loads so all agree on the vocabulary."""
    train_text, val_text = load_corpus(cfg.data)
    tok_dir = cfg.run_dir / "tokenizer"
    if dist.get_rank() == 0 and not tok_dir.is_dir():
        tok = build_tokenizer(cfg.data.tokenizer, train_text + val_text, cfg.data.bpe_vocab_size)
        tok.save(tok_dir)
    dist.barrier()
    tok = load_tokenizer(tok_dir)
    return Data(tok, encode_to_tensor(tok, train_text), encode_to_tensor(tok, val_text))


def resolve_vocab(cfg: Config, vocab_size: int) -> None:
    """Take the model's vocabulary size from the tokenizer unless the config fixes a larger one."""
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = vocab_size
    elif cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size}; "
            "set model.vocab_size=0 to take the tokenizer's size"
        )


def autocast(cfg: Config, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.training.dtype == "bf16")


def micro_batch_loss(model, x: torch.Tensor, y: torch.Tensor, cfg: Config, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of one micro-batch; x, y: [micro_batch, seq_len]."""
    with autocast(cfg, device):
        logits = model(x.to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())


def train_step(model, sync: GradientSynchronizer, optimizer, micro_batches, cfg: Config, device) -> float:
    """One optimizer step over this rank's micro-batches; returns the rank's mean loss.

    Only the last micro-batch's backward communicates (the others run under ``no_sync``),
    then the averaged gradient is clipped by its global norm and applied.
    """
    total = 0.0
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        with sync.no_sync() if i < last else contextlib.nullcontext():
            loss = micro_batch_loss(model, x, y, cfg, device)
            (loss / len(micro_batches)).backward()
        total += loss.item()
    sync.finish_gradient_sync()
    if cfg.training.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
    optimizer.step()
    sync.zero_grad()
    return total / len(micro_batches)


def mean_over_ranks(value: float, device: torch.device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


@torch.no_grad()
def evaluate(model, data: Data, cfg: Config, dims: ParallelDims, device) -> float:
    """Validation loss (nats/token) over ``training.eval_batches`` micro-batches per rank,
    averaged over ranks."""
    model.eval()
    batches = eval_batches(
        data.val, cfg.training.seq_len, cfg.training.micro_batch_size, cfg.training.eval_batches, dims.dp_rank, dims.dp
    )
    local = sum(micro_batch_loss(model, x, y, cfg, device).item() for x, y in batches) / len(batches)
    model.train()
    return mean_over_ranks(local, device, dims.dp_group)


class Throughput:
    """Tokens/s and MFU over the steps since the last report (evaluation and checkpoint time
    excluded, since they are not training)."""

    def __init__(self, tokens_per_step_per_device: int, flops_per_token: float, peak_flops: float):
        self.tokens = tokens_per_step_per_device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops
        self.steps = self.total_steps = 0
        self.seconds = self.total_seconds = 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.total_steps += 1
        self.total_seconds += seconds

    def report(self, world_size: int) -> dict[str, float]:
        """Global tokens/s and per-device MFU since the last report; resets the window."""
        per_device = self.tokens * self.steps / max(self.seconds, 1e-9)
        self.steps, self.seconds = 0, 0.0
        return {"tokens_per_s": per_device * world_size, "mfu": mfu(self.flops_per_token, per_device, self.peak)}

    def overall(self, world_size: int) -> dict[str, float]:
        per_device = self.tokens * self.total_steps / max(self.total_seconds, 1e-9)
        return {"tokens_per_s": per_device * world_size, "mfu": mfu(self.flops_per_token, per_device, self.peak)}


def train(cfg: Config) -> dict:
    """Train ``cfg`` in the current process group; returns the summary (``summary.json``).

    Raises:
        ConfigError: a setting that does not fit the world size or the data.
    """
    wall_start = time.perf_counter()
    device = select_device(cfg)
    init_distributed(cfg, device)
    dims = ParallelDims.from_world(dist.get_world_size(), device.type)
    cfg.validate_world(dims.dp)
    rank0 = dist.get_rank() == 0
    check_run_dir(cfg)
    dist.barrier()
    if rank0:
        prepare_run_dir(cfg)
    data = build_data(cfg)
    resolve_vocab(cfg, data.tokenizer.vocab_size)

    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model).to(device)
    sync = apply_data_parallel(
        model, dims.dp_group, cfg.data_parallel.bucket_size_mb, COMM_HOOKS[cfg.data_parallel.comm_hook]()
    )
    optimizer = build_optimizer(model, cfg.training)
    t = cfg.training
    loader = DistributedBatchLoader(
        data.train, t.seq_len, t.global_batch_size, t.micro_batch_size, dims.dp_rank, dims.dp, cfg.run.seed
    )
    ckpt = CheckpointManager(cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last)
    step = start_step = 0
    resume_from = ckpt.resolve(cfg.checkpoint.resume)
    if resume_from is not None:
        state = ckpt.load(resume_from, model, optimizer)
        step = start_step = state.step
        loader.load_state_dict(state.loader)
        log.info("resumed from %s at step %d", resume_from, step)

    metrics = MetricsProcessor(
        cfg.run_dir, t.steps, step, rank0, cfg.metrics.tensorboard, cfg.metrics.progress_bar
    )
    peak = peak_flops_per_s(device, torch.bfloat16 if t.dtype == "bf16" else torch.float32)
    fpt = flops_per_token(cfg.model, t.seq_len)
    speed = Throughput(t.global_batch_size * t.seq_len // dims.dp, fpt, peak)
    if rank0:
        metrics.message(
            f"loomtrain: {count_params(model):,} parameters, world size {dims.dp}, "
            f"{cfg.grad_accum_steps(dims.dp)} micro-batch(es) of {t.micro_batch_size} per rank per step, "
            f"{fpt / 1e6:.2f} MFLOP/token, device peak {peak / 1e9:.1f} GFLOP/s"
        )

    val_loss = None
    loss = float("nan")
    while step < t.steps:
        set_lr(optimizer, lr_at(step, t))
        micro_batches = loader.next_step()
        start = time.perf_counter()
        loss = train_step(model, sync, optimizer, micro_batches, cfg, device)
        speed.add(time.perf_counter() - start)
        step += 1
        metrics.advance()
        eval_now = step % t.eval_interval == 0 or step == t.steps
        if eval_now or step % t.log_interval == 0 or step == 1:
            loss = mean_over_ranks(loss, device, dims.dp_group)
            record = {"loss": loss, "lr": lr_at(step - 1, t), **speed.report(dims.dp)}
            if eval_now:
                val_loss = record["val_loss"] = evaluate(model, data, cfg, dims, device)
                metrics.message(f"step {step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
            metrics.log(step, record)
        if cfg.checkpoint.enabled and (step % cfg.checkpoint.interval == 0 or step == t.steps):
            ckpt.save(step, model, optimizer, TrainState(step, loader.state_dict()))

    if val_loss is None:
        val_loss = evaluate(model, data, cfg, dims, device)
    peak_mem = torch.tensor([peak_memory_bytes(device)], device=device)
    dist.all_reduce(peak_mem, op=dist.ReduceOp.MAX)
    summary = {
        "final_step": step,
        "start_step": start_step,
        "resumed_from": str(resume_from) if resume_from else None,
        "loss": loss,
        "val_loss": val_loss,
        **speed.overall(dims.dp),
        "wall_s": time.perf_counter() - wall_start,
        "world_size": dims.dp,
        "peak_memory_bytes": int(peak_mem.item()),
        "n_params": count_params(model),
        "flops_per_token": fpt,
        "peak_flops_per_s": peak,
        "comm_bytes_per_step": sync.hook.bytes_sent / max(1, speed.total_steps),
    }
    metrics.close()
    if rank0:
        (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.sample.max_new_tokens > 0:
            s = cfg.sample
            text = sample(model, data.tokenizer, s.prompt, s.max_new_tokens, cfg.model.max_seq_len, s.temperature,
                          s.top_k, cfg.run.seed)  # fmt: skip
            print(f"\n--- sample ({s.max_new_tokens} tokens) ---\n{text}\n---")
        print(
            f"done: step {step}, val loss {val_loss:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {summary['mfu']:.2%}, wall {summary['wall_s']:.1f} s; run directory {cfg.run_dir}"
        )
    sync.remove()
    return summary
