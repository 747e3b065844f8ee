"""``loomtrain train --simulate.device=NAME``: a pipeline training run on emulated devices.

Each pipeline rank's stages take the time ``distributed/pipeline/emulated.py``'s cost model gives
the named GPU for the configured model shape and micro-batch, instead of computing. Real: the data
loader, the executor and its schedule, the point-to-point transfers (real tensors of the real
activation shape), the gradient synchronizer and optimizer (over each stage's one-element stand-in
parameter), the metrics. Not run: the model's arithmetic, so there is no loss to learn, no
evaluation, no checkpoint and no sample. It is a test instrument for schedules at scales this
machine cannot compute: every output says ``emulated`` (the console line, each ``metrics.jsonl``
record, ``summary.json``, ``timeline.json`` and the charts of ``loomtrain report``), and its
figures are a cost model's, not measurements of hardware.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from loomtrain.compression import build_comm_hook
from loomtrain.config import Config
from loomtrain.data import DistributedBatchLoader, build_data, resolve_vocab
from loomtrain.distributed.parallel_dims import ParallelDims, is_main_process
from loomtrain.distributed.pipeline.emulated import device as emulated_device
from loomtrain.distributed.pipeline.emulated import replayed_step_s as replay
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.distributed.process_group import init_distributed
from loomtrain.hardware import Peak
from loomtrain.metrics import TrainingMetrics
from loomtrain.models.parallelize import parallelize_emulated
from loomtrain.optim import build_optimizer, lr_at, set_lr
from loomtrain.preflight import check_once
from loomtrain.run_dir import prepare_run_dir
from loomtrain.trainer import mean_over_ranks, train_step


def emulated_marker(cfg: Config) -> dict[str, str]:
    """What every output of an emulated run carries: ``{"device": name, "source": datasheet line,
    "note": ...}``."""
    dev = emulated_device(cfg.simulate.device)
    return {"device": dev.name, "source": dev.source,
            "note": "emulated: compute times from a cost model, not measured on this hardware"}  # fmt: skip


# Measured device step time above the replay by more than this: the host did not keep up with the
# emulated devices (actions shorter than its own time per action), and the figures show the host.
HOST_BOUND_MARGIN = 0.05


def replayed_step_s(cfg: Config, pm) -> float:
    """The step time, seconds, of the run's schedule replayed with the cost model's action times."""
    p, t = cfg.parallel, cfg.training
    plan = partition_layers(cfg.model.n_layers, p.n_stages, p.stage_boundaries)
    layers = {s: [str(i) for i in plan[s]] for s in range(p.n_stages)}
    return replay(cfg.model, layers, pm.pipeline.all_actions, pm.dims.pp, p.virtual_stages, t.seq_len,
                  t.micro_batch_size, emulated_device(cfg.simulate.device))  # fmt: skip


def _host_check(cfg: Config, pm, steps: list[float], writer) -> dict[str, float]:
    """Compare the measured steady-state device step (median, first step left out) with the replay;
    warn when the host was the bottleneck."""
    steady = sorted(steps[1:] or steps)
    measured, replayed = steady[len(steady) // 2], replayed_step_s(cfg, pm)
    if measured > replayed * (1 + HOST_BOUND_MARGIN):
        writer.message(f"warning: emulated steps took {measured * 1e3:.1f} ms against the cost model's "
                       f"{replayed * 1e3:.1f} ms: the host cannot keep up with actions this short, so these "
                       "figures describe this machine; emulate a larger micro-batch or sequence")  # fmt: skip
    return {"device_step_s": measured, "replayed_step_s": replayed}


def run_emulated(cfg: Config) -> dict:
    """Run ``training.steps`` pipeline steps of ``cfg`` on the emulated ``simulate.device`` in the
    current process group (joined here if needed); returns the summary written to ``summary.json``.

    Raises:
        ConfigError: a setting that does not fit (see ``Config`` and ``preflight.check_world``).
    """
    wall_start, config_toml, cpu = time.perf_counter(), cfg.to_toml(), torch.device("cpu")
    init_distributed(cfg, cpu)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size())
    check_once(cfg, dims.world_size)
    data = build_data(cfg, None)
    resolve_vocab(cfg, data.tokenizer.vocab_size)
    if is_main_process():
        prepare_run_dir(cfg, config_toml, data.tokenizer)
    dist.barrier()
    marker, t = emulated_marker(cfg), cfg.training
    pm = parallelize_emulated(cfg, dims, build_comm_hook(cfg.compression, cfg.data_parallel.comm_hook, None))
    optimizer = build_optimizer(pm.model, t)
    pm.sync.attach_optimizer(optimizer)
    loader = DistributedBatchLoader(data.train, t.seq_len, t.global_batch_size, t.micro_batch_size, 0, 1,
                                    cfg.run.seed)  # fmt: skip
    dev = emulated_device(cfg.simulate.device)
    # MFU against the emulated device's datasheet peak: the cost model's, as the marks say.
    peak = Peak(dev.peak_flops_per_s, "datasheet", note=f"emulated {dev.name}")
    metrics = TrainingMetrics.for_run(cfg, pm, cpu, 0, peak)
    metrics.writer.message(f"EMULATED {marker['device']} devices ({marker['source']}): {marker['note']}")
    steps = []
    for step in range(1, t.steps + 1):
        set_lr(optimizer, lr_at(step - 1, t))
        with metrics.timed_step():
            loss = train_step(pm, optimizer, loader.next_step(), cfg, cpu)
        steps.append(pm.pipeline.last_record.step_s)  # on the emulated devices' clocks
        if step % t.log_interval == 0 or step in (1, t.steps):
            record = metrics.step_record(mean_over_ranks(loss, cpu), lr_at(step - 1, t))
            metrics.writer.log(step, {**record, "emulated_device": marker["device"]})
    marker = {**marker, **_host_check(cfg, pm, steps, metrics.writer)}
    summary = metrics.summary(final_step=t.steps, start_step=0, wall_s=time.perf_counter() - wall_start,
                              emulated=marker)  # fmt: skip
    metrics.writer.close()
    if is_main_process():
        metrics.write(cfg.run_dir, summary, t.steps)
    return summary
