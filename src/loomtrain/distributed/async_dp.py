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

Transport: point-to-point messages on a gloo group (``dist.isend``/``dist.irecv``; the server
receives from any source, ``src=None``, which gloo supports and NCCL does not), CPU fp32
tensors: ``[header (4 numbers), payload (Σ numel)]`` in one message each way. Every wait has a
deadline (``timeout_s``): a worker that sends nothing within it after being given a round makes
the server raise :class:`AsyncTimeoutError` naming it; a worker that hears nothing from the
server within it raises too.

The work is a fixed list of rounds (:func:`plan_rounds`): the tokens of ``training.steps``
synchronous steps, cut into ``W`` rounds of ``H`` steps per period; rounds go to whichever
worker asks next, so a fast worker takes more of them. Round ``k``'s batches and learning rates
depend only on ``k`` (not on the worker), so with one worker the run is exactly DiLoCo with one
replica.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.config import DataParallelConfig
from loomtrain.data import DistributedBatchLoader, eval_batches
from loomtrain.distributed.data_parallel import CommHook
from loomtrain.distributed.local_sgd import (
    LocalOnlyHook,
    _load_optimizer_state,
    check_identical,
    flatten,
    holding,
    write_flat,
)
from loomtrain.distributed.traffic import GRADIENT_AXIS
from loomtrain.optim import lr_at, set_lr
from loomtrain.profiling import StepProfiler

log = logging.getLogger(__name__)

# Server → worker commands (header[1]).
CONTINUE, PAUSE, STOP, PREEMPT = 0, 1, 2, 3
HEADER = 4  # numbers before the payload in every message (fp32: exact integers below 2**24)


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


def plan_rounds(steps: int, inner_steps: int, workers: int) -> list[Round]:
    """The run's rounds: for each period ``p`` of ``inner_steps`` (H) synchronous steps, ``workers``
    (W) rounds of ``min(H, steps − p·H)`` steps each, so the rounds hold ``steps·W`` worker steps:
    the tokens of ``steps`` synchronous steps over W ranks.

    Raises:
        ValueError: ``steps``, ``inner_steps`` or ``workers`` below 1.
    """
    if min(steps, inner_steps, workers) < 1:
        raise ValueError(f"steps={steps}, inner_steps={inner_steps}, workers={workers} must all be at least 1")
    rounds: list[Round] = []
    offset = 0
    for first in range(0, steps, inner_steps):
        length = min(inner_steps, steps - first)
        for _ in range(workers):
            rounds.append(Round(len(rounds), first, length, offset))
            offset += length
    return rounds


def delta_weight(tau: int, max_staleness: int, policy: str, workers: int) -> float | None:
    """The weight of a delta of staleness ``tau`` from one of ``workers`` (module docstring):
    ``None`` (rejected) above ``max_staleness``; else ``1/W``, or ``1/(W·(1+τ))`` with
    ``policy="scale"`` (Zhang et al. 2016)."""
    if tau > max_staleness:
        return None
    return 1.0 / workers / (1 + tau if policy == "scale" else 1)


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

    ``θ_global`` is one flat fp32 tensor of ``Σ p.numel()`` elements (``params`` order): on the
    server the global model, on a worker the model it last received (its delta's base). The
    outer optimizer (:func:`build_async_outer_optimizer`: SGD with DiLoCo's defaults from
    ``cfg``, or Delayed Nesterov) steps it on the server only. ``group``: where the initial
    parameters are checked identical (a collective).

    Attributes:
        version: outer updates applied (server); the received model's version (worker).
        next_round: rounds handed out and settled (server; at a pause every handed-out round is).
        worker_steps: worker steps of the settled rounds (server).
        applied: τ → number of applied deltas with that staleness (server).
        rejected: τ → number of rejected deltas (server).
        wait_s: seconds spent waiting for messages (server: for any delta; worker: for replies).
    """

    def __init__(self, params: list[nn.Parameter], inner_optimizer: torch.optim.Optimizer, cfg: DataParallelConfig,
                 group: dist.ProcessGroup | None = None, hook: CommHook | None = None):  # fmt: skip
        self.params, self.inner_optimizer, self.cfg = list(params), inner_optimizer, cfg
        self.hook = hook if hook is not None else LocalOnlyHook()
        self.global_flat = flatten(self.params)
        if group is not None:
            check_identical(self.global_flat, group, "the initial parameters")
        self.outer_optimizer = build_async_outer_optimizer(self.global_flat, cfg)
        self.version = self.next_round = self.worker_steps = 0
        self.applied: Counter[int] = Counter()
        self.rejected: Counter[int] = Counter()
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
        return holding(self.params, self.global_flat)

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: ``mode`` ("async"), ``global`` (1-D fp32 copy),
        ``outer_optimizer`` (with Delayed Nesterov also its delta sum and count), ``version``,
        ``next_round``, ``worker_steps``, ``inner_steps``, ``outer_momentum_delay``, ``applied`` and
        ``rejected`` (τ → count) and ``inner_optimizer`` (this rank's optimizer state)."""
        return {
            "mode": "async", "global": self.global_flat.clone(), "outer_optimizer": self.outer_optimizer.state_dict(),
            "version": self.version, "next_round": self.next_round, "worker_steps": self.worker_steps,
            "inner_steps": self.cfg.resolved_inner_steps, "outer_momentum_delay": self.cfg.outer_momentum_delay,
            "applied": dict(self.applied), "rejected": dict(self.rejected),
            "inner_optimizer": self.inner_optimizer.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output. ``None`` or another mode's state (a checkpoint of
        another world size or mode): the loaded parameters become ``θ_global``, the outer
        momentum restarts at zero, and :attr:`next_round` stays 0 for the caller to place
        (with a warning).

        Raises:
            ValueError: the saved ``θ_global`` has another number of elements, or the state
                was saved with another ``inner_steps`` (its round counter means other rounds)
                or ``outer_momentum_delay`` (its outer optimizer state is another's).
        """
        if state is None or state.get("mode") != "async":
            log.warning("no async state in the checkpoint: the loaded parameters become θ_global, outer momentum 0")
            self.global_flat.copy_(flatten(self.params))
            return
        self._check_saved_settings(state)
        if state["global"].numel() != self.global_flat.numel():
            raise ValueError(
                f"the checkpoint's θ_global has {state['global'].numel()} elements, this model "
                f"{self.global_flat.numel()}: resume with the model settings it was saved with"
            )
        self.global_flat.copy_(state["global"])
        _load_optimizer_state(self.outer_optimizer, state["outer_optimizer"])
        _load_optimizer_state(self.inner_optimizer, state["inner_optimizer"])
        self.version, self.next_round, self.worker_steps = state["version"], state["next_round"], state["worker_steps"]
        self.applied, self.rejected = Counter(state["applied"]), Counter(state["rejected"])
        write_flat(self.global_flat, self.params)

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
        ``staleness_applied`` / ``staleness_rejected`` (τ → count) and ``staleness_max_applied``."""
        return {
            "outer_sync_s": self.wait_s, "outer_steps": self.version,
            "staleness_applied": {str(k): v for k, v in sorted(self.applied.items())},
            "staleness_rejected": {str(k): v for k, v in sorted(self.rejected.items())},
            "staleness_max_applied": max(self.applied, default=0),
        }  # fmt: skip


@dataclass(frozen=True)
class Settled:
    """What the server did with one returned round: the worker's global rank, the round, the
    delta's staleness ``tau``, its ``weight`` (``None``: rejected), the version after it, the
    worker's mean inner loss over the round (nats)."""

    worker: int
    round: Round
    tau: int
    weight: float | None
    version: int
    loss: float


def _wait(work: dist.Work, seconds: float, what: Callable[[], str]) -> None:
    """``work.wait`` with a deadline of ``seconds``; past it, :class:`AsyncTimeoutError` saying
    ``what()``."""
    try:
        work.wait(timeout=timedelta(seconds=max(seconds, 0.001)))
    except RuntimeError as err:
        if "Timed out" not in str(err):
            raise
        raise AsyncTimeoutError(what()) from err


class ParameterServer:
    """The server side (module docstring) over ``group`` for the ``workers`` (global ranks).

    ``rounds``: the run's :func:`plan_rounds`; ``timeout_s``: the most seconds a worker may take
    to return a round (``distributed.timeout_s``); ``on_settled``: called after each returned
    round (logging, evaluation). ``stop_requested``: polled before each assignment; once true no
    new round is handed out and :meth:`serve` ends with ``"preempt"``.
    """

    def __init__(self, outer: AsyncOuter, group: dist.ProcessGroup, workers: list[int], rounds: list[Round],
                 timeout_s: float, on_settled: Callable[[Settled], None] | None = None,
                 stop_requested: Callable[[], bool] = lambda: False):  # fmt: skip
        self.outer, self.group, self.workers, self.rounds = outer, group, workers, rounds
        self.timeout_s, self.on_settled, self.stop_requested = timeout_s, on_settled, stop_requested
        self.cfg = outer.cfg
        self.numel = outer.global_flat.numel()
        self.outstanding: dict[int, tuple[Round, float]] = {}  # worker → (its round, when handed out)
        self.preempt = False

    def serve(self, pause_at: int | None = None) -> str:
        """Hand out rounds until round ``pause_at`` (``None``: all), settle every returned one,
        and end every worker's turn: ``"done"`` (all rounds settled, workers told STOP),
        ``"pause"`` (workers told PAUSE: a checkpoint) or ``"preempt"``. Every worker holds the
        current ``θ_global`` afterwards.

        Raises:
            AsyncTimeoutError: a worker returned nothing within ``timeout_s`` of its round.
        """
        limit = len(self.rounds) if pause_at is None else pause_at
        for worker in self.workers:
            self._assign(worker, limit)
        buf = torch.empty(HEADER + self.numel)
        while self.outstanding:
            worker = self._receive(buf)
            self._settle(worker, buf)
            self._assign(worker, limit)
        if self.preempt:
            return "preempt"
        return "done" if self.outer.next_round >= len(self.rounds) else "pause"

    def _assign(self, worker: int, limit: int) -> None:
        """Send ``worker`` the model with its next round, or the command that ends its turn."""
        outer = self.outer
        self.preempt = self.preempt or self.stop_requested()
        if outer.next_round < limit and not self.preempt:
            command, index = CONTINUE, outer.next_round
            self.outstanding[worker] = (self.rounds[index], time.monotonic())
            outer.next_round += 1
        else:
            command, index = (PREEMPT if self.preempt else STOP if outer.next_round >= len(self.rounds) else PAUSE), -1
        message = torch.cat([torch.tensor([outer.version, command, index, 0.0]), outer.global_flat.cpu()])
        outer.hook.bytes_sent += message.numel() * 4
        outer.hook.dense_bytes += message.numel() * 4
        work = dist.isend(message, dst=worker, group=self.group)
        _wait(work, self.timeout_s, lambda: f"async server: could not send to worker rank {worker} within "
                                            f"{self.timeout_s:.0f} s (distributed.timeout_s)")  # fmt: skip

    def _receive(self, buf: torch.Tensor) -> int:
        """Wait for the next delta from any worker into ``buf``; returns the sender's rank."""
        overdue = min(self.outstanding, key=lambda w: self.outstanding[w][1])
        deadline = self.outstanding[overdue][1] + self.timeout_s
        start = time.perf_counter()
        work = dist.irecv(buf, src=None, group=self.group)
        _wait(work, deadline - time.monotonic(), lambda: self._overdue_message(overdue))
        self.outer.wait_s += time.perf_counter() - start
        return work._source_rank()

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
        base, index, loss, preempt = buf[:HEADER].tolist()
        rnd, _ = self.outstanding.pop(worker)
        if int(index) != rnd.index:
            raise RuntimeError(f"async server: worker rank {worker} returned round {int(index)}, expected {rnd.index}")
        self.preempt = self.preempt or preempt > 0
        outer = self.outer
        tau = outer.version - int(base)
        weight = delta_weight(tau, self.cfg.max_staleness, self.cfg.staleness_policy, len(self.workers))
        if weight is None:
            outer.rejected[tau] += 1
        else:
            outer.apply(buf[HEADER:].to(outer.global_flat.device), weight)
            outer.applied[tau] += 1
        outer.worker_steps += rnd.steps
        if self.on_settled is not None:
            self.on_settled(Settled(worker, rnd, tau, weight, outer.version, loss))


class AsyncWorker:
    """The worker side (module docstring): receives a model and a round from ``server`` over
    ``group``, runs ``train_round(round) -> mean loss`` (the inner steps, on ``outer.params``),
    sends the delta, and so on until the server ends its turn. ``preempt_requested``: sent with
    each delta (a SIGTERM seen here stops the whole run at the next checkpoint)."""

    def __init__(self, outer: AsyncOuter, group: dist.ProcessGroup, server: int, rounds: list[Round],
                 timeout_s: float, train_round: Callable[[Round], float],
                 preempt_requested: Callable[[], bool] = lambda: False):  # fmt: skip
        self.outer, self.group, self.server, self.rounds = outer, group, server, rounds
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
            command, index = self._receive()
            if command != CONTINUE:
                return {PAUSE: "pause", STOP: "done", PREEMPT: "preempt"}[command]
            loss = self.train_round(self.rounds[index])
            self.rounds_done += 1
            delta = self.outer.global_flat - flatten(self.outer.params)
            header = torch.tensor([self.outer.version, index, loss, float(self.preempt_requested())])
            message = torch.cat([header, delta.cpu()])
            self.outer.hook.bytes_sent += message.numel() * 4
            self.outer.hook.dense_bytes += message.numel() * 4
            work = dist.isend(message, dst=self.server, group=self.group)
            _wait(work, self.timeout_s, lambda: f"async worker: could not send its delta to the server (rank "
                                                f"{self.server}) within {self.timeout_s:.0f} s")  # fmt: skip

    def _receive(self) -> tuple[int, int]:
        """Wait for the server's next message; take its model as ``θ_global`` and this rank's
        parameters. Returns (command, round index)."""
        start = time.perf_counter()
        work = dist.irecv(self.buf, src=self.server, group=self.group)
        _wait(work, self.timeout_s, lambda: f"async worker rank {dist.get_rank()}: no message from the server (rank "
                                            f"{self.server}) within {self.timeout_s:.0f} s (distributed.timeout_s); "
                                            "the server died or hangs: see rank 0's log")  # fmt: skip
        self.outer.wait_s += time.perf_counter() - start
        version, command, index, _ = self.buf[:HEADER].tolist()
        self.outer.version = int(version)
        self.outer.global_flat.copy_(self.buf[HEADER:])
        write_flat(self.outer.global_flat, self.outer.params)
        return int(command), int(index)


def pause_rounds(rounds: list[Round], workers: int, interval: int, after: int) -> list[int]:
    """Indices of the rounds before which the server pauses for a checkpoint: the first round of
    the first period starting at or after each multiple of ``interval`` steps, later than round
    ``after`` and before the last period's end (the run's end checkpoints anyway)."""
    starts = [r.index for r in rounds if r.index % workers == 0]
    out = []
    for multiple in range(interval, rounds[-1].first_step + 1, interval):
        first = next((k for k in starts if rounds[k].first_step >= multiple), None)
        if first is not None and first > after and first not in out:
            out.append(first)
    return out


class _ServerLog:
    """The server's per-round records in ``metrics.jsonl`` (through the trainer's writer), and its
    evaluation of ``θ_global`` every ``training.eval_interval`` equivalent steps."""

    def __init__(self, trainer: Any, workers: int):
        self.trainer, self.workers = trainer, workers
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
            "outer_version": settled.version, "tokens_per_s": tokens / max(self.train_s(), 1e-9),
            "outer_sync_s": outer.wait_s,
        }  # fmt: skip
        step = self.step
        if step // t.eval_interval > self.logged_step // t.eval_interval and step < t.steps:
            record["val_loss"] = self.evaluate()
        trainer.metrics.writer.log(step, record)
        trainer.metrics.writer.advance(step - self.logged_step)
        self.logged_step, self.last_loss = step, settled.loss

    def evaluate(self) -> float:
        """Validation loss of ``θ_global`` (nats/token) over the run's fixed validation set, on
        the server alone (the workers train on meanwhile)."""
        from loomtrain.trainer import autocast  # the trainer imports this module

        trainer, t = self.trainer, self.trainer.cfg.training
        batches = eval_batches(trainer.data.val, t.seq_len, t.micro_batch_size, t.eval_batches)
        with trainer.outer.global_weights():
            trainer.pm.model.eval()
            loss = trainer.pm.eval_loss(batches, lambda: autocast(trainer.cfg, trainer.device), trainer.device)
            trainer.pm.model.train()
        return loss


def _round_trainer(trainer: Any, workers: int) -> Callable[[Round], float]:
    """A worker's ``train_round``: the round's inner steps through the trainer's model and
    optimizer, its batches the round's own (``global_batch_size / W`` samples per step, the
    stream position ``round.offset``), its learning rates those of steps ``first_step…``."""
    from loomtrain.trainer import train_step  # the trainer imports this module

    cfg, t = trainer.cfg, trainer.cfg.training
    samples = t.global_batch_size // workers
    # One loader, repositioned per round: a worker's rounds only move forward in the stream.
    loader = DistributedBatchLoader(trainer.data.train, t.seq_len, samples, t.micro_batch_size, 0, 1, cfg.run.seed)

    def train_round(rnd: Round) -> float:
        loader.samples_consumed = rnd.offset * samples
        total = 0.0
        for j in range(rnd.steps):
            set_lr(trainer.optimizer, lr_at(rnd.first_step + j, t))
            total += train_step(trainer.pm, trainer.optimizer, loader.next_step(), cfg, trainer.device)
        return total / rnd.steps

    return train_round


def _first_round_at(rounds: list[Round], step: int, workers: int) -> int:
    """The first round of the first period starting at or after ``step`` (a resume without async
    state: from another mode or world size)."""
    return next((r.index for r in rounds if r.index % workers == 0 and r.first_step >= step), len(rounds))


def run_async(trainer: Any) -> dict:
    """Train ``trainer`` (a :class:`~loomtrain.trainer.Trainer` built with ``mode="async"``) to
    ``training.steps``: rank 0 serves (:class:`ParameterServer`), the others work
    (:class:`AsyncWorker`). Every checkpoint is a pause: the server stops handing out rounds,
    waits for the ones out, and all ranks save together (``θ_global`` as the model, each rank's
    :class:`AsyncOuter` state in its own file). Returns the run's summary (``summary.json``).

    Raises:
        AsyncTimeoutError: a worker or the server sent nothing within ``distributed.timeout_s``.
    """
    cfg, t, ck = trainer.cfg, trainer.cfg.training, trainer.cfg.checkpoint
    outer: AsyncOuter = trainer.outer
    rank, workers = dist.get_rank(), list(range(1, dist.get_world_size()))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.distributed.timeout_s))
    rounds = plan_rounds(t.steps, cfg.data_parallel.resolved_inner_steps, len(workers))
    if outer.next_round == 0 and trainer.start_step:
        outer.next_round = _first_round_at(rounds, trainer.start_step, len(workers))
        outer.worker_steps = sum(r.steps for r in rounds[: outer.next_round])
    trainer.profiler = StepProfiler(cfg, trainer.device, trainer.start_step, trainer.events)
    pauses = pause_rounds(rounds, len(workers), ck.interval, outer.next_round) if ck.enabled else []
    log_ = _ServerLog(trainer, len(workers)) if rank == 0 else None
    sent_before = outer.hook.bytes_sent
    reason = "pause"
    while reason == "pause":
        pause_at = next((k for k in pauses if k > outer.next_round), None) if rank == 0 else None
        if rank == 0:
            server = ParameterServer(outer, group, workers, rounds, cfg.distributed.timeout_s, log_,
                                     lambda: trainer.preemption.requested)  # fmt: skip
            reason = server.serve(pause_at)
        else:
            train_round = _round_trainer(trainer, len(workers))
            reason = AsyncWorker(outer, group, 0, rounds, cfg.distributed.timeout_s, train_round,
                                 lambda: trainer.preemption.requested).run()  # fmt: skip
        box = [reason, outer.worker_steps // len(workers)]
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
    write_flat(outer.global_flat, outer.params)
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
