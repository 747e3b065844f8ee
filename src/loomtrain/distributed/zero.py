"""ZeRO stages 1, 2 and 3: model state sharded over the data-parallel ranks.

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC 2020), §5 (P_os, P_os+g, P_os+g+p) and §7 (communication).

Every parameter is sharded along dim 0 over the ``dp`` mesh axis (rank ``r`` holds rows
``[r·c, (r+1)·c)``, ``c = ceil(dim0 / N)``; trailing ranks may hold fewer or none). The shard
is an fp32 ``DTensor`` with placement ``Shard(0)``, registered in the module in place of the
original parameter, so ``state_dict()``, the optimizer and DCP see sharded master weights
and DCP reshards them between world sizes.

For compute, each *unit* (one ``TransformerBlock``, plus one unit for the remaining
parameters) gets full tensors in ``param_dtype``, swapped into the module around its forward:

- stage 1: full parameters persist; gradients are all-reduced (full gradients held), each
  rank keeps its rows for the optimizer.
- stage 2: as stage 1, but gradients are reduce-scattered: a rank keeps only its shard.
- stage 3: full parameters exist only while needed: gathered before a unit's forward and
  again before its backward, freed after each; the next unit's all-gather is launched
  asynchronously so it overlaps the current unit's compute.

In stages 1 and 2 the updated shards are all-gathered at the first forward after an
optimizer step (or a checkpoint load). Gradient reduction runs unit by unit during backward,
through the :class:`~loomtrain.distributed.data_parallel.CommHook` seam, launched in a fixed
unit order so all ranks issue collectives in the same sequence.

Collectives use one flat buffer per unit, rank-major: rank ``r``'s segment holds its rows of
every parameter, each padded to ``c`` rows, so all-gather and reduce-scatter are single calls.

The reduced gradient is held in ``reduce_dtype`` (stage 1: the whole all-reduced buffer,
stages 2-3: this rank's shard). With ``reduce_dtype`` fp32 each master's ``.grad`` is a view
of it; otherwise (bf16, fp16: the paper's mixed-precision setting, §3.1) the fp32 ``.grad``
the optimizer needs is a copy made just before the step and dropped by ``zero_grad``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loomtrain.distributed.data_parallel import (
    AllReduceHook,
    CommHook,
    GradBucket,
    LocalAccumulation,
    broadcast_module,
)
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.parallel_dims import shard_range, sharded_dtensor
from loomtrain.optim import clip_grad_norm_

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelLayout:
    """Parameters that tensor parallelism has already split, for ZeRO to shard further.

    Attributes:
        mesh: 2-D mesh ``(dp_sp, tp)``: ZeRO's ranks (``ParallelDims.grad_mesh``), then the
            tensor-parallel ranks (``ParallelDims.grad_tp_mesh``).
        shards: ``{parameter name: (dim split over tp, full shape)}``; others are replicated over tp.

    A master then covers rows ``[r·c, (r+1)·c)`` of this rank's tensor-parallel shard, which is
    itself a block of the full tensor; the DTensor records both levels (for a shard split along
    dim 0 too, a ``_StridedShard`` over dp: its rows lie inside the tp block), so DCP saves
    the full tensor and reshards it to any dp and tp degrees.
    """

    mesh: DeviceMesh
    shards: dict[str, tuple[int, torch.Size]]

    def placement(self, name: str, local_shape: torch.Size) -> tuple[list, torch.Size]:
        """Placements on :attr:`mesh` and the global shape of parameter ``name``'s master."""
        if name not in self.shards:
            return [Shard(0), Replicate()], local_shape
        dim, full = self.shards[name]
        over_dp = _StridedShard(0, split_factor=self.mesh.size(1)) if dim == 0 else Shard(0)
        return [over_dp, Shard(dim)], full

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(1)


@dataclass
class _Slot:
    """One original parameter: its registrations, full compute tensor and fp32 master shard."""

    name: str
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    rows: int  # rows per rank, c = ceil(dim0 / N)
    offset: int  # element offset of this parameter's chunk inside a rank's segment
    full: nn.Parameter
    master: nn.Parameter
    pieces: list[tuple[int, int, int]]  # (rank, first row, end row) for every rank holding rows

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def chunk_numel(self) -> int:
        return self.rows * self.row_numel


@dataclass
class _Unit:
    """Parameters gathered and reduced together (``shard_numel`` = one rank's segment)."""

    index: int
    slots: list[_Slot]
    shard_numel: int
    padded: bool  # some parameter's dim 0 does not divide by N: its padding rows must read zero
    produced: int = 0
    ready: bool = False
    pending: tuple | None = None  # (work, flat) of an all-gather in flight
    gathered: bool = False
    reduced: tuple | None = None  # (handle, out) of the gradient reduction in flight
    grad: torch.Tensor | None = None  # this rank's part of the reduced gradient, in reduce_dtype


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_bytes(params, grads, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes actually held (distinct storages) by ``params``, ``grads`` (``None``
    entries skipped) and ``optimizer``'s state."""
    optim = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes(grads),
        "optim_bytes": storage_bytes(optim),
    }


class ZeroSynchronizer(LocalAccumulation):
    """Shards a module's state over ``mesh`` and drives gathering and gradient reduction.

    Same driving protocol as :class:`~loomtrain.distributed.data_parallel.GradientSynchronizer`
    (``no_sync()``, ``finish_gradient_sync()``, ``zero_grad()``, ``remove()``, ``.hook``),
    plus :meth:`attach_optimizer`, :meth:`unscale_and_clip_` and :attr:`loss_scale`.
    Built by :func:`apply_zero`.

    :attr:`state_bytes` holds the largest persistent model state seen at a step's end (see
    :meth:`zero_grad`): masters, full copies, reduced gradients and optimizer state.
    """

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh, stage: int,
                 mp: MixedPrecision, hook: CommHook, scaler: DynamicLossScaler | None,
                 tp: TensorParallelLayout | None = None, pp_group: dist.ProcessGroup | None = None):  # fmt: skip
        self.mesh, self.stage, self.mp, self.hook, self.scaler, self.tp = mesh, stage, mp, hook, scaler, tp
        self.pp_group = pp_group
        self.group = mesh.get_group()
        self.n, self.rank = mesh.size(), mesh.get_local_rank()
        self.units = self._build_units(module, blocks)
        self.state_bytes = {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}
        self.optimizer: torch.optim.Optimizer | None = None
        self._stale = stage < 3  # stages 1-2: full copies are refreshed at the next forward
        self._next_launch = 0
        self._warned_unused = False
        self._handles = self._install_hooks(module, blocks)

    # ----- construction -----------------------------------------------------------------

    def _build_units(self, module: nn.Module, blocks: Sequence[nn.Module]) -> list[_Unit]:
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        names: dict[int, str] = {}
        for mod_name, mod in module.named_modules():
            for attr, p in mod.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((mod, attr))
                names.setdefault(id(p), f"{mod_name}.{attr}".lstrip("."))
        in_block = {id(p) for b in blocks for p in b.parameters()}
        rest = [p for p in module.parameters() if id(p) not in in_block]
        groups = [list(b.parameters()) for b in blocks] + [rest]
        return [self._build_unit(i, ps, owners, names) for i, ps in enumerate(groups)]

    def _build_unit(self, index: int, params: list[nn.Parameter], owners: dict, names: dict) -> _Unit:
        slots, offset = [], 0
        for p in params:
            if p.dim() == 0:
                raise ValueError(f"ZeRO shards along dim 0; parameter {names[id(p)]} is a scalar")
            slot = self._make_slot(p, names[id(p)], owners[id(p)], offset)
            slots.append(slot)
            offset += slot.chunk_numel
        padded = any(s.rows * self.n != s.shape[0] for s in slots)
        return _Unit(index, slots, offset, padded)

    @torch.no_grad()
    def _make_slot(self, p: nn.Parameter, name: str, owners: list, offset: int) -> _Slot:
        rows = -(-p.shape[0] // self.n)
        start, end = shard_range(p.shape[0], self.n, self.rank)
        keep_full = self.stage < 3 and p.dtype == self.mp.param_dtype == torch.float32
        if keep_full:
            # fp32 stages 1-2: the master shard is a view of the full parameter, held once.
            full, local = p, p.data[start:end]
        else:
            full = nn.Parameter(torch.empty(p.shape, dtype=self.mp.param_dtype, device=p.device))
            local = p.detach()[start:end].to(torch.float32).clone()
        master = nn.Parameter(self._as_master(local, name, p.shape))
        pieces = [(r, *shard_range(p.shape[0], self.n, r)) for r in range(self.n)]
        slot = _Slot(name, owners, p.shape, rows, offset, full, master, [x for x in pieces if x[2] > x[1]])
        if self.stage == 3:
            full.untyped_storage().resize_(0)
        self._register(slot, master)
        return slot

    def _as_master(self, local: torch.Tensor, name: str, shape: torch.Size) -> DTensor:
        """``local`` (this rank's rows of parameter ``name``, shaped ``shape`` on this rank) as
        a DTensor of the full parameter; ``shape`` is tensor-parallel-local under ``tp``."""
        mesh, placements = self.mesh, [Shard(0)]
        if self.tp is not None:
            mesh = self.tp.mesh
            placements, shape = self.tp.placement(name, shape)
        return sharded_dtensor(local, mesh, placements, shape)

    @staticmethod
    def _register(slot: _Slot, tensor: nn.Parameter) -> None:
        for mod, attr in slot.owners:
            mod._parameters[attr] = tensor

    def _install_hooks(self, module: nn.Module, blocks: Sequence[nn.Module]) -> list:
        handles = [
            module.register_forward_pre_hook(self._root_pre_forward),
            module.register_forward_hook(lambda m, a, out: self._post_forward(self.units[-1], out)),
            module.register_load_state_dict_post_hook(lambda m, keys: self._mark_stale()),
        ]
        for unit, block in zip(self.units, blocks, strict=False):
            handles.append(block.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u)))
            handles.append(block.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out)))
        for unit in self.units:
            for slot in unit.slots:
                handles.append(slot.full.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad(u)))
        return handles

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell the synchronizer which optimizer steps the masters: after each step, stages
        1-2 refresh their full copies; :meth:`zero_grad` measures the optimizer state."""
        self.optimizer = optimizer
        self._handles.append(optimizer.register_step_pre_hook(lambda *a: self._set_master_grads()))
        self._handles.append(optimizer.register_step_post_hook(lambda *a: self._mark_stale()))

    def _mark_stale(self) -> None:
        self._stale = self.stage < 3

    # ----- gathering ---------------------------------------------------------------------

    def _start_gather(self, unit: _Unit) -> None:
        if unit.pending is not None or unit.gathered:
            return
        dtype, device = self.mp.param_dtype, unit.slots[0].master.device
        send = torch.empty(unit.shard_numel, dtype=dtype, device=device)  # padding rows are gathered, then dropped
        for slot in unit.slots:
            local = slot.master.to_local()
            send[slot.offset : slot.offset + local.numel()].copy_(local.reshape(-1))
        recv = torch.empty(self.n * unit.shard_numel, dtype=dtype, device=device)
        # A list of narrow() views, not all_gather_into_tensor: gloo splits that output into
        # multi-output views, which autograd refuses to let its worker thread write into.
        parts = [recv.narrow(0, r * unit.shard_numel, unit.shard_numel) for r in range(self.n)]
        unit.pending = (dist.all_gather(parts, send, group=self.group, async_op=True), recv)

    @torch.no_grad()
    def _ensure_gathered(self, unit: _Unit) -> None:
        if unit.pending is None and (unit.gathered or self.stage < 3):
            return
        self._start_gather(unit)
        work, recv = unit.pending
        work.wait()
        segments = recv.view(self.n, unit.shard_numel)
        for slot in unit.slots:
            storage = slot.full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(slot.full.numel() * slot.full.element_size())
            # .data: refilling a freed parameter must not bump the version autograd saved.
            rows = slot.full.data.view(slot.shape[0], -1)
            for r, start, end in slot.pieces:
                piece = segments[r, slot.offset : slot.offset + (end - start) * slot.row_numel]
                rows[start:end].copy_(piece.view(end - start, -1))
        unit.pending, unit.gathered = None, True

    def _free(self, unit: _Unit) -> None:
        if self.stage == 3 and unit.gathered:
            for slot in unit.slots:
                slot.full.untyped_storage().resize_(0)
            unit.gathered = False

    # ----- forward and backward hooks ---------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self._stale:
            # Launch every refresh now; each unit waits for its own just before its forward.
            for unit in (self.units[-1], *self.units[:-1]):
                unit.gathered = False
                self._start_gather(unit)
            self._stale = False
        self._pre_forward(self.units[-1])

    def _pre_forward(self, unit: _Unit) -> None:
        self._ensure_gathered(unit)
        if self.stage == 3:
            nxt = 0 if unit is self.units[-1] else unit.index + 1
            if nxt < len(self.units) - 1:
                self._start_gather(self.units[nxt])
        if torch.is_grad_enabled():
            unit.produced = 0
        for slot in unit.slots:
            self._register(slot, slot.full)

    def _post_forward(self, unit: _Unit, out) -> None:
        for slot in unit.slots:
            self._register(slot, slot.master)
        self._free(unit)
        if isinstance(out, torch.Tensor) and out.requires_grad and self.stage == 3:
            out.register_hook(lambda g, u=unit: self._pre_backward(u))

    def _pre_backward(self, unit: _Unit) -> None:
        self._ensure_gathered(unit)
        # Backward visits the root's output head first, then blocks last to first.
        prev = len(self.units) - 2 if unit is self.units[-1] else unit.index - 1
        if prev >= 0:
            self._start_gather(self.units[prev])

    def _on_grad(self, unit: _Unit) -> None:
        unit.produced += 1
        if unit.produced < len(unit.slots):
            return
        # Counted per backward: a pipeline runs several forwards before their backwards.
        unit.produced = 0
        self._free(unit)
        if self._sync:
            unit.ready = True
            self._launch_ready()

    # ----- gradient reduction -----------------------------------------------------------

    def _reduce_order(self) -> list[_Unit]:
        # The order in which backward completes units: blocks last to first, then the root.
        return [*reversed(self.units[:-1]), self.units[-1]]

    def _launch_ready(self) -> None:
        order = self._reduce_order()
        while self._next_launch < len(order) and order[self._next_launch].ready:
            self._launch(order[self._next_launch])

    @torch.no_grad()
    def _launch(self, unit: _Unit) -> None:
        slot0 = unit.slots[0]
        numel = self.n * unit.shard_numel
        flat = torch.empty(numel, dtype=self.mp.reduce_dtype, device=slot0.master.device)
        if unit.padded:
            flat.zero_()
        segments = flat.view(self.n, unit.shard_numel)
        missing = []
        for slot in unit.slots:
            grad = slot.full.grad
            if grad is None:
                missing.append(slot.name)
                segments[:, slot.offset : slot.offset + slot.chunk_numel].zero_()
                continue
            rows = grad.reshape(slot.shape[0], -1)
            for r, start, end in slot.pieces:  # padding rows stay zero
                piece = segments[r, slot.offset : slot.offset + (end - start) * slot.row_numel]
                piece.view(end - start, -1).copy_(rows[start:end])
            slot.full.grad = None
        if missing and not self._warned_unused:
            self._warned_unused = True
            log.warning("parameters without a gradient this step (reduced as zeros): %s", ", ".join(missing))
        # Each parameter's full (padded) gradient as [n, rows, row_numel], for per-matrix hooks.
        matrices = [segments[:, s.offset : s.offset + s.chunk_numel].unflatten(1, (s.rows, s.row_numel))
                    for s in unit.slots]  # fmt: skip
        bucket = GradBucket(unit.index, flat, [], [], [], matrices=matrices)
        if self.stage == 1:
            unit.reduced = (self.hook.reduce(bucket, self.group), None)
        else:
            out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
            unit.reduced = (self.hook.reduce_scatter(flat, out, self.group, bucket), out)
        self._next_launch += 1

    def finish_gradient_sync(self) -> None:
        """Launch units still waiting for parameters that got no gradient (reduced as zeros,
        named once in a warning) and wait for every reduction. Each master's ``.grad`` is then
        this rank's fp32 shard of the rank-averaged gradient (a ``Shard(0)`` DTensor): right
        away with fp32 ``reduce_dtype``, otherwise from :meth:`unscale_and_clip_` or the
        optimizer step on, until :meth:`zero_grad`."""
        order = self._reduce_order()
        while self._next_launch < len(order):
            self._launch(order[self._next_launch])
        for unit in order:
            handle, out = unit.reduced
            value = handle.wait()
            if out is None:  # stage 1: the all-reduce future's value is the whole flat buffer
                value = value[0] if isinstance(value, list) else value
                out = value.view(self.n, unit.shard_numel)[self.rank]
            unit.grad = out
            unit.reduced = None
            unit.ready = False
            self._free(unit)
        self._next_launch = 0
        self._drop_prefetches()
        self.hook.on_step_end()
        if self.mp.reduce_dtype == torch.float32:
            self._set_master_grads()  # views of the reduced shards, no copy: nothing to defer

    def _drop_prefetches(self) -> None:
        """Wait out gathers prefetched but not used this step (a pipeline's last backward may
        prefetch a block of another stage): the optimizer step makes their data stale."""
        for unit in self.units:
            if unit.pending is not None:
                unit.pending[0].wait()
                unit.pending = None

    def _set_master_grads(self) -> None:
        """Give each master without one an fp32 ``.grad`` from its unit's reduced shard (a view
        if that is fp32, else a copy: the transient fp32 gradient of mixed-precision ZeRO)."""
        for unit in self.units:
            if unit.grad is None:
                continue
            for slot in unit.slots:
                if slot.master.grad is None:
                    slot.master.grad = self._master_grad(slot, unit.grad)

    def _master_grad(self, slot: _Slot, shard: torch.Tensor) -> DTensor:
        local = slot.master.to_local()
        grad = shard[slot.offset : slot.offset + local.numel()].view(local.shape)
        return self._as_master(grad.to(torch.float32), slot.name, slot.shape)

    # ----- optimizer step ----------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """Factor to multiply the loss by before backward (1 unless fp16 loss scaling is on)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _local_grads(self) -> list[torch.Tensor]:
        return [s.master.grad.to_local() for u in self.units for s in u.slots if s.master.grad is not None]

    @torch.no_grad()
    def unscale_and_clip_(self, max_norm: float) -> bool:
        """Prepare the sharded gradients for the optimizer step.

        With fp16 loss scaling, divide by the scale and return ``False`` (skip the step;
        the scale has been lowered) if any rank found inf or nan. Then, if ``max_norm > 0``,
        clip by the global L2 norm: the squares of every rank's shards are summed with one
        all-reduce (and those of tensor-parallel shards with one more over tp; parameters
        replicated over tp count once), and all gradients are multiplied by
        ``min(1, max_norm / (norm + 1e-6))`` (the rule of ``torch.nn.utils.clip_grad_norm_``).
        Works on the masters' fp32 ``.grad``.
        """
        self._set_master_grads()
        grads = self._local_grads()
        groups = [self.group]
        if self.tp is not None:
            groups.append(self.tp.group)
        if self.pp_group is not None:
            groups.append(self.pp_group)
        if self.scaler is not None and not self.scaler.unscale_and_check(grads, *groups):
            return False
        if max_norm > 0:
            sharded, replicated = [], []
            for unit in self.units:
                for slot in unit.slots:
                    if slot.master.grad is not None:
                        tp_split = self.tp is not None and slot.name in self.tp.shards
                        (sharded if tp_split else replicated).append(slot.master.grad.to_local())
            tp_group = self.tp.group if self.tp is not None else None
            clip_grad_norm_(sharded, replicated, max_norm, reduce_group=self.group, tp_group=tp_group,
                            pp_group=self.pp_group)  # fmt: skip
        return True

    def zero_grad(self) -> None:
        """Record the persistent model-state bytes, then drop the gradients.

        Counted (distinct storages, after the optimizer step): masters and full copies,
        gradients as held between reduction and step (the reduced gradients in
        ``reduce_dtype`` and any full ``.grad``), optimizer state. Not counted, as in the
        paper's and DeepSpeed's accounting: the masters' fp32 ``.grad`` when it is a copy
        (``reduce_dtype`` not fp32), 4 bytes per local master element alive only from
        :meth:`unscale_and_clip_` to here.
        """
        if self.optimizer is not None:
            full = self.full_params()
            grads = [u.grad for u in self.units] + [p.grad for p in full]
            measured = model_state_bytes(self.masters() + full, grads, self.optimizer)
            self.state_bytes = {k: max(v, self.state_bytes[k]) for k, v in measured.items()}
        for unit in self.units:
            unit.grad = None
            for slot in unit.slots:
                slot.master.grad = None
                slot.full.grad = None

    def masters(self) -> list[nn.Parameter]:
        """The fp32 ``Shard(0)`` master parameters (what the optimizer steps on)."""
        return [s.master for u in self.units for s in u.slots]

    def full_params(self) -> list[nn.Parameter]:
        """The full compute tensors (storage freed between uses in stage 3)."""
        return [s.full for u in self.units for s in u.slots]

    @torch.no_grad()
    def remove(self) -> None:
        """Detach all hooks and put full fp32 parameters back into the module (a collective:
        every rank must call it), leaving a plain module, e.g. for generation."""
        for h in self._handles:
            h.remove()
        for unit in self.units:
            for slot in unit.slots:
                self._register(slot, nn.Parameter(self._gather_rows(slot)))

    def _gather_rows(self, slot: _Slot) -> torch.Tensor:
        """All of this rank's rows of ``slot``'s parameter (its tensor-parallel shard under tp)."""
        return sharded_dtensor(slot.master.to_local(), self.mesh, [Shard(0)], slot.shape).full_tensor()


def apply_zero(
    module: nn.Module,
    mesh: DeviceMesh,
    stage: int,
    mp: MixedPrecision | None = None,
    hook: CommHook | None = None,
    scaler: DynamicLossScaler | None = None,
    blocks: Sequence[nn.Module] | None = None,
    tp: TensorParallelLayout | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> ZeroSynchronizer:
    """Shard ``module``'s parameters over the 1-D data-parallel ``mesh``, in place (ZeRO ``stage``).

    Broadcasts rank 0's parameters and buffers first. ``blocks`` are the units gathered one
    at a time (default: ``module.layers``, the TransformerBlocks); the other parameters form
    one more unit. Build the optimizer afterwards on ``module.parameters()`` (the masters) and
    pass it to :meth:`ZeroSynchronizer.attach_optimizer`. ``tp``: the tensor-parallel split of
    ``module``'s parameters, if any (``mesh`` is then ZeRO's axis of ``tp.mesh``). ``pp_group``:
    the pipeline ranks, which hold other layers: gradient norms and overflow checks span them.

    Raises:
        ValueError: ``stage`` not in 1..3, or a scalar (0-dim) parameter.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"data_parallel.zero_stage={stage}; apply_zero needs 1, 2 or 3 (0 is plain data parallel)")
    broadcast_module(module, mesh.get_group())
    if blocks is None:
        layers = getattr(module, "layers", None)
        blocks = [] if layers is None else list(layers.values())
    blocks = list(blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    if blocks and all(id(p) in in_blocks for p in module.parameters()):
        # A pipeline stage with neither embedding nor head: its last block is the root unit.
        blocks = blocks[:-1]
    return ZeroSynchronizer(module, blocks, mesh, stage, mp or MixedPrecision(), hook or AllReduceHook(), scaler, tp,
                            pp_group)  # fmt: skip
