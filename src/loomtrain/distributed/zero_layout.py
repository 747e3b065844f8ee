"""ZeRO's shard layout: which rows of each parameter a rank holds, and the flat rank-major
buffers that its collectives move (the runtime that drives them is ``zero.py``).

Every parameter is sharded along dim 0 over the ``n`` ranks of the shard group: rank ``r``
holds rows ``[r·c, (r+1)·c)``, ``c = ceil(dim0 / n)`` (:func:`~loomtrain.distributed.parallel_dims.shard_range`;
trailing ranks may hold fewer or none). Parameters are grouped in *units* (one
``TransformerBlock`` each, plus one unit for the rest) gathered and reduced together through
one flat buffer per unit, rank-major: rank ``r``'s segment holds its rows of every parameter
of the unit, each padded to ``c`` rows, so all-gather and reduce-scatter are single calls.

The master shard is an fp32 ``DTensor`` (``Shard(0)`` over the shard group; ``Replicate()``
over HSDP's replica groups first, when the mesh has two dimensions), so ``state_dict()``,
the optimizer and DCP see sharded master weights and DCP reshards them between world sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loomtrain.distributed.mixed_precision import MixedPrecision
from loomtrain.distributed.parallel_dims import shard_range, shard_rows, sharded_dtensor


@dataclass(frozen=True)
class TensorParallelLayout:
    """Parameters that tensor parallelism has already split, for ZeRO to shard further.

    Attributes:
        mesh: ZeRO's mesh with the tensor-parallel axis last: ``(dp_shard_sp, tp)``, or
            ``(dp_replicate, dp_shard_sp, tp)`` under HSDP (``ParallelDims.zero_tp_mesh``).
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
        replicas = [Replicate()] * (self.mesh.ndim - 2)
        if name not in self.shards:
            return [*replicas, Shard(0), Replicate()], local_shape
        dim, full = self.shards[name]
        over_dp = _StridedShard(0, split_factor=self.mesh.size(-1)) if dim == 0 else Shard(0)
        return [*replicas, over_dp, Shard(dim)], full

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.mesh.ndim - 1)


@dataclass
class Slot:
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

    def register(self, tensor: nn.Parameter) -> None:
        """Put ``tensor`` in the module(s) in place of this parameter."""
        for mod, attr in self.owners:
            mod._parameters[attr] = tensor


@dataclass
class Unit:
    """Parameters gathered and reduced together (``shard_numel`` = one rank's segment)."""

    index: int
    slots: list[Slot]
    shard_numel: int
    padded: bool  # some parameter's dim 0 does not divide by N: its padding rows must read zero
    produced: int = 0
    ready: bool = False
    pending: tuple | None = None  # (work, send, recv) of an all-gather in flight
    gathered: bool = False
    reduced: tuple | None = None  # (handle, out, flat) of the gradient reduction (handle None once waited)
    grad: torch.Tensor | None = None  # this rank's part of the reduced gradient, in reduce_dtype
    flat: torch.Tensor | None = None  # stage 1: the pooled buffer ``grad`` may view, until zero_grad


class BufferPool:
    """Reusable 1-D buffers for ZeRO's collectives (gather inputs and outputs, gradient
    buffers), by dtype and device: :meth:`take` a buffer, :meth:`give` it back once its
    collective is done.

    Why: on CPU a fresh tensor of many megabytes is fresh memory from the kernel, and the
    first write to each page faults. Allocating every unit's buffers every step made our
    ZeRO-1 step 1.27x the step of torch's ``ZeroRedundancyOptimizer`` (``docs/performance.md``);
    a copy into a fresh 25 MB buffer took 9.7 ms against 1.4 ms into a reused one. CUDA's
    caching allocator already reuses memory; this pool does so on every device.

    The pool holds no more buffers than were in use at once (:attr:`nbytes` counts them).
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}
        self.nbytes = 0

    @torch.no_grad()
    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined) on a pooled buffer's memory."""
        free = self._free.setdefault((dtype, device), [])
        fits = [i for i, buf in enumerate(free) if buf.numel() >= numel]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            if free:  # none fits: replace the largest free buffer, so the pool does not grow
                self.nbytes -= free.pop(max(range(len(free)), key=lambda i: free[i].numel())).nbytes
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.nbytes += buf.nbytes
        # set_ rather than a slice: a slice is an autograd view of the pooled buffer, and one
        # buffer lent in grad mode (a forward hook's gather) and then in no-grad mode (a
        # backward reduction) failed autograd's check on in-place writes through views.
        lent = torch.empty(0, dtype=dtype, device=device).set_(buf.untyped_storage(), 0, (numel,))
        self._lent[lent.data_ptr()] = buf
        return lent

    def give(self, lent: torch.Tensor) -> None:
        """Return a tensor from :meth:`take` (no longer in use by any collective)."""
        buf = self._lent.pop(lent.data_ptr())
        self._free.setdefault((buf.dtype, buf.device), []).append(buf)


class ShardLayout:
    """Builds the units of a module over ``mesh`` (1-D shard group, or 2-D ``(replicate,
    shard)`` for HSDP) and moves data between full tensors and the flat rank-major buffers.

    ``stage == 3`` frees the full tensors after building (they are gathered on demand);
    stages 1–2 with fp32 compute keep the master as a view of the full parameter.
    """

    def __init__(self, mesh: DeviceMesh, stage: int, mp: MixedPrecision, tp: TensorParallelLayout | None):
        self.mesh, self.stage, self.mp, self.tp = mesh, stage, mp, tp
        self.shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]
        self.n, self.rank = self.shard_mesh.size(), self.shard_mesh.get_local_rank()

    def build_units(self, module: nn.Module, blocks: Sequence[nn.Module]) -> list[Unit]:
        """One unit per block, then one for the parameters in no block; each parameter is
        replaced in ``module`` by its master shard."""
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

    def _build_unit(self, index: int, params: list[nn.Parameter], owners: dict, names: dict) -> Unit:
        slots, offset = [], 0
        for p in params:
            if p.dim() == 0:
                raise ValueError(f"ZeRO shards along dim 0; parameter {names[id(p)]} is a scalar")
            slot = self._make_slot(p, names[id(p)], owners[id(p)], offset)
            slots.append(slot)
            offset += slot.chunk_numel
        padded = any(s.rows * self.n != s.shape[0] for s in slots)
        return Unit(index, slots, offset, padded)

    @torch.no_grad()
    def _make_slot(self, p: nn.Parameter, name: str, owners: list, offset: int) -> Slot:
        start, end = shard_range(p.shape[0], self.n, self.rank)
        keep_full = self.stage < 3 and p.dtype == self.mp.param_dtype == torch.float32
        if keep_full:
            # fp32 stages 1-2: the master shard is a view of the full parameter, held once.
            full, local = p, p.data[start:end]
        else:
            full = nn.Parameter(torch.empty(p.shape, dtype=self.mp.param_dtype, device=p.device))
            local = p.detach()[start:end].to(torch.float32).clone()
            # Gradient hooks act on what backward computes, now the full tensor's gradient (a
            # norm weight's sum over tp under sequence or 2D parallelism would be lost).
            for hook in (p._backward_hooks or {}).values():
                full.register_hook(hook)
        master = nn.Parameter(self.as_master(local, name, p.shape))
        pieces = [(r, *shard_range(p.shape[0], self.n, r)) for r in range(self.n)]
        rows = shard_rows(p.shape[0], self.n)
        slot = Slot(name, owners, p.shape, rows, offset, full, master, [x for x in pieces if x[2] > x[1]])
        if self.stage == 3:
            full.untyped_storage().resize_(0)
        slot.register(master)
        return slot

    def as_master(self, local: torch.Tensor, name: str, shape: torch.Size) -> DTensor:
        """``local`` (this rank's rows of parameter ``name``, shaped ``shape`` on this rank) as
        a DTensor of the full parameter; ``shape`` is tensor-parallel-local under ``tp``."""
        mesh, placements = self.mesh, [Replicate()] * (self.mesh.ndim - 1) + [Shard(0)]
        if self.tp is not None:
            mesh = self.tp.mesh
            placements, shape = self.tp.placement(name, shape)
        return sharded_dtensor(local, mesh, placements, shape)

    def pack_masters(self, unit: Unit, send: torch.Tensor) -> None:
        """Copy this rank's master rows of every parameter of ``unit`` into its segment ``send``
        (padding rows are left as they are: gathered, then dropped)."""
        for slot in unit.slots:
            local = slot.master.to_local()
            send[slot.offset : slot.offset + local.numel()].copy_(local.reshape(-1))

    def unpack_gathered(self, unit: Unit, recv: torch.Tensor) -> None:
        """Fill every full tensor of ``unit`` from the all-gathered buffer ``recv``
        (``n × shard_numel``), reallocating freed storage first."""
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

    def pack_gradients(self, unit: Unit, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[str]]:
        """Copy every full gradient of ``unit`` into the rank-major ``flat`` buffer (``n ×
        shard_numel``; a missing gradient reads as zeros) and drop the full gradients.

        Returns:
            Each parameter's full (padded) gradient as a ``[n, rows, row_numel]`` view of
            ``flat``, for per-matrix hooks; the names of parameters that had no gradient.
        """
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
        matrices = [segments[:, s.offset : s.offset + s.chunk_numel].unflatten(1, (s.rows, s.row_numel))
                    for s in unit.slots]  # fmt: skip
        return matrices, missing

    def master_grad(self, slot: Slot, shard: torch.Tensor) -> DTensor:
        """``slot``'s fp32 gradient shard (a DTensor placed like its master) from the unit's
        reduced shard ``shard`` (a view if that is fp32, else a copy)."""
        local = slot.master.to_local()
        grad = shard[slot.offset : slot.offset + local.numel()].view(local.shape)
        return self.as_master(grad.to(torch.float32), slot.name, slot.shape)

    def full_rows(self, slot: Slot) -> torch.Tensor:
        """All rows of ``slot``'s parameter (its tensor-parallel shard under tp), gathered over
        the shard group (a collective)."""
        return sharded_dtensor(slot.master.to_local(), self.shard_mesh, [Shard(0)], slot.shape).full_tensor()
