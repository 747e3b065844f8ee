"""The one executor that runs any pipeline schedule: this rank's list of forward and backward
actions, in order, with point-to-point transfers between stages.

Before an action it waits for its input (an activation from the previous stage, or the
gradient of its output from the next one); the receive was posted earlier when the channel's
shape was already agreed, so the transfer overlaps the previous action's compute. After an
action it starts sending its result and moves on. Every action's start and end are
recorded by the executor's clock (:class:`WallClock` on real devices; an emulated device's own
clock, ``emulated.DeviceClock``, which also stamps what is sent with when it was computed); after
the step the pipeline ranks exchange them (one all-gather, which also carries the loss from the
last stage), giving the measured bubble: idle time over step time.

Gradient synchronisation over data-parallel ranks happens once per step: every backward but
the last one of each stage runs under ``sync.no_sync()``, and the last one of each stage lets
the synchronizer's hooks reduce that stage's gradients (overlapping the remaining backwards).

Zero-bubble schedules (``zb_h1``) split each backward (see ``split_backward``): ``B`` computes the
input gradient only and sends it upstream at once; ``W`` later accumulates the parameters'
gradients and releases the micro-batch's graph. There the ``W`` actions are the backwards that
accumulate, so the no-sync rule applies to them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.pipeline.schedule import (
    SPLIT_BACKWARD,
    Action,
    bubble_fraction,
    build_schedule,
    forward_only_schedule,
    stage_rank,
    theoretical_bubble,
)
from loomtrain.distributed.pipeline.split_backward import WeightGrad, backward_input
from loomtrain.hardware import synchronize

TIMELINE_FORMAT = "loomtrain-timeline-1"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepRecord:
    """What one pipeline step measured, for every pipeline rank.

    Attributes:
        actions: per pipeline rank, its actions in execution order.
        intervals: per pipeline rank, ``(start, end)`` wall-clock seconds (``time.time``) of each action.
        bubble_fraction: mean over ranks of idle time / step time (see ``schedule.bubble_fraction``).
    """

    actions: list[list[Action]]
    intervals: list[list[tuple[float, float]]]
    bubble_fraction: float

    @property
    def step_s(self) -> float:
        """Seconds from the step's first action start to its last action end, over all ranks."""
        times = [t for lane in self.intervals for span in lane for t in span]
        return max(times) - min(times)


class WallClock:
    """Action times as the host sees them: ``time.time()`` seconds once the device's queued work is done.

    The interface the executor times actions through (``emulated.DeviceClock`` is the other one):
    :meth:`begin` before an action's compute, :meth:`end` after it, :meth:`stamp` on what it sends,
    :meth:`synchronize` at the end of a step.
    """

    emulated = None  # real times: nothing for a timeline to flag

    def __init__(self, device: torch.device):
        self.device, self._start = device, 0.0

    def begin(self, received: torch.Tensor | None = None) -> None:
        """An action starts (``received``: the tensor it waited for; unused here)."""
        synchronize(self.device)
        self._start = time.time()

    def end(self) -> tuple[float, float]:
        """``(start, end)`` seconds of the action: an action's end is when its kernels end."""
        synchronize(self.device)
        return self._start, time.time()

    def stamp(self, tensor: torch.Tensor, at: float) -> torch.Tensor:
        """What to send for ``tensor``: the tensor itself."""
        return tensor

    def synchronize(self) -> None:
        """Wait for the device's queued work."""
        synchronize(self.device)


@dataclass
class _Pending:
    recvs: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    weights: dict[tuple[int, int], WeightGrad] = field(default_factory=dict)
    posted: int = 0


class PipelineExecutor:
    """Runs a schedule's actions for one pipeline rank of a model pruned to its stages.

    Args:
        model: the rank's part of the model (see ``models.parallelize.prune_to_rank``), called as
            ``model(x, start_pos, layers=keys)`` per stage.
        stage_layers: ``{stage: [layer keys]}`` for this rank's stages.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zb_h1"``.
        n_micro: micro-batches per training step; ``pp``, ``v``: pipeline degree and virtual stages.
        comm: the rank's :class:`PipelineComm`.
        clock: what times the actions (default: a :class:`WallClock` on ``comm.device``).

    Raises:
        ScheduleError: the schedule does not fit ``pp``, ``v`` and ``n_micro``.
    """

    def __init__(self, model: torch.nn.Module, stage_layers: dict[int, list[str]], schedule: str, n_micro: int,
                 pp: int, v: int, comm: PipelineComm, clock=None):  # fmt: skip
        self.model, self.stage_layers, self.comm = model, stage_layers, comm
        self.clock = WallClock(comm.device) if clock is None else clock
        self.schedule_name, self.n_micro, self.pp, self.v = schedule, n_micro, pp, v
        self.n_stages = pp * v
        self.all_actions = build_schedule(schedule, pp, n_micro, v)
        self.actions = self.all_actions[comm.pp_rank]
        self.split = schedule in SPLIT_BACKWARD
        accumulating = "W" if self.split else "B"  # the actions that write parameter gradients
        self.last_backward = {a.stage: i for i, a in enumerate(self.actions) if a.kind == accumulating}
        self.last_record: StepRecord | None = None

    def _source(self, a: Action) -> tuple[str, int] | None:
        """The receive an action waits for: (kind, from pp rank), or None."""
        if a.kind == "F" and a.stage > 0:
            return "activation", stage_rank(a.stage - 1, self.pp)
        if a.kind == "B" and a.stage < self.n_stages - 1:
            return "gradient", stage_rank(a.stage + 1, self.pp)
        return None

    def _post_until(self, actions: Sequence[Action], state: _Pending, limit: int, only_agreed: bool) -> None:
        # Receives are posted strictly in action order: on each channel that is the sender's order.
        while state.posted < min(limit, len(actions)):
            a = actions[state.posted]
            source = self._source(a)
            if source is not None:
                kind, src = source
                if only_agreed and not self.comm.agreed(src, kind):
                    return
                state.recvs[(a.kind, a.stage, a.micro_batch)] = self.comm.recv(src, kind)
            state.posted += 1

    def _prefetch(self, actions: Sequence[Action], state: _Pending, i: int) -> None:
        self._post_until(actions, state, i + 1, only_agreed=False)
        nxt = next((j for j in range(i + 1, len(actions)) if self._source(actions[j]) is not None), None)
        if nxt is not None:
            self._post_until(actions, state, nxt + 1, only_agreed=True)

    def _received(self, a: Action, state: _Pending) -> torch.Tensor:
        work, buffer = state.recvs.pop((a.kind, a.stage, a.micro_batch))
        work.wait()
        return buffer

    def train_step(
        self,
        micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: LossFn,
        start_pos: int = 0,
        scale: float = 1.0,
        sync=None,
        autocast=contextlib.nullcontext,
    ) -> float:
        """Forward and backward of ``micro_batches`` (``[(tokens, targets)]``, each
        ``LongTensor[micro_batch, seq]``, this rank's sequence slice starting at ``start_pos``)
        through the pipeline; the loss of the last stage's micro-batch is ``loss_fn(logits,
        targets)``, and backward starts from ``loss · scale / n_micro``.

        Returns the mean loss over micro-batches (on every pipeline rank); the step's timings
        are in :attr:`last_record`.

        Raises:
            ValueError: ``len(micro_batches)`` differs from ``n_micro``.
        """
        if len(micro_batches) != self.n_micro:
            raise ValueError(
                f"the pipeline was built for {self.n_micro} micro-batches per step, got {len(micro_batches)}"
            )
        state, intervals, loss_sum = _Pending(), [], torch.zeros((), dtype=torch.float64)
        for i, a in enumerate(self.actions):
            self._prefetch(self.actions, state, i)
            if a.kind == "F":
                span, loss = self._forward(a, micro_batches, loss_fn, start_pos, state, autocast, train=True)
                if loss is not None:
                    loss_sum += loss.detach().double().cpu()
            elif a.kind == "B" and self.split:
                span = self._backward_input(a, state, scale / self.n_micro)
            else:
                quiet = sync is not None and self.last_backward[a.stage] != i
                with sync.no_sync() if quiet else contextlib.nullcontext():
                    span = self._backward(a, state, scale / self.n_micro)
            intervals.append(span)
        self.clock.synchronize()
        self.comm.finish_sends()
        loss, self.last_record = self._exchange(self.actions, intervals, loss_sum, self.all_actions)
        return loss / self.n_micro

    @torch.no_grad()
    def eval_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn,
                  start_pos: int = 0, autocast=contextlib.nullcontext) -> float:  # fmt: skip
        """Mean loss of ``micro_batches`` (any number) through the pipeline, forwards only
        (``forward_only_schedule``); on every pipeline rank."""
        all_actions = forward_only_schedule(self.pp, len(micro_batches), self.v)
        actions = all_actions[self.comm.pp_rank]
        state, intervals, loss_sum = _Pending(), [], torch.zeros((), dtype=torch.float64)
        for i, a in enumerate(actions):
            self._prefetch(actions, state, i)
            span, loss = self._forward(a, micro_batches, loss_fn, start_pos, state, autocast, train=False)
            if loss is not None:
                loss_sum += loss.double().cpu()
            intervals.append(span)
        self.clock.synchronize()
        self.comm.finish_sends()
        loss, _ = self._exchange(actions, intervals, loss_sum, all_actions)
        return loss / len(micro_batches)

    def _forward(self, a: Action, micro_batches, loss_fn: LossFn, start_pos: int, state: _Pending, autocast,
                 train: bool) -> tuple[tuple[float, float], torch.Tensor | None]:  # fmt: skip
        tokens, targets = micro_batches[a.micro_batch]
        x = tokens if a.stage == 0 else self._received(a, state).requires_grad_(train)
        self.clock.begin(None if a.stage == 0 else x)
        with autocast():
            out = self.model(x, start_pos, layers=self.stage_layers[a.stage])
            loss = loss_fn(out, targets) if a.stage == self.n_stages - 1 else None
        span = self.clock.end()
        if loss is None:
            self.comm.send(self.clock.stamp(out, span[1]), stage_rank(a.stage + 1, self.pp), "activation")
        if train:
            state.saved[(a.stage, a.micro_batch)] = (x, out if loss is None else loss)
        return span, loss

    def _backward(self, a: Action, state: _Pending, loss_factor: float) -> tuple[float, float]:
        if a.kind == "W":
            self.clock.begin()
            state.weights.pop((a.stage, a.micro_batch)).run()
            return self.clock.end()
        x, out = state.saved.pop((a.stage, a.micro_batch))
        grad = None if a.stage == self.n_stages - 1 else self._received(a, state)
        self.clock.begin(grad)
        if grad is None:
            (out * loss_factor).backward()
        else:
            torch.autograd.backward(out, grad)
        span = self.clock.end()
        if a.stage > 0:
            self.comm.send(self.clock.stamp(x.grad, span[1]), stage_rank(a.stage - 1, self.pp), "gradient")
        return span

    def _backward_input(self, a: Action, state: _Pending, loss_factor: float) -> tuple[float, float]:
        """A split schedule's ``B``: the input gradient only, sent at once; the weight gradient waits for ``W``."""
        x, out = state.saved.pop((a.stage, a.micro_batch))
        last = a.stage == self.n_stages - 1
        grad = None if last else self._received(a, state)
        self.clock.begin(grad)
        dx, state.weights[(a.stage, a.micro_batch)] = backward_input(out * loss_factor if last else out, x, grad)
        span = self.clock.end()
        if a.stage > 0:
            self.comm.send(self.clock.stamp(dx, span[1]), stage_rank(a.stage - 1, self.pp), "gradient")
        return span

    def timeline(self, step: int) -> dict:
        """:attr:`last_record` as the run directory's ``timeline.json`` document (read by
        ``loomtrain report``): every action's start and end in seconds from the step's first
        action on any pipeline rank.

        Raises:
            RuntimeError: no training step has run yet.
        """
        record = self.last_record
        if record is None:
            raise RuntimeError("no pipeline step has run yet: nothing to put in a timeline")
        origin = min(start for spans in record.intervals for start, _ in spans)
        ranks = [
            {
                "pp_rank": r,
                "global_rank": dist.get_global_rank(self.comm.groups["activation"], r),
                "events": [{"kind": a.kind, "stage": a.stage, "micro_batch": a.micro_batch,
                            "start": start - origin, "end": end - origin}
                           for a, (start, end) in zip(actions, spans, strict=True)],
            }
            for r, (actions, spans) in enumerate(zip(record.actions, record.intervals, strict=True))
        ]  # fmt: skip
        theory = theoretical_bubble(self.schedule_name, self.pp, self.n_micro, self.v)
        return {
            "format": TIMELINE_FORMAT,
            "schedule": self.schedule_name,
            "pp": self.pp,
            "virtual_stages": self.v,
            "micro_batches": self.n_micro,
            **({} if self.clock.emulated is None else {"emulated": self.clock.emulated}),
            "steps": [{"step": step, "bubble_fraction": record.bubble_fraction, "theoretical_bubble": theory,
                       "ranks": ranks}],
        }  # fmt: skip

    def _exchange(self, actions, intervals, loss_sum, all_actions) -> tuple[float, StepRecord]:
        """One all-gather over the pipeline ranks: every rank's action intervals and loss sum
        (non-zero only on the rank holding the last stage)."""
        mine = torch.tensor([*(t for span in intervals for t in span), loss_sum.item()], dtype=torch.float64)
        mine = mine.to(self.comm.device)
        gathered = [torch.empty_like(mine) for _ in range(self.pp)]
        dist.all_gather(gathered, mine, group=self.comm.groups["activation"])
        per_rank = [g.cpu().tolist() for g in gathered]
        spans = [list(zip(v[:-1:2], v[1:-1:2], strict=True)) for v in per_rank]
        record = StepRecord(all_actions, spans, bubble_fraction(spans))
        return sum(v[-1] for v in per_rank), record
