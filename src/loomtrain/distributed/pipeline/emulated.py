"""Emulated devices for pipeline stages: every forward and backward takes the time a cost model gives
for a named GPU instead of computing, while the executor, the schedule and the point-to-point
transfers (real tensors of the real activation shape) run for real. A test instrument: its times are
a model's, not measurements of hardware, and every output of such a run says so.

Device clock. Like a CUDA stream, an emulated device runs its work in issue order and the host
runs ahead of it: a piece of work starts when the device is free, its input is ready and the host
has issued it, and the host blocks only until the device has started the work it issued
:data:`QUEUE_DEPTH` pieces earlier (CUDA lets a host run about a thousand kernels ahead). The
host's own time per action (posting sends and receives: 0.2-2 ms of CPU on a 2-core machine)
therefore overlaps the device's work as it does on a GPU, and shows only where the host falls
behind. An input's readiness travels with it: a sent activation or
gradient carries, in its first 8 bytes, the sender's device time at which it was computed
(:meth:`DeviceClock.stamp`); the bytes themselves are otherwise meaningless, as the stage computes
nothing. Device times are ``time.time()`` seconds, shared by every process of one machine (or of its
emulated hosts, which share one kernel clock): emulated ranks must run on one machine.

Cost model: ``planner/cost.py``, the one layer cost model the planner's time model uses too (the
math-or-memory bound of each weight GEMM and of the fused attention kernel, without wave
quantization, at the datasheet peak; norms and other elementwise work left out, as in
``models/flops.py``). Point-to-point transfers take no device time (the bubble formulas assume so;
512 KiB over 900 GB/s NVLink is under a microsecond).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.config import ModelConfig
from loomtrain.distributed.pipeline.executor import PipelineExecutor
from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.pipeline.schedule import rank_stages, simulate, theoretical_bubble
from loomtrain.planner.cost import DEVICES as DEVICES  # re-exported: --simulate.device's names
from loomtrain.planner.cost import Device, stage_times
from loomtrain.planner.cost import Gemm as Gemm
from loomtrain.planner.cost import attention_kernels as attention_kernels
from loomtrain.planner.cost import device as device
from loomtrain.planner.cost import layer_gemms as layer_gemms

STAMP_BYTES = 8  # one float64: the device time at which a sent tensor was computed
# How many pieces of work (an action is one to three) the host may queue ahead of the device: a
# few, so the host's own time per action (0.2-2 ms, more where 8 ranks share 2 cores) is absorbed
# over several actions, while a step's wall-clock time still follows the device clocks.
QUEUE_DEPTH = 32


def sleep_until(deadline: float) -> None:
    """Block until ``time.time()`` reaches ``deadline`` (seconds), without using CPU."""
    remaining = deadline - time.time()
    if remaining > 0:
        time.sleep(remaining)


class DeviceClock:
    """The emulated device of one rank: a stream of timed work (see the module docstring).

    ``dev``: the emulated device (its name and source go into timelines as ``emulated``). The
    executor brackets each action with :meth:`begin` and :meth:`end`; the emulated stages call
    :meth:`run` for each piece of work inside it. Times are ``time.time()`` seconds.
    """

    def __init__(self, dev: Device) -> None:
        # What the executor writes into every timeline of this clock's actions.
        self.emulated = {"device": dev.name, "source": dev.source}
        self.free_at = 0.0
        self._ready = 0.0
        self._start: float | None = None
        self._queued: collections.deque[float] = collections.deque(maxlen=QUEUE_DEPTH)

    def begin(self, received: torch.Tensor | None = None) -> None:
        """An action starts; ``received`` is the stamped tensor it waited for (None: no input)."""
        self._ready = 0.0 if received is None else read_stamp(received)
        self._start = None

    def run(self, seconds: float) -> None:
        """Queue ``seconds`` of device work: it starts when the device is free, the action's input is
        ready and the host issues it (now); block until the work queued :data:`QUEUE_DEPTH` pieces
        ago has started (this one, with a depth of 1)."""
        start = max(self.free_at, self._ready, time.time())
        if self._start is None:
            self._start = start
        self.free_at = start + seconds
        self._queued.append(start)
        sleep_until(self._queued[0])

    def end(self) -> tuple[float, float]:
        """``(start, end)`` device seconds of the action since :meth:`begin` (its first work's start,
        its last work's end; both the free time if it queued none)."""
        return (self.free_at if self._start is None else self._start), self.free_at

    def stamp(self, tensor: torch.Tensor, at: float) -> torch.Tensor:
        """A tensor of ``tensor``'s shape and dtype to send in its place, stamped as computed at ``at``.

        Raises:
            ValueError: the tensor is smaller than the 8-byte stamp.
        """
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        _stamp_bytes(out)[:] = torch.tensor([at], dtype=torch.float64).view(torch.uint8)
        return out

    def synchronize(self) -> None:
        """Block until the device has finished the work queued so far."""
        sleep_until(self.free_at)


def _stamp_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() * tensor.element_size() < STAMP_BYTES:
        raise ValueError(f"an emulated pipeline tensor needs at least {STAMP_BYTES} bytes, got shape "
                         f"{tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip
    return tensor.reshape(-1).view(torch.uint8)[:STAMP_BYTES]


def read_stamp(tensor: torch.Tensor) -> float:
    """The device time (``time.time()`` seconds) a tensor from :meth:`DeviceClock.stamp` was computed at."""
    return _stamp_bytes(tensor.detach()).clone().view(torch.float64).item()


class _Wait(torch.autograd.Function):
    """Identity whose backward runs ``seconds`` on ``clock``: the emulated cost of the gradient that passes it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float, clock: DeviceClock) -> torch.Tensor:
        ctx.seconds, ctx.clock = seconds, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.run(ctx.seconds)
        return grad, None, None


class _Join(torch.autograd.Function):
    """``h`` unchanged, made to depend on the stage's parameter ``w`` (zero gradient)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w_shape = w.shape
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.w_shape)


class EmulatedStages(nn.Module):
    """A pipeline rank's stages on an emulated device, called like the pruned model by the executor.

    Each stage's forward runs its :func:`stage_times` forward time on :attr:`clock` (this rank's
    :class:`DeviceClock`, which the executor must be given) and returns a ``[B, S, dim]`` tensor
    (``dtype``): the shape the real stage sends, so transfers are real-sized. The last stage returns
    that too, not logits (its head's time is in its forward time); use :func:`emulated_loss`.
    Backward runs the input-gradient time on the path to the stage input and the weight-gradient
    time on the path to the stage's one-element parameter, so a split backward (``zb_h1``) runs each
    part in its own action and a whole backward runs their sum.

    Args:
        cfg: the emulated model. stage_layers: ``{stage: [layer keys]}`` of this rank. n_stages: all
            stages of the pipeline. seq_len, micro_batch: the shape of a micro-batch. dev: the device.
        with_head: the last stage also pays the output head (False: equal stages, the premise of the
            schedules' bubble formulas).

    Raises:
        ValueError: a stage without layers.
    """

    def __init__(self, cfg: ModelConfig, stage_layers: dict[int, list[str]], n_stages: int, seq_len: int,
                 micro_batch: int, dev: Device, dtype: torch.dtype = torch.bfloat16,
                 with_head: bool = True):  # fmt: skip
        super().__init__()
        if any(not layers for layers in stage_layers.values()):
            raise ValueError(f"every pipeline stage needs at least one layer, got {stage_layers}")
        self.cfg, self.dev, self.dtype = cfg, dev, dtype
        self.stage_of = {tuple(layers): stage for stage, layers in stage_layers.items()}
        self.times = {stage: stage_times(cfg, len(layers), with_head and stage == n_stages - 1, seq_len, micro_batch,
                                         dev) for stage, layers in stage_layers.items()}  # fmt: skip
        self.weights = nn.ParameterDict({str(s): nn.Parameter(torch.zeros(1)) for s in stage_layers})
        self._embedded: dict[tuple[int, ...], torch.Tensor] = {}
        self.clock = DeviceClock(dev)

    def forward(self, x: torch.Tensor, start_pos: int = 0, layers: Sequence[str] | None = None) -> torch.Tensor:
        """Run the forward time of the stage running ``layers``; ``x`` is ``LongTensor[B, S]`` tokens
        or ``[B, S, dim]`` hidden states. Returns ``[B, S, dim]``.

        Raises:
            KeyError: ``layers`` is not one of this rank's stages.
        """
        stage = self.stage_of[tuple(layers or ())]
        times = self.times[stage]
        self.clock.run(times.forward)
        h = x if x.is_floating_point() else self._embedding(tuple(x.shape))
        weight = _Wait.apply(self.weights[str(stage)], times.weight_grad, self.clock)
        return _Wait.apply(_Join.apply(h, weight), times.input_grad, self.clock)

    def _embedding(self, shape: tuple[int, ...]) -> torch.Tensor:
        # One zero tensor per token shape, never written: allocating it per forward would add CPU time.
        if shape not in self._embedded:
            self._embedded[shape] = torch.zeros(*shape, self.cfg.dim, dtype=self.dtype)
        return self._embedded[shape]


class _Loss(torch.autograd.Function):
    """A zero scalar whose gradient is the incoming one broadcast (a view, no copy) to ``out``'s shape."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = out.shape, out.dtype
        return out.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.dtype).expand(ctx.shape)


def emulated_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of an emulated last stage: a zero scalar (``targets`` unused) that costs no CPU time, so
    the stage's time is only what the cost model gave (the head and loss are in its forward time).
    Its gradient reaches the stage as a ``[B, S, dim]`` tensor like a real one."""
    return _Loss.apply(out)


def replayed_step_s(cfg: ModelConfig, stage_layers: dict[int, list[str]], schedule: Sequence[Sequence],
                    pp: int, v: int, seq_len: int, micro_batch: int, dev: Device,
                    with_head: bool = True) -> float:  # fmt: skip
    """The step time, seconds, a host that keeps up would record: ``schedule`` (every rank's
    actions) replayed by ``schedule.simulate`` with each stage's :func:`stage_times` (zero
    communication time) until its last action ends. ``stage_layers``: ``{stage: [layer keys]}``
    of every stage."""
    n_stages = pp * v
    split = any(a.kind == "W" for actions in schedule for a in actions)
    durations: dict[tuple[str, int], float] = {}
    for stage, layers in stage_layers.items():
        t = stage_times(cfg, len(layers), with_head and stage == n_stages - 1, seq_len, micro_batch, dev)
        durations |= {("F", stage): t.forward, ("B", stage): t.input_grad if split else t.backward,
                      ("W", stage): t.weight_grad}  # fmt: skip
    timeline = simulate([list(a) for a in schedule], pp, v, stage_times=durations)
    return max(end for lane in timeline for _, _, end in lane)


def even_stage_layers(n_layers: int, n_stages: int) -> dict[int, list[str]]:
    """``{stage: [layer keys]}`` of ``n_stages`` equal stages (``n_layers // n_stages`` layers each;
    the remainder is left out, so the stages are equal as the bubble formulas assume)."""
    per_stage = n_layers // n_stages
    return {s: [str(s * per_stage + i) for i in range(per_stage)] for s in range(n_stages)}


def measure_step(comm: PipelineComm, cfg: ModelConfig, schedule: str, n_micro: int, v: int, seq_len: int,
                 micro_batch: int, dev: Device, timeline: bool = False) -> dict:  # fmt: skip
    """One training step of ``schedule`` on emulated devices over ``comm``'s pipeline ranks (every
    rank calls it), on equal stages without the output head (the premise of the bubble formulas).

    Returns (equal on every rank): ``bubble`` (measured by the executor: mean over ranks of idle /
    step), ``theory`` (``schedule.theoretical_bubble`` with the model's action times), ``step_s``
    (the step on the device clocks), ``replayed_s`` (:func:`replayed_step_s`) and
    ``wall_s`` (this rank's wall-clock seconds in ``train_step``, the closing exchange included)
    and, with ``timeline``, ``timeline``: the executor's ``timeline.json`` document of the step.
    """
    pp = comm.pp
    every = even_stage_layers(cfg.n_layers, pp * v)
    mine = {s: every[s] for s in rank_stages(comm.pp_rank, pp, v)}
    model = EmulatedStages(cfg, mine, pp * v, seq_len, micro_batch, dev, with_head=False)
    executor = PipelineExecutor(model, mine, schedule, n_micro, pp, v, comm, clock=model.clock)
    replayed = replayed_step_s(cfg, every, executor.all_actions, pp, v, seq_len, micro_batch, dev, with_head=False)
    t = next(iter(model.times.values()))
    theory = theoretical_bubble(schedule, pp, n_micro, v, forward_time=t.forward, backward_time=t.backward,
                                weight_time=t.weight_grad)  # fmt: skip
    tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    # The hosts start together, as a training loop's do after the previous step's collectives: a
    # host still busy with set-up would issue its first action late and stall the pipeline.
    dist.barrier(group=comm.groups["activation"])
    started = time.perf_counter()
    executor.train_step([(tokens, tokens)] * n_micro, emulated_loss)
    wall = time.perf_counter() - started
    record = executor.last_record
    out = {"bubble": record.bubble_fraction, "theory": theory, "step_s": record.step_s, "replayed_s": replayed,
           "wall_s": wall}  # fmt: skip
    return out | {"timeline": executor.timeline(1)} if timeline else out
