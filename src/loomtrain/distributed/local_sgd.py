"""Communication-light data parallelism: local SGD and DiLoCo (``data_parallel.mode``).

Each dp rank is one replica. Inner steps are plain local optimizer steps: the gradient is
not all-reduced across dp (the trainer builds the gradient synchronizer with
:class:`LocalOnlyHook`, which leaves each rank's gradient as it is). Every ``H`` inner steps
an outer step (:meth:`OuterSync.outer_step`) brings the replicas back together::

    Δ = θ_global − mean_r θ_local,r      (one all-reduce of the fp32 deltas over the dp group)
    local_sgd:  θ_global ← θ_global − Δ  (= mean_r θ_local,r: outer SGD, lr 1, no momentum)
    diloco:     θ_global ← OuterOpt(θ_global, Δ)   (SGD with Nesterov momentum)
    every replica: θ_local ← θ_global

The mean is taken by a communication hook (:func:`outer_reducer`, the gradients' ``CommHook``
seam): a flat all-reduce; hierarchical over hosts (``data_parallel.comm_hook``, the multi-host
issue's hooks); split over the ranks of a replica of several plain-DP ranks
(:class:`~loomtrain.distributed.collectives.ReplicaSplitHook`); bf16/int8 payloads
(:class:`OuterPayloadHook`) inside any of them.

Local SGD: Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019), periodic
model averaging. DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv:2311.08105, 2023), Algorithm 1 (the outer gradient is the averaged
parameter delta, applied by an outer optimizer) and §3 (outer Nesterov momentum 0.9, outer
learning rate 0.7, H = 500 inner AdamW steps). The inner optimizer state (AdamW moments)
stays local to each replica and is kept across outer steps, as in DiLoCo.

The global model ``θ_global`` is what the run evaluates and writes into the DCP checkpoint
(:meth:`OuterSync.global_weights`); each replica's ``θ_local``, inner optimizer state, the
outer optimizer state and the inner step counter go into its per-rank checkpoint file
(:meth:`OuterSync.state_dict`), so a resume inside an inner phase continues the same run. A
resume at another world size (:func:`resume_at_another_layout`) starts a new inner phase from
the checkpoint's θ_global, keeping DiLoCo's outer momentum and step count: from rank 0's file
where replicas hold the whole model before and after; otherwise (tp, pp or ZeRO inside a
replica: each rank holds a part of the momentum, as of the parameters; and streaming DiLoCo)
from the DCP checkpoint, which holds the momentum by parameter, sharded like the model
(:func:`outer_param_state`), and reshards it to the new layout as it does AdamW's moments.
The trainer forces an outer step after the last training step, so a run ends with one model.

Streaming DiLoCo (:class:`StreamingOuterSync`): Douillard et al., "Streaming DiLoCo with
overlapping communication: Towards a Distributed Free Lunch" (arXiv:2501.18512, 2025). DiLoCo's
outer step, taken on one fragment of the model at a time (§2.2, streaming partial updates): the
model's transformer blocks are split into F fragments, runs of consecutive blocks (the paper's
"sequential" pattern, Fig. 2) or every F-th block (its "strided" one: block i in fragment i mod
F; ``data_parallel.fragment_pattern``); under pipeline parallelism each stage takes its part of
each fragment. Fragment f's outer step starts every H inner steps at an offset of f·H/F steps,
so one starts every H/F steps and each sends about 1/F of the model. Its all-reduce overlaps
the next τ inner steps (§2.3-2.4; Table 1 lets it take one step) and lands as ``θ_local ←
α·θ_local + (1−α)·θ_global`` on that fragment (α = 0.5, Fig. 8 and 10). The outer gradients may
cross the dp group in bf16 or int8 and are summed in fp32 (the paper's are 4-bit floats, Fig.
11; torch has no 4-bit float arithmetic).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loomtrain.checkpoint import StateDictSharding, load_param_state, read_rank_state
from loomtrain.compression.quantize import dequantize_int8, quantize_int8
from loomtrain.config import DataParallelConfig
from loomtrain.distributed.collectives import ReplicaSplitHook, host_hook, reduced_value
from loomtrain.distributed.data_parallel import AllReduceHook, CommHook, GradBucket, Pending
from loomtrain.distributed.local_step import placed_like
from loomtrain.distributed.parallel_dims import Axis, ParallelDims
from loomtrain.distributed.topology import Topology
from loomtrain.distributed.traffic import all_gather_bytes, all_reduce_bytes
from loomtrain.hardware import synchronize

log = logging.getLogger(__name__)

# The modes whose replicas meet in an all-reduce (async has its own server: async_dp.py).
OUTER_SYNC_MODES = ("local_sgd", "diloco", "streaming_diloco")
# The checkpoint's param_state entry of (streaming) DiLoCo's outer momentum (outer_param_state).
OUTER_MOMENTUM = "outer_momentum"


class LocalOnlyHook(CommHook):
    """A communication hook that reduces nothing: each dp rank keeps its own gradient, as the
    inner steps of local SGD and DiLoCo need (sends 0 bytes)."""

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> torch.futures.Future:
        """A completed future holding ``bucket.buffer`` unchanged (no collective)."""
        del group
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer)
        return done


def held(p: nn.Parameter) -> torch.Tensor:
    """What this rank holds of ``p``: a ZeRO master's local rows (a DTensor's local tensor,
    storage shared), else ``p`` itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s trainable ``(name, parameter)`` pairs in ``model.parameters()`` order: the
    outer loop's parameters (:func:`build_outer_sync`)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def by_param(flat: torch.Tensor, named: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """The 1-D ``flat`` (laid out as :func:`flatten` lays out what this rank holds of the
    parameters of ``named``) as ``{name: view of flat}``, each view shaped like what this rank
    holds of its parameter, and a DTensor placed like it where the parameter is one (a ZeRO
    master): a state dict sharded like the model's (``checkpoint.TrainState.param_state``).

    Raises:
        ValueError: ``flat`` has another number of elements than this rank holds of ``named``.
    """
    numels = [held(p).numel() for _, p in named]
    if flat.numel() != sum(numels):
        raise ValueError(f"{flat.numel()} elements do not lay out parameters holding {sum(numels)}")
    views = flat.split(numels)
    return {name: placed_like(p, v.view_as(held(p))) if isinstance(p, DTensor) else v.view_as(p)
            for (name, p), v in zip(named, views, strict=True)}  # fmt: skip


def flatten(params: list[nn.Parameter]) -> torch.Tensor:
    """What this rank holds of ``params`` (:func:`held`) concatenated into a new 1-D fp32
    tensor."""
    return torch.cat([held(p).detach().reshape(-1).float() for p in params])


@torch.no_grad()
def write_flat(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Copy the 1-D ``flat`` (as :func:`flatten` makes it) into what this rank holds of
    ``params`` in place, cast to each parameter's dtype."""
    offset = 0
    for p in map(held, params):
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def check_identical(flat: torch.Tensor, group: dist.ProcessGroup, what: str, chunk: int = 1 << 22) -> None:
    """Raise on every rank unless ``flat`` (1-D fp32) is bitwise the same on every rank of
    ``group``. One all-reduce (MAX) of a two-number fingerprint and its negation: the sum of the
    fp32 bit patterns, plain and weighted by position (int64, wrapping), so a changed element
    or two swapped ones change it. Computed ``chunk`` elements at a time: the int64 copies of a
    whole large model would need 16 bytes per parameter.

    Raises:
        RuntimeError: the fingerprints differ across ``group``.
    """
    fingerprint = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        bits = flat[start : start + chunk].view(torch.int32).to(torch.int64)
        weights = torch.arange(start, start + bits.numel(), device=flat.device) % 1009 + 1
        fingerprint += torch.stack([bits.sum(), (bits * weights).sum()])
    both = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[:2], -both[2:]):
        raise RuntimeError(
            f"{what} differs across the dp replicas: local SGD and DiLoCo need every replica to start from the "
            "same weights; initialise them from the same seed or broadcast rank 0's parameters first"
        )


@contextlib.contextmanager
def holding(params: list[nn.Parameter], flat: torch.Tensor,
            written: Callable[[], None] = lambda: None) -> Iterator[None]:  # fmt: skip
    """Inside it, ``params`` hold the values of ``flat`` (1-D, their concatenation in order, as
    :func:`flatten` makes it); their own values are back afterwards, also after an error.
    ``written()`` is called after each write (ZeRO refreshes its full copies)."""
    local = flatten(params)
    write_flat(flat, params)
    written()
    try:
        yield
    finally:
        write_flat(local, params)
        written()


class OuterSync:
    """The outer loop of local SGD or DiLoCo over one dp ``group`` (see the module docstring).

    Holds ``θ_global`` as one flat fp32 tensor of ``Σ p.numel()`` elements (the parameters in
    ``params`` order), the outer optimizer (``torch.optim.SGD``, DiLoCo only) and the inner
    step counter. ``inner_optimizer`` is the local optimizer stepping ``params``: its state is
    part of :meth:`state_dict`, since DCP keeps one copy of what it takes for replicated.
    ``hook``: the gradient synchronizer's hook, where the outer all-reduce's bytes are counted
    (a fresh :class:`LocalOnlyHook` if ``None``). ``reducer``: the communication hook that
    averages the outer gradients over ``group`` (:func:`outer_reducer`: flat, split over a
    replica's ranks or hierarchical over hosts; a flat fp32 ``AllReduceHook`` if ``None``).
    ``written``: called whenever the outer loop has written into the parameters (ZeRO's
    ``after_step``: the full copies it computes with are refreshed from the masters; with ZeRO
    inside a replica ``params`` are its masters, and this rank's rows of them are what it
    averages with the same rows of the other replicas).

    Attributes:
        inner_done: inner steps since the last outer step.
        outer_steps: outer steps taken by this process.
        wait_s: seconds spent in the outer all-reduce (including waiting for the slowest
            replica), summed over this process's outer steps.

    Raises:
        ValueError: an unknown ``mode`` or ``inner_steps < 1``.
        RuntimeError: (a collective) the replicas' parameters differ (:func:`check_identical`).
    """

    def __init__(self, params: list[nn.Parameter], inner_optimizer: torch.optim.Optimizer,
                 group: dist.ProcessGroup, mode: str, inner_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True,
                 hook: CommHook | None = None, written: Callable[[], None] = lambda: None,
                 reducer: CommHook | None = None):  # fmt: skip
        if mode not in OUTER_SYNC_MODES:
            raise ValueError(f"mode={mode!r} is not an outer-step mode; use one of {sorted(OUTER_SYNC_MODES)}")
        if inner_steps < 1:
            raise ValueError(f"inner_steps={inner_steps} must be at least 1")
        self.params, self.inner_optimizer, self.group = list(params), inner_optimizer, group
        self.mode, self.inner_steps = mode, inner_steps
        self.reducer = reducer if reducer is not None else AllReduceHook()
        self.hook = hook if hook is not None else LocalOnlyHook()
        self.written = written
        self.global_flat = flatten(self.params)
        check_identical(self.global_flat, group, "the initial parameters")
        self.outer_optimizer = self._build_outer_optimizer(outer_lr, outer_momentum, nesterov)
        self.inner_done = self.outer_steps = 0
        self.wait_s = 0.0

    def _build_outer_optimizer(self, lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD | None:
        """DiLoCo's outer SGD on ``θ_global`` (``None`` for local SGD: lr 1, no momentum)."""
        if self.mode != "diloco":
            return None
        return torch.optim.SGD([self.global_flat], lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    def after_inner_step(self, force: bool = False) -> bool:
        """Count one inner step; take the outer step when ``inner_steps`` are done or ``force``
        (the run's last step). A collective whenever it steps. Returns whether it stepped."""
        self.inner_done += 1
        if self.inner_done < self.inner_steps and not force:
            return False
        self.outer_step()
        return True

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the outer gradient ``Δ = θ_global − θ_local`` (fp32, ``4·Σ numel`` bytes)
        over the replicas through :attr:`reducer`, update ``θ_global`` and copy it into every
        replica's parameters. The bytes are counted in :attr:`hook` (``bytes_sent``: the ``dp``
        axis of its traffic counter; ``dense_bytes``). A collective over :attr:`group`."""
        delta = self.global_flat - flatten(self.params)
        # On CUDA the collective is queued on a stream: the wait is measured between device syncs.
        synchronize(delta.device)
        start = time.perf_counter()
        delta = self.average(self.outer_bucket(0, delta, self.params)).wait()
        synchronize(delta.device)
        self.wait_s += time.perf_counter() - start
        if self.outer_optimizer is None:
            self.global_flat.sub_(delta)
        else:
            self.global_flat.grad = delta
            self.outer_optimizer.step()
            self.global_flat.grad = None
        write_flat(self.global_flat, self.params)
        self.written()
        self.inner_done = 0
        self.outer_steps += 1

    def outer_bucket(self, index: int, delta: torch.Tensor, params: list[nn.Parameter]) -> GradBucket:
        """``delta`` (1-D, the held elements of ``params`` back to back) as the bucket
        :attr:`reducer` takes: ``index`` keys its per-bucket choices (``auto``'s path), and each
        parameter's elements are a ``[rows, cols]`` matrix view, so that a split cuts at row
        boundaries and int8 scales never span two parameters (:class:`OuterPayloadHook`)."""
        matrices, offset = [], 0
        for p in params:
            t = held(p)
            rows = t.shape[0] if t.dim() and t.numel() else 1
            matrices.append(delta[offset : offset + t.numel()].view(rows, -1))
            offset += t.numel()
        return GradBucket(index, delta, [], [], [], matrices=matrices)

    def average(self, bucket: GradBucket) -> Pending:
        """Start :attr:`reducer`'s average of ``bucket`` over :attr:`group`; its bytes, as they
        are sent (at the start and in ``wait()``), are counted in :attr:`hook`."""
        pending = self._counted(lambda: self.reducer.reduce(bucket, self.group))
        return Pending(None, lambda: self._counted(lambda: reduced_value(pending.wait())))

    def _counted(self, call: Callable[[], Any]) -> Any:
        """``call()``, adding the bytes :attr:`reducer` counted during it to :attr:`hook`'s (every
        axis of its traffic counter, and ``dense_bytes``)."""
        before, dense = self.reducer.traffic.snapshot(), self.reducer.dense_bytes
        result = call()
        for axis, total in self.reducer.traffic.snapshot().items():
            self.hook.traffic.bytes[axis] += total - before.get(axis, 0)
        self.hook.dense_bytes += self.reducer.dense_bytes - dense
        return result

    def summary_fields(self) -> dict[str, Any]:
        """``outer_sync_s`` (:attr:`wait_s`) and ``outer_steps`` for ``summary.json``."""
        return {"outer_sync_s": self.wait_s, "outer_steps": self.outer_steps}

    def global_weights(self) -> contextlib.AbstractContextManager[None]:
        """Inside it, the parameters hold ``θ_global`` (the same on every replica: what the run
        evaluates and checkpoints); each replica's ``θ_local`` is back afterwards."""
        return holding(self.params, self.global_flat, self.written)

    def state_dict(self) -> dict[str, Any]:
        """This replica's part of a checkpoint (tensors are copies or the live optimizer state):
        ``mode``, ``inner_steps``, ``inner_done``, ``outer_steps``, ``global`` (θ_global, 1-D
        fp32), ``outer_optimizer`` (its state dict, or ``None``), ``local`` (θ_local, 1-D fp32)
        and ``inner_optimizer`` (this replica's optimizer state)."""
        outer = None if self.outer_optimizer is None else self.outer_optimizer.state_dict()
        return {
            "mode": self.mode, "inner_steps": self.inner_steps, "inner_done": self.inner_done,
            "outer_steps": self.outer_steps, "global": self.global_flat.clone(), "outer_optimizer": outer,
            "local": flatten(self.params), "inner_optimizer": portable_state(self.inner_optimizer),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output (a collective: checks that ``θ_global`` is the
        same on every replica). ``None`` (a checkpoint of another layout or mode) or a state of
        another mode: the parameters as loaded become ``θ_global`` and a new inner phase starts
        (the outer momentum restarts at zero, with a warning; :func:`resume_at_another_layout` then
        adopts what the checkpoint keeps).

        Raises:
            RuntimeError: ``θ_global`` differs across replicas.
            ValueError: the saved ``θ_global`` has another number of elements.
        """
        if state is None or state.get("mode") != self.mode:
            log.warning("no %s state in the checkpoint: the loaded parameters start a new inner phase", self.mode)
            self.global_flat.copy_(flatten(self.params))
            self.inner_done = 0
        elif ("fragments" in state) != isinstance(self, StreamingOuterSync):
            # DiLoCo with quantized outer gradients runs as one-fragment streaming, whose step counter
            # counts from the start, not from the last outer step: the two states do not mix.
            raise ValueError(
                "the checkpoint's DiLoCo state was written with data_parallel.outer_grad_dtype="
                f"{'a 16- or 8-bit dtype' if 'fragments' in state else 'fp32'}; resume with the outer_grad_dtype "
                "it was written with"
            )
        else:
            self._restore(state)
        check_identical(self.global_flat, self.group, "the global parameters θ_global")

    def adopt_outer_state(self, state: dict[str, Any], momentum: torch.Tensor | None = None) -> None:
        """Resume at another world size with a saved replica's :meth:`state_dict` of this mode
        (rank 0's: :func:`resume_at_another_layout` picks it): the outer step count carries over,
        and DiLoCo's outer momentum: ``momentum`` (1-D fp32 laid out like θ_global: the
        checkpoint's, resharded to this rank) or, without it (replicas of one rank holding the
        whole model there and here), ``state``'s own outer optimizer state. θ_global stays the
        loaded model (the checkpoint's model is θ_global) and a new inner phase starts from it.
        Nothing but the step count for local SGD (no outer state).

        Raises:
            ValueError: ``state`` was saved with another ``inner_steps`` (its momentum is another
                run's); without ``momentum``, its θ_global is of another size or not the loaded model.
        """
        if state["inner_steps"] != self.inner_steps:
            raise ValueError(f"the checkpoint's outer state was saved with data_parallel.inner_steps="
                             f"{state['inner_steps']}, this run has {self.inner_steps}: resume with "
                             f"data_parallel.inner_steps={state['inner_steps']}")  # fmt: skip
        if momentum is not None:
            self._set_momentum(momentum)
        else:
            if state["global"].shape != self.global_flat.shape or not torch.equal(state["global"], self.global_flat):
                raise ValueError("the checkpoint's θ_global is not its model: resume from a checkpoint written whole")
            if self.outer_optimizer is not None:
                _load_optimizer_state(self.outer_optimizer, state["outer_optimizer"])
        self.inner_done, self.outer_steps = 0, state["outer_steps"]

    def momentum(self) -> torch.Tensor | None:
        """DiLoCo's outer momentum buffer (the live 1-D fp32 tensor, laid out like θ_global), or
        ``None`` (local SGD, ``outer_momentum=0``, or before the first outer step)."""
        if self.outer_optimizer is None:
            return None
        return self.outer_optimizer.state.get(self.global_flat, {}).get("momentum_buffer")

    def _set_momentum(self, momentum: torch.Tensor) -> None:
        _load_optimizer_state(self.outer_optimizer, {"state": {0: {"momentum_buffer": momentum}}})

    def _restore(self, state: dict[str, Any]) -> None:
        if state["global"].numel() != self.global_flat.numel():
            raise ValueError(
                f"the checkpoint's θ_global has {state['global'].numel()} elements, this model "
                f"{self.global_flat.numel()}: resume with the model settings it was saved with"
            )
        self.global_flat.copy_(state["global"])
        if self.outer_optimizer is not None:
            _load_optimizer_state(self.outer_optimizer, state["outer_optimizer"])
        write_flat(state["local"], self.params)
        self.written()
        _load_optimizer_state(self.inner_optimizer, state["inner_optimizer"])
        self.inner_done, self.outer_steps = state["inner_done"], state["outer_steps"]


def whole_model_replicas(layout: dict[str, int]) -> bool:
    """Whether a checkpoint manifest's ``layout`` (or :meth:`ParallelDims.layout`) makes every
    replica of a local mode one rank holding the whole model."""
    dp, replicate = layout.get("dp", 1), layout.get("dp_replicate", 1)
    return layout.get("pp", 1) == layout.get("tp", 1) == layout.get("sp", 1) == 1 and replicate in (1, dp)


def outer_param_state(outer: Any, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """What the trainer's outer loop ``outer`` (of any mode, or ``None``) adds to a checkpoint's
    DCP state (``checkpoint.TrainState.param_state``): (streaming) DiLoCo's outer momentum by
    parameter of ``model`` (:data:`OUTER_MOMENTUM`, :meth:`OuterSync.momentum` as
    :func:`by_param` splits it), which a resume at another layout reshards
    (:func:`resume_at_another_layout`); nothing for local SGD (no outer state), async (its
    server's state: ``async_dp.server_param_state``) or before the first outer step."""
    momentum = outer.momentum() if isinstance(outer, OuterSync) else None
    return {} if momentum is None else {OUTER_MOMENTUM: by_param(momentum, trainable(model))}


def load_flat_param_state(checkpoint: Path, entry: str, like: torch.Tensor | None, model: nn.Module,
                          sharding: StateDictSharding | None) -> torch.Tensor | None:  # fmt: skip
    """``entry`` of ``checkpoint``'s ``param_state`` (saved by :func:`by_param`), resharded to
    what this rank holds of ``model``'s trainable parameters and flattened like ``like`` (a 1-D
    fp32 tensor laid out as :func:`flatten` lays them out: θ_global); ``like`` ``None``: this
    rank asks for nothing but joins the collective load, and gets an empty tensor. ``None``
    where the checkpoint holds no such entry (written before it existed). A collective
    (:func:`~loomtrain.checkpoint.load_param_state`).

    Raises:
        RuntimeError: (DCP) the entry lacks a parameter of ``model`` (another model).
    """
    template = {} if like is None else by_param(torch.zeros_like(like), trainable(model))
    loaded = load_param_state(checkpoint, entry, template, sharding)
    if loaded is None:
        return None
    return torch.empty(0) if like is None else flatten(list(loaded.values()))


def resume_at_another_layout(outer: OuterSync, checkpoint: Path, saved_layout: dict[str, int],
                             layout: dict[str, int], model: nn.Module,
                             sharding: StateDictSharding | None = None) -> None:  # fmt: skip
    """A sync-family resume without this rank's own state (``checkpoint`` written with
    ``saved_layout``, this run's ``layout`` another; ``outer`` built on ``model``, whose
    ``sharding`` is the checkpoint's): a new inner phase from the loaded θ_global and, where rank
    0 saved this mode's state (a sync checkpoint has none; nor one of DiLoCo's other
    ``outer_grad_dtype``), its outer step count and (streaming) DiLoCo's outer momentum
    (:meth:`OuterSync.adopt_outer_state`): from rank 0's file where replicas of one rank hold the
    whole model before and after (DiLoCo in fp32), else (tp, pp or ZeRO inside the replicas,
    before or after, or streaming) resharded from the checkpoint's DCP entry
    :data:`OUTER_MOMENTUM` (:func:`~loomtrain.checkpoint.load_param_state`; a collective). A
    checkpoint written before that entry existed restarts the momentum at zero, with a warning.
    Local SGD (no outer state) keeps its step count from whole-model replicas only; streaming
    DiLoCo's schedule and its in-flight fragment sums (per layout) restart.

    Raises:
        ValueError: as :meth:`OuterSync.adopt_outer_state`.
    """
    saved = read_rank_state(checkpoint, 0).get("outer_sync") or {}
    outer.load_state_dict(None)
    streaming = isinstance(outer, StreamingOuterSync)
    if saved.get("mode") != outer.mode or ("fragments" in saved) != streaming:
        return
    # Streaming's per-fragment state in rank 0's file is per fragment layout: DCP's is not.
    if not streaming and whole_model_replicas(saved_layout) and whole_model_replicas(layout):
        outer.adopt_outer_state(saved)
        log.info("%s at another world size: rank 0's outer momentum (outer step %d) kept", outer.mode,
                 saved["outer_steps"])  # fmt: skip
        return
    if outer.outer_optimizer is None:  # local SGD: no outer state to reshard
        return
    momentum = load_flat_param_state(checkpoint, OUTER_MOMENTUM, outer.global_flat, model, sharding)
    if momentum is None:
        if saved["outer_optimizer"]["state"]:
            log.warning("checkpoint %s holds no %s entry (written before it existed): %s's outer momentum "
                        "restarts at zero", checkpoint, OUTER_MOMENTUM, outer.mode)  # fmt: skip
        return
    outer.adopt_outer_state(saved, momentum)
    log.info("%s at another layout: the outer momentum (outer step %d) kept, resharded", outer.mode,
             saved["outer_steps"])  # fmt: skip


def portable_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its DTensor values (ZeRO's moments) as this rank's local
    tensors: a per-rank file holds plain tensors (a DTensor would pickle its mesh)."""
    saved = optimizer.state_dict()
    state = {k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in values.items()}
             for k, values in saved["state"].items()}  # fmt: skip
    return {**saved, "state": state}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved``'s per-parameter state (momenta, moments; :func:`portable_state`) into
    ``optimizer``, keeping its hyperparameters (they are this run's, from the config); the state
    of a DTensor parameter becomes DTensors placed like it again."""
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": saved["state"], "param_groups": groups})
    for p, values in optimizer.state.items():
        if isinstance(p, DTensor):
            optimizer.state[p] = {k: placed_like(p, v) for k, v in values.items()}


# A transformer block's parameters: ``layers.<i>.…``, under any wrapper's prefix.
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# int8 outer gradients: elements per fp32 scale (compression.chunk_size's default).
OUTER_INT8_CHUNK = 1024


def count_blocks(names: list[str]) -> int:
    """The number of transformer blocks among the parameter ``names`` (``layers.<i>.…``)."""
    return 1 + max((int(m.group(1)) for name in names if (m := _BLOCK.search(name))), default=-1)


def block_fragment(block: int, fragments: int, n_blocks: int, pattern: str) -> int:
    """The fragment of transformer block ``block`` (0..B−1, B = ``n_blocks``) among F =
    ``fragments`` (Streaming DiLoCo §2.2, Fig. 2): ``"sequential"``: F runs of consecutive
    blocks, block i in fragment ⌊i·F/B⌋ (sizes differ by at most one: 24 blocks, F = 8 gives the
    paper's 3 blocks per fragment); ``"strided"``: block i in fragment i mod F.

    Raises:
        ValueError: an unknown ``pattern``.
    """
    if pattern == "sequential":
        return block * fragments // n_blocks
    if pattern == "strided":
        return block % fragments
    raise ValueError(f"fragment pattern {pattern!r} is neither 'sequential' nor 'strided'")


def block_fragments(names: list[str], fragments: int, n_blocks: int, pattern: str = "sequential") -> list[int]:
    """The fragment (0..F−1) of each parameter named in ``names`` (``model.named_parameters()``
    order), F = ``fragments``: a block's parameters (named ``…layers.<i>.…``) that of block i of
    the model's B = ``n_blocks`` by :func:`block_fragment`; a parameter outside the blocks joins
    the fragment of the block before it (the embedding, before every block, block 0's: fragment
    0; the final norm and output head the last block's: F−1 sequential, (B−1) mod F strided; a
    model without blocks is one fragment). A pipeline stage's ``names`` hold only its blocks
    (with their model-wide indices ``i``), so it may hold parts of some fragments and none of
    others.

    Raises:
        ValueError: fewer blocks than ``fragments``, blocks out of order in ``names``, or an
            unknown ``pattern``.
    """
    if fragments > max(n_blocks, 1):
        raise ValueError(
            f"data_parallel.fragments={fragments} is more than the model's {n_blocks} transformer blocks "
            "(parameters named layers.<i>.…); set data_parallel.fragments to at most the number of blocks"
        )
    out, current, last = [], 0, -1
    for name in names:
        if m := _BLOCK.search(name):
            block = int(m.group(1))
            if block < last:
                raise ValueError(f"parameter {name!r} comes after a later block's: blocks must be in order")
            last, current = block, block_fragment(block, fragments, n_blocks, pattern)
        out.append(current)
    return out


def fragment_runs(fragment_of: list[int], numels: list[int], fragments: int) -> list[list[tuple[slice, slice]]]:
    """For each of the ``fragments`` fragments (ids in ``fragment_of``, one per parameter of
    ``numels`` elements): its runs, the maximal ranges of consecutive parameters in it, in order,
    each as a slice of the parameter list and a slice of the flat fp32 parameters. A sequential
    fragment is one run, a strided one a run per block (the embedding or the head in its
    block's). A fragment this rank holds none of (a pipeline stage) is one empty run: the outer
    optimizer keeps one empty view for it, so its state has one entry per fragment as
    checkpoints of the sequential pattern always had."""
    runs: list[list[tuple[slice, slice]]] = [[] for _ in range(fragments)]
    first = offset = 0
    for f, group in itertools.groupby(fragment_of):
        count = len(list(group))
        size = sum(numels[first : first + count])
        runs[f].append((slice(first, first + count), slice(offset, offset + size)))
        first, offset = first + count, offset + size
    return [r or [(slice(0, 0), slice(0, 0))] for r in runs]


def encode_outer(x: torch.Tensor, numels: list[int], dtype: str) -> torch.Tensor:
    """The uint8 payload of the 1-D fp32 outer gradient ``x`` (``Σ numels`` elements): its bf16
    values (2 bytes each), or per parameter (so no scale spans two tensors) the fp32 scales then
    the int8 values of :func:`~loomtrain.compression.quantize.quantize_int8`, one scale per
    :data:`OUTER_INT8_CHUNK` elements (about 1 byte each)."""
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    parts = []
    for piece in x.split(numels):
        q, scale = quantize_int8(piece, OUTER_INT8_CHUNK)
        parts += [scale.view(torch.uint8), q.view(torch.uint8)]
    return torch.cat(parts)


def decode_outer(payload: torch.Tensor, numels: list[int], dtype: str) -> torch.Tensor:
    """fp32 ``[Σ numels]`` from a payload of :func:`encode_outer`."""
    if dtype == "bf16":
        return payload.view(torch.bfloat16).float()
    out, start = [], 0
    for numel in numels:
        scales = 4 * -(-numel // OUTER_INT8_CHUNK)
        # A copy: a payload starts at any byte offset, and a float32 view needs 4-byte alignment.
        scale = payload[start : start + scales].clone().view(torch.float32)
        q = payload[start + scales : start + scales + numel].view(torch.int8)
        out.append(dequantize_int8(q, scale, OUTER_INT8_CHUNK))
        start += scales + numel
    return torch.cat(out)


def sum_decoded(parts: list[torch.Tensor], numels: list[int], dtype: str) -> torch.Tensor:
    """fp32 ``[Σ numels]``: the sum of every rank's decoded payload (``parts``, rank order). The
    same bytes in the same order give every replica the bitwise-identical sum."""
    total = decode_outer(parts[0], numels, dtype)
    for part in parts[1:]:
        total += decode_outer(part, numels, dtype)
    return total


class OuterPayloadHook(CommHook):
    """Averages outer gradients sent as bf16 or int8 payloads (Streaming DiLoCo, Douillard et al.
    2025, §2.5 quantizes the outer gradients): ``reduce`` encodes ``bucket.buffer`` (fp32, 1-D)
    with :func:`encode_outer`, one piece per matrix of ``bucket.matrices`` (so no int8 scale
    spans two parameters; the whole buffer if it has none), all-gathers the payloads over the
    group (``async_op``) and, in ``wait()``, decodes and sums them in rank order in fp32 and
    divides by the group's size: every rank gets the bitwise same mean. ``bytes_sent``: the
    all-gather's ring volume; ``dense_bytes``: the fp32 all-reduce's.

    Args:
        dtype: ``"bf16"`` or ``"int8"`` (``data_parallel.outer_grad_dtype``).
    """

    def __init__(self, dtype: str):
        super().__init__()
        self.dtype = dtype

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        """Start the all-gather of ``bucket.buffer``'s payload; ``wait()`` returns the buffer
        holding the group's mean."""
        n = dist.get_world_size(group)
        numels = [m.numel() for m in bucket.matrices] or [bucket.buffer.numel()]
        payload = encode_outer(bucket.buffer, numels, self.dtype)
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)
        parts = list(gathered.chunk(n))
        self.bytes_sent += all_gather_bytes(gathered.numel(), n)
        self.dense_bytes += all_reduce_bytes(bucket.nbytes, n)
        work = dist.all_gather(parts, payload, group=group, async_op=True)
        return Pending(work, lambda: bucket.buffer.copy_(sum_decoded(parts, numels, self.dtype)).div_(n))


@dataclass
class InFlight:
    """One fragment's outer all-reduce, started at a sync step and applied at inner step
    ``apply_at``. ``pending`` gives the replicas' mean outer gradient (1-D fp32); ``mean`` holds
    it after :meth:`wait` (or from a checkpoint, with no ``pending``)."""

    fragment: int
    apply_at: int
    pending: Pending | None
    mean: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The mean outer gradient, waiting for the collective if it is still in flight."""
        if self.mean is None:
            self.mean = self.pending.wait()
        return self.mean


class StreamingOuterSync(OuterSync):
    """Streaming DiLoCo's outer loop over one dp ``group`` (module docstring; settings from
    ``cfg``: ``inner_steps`` H, ``fragments`` F, ``overlap_steps`` τ, ``mixing_alpha`` α,
    ``outer_grad_dtype``, the outer SGD's). ``named``: the trainable ``(name, parameter)``
    pairs in ``model.named_parameters()`` order, split by :func:`block_fragments` (by
    ``cfg.fragment_pattern``); ``n_blocks``: the whole model's transformer blocks (unset:
    counted from ``named``, which must then hold them all). On a pipeline stage ``named`` is
    the stage's and ``group`` its dp group (the same stage of every replica): a fragment's
    outer step there covers the stage's part of it, and a fragment the stage holds none of is a
    step without communication.

    After inner step t (counted from the start), fragment f = the one whose offset ``f·H//F``
    is ``t mod H`` starts: its outer gradient ``θ_global,f − θ_local,f`` is all-reduced with
    ``async_op=True`` (fp32; bf16/int8 payloads are all-gathered and summed in fp32 in rank
    order, so every replica gets the same sum). After step t + τ its mean is applied by the outer
    SGD (one parameter per fragment: its own Nesterov momentum buffer) to ``θ_global,f`` and the
    replica's fragment becomes ``α·θ_local,f + (1−α)·θ_global,f`` (τ = 0: ``θ_global,f``, as
    DiLoCo). With F = 1, τ = 0 and fp32 this is DiLoCo exactly.

    Attributes (beyond :class:`OuterSync`'s):
        inner_done: inner steps since the start (the schedule's clock; not reset by a sync).
        outer_steps: fragment outer steps applied.
        pattern: ``cfg.fragment_pattern`` ("sequential" or "strided", :func:`block_fragment`).
        runs: per fragment, its runs of consecutive parameters (:func:`fragment_runs`: slices
            of ``params`` and of ``θ_global``).
        views: per fragment, its runs' views of ``θ_global`` (the outer SGD's parameters).
        pending: the started, not yet applied :class:`InFlight` all-reduces, oldest first.
        wait_s: seconds spent waiting for (and decoding) outer collectives before applying them.

    Raises:
        ValueError: F > H, or a fragment layout :func:`block_fragments` refuses (τ < H is
            checked by ``DataParallelConfig``).
        RuntimeError: (a collective) the replicas' parameters differ.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], inner_optimizer: torch.optim.Optimizer,
                 group: dist.ProcessGroup, cfg: DataParallelConfig, hook: CommHook | None = None,
                 written: Callable[[], None] = lambda: None, n_blocks: int | None = None,
                 reducer: CommHook | None = None):  # fmt: skip
        names, params = [name for name, _ in named], [p for _, p in named]
        h = cfg.resolved_inner_steps
        n_blocks = count_blocks(names) if n_blocks is None else n_blocks
        fragments = max(1, cfg.resolved_fragments(n_blocks))  # a model without blocks: one fragment
        if fragments > h:
            raise ValueError(
                f"data_parallel.fragments={fragments} is more than data_parallel.inner_steps={h}: the fragments sync "
                "at distinct steps of each period; lower fragments or raise inner_steps"
            )
        self.pattern = cfg.fragment_pattern
        fragment_of = block_fragments(names, fragments, n_blocks, self.pattern)
        self.runs = fragment_runs(fragment_of, [held(p).numel() for p in params], fragments)
        self.offsets = {f * h // fragments: f for f in range(fragments)}
        self.overlap_steps, self.mixing_alpha, self.outer_grad_dtype = (
            cfg.overlap_steps, cfg.mixing_alpha, cfg.outer_grad_dtype,
        )  # fmt: skip
        self.pending: list[InFlight] = []
        # cfg.mode: "diloco" when build_outer_sync runs DiLoCo's quantized outer gradients through here.
        reducer = reducer if reducer is not None else payload_hook(cfg.outer_grad_dtype)
        super().__init__(params, inner_optimizer, group, cfg.mode, h, cfg.outer_lr, cfg.outer_momentum,
                         cfg.outer_nesterov, hook, written, reducer)  # fmt: skip

    def _build_outer_optimizer(self, lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD:
        """One outer SGD whose parameters are the fragments' runs' views of ``θ_global`` (in
        fragment order): stepping it with only fragment f's gradients set updates only its views
        and their momentum buffers (SGD is elementwise: a fragment of several views steps as one
        tensor would)."""
        self.views = [[self.global_flat[elements] for _, elements in runs] for runs in self.runs]
        flat_views = [view for views in self.views for view in views]
        return torch.optim.SGD(flat_views, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)

    def fragment_params(self, fragment: int) -> list[nn.Parameter]:
        """The parameters of ``fragment`` on this rank, in ``params`` order."""
        return [p for params, _ in self.runs[fragment] for p in self.params[params]]

    def after_inner_step(self, force: bool = False) -> bool:
        """Count one inner step; apply the outer steps due now (started τ steps ago); start the
        sync of the fragment whose offset this step is (applied at once if τ = 0); with
        ``force`` (the run's last step) take :meth:`outer_step` instead. Collectives. Returns
        whether a fragment sync started (always, with ``force``)."""
        self.inner_done += 1
        self._land(lambda entry: entry.apply_at <= self.inner_done)
        if force:
            self.outer_step()
            return True
        fragment = self.offsets.get(self.inner_done % self.inner_steps)
        if fragment is None:
            return False
        entry = self._start(fragment)
        if self.overlap_steps == 0:
            self._apply(entry, mix=False)
        else:
            self.pending.append(entry)
        return True

    @torch.no_grad()
    def outer_step(self) -> None:
        """Apply every in-flight fragment sync, then sync every fragment at once and wait (a
        full DiLoCo outer step, sent fragment by fragment): every replica then holds
        ``θ_global``. A collective over :attr:`group`."""
        self._land(lambda entry: True)
        for fragment in range(len(self.runs)):
            self._apply(self._start(fragment), mix=False)

    def _land(self, due: Callable[[InFlight], bool]) -> None:
        """Apply, oldest first, the pending syncs for which ``due`` is true, mixing (α)."""
        for entry in [e for e in self.pending if due(e)]:
            self.pending.remove(entry)
            self._apply(entry, mix=True)

    @torch.no_grad()
    def _start(self, fragment: int) -> InFlight:
        """Start the all-reduce of ``fragment``'s outer gradient ``θ_global,f − θ_local,f``.
        Counts its bytes in :attr:`hook` (``dense_bytes``: the fp32 all-reduce's)."""
        params = self.fragment_params(fragment)
        apply_at = self.inner_done + self.overlap_steps
        delta = torch.cat(self.views[fragment])  # θ_global,f: a new 1-D tensor
        if delta.numel() == 0:  # none of it on this pipeline stage (nor its dp group's: the same)
            return InFlight(fragment, apply_at, None, delta)
        delta.sub_(flatten(params))
        # The fragment's index keys the reducer's per-bucket state (auto's path for its size).
        return InFlight(fragment, apply_at, self.average(self.outer_bucket(fragment, delta, params)))

    @torch.no_grad()
    def _apply(self, entry: InFlight, mix: bool) -> None:
        """The outer SGD step on ``entry``'s fragment of ``θ_global`` with the mean outer
        gradient; the replica's fragment then takes ``θ_global,f`` (``mix``: lerped with weight
        α towards its own ``θ_local,f``)."""
        synchronize(self.global_flat.device)
        start = time.perf_counter()
        mean = entry.wait()
        synchronize(self.global_flat.device)
        self.wait_s += time.perf_counter() - start
        views = self.views[entry.fragment]
        grads = mean.split([view.numel() for view in views])
        for view, grad in zip(views, grads, strict=True):
            view.grad = grad
        self.outer_optimizer.step()
        for (params, _), view in zip(self.runs[entry.fragment], views, strict=True):
            view.grad = None
            if view.numel():
                target = torch.lerp(view, flatten(self.params[params]), self.mixing_alpha) if mix else view
                write_flat(target, self.params[params])
        self.written()
        self.outer_steps += 1

    def _view_elements(self) -> Iterator[tuple[torch.Tensor, slice]]:
        """Each of the outer SGD's parameters (a fragment's run's view of θ_global) and its slice
        of θ_global."""
        for runs, views in zip(self.runs, self.views, strict=True):
            for (_, elements), view in zip(runs, views, strict=True):
                yield view, elements

    def momentum(self) -> torch.Tensor | None:
        """The fragments' outer momentum buffers laid out like θ_global (a new 1-D fp32 tensor;
        zeros for a fragment not stepped yet, whose first step then adds its outer gradient to
        zero, as SGD's first step copies it), or ``None`` before any fragment's first outer step
        (or with ``outer_momentum=0``)."""
        state = self.outer_optimizer.state
        pieces = [(elements, state[view]["momentum_buffer"]) for view, elements in self._view_elements()
                  if "momentum_buffer" in state.get(view, {})]  # fmt: skip
        if not pieces:
            return None
        flat = torch.zeros_like(self.global_flat)
        for elements, buffer in pieces:
            flat[elements] = buffer
        return flat

    def _set_momentum(self, momentum: torch.Tensor) -> None:
        for view, elements in self._view_elements():
            self.outer_optimizer.state[view]["momentum_buffer"] = momentum[elements].clone()

    def state_dict(self) -> dict[str, Any]:
        """:meth:`OuterSync.state_dict` plus ``fragments`` (F), ``fragment_pattern`` and
        ``pending``: each in-flight all-reduce is completed first (a collective wait, so every
        rank must checkpoint at the same step, as the trainer does) and saved as ``{"fragment",
        "apply_at", "mean"}`` (the replicas' mean fp32 outer gradient), still to be applied at its
        own step: a resume continues the same run."""
        pending = [{"fragment": e.fragment, "apply_at": e.apply_at, "mean": e.wait().clone()} for e in self.pending]
        layout = {"fragments": len(self.runs), "fragment_pattern": self.pattern}
        return {**super().state_dict(), **layout, "pending": pending}

    def _restore(self, state: dict[str, Any]) -> None:
        # Checkpoints from before fragment_pattern existed are sequential.
        saved = (state.get("fragments"), state.get("fragment_pattern", "sequential"))
        if saved != (len(self.runs), self.pattern):
            raise ValueError(
                f"the checkpoint's streaming DiLoCo state has {saved[0]} {saved[1]} fragments, this run "
                f"{len(self.runs)} {self.pattern}: resume with data_parallel.fragments={saved[0]} and "
                f"data_parallel.fragment_pattern={saved[1]!r}"
            )
        super()._restore(state)
        device, n = self.global_flat.device, dist.get_world_size(self.group)
        self.pending = [InFlight(p["fragment"], p["apply_at"], None, _saved_mean(p, n).to(device).clone())
                        for p in state["pending"]]  # fmt: skip


def _saved_mean(entry: dict[str, Any], replicas: int) -> torch.Tensor:
    """A checkpointed in-flight sync's mean outer gradient (files written before 2026-12-04
    hold the replicas' sum, ``total``)."""
    return entry["mean"] if "mean" in entry else entry["total"] / replicas


def build_outer_sync(cfg: DataParallelConfig, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                     group: dist.ProcessGroup, hook: CommHook,
                     written: Callable[[], None] = lambda: None, n_blocks: int | None = None,
                     reducer: CommHook | None = None) -> Any:  # fmt: skip
    """The outer loop that ``cfg.mode`` asks for over the dp ``group`` (``None`` for ``sync``;
    :class:`StreamingOuterSync` for ``streaming_diloco``, and with one fragment and no overlap for
    ``diloco`` with a 16- or 8-bit ``outer_grad_dtype``; the state of the asynchronous mode,
    :class:`~loomtrain.distributed.async_dp.AsyncOuter`, for ``async``),
    on ``model``'s trainable parameters, counting its bytes in ``hook`` (the gradient
    synchronizer's). ``group``: :func:`outer_group`; ``written``: the gradient synchronizer's
    ``after_step`` (see :class:`OuterSync`); ``n_blocks``: the whole model's transformer blocks
    (streaming's fragments; needed where ``model`` is one pipeline stage); ``reducer``: the hook
    that averages the outer gradients (:func:`outer_reducer`; ``None``: flat, in
    ``cfg.outer_grad_dtype``). A collective."""
    if cfg.mode == "sync":
        return None
    if cfg.mode == "async":
        from loomtrain.distributed.async_dp import AsyncOuter  # it imports this module

        return AsyncOuter([p for p in model.parameters() if p.requires_grad], inner_optimizer, cfg, group, hook,
                          written)  # fmt: skip
    if cfg.mode == "diloco" and cfg.outer_grad_dtype != "fp32":
        # DiLoCo is streaming DiLoCo with one fragment and no overlap (tested equal in fp32), so its
        # quantized outer gradients take that path (Streaming DiLoCo §2.5 quantizes them; the
        # DiLoCo paper's own are fp32).
        cfg = cfg.model_copy(update={"fragments": 1, "overlap_steps": 0})
    if cfg.mode == "streaming_diloco" or cfg.outer_grad_dtype != "fp32":
        return StreamingOuterSync(trainable(model), inner_optimizer, group, cfg, hook, written, n_blocks, reducer)
    params = [p for _, p in trainable(model)]
    return OuterSync(params, inner_optimizer, group, cfg.mode, cfg.resolved_inner_steps, cfg.outer_lr,
                     cfg.outer_momentum, cfg.outer_nesterov, hook, written, reducer)  # fmt: skip


def replicas_sync_inside(cfg: DataParallelConfig, dims: ParallelDims) -> bool:
    """Whether a local mode's replicas are the ``dp_replicate`` groups, each of ``dp_shard``
    ranks that average their gradients every step (plain data parallelism or ZeRO inside the
    replica, DiLoCo's usual setting), rather than every dp rank a replica of its own. Async's
    replicas are cut the same way (replica 0 serves)."""
    return cfg.mode in (*OUTER_SYNC_MODES, "async") and dims.dp_replicate > 1


def outer_shard_group(cfg: DataParallelConfig, dims: ParallelDims) -> dist.ProcessGroup | None:
    """The ``dp_shard`` group when a local mode's replicas are several plain-DP ranks each (no
    ZeRO: every rank of a replica holds the same parameters, so the outer all-reduce can be split
    over them, :class:`ReplicaSplitHook`); else ``None``. A collective the first time."""
    if not replicas_sync_inside(cfg, dims) or cfg.zero_stage or dims.dp_shard == 1:
        return None
    return dims.group(Axis.DP_SHARD)


def payload_hook(outer_grad_dtype: str) -> CommHook:
    """The flat hook averaging outer gradients in ``outer_grad_dtype``: a dense fp32
    ``AllReduceHook``, or an :class:`OuterPayloadHook` for bf16 and int8."""
    return AllReduceHook() if outer_grad_dtype == "fp32" else OuterPayloadHook(outer_grad_dtype)


def outer_reducer(cfg: DataParallelConfig, dims: ParallelDims, topology: Topology | None) -> CommHook | None:
    """The hook a sync-family mode's outer step averages with (``None`` for other modes), its
    payload in ``cfg.outer_grad_dtype`` (:func:`payload_hook`): split over the ranks of a replica
    of several plain-DP ranks (:func:`outer_shard_group`, :class:`ReplicaSplitHook`); with every
    dp rank a replica and ``cfg.comm_hook`` ``hierarchical`` or ``auto``, the multi-host hooks
    over the outer groups (reduce-scatter inside each host, the payload across hosts, all-gather
    inside: each rank sends ``1/P`` of it across hosts), set up here on ``topology`` (the job's,
    identical on every rank); else flat. A collective (the groups it needs).

    Raises:
        ValueError: ``hierarchical`` or ``auto`` without a ``topology``.
    """
    if cfg.mode not in OUTER_SYNC_MODES:
        return None
    inner = payload_hook(cfg.outer_grad_dtype)
    replica = outer_shard_group(cfg, dims)
    if replica is not None:
        return ReplicaSplitHook(replica, inner)
    if replicas_sync_inside(cfg, dims):
        return inner
    hook = host_hook(cfg.comm_hook, topology, inner)
    hook.setup(dims.axis_groups(Axis.DP_SP))  # the outer groups of one-rank replicas (outer_group)
    return hook


def outer_group(cfg: DataParallelConfig, dims: ParallelDims) -> dist.ProcessGroup:
    """The ranks a local mode's outer step averages over: the ``dp_replicate`` axis (the same
    rows of the same shard in every replica) when :func:`replicas_sync_inside`, else the whole
    gradient mesh (every dp rank a replica). A collective the first time (the mesh's groups)."""
    if replicas_sync_inside(cfg, dims):
        return dims.group(Axis.DP_REPLICATE)
    return dims.grad_mesh.get_group()
