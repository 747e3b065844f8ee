"""Metrics and run records: what a training step measured (:class:`TrainingMetrics`:
throughput, MFU, bytes per mesh axis, pipeline bubble, model-state bytes, peak memory, the
summary), console progress bar, ``metrics.jsonl``, TensorBoard, the event log and the
per-rank sample audit.

Only rank 0 writes metrics and events; other ranks construct them with ``enabled=False``.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loomtrain.config import Config
from loomtrain.console import Console
from loomtrain.distributed.parallel_dims import Axis, is_main_process
from loomtrain.distributed.traffic import GRADIENT_AXIS, INTER_HOST_AXIS
from loomtrain.hardware import Peak, device_peak, mfu
from loomtrain.models.flops import flops_per_token
from loomtrain.profiling import StepComm, overlap_figures

if TYPE_CHECKING:
    from loomtrain.distributed.parallel_model import ParallelModel


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA allocator peak on GPU, else the resident
    set high-water mark (``ru_maxrss``, which Linux reports in KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def last_logged_step(run_dir: Path) -> int:
    """The last step recorded in ``<run>/metrics.jsonl`` (0 if none): how far a failed attempt
    got, or how far a running one has got (safe to call while the file is being written)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    complete = path.read_text().split("\n")[:-1]  # a line still being written is not counted
    return max((json.loads(line)["step"] for line in complete if line), default=0)


def _truncated_jsonl(path: Path, start_step: int):
    """Open ``path`` for appending after dropping records past ``start_step``: steps after the
    checkpoint a run resumes from are redone, and each step must appear once."""
    kept = []
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
    f = path.open("w")
    f.writelines(line + "\n" for line in kept)
    f.flush()
    return f


class MetricsProcessor:
    """Writes one JSON object per logged step to ``<run>/metrics.jsonl`` (stamped with ``time``,
    Unix seconds) and the same scalars to TensorBoard (``<run>/tensorboard``); shows progress on
    the console (:class:`~loomtrain.console.Console`: a bar on a terminal, a plain line per
    logged step otherwise, or JSON lines).

    Args:
        run_dir: the run directory (exists).
        total_steps: optimizer steps of the whole run, for the progress and its ETA.
        start_step: the step a resumed run starts from.
        enabled: False on every rank but 0.
        log_format: ``log.format``, ``"text"`` or ``"json"``.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
        log_format: str = "text",
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._console = None
        if not enabled:
            return
        self._jsonl = _truncated_jsonl(run_dir / "metrics.jsonl", start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events after the resumed step, which are about to be redone.
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        self._console = Console(total_steps, start_step, log_format, progress_bar)

    def advance(self, steps: int = 1) -> None:
        if self._console is not None:
            self._console.advance(steps)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record ``values`` for ``step`` (scalars only)."""
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        self._console.log(step, values)

    def message(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if self._console is not None:
            self._console.message(text)

    def close(self) -> None:
        if self._console is not None:
            self._console.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


class EventLog:
    """Run events (start, restart, checkpoint loaded or saved, world-size change, steps redone,
    preemption) appended to ``<run>/events.jsonl`` and printed on rank 0. Never truncated: it
    is the run's history across attempts."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = run_dir / "events.jsonl"
        self.enabled = enabled

    def __call__(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), "event": kind, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        details = ", ".join(f"{k}={v}" for k, v in fields.items())
        print(f"[loomtrain] {kind}: {details}", file=sys.stderr, flush=True)

    def read(self) -> list[dict[str, Any]]:
        """All events so far (any rank may read)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


class SampleRecorder:
    """Per rank, the window ids of every micro-batch it trained on, one JSON line per step in
    ``<run>/samples/rank_XXXXX.jsonl``: an audit that no sample is skipped or seen twice across
    restarts. Records past the resumed step are dropped, as they are redone; after a shrink,
    rank 0 drops them from the files of ranks that no longer exist too."""

    def __init__(self, run_dir: Path, rank: int, start_step: int, enabled: bool, world_size: int = 1):
        self._file = None
        if not enabled:
            return
        folder = run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        self._file = _truncated_jsonl(folder / f"rank_{rank:05d}.jsonl", start_step)
        if rank == 0:
            for path in folder.glob("rank_*.jsonl"):
                if int(path.stem.removeprefix("rank_")) >= world_size:
                    _truncated_jsonl(path, start_step).close()

    def record(self, step: int, sample_ids: list[list[int]]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"step": step, "samples": sample_ids}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Throughput:
    """Tokens/s and MFU, over the steps since the last report and over the whole run.

    Only time inside a training step counts: evaluation and checkpointing are not training.
    MFU = achieved model FLOP/s per device / the device's peak FLOP/s (Chowdhery et al.,
    "PaLM", 2022, Appendix B); ``peak`` says where that peak came from.
    """

    def __init__(self, tokens_per_step_per_device: int, flops_per_token: float, peak: Peak, world: int):
        self.tokens = tokens_per_step_per_device
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world = world
        self.window = [0, 0.0]
        self.total = [0, 0.0]

    def add(self, seconds: float) -> None:
        for acc in (self.window, self.total):
            acc[0] += 1
            acc[1] += seconds

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        """``tokens_per_s`` of the whole job and ``mfu`` of one device, for ``steps`` global
        batches trained in ``seconds``."""
        per_device = self.tokens * steps / max(seconds, 1e-9)
        return {
            "tokens_per_s": per_device * self.world,
            "mfu": mfu(self.flops_per_token, per_device, self.peak.flops_per_s),
        }

    def report(self) -> dict[str, float]:
        """:meth:`rates` of this rank's steps since the last report; resets the window."""
        rates = self.rates(*self.window)
        self.window = [0, 0.0]
        return rates


# How each summary.json figure combines the ranks' values (docs/metrics.md#summaryjson): "same" is
# equal on every rank; "global" is computed from all ranks' totals (the whole job's tokens over the
# slowest rank's seconds, a loss weighted by each rank's tokens or samples); "max" is the largest
# rank's (times and memory: what the slowest or fullest rank needs); "mean" is the mean over ranks.
SUMMARY_REDUCTIONS = {
    **dict.fromkeys(("final_step", "start_step", "resumed_from", "world_size", "n_params", "flops_per_token",
                     "peak_flops_per_s", "peak_flops", "loss_scale"), "same"),
    **dict.fromkeys(("loss", "val_loss", "tokens_per_s", "mfu", "compression_ratio", "comm_hidden_fraction"),
                    "global"),
    **dict.fromkeys(("wall_s", "peak_memory_bytes", "param_bytes", "grad_bytes", "optim_bytes"), "max"),
    **dict.fromkeys(("comm_bytes_per_step", "comm_bytes_per_step_by_axis", "comm_s", "comm_exposed_s",
                     "bubble_fraction"), "mean"),
}  # fmt: skip
# A figure missing from SUMMARY_REDUCTIONS is rank 0's own: said so rather than guessed.
UNREDUCED = "rank 0"


def _all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    """``values`` reduced element-wise over all ranks with ``op`` in float64 (exact for byte
    counts below 2⁵³). A collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def agreed_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """Rank 0's :func:`~loomtrain.hardware.device_peak`, on every rank (a collective). The other
    ranks wait in the broadcast meanwhile, so a benchmark does not share its cores with theirs,
    and the peak cache has one writer."""
    box = [device_peak(device, dtype) if is_main_process() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class TrainingMetrics:
    """Everything a run measures per training step and reports: rank 0 writes it through
    ``writer`` (console, ``metrics.jsonl``, TensorBoard) and ``summary.json``.

    Per step (:meth:`timed_step`): seconds inside the step, bytes sent per mesh axis (the
    traffic counter of ``pm``, where the gradient hook counts ``dp`` and tensor, sequence and
    pipeline parallelism count theirs), pipelined, the measured bubble fraction and, on CPU, the
    gradient communication hidden behind backward (``profiling.CommOverlap``).
    """

    def __init__(self, writer: MetricsProcessor, pm: ParallelModel, speed: Throughput, device: torch.device):
        self.writer, self.pm, self.speed, self.device = writer, pm, speed, device
        self.train_traffic: Counter[str] = Counter()
        self.bubbles: list[float] = []  # measured per pipelined step (see PipelineExecutor)
        self.bubbles_logged = 0
        self.comm_steps: list[StepComm] = []  # per step, this rank's (see CommOverlap)
        self.comm_logged = 0

    @classmethod
    def for_run(cls, cfg: Config, pm: ParallelModel, device: torch.device, start_step: int,
                peak: Peak | None = None) -> TrainingMetrics:  # fmt: skip
        """The metrics of a training run from ``start_step``: rank 0 writes them; the device peak
        is ``peak``, else (:func:`agreed_peak`, a collective) that of ``training.dtype``. Every
        device is credited an equal share of the step's FLOPs, whatever the mix of dp, sp, tp and pp."""
        t, m, world = cfg.training, cfg.metrics, pm.dims.world_size
        writer = MetricsProcessor(cfg.run_dir, t.steps, start_step, is_main_process(), m.tensorboard, m.progress_bar,
                                  cfg.log.format)  # fmt: skip
        if peak is None:
            peak = agreed_peak(device, torch.bfloat16 if t.dtype == "bf16" else torch.float32)
        speed = Throughput(t.global_batch_size * t.seq_len // world, flops_per_token(cfg.model, t.seq_len), peak, world)
        return cls(writer, pm, speed, device)

    def announce(self, cfg: Config, n_params: int) -> None:
        """Print the run's shape on rank 0: parameters, layout, micro-batches, FLOPs, peak."""
        dims, t = self.pm.dims, cfg.training
        self.writer.message(
            f"loomtrain: {n_params:,} parameters, world size {dims.world_size} ({dims.describe()}), "
            f"{cfg.grad_accum_steps(dims.dp)} micro-batch(es) of {t.micro_batch_size} per rank per step, "
            f"{self.speed.flops_per_token / 1e6:.2f} MFLOP/token, device peak {self.speed.peak.describe()}"
        )

    @contextlib.contextmanager
    def timed_step(self) -> Iterator[None]:
        """Wrap one training step: its time, bytes and bubble are recorded."""
        start, sent = time.perf_counter(), self.pm.traffic.snapshot()
        yield
        self.speed.add(time.perf_counter() - start)
        for axis, nbytes in self.pm.traffic.snapshot().items():
            self.train_traffic[axis] += nbytes - sent.get(axis, 0)
        if self.pm.pipeline is not None:
            self.bubbles.append(self.pm.pipeline.last_record.bubble_fraction)
        comm = self.pm.sync.overlap.pop()
        if comm is not None:
            self.comm_steps.append(comm)
        self.writer.advance()

    def step_record(self, loss: float, lr: float) -> dict[str, float]:
        """The record of a logged step: ``loss`` (mean over ranks), ``lr``, tokens/s and MFU
        since the last logged step, bytes per step and axis, the bubble over the steps since
        the last logged one (pipelined), the fp16 loss scale (with loss scaling), the peak memory
        so far (bytes, max over ranks), the gradient communication overlap over those steps
        (:meth:`comm_overlap`). A collective."""
        record = {"loss": loss, "lr": lr, **self.speed.report(), "peak_memory_bytes": self.max_peak_memory_bytes()}
        record.update({f"comm_bytes_{axis}": v for axis, v in self.comm_bytes_per_step().items()})
        window = self.bubbles[self.bubbles_logged :]
        if window:
            record["bubble_fraction"] = sum(window) / len(window)
            self.bubbles_logged = len(self.bubbles)
        if self.pm.sync.scaler is not None:
            record["loss_scale"] = self.pm.sync.scaler.scale
        record.update(self.comm_overlap(self.comm_steps[self.comm_logged :]))
        self.comm_logged = len(self.comm_steps)
        return record

    def comm_overlap(self, steps: list[StepComm]) -> dict[str, float]:
        """``comm_s``, ``comm_exposed_s`` (seconds per step) and ``comm_hidden_fraction`` over
        ``steps``, all ranks together (``profiling.overlap_figures``); empty where the timer is
        off (CUDA). A collective where it is on."""
        return overlap_figures(steps, self.device) if self.pm.sync.overlap.enabled else {}

    def max_peak_memory_bytes(self) -> int:
        """Peak memory so far in bytes (see :func:`peak_memory_bytes`), the largest over all
        ranks. A collective."""
        peak = torch.tensor([peak_memory_bytes(self.device)], device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item())

    def comm_bytes_per_step(self) -> dict[str, float]:
        """Bytes a rank sent per training step, mean over ranks, per mesh axis: ``dp`` (gradient
        reduction over the dp × sp ranks, through the comm hook), ``tp`` and ``sp`` (activations;
        under 2D tensor parallelism ``tp_row`` and ``tp_col``, along grid columns and grid rows),
        ``pp`` (activations and their gradients between stages; the first and last pipeline
        ranks send one kind each, the others both). Evaluation forwards are not counted. A
        collective: every rank calls it."""
        dims = self.pm.dims
        steps = max(1, self.speed.total[0])
        tp_axes = (Axis.TP_ROW, Axis.TP_COL) if dims.tp_2d else (Axis.TP,)
        axes = [GRADIENT_AXIS] + [str(a) for a in (Axis.PP, Axis.SP, *tp_axes) if dims.degree(a) > 1]
        if self.pm.sync.hook.counts_inter_host:  # the same hook kind on every rank, so the same axes
            axes.append(INTER_HOST_AXIS)  # part of dp: what of it crossed hosts
        sent = [float(self.train_traffic.get(axis, 0)) for axis in axes]
        totals = torch.tensor(sent, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return {axis: total / dims.world_size / steps for axis, total in zip(axes, totals.tolist(), strict=True)}

    def summary(self, wall_s: float, **run: Any) -> dict[str, Any]:
        """The run's summary (``summary.json``), each figure reduced over ranks as
        :data:`SUMMARY_REDUCTIONS` says and that map written with it as ``reductions``.

        ``run``: fields equal on every rank (final_step, start_step, resumed_from, n_params) or
        already global (loss, val_loss); ``wall_s``: this rank's seconds (the max is kept). Adds
        tokens/s and MFU over the run (the whole job's tokens over the slowest rank's training
        seconds), peak memory and model-state bytes (max over ranks), bytes per step (mean
        over ranks), the compression ratio (all ranks' bytes), the peak and its source, the
        loss scale, the steady-state bubble and gradient communication overlap
        (:meth:`comm_overlap`). A collective."""
        sync, steps = self.pm.sync, max(1, self.speed.total[0])
        state = sync.state_bytes()
        slowest = _all_reduce([self.speed.total[1], wall_s, *state.values()], dist.ReduceOp.MAX, self.device)
        sent, dense = _all_reduce([sync.hook.bytes_sent, sync.hook.dense_bytes], dist.ReduceOp.SUM, self.device)
        by_axis = self.comm_bytes_per_step()
        summary = {
            **run, "wall_s": slowest[1], **self.speed.rates(steps, slowest[0]), "world_size": dist.get_world_size(),
            "peak_memory_bytes": self.max_peak_memory_bytes(), "flops_per_token": self.speed.flops_per_token,
            "peak_flops_per_s": self.speed.peak.flops_per_s, "peak_flops": self.speed.peak.as_dict(),
            "comm_bytes_per_step": by_axis[GRADIENT_AXIS], "compression_ratio": sent / max(1.0, dense),
            "comm_bytes_per_step_by_axis": by_axis, **{k: int(v) for k, v in zip(state, slowest[2:], strict=True)},
        }  # fmt: skip
        if sync.scaler is not None:
            summary["loss_scale"] = sync.scaler.scale
        if self.bubbles:
            # The first step of a process also agrees the transfer shapes: not a steady-state step.
            steady = self.bubbles[1:] or self.bubbles
            summary["bubble_fraction"] = sum(steady) / len(steady)
        # Without a process's first step, which also builds what is built lazily.
        summary.update(self.comm_overlap(self.comm_steps[1:] or self.comm_steps))
        summary["reductions"] = {key: SUMMARY_REDUCTIONS.get(key, UNREDUCED) for key in summary}
        return summary

    def write(self, run_dir: Path, summary: dict[str, Any], step: int) -> None:
        """Rank 0: ``summary.json``, and for a pipelined run ``timeline.json`` (every action of
        the last step, for ``loomtrain report``)."""
        if self.bubbles:
            (run_dir / "timeline.json").write_text(json.dumps(self.pm.pipeline.timeline(step)))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def record_start(events: EventLog, world_size: int, attempt: int, reached: int) -> None:
    """Log a start, and for a restarted attempt (``attempt > 0``) the failure it follows: the
    failed attempt had reached step ``reached``."""
    events("start", world_size=world_size, attempt=attempt)
    if attempt > 0:
        events("failure_detected", failed_attempt=attempt - 1, reached_step=reached)
        events("restart", attempt=attempt)


def record_resume(events: EventLog, path: Path, step: int, saved_world: int, world: int, reached: int) -> None:
    """Log a checkpoint load: which one, a change of world size, the steps to be redone
    (those after the checkpoint that an earlier attempt had reached)."""
    events("checkpoint_loaded", path=str(path), step=step, saved_world_size=saved_world)
    if saved_world != world:
        events("world_size_change", before=saved_world, after=world)
    if reached > step:
        events("steps_redone", count=reached - step, from_step=step + 1, to_step=reached)
