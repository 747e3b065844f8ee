"""The training loop. Reads top to bottom: set-up, data, model, resume, steps, summary.

Runs inside a launched process group (torchrun, ``loomtrain train --nproc N``, or the test
spawn helper); one process is also fine. The loop drives any data-parallel strategy through
the gradient-sync protocol (``distributed/sync.py``) and leaves measuring to ``metrics.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.checkpoint import CheckpointManager, TrainState, read_manifest
from loomtrain.cluster.throttle import CpuThrottle, parse_speed_changes, place_ranks
from loomtrain.compression import build_comm_hook
from loomtrain.config import Config
from loomtrain.data import Data, DistributedBatchLoader, build_data, eval_batches, resolve_vocab
from loomtrain.distributed import async_dp, local_sgd
from loomtrain.distributed.async_dp import run_async
from loomtrain.distributed.balance import DataBalancer, PipelineBalancer, SpeedMonitor, rebalance_event
from loomtrain.distributed.local_sgd import (
    LocalOnlyHook,
    build_outer_sync,
    outer_group,
    outer_reducer,
    replicas_sync_inside,
)
from loomtrain.distributed.parallel_dims import is_main_process, launch_env
from loomtrain.distributed.parallel_model import ParallelModel
from loomtrain.distributed.preemption import Preemption
from loomtrain.distributed.process_group import init_distributed, select_device
from loomtrain.distributed.topology import discover_topology, placed_dims, placement_report, write_topology
from loomtrain.generation import print_run_end
from loomtrain.interop.hf import load_hf_weights, resolve_init_from
from loomtrain.metrics import EventLog, SampleRecorder, TrainingMetrics, last_logged_step, record_resume, record_start
from loomtrain.models import Transformer, count_params
from loomtrain.models.parallelize import parallelize_llama
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.preflight import check_once
from loomtrain.profiling import StepProfiler
from loomtrain.run_dir import prepare_run_dir

log = logging.getLogger(__name__)


def autocast(cfg: Config, device: torch.device):
    """bf16 autocast when ``training.dtype='bf16'``, else a context that changes nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.training.dtype == "bf16")


def train_step(pm: ParallelModel, optimizer, micro_batches, cfg: Config, device,
               monitor: SpeedMonitor | None = None) -> float:  # fmt: skip
    """One optimizer step over this rank's micro-batches; returns the mean loss (nats).

    Forward and backward go through ``pm`` (only the last backward of each stage
    communicates), scaled by the synchronizer's loss scale; then the averaged gradient is
    unscaled, checked and clipped by its global norm, and applied unless it overflowed.
    ``monitor`` (load balancing) times the compute and the gradient synchronisation.
    """
    sync = pm.sync
    samples = sum(x.shape[0] for x, _ in micro_batches)
    with monitor.compute(samples, lambda: sync.blocked_s) if monitor else contextlib.nullcontext():
        loss = pm.forward_backward(micro_batches, sync.loss_scale, lambda: autocast(cfg, device), device)
    with monitor.waiting() if monitor else contextlib.nullcontext():
        sync.finish_gradient_sync()
        ready = sync.prepare_step(cfg.training.grad_clip)
    if ready:
        optimizer.step()
        sync.after_step()
    sync.zero_grad()
    return loss


def mean_over_ranks(value: float, device: torch.device, group=None, weight: float = 1.0) -> float:
    """The mean of ``value`` over ``group`` weighted by ``weight`` (e.g. this rank's samples):
    ``Σ weight·value / Σ weight`` (a collective)."""
    t = torch.tensor([value * weight, weight], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return (t[0] / t[1]).item()


@torch.no_grad()
def evaluate(pm: ParallelModel, data: Data, cfg: Config, device) -> float:
    """Validation loss (nats/token) over the fixed set of ``training.eval_batches`` micro-batches
    (:func:`~loomtrain.data.eval_batches`), whatever the number of ``dp`` ranks sharing it.

    ``dp`` rank ``r`` evaluates micro-batches ``r, r + dp, …`` and the ranks' means are averaged
    weighted by their tokens, so an uneven share is exact and the result differs between dp
    sizes only by the order of the float sums. A collective over the dp × sp ranks.
    """
    dims, t = pm.dims, cfg.training
    batches = eval_batches(data.val, t.seq_len, t.micro_batch_size, t.eval_batches)
    mine = batches[dims.dp_rank :: dims.dp]
    pm.model.eval()
    local = pm.eval_loss(mine, lambda: autocast(cfg, device), device) if mine else 0.0
    _pad_forwards(pm, batches, len(mine), dims.dp, lambda: autocast(cfg, device), device)
    pm.model.train()
    tokens = sum(y.numel() for _, y in mine)
    return mean_over_ranks(local, device, dims.grad_mesh.get_group(), weight=tokens)


def _pad_forwards(pm: ParallelModel, batches: list, done: int, dp: int, context, device: torch.device) -> None:
    """Forwards whose loss is dropped, so this rank runs as many as the rank with the most
    micro-batches (``⌈len(batches) / dp⌉``): ZeRO-3 gathers each layer's parameters from all
    dp ranks in every forward, and a rank that stopped early would leave the others waiting."""
    missing = -(-len(batches) // dp) - done
    if missing:
        pm.eval_loss(batches[:missing], context, device)


class Trainer:
    """Builds a run from its config in the current process group, then trains it.

    Set-up order: device and process group → topology and placed mesh → checks (once, on rank 0) → run directory,
    data and tokenizer → model, parallelism, optimizer, loader → resume → metrics.
    """

    def __init__(self, cfg: Config):
        self.wall_start = time.perf_counter()
        self.cfg, config_toml = cfg, cfg.to_toml()
        self.device = select_device(cfg)
        init_distributed(cfg, self.device)
        self.topology = discover_topology(cfg.distributed.probe_topology, cfg.distributed.probe_budget_s)
        self.dims = placed_dims(cfg.parallel, self.topology, self.device.type)
        self.resumed_from = check_once(cfg, self.dims.world_size)
        self.throttle = start_throttle(cfg, dist.get_rank())
        self.speed_changes = [c for c in parse_speed_changes(cfg.simulate.speed_change) if c.rank == dist.get_rank()]
        layout = {**self.dims.layout(), "zero_stage": cfg.data_parallel.zero_stage}
        ck = cfg.checkpoint
        self.ckpt = CheckpointManager(cfg.run_dir / "checkpoints", ck.keep_last, ck.async_save, layout)
        # <run>/checkpoints/step_N → <run>/tokenizer, also when resuming from another run's checkpoint.
        saved_tokenizer = None if self.resumed_from is None else self.resumed_from.parent.parent / "tokenizer"
        self.data = build_data(cfg, saved_tokenizer)
        resolve_vocab(cfg, self.data.tokenizer.vocab_size)
        if is_main_process():
            prepare_run_dir(cfg, config_toml, self.data.tokenizer)
            write_topology(cfg.run_dir, self.topology, self.dims)
            log.info(
                "%s\nplacement:\n%s",
                self.topology.describe(),
                placement_report(self.dims, self.topology, cfg.data_parallel.zero_stage > 0),
            )
        dist.barrier()
        self._adopt_saved_stages()
        self._build_model()
        self.stage_balancer = self._stage_balancer()
        self._resume()
        self._build_metrics()

    def _build_model(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        torch.manual_seed(cfg.run.seed)
        self.model = Transformer(cfg.model).to(self.device)
        if cfg.model.init_from is not None and self.resumed_from is None:
            # Into the whole model, before parallelize_llama shards it: every layout then starts from these weights.
            load_hf_weights(self.model, cfg.model.init_from)
        self.n_params = count_params(self.model)  # counted whole, before sharding
        # Local modes: inner steps keep each replica's own gradient (averaged inside a replica of
        # dp_shard ranks); the outer sync averages the replicas.
        dp_cfg = cfg.data_parallel
        own = dp_cfg.mode != "sync" and not replicas_sync_inside(dp_cfg, self.dims)
        hook = LocalOnlyHook() if own else build_comm_hook(cfg.compression, dp_cfg.comm_hook, self.topology)
        self.pm = parallelize_llama(self.model, self.dims, cfg, hook)
        self.sync = self.pm.sync
        self.optimizer = build_optimizer(self.model, t)
        self.sync.attach_optimizer(self.optimizer)
        self.outer = build_outer_sync(dp_cfg, self.model, self.optimizer, outer_group(dp_cfg, self.dims), hook,
                                      self.sync.after_step, cfg.model.n_layers,
                                      outer_reducer(dp_cfg, self.dims, self.topology))  # fmt: skip
        # async: each round reads its own batches (async_dp); this loader only carries the checkpoint's position.
        dp_rank, dp = (0, 1) if cfg.data_parallel.mode == "async" else (self.dims.dp_rank, self.dims.dp)
        self.loader = DistributedBatchLoader(
            self.data.train, t.seq_len, t.global_batch_size, t.micro_batch_size, dp_rank, dp, cfg.run.seed,
        )  # fmt: skip
        self.balancer, self.monitor = None, SpeedMonitor(cfg.balance.smoothing, self.device)
        b = cfg.balance
        if b.data or b.samples_per_rank:
            self.balancer = DataBalancer(t.global_batch_size, self.dims.dp, cfg.grad_accum_steps(self.dims.dp),
                                         b.max_micro_batch_size, b.threshold, b.samples_per_rank)  # fmt: skip

    def _adopt_saved_stages(self) -> None:
        """A resumed pipeline-balanced run starts on the split its checkpoint was saved with."""
        if self.resumed_from is None or not self.cfg.balance.pipeline:
            return
        saved = read_manifest(self.resumed_from).get("balance", {}).get("pipeline", {}).get("boundaries")
        if saved and len(saved) == self.cfg.parallel.n_stages - 1:
            self.cfg.parallel.stage_boundaries = saved

    def _stage_balancer(self) -> PipelineBalancer | None:
        cfg, b = self.cfg, self.cfg.balance
        if not b.pipeline:
            return None
        p = cfg.parallel
        return PipelineBalancer(cfg.model.n_layers, p.pipeline_parallel_degree, p.virtual_stages,
                                cfg.grad_accum_steps(self.dims.dp), p.stage_boundaries, b.threshold,
                                b.smoothing)  # fmt: skip

    def _resume(self) -> None:
        """Load the chosen checkpoint (if any) and record what happened in the event log."""
        self.step = self.start_step = 0
        self.events = EventLog(self.cfg.run_dir, is_main_process())
        if self.resumed_from is None:
            record_start(self.events, self.dims.world_size, launch_env().restart_count, 0)
            return
        manifest = read_manifest(self.resumed_from)
        # Metrics are logged every log_interval steps; a checkpoint may come from a later step.
        reached = max(last_logged_step(self.cfg.run_dir), manifest["step"])
        record_start(self.events, self.dims.world_size, launch_env().restart_count, reached)
        state = self.ckpt.load(self.resumed_from, self.model, self.optimizer, self.pm)
        self.step = self.start_step = state.step
        self.loader.load_state_dict(state.loader)
        self.sync.load_state_dict(state.sync)
        if self.outer is not None:
            self._resume_outer(state.sync["per_rank"].get("outer_sync"), manifest)
        if self.balancer is not None:
            self.balancer.load_state_dict(state.balance.get("data", {}))
            self.events("balance_restored", step=state.step, split=self.balancer.split)
        record_resume(self.events, self.resumed_from, state.step, manifest["world_size"], self.dims.world_size, reached)

    def _resume_outer(self, saved: dict | None, manifest: dict) -> None:
        """The outer loop's state: this rank's own; without it (another world size or layout, or
        another mode's checkpoint) the mode's ``resume_at_another_layout`` (async's or the
        sync-family's), which keeps what the saved rank 0's state (and, for DiLoCo and the async
        server, the checkpoint's resharded outer momentum) allows."""
        if saved is not None:
            self.outer.load_state_dict(saved)
            return
        path, saved_layout, layout = self.resumed_from, manifest.get("layout", {}), self.dims.layout()
        if self.cfg.data_parallel.mode == "async":
            async_dp.resume_at_another_layout(self.outer, path, saved_layout, layout, self.model, self.pm,
                                              async_dp.serves(self.dims, self.cfg.data_parallel))  # fmt: skip
        else:
            local_sgd.resume_at_another_layout(self.outer, path, saved_layout, layout, self.model, self.pm)

    def _build_metrics(self) -> None:
        cfg = self.cfg
        self.samples = SampleRecorder(cfg.run_dir, dist.get_rank(), self.step, cfg.metrics.record_samples,
                                      self.dims.world_size)  # fmt: skip
        self.preemption = Preemption()
        if self.balancer is not None:
            self.sync.set_rank_weight(self.balancer.split[self.dims.dp_rank])
        self.metrics = TrainingMetrics.for_run(cfg, self.pm, self.device, self.step)
        self.metrics.announce(cfg, self.n_params)

    def run(self) -> dict:
        """Train to ``training.steps``; returns the summary written to ``summary.json``."""
        t, ck = self.cfg.training, self.cfg.checkpoint
        if self.cfg.data_parallel.mode == "async":  # rank 0 serves the global model, the others train
            return run_async(self)
        loss, val_loss = float("nan"), None
        self.profiler = StepProfiler(self.cfg, self.device, self.start_step, self.events)
        while self.step < t.steps:
            self.profiler.step(self.step + 1)
            self._change_speed()
            set_lr(self.optimizer, lr_at(self.step, t))
            micro_batches = self.loader.next_step(self.balancer.split if self.balancer else None)
            # The loss is averaged weighted by the samples of the step that made it (a rebalance
            # after the step must not reweigh it).
            self.step_samples = sum(x.shape[0] for x, _ in micro_batches)
            # The first step after a start builds lazily and would skew the measured speed.
            measured = self.step > self.start_step
            with self.metrics.timed_step():
                loss = train_step(self.pm, self.optimizer, micro_batches, self.cfg, self.device,
                                  self.monitor if measured and self.balancer else None)  # fmt: skip
                if self.outer is not None:  # local_sgd/diloco; the run ends on an outer step
                    self.outer.after_inner_step(force=self.step + 1 == t.steps)
            self.step += 1
            if measured:
                self._balance()
            eval_now = self.step % t.eval_interval == 0 or self.step == t.steps
            if eval_now or self.step % t.log_interval == 0 or self.step == 1:
                loss, val_loss = self._log_step(loss, eval_now, val_loss)
            self.samples.record(self.step, self.loader.last_sample_ids)
            if ck.enabled and (self.step % ck.interval == 0 or self.step == t.steps):
                self._save()
            if self.preemption.agreed(self.device):
                return self._stop_for_preemption()
        self.preemption.drain()
        self.profiler.close()
        self.ckpt.finalize()
        if val_loss is None:
            val_loss = self._evaluate()
        return self._finish(loss, val_loss)

    def _global_weights(self):
        """Where the model holds the run's one model: local_sgd/diloco's θ_global, else as is."""
        return self.outer.global_weights() if self.outer is not None else contextlib.nullcontext()

    def _evaluate(self) -> float:
        with self._global_weights():
            return evaluate(self.pm, self.data, self.cfg, self.device)

    def _change_speed(self) -> None:
        """Apply this rank's ``simulate.speed_change`` entries due before the coming step."""
        if self.throttle is None:
            return
        for change in self.speed_changes:
            if change.step == self.step + 1:
                self.throttle.set_speed(change.speed)

    def _balance(self) -> None:
        """Every ``balance.interval`` steps, let the balancers share their measurements and decide."""
        if self.stage_balancer is not None:
            self.stage_balancer.record(self.pm.pipeline.last_record)
        # Nothing to balance for after the last step (and a pipeline rebuilt then has no step to report).
        if self.step % self.cfg.balance.interval or self.step == self.cfg.training.steps:
            return
        if self.balancer is not None:
            self._rebalance_data()
        if self.stage_balancer is not None:
            self._rebalance_stages()

    def _rebalance_stages(self) -> None:
        """Move layers between pipeline ranks when the measured speeds predict a faster split:
        checkpoint this step, rebuild the model on the new split and load the checkpoint into it
        (weights and optimizer state follow their layers by name)."""
        decision = self.stage_balancer.decide(self.step, self.stage_balancer.gather(self.device))
        if decision is None:
            return
        self.events("pipeline_rebalance", **rebalance_event(decision))
        path, loader = self._save(), self.loader.state_dict()
        self.ckpt.finalize()
        self.cfg.parallel.stage_boundaries = self.stage_balancer.boundaries
        self._build_model()
        state = self.ckpt.load(path, self.model, self.optimizer, self.pm)
        self.loader.load_state_dict(loader)
        self.sync.load_state_dict(state.sync)
        self.metrics.pm = self.pm

    def _rebalance_data(self) -> None:
        """Share the measured speeds; take a new split if it is predicted faster enough (on every
        rank alike: all decide from the same gathered figures)."""
        measures = self.monitor.gather(self.dims.dp_rank, self.dims.dp)
        decision = self.balancer.decide(self.step, measures)
        if decision is not None:
            self.sync.set_rank_weight(self.balancer.split[self.dims.dp_rank])
            self.events("rebalance", **rebalance_event(decision))
        if is_main_process():
            record_balance(self.cfg.run_dir, self.step, self.balancer.split, measures, self.cfg.training.seq_len)

    def _save(self) -> Path:
        balance = {"data": self.balancer.state_dict()} if self.balancer else {}
        if self.stage_balancer is not None:
            balance["pipeline"] = self.stage_balancer.state_dict()
        sync = self.sync.state_dict()
        if self.outer is not None:
            # Each replica's θ_local and inner optimizer state: DCP keeps one copy of plain tensors.
            sync["per_rank"]["outer_sync"] = self.outer.state_dict()
        state = TrainState(self.step, self.loader.state_dict(), sync, balance, self._param_state())
        with self._global_weights():
            return self.ckpt.save(self.step, self.model, self.optimizer, state, self.pm)

    def _param_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The outer optimizer's state by parameter (DiLoCo's momentum, or the async server's
        momentum and Delayed Nesterov's delta sum), which DCP reshards to another layout."""
        dp_cfg = self.cfg.data_parallel
        if dp_cfg.mode == "async":
            return async_dp.server_param_state(self.outer, self.model, async_dp.serves(self.dims, dp_cfg))
        return local_sgd.outer_param_state(self.outer, self.model)

    def _stop_for_preemption(self) -> dict:
        """All ranks agreed a SIGTERM arrived: checkpoint this step (unless just done), stop."""
        self.preemption.drain()
        if self.ckpt.last_saved_step != self.step:
            self._save()
        self.ckpt.finalize()
        self.events("preempted", step=self.step, checkpoint=f"step_{self.step:08d}")
        self._close_records()
        return {"final_step": self.step, "start_step": self.start_step, "preempted": True}

    def _close_records(self) -> None:
        self.profiler.close()  # a preempted run writes the steps it traced
        self.metrics.writer.close()
        self.samples.close()

    def _log_step(self, local_loss: float, eval_now: bool, val_loss: float | None) -> tuple[float, float | None]:
        weight = self.step_samples if self.balancer else 1.0
        loss = mean_over_ranks(local_loss, self.device, self.dims.grad_mesh.get_group(), weight)
        record = self.metrics.step_record(loss, lr_at(self.step - 1, self.cfg.training))
        if self.outer is not None:
            record["outer_sync_s"] = self.outer.wait_s  # this rank's, summed since the start
        if eval_now:
            val_loss = record["val_loss"] = self._evaluate()
            self.metrics.writer.message(f"step {self.step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
        self.metrics.writer.log(self.step, record)
        return loss, val_loss

    def _finish(self, loss: float, val_loss: float) -> dict:
        outer = {} if self.outer is None else self.outer.summary_fields()
        summary = self.metrics.summary(
            final_step=self.step, start_step=self.start_step, loss=loss, val_loss=val_loss,
            resumed_from=str(self.resumed_from) if self.resumed_from else None,
            wall_s=time.perf_counter() - self.wall_start, n_params=self.n_params,
            **outer,
        )  # fmt: skip
        self._close_records()
        self.sync.remove()
        full_model = self.pm.full_model()
        if is_main_process():
            self.metrics.write(self.cfg.run_dir, summary, self.step)
            print_run_end(self.cfg, full_model, self.data.tokenizer, summary)
        return summary


def start_throttle(cfg: Config, rank: int) -> CpuThrottle | None:
    """Throttle and pin this rank's process as ``simulate.rank_speed`` says (None: not asked)."""
    speeds = cfg.simulate.rank_speed
    if not speeds:
        return None
    # Core k of the plan is the k-th CPU this process may run on (an affinity mask may hide some).
    return CpuThrottle(os.getpid(), speeds[rank], place_ranks(speeds)[rank], tag=f"{cfg.run.name}-r{rank}")


def record_balance(run_dir, step: int, split: list[int], measures, seq_len: int) -> None:
    """Append one balance check to ``<run>/balance.jsonl``: per dp rank its samples, compute
    seconds per sample, compute speed (tokens/s), gradient-sync wait (s) and memory headroom (bytes)."""
    record = {
        "step": step,
        "samples": split,
        "seconds_per_sample": [m.seconds_per_sample for m in measures],
        "tokens_per_s": [seq_len / m.seconds_per_sample for m in measures],
        "wait_s": [m.wait_s for m in measures],
        "headroom_bytes": [m.headroom_bytes for m in measures],
    }
    with (run_dir / "balance.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def train(cfg: Config) -> dict:
    """Train ``cfg`` in the current process group (joined here if needed); returns the summary.

    Raises:
        ConfigError: a setting that does not fit the world size or the data.
    """
    return Trainer(resolve_init_from(cfg)).run()
