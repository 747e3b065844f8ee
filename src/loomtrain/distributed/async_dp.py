"""Asynchronous local SGD with bounded staleness (``data_parallel.mode = "async"``).

One rank (the **server**, rank 0 of the group) holds the global model ``θ_global`` and the outer
optimizer; every other rank is a **worker**. No worker ever waits for another (Dean et al.,
"Large Scale Distributed Deep Networks", NeurIPS 2012, the parameter-server pattern; for
language models with local steps: Liu et al., "Asynchronous Local-SGD Training for Language
Modeling", arXiv:2401.09135, 2024)::

    worker:  receive (θ_global, version v, round k) → θ_local ← θ_global
             H inner optimizer steps on round k's batches
             send Δ = θ_received − θ_local, tagged with v → receive the next model, go on
    server:  on each Δ (whichever worker sends first): τ = version − v (outer updates applied
             since that worker received its model)
             τ > max_staleness: rejected (not applied)
             else θ_global ← OuterSGD(θ_global, w(τ)·Δ), version += 1
             reply with θ_global and the worker's next round (or PAUSE / STOP)

``w(τ) = 1/W`` (``staleness_policy = "reject"``) or ``1/(W·(1+τ))`` (``"scale"``), ``W`` workers.
``1/W``: each delta is one worker's share of what a DiLoCo outer step averages over ``W``
replicas, so one round of every worker moves ``θ_global`` about as far as one DiLoCo outer
step (our choice; with ``W = 1`` it is 1). ``1/(1+τ)``: staleness-aware scaling of the update
(Zhang et al., "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016, divide the
learning rate by τ; ``1 + τ`` leaves a fresh delta unscaled). The outer optimizer is DiLoCo's
(Douillard et al. 2023, §3: SGD with Nesterov momentum 0.9, learning rate 0.7), a Nesterov step
per applied delta; with ``outer_momentum_delay = N > 1`` it is Liu et al.'s Delayed Nesterov
(:class:`DelayedNesterov`): the momentum moves once per N deltas, on their mean, so a stale
delta is not multiplied by the momentum again at every later delta.

Replicas of several ranks (tp, a pipeline, or dp_shard ranks with ZeRO inside; cut as the
sync-family modes cut them, :class:`AsyncLayout`): the server is replica 0, holding ``θ_global``
split as every replica splits its model, with the outer state sharded alike; the rank at position
``j`` of a worker replica exchanges only with the server's rank ``j``. The server's first rank
(the leader) decides the order of every exchange and tells its other ranks, which repeat it on
their shards (:class:`ServerMirror`, :class:`ServerFollower`).

Transport: point-to-point messages on a gloo group (``dist.isend``/``dist.irecv``; the server
receives from any source, ``src=None``, which gloo supports and NCCL does not), CPU fp32
tensors: ``[header (HEADER numbers), payload (Σ numel)]`` in one message each way. Every wait has a
deadline (``timeout_s``): a worker that sends nothing within it after being given a round makes
the server raise :class:`AsyncTimeoutError` naming it; a worker that hears nothing from the
server within it raises too.

The work is fixed: the tokens of ``training.steps`` synchronous steps, as ``W`` lanes (one
per worker share of a synchronous batch) of ``training.steps`` steps each. :class:`RoundPlanner`
cuts each round, when a worker asks, from the lane furthest behind, never across a period of
``H`` steps, so a fast worker takes more rounds. With rounds of ``H`` steps (the default) round
``k``'s batches and learning rates depend only on ``k`` (not on the worker), ``W`` rounds of
``H`` steps per period (:func:`plan_rounds`), and with one worker the run is exactly DiLoCo with
one replica. With ``dynamic_local_steps`` (Liu et al. 2024, Dynamic Local Updates, DyLU) a
worker's round has ``max(1, ⌊H·v_w / max_j v_j⌋)`` steps (:func:`local_steps`), ``v`` the
workers' measured speeds; a step of a lane keeps its batch and learning rate whichever round
holds it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.checkpoint import StateDictSharding, read_rank_state
from loomtrain.config import DataParallelConfig
from loomtrain.data import DistributedBatchLoader, eval_batches
from loomtrain.distributed.data_parallel import CommHook
from loomtrain.distributed.local_sgd import (
    OUTER_MOMENTUM,
    LocalOnlyHook,
    _load_optimizer_state,
    by_param,
    check_identical,
    flatten,
    holding,
    load_flat_param_state,
    portable_state,
    replicas_sync_inside,
    trainable,
    whole_model_replicas,
    write_flat,
)
from loomtrain.distributed.parallel_dims import Axis, ParallelDims
from loomtrain.distributed.traffic import GRADIENT_AXIS
from loomtrain.optim import lr_at, set_lr
from loomtrain.profiling import StepProfiler

log = logging.getLogger(__name__)

# Server → worker commands (header[1]).
CONTINUE, PAUSE, STOP, PREEMPT = 0, 1, 2, 3
ENDS = {PAUSE: "pause", STOP: "done", PREEMPT: "preempt"}
# Numbers before the payload in every message (fp32: exact integers below 2**24). Server → worker:
# version, command, round index, first_step, steps, offset; worker → server: base version, round
# index, mean loss, SIGTERM seen, seconds of the round's inner steps, 0.
HEADER = 6
# The server's outer optimizer tensors (each laid out like θ_global) → their checkpoint
# param_state entries: DCP holds them by parameter, so a resume at another layout reshards them.
SERVER_ENTRIES = {"momentum_buffer": OUTER_MOMENTUM, "delta_sum": "outer_delta_sum"}


class AsyncTimeoutError(TimeoutError):
    """A peer of the asynchronous server/worker exchange sent nothing within the deadline."""


@dataclass(frozen=True)
class Round:
    """One worker's unit of work: ``steps`` inner steps of learning-rate steps ``first_step``,
    ``first_step + 1``, …, on the batches ``offset``, ``offset + 1``, … of the worker batch
    stream (each ``global_batch_size / W`` samples)."""

    index: int
    first_step: int
    steps: int
    offset: int


class RoundPlanner:
    """Cuts the run's ``steps·W`` worker steps into rounds as the workers ask (module docstring).

    Lane ``ℓ`` (of ``workers``, W) holds steps ``0 … steps−1``; in the period of ``inner_steps``
    (H) synchronous steps starting at ``P`` (length ``L``), its step ``s`` trains on worker batch
    ``P·W + ℓ·L + s − P`` at the learning rate of step ``s``: the layout of W rounds of ``L`` steps
    per period, so a step's batch and learning rate do not depend on how the lane was cut.
    ``lanes``: each lane's next step not yet handed out (all 0 at the start; a checkpoint's).

    Raises:
        ValueError: ``steps``, ``inner_steps`` or ``workers`` below 1, or ``lanes`` not W steps.
    """

    def __init__(self, steps: int, inner_steps: int, workers: int, lanes: list[int] | None = None):
        if min(steps, inner_steps, workers) < 1:
            raise ValueError(f"steps={steps}, inner_steps={inner_steps}, workers={workers} must all be at least 1")
        self.steps, self.inner_steps, self.workers = steps, inner_steps, workers
        self.lanes = [0] * workers if lanes is None else list(lanes)
        if len(self.lanes) != workers:
            raise ValueError(f"lanes={self.lanes} must hold one next step per worker ({workers})")

    @property
    def done(self) -> bool:
        """Every worker step handed out."""
        return min(self.lanes) >= self.steps

    def cut(self, index: int, length: int, before: int) -> Round | None:
        """Round ``index``: up to ``length`` steps of the lane furthest behind (the lowest such
        lane), from its next step to at most its period's end; ``None`` once every lane has
        reached ``before`` (a checkpoint's period start, or ``steps``)."""
        lane = self.lanes.index(min(self.lanes))
        first = self.lanes[lane]
        if first >= min(before, self.steps):
            return None
        start = first - first % self.inner_steps
        period = min(self.inner_steps, self.steps - start)
        count = min(length, start + period - first)
        self.lanes[lane] += count
        return Round(index, first, count, start * self.workers + lane * period + first - start)


def plan_rounds(steps: int, inner_steps: int, workers: int) -> list[Round]:
    """The rounds of a run without dynamic local steps: for each period ``p`` of ``inner_steps``
    (H) synchronous steps, ``workers`` (W) rounds of ``min(H, steps − p·H)`` steps each, so the
    rounds hold ``steps·W`` worker steps: the tokens of ``steps`` synchronous steps over W ranks.

    Raises:
        ValueError: ``steps``, ``inner_steps`` or ``workers`` below 1.
    """
    planner = RoundPlanner(steps, inner_steps, workers)
    rounds: list[Round] = []
    while (rnd := planner.cut(len(rounds), inner_steps, steps)) is not None:
        rounds.append(rnd)
    return rounds


def local_steps(cfg: DataParallelConfig, speed: float | None, speeds: list[float]) -> int:
    """Inner steps of a worker's next round: ``H`` (``inner_steps``), or with
    ``dynamic_local_steps`` Liu et al.'s Dynamic Local Updates (arXiv:2401.09135, 2024, DyLU)
    ``max(1, ⌊H·v_w / max_j v_j⌋)``: ``speed`` (``v_w``, steps/s) is this worker's last measured
    speed, ``speeds`` every worker's; a worker not measured yet (``None``) gets ``H``. The 1 keeps
    a very slow worker in the run (the paper's rule alone would give it 0 steps)."""
    h = cfg.resolved_inner_steps
    if not cfg.dynamic_local_steps or speed is None:
        return h
    return max(1, int(h * (speed / max(speeds))))  # the fastest: v/v = 1 exactly, so H


def delta_weight(tau: int, max_staleness: int, policy: str, workers: int) -> float | None:
    """The weight of a delta of staleness ``tau`` from one of ``workers`` (module docstring):
    ``None`` (rejected) above ``max_staleness``; else ``1/W``, or ``1/(W·(1+τ))`` with
    ``policy="scale"`` (Zhang et al. 2016). Under Delayed Nesterov the server passes
    ``workers=1``: the optimizer's own 1/N replaces the share."""
    if tau > max_staleness:
        return None
    return 1.0 / workers / (1 + tau if policy == "scale" else 1)


def server_delta_weight(tau: int, cfg: DataParallelConfig, workers: int) -> float | None:
    """:func:`delta_weight` as the server applies it: with Delayed Nesterov
    (``outer_momentum_delay > 1``) without the ``1/W`` share, since the optimizer divides each
    delta by its N itself (Liu et al.: ε·Δ/N per delta, the momentum on the mean of N deltas);
    both factors would shorten the step W-fold."""
    share = 1 if cfg.outer_momentum_delay > 1 else workers
    return delta_weight(tau, cfg.max_staleness, cfg.staleness_policy, share)


class DelayedNesterov(torch.optim.Optimizer):
    """Liu et al.'s Delayed Nesterov (DN) outer optimizer ("Asynchronous Local-SGD Training for
    Language Modeling", arXiv:2401.09135, 2024: the delayed Nesterov momentum update, their
    Algorithm 3): between two momentum updates a delta moves the parameters without any
    momentum term, at learning rate ε/N. Learning rate ``lr`` (ε), momentum
    ``momentum`` (β), ``delay`` (N ≥ 1). For the k-th gradient ``g`` set on a parameter ``θ``
    (any shape; the server's is 1-D fp32)::

        s ← s + g
        k mod N ≠ 0:  θ ← θ − ε·g/N                             (a plain step; m untouched)
        k mod N = 0:  m ← β·m + s/N;  θ ← θ − ε·(g/N + β·m);  s ← 0

    Over N gradients θ moves by ``−ε·(s/N + β·m)``: one Nesterov step (``torch.optim.SGD``'s
    form, ``nesterov=True``) on their mean, whose gradient part is applied as they arrive (the
    workers get a model that already holds their deltas). The state (``m``, ``s``, ``k``) is in
    :meth:`state_dict`, so a resume between two momentum updates continues exactly. With N = 1
    it is that Nesterov SGD step for step (the server then uses ``torch.optim.SGD`` itself).

    Raises:
        ValueError: ``delay < 1``, ``lr <= 0`` or ``momentum`` outside [0, 1).
    """

    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float, delay: int):
        if delay < 1 or lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"DelayedNesterov needs delay >= 1, lr > 0 and 0 <= momentum < 1 (got {delay}, {lr}, {momentum})"
            )
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One DN update of every parameter whose ``grad`` is set (class docstring); ``closure``
        is not supported (``torch.optim.Optimizer``'s signature)."""
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                self._update(p, group["lr"], group["momentum"], group["delay"])

    def _update(self, p: torch.Tensor, lr: float, beta: float, n: int) -> None:
        state = self.state[p]
        if not state:
            state.update(momentum_buffer=torch.zeros_like(p), delta_sum=torch.zeros_like(p), received=0)
        update = p.grad / n
        state["delta_sum"].add_(p.grad)
        state["received"] += 1
        if state["received"] % n == 0:
            buf = state["momentum_buffer"].mul_(beta).add_(state["delta_sum"] / n)
            update.add_(buf, alpha=beta)
            state["delta_sum"].zero_()
        p.add_(update, alpha=-lr)


def build_async_outer_optimizer(flat: torch.Tensor, cfg: DataParallelConfig) -> torch.optim.Optimizer:
    """The server's outer optimizer on ``θ_global`` (``flat``): DiLoCo's ``torch.optim.SGD``
    (Nesterov unless ``outer_nesterov`` is off or the momentum 0), or :class:`DelayedNesterov`
    when ``outer_momentum_delay > 1``."""
    if cfg.outer_momentum_delay > 1:
        return DelayedNesterov([flat], cfg.outer_lr, cfg.outer_momentum, cfg.outer_momentum_delay)
    return torch.optim.SGD([flat], lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                           nesterov=cfg.outer_nesterov and cfg.outer_momentum > 0)  # fmt: skip


class AsyncOuter:
    """The asynchronous mode's state on every rank (what the trainer checkpoints and evaluates).

    ``θ_global`` is one flat fp32 tensor of ``Σ p.numel()`` elements (``params`` order, what this
    rank holds of each: its tp shard, stage or ZeRO rows): on the server the global model, on a
    worker the model it last received (its delta's base). The outer optimizer
    (:func:`build_async_outer_optimizer`: SGD with DiLoCo's defaults from ``cfg``, or Delayed
    Nesterov) steps it on the server only. ``group``: where the initial parameters are checked
    identical (a collective). ``written``: called whenever θ_global has been written into the
    parameters (ZeRO's ``after_step``: its full copies follow its masters).

    Attributes:
        version: outer updates applied (server); the received model's version (worker).
        next_round: rounds handed out and settled (server; at a pause every handed-out round is).
        worker_steps: worker steps of the settled rounds (server).
        lanes: each lane's next step not yet handed out (server, :class:`RoundPlanner`; empty
            until the run plans).
        speeds: worker rank → its last round's inner steps per second (server).
        applied: τ → number of applied deltas with that staleness (server).
        rejected: τ → number of rejected deltas (server).
        local_steps: inner steps → number of applied deltas of rounds that long (server).
        wait_s: seconds spent waiting for messages (server: for any delta; worker: for replies).
    """

    def __init__(self, params: list[nn.Parameter], inner_optimizer: torch.optim.Optimizer, cfg: DataParallelConfig,
                 group: dist.ProcessGroup | None = None, hook: CommHook | None = None,
                 written: Callable[[], None] = lambda: None):  # fmt: skip
        self.params, self.inner_optimizer, self.cfg = list(params), inner_optimizer, cfg
        self.hook = hook if hook is not None else LocalOnlyHook()
        self.written = written
        self.global_flat = flatten(self.params)
        if group is not None:
            check_identical(self.global_flat, group, "the initial parameters")
        self.outer_optimizer = build_async_outer_optimizer(self.global_flat, cfg)
        self.version = self.next_round = self.worker_steps = 0
        self.lanes: list[int] = []
        self.speeds: dict[int, float] = {}
        self.applied: Counter[int] = Counter()
        self.rejected: Counter[int] = Counter()
        self.local_steps: Counter[int] = Counter()
        self.wait_s = 0.0

    @property
    def outer_steps(self) -> int:
        """Outer updates applied (the server's count; a worker's is the last version it saw)."""
        return self.version

    @torch.no_grad()
    def apply(self, delta: torch.Tensor, weight: float) -> None:
        """One outer step: ``θ_global ← OuterOpt(θ_global, weight·delta)``; ``delta`` is 1-D fp32
        (scaled in place)."""
        self.global_flat.grad = delta.mul_(weight)
        self.outer_optimizer.step()
        self.global_flat.grad = None
        self.version += 1

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """Inside it, the parameters hold ``θ_global``; this rank's own are back afterwards."""
        return holding(self.params, self.global_flat, self.written)

    def take_global(self) -> None:
        """The parameters become ``θ_global`` (a worker's new base; every rank at the end)."""
        write_flat(self.global_flat, self.params)
        self.written()

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: ``mode`` ("async"), ``global`` (1-D fp32 copy),
        ``outer_optimizer`` (with Delayed Nesterov also its delta sum and count), ``version``,
        ``next_round``, ``worker_steps``, ``lanes`` and ``speeds`` (what the next rounds' cuts
        depend on), ``inner_steps``, ``outer_momentum_delay``, ``applied`` and ``rejected`` (τ →
        count), ``local_steps`` (steps → count) and ``inner_optimizer`` (this rank's optimizer
        state, ZeRO's DTensor moments as this rank's local tensors)."""
        return {
            "mode": "async", "global": self.global_flat.clone(), "outer_optimizer": self.outer_optimizer.state_dict(),
            "version": self.version, "next_round": self.next_round, "worker_steps": self.worker_steps,
            "lanes": list(self.lanes), "speeds": dict(self.speeds),
            "inner_steps": self.cfg.resolved_inner_steps, "outer_momentum_delay": self.cfg.outer_momentum_delay,
            "applied": dict(self.applied), "rejected": dict(self.rejected), "local_steps": dict(self.local_steps),
            "inner_optimizer": portable_state(self.inner_optimizer),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output. ``None`` or another mode's state (a checkpoint of
        another layout or mode): the loaded parameters become ``θ_global``, the outer momentum
        restarts at zero, and :attr:`next_round` stays 0 for the caller to place (with a warning;
        :func:`resume_at_another_layout` decides about the inner optimizer state).

        Raises:
            ValueError: the saved ``θ_global`` has another number of elements, or the state
                was saved with another ``inner_steps`` (its round counter means other rounds)
                or ``outer_momentum_delay`` (its outer optimizer state is another's).
        """
        if state is None or state.get("mode") != "async":
            if not dist.is_initialized() or dist.get_rank() == 0:  # every rank drops its state alike: one line
                log.warning(
                    "no async state for this rank in the checkpoint (another layout or mode): the loaded "
                    "parameters become θ_global, the outer momentum starts at 0"
                )
            self.global_flat.copy_(flatten(self.params))
            return
        self._restore_server(state)
        _load_optimizer_state(self.inner_optimizer, state["inner_optimizer"])
        self.next_round, self.worker_steps = state["next_round"], state["worker_steps"]
        # Checkpoints written before dynamic local steps lack these; run_async replays their lanes.
        self.lanes, self.speeds = list(state.get("lanes", [])), dict(state.get("speeds", {}))
        self.take_global()

    def adopt_server_state(self, state: dict[str, Any], resharded: dict[str, torch.Tensor] | None = None) -> None:
        """Resume at another layout with the saved server leader's ``state`` (its
        :meth:`state_dict`, rank 0's file): the version and the staleness counts carry over, and
        the outer optimizer state (momentum, Delayed Nesterov's window). ``resharded`` ``None``
        (one-rank servers holding the whole model there and here): ``state``'s own optimizer
        state and ``θ_global``. Otherwise ``state``'s scalars (Delayed Nesterov's delta count)
        with ``resharded``'s tensors (by optimizer state key, each 1-D fp32 laid out like
        ``θ_global``: the checkpoint's, resharded to this rank, :func:`load_server_tensors`), and
        ``θ_global`` stays the loaded model; empty on a worker, whose outer optimizer then keeps
        no state (it never steps). The round plan, the workers' speeds and the inner optimizer
        states start afresh (the workers are others; :meth:`forget_inner_state`), the plan from
        the checkpoint's step.

        Raises:
            ValueError: as :meth:`load_state_dict` for another model, ``inner_steps`` or
                ``outer_momentum_delay``.
        """
        if resharded is None:
            self._restore_server(state)
        else:
            self._check_saved_settings(state)
            self.global_flat.copy_(flatten(self.params))
            if resharded:
                saved = state["outer_optimizer"]["state"][0]
                _load_optimizer_state(self.outer_optimizer, {"state": {0: {**saved, **resharded}}})
            self._restore_counts(state)
        self.forget_inner_state()
        self.take_global()

    def _restore_server(self, state: dict[str, Any]) -> None:
        """``θ_global``, the outer optimizer state, the version and the applied/rejected/local-step
        counts of ``state``, after checking its settings and size (see :meth:`load_state_dict`)."""
        self._check_saved_settings(state)
        if state["global"].numel() != self.global_flat.numel():
            raise ValueError(
                f"the checkpoint's θ_global has {state['global'].numel()} elements, this model "
                f"{self.global_flat.numel()}: resume with the model settings it was saved with"
            )
        self.global_flat.copy_(state["global"])
        _load_optimizer_state(self.outer_optimizer, state["outer_optimizer"])
        self._restore_counts(state)

    def _restore_counts(self, state: dict[str, Any]) -> None:
        """The version and the applied/rejected/local-step counts of ``state`` (the same for any
        split of the server)."""
        self.version = state["version"]
        self.applied, self.rejected = Counter(state["applied"]), Counter(state["rejected"])
        self.local_steps = Counter(state.get("local_steps", {}))

    def param_state(self, named: list[tuple[str, nn.Parameter]]) -> dict[str, dict[str, torch.Tensor]]:
        """The outer optimizer's tensors (SGD's momentum; Delayed Nesterov's also its delta sum)
        by parameter of ``named`` (this rank's ``(name, parameter)`` pairs, :attr:`params`
        order), under their :data:`SERVER_ENTRIES` names: what the server adds to a checkpoint's
        DCP state (``checkpoint.TrainState.param_state``; views, shaped as
        :func:`~loomtrain.distributed.local_sgd.by_param` shapes them). Empty before the first
        applied delta and with ``outer_momentum=0`` (:func:`server_param_state` asks the server
        alone).

        Raises:
            ValueError: ``named`` does not lay out ``θ_global`` (another list of parameters).
        """
        state = self.outer_optimizer.state.get(self.global_flat, {})
        return {SERVER_ENTRIES[key]: by_param(value, named) for key, value in state.items() if key in SERVER_ENTRIES}

    def forget_inner_state(self) -> None:
        """Drop the inner optimizer's state (its moments start at zero, as on a fresh worker). At
        another layout the checkpoint's DCP copy of it is no one's: DCP keeps one copy of each
        tensor it takes as replicated, and async's server ranks (whose optimizer never stepped)
        and workers hold different ones, so the copy can pair one worker's second moment with the
        server's zero first moment."""
        self.inner_optimizer.state.clear()

    def _check_saved_settings(self, state: dict[str, Any]) -> None:
        """Raise unless ``state`` was saved with this run's ``inner_steps`` and
        ``outer_momentum_delay`` (1 in checkpoints written before it existed)."""
        saved = {"inner_steps": state["inner_steps"], "outer_momentum_delay": state.get("outer_momentum_delay", 1)}
        ours = {"inner_steps": self.cfg.resolved_inner_steps, "outer_momentum_delay": self.cfg.outer_momentum_delay}
        for name, value in saved.items():
            if value != ours[name]:
                raise ValueError(
                    f"the checkpoint's async state was saved with data_parallel.{name}={value}, this run has "
                    f"{ours[name]}: resume with data_parallel.{name}={value}"
                )

    def summary_fields(self) -> dict[str, Any]:
        """``outer_sync_s``, ``outer_steps`` and the staleness record for ``summary.json``:
        ``staleness_applied`` / ``staleness_rejected`` (τ → count), ``staleness_max_applied``, and
        beside it ``local_steps_applied`` (inner steps of a round → applied deltas)."""
        return {
            "outer_sync_s": self.wait_s, "outer_steps": self.version,
            "staleness_applied": {str(k): v for k, v in sorted(self.applied.items())},
            "staleness_rejected": {str(k): v for k, v in sorted(self.rejected.items())},
            "staleness_max_applied": max(self.applied, default=0),
            "local_steps_applied": {str(k): v for k, v in sorted(self.local_steps.items())},
        }  # fmt: skip


@dataclass(frozen=True)
class Settled:
    """What the server did with one returned round: the worker's global rank, the round, the
    delta's staleness ``tau``, its ``weight`` (``None``: rejected), the version after it, the
    worker's mean inner loss over the round (nats) and its measured speed (inner steps/s)."""

    worker: int
    round: Round
    tau: int
    weight: float | None
    version: int
    loss: float
    speed: float


def _wait(work: dist.Work, seconds: float, what: Callable[[], str]) -> None:
    """``work.wait`` with a deadline of ``seconds``; past it, :class:`AsyncTimeoutError` saying
    ``what()``."""
    try:
        work.wait(timeout=timedelta(seconds=max(seconds, 0.001)))
    except RuntimeError as err:
        if "Timed out" not in str(err):
            raise
        raise AsyncTimeoutError(what()) from err


def send_model(outer: AsyncOuter, group: dist.ProcessGroup, dst: int, command: int, fields: list[int],
               timeout_s: float) -> None:  # fmt: skip
    """Send global rank ``dst`` the header (version, ``command``, the round's four ``fields``)
    and this rank's ``θ_global``, counting the bytes.

    Raises:
        AsyncTimeoutError: ``dst`` did not take it within ``timeout_s``.
    """
    message = torch.cat([torch.tensor([outer.version, command, *fields], dtype=torch.float32),
                         outer.global_flat.cpu()])  # fmt: skip
    _post(outer, message, group, dst, timeout_s, lambda: f"async server rank {dist.get_rank()}: could not send to "
                                                         f"worker rank {dst} within {timeout_s:.0f} s "
                                                         "(distributed.timeout_s)")  # fmt: skip


def _post(outer: AsyncOuter, message: torch.Tensor, group: dist.ProcessGroup, dst: int, timeout_s: float,
          what: Callable[[], str]) -> None:  # fmt: skip
    """Send ``message`` (1-D fp32: header and payload) to global rank ``dst``, counting its bytes
    in ``outer.hook``; past ``timeout_s``, :class:`AsyncTimeoutError` saying ``what()``."""
    outer.hook.bytes_sent += message.numel() * 4
    outer.hook.dense_bytes += message.numel() * 4
    _wait(dist.isend(message, dst=dst, group=group), timeout_s, what)


@dataclass(frozen=True)
class AsyncLayout:
    """Where this rank sits in the asynchronous exchange. ``replicas[r]``: replica ``r``'s global
    ranks in mesh order (pp, dp_shard, tp coordinates row-major), the same order in every
    replica; replica 0 is the server, its ranks hold ``θ_global`` split as every replica splits
    its model. ``position``: this rank's index in its replica. Rank ``replicas[r][j]`` talks only
    to ``replicas[0][j]``; position 0 of the server (the leader) decides the order of all
    exchanges, the server's other ranks follow it (:class:`ServerMirror`)."""

    replicas: list[list[int]]
    replica: int
    position: int

    @classmethod
    def from_dims(cls, dims: ParallelDims, inside: bool) -> AsyncLayout:
        """The replicas of ``dims``: its ``dp_replicate`` groups when ``inside``
        (:func:`~loomtrain.distributed.local_sgd.replicas_sync_inside`), else every dp rank with
        its tp and pp ranks (as the sync-family modes cut them)."""
        ranks = dims.mesh_ranks()  # [pp, dp_replicate, dp_shard, sp, tp]
        across = (1,) if inside else (1, 2)
        rest = [d for d in range(ranks.dim()) if d not in across]
        count = math.prod(ranks.shape[d] for d in across)
        replicas = ranks.permute(*across, *rest).reshape(count, -1).tolist()
        me = dist.get_rank()
        replica = next(r for r, members in enumerate(replicas) if me in members)
        return cls(replicas, replica, replicas[replica].index(me))

    @property
    def server(self) -> int:
        """The server rank this rank exchanges with (itself on the server)."""
        return self.replicas[0][self.position]

    @property
    def workers(self) -> list[int]:
        """The worker ranks at this position, replica 1 first."""
        return [members[self.position] for members in self.replicas[1:]]

    @property
    def role(self) -> str:
        """``"leader"`` (the server's position 0), ``"follower"`` (its other ranks) or ``"worker"``."""
        return "worker" if self.replica else "follower" if self.position else "leader"

    def groups(self, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """This rank's gloo groups (a collective: every rank creates every group): the channel of
        its position (its server rank and workers) and the server replica's control group
        (``None`` off the server or on a server of one rank)."""
        timeout = timedelta(seconds=timeout_s)
        channel = None
        for j in range(len(self.replicas[0])):
            group = dist.new_group([members[j] for members in self.replicas], backend="gloo", timeout=timeout)
            channel = group if j == self.position else channel
        if len(self.replicas[0]) == 1:
            return channel, None
        control = dist.new_group(self.replicas[0], backend="gloo", timeout=timeout)
        return channel, control if self.replica == 0 else None


# Leader → follower instructions: [kind, replica, version, command or round index, 4 round fields, weight].
SEND, SETTLE, EVALUATE, EXIT = 0, 1, 2, 3
INSTRUCTION = 9


class ServerMirror:
    """The server leader's side of a server replica of several ranks: tells each ``follower``
    (global ranks, over ``control``) each send, settlement, evaluation and end of the leader,
    so each repeats it on its shard of ``θ_global`` in the same order (:class:`ServerFollower`).
    Every instruction carries the leader's version, which each follower checks against its own.

    Raises (from each method):
        AsyncTimeoutError: a follower did not take an instruction within ``timeout_s``.
    """

    def __init__(self, control: dist.ProcessGroup, followers: list[int], timeout_s: float):
        self.control, self.followers, self.timeout_s = control, followers, timeout_s

    def send(self, replica: int, version: int, command: int, fields: list[int]) -> None:
        """Send ``replica``'s ranks the header and your shard."""
        self._tell([SEND, replica, version, command, *fields, 0.0])

    def settle(self, replica: int, version: int, index: int, weight: float | None) -> None:
        """Receive ``replica``'s delta of round ``index``; apply it with ``weight`` (``None``:
        rejected, dropped)."""
        self._tell([SETTLE, replica, version, index, 0, 0, 0, 0, math.nan if weight is None else weight])

    def evaluate(self, version: int) -> None:
        """Join the validation of ``θ_global`` (its collectives span the server replica)."""
        self._tell([EVALUATE, 0, version, 0, 0, 0, 0, 0, 0.0])

    def exit(self, version: int, command: int) -> None:
        """The server's turn ends with ``command`` (PAUSE, STOP or PREEMPT)."""
        self._tell([EXIT, 0, version, command, 0, 0, 0, 0, 0.0])

    def _tell(self, numbers: list[float]) -> None:
        message = torch.tensor(numbers, dtype=torch.float64)
        for rank in self.followers:
            work = dist.isend(message, dst=rank, group=self.control)
            _wait(work, self.timeout_s, lambda r=rank: f"async server leader: could not reach server rank {r} "
                                                       f"within {self.timeout_s:.0f} s")  # fmt: skip


class ServerFollower:
    """A server rank other than the leader: holds ``θ_global``'s shard of its position and
    repeats the leader's instructions (:class:`ServerMirror`) with the ``workers`` of its
    position (global ranks, replica 1 first) over ``channel``. ``evaluate``: the validation
    that the leader's evaluations need this rank in.

    Raises (from :meth:`follow`):
        AsyncTimeoutError: no instruction from ``leader`` within twice ``timeout_s`` (a round's
            deadline plus the leader's own), or a worker's delta not within ``timeout_s``.
        RuntimeError: an instruction's version is not this rank's (the shards would diverge),
            or a worker returned another round than the leader settled.
    """

    def __init__(self, outer: AsyncOuter, channel: dist.ProcessGroup, control: dist.ProcessGroup, leader: int,
                 workers: list[int], timeout_s: float, evaluate: Callable[[], float]):  # fmt: skip
        self.outer, self.channel, self.control, self.leader = outer, channel, control, leader
        self.workers, self.timeout_s, self.evaluate = workers, timeout_s, evaluate
        self.buf = torch.empty(HEADER + outer.global_flat.numel())

    def follow(self) -> str:
        """Carry out instructions until EXIT; returns ``"pause"``, ``"done"`` or ``"preempt"``."""
        while True:
            kind, replica, version, command, *fields, weight = self._instruction()
            if int(version) != self.outer.version:
                raise RuntimeError(f"async server rank {dist.get_rank()}: the leader is at version {int(version)}, "
                                   f"this rank at {self.outer.version}: θ_global's shards would diverge")  # fmt: skip
            worker = self.workers[int(replica) - 1] if replica else -1
            if kind == SEND:
                send_model(self.outer, self.channel, worker, int(command), [int(f) for f in fields], self.timeout_s)
            elif kind == SETTLE:
                self._settle(worker, int(command), None if math.isnan(weight) else weight)
            elif kind == EVALUATE:
                self.evaluate()
            else:
                return ENDS[int(command)]

    def _instruction(self) -> list[float]:
        message = torch.empty(INSTRUCTION, dtype=torch.float64)
        work = dist.irecv(message, src=self.leader, group=self.control)
        _wait(work, 2 * self.timeout_s, lambda: f"async server rank {dist.get_rank()}: no instruction from the "
                                                f"server leader (rank {self.leader}) within {2 * self.timeout_s:.0f} "
                                                "s; it died or hangs: see its log")  # fmt: skip
        return message.tolist()

    def _settle(self, worker: int, index: int, weight: float | None) -> None:
        work = dist.irecv(self.buf, src=worker, group=self.channel)
        _wait(work, self.timeout_s, lambda: f"async server rank {dist.get_rank()}: worker rank {worker} sent no "
                                            f"delta within {self.timeout_s:.0f} s of its leader's")  # fmt: skip
        if int(self.buf[1]) != index:
            raise RuntimeError(f"async server rank {dist.get_rank()}: worker rank {worker} returned round "
                               f"{int(self.buf[1])}, its replica's leader round {index}")  # fmt: skip
        if weight is not None:
            self.outer.apply(self.buf[HEADER:].to(self.outer.global_flat.device), weight)


class ParameterServer:
    """The server side (module docstring) over ``group`` for the ``workers`` (global ranks).

    ``planner``: cuts the rounds, of :func:`local_steps` steps each; ``timeout_s``: the most
    seconds a worker may take to return a round (``distributed.timeout_s``); ``on_settled``:
    called after each returned round (logging, evaluation). ``stop_requested``: polled before each
    assignment; once true no new round is handed out and :meth:`serve` ends with ``"preempt"``.
    ``mirror``: where the server replica has more ranks (tp, pp or ZeRO inside a replica), the
    channel that makes them repeat this rank's every send and settlement on their shards, in
    this rank's order (:class:`ServerMirror`); ``None`` on a server of one rank.
    """

    def __init__(self, outer: AsyncOuter, group: dist.ProcessGroup, workers: list[int], planner: RoundPlanner,
                 timeout_s: float, on_settled: Callable[[Settled], None] | None = None,
                 stop_requested: Callable[[], bool] = lambda: False, mirror: ServerMirror | None = None):  # fmt: skip
        self.outer, self.group, self.workers, self.planner = outer, group, workers, planner
        self.timeout_s, self.on_settled, self.stop_requested = timeout_s, on_settled, stop_requested
        self.mirror = mirror
        self.cfg = outer.cfg
        self.numel = outer.global_flat.numel()
        self.outstanding: dict[int, tuple[Round, float]] = {}  # worker → (its round, when handed out)
        self.preempt = False

    def serve(self, pause_at: int | None = None) -> str:
        """Hand out rounds until every lane reaches step ``pause_at`` (a period start; ``None``:
        the run's end), settle every returned one, and end every worker's turn: ``"done"`` (all
        rounds settled, workers told STOP), ``"pause"`` (workers told PAUSE: a checkpoint) or
        ``"preempt"``. Every worker holds the current ``θ_global`` afterwards.

        Raises:
            AsyncTimeoutError: a worker returned nothing within ``timeout_s`` of its round.
        """
        limit = self.planner.steps if pause_at is None else pause_at
        for worker in self.workers:
            self._assign(worker, limit)
        buf = torch.empty(HEADER + self.numel)
        while self.outstanding:
            worker = self._receive(buf)
            self._settle(worker, buf)
            self._assign(worker, limit)
        # Ends go out only now, so every worker takes the θ_global of the last settled delta.
        command = PREEMPT if self.preempt else STOP if self.planner.done else PAUSE
        for worker in self.workers:
            self._send(worker, command, [-1, 0, 0, 0])
        if self.mirror is not None:
            self.mirror.exit(self.outer.version, command)
        return ENDS[command]

    def _assign(self, worker: int, limit: int) -> None:
        """Send ``worker`` the model with its next round (cut before step ``limit``); with none
        left, its turn ends in :meth:`serve`."""
        outer = self.outer
        self.preempt = self.preempt or self.stop_requested()
        length = local_steps(self.cfg, outer.speeds.get(worker), list(outer.speeds.values()))
        rnd = None if self.preempt else self.planner.cut(outer.next_round, length, limit)
        if rnd is not None:
            self.outstanding[worker] = (rnd, time.monotonic())
            outer.next_round += 1
            self._send(worker, CONTINUE, [rnd.index, rnd.first_step, rnd.steps, rnd.offset])

    def _send(self, worker: int, command: int, fields: list[int]) -> None:
        """Send ``worker`` the header (``command``, round ``fields``) and ``θ_global`` (the
        server's other ranks the same header and their shards, through :attr:`mirror`)."""
        send_model(self.outer, self.group, worker, command, fields, self.timeout_s)
        if self.mirror is not None:
            self.mirror.send(self._replica(worker), self.outer.version, command, fields)

    def _replica(self, worker: int) -> int:
        return self.workers.index(worker) + 1

    def _receive(self, buf: torch.Tensor) -> int:
        """Wait for the next delta from any worker into ``buf``; returns the sender's global rank."""
        overdue = min(self.outstanding, key=lambda w: self.outstanding[w][1])
        deadline = self.outstanding[overdue][1] + self.timeout_s
        start = time.perf_counter()
        work = dist.irecv(buf, src=None, group=self.group)
        _wait(work, deadline - time.monotonic(), lambda: self._overdue_message(overdue))
        self.outer.wait_s += time.perf_counter() - start
        return dist.get_global_rank(self.group, work._source_rank())

    def _overdue_message(self, worker: int) -> str:
        rnd, since = self.outstanding[worker]
        waiting = ", ".join(str(w) for w in sorted(self.outstanding))
        return (
            f"async server: worker rank {worker} returned nothing for round {rnd.index} within {self.timeout_s:.0f} s "
            f"(distributed.timeout_s; {time.monotonic() - since:.1f} s since it was handed out); still waiting for "
            f"rank(s) {waiting}. A worker died or hangs: see its log; raise distributed.timeout_s if a round is "
            "legitimately slower"
        )

    def _settle(self, worker: int, buf: torch.Tensor) -> None:
        """Apply (or reject) the delta in ``buf`` from ``worker`` by the staleness rule."""
        base, index, loss, preempt, seconds, _ = buf[:HEADER].tolist()
        rnd, _ = self.outstanding.pop(worker)
        if int(index) != rnd.index:
            raise RuntimeError(f"async server: worker rank {worker} returned round {int(index)}, expected {rnd.index}")
        self.preempt = self.preempt or preempt > 0
        outer = self.outer
        tau = outer.version - int(base)
        weight = server_delta_weight(tau, self.cfg, len(self.workers))
        if self.mirror is not None:
            self.mirror.settle(self._replica(worker), outer.version, rnd.index, weight)
        if weight is None:
            outer.rejected[tau] += 1
        else:
            outer.apply(buf[HEADER:].to(outer.global_flat.device), weight)
            outer.applied[tau] += 1
            outer.local_steps[rnd.steps] += 1
        outer.worker_steps += rnd.steps
        # DyLU's v_w: the worker's own compute time, so the transfers and the server's queue (an
        # evaluation, other deltas) do not count as slowness.
        outer.speeds[worker] = rnd.steps / max(seconds, 1e-9)
        if self.on_settled is not None:
            self.on_settled(Settled(worker, rnd, tau, weight, outer.version, loss, outer.speeds[worker]))


class AsyncWorker:
    """The worker side (module docstring): receives a model and a round from ``server`` over
    ``group``, runs ``train_round(round) -> mean loss`` (the inner steps, on ``outer.params``),
    sends the delta with the round's seconds, and so on until the server ends its turn.
    ``preempt_requested``: sent with each delta (a SIGTERM seen here stops the whole run at the
    next checkpoint)."""

    def __init__(self, outer: AsyncOuter, group: dist.ProcessGroup, server: int, timeout_s: float,
                 train_round: Callable[[Round], float],
                 preempt_requested: Callable[[], bool] = lambda: False):  # fmt: skip
        self.outer, self.group, self.server = outer, group, server
        self.timeout_s, self.train_round, self.preempt_requested = timeout_s, train_round, preempt_requested
        self.buf = torch.empty(HEADER + outer.global_flat.numel())
        self.rounds_done = 0

    def run(self) -> str:
        """Train rounds until the server says otherwise; returns ``"pause"``, ``"done"`` or
        ``"preempt"``. The parameters then hold the server's ``θ_global``.

        Raises:
            AsyncTimeoutError: no message from the server within ``timeout_s``.
        """
        while True:
            command, rnd = self._receive()
            if rnd is None:
                return ENDS[command]
            start = time.perf_counter()
            loss = self.train_round(rnd)
            seconds = time.perf_counter() - start
            self.rounds_done += 1
            delta = self.outer.global_flat - flatten(self.outer.params)
            header = torch.tensor([self.outer.version, rnd.index, loss, float(self.preempt_requested()), seconds, 0.0])
            _post(self.outer, torch.cat([header, delta.cpu()]), self.group, self.server, self.timeout_s,
                  lambda: f"async worker: could not send its delta to the server (rank {self.server}) within "
                          f"{self.timeout_s:.0f} s")  # fmt: skip

    def _receive(self) -> tuple[int, Round | None]:
        """Wait for the server's next message; take its model as ``θ_global`` and this rank's
        parameters. Returns the command and the round to train (``None`` unless CONTINUE)."""
        start = time.perf_counter()
        work = dist.irecv(self.buf, src=self.server, group=self.group)
        _wait(work, self.timeout_s, lambda: f"async worker rank {dist.get_rank()}: no message from the server (rank "
                                            f"{self.server}) within {self.timeout_s:.0f} s (distributed.timeout_s); "
                                            "the server died or hangs: see rank 0's log")  # fmt: skip
        self.outer.wait_s += time.perf_counter() - start
        version, command, *fields = (int(x) for x in self.buf[:HEADER].tolist())
        self.outer.version = version
        self.outer.global_flat.copy_(self.buf[HEADER:])
        self.outer.take_global()
        return command, Round(*fields) if command == CONTINUE else None


def saved_async_state(checkpoint: Path) -> dict | None:
    """The async state rank 0 (the server's leader) saved in ``checkpoint``; ``None`` for another
    mode's checkpoint or a missing file (a checkpoint on a disk rank 0 alone sees)."""
    state = read_rank_state(checkpoint, 0).get("outer_sync")
    return state if state and state.get("mode") == "async" else None


def serves(dims: ParallelDims, cfg: DataParallelConfig) -> bool:
    """Whether this rank is one of the server replica's (replica 0 of :class:`AsyncLayout`;
    no process group needed)."""
    return AsyncLayout.from_dims(dims, replicas_sync_inside(cfg, dims)).replica == 0


def server_param_state(outer: AsyncOuter, model: nn.Module, serving: bool) -> dict[str, dict[str, torch.Tensor]]:
    """What async adds to a checkpoint's DCP state (``checkpoint.TrainState.param_state``): on
    the server's ranks (``serving``) the outer optimizer's tensors by parameter of ``model``
    (:meth:`AsyncOuter.param_state`), which DCP writes sharded like the model (so the server's
    ranks together write each whole); nothing on a worker's: its outer optimizer never steps,
    and a state it adopted at a resume is stale, yet DCP would keep either rank's copy of a
    tensor it takes as replicated."""
    return outer.param_state(trainable(model)) if serving else {}


def load_server_tensors(
    outer: AsyncOuter,
    checkpoint: Path,
    server: dict[str, Any],
    model: nn.Module,
    sharding: StateDictSharding | None,
    serving: bool,
) -> dict[str, torch.Tensor] | None:
    """The saved server's outer optimizer tensors (those in ``server``, its leader's
    :meth:`AsyncOuter.state_dict`), resharded from ``checkpoint``'s DCP entries
    (:data:`SERVER_ENTRIES`, :func:`~loomtrain.checkpoint.load_param_state`) to what this rank
    holds of ``model`` (``outer`` built on it; ``sharding`` as the checkpoint's): ``{state key:
    1-D fp32 tensor laid out like θ_global}`` on the server's ranks (``serving``), ``{}`` on a
    worker's (they load nothing but join DCP's collective load), ``None`` where the checkpoint
    holds no such entry (written before they existed). A collective: every rank must call it.

    Raises:
        RuntimeError: (DCP) an entry lacks a parameter of ``model`` (another model).
    """
    optimizer = server["outer_optimizer"]["state"].get(0, {})
    like = outer.global_flat if serving else None
    tensors = {}
    for key in (k for k, v in optimizer.items() if isinstance(v, torch.Tensor)):
        loaded = load_flat_param_state(checkpoint, SERVER_ENTRIES[key], like, model, sharding)
        if loaded is None:  # the same on every rank: all read the one metadata file
            return None
        if serving:
            tensors[key] = loaded
    return tensors


def resume_at_another_layout(outer: AsyncOuter, checkpoint: Path, saved_layout: dict[str, int],
                             layout: dict[str, int], model: nn.Module, sharding: StateDictSharding | None,
                             serving: bool) -> None:  # fmt: skip
    """An async resume without this rank's own state (``checkpoint`` written with
    ``saved_layout``, this run's ``layout`` another; ``outer`` built on ``model``, whose
    ``sharding`` is the checkpoint's; ``serving``: this rank is on the new server). From an
    async checkpoint the saved server's version, staleness counts and outer optimizer state
    (momentum, Delayed Nesterov's window) carry over (:meth:`AsyncOuter.adopt_server_state`):
    from rank 0's file where both servers are one rank holding the whole model; otherwise (a
    server split by tp, pp or ZeRO before or after) with the tensors resharded from the
    checkpoint's DCP entries (:func:`load_server_tensors`; a collective), θ_global the DCP
    model. Either way the inner optimizer states and the round plan start afresh. A split
    checkpoint written before those entries existed restarts the outer momentum and version at
    zero, with a warning. From another mode's checkpoint the DCP model becomes ``θ_global``
    with the outer state at zero (:meth:`AsyncOuter.load_state_dict` of ``None``) and its DCP
    inner optimizer state (a sync run's moments, the same on every rank) is kept.

    Raises:
        ValueError: the saved server's state is of another model, ``inner_steps`` or
            ``outer_momentum_delay`` (:meth:`AsyncOuter.adopt_server_state`).
    """
    server = saved_async_state(checkpoint)
    if server is None:
        outer.load_state_dict(None)
        return
    if whole_model_replicas(saved_layout) and whole_model_replicas(layout):
        outer.adopt_server_state(server)
        log.info("async at another world size: the saved server's θ_global and outer momentum (version %d) kept; "
                 "inner optimizer states and the round plan start afresh", server["version"])  # fmt: skip
        return
    resharded = load_server_tensors(outer, checkpoint, server, model, sharding, serving)
    if resharded is None:
        log.warning("checkpoint %s holds no resharded outer optimizer state (written before it existed): the async "
                    "server's outer momentum and version restart at zero", checkpoint)  # fmt: skip
        outer.load_state_dict(None)
        outer.forget_inner_state()
        return
    outer.adopt_server_state(server, resharded)
    log.info("async at another layout: the saved server's outer momentum (version %d) kept, resharded; inner "
             "optimizer states and the round plan start afresh", server["version"])  # fmt: skip


def _period_start(step: int, inner_steps: int) -> int:
    """The first period start at or after ``step`` (periods of ``inner_steps`` steps)."""
    return -(-step // inner_steps) * inner_steps


def pause_steps(steps: int, inner_steps: int, interval: int, after: int) -> list[int]:
    """The steps at which the server pauses for a checkpoint (every lane there, none beyond): the
    first period start at or after each multiple of ``interval`` steps, later than step ``after``
    and before ``steps`` (the run's end checkpoints anyway)."""
    starts = (_period_start(m, inner_steps) for m in range(interval, steps, interval))
    return sorted({p for p in starts if after < p < steps})


class _ServerLog:
    """The server's per-round records in ``metrics.jsonl`` (through the trainer's writer), and its
    evaluation of ``θ_global`` every ``training.eval_interval`` equivalent steps."""

    def __init__(self, trainer: Any, workers: int, mirror: ServerMirror | None):
        self.trainer, self.workers, self.mirror = trainer, workers, mirror
        t = trainer.cfg.training
        self.batch_tokens = t.global_batch_size // workers * t.seq_len  # one worker step's tokens
        self.start_steps = trainer.outer.worker_steps
        self.start_s = time.perf_counter()
        self.logged_step = trainer.start_step
        self.last_loss = float("nan")

    @property
    def step(self) -> int:
        """Equivalent synchronous steps done: settled worker steps / W."""
        return self.trainer.outer.worker_steps // self.workers

    def train_s(self) -> float:
        return time.perf_counter() - self.start_s

    def __call__(self, settled: Settled) -> None:
        trainer, outer, t = self.trainer, self.trainer.outer, self.trainer.cfg.training
        tokens = (outer.worker_steps - self.start_steps) * self.batch_tokens
        record = {
            "loss": settled.loss, "lr": lr_at(settled.round.first_step + settled.round.steps - 1, t),
            "staleness": settled.tau, "applied": int(settled.weight is not None),
            "delta_weight": settled.weight or 0.0, "worker": settled.worker, "round": settled.round.index,
            "local_steps": settled.round.steps, "worker_steps_per_s": settled.speed,
            "outer_version": settled.version, "tokens_per_s": tokens / max(self.train_s(), 1e-9),
            "outer_sync_s": outer.wait_s,
        }  # fmt: skip
        step = self.step
        if step // t.eval_interval > self.logged_step // t.eval_interval and step < t.steps:
            if self.mirror is not None:
                self.mirror.evaluate(outer.version)
            record["val_loss"] = evaluate_global(trainer)
        trainer.metrics.writer.log(step, record)
        trainer.metrics.writer.advance(step - self.logged_step)
        self.logged_step, self.last_loss = step, settled.loss


def evaluate_global(trainer: Any) -> float:
    """Validation loss of ``θ_global`` (nats/token) over the run's fixed validation set, on the
    server replica alone (the workers train on meanwhile; each server rank evaluates every
    batch, so the replica's tp, pp or ZeRO collectives are all it needs)."""
    from loomtrain.trainer import autocast  # the trainer imports this module

    t = trainer.cfg.training
    batches = eval_batches(trainer.data.val, t.seq_len, t.micro_batch_size, t.eval_batches)
    with trainer.outer.global_weights():
        trainer.pm.model.eval()
        loss = trainer.pm.eval_loss(batches, lambda: autocast(trainer.cfg, trainer.device), trainer.device)
        trainer.pm.model.train()
    return loss


def _round_trainer(trainer: Any, workers: int, inside: bool) -> Callable[[Round], float]:
    """A worker replica's ``train_round``: the round's inner steps through the trainer's model
    and optimizer, its batches the round's own (``global_batch_size / W`` samples per step, the
    stream position ``round.offset``, split over the replica's dp_shard ranks when ``inside``),
    its learning rates those of steps ``first_step…``. Returns the replica's mean loss."""
    from loomtrain.trainer import mean_over_ranks, train_step  # the trainer imports this module

    cfg, t, dims = trainer.cfg, trainer.cfg.training, trainer.dims
    samples = t.global_batch_size // workers
    rank, ranks = (dims.rank(Axis.DP_SHARD), dims.dp_shard) if inside else (0, 1)
    # One loader, repositioned per round: a worker's rounds only move forward in the stream.
    loader = DistributedBatchLoader(trainer.data.train, t.seq_len, samples, t.micro_batch_size, rank, ranks,
                                    cfg.run.seed)  # fmt: skip

    def train_round(rnd: Round) -> float:
        loader.samples_consumed = rnd.offset * samples
        total = 0.0
        for j in range(rnd.steps):
            set_lr(trainer.optimizer, lr_at(rnd.first_step + j, t))
            total += train_step(trainer.pm, trainer.optimizer, loader.next_step(), cfg, trainer.device)
        if ranks == 1:
            return total / rnd.steps
        return mean_over_ranks(total / rnd.steps, trainer.device, dims.shard_mesh.get_group())

    return train_round


def _planner(trainer: Any, workers: int) -> RoundPlanner:
    """The run's :class:`RoundPlanner`, its lanes shared with ``trainer.outer`` (a checkpoint
    holds every cut): from the checkpoint's lanes; from a checkpoint written before lanes
    existed, its ``next_round`` fixed rounds replayed; without async state (another mode or
    world size), every lane at the first period start at or after the resumed step."""
    t, outer = trainer.cfg.training, trainer.outer
    h = trainer.cfg.data_parallel.resolved_inner_steps
    planner = RoundPlanner(t.steps, h, workers, outer.lanes or None)
    if not outer.lanes and outer.next_round:
        for k in range(outer.next_round):
            planner.cut(k, h, t.steps)
    elif not outer.lanes and trainer.start_step:
        start = min(_period_start(trainer.start_step, h), t.steps)
        planner.lanes = [start] * workers
        outer.next_round, outer.worker_steps = -(-start // h) * workers, start * workers
    outer.lanes = planner.lanes
    return planner


def run_async(trainer: Any) -> dict:
    """Train ``trainer`` (a :class:`~loomtrain.trainer.Trainer` built with ``mode="async"``) to
    ``training.steps``: replica 0 serves (:class:`ParameterServer` on its first rank, which must
    be rank 0, :class:`ServerFollower` on its others), the other replicas work
    (:class:`AsyncWorker` on each of their ranks; :class:`AsyncLayout`). Every checkpoint is a
    pause: the server stops handing out rounds, waits for the ones out, and all ranks save
    together (``θ_global`` as the model, each rank's :class:`AsyncOuter` state in its own file).
    Returns the run's summary (``summary.json``).

    Raises:
        AsyncTimeoutError: a worker or the server sent nothing within ``distributed.timeout_s``.
        RuntimeError: the rank placement put another rank than 0 first in the server replica.
    """
    cfg, t, ck = trainer.cfg, trainer.cfg.training, trainer.cfg.checkpoint
    outer: AsyncOuter = trainer.outer
    inside = replicas_sync_inside(cfg.data_parallel, trainer.dims)
    layout = AsyncLayout.from_dims(trainer.dims, inside)
    if layout.replicas[0][0] != 0:
        raise RuntimeError(f"async: the server replica's first rank is {layout.replicas[0][0]}, not rank 0 (which "
                           "writes the metrics); use the launcher's rank order")  # fmt: skip
    channel, control = layout.groups(cfg.distributed.timeout_s)
    workers = len(layout.replicas) - 1
    planner = _planner(trainer, workers)
    trainer.profiler = StepProfiler(cfg, trainer.device, trainer.start_step, trainer.events)
    pauses = pause_steps(t.steps, planner.inner_steps, ck.interval, min(planner.lanes)) if ck.enabled else []
    mirror = ServerMirror(control, layout.replicas[0][1:], cfg.distributed.timeout_s) if control else None
    log_ = _ServerLog(trainer, workers, mirror) if layout.role == "leader" else None
    sent_before = outer.hook.bytes_sent
    reason = "pause"
    while reason == "pause":
        if layout.role == "leader":
            pause_at = next((p for p in pauses if p > min(planner.lanes)), None)
            reason = ParameterServer(outer, channel, layout.workers, planner, cfg.distributed.timeout_s, log_,
                                     lambda: trainer.preemption.requested, mirror).serve(pause_at)  # fmt: skip
        elif layout.role == "follower":
            reason = ServerFollower(outer, channel, control, layout.replicas[0][0], layout.workers,
                                    cfg.distributed.timeout_s, lambda: evaluate_global(trainer)).follow()  # fmt: skip
        else:
            reason = AsyncWorker(outer, channel, layout.server, cfg.distributed.timeout_s,
                                 _round_trainer(trainer, workers, inside),
                                 lambda: trainer.preemption.requested).run()  # fmt: skip
        box = [reason, outer.worker_steps // workers]
        dist.broadcast_object_list(box, src=0)  # every rank is back: the server's verdict and step
        reason, trainer.step = box
        if reason == "preempt":
            return trainer._stop_for_preemption()
        if reason == "pause":
            trainer._save()
    return _finish(trainer, log_, outer.hook.bytes_sent - sent_before)


def _finish(trainer: Any, log_: _ServerLog | None, sent: int) -> dict:
    """Every rank takes ``θ_global``; the final evaluation (all ranks), checkpoint and summary.
    The server's training seconds and the run's equivalent steps make the summary's tokens/s."""
    cfg, t = trainer.cfg, trainer.cfg.training
    outer: AsyncOuter = trainer.outer
    outer.take_global()
    trainer.step = t.steps
    trainer.metrics.train_traffic[GRADIENT_AXIS] += sent
    if log_ is not None:
        trainer.metrics.speed.total = [t.steps - trainer.start_step, log_.train_s()]
        trainer.metrics.writer.message(
            f"async: {outer.version} deltas applied (staleness {dict(sorted(outer.applied.items()))}), "
            f"{sum(outer.rejected.values())} rejected (staleness {dict(sorted(outer.rejected.items()))})"
        )
    val_loss = trainer._evaluate()
    if cfg.checkpoint.enabled and trainer.ckpt.last_saved_step != trainer.step:
        trainer._save()
    trainer.profiler.close()
    trainer.ckpt.finalize()
    return trainer._finish(log_.last_loss if log_ is not None else float("nan"), val_loss)
