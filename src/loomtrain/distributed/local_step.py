"""Optimizer steps on the local shards of DTensor parameters, DTensors kept for checkpoints.

Why: ZeRO's masters are ``Shard(0)`` DTensors, so that ``state_dict()`` and DCP see sharded
weights and reshard them between layouts. But an optimizer stepping DTensors pays DTensor
dispatch on every operation: torch's single-tensor AdamW (the CPU default) makes about ten
per parameter, and on the 25 M-parameter model of ``benchmarks/bench_zero.py`` its step took
58 ms against 38 ms for the same elements as plain tensors (docs/performance.md). Every one of
those operations is elementwise on this rank's rows, so stepping the plain local tensors does
the same arithmetic on the same memory: the results are bit for bit the same.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


class LocalShardStep:
    """Makes ``optimizer.step()`` run on the local tensors of its DTensor parameters.

    A step pre-hook swaps each DTensor parameter in the param groups for its local tensor
    (with the local part of its ``.grad``) and keys the state by those local tensors, their
    DTensor values replaced by their local parts (the same storage, updated in place); the
    post-hook swaps everything back and wraps state the step created (e.g. AdamW's moments on
    the first step, shaped like the parameter) as DTensors placed like their parameter. Between
    steps the optimizer looks exactly as it would without this: DTensor parameters and state,
    which is what ``get_state_dict`` and DCP checkpoints read.

    Only for optimizers whose update is elementwise (SGD, Adam, AdamW, ...): a step that mixes
    elements of one parameter (a norm across rows, as LAMB or Muon compute) would see only
    this rank's rows.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._masters: dict[int, DTensor] = {}
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._to_local())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._to_dtensor())

    def _to_local(self) -> None:
        opt, state = self.optimizer, defaultdict(dict)
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if not isinstance(p, DTensor):
                    continue
                local = p._local_tensor
                local.grad = None if p.grad is None else p.grad._local_tensor
                self._masters[id(local)] = p
                group["params"][i] = local
                if p in opt.state:
                    state[local] = {k: _local(v) for k, v in opt.state[p].items()}
        for p, values in opt.state.items():
            if not isinstance(p, DTensor):
                state[p] = values
        self._dtensor_state = opt.state
        opt.state = state

    def _to_dtensor(self) -> None:
        opt, old = self.optimizer, self._dtensor_state
        for group in opt.param_groups:
            for i, local in enumerate(group["params"]):
                master = self._masters.get(id(local))
                if master is not None:
                    group["params"][i] = master
                    local.grad = None
        for key, values in opt.state.items():
            master = self._masters.get(id(key))
            if master is None:
                old[key] = values
            else:
                before = old.get(master, {})
                old[master] = {k: placed_like(master, v, before.get(k)) for k, v in values.items()}
        self._masters.clear()
        opt.state = old
        self._dtensor_state = None


def _local(value):
    """A state value for a local step: a DTensor's local part (same storage), else as is."""
    return value._local_tensor if isinstance(value, DTensor) else value


def placed_like(master: DTensor, value, before=None):
    """``value`` of ``master``'s state after a local step (or loaded from a per-rank file, no
    ``before``): the DTensor it was before (its
    local part was updated in place), a new tensor shaped like the local shard wrapped as a
    DTensor placed like ``master``, or as is (a scalar such as AdamW's step count)."""
    if isinstance(before, DTensor) and before._local_tensor is value:
        return before
    if isinstance(value, torch.Tensor) and value.shape == master._local_tensor.shape and value.dim() > 0:
        return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False,
                                  shape=master.shape, stride=master.stride())  # fmt: skip
    return value
