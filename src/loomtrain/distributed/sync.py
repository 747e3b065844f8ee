"""The gradient-sync protocol: what the training loop asks of any data-parallel strategy.

Plain data parallelism (``data_parallel.py``) and ZeRO (``zero.py``) implement it; the
trainer drives them alike and never asks which one it has. One optimizer step is::

    loss = forward_backward(micro_batches, scale=sync.loss_scale)  # all but the last under sync.no_sync()
    sync.finish_gradient_sync()       # wait for the reductions: .grad holds the average
    if sync.prepare_step(max_norm):   # unscale, overflow check, global-norm clip
        optimizer.step()
        sync.after_step()             # e.g. ZeRO refreshes its gathered parameters
    sync.zero_grad()

A strategy's state that a resumed run needs (error-feedback residuals of the comm hook, the
fp16 loss scale, later balancer and outer-optimizer state) is in :meth:`GradientSync.state_dict`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomtrain.distributed.mixed_precision import DynamicLossScaler
from loomtrain.profiling import CommOverlap


class GradientSync(ABC):
    """A data-parallel gradient synchronizer (see the module docstring for the call order).

    Attributes:
        hook: the :class:`~loomtrain.distributed.data_parallel.CommHook` that reduces gradients.
        blocked_s: running total of seconds blocked on collectives inside forward and backward.
        group: the ranks whose gradients are averaged (``ParallelDims.grad_mesh``).
        scaler: the fp16 dynamic loss scaler, or ``None``.
        overlap: times the gradient reductions against backward (host clock; off on CUDA).
    """

    _sync = True

    def __init__(self, hook, group: dist.ProcessGroup, device: torch.device, scaler: DynamicLossScaler | None = None):
        self.hook = hook
        self.group = group
        self.device = device  # where this strategy's collectives put their small tensors (NCCL needs CUDA)
        self.scaler = scaler
        self.optimizer: torch.optim.Optimizer | None = None
        self._rank_factor = 1.0
        # Seconds spent blocked on collectives inside forward and backward (ZeRO-3's parameter
        # gathers wait for the slowest rank): a speed monitor takes them out of compute time.
        self.blocked_s = 0.0
        self.overlap = CommOverlap(enabled=device.type == "cpu")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside it, backward accumulates gradients locally and nothing is communicated (all
        micro-batches of a step but the last)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @abstractmethod
    def finish_gradient_sync(self) -> None:
        """Wait for every reduction of this step; afterwards the gradients are averaged."""

    @abstractmethod
    def prepare_step(self, max_norm: float) -> bool:
        """Make the averaged gradients ready for ``optimizer.step()``: divide out the fp16 loss
        scale and check for inf/nan on every rank, then clip to global L2 norm ``max_norm``
        (``<= 0``: no clipping). Returns ``False`` when the step must be skipped (overflow)."""

    @abstractmethod
    def after_step(self) -> None:
        """Called after each ``optimizer.step()`` that ran (not after a skipped one)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop or zero the gradients after the step."""

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes: ``param_bytes``, ``grad_bytes``, ``optim_bytes``."""

    @abstractmethod
    def remove(self) -> None:
        """Detach from the module, leaving plain full parameters (a collective for ZeRO)."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps this module's parameters (its state is counted in
        :meth:`state_bytes`)."""
        self.optimizer = optimizer

    @property
    def loss_scale(self) -> float:
        """Factor to multiply the loss by before backward: the fp16 loss scale (1 without) times
        this rank's weight factor (1 unless :meth:`set_rank_weight` was called)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        return scale * self._rank_factor

    def set_rank_weight(self, weight: float) -> None:
        """Weigh this rank's gradient by ``weight`` (e.g. the samples it processed this step)
        in the average: the result becomes ``Σ_r weight_r·g_r / Σ_r weight_r`` instead of the
        plain mean. A collective over :attr:`group` (one all-reduce of the weights); the
        factor holds until the next call. Works by scaling the loss (``n·weight / Σ weight``),
        so every hook and ZeRO stage averages the weighted gradients unchanged.

        Raises:
            ValueError: on every rank, when any rank's weight is negative or the weights sum to zero.
        """
        # The weight sum and the count of negative weights in one all-reduce, so all ranks agree to raise.
        values = torch.tensor([max(weight, 0.0), float(weight < 0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.group)
        total, negative = values.tolist()
        if negative:
            raise ValueError(f"{int(negative)} rank(s) gave a negative rank weight (this rank: {weight})")
        if total <= 0:
            raise ValueError("the rank weights sum to zero: at least one rank must have processed samples")
        self._rank_factor = dist.get_world_size(self.group) * weight / total

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """What a resumed run needs: ``"shared"`` (JSON-able, the same on every rank, kept
        across a change of world size: the loss scaler) and ``"per_rank"`` (this rank's own,
        tensors allowed, restored only at the same layout: the hook's error-feedback residuals)."""
        shared = {} if self.scaler is None else {"loss_scaler": self.scaler.state_dict()}
        per_rank = {"comm_hook": self.hook.state_dict(), "compression_method": self.hook.method}
        return {"shared": shared, "per_rank": per_rank}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output. Parts absent (a layout change drops the
        per-rank part) keep their fresh state; residuals of another compression method do not
        fit and are ignored, so they restart at zero."""
        shared, per_rank = state.get("shared", {}), state.get("per_rank", {})
        if self.scaler is not None and "loss_scaler" in shared:
            self.scaler.load_state_dict(shared["loss_scaler"])
        if per_rank.get("compression_method") == self.hook.method:
            self.hook.load_state_dict(per_rank["comm_hook"])


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped; DTensors count
    their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(params, grads, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Per-rank bytes actually held (distinct storages) by ``params``, ``grads`` (``None``
    entries skipped) and ``optimizer``'s state."""
    states = [] if optimizer is None else optimizer.state.values()
    optim = [v for s in states for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes(grads),
        "optim_bytes": storage_bytes(optim),
    }
