"""Activation checkpointing (recomputation), applied to any modules from outside, and an exact
count of the activation memory a forward leaves for backward.

Source: Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), §3: keep only a
region's inputs in forward and recompute the region in backward; Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023), §4: which
regions of a transformer to recompute (a whole block, or only the attention core). The
recomputation is ``torch.utils.checkpoint``'s non-reentrant one (the saved-tensor hooks of
``torch.autograd.graph``): the region's saved tensors are dropped in forward and rebuilt the
first time backward needs one, with the RNG state of the forward (same dropout masks).

Nothing here knows a model class: ``models/parallelize.py`` chooses the modules (whole
transformer blocks, or their attention cores). Module names and ``state_dict`` keys do not
change (the module's ``forward`` is wrapped in place, no wrapper module is inserted), so
checkpoints load across modes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Registration = tuple[nn.Module, str, torch.Tensor]


def apply_activation_checkpointing(modules: Iterable[nn.Module]) -> None:
    """Make each of ``modules`` recompute its forward in backward instead of keeping what its
    operations save (Chen et al. 2016 §3), in place.

    In forward only the module's tensor arguments are saved; the first time backward needs a
    tensor saved inside, the module's forward runs again (non-reentrant ``torch.utils.checkpoint``,
    RNG state of the forward restored). Hooks registered on the module itself run once, in
    forward, outside the recomputed region; its children's hooks are inside it and run again.

    The recomputation uses the parameter tensors the forward used, even if other code has
    registered different ones in the module since (ZeRO puts its full parameters in for a
    block's forward and its sharded masters back after it; see ``distributed/zero.py``), so
    gradients reach the tensors autograd recorded.

    Apply it after anything that replaces the modules or their children (tensor and sequence
    parallelism) and before anything that hooks onto them (data parallelism, ZeRO). The wrapped
    ``forward`` belongs to the module it was applied to: a ``copy.deepcopy`` of the module
    would still run the original's, so copy first.

    Raises:
        ValueError: a module is already checkpointed (wrapping twice would recompute twice).
    """
    for module in modules:
        if getattr(module.forward, "_loomtrain_checkpointed", False):
            raise ValueError(f"{type(module).__name__} is already activation-checkpointed; apply it once per module")
        module.forward = _checkpointed(module, module.forward)


def _checkpointed(module: nn.Module, forward: Callable) -> Callable:
    def run(registrations: list[Registration], *args, **kwargs):
        with _registered(registrations):
            return forward(*args, **kwargs)

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(run, _registrations(module), *args, use_reentrant=False, **kwargs)

    checkpointed_forward._loomtrain_checkpointed = True
    return checkpointed_forward


def _registrations(module: nn.Module) -> list[Registration]:
    """Every ``(owner, name, tensor)`` parameter registration in ``module`` and its children, now."""
    return [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items() if p is not None]


@contextlib.contextmanager
def _registered(registrations: list[Registration]) -> Iterator[None]:
    """Register ``registrations``' tensors for the duration; put back whatever was there."""
    before = [owner._parameters[name] for owner, name, _ in registrations]
    for owner, name, tensor in registrations:
        owner._parameters[name] = tensor
    try:
        yield
    finally:
        for (owner, name, _), tensor in zip(registrations, before, strict=True):
            owner._parameters[name] = tensor


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward while the context is active: the activation
    memory a forward leaves behind (``torch.autograd.graph.saved_tensors_hooks``; PyTorch's
    "Hooks for saved tensors" notes: every tensor an operation saves passes the pack hook).

    Each saved tensor is counted by its storage, once (views and tensors saved by several
    operations share one), at the storage's full size in bytes. Storages of ``exclude``
    (parameters, buffers: memory that exists without a forward) are not counted. Tensors a
    checkpointed region saves inside itself are not seen, since the region drops them; its
    inputs, which it keeps, are.

    Attributes:
        bytes: bytes of the distinct storages saved so far.
        tensors: number of distinct storages saved so far.

    Use::

        with SavedTensorCounter(model.parameters()) as counter:
            loss = model(x).sum()
        counter.bytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: dict[tuple[torch.device, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._excluded:
            self._seen[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
