"""The runtime of a parallelized model: what the training loop drives, for any model class.

``parallelize_*`` (``models/parallelize.py``) builds a :class:`ParallelModel` from a model and
the layout; from then on the trainer calls only this: forward and backward of a step's
micro-batches (plainly, or through the pipeline schedule), the loss (slicing the sequence for
``sp``, vocab-parallel cross-entropy for ``tp``), evaluation, DTensor views of the
tensor-parallel shards for checkpoints, and a full model for sampling.

The model is called as ``model(tokens, start_pos=...)`` (``tokens``: ``LongTensor[B, S]``,
logits ``[B, S, V]`` or ``[B, S, V/tp]``); a pipelined one as ``model(x, start_pos, layers=keys)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from loomtrain.distributed.parallel_dims import Axis, ParallelDims, sharded_dtensor
from loomtrain.distributed.pipeline.executor import PipelineExecutor
from loomtrain.distributed.sync import GradientSync
from loomtrain.distributed.tensor_parallel import vocab_parallel_cross_entropy
from loomtrain.distributed.tensor_parallel_2d import BATCH_DIM, Grid2D, GridShard, cross_entropy_2d, grid_dtensor
from loomtrain.distributed.traffic import Traffic

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ParallelModel:
    """A parallelized model and what the training loop needs to drive it.

    Attributes:
        model: the module, changed in place (its parameters are this rank's shards).
        sync: the gradient synchronizer (plain data parallel or ZeRO) over ``dims.grad_mesh``.
        dims: the layout.
        tp_shards: ``{parameter name: (dim split over tp, full shape)}`` for tensor-parallel shards.
        traffic: bytes sent per mesh axis (``dp`` by the sync's hook; ``tp``, ``sp``, ``pp``).
        build_plain: makes an unsharded model of the same architecture (for :meth:`full_model`).
        pipeline: the schedule executor when ``pp > 1``, else ``None``.
    """

    model: nn.Module
    sync: GradientSync
    dims: ParallelDims
    tp_shards: dict[str, tuple[int, torch.Size]]
    traffic: Traffic
    build_plain: Callable[[], nn.Module]
    pipeline: PipelineExecutor | None = None

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of this rank's tokens of a micro-batch (not
        pipelined: the whole model is on this rank).

        ``x``, ``y``: ``LongTensor[micro_batch, seq_len]``, the whole sequences of this ``dp``
        rank; each ``sp`` rank takes its slice of positions. With ``tp > 1`` the logits are
        vocabulary shards and the loss is the vocab-parallel cross-entropy.
        """
        cut = self.dims.sequence_slice(x.shape[1])
        return self.logits_loss(self.model(x[:, cut], start_pos=cut.start), y[:, cut])

    def logits_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats) of ``logits`` ``[B, S, V or V/tp]`` against ``target`` ``[B, S]``."""
        if self.dims.tp > 1:
            return vocab_parallel_cross_entropy(logits.float(), target, self.dims.group(Axis.TP), self.traffic)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def _pipeline_batches(self, micro_batches: Batches, device) -> tuple[list, int]:
        cut = self.dims.sequence_slice(micro_batches[0][0].shape[1])
        return [(x[:, cut].to(device), y[:, cut].to(device)) for x, y in micro_batches], cut.start

    def forward_backward(self, micro_batches: Batches, scale: float, autocast: Callable,
                         device: torch.device) -> float:  # fmt: skip
        """Forward and backward of one step's micro-batches (``[(x, y)]``, each
        ``LongTensor[micro_batch, seq_len]``), leaving the gradients of ``mean loss · scale`` to
        be reduced; returns this rank's mean loss (nats). ``autocast()`` gives the compute
        context.

        Not pipelined: every micro-batch but the last runs under ``sync.no_sync()``, so only
        the last backward communicates; micro-batches of unequal size weigh by their samples
        (the loss is the mean over this rank's samples). Pipelined: the schedule runs them, and each stage's
        last backward communicates.
        """
        if self.pipeline is not None:
            batches, start = self._pipeline_batches(micro_batches, device)
            return self.pipeline.train_step(batches, self.logits_loss, start, scale, self.sync, autocast)
        total, count = 0.0, len(micro_batches)
        samples = sum(x.shape[0] for x, _ in micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            # A load balancer's micro-batches may differ in size by one: each weighs by its
            # samples, so the gradient is the mean over this rank's samples (weight 1.0, exactly,
            # when the sizes are equal).
            weight = x.shape[0] * count / samples
            with self.sync.no_sync() if i < count - 1 else contextlib.nullcontext():
                with autocast():
                    loss = self.loss(x.to(device), y.to(device))
                (loss * scale * weight / count).backward()
            total += loss.item() * weight
        return total / count

    @torch.no_grad()
    def eval_loss(self, batches: Batches, autocast: Callable, device: torch.device) -> float:
        """Mean loss (nats) of ``batches`` (as for :meth:`forward_backward`), forwards only."""
        if self.pipeline is not None:
            batches, start = self._pipeline_batches(batches, device)
            return self.pipeline.eval_step(batches, self.logits_loss, start, autocast)
        total = 0.0
        for x, y in batches:
            with autocast():
                total += self.loss(x.to(device), y.to(device)).item()
        return total / len(batches)

    def _shard_names(self) -> Collection[str]:
        """Names of the parameters split over tensor parallelism."""
        return self.tp_shards

    def _as_dtensor(self, name: str, local: torch.Tensor) -> DTensor:
        dim, shape = self.tp_shards[name]
        return sharded_dtensor(local, self.dims.mesh[Axis.TP], [Shard(dim)], shape)

    def _plain_shards(self) -> list[str]:
        """Tensor-parallel shards held as plain tensors (ZeRO's masters are DTensors already,
        placed on dp and tp)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return [name for name in self._shard_names() if name in params and not isinstance(params[name], DTensor)]

    def wrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """In place: the tensor-parallel shards in a model and an optimizer state dict (as
        ``get_state_dict`` returns them, keyed by parameter name) become ``Shard(dim)`` DTensors
        on the ``tp`` axis that share the local storage, so DCP saves and loads the full
        tensors and reshards them to another tensor-parallel degree."""
        for name in self._plain_shards():
            if name in model_sd:
                model_sd[name] = self._as_dtensor(name, model_sd[name])
            if name in optim_sd.get("state", {}):
                # A new dict: get_state_dict may hand out the optimizer's own per-parameter state.
                optim_sd["state"][name] = {
                    key: self._as_dtensor(name, v) if _is_shard(v) else v for key, v in optim_sd["state"][name].items()
                }

    def unwrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Undo :meth:`wrap_state_dicts`: the DTensors it made back to their local shards."""
        for name in self._plain_shards():
            if isinstance(model_sd.get(name), DTensor):
                model_sd[name] = model_sd[name].to_local()
            state = optim_sd.get("state", {}).get(name, {})
            for key, value in state.items():
                if isinstance(value, DTensor):
                    state[key] = value.to_local()

    @torch.no_grad()
    def full_model(self) -> nn.Module:
        """A plain single-process model with the full parameters, on every rank (a collective
        over ``tp`` and ``pp``); the model itself when nothing is split. For sampling after
        training; call ``sync.remove()`` first so ZeRO shards are whole again."""
        if self.dims.tp == 1 and self.dims.sp == 1 and self.dims.pp == 1:
            return self.model
        full = {
            name: self._as_dtensor(name, p.detach()).full_tensor() if name in self._shard_names() else p.detach()
            for name, p in self.model.named_parameters(remove_duplicate=False)
        }
        device = next(self.model.parameters()).device
        if self.dims.pp > 1:
            # Each pipeline rank holds other layers: every rank gets all of them (small models only).
            parts: list[dict] = [{} for _ in range(self.dims.pp)]
            dist.all_gather_object(parts, {k: v.cpu() for k, v in full.items()}, group=self.dims.group(Axis.PP))
            full = {k: v.to(device) for part in parts for k, v in part.items()}
        plain = self.build_plain().to(device)
        plain.load_state_dict(full)
        return plain


@dataclass
class GridParallelModel(ParallelModel):
    """A :class:`ParallelModel` under 2D tensor parallelism (``parallel.tp_mode="2d"``): the
    logits are blocks ``[B/q, S, V_pad/q]`` (this grid row's sequences, this grid column's
    vocabulary) and the loss is :func:`cross_entropy_2d` over them; checkpoints and
    :meth:`full_model` see every 2D shard as a DTensor of the unpadded full tensor on the grid
    axes (:func:`grid_dtensor`), so they reshard to 1D or no tensor parallelism.

    Attributes (besides the base class's; ``tp_shards`` is empty):
        grid: this rank's place on the ``q × q`` grid.
        grid_shards: ``{parameter name: (placements on (tp_row, tp_col), full shape)}``.
        vocab_size: the real vocabulary (the padding columns are never predicted).
    """

    grid: Grid2D | None = None
    grid_shards: dict[str, GridShard] = field(default_factory=dict)
    vocab_size: int = 0

    def logits_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats) of the whole micro-batch: ``logits`` ``[B/q, S, V_pad/q]``,
        ``target`` ``[B, S]`` (every rank the whole micro-batch; this grid row's part is used)."""
        mine = self.grid.block(target, row_dim=BATCH_DIM, col_dim=None)
        return cross_entropy_2d(logits.float(), mine, self.vocab_size, self.grid, self.traffic)

    def _shard_names(self) -> Collection[str]:
        return self.grid_shards

    def _as_dtensor(self, name: str, local: torch.Tensor) -> DTensor:
        placements, shape = self.grid_shards[name]
        return grid_dtensor(local, self.dims.grid_mesh, placements, shape)

    def wrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """As :meth:`ParallelModel.wrap_state_dicts`, onto the grid. Under ZeRO a 2D block's
        master (and its optimizer moments) is a DTensor of the block over the dp ranks, which
        knows nothing of the grid or the vocabulary padding: each is gathered into its block (an
        all-gather over ZeRO's shard group; one block at a time, in name order on every rank)
        and the block becomes the grid DTensor. :meth:`unwrap_state_dicts` copies this rank's
        rows of the (loaded) blocks back into the masters."""
        state = optim_sd.get("state", {})
        # ZeRO's masters: the parameters that are DTensors already (the plain ones are the base
        # class's, wrapped after these so that none is gathered twice).
        for name in sorted(set(self.grid_shards) - set(self._plain_shards())):
            if isinstance(model_sd.get(name), DTensor):
                model_sd[name] = self._gather_block(name, model_sd[name])
            if name in state:
                state[name] = {k: self._gather_block(name, v) if isinstance(v, DTensor) else v
                               for k, v in state[name].items()}  # fmt: skip
        super().wrap_state_dicts(model_sd, optim_sd)

    def _gather_block(self, name: str, master: DTensor) -> DTensor:
        block = master.full_tensor()
        wrapped = self._as_dtensor(name, block)
        # On the wrapped tensor, not in this object: a saved state dict is dropped after the
        # save, and its gathered blocks with it.
        wrapped.zero_master = (master, block)
        return wrapped

    def unwrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Undo :meth:`wrap_state_dicts`; a gathered block's rows go back into its master."""
        super().unwrap_state_dicts(model_sd, optim_sd)
        for values in (model_sd, *optim_sd.get("state", {}).values()):
            for key, value in values.items():
                if hasattr(value, "zero_master"):
                    values[key] = _scatter_rows(*value.zero_master)


@torch.no_grad()
def _scatter_rows(master: DTensor, block: torch.Tensor) -> DTensor:
    """``master`` with its local rows replaced by its rows of the whole ``block`` (placed like
    it; a local slice, no communication)."""
    mesh = master.device_mesh
    whole = DTensor.from_local(block, mesh, [Replicate()] * mesh.ndim, run_check=False)
    master.to_local().copy_(whole.redistribute(mesh, master.placements).to_local())
    return master


def _is_shard(value) -> bool:
    # Moments are shaped like the shard; the step count is a scalar, the same on every rank.
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0
