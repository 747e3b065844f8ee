"""Mixed-precision policy and dynamic loss scaling for ZeRO (``zero.py``).

The policy follows Micikevicius et al., "Mixed Precision Training" (ICLR 2018): compute in a
16-bit dtype, keep fp32 master weights and optimizer state, and for fp16 scale the loss so
small gradients do not underflow, lowering the scale whenever a gradient overflows (§3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes ZeRO uses. Master weights and optimizer state are always fp32.

    Attributes:
        param_dtype: dtype of the gathered parameters that forward and backward compute with.
        reduce_dtype: dtype in which gradients are reduced (all-reduce or reduce-scatter).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def from_names(cls, param_dtype: str, reduce_dtype: str) -> MixedPrecision:
        """From config names (``"fp32"``, ``"bf16"``, ``"fp16"``)."""
        return cls(DTYPES[param_dtype], DTYPES[reduce_dtype])


class DynamicLossScaler:
    """Dynamic loss scale for fp16 (Micikevicius et al. 2018, §3.2).

    Multiply the loss by :attr:`scale` before backward; :meth:`unscale_and_check` divides the
    gradients back and tells whether any rank saw inf/nan. On overflow the step must be
    skipped and the scale is multiplied by ``backoff``; after ``growth_interval`` good steps
    in a row it is multiplied by ``growth``.

    Resume state (:meth:`state_dict`): ``{"scale": float, "good_steps": int}``.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000, backoff: float = 0.5,
                 growth: float = 2.0):  # fmt: skip
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self.good_steps = 0

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor], *groups: dist.ProcessGroup) -> bool:
        """Divide ``grads`` (this rank's shards) by the scale in place, update the scale, and
        return ``True`` when the optimizer may step (no rank found inf or nan). The verdict is
        agreed over ``groups`` in turn (e.g. the data-parallel, then the tensor-parallel group),
        so it covers every rank of their product."""
        found = torch.zeros(1, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(1.0 / self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
        # Each rank holds different shards: one rank's overflow must skip the step everywhere.
        for group in groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        ok = found.item() == 0
        if not ok:
            self.scale *= self.backoff
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
