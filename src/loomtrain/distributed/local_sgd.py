"""Communication-light data parallelism: local SGD and DiLoCo (``data_parallel.mode``).

Each dp rank is one replica. Inner steps are plain local optimizer steps: the gradient is
not all-reduced across dp (the trainer builds the gradient synchronizer with
:class:`LocalOnlyHook`, which leaves each rank's gradient as it is). Every ``H`` inner steps
an outer step (:meth:`OuterSync.outer_step`) brings the replicas back together::

    Δ = θ_global − mean_r θ_local,r      (one all-reduce of the fp32 deltas over the dp group)
    local_sgd:  θ_global ← θ_global − Δ  (= mean_r θ_local,r: outer SGD, lr 1, no momentum)
    diloco:     θ_global ← OuterOpt(θ_global, Δ)   (SGD with Nesterov momentum)
    every replica: θ_local ← θ_global

Local SGD: Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019), periodic
model averaging. DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv:2311.08105, 2023), Algorithm 1 (the outer gradient is the averaged
parameter delta, applied by an outer optimizer) and §3 (outer Nesterov momentum 0.9, outer
learning rate 0.7, H = 500 inner AdamW steps). The inner optimizer state (AdamW moments)
stays local to each replica and is kept across outer steps, as in DiLoCo.

The global model ``θ_global`` is what the run evaluates and writes into the DCP checkpoint
(:meth:`OuterSync.global_weights`); each replica's ``θ_local``, inner optimizer state, the
outer optimizer state and the inner step counter go into its per-rank checkpoint file
(:meth:`OuterSync.state_dict`), so a resume inside an inner phase continues the same run.
The trainer forces an outer step after the last training step, so a run ends with one model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.config import DEFAULT_INNER_STEPS, DataParallelConfig
from loomtrain.distributed.data_parallel import CommHook, GradBucket
from loomtrain.distributed.traffic import all_reduce_bytes
from loomtrain.hardware import synchronize

log = logging.getLogger(__name__)


class LocalOnlyHook(CommHook):
    """A communication hook that reduces nothing: each dp rank keeps its own gradient, as the
    inner steps of local SGD and DiLoCo need (sends 0 bytes)."""

    def reduce(self, bucket: GradBucket, group: dist.ProcessGroup) -> torch.futures.Future:
        """A completed future holding ``bucket.buffer`` unchanged (no collective)."""
        del group
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer)
        return done


def flatten(params: list[nn.Parameter]) -> torch.Tensor:
    """``params`` concatenated into a new 1-D fp32 tensor of ``Σ p.numel()`` elements."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


@torch.no_grad()
def write_flat(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Copy the 1-D ``flat`` (``Σ p.numel()`` elements) into ``params`` in place, cast to
    each parameter's dtype."""
    offset = 0
    for p in params:
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


class OuterSync:
    """The outer loop of local SGD or DiLoCo over one dp ``group`` (see the module docstring).

    Holds ``θ_global`` as one flat fp32 tensor of ``Σ p.numel()`` elements (the parameters in
    ``params`` order), the outer optimizer (``torch.optim.SGD``, DiLoCo only) and the inner
    step counter. ``inner_optimizer`` is the local optimizer stepping ``params``: its state is
    part of :meth:`state_dict`, since DCP keeps one copy of what it takes for replicated.
    ``hook``: the gradient synchronizer's hook, where the outer all-reduce's bytes are counted
    (a fresh :class:`LocalOnlyHook` if ``None``).

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
                 hook: CommHook | None = None):  # fmt: skip
        if mode not in DEFAULT_INNER_STEPS:
            raise ValueError(f"mode={mode!r} is not an outer-step mode; use one of {sorted(DEFAULT_INNER_STEPS)}")
        if inner_steps < 1:
            raise ValueError(f"inner_steps={inner_steps} must be at least 1")
        self.params, self.inner_optimizer, self.group = list(params), inner_optimizer, group
        self.mode, self.inner_steps = mode, inner_steps
        self.hook = hook if hook is not None else LocalOnlyHook()
        self.global_flat = flatten(self.params)
        check_identical(self.global_flat, group, "the initial parameters")
        self.outer_optimizer = None
        if mode == "diloco":
            self.outer_optimizer = torch.optim.SGD([self.global_flat], lr=outer_lr, momentum=outer_momentum,
                                                   nesterov=nesterov and outer_momentum > 0)  # fmt: skip
        self.inner_done = self.outer_steps = 0
        self.wait_s = 0.0

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
        """All-reduce the mean outer gradient ``Δ = θ_global − mean θ_local`` (fp32, ``4·Σ
        numel`` bytes), update ``θ_global`` and copy it into every replica's parameters. The
        ring volume is counted in :attr:`hook`'s ``bytes_sent`` (the ``dp`` axis of its traffic
        counter) and ``dense_bytes``, as a dense gradient all-reduce would be. A collective over
        :attr:`group`."""
        n = dist.get_world_size(self.group)
        delta = self.global_flat - flatten(self.params)
        # On CUDA the collective is queued on a stream: the wait is measured between device syncs.
        synchronize(delta.device)
        start = time.perf_counter()
        dist.all_reduce(delta, group=self.group)
        synchronize(delta.device)
        self.wait_s += time.perf_counter() - start
        nbytes = all_reduce_bytes(delta.numel() * delta.element_size(), n)
        self.hook.bytes_sent += nbytes
        self.hook.dense_bytes += nbytes
        delta.div_(n)
        if self.outer_optimizer is None:
            self.global_flat.sub_(delta)
        else:
            self.global_flat.grad = delta
            self.outer_optimizer.step()
            self.global_flat.grad = None
        write_flat(self.global_flat, self.params)
        self.inner_done = 0
        self.outer_steps += 1

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """Inside it, the parameters hold ``θ_global`` (the same on every replica: what the run
        evaluates and checkpoints); each replica's ``θ_local`` is back afterwards."""
        local = flatten(self.params)
        write_flat(self.global_flat, self.params)
        try:
            yield
        finally:
            write_flat(local, self.params)

    def state_dict(self) -> dict[str, Any]:
        """This replica's part of a checkpoint (tensors are copies or the live optimizer state):
        ``mode``, ``inner_steps``, ``inner_done``, ``outer_steps``, ``global`` (θ_global, 1-D
        fp32), ``outer_optimizer`` (its state dict, or ``None``), ``local`` (θ_local, 1-D fp32)
        and ``inner_optimizer`` (this replica's optimizer state)."""
        outer = None if self.outer_optimizer is None else self.outer_optimizer.state_dict()
        return {
            "mode": self.mode, "inner_steps": self.inner_steps, "inner_done": self.inner_done,
            "outer_steps": self.outer_steps, "global": self.global_flat.clone(), "outer_optimizer": outer,
            "local": flatten(self.params), "inner_optimizer": self.inner_optimizer.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s output (a collective: checks that ``θ_global`` is the
        same on every replica). ``None`` (a checkpoint of another layout or mode) or a state of
        another mode: the parameters as loaded become ``θ_global`` and a new inner phase starts
        (the outer momentum restarts at zero, with a warning).

        Raises:
            RuntimeError: ``θ_global`` differs across replicas.
            ValueError: the saved ``θ_global`` has another number of elements.
        """
        if state is None or state.get("mode") != self.mode:
            log.warning("no %s state in the checkpoint: the loaded parameters start a new inner phase", self.mode)
            self.global_flat.copy_(flatten(self.params))
            self.inner_done = 0
        else:
            self._restore(state)
        check_identical(self.global_flat, self.group, "the global parameters θ_global")

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
        _load_optimizer_state(self.inner_optimizer, state["inner_optimizer"])
        self.inner_done, self.outer_steps = state["inner_done"], state["outer_steps"]


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load ``saved``'s per-parameter state (momenta, moments) into ``optimizer``, keeping its
    hyperparameters: they are this run's, from the config."""
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": saved["state"], "param_groups": groups})


def build_outer_sync(cfg: DataParallelConfig, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                     group: dist.ProcessGroup, hook: CommHook) -> OuterSync | None:  # fmt: skip
    """The outer loop that ``cfg.mode`` asks for over the dp ``group`` (``None`` for ``sync``),
    on ``model``'s trainable parameters, counting its bytes in ``hook`` (the gradient
    synchronizer's, a :class:`LocalOnlyHook`). A collective."""
    if cfg.mode == "sync":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return OuterSync(params, inner_optimizer, group, cfg.mode, cfg.resolved_inner_steps, cfg.outer_lr,
                     cfg.outer_momentum, cfg.outer_nesterov, hook)  # fmt: skip
