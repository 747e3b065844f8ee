"""Top-K sparsification with residual accumulation: Deep Gradient Compression.

Source: Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training" (ICLR 2018). Each rank adds its gradient to its residual, sends only the
``k`` largest magnitudes of every tensor (§3.1: threshold per layer; ``k = ceil(ratio·numel)``)
as (index, value) pairs and keeps the rest as the residual (§3.1, "gradient accumulation").
Tensors smaller than ``min_compress_numel`` are sent whole. Optional parts of the paper:

- momentum correction (§3.2): accumulate the velocity ``u ← m·u + g`` instead of the
  gradient, and momentum factor masking (§3.3): clear ``u`` where values were sent. Meant for
  plain SGD with the momentum done here, so the optimizer's own momentum should be off;
- warm-up (§3.4): for the first ``warmup_steps`` steps either a dense all-reduce, or, with
  ``warmup_density`` ``d₀``, the paper's exponential ramp: step ``t`` sends the fraction
  ``d₀·(ratio/d₀)^(t/warmup_steps)`` of each tensor, from ``d₀`` down to ``ratio``.

The sparse parts cannot be summed on the wire: every rank all-gathers all ranks' (int32
index, fp32 value) pairs and adds them into a dense buffer in rank order, so every rank
computes the identical sum. Per rank that sends ``(n−1)·8k`` bytes against the dense
all-reduce's ``2·(n−1)/n·4N``: ratio ``n·k/N``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from loomtrain.compression.feedback import CompressionHook, Pending, same_view
from loomtrain.distributed.data_parallel import GradBucket
from loomtrain.distributed.traffic import all_gather_bytes


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64 ``[k]``, unordered) of the ``k`` largest ``|x|`` of 1-D ``x``."""
    return x.abs().topk(k, sorted=False).indices


def _flat_index(view: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Element offsets, relative to ``view.storage_offset()``, of ``view.reshape(-1)[local]``."""
    coords = torch.unravel_index(local, view.shape)
    return sum(c * s for c, s in zip(coords, view.stride(), strict=True))


class TopKHook(CompressionHook):
    """Sends the ``ratio`` fraction of largest-magnitude entries of each tensor, with residuals.

    Args:
        ratio: fraction of each tensor's entries sent, in (0, 1]; 1 sends everything (lossless).
        min_compress_numel: tensors with fewer elements are sent whole.
        momentum: DGC momentum correction factor ``m`` (0: off).
        warmup_steps: steps of warm-up: dense, or the density ramp if ``warmup_density``.
        warmup_density: the fraction sent at step 0 of the ramp (0: dense warm-up instead).
    """

    method = "topk"

    def __init__(
        self,
        ratio: float,
        min_compress_numel: int = 0,
        momentum: float = 0.0,
        warmup_steps: int = 0,
        warmup_density: float = 0.0,
    ):
        super().__init__(warmup_steps)
        self.ratio, self.min_compress_numel, self.momentum = ratio, min_compress_numel, momentum
        self.warmup_density = warmup_density
        self.velocity: dict[int, torch.Tensor] = {}

    @property
    def warming_up(self) -> bool:
        """Dense warm-up only: the ramp compresses from its first step."""
        return not self.warmup_density and super().warming_up

    def density(self) -> float:
        """The fraction of each tensor sent at the current step."""
        if self.warmup_density and self.steps < self.warmup_steps:
            return self.warmup_density * (self.ratio / self.warmup_density) ** (self.steps / self.warmup_steps)
        return self.ratio

    def _k(self, numel: int) -> int:
        return numel if numel < self.min_compress_numel else max(1, math.ceil(self.density() * numel))

    def _accumulated(self, bucket: GradBucket) -> torch.Tensor:
        """``Δ``: residual plus gradient, or (momentum correction) residual plus velocity."""
        if not self.momentum:
            return self.feedback.accumulate(bucket.index, bucket.buffer)
        u = self.velocity.get(bucket.index)
        if u is None or u.shape != bucket.buffer.shape:
            u = self.velocity[bucket.index] = torch.zeros_like(bucket.buffer, dtype=torch.float32)
        return self.feedback.accumulate(bucket.index, u.mul_(self.momentum).add_(bucket.buffer))

    def _select(self, bucket: GradBucket, delta: torch.Tensor) -> torch.Tensor:
        """Flat indices into ``delta`` of every tensor's top-k entries (int64)."""
        picked = []
        for m in bucket.matrices:
            view = same_view(m, bucket.buffer, delta)
            local = topk_indices(view.reshape(-1), self._k(view.numel()))
            picked.append(_flat_index(view, local) + (view.storage_offset() - delta.storage_offset()))
        return torch.cat(picked)

    def _start(self, bucket: GradBucket, group: dist.ProcessGroup) -> Pending:
        n, numel = dist.get_world_size(group), bucket.buffer.numel()
        if numel >= 2**31:
            raise ValueError(f"bucket {bucket.index} has {numel} elements; int32 indices need fewer than 2**31")
        delta = self._accumulated(bucket)
        index = self._select(bucket, delta)
        values = delta[index]
        delta[index] = 0
        if self.momentum:
            self.velocity[bucket.index][index] = 0
        payload = torch.cat([index.to(torch.int32), values.view(torch.int32)])
        size = payload.numel()
        gathered = torch.empty(n * size, dtype=torch.int32, device=payload.device)
        parts = [gathered.narrow(0, r * size, size) for r in range(n)]
        work = dist.all_gather(parts, payload, group=group, async_op=True)
        self.bytes_sent += all_gather_bytes(gathered.numel() * 4, n)
        k = index.numel()

        def finish() -> torch.Tensor:
            total = torch.zeros(numel, dtype=torch.float32, device=delta.device)
            for part in parts:  # indices are distinct within a part: each index_add_ is exact and ordered
                total.index_add_(0, part[:k].long(), part[k:].view(torch.float32))
            return bucket.buffer.copy_(total.div_(n))

        return Pending(work, finish)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "velocity": dict(self.velocity)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.velocity = dict(state["velocity"])
