"""The training loop. Reads top to bottom: set-up, data, model, resume, steps, summary.

Runs inside a launched process group (torchrun, ``loomtrain train --nproc N``, or the test
spawn helper); one process is also fine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.checkpoint import CheckpointManager, TrainState, read_manifest
from loomtrain.compression import build_comm_hook
from loomtrain.config import Config, ConfigError
from loomtrain.data import (
    DistributedBatchLoader,
    Tokenizer,
    build_tokenizer,
    encode_to_tensor,
    eval_batches,
    load_corpus,
    load_tokenizer,
)
from loomtrain.distributed.parallel_dims import AXES, ParallelDims
from loomtrain.distributed.zero import ZeroSynchronizer, model_state_bytes
from loomtrain.generation import sample
from loomtrain.hardware import mfu, peak_flops_per_s
from loomtrain.metrics import EventLog, MetricsProcessor, SampleRecorder, last_logged_step, peak_memory_bytes
from loomtrain.models import Transformer, count_params, flops_per_token
from loomtrain.models.parallelize import ParallelModel, parallelize_llama
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.preflight import check_launch

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


def prepare_run_dir(cfg: Config, config_toml: str, tokenizer: Tokenizer) -> None:
    """Rank 0, after every check passed: apply ``run.overwrite``, create the directory, write
    the config as the user gave it and the tokenizer."""
    if cfg.run.overwrite and cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "config.toml").write_text(config_toml)
    tokenizer.save(cfg.run_dir / "tokenizer")


@dataclass
class Data:
    """Token streams (1-D int64) and the tokenizer of a run."""

    tokenizer: Tokenizer
    train: torch.Tensor
    val: torch.Tensor


def build_data(cfg: Config, saved_tokenizer: Path | None) -> Data:
    """Read the corpus and tokenize it. Rank 0 builds the tokenizer (or, when resuming, loads
    the one saved beside the checkpoint, ``saved_tokenizer``) and broadcasts it, so all ranks
    agree on the vocabulary.

    Raises:
        ConfigError: a split too short for one sample of ``training.seq_len`` tokens.
    """
    train_text, val_text = load_corpus(cfg.data)
    box: list[Tokenizer | None] = [None]
    if dist.get_rank() == 0:
        if saved_tokenizer is not None:
            box[0] = load_tokenizer(saved_tokenizer)
        else:
            box[0] = build_tokenizer(cfg.data.tokenizer, train_text + val_text, cfg.data.bpe_vocab_size)
    dist.broadcast_object_list(box, src=0)
    tok = box[0]
    data = Data(tok, encode_to_tensor(tok, train_text), encode_to_tensor(tok, val_text))
    for split, tokens in (("training", data.train), ("validation", data.val)):
        if len(tokens) < cfg.training.seq_len + 1:
            raise ConfigError(
                f"the {split} text has {len(tokens)} tokens, fewer than one sample of training.seq_len+1="
                f"{cfg.training.seq_len + 1}; use more text or lower training.seq_len"
            )
    return data


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


def train_step(pm: ParallelModel, optimizer, micro_batches, cfg: Config, device) -> float:
    """One optimizer step over this rank's micro-batches; returns the mean loss.

    Forward and backward go through ``pm`` (only the last backward of each stage
    communicates), then the averaged gradient is clipped by its global norm and applied. With
    ZeRO the loss is multiplied by the fp16 loss scale (1 otherwise) and the synchronizer
    unscales and clips its gradient shards; a step with inf/nan gradients is skipped.
    """
    sync = pm.sync
    zero = isinstance(sync, ZeroSynchronizer)
    scale = sync.loss_scale if zero else 1.0
    loss = pm.forward_backward(micro_batches, scale, lambda: autocast(cfg, device), device)
    sync.finish_gradient_sync()
    if zero:
        step_ok = sync.unscale_and_clip_(cfg.training.grad_clip)
    else:
        step_ok = True
        if cfg.training.grad_clip > 0:
            pm.clip_grad_norm_(cfg.training.grad_clip)
    if step_ok:
        optimizer.step()
    sync.zero_grad()
    return loss


def mean_over_ranks(value: float, device: torch.device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


@torch.no_grad()
def evaluate(pm: ParallelModel, data: Data, cfg: Config, device) -> float:
    """Validation loss (nats/token) over ``training.eval_batches`` micro-batches per ``dp``
    rank, averaged over ranks."""
    dims = pm.dims
    pm.model.eval()
    batches = eval_batches(
        data.val,
        cfg.training.seq_len,
        cfg.training.micro_batch_size,
        cfg.training.eval_batches,
        dims.dp_rank,
        dims.dp,
    )
    local = pm.eval_loss(batches, lambda: autocast(cfg, device), device)
    pm.model.train()
    return mean_over_ranks(local, device, dims.grad_mesh.get_group())


class Throughput:
    """Tokens/s and MFU, over the steps since the last report and over the whole run.

    Only time inside :func:`train_step` counts: evaluation and checkpointing are not training.
    """

    def __init__(self, tokens_per_step_per_device: int, flops_per_token: float, peak_flops: float, world: int):
        self.tokens = tokens_per_step_per_device
        self.flops_per_token = flops_per_token
        self.peak = peak_flops
        self.world = world
        self.window = [0, 0.0]
        self.total = [0, 0.0]

    def add(self, seconds: float) -> None:
        for acc in (self.window, self.total):
            acc[0] += 1
            acc[1] += seconds

    def _rates(self, steps: int, seconds: float) -> dict[str, float]:
        per_device = self.tokens * steps / max(seconds, 1e-9)
        return {
            "tokens_per_s": per_device * self.world,
            "mfu": mfu(self.flops_per_token, per_device, self.peak),
        }

    def report(self) -> dict[str, float]:
        """Global tokens/s and per-device MFU since the last report; resets the window."""
        rates = self._rates(*self.window)
        self.window = [0, 0.0]
        return rates

    def overall(self) -> dict[str, float]:
        return self._rates(*self.total)


class Preemption:
    """Graceful stop on SIGTERM (a scheduler's preemption notice, or torchrun passing on the
    launcher's SIGTERM): the handler only sets a flag; after each step the ranks agree by a
    one-element all-reduce (MAX), so all stop at the same step and checkpoint together."""

    def __init__(self) -> None:
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class Trainer:
    """Builds a run from its config in the current process group, then trains it.

    Set-up order: device and process group → mesh → run directory → data and tokenizer →
    model → data parallelism → optimizer → loader → resume from a checkpoint.
    """

    def __init__(self, cfg: Config):
        self.wall_start = time.perf_counter()
        self.cfg = cfg
        config_toml = cfg.to_toml()
        self.device = select_device(cfg)
        init_distributed(cfg, self.device)
        self.dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size(), self.device.type)
        self.rank0 = dist.get_rank() == 0
        check_launch(cfg, self.dims.world_size)
        layout = {"pp": self.dims.pp, "dp": self.dims.dp, "sp": self.dims.sp, "tp": self.dims.tp,
                  "zero_stage": cfg.data_parallel.zero_stage}  # fmt: skip
        self.ckpt = CheckpointManager(
            cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.async_save, layout
        )
        self.resumed_from = self.ckpt.resolve(cfg.checkpoint.resume)
        # <run>/checkpoints/step_N → <run>/tokenizer, also when resuming from another run's checkpoint.
        saved_tokenizer = None if self.resumed_from is None else self.resumed_from.parent.parent / "tokenizer"
        self.data = build_data(cfg, saved_tokenizer)
        resolve_vocab(cfg, self.data.tokenizer.vocab_size)
        if self.rank0:
            prepare_run_dir(cfg, config_toml, self.data.tokenizer)
        dist.barrier()
        self._build_model()
        self._resume()
        self._build_metrics()

    def _build_model(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        torch.manual_seed(cfg.run.seed)
        self.model = Transformer(cfg.model).to(self.device)
        self.n_params = count_params(self.model)  # counted whole, before sharding
        dp = cfg.data_parallel
        hook = build_comm_hook(cfg.compression, dp.comm_hook)
        self.pm = parallelize_llama(self.model, self.dims, cfg, hook)
        self.sync = self.pm.sync
        self.optimizer = build_optimizer(self.model, t)
        if dp.zero_stage > 0:
            self.sync.attach_optimizer(self.optimizer)
        self.loader = DistributedBatchLoader(
            self.data.train, t.seq_len, t.global_batch_size, t.micro_batch_size, self.dims.dp_rank, self.dims.dp,
            cfg.run.seed,
        )  # fmt: skip

    def _resume(self) -> None:
        """Load the chosen checkpoint (if any) and record what happened in the event log."""
        self.step = self.start_step = 0
        self.events = EventLog(self.cfg.run_dir, self.rank0)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        reached = 0
        if self.resumed_from is not None:
            # Metrics are logged every log_interval steps; a checkpoint may come from a later step.
            reached = max(last_logged_step(self.cfg.run_dir), read_manifest(self.resumed_from)["step"])
        self.events("start", world_size=self.dims.world_size, attempt=attempt)
        if attempt > 0:
            self.events("failure_detected", failed_attempt=attempt - 1, reached_step=reached)
            self.events("restart", attempt=attempt)
        if self.resumed_from is None:
            return
        state = self.ckpt.load(self.resumed_from, self.model, self.optimizer, self.pm)
        self.step = self.start_step = state.step
        self.loader.load_state_dict(state.loader)
        # Absent after a layout change; another method's state does not fit: residuals restart at zero.
        if state.rank_state.get("compression_method") == self.cfg.compression.method:
            self.sync.hook.load_state_dict(state.rank_state["comm_hook"])
        if self._scaler is not None and "loss_scaler" in state.extra:
            self._scaler.load_state_dict(state.extra["loss_scaler"])
        saved_world = read_manifest(self.resumed_from)["world_size"]
        self.events("checkpoint_loaded", path=str(self.resumed_from), step=state.step, saved_world_size=saved_world)
        if saved_world != self.dims.world_size:
            self.events("world_size_change", before=saved_world, after=self.dims.world_size)
        if reached > state.step:
            self.events("steps_redone", count=reached - state.step, from_step=state.step + 1, to_step=reached)

    def _build_metrics(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.metrics = MetricsProcessor(
            cfg.run_dir, t.steps, self.step, self.rank0, cfg.metrics.tensorboard, cfg.metrics.progress_bar
        )
        self.samples = SampleRecorder(cfg.run_dir, dist.get_rank(), self.step, cfg.metrics.record_samples)
        self.preemption = Preemption()
        peak = peak_flops_per_s(self.device, torch.bfloat16 if t.dtype == "bf16" else torch.float32)
        fpt = flops_per_token(cfg.model, t.seq_len)
        world = self.dims.world_size
        # Every device shares the step's FLOPs equally, whatever the mix of dp, sp and tp.
        self.train_traffic: Counter[str] = Counter()
        self.bubbles: list[float] = []  # measured per pipelined step (see PipelineExecutor)
        self.bubbles_logged = 0
        self.speed = Throughput(t.global_batch_size * t.seq_len // world, fpt, peak, world)
        self.metrics.message(
            f"loomtrain: {self.n_params:,} parameters, world size {world} "
            f"(pp {self.dims.pp}, dp {self.dims.dp}, sp {self.dims.sp}, tp {self.dims.tp}), "
            f"{cfg.grad_accum_steps(self.dims.dp)} micro-batch(es) of {t.micro_batch_size} per rank per step, "
            f"{fpt / 1e6:.2f} MFLOP/token, device peak {peak / 1e9:.1f} GFLOP/s"
        )

    def run(self) -> dict:
        """Train to ``training.steps``; returns the summary written to ``summary.json``."""
        t = self.cfg.training
        loss, val_loss = float("nan"), None
        while self.step < t.steps:
            set_lr(self.optimizer, lr_at(self.step, t))
            micro_batches = self.loader.next_step()
            start, sent = time.perf_counter(), self.pm.traffic.snapshot()
            loss = train_step(self.pm, self.optimizer, micro_batches, self.cfg, self.device)
            self.speed.add(time.perf_counter() - start)
            for axis, nbytes in self.pm.traffic.snapshot().items():
                self.train_traffic[axis] += nbytes - sent.get(axis, 0)
            if self.pm.pipeline is not None:
                self.bubbles.append(self.pm.pipeline.last_record.bubble_fraction)
            self.step += 1
            self.metrics.advance()
            eval_now = self.step % t.eval_interval == 0 or self.step == t.steps
            if eval_now or self.step % t.log_interval == 0 or self.step == 1:
                loss, val_loss = self._log_step(loss, eval_now, val_loss)
            self.samples.record(self.step, self.loader.last_sample_ids)
            ck = self.cfg.checkpoint
            if ck.enabled and (self.step % ck.interval == 0 or self.step == t.steps):
                self._save()
            if self.preemption.agreed(self.device):
                return self._stop_for_preemption()
        self.ckpt.finalize()
        if val_loss is None:
            val_loss = evaluate(self.pm, self.data, self.cfg, self.device)
        return self._finish(loss, val_loss)

    @property
    def _scaler(self):
        return getattr(self.sync, "scaler", None)

    def _save(self) -> None:
        extra = {} if self._scaler is None else {"loss_scaler": self._scaler.state_dict()}
        rank_state = {"comm_hook": self.sync.hook.state_dict(), "compression_method": self.cfg.compression.method}
        train_state = TrainState(self.step, self.loader.state_dict(), extra, rank_state)
        self.ckpt.save(self.step, self.model, self.optimizer, train_state, self.pm)

    def _stop_for_preemption(self) -> dict:
        """All ranks agreed a SIGTERM arrived: checkpoint this step (unless just done), stop."""
        if self.ckpt.last_saved_step != self.step:
            self._save()
        self.ckpt.finalize()
        self.events("preempted", step=self.step, checkpoint=f"step_{self.step:08d}")
        self._close_records()
        return {"final_step": self.step, "start_step": self.start_step, "preempted": True}

    def _close_records(self) -> None:
        self.metrics.close()
        self.samples.close()

    def _log_step(self, local_loss: float, eval_now: bool, val_loss: float | None) -> tuple[float, float | None]:
        loss = mean_over_ranks(local_loss, self.device, self.dims.grad_mesh.get_group())
        record = {"loss": loss, "lr": lr_at(self.step - 1, self.cfg.training), **self.speed.report()}
        record.update({f"comm_bytes_{axis}": v for axis, v in self._comm_bytes_per_step().items()})
        window = self.bubbles[self.bubbles_logged :]
        if window:
            record["bubble_fraction"] = sum(window) / len(window)
            self.bubbles_logged = len(self.bubbles)
        if eval_now:
            val_loss = record["val_loss"] = evaluate(self.pm, self.data, self.cfg, self.device)
            self.metrics.message(f"step {self.step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
        self.metrics.log(self.step, record)
        return loss, val_loss

    def _finish(self, loss: float, val_loss: float) -> dict:
        peak_mem = torch.tensor([peak_memory_bytes(self.device)], device=self.device)
        dist.all_reduce(peak_mem, op=dist.ReduceOp.MAX)
        summary = {
            "final_step": self.step,
            "start_step": self.start_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "loss": loss,
            "val_loss": val_loss,
            **self.speed.overall(),
            "wall_s": time.perf_counter() - self.wall_start,
            "world_size": dist.get_world_size(),
            "peak_memory_bytes": int(peak_mem.item()),
            "n_params": self.n_params,
            "flops_per_token": self.speed.flops_per_token,
            "peak_flops_per_s": self.speed.peak,
            "comm_bytes_per_step": self.sync.hook.bytes_sent / max(1, self.speed.total[0]),
            "compression_ratio": self.sync.hook.bytes_sent / max(1, self.sync.hook.dense_bytes),
            "comm_bytes_per_step_by_axis": self._comm_bytes_per_step(),
            **self._model_state_bytes(),
        }
        if self._scaler is not None:
            summary["loss_scale"] = self._scaler.scale
        if self.bubbles:
            # The first step of a process also agrees the transfer shapes: not a steady-state step.
            steady = self.bubbles[1:] or self.bubbles
            summary["bubble_fraction"] = sum(steady) / len(steady)
            if self.rank0:
                timeline = self.pm.pipeline.timeline(self.step)
                (self.cfg.run_dir / "timeline.json").write_text(json.dumps(timeline))
        self._close_records()
        self.sync.remove()
        full_model = self.pm.full_model()
        if self.rank0:
            (self.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            self._print_end(summary, full_model)
        return summary

    def _comm_bytes_per_step(self) -> dict[str, float]:
        """Bytes a rank sent per training step, mean over ranks, per mesh axis: ``dp`` (gradient
        reduction over the dp × sp ranks, through the comm hook), ``tp`` and ``sp`` (activations),
        ``pp`` (activations and their gradients between stages; the first and last pipeline
        ranks send one kind each, the others both). Evaluation forwards are not counted. A
        collective: every rank calls it."""
        steps = max(1, self.speed.total[0])
        sent = {"dp": self.sync.hook.bytes_sent, **self.train_traffic}
        axes = ["dp"] + [axis for axis in AXES if axis != "dp" and getattr(self.dims, axis) > 1]
        totals = torch.tensor([float(sent.get(axis, 0)) for axis in axes], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return {axis: total / self.dims.world_size / steps for axis, total in zip(axes, totals.tolist(), strict=True)}

    def _model_state_bytes(self) -> dict[str, int]:
        """This rank's ``param_bytes``, ``grad_bytes``, ``optim_bytes`` (held storage; for ZeRO
        the largest persistent state seen at a step's end, see ``ZeroSynchronizer.zero_grad``)."""
        if isinstance(self.sync, ZeroSynchronizer):
            return dict(self.sync.state_bytes)
        params = list(self.model.parameters())
        return model_state_bytes(params, [p.grad for p in params], self.optimizer)

    def _print_end(self, summary: dict, model: Transformer) -> None:
        s = self.cfg.sample
        if s.max_new_tokens > 0:
            text = sample(
                model, self.data.tokenizer, s.prompt, s.max_new_tokens, self.cfg.model.max_seq_len,
                s.temperature, s.top_k, self.cfg.run.seed,
            )  # fmt: skip
            print(f"\n--- sample ({s.max_new_tokens} tokens) ---\n{text}\n---")
        print(
            f"done: step {summary['final_step']}, val loss {summary['val_loss']:.4f}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {summary['mfu']:.2%}, wall {summary['wall_s']:.1f} s; "
            f"run directory {self.cfg.run_dir}"
        )


def train(cfg: Config) -> dict:
    """Train ``cfg`` in the current process group (joined here if needed); returns the summary.

    Raises:
        ConfigError: a setting that does not fit the world size or the data.
    """
    return Trainer(cfg).run()
