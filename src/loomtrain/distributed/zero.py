"""ZeRO stages 1, 2 and 3: model state sharded over the data-parallel ranks; the runtime
that gathers parameters and reduces gradients (the shard layout is ``zero_layout.py``).

Source: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC 2020), §5 (P_os, P_os+g, P_os+g+p) and §7 (communication). HSDP (Zhao et al.,
"PyTorch FSDP", VLDB 2023, §3.2.2): with a 2-D mesh ``(dp_replicate, dp_shard)`` the state
is sharded within each replica group and replicated across groups; the reduced gradient
shard is then averaged over the groups.

For compute, each *unit* (one ``TransformerBlock``, plus one unit for the remaining
parameters) gets full tensors in ``param_dtype``, swapped into the module around its forward:

- stage 1: full parameters persist; gradients are all-reduced (full gradients held), each
  rank keeps its rows for the optimizer.
- stage 2: as stage 1, but gradients are reduce-scattered: a rank keeps only its shard.
- stage 3: full parameters exist only while needed: gathered before a unit's forward and
  again before its backward, freed after each; the next unit's all-gather is launched
  asynchronously so it overlaps the current unit's compute.

In stages 1 and 2 the updated shards are all-gathered during the first forward after an
optimizer step (:meth:`ZeroSynchronizer.after_step`) or a checkpoint load, unit by unit as
stage 3 gathers. Collective buffers come from a
:class:`~loomtrain.distributed.zero_layout.BufferPool`; stages 2-3 keep at most two gradient
reduce-scatters in flight (FSDP's limit too), so the pool holds two units' gradients. Gradient
reduction runs unit by unit during backward, through the
:class:`~loomtrain.distributed.data_parallel.CommHook` seam, launched in a fixed unit order so
all ranks issue collectives in the same sequence.

The reduced gradient is held in ``reduce_dtype`` (stage 1: the whole all-reduced buffer,
stages 2-3: this rank's shard). With ``reduce_dtype`` fp32 each master's ``.grad`` is a view
of it; otherwise (bf16, fp16: the paper's mixed-precision setting, §3.1) the fp32 ``.grad``
the optimizer needs is a copy made by :meth:`ZeroSynchronizer.prepare_step` and dropped by
``zero_grad``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loomtrain.distributed.clip import NormLayout
from loomtrain.distributed.data_parallel import AllReduceHook, CommHook, GradBucket, broadcast_module
from loomtrain.distributed.local_step import LocalShardStep
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.sync import GradientSync, model_state_bytes
from loomtrain.distributed.zero_layout import BufferPool, ShardLayout, TensorParallelLayout, Unit

log = logging.getLogger(__name__)

# Optimizers whose update of an element reads only that element's parameter, gradient and
# state: stepping a rank's rows alone gives the same result (see LocalShardStep).
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class ZeroSynchronizer(GradientSync):
    """Shards a module's state over ``mesh`` and drives gathering and gradient reduction,
    through the protocol of :class:`~loomtrain.distributed.sync.GradientSync`. Built by
    :func:`apply_zero`.

    :meth:`state_bytes` is the largest persistent model state seen at a step's end (see
    :meth:`zero_grad`): masters, full copies, reduced gradients and optimizer state.

    ``tp`` places the masters of tensor-parallel shards (1D) on ``(dp, tp)``; ``norm`` says
    where the rest of the gradient lives (tensor-parallel shards or 2D blocks, pipeline
    stages) for clipping and overflow checks.
    """

    def __init__(self, module: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh, stage: int,
                 mp: MixedPrecision, hook: CommHook, scaler: DynamicLossScaler | None,
                 tp: TensorParallelLayout | None = None, norm: NormLayout | None = None):  # fmt: skip
        self.layout = ShardLayout(mesh, stage, mp, tp)
        self.shard_group = self.layout.shard_mesh.get_group()
        # HSDP: the replica groups (mesh dim 0) average the reduced shards; the whole data-parallel
        # group (replicas × shards) is what the broadcast, the rank weights and stage 1's all-reduce span.
        group = self.shard_group if mesh.ndim == 1 else mesh._flatten().get_group()
        super().__init__(hook, group, next(module.parameters()).device, scaler)
        broadcast_module(module, group)  # before the masters are cut from the parameters
        self.replica_group = None if mesh.ndim == 1 or mesh.size(0) == 1 else mesh.get_group(0)
        self.stage, self.mp, self.norm = stage, mp, norm or NormLayout()
        self.n, self.rank = self.layout.n, self.layout.rank
        self.units = self.layout.build_units(module, blocks)
        self.buffers = BufferPool()
        self._state_bytes = {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}
        self._stale = stage < 3  # stages 1-2: full copies are refreshed at the next forward
        self._next_launch = 0
        self._warned_unused = False
        self._handles = self._install_hooks(module, blocks)

    def _install_hooks(self, module: nn.Module, blocks: Sequence[nn.Module]) -> list:
        handles = [
            module.register_forward_pre_hook(self._root_pre_forward),
            module.register_forward_hook(lambda m, a, out: self._post_forward(self.units[-1], out)),
            module.register_load_state_dict_post_hook(lambda m, keys: self.after_step()),
        ]
        for unit, block in zip(self.units, blocks, strict=False):
            handles.append(block.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u)))
            handles.append(block.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out)))
        for unit in self.units:
            for slot in unit.slots:
                handles.append(slot.full.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad(u)))
        return handles

    def after_step(self) -> None:
        """The masters changed (an optimizer step, or a checkpoint load): stages 1-2 refresh
        their full copies at the next forward (stage 3 gathers before every use anyway)."""
        self._stale = self.stage < 3

    # ----- gathering ---------------------------------------------------------------------

    def _start_gather(self, unit: Unit) -> None:
        if unit.pending is not None or unit.gathered:
            return
        dtype, device = self.mp.param_dtype, unit.slots[0].master.device
        send = self.buffers.take(unit.shard_numel, dtype, device)
        self.layout.pack_masters(unit, send)
        recv = self.buffers.take(self.n * unit.shard_numel, dtype, device)
        # A list of narrow() views, not all_gather_into_tensor: gloo splits that output into
        # multi-output views, which autograd refuses to let its worker thread write into.
        parts = [recv.narrow(0, r * unit.shard_numel, unit.shard_numel) for r in range(self.n)]
        unit.pending = (dist.all_gather(parts, send, group=self.shard_group, async_op=True), send, recv)

    @torch.no_grad()
    def _ensure_gathered(self, unit: Unit) -> None:
        if unit.pending is None and unit.gathered:
            return
        self._start_gather(unit)
        work, _, recv = unit.pending
        start = time.perf_counter()
        work.wait()
        self.blocked_s += time.perf_counter() - start
        self.layout.unpack_gathered(unit, recv)
        self._release_gather(unit)
        unit.gathered = True

    def _release_gather(self, unit: Unit) -> None:
        """The gather of ``unit`` is done and unpacked (or dropped): pool its buffers."""
        _, send, recv = unit.pending
        self.buffers.give(send)
        self.buffers.give(recv)
        unit.pending = None

    def _free(self, unit: Unit) -> None:
        if self.stage == 3 and unit.gathered:
            for slot in unit.slots:
                slot.full.untyped_storage().resize_(0)
            unit.gathered = False

    # ----- forward and backward hooks ---------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self._stale:
            # Stages 1-2 refresh like stage 3 gathers: each unit just before its forward, the
            # next one prefetched (two gathers' buffers at a time, not every unit's).
            for unit in self.units:
                unit.gathered = False
            self._stale = False
        self._pre_forward(self.units[-1])

    def _pre_forward(self, unit: Unit) -> None:
        self._ensure_gathered(unit)
        nxt = 0 if unit is self.units[-1] else unit.index + 1
        if nxt < len(self.units) - 1:
            self._start_gather(self.units[nxt])
        if torch.is_grad_enabled():
            unit.produced = 0
        for slot in unit.slots:
            slot.register(slot.full)

    def _post_forward(self, unit: Unit, out) -> None:
        for slot in unit.slots:
            slot.register(slot.master)
        self._free(unit)
        if isinstance(out, torch.Tensor) and out.requires_grad and self.stage == 3:
            out.register_hook(lambda g, u=unit: self._pre_backward(u))

    def _pre_backward(self, unit: Unit) -> None:
        self._ensure_gathered(unit)
        # Backward visits the root's output head first, then blocks last to first.
        prev = len(self.units) - 2 if unit is self.units[-1] else unit.index - 1
        if prev >= 0:
            self._start_gather(self.units[prev])

    def _on_grad(self, unit: Unit) -> None:
        self.overlap.poll()
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

    def _reduce_order(self) -> list[Unit]:
        # The order in which backward completes units: blocks last to first, then the root.
        return [*reversed(self.units[:-1]), self.units[-1]]

    def _launch_ready(self) -> None:
        order = self._reduce_order()
        while self._next_launch < len(order) and order[self._next_launch].ready:
            self._launch(order[self._next_launch])

    @torch.no_grad()
    def _launch(self, unit: Unit) -> None:
        if self.stage > 1:
            self._retire_reductions(keep=1)
        flat = self.buffers.take(self.n * unit.shard_numel, self.mp.reduce_dtype, unit.slots[0].master.device)
        matrices, missing = self.layout.pack_gradients(unit, flat)
        if missing and not self._warned_unused:
            self._warned_unused = True
            log.warning("parameters without a gradient this step (reduced as zeros): %s", ", ".join(missing))
        bucket = GradBucket(unit.index, flat, [], [], [], matrices=matrices)
        start = time.perf_counter()
        if self.stage == 1:
            unit.reduced = (self.hook.reduce(bucket, self.group), None, flat)
        else:
            out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
            unit.reduced = (self.hook.reduce_scatter(flat, out, self.shard_group, bucket), out, flat)
        self.overlap.launched(unit.reduced[0], start)
        self._next_launch += 1

    def _retire_reductions(self, keep: int) -> None:
        """Stages 2-3: wait for all but the ``keep`` latest reduce-scatters in flight and pool
        their full-size buffers, so backward holds at most ``keep + 1`` of them (as FSDP
        does), not a full model's gradients."""
        order = self._reduce_order()[: self._next_launch]
        in_flight = [u for u in order if u.reduced is not None and u.reduced[0] is not None]
        for unit in in_flight[: max(0, len(in_flight) - keep)]:
            handle, out, flat = unit.reduced
            handle.wait()
            self.buffers.give(flat)
            unit.reduced = (None, out, None)

    def finish_gradient_sync(self) -> None:
        """Launch units still waiting for parameters that got no gradient (reduced as zeros,
        named once in a warning) and wait for every reduction (under HSDP, then average the
        shard over the replica groups). Each master's ``.grad`` is then this rank's fp32 shard
        of the rank-averaged gradient (a DTensor placed like the master): right away with fp32
        ``reduce_dtype``, otherwise from :meth:`prepare_step` on, until :meth:`zero_grad`."""
        self.overlap.compute_ended()
        order = self._reduce_order()
        while self._next_launch < len(order):
            self._launch(order[self._next_launch])
        for unit in order:
            unit.grad = self._wait_reduced(unit)
            unit.reduced = None
            unit.ready = False
            self._free(unit)
        self._next_launch = 0
        self._drop_prefetches()
        self.hook.on_step_end()
        if self.mp.reduce_dtype == torch.float32:
            self._set_master_grads()  # views of the reduced shards, no copy: nothing to defer
        self.overlap.synced()

    def _wait_reduced(self, unit: Unit) -> torch.Tensor:
        """This rank's part of ``unit``'s averaged gradient, once its reduction is done."""
        handle, out, flat = unit.reduced
        value = None if handle is None else handle.wait()
        if out is None:  # stage 1: the all-reduce future's value is the whole flat buffer
            value = value[0] if isinstance(value, list) else value
            unit.flat = flat  # the reduced gradient may be a view of it: pooled at zero_grad
            return value.view(self.n, unit.shard_numel)[self.rank]
        if flat is not None:
            self.buffers.give(flat)
        if self.replica_group is not None:
            self.hook.average_replicas(out, self.replica_group)
        return out

    def _drop_prefetches(self) -> None:
        """Wait out gathers prefetched but not used this step (a pipeline's last backward may
        prefetch a block of another stage): the optimizer step makes their data stale."""
        for unit in self.units:
            if unit.pending is not None:
                unit.pending[0].wait()
                self._release_gather(unit)

    def _set_master_grads(self) -> None:
        """Give each master without one an fp32 ``.grad`` from its unit's reduced shard (a view
        if that is fp32, else a copy: the transient fp32 gradient of mixed-precision ZeRO)."""
        for unit in self.units:
            if unit.grad is None:
                continue
            for slot in unit.slots:
                if slot.master.grad is None:
                    slot.master.grad = self.layout.master_grad(slot, unit.grad)

    # ----- optimizer step ----------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps the masters (its state is counted in :meth:`state_bytes`).
        SGD, Adam and AdamW step the masters' local shards (:class:`LocalShardStep`: the same
        arithmetic without DTensor dispatch); other optimizers step the DTensors."""
        super().attach_optimizer(optimizer)
        if type(optimizer) in ELEMENTWISE_OPTIMIZERS and not getattr(optimizer, "_loomtrain_local_step", False):
            LocalShardStep(optimizer)
            optimizer._loomtrain_local_step = True

    @torch.no_grad()
    def prepare_step(self, max_norm: float) -> bool:
        """Prepare the sharded gradients for the optimizer step.

        With fp16 loss scaling, divide by the scale and return ``False`` (skip the step;
        the scale has been lowered) if any rank found inf or nan. Then, if ``max_norm > 0``,
        clip by the global L2 norm: the squares of every rank's shards are summed with one
        all-reduce over the shard group (and those of tensor-parallel shards with one more over
        tp; parameters replicated over tp count once), and all gradients are multiplied by
        ``min(1, max_norm / (norm + 1e-6))`` (the rule of ``torch.nn.utils.clip_grad_norm_``).
        Works on the masters' fp32 ``.grad``.
        """
        self._set_master_grads()
        named = [(s.name, s.master.grad.to_local()) for u in self.units for s in u.slots if s.master.grad is not None]
        # The other pieces of the gradient: other rows (shard group), other tensor-parallel
        # parts and other layers. Replicas hold copies.
        groups = [self.shard_group, *self.norm.model_groups()]
        if self.scaler is not None and not self.scaler.unscale_and_check([g for _, g in named], *groups):
            return False
        if max_norm > 0:
            self.norm.clip(named, max_norm, reduce_group=self.shard_group)
        return True

    def zero_grad(self) -> None:
        """Record the persistent model-state bytes, then drop the gradients.

        Counted (distinct storages, after the optimizer step): masters and full copies,
        gradients as held between reduction and step (the reduced gradients in
        ``reduce_dtype`` and any full ``.grad``), optimizer state. Not counted, as in the
        paper's and DeepSpeed's accounting: the masters' fp32 ``.grad`` when it is a copy
        (``reduce_dtype`` not fp32), 4 bytes per local master element alive only from
        :meth:`prepare_step` to here.
        """
        if self.optimizer is not None:
            full = self.full_params()
            grads = [u.grad for u in self.units] + [p.grad for p in full]
            measured = model_state_bytes(self.masters() + full, grads, self.optimizer)
            self._state_bytes = {k: max(v, self._state_bytes[k]) for k, v in measured.items()}
        for unit in self.units:
            unit.grad = None
            if unit.flat is not None:
                self.buffers.give(unit.flat)
                unit.flat = None
            for slot in unit.slots:
                slot.master.grad = None
                slot.full.grad = None

    def state_bytes(self) -> dict[str, int]:
        """The largest persistent model state seen at a step's end (see :meth:`zero_grad`)."""
        return dict(self._state_bytes)

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
                slot.register(nn.Parameter(self.layout.full_rows(slot)))


def apply_zero(
    module: nn.Module,
    mesh: DeviceMesh,
    stage: int,
    blocks: Sequence[nn.Module],
    mp: MixedPrecision | None = None,
    hook: CommHook | None = None,
    scaler: DynamicLossScaler | None = None,
    tp: TensorParallelLayout | None = None,
    **norm_layout,
) -> ZeroSynchronizer:
    """Shard ``module``'s parameters over ``mesh``, in place (ZeRO ``stage``): a 1-D mesh of the
    ranks to shard over, or a 2-D ``(replicate, shard)`` mesh for HSDP (``ParallelDims.zero_mesh``).

    Broadcasts rank 0's parameters and buffers over all of ``mesh`` first. ``blocks`` are the
    units gathered one at a time (e.g. the transformer blocks); the other parameters form one
    more unit. Build the optimizer afterwards on ``module.parameters()`` (the masters) and pass
    it to :meth:`ZeroSynchronizer.attach_optimizer`. ``tp``: the 1D tensor-parallel split of
    ``module``'s parameters, if any (``mesh`` is then ZeRO's part of ``tp.mesh``): the masters'
    DTensors record it. ``norm_layout``: the fields of
    :class:`~loomtrain.distributed.clip.NormLayout` (``tp_sharded``, ``tp_group``, ``pp_group``,
    ``replicated_group``): where the rest of the gradient lives, for gradient norms and
    overflow checks.

    A parameter's gradient hooks (``Tensor.register_hook``, e.g. the sum over tp of a norm
    weight under sequence or 2D parallelism) move to the compute tensor that replaces it.

    Raises:
        ValueError: ``stage`` not in 1..3, or a scalar (0-dim) parameter.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"data_parallel.zero_stage={stage}; apply_zero needs 1, 2 or 3 (0 is plain data parallel)")
    blocks = list(blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    if blocks and all(id(p) in in_blocks for p in module.parameters()):
        # A pipeline stage with neither embedding nor head: its last block is the root unit.
        blocks = blocks[:-1]
    return ZeroSynchronizer(module, blocks, mesh, stage, mp or MixedPrecision(), hook or AllReduceHook(), scaler, tp,
                            NormLayout(**norm_layout))  # fmt: skip
