"""Apply the parallel plan to a Llama model from outside; the model file knows nothing of it.

Order (each step sees the module the previous one produced):

1. pipeline split on the ``pp`` axis: the model is pruned to this rank's stages (layers, and
   the embedding or head where they belong) before anything else, so no rank splits or
   shards layers it does not hold;
2. tensor parallelism on the ``tp`` axis (Megatron column/row linears, vocab-parallel
   embedding and head), with Megatron sequence parallelism if ``tp_mode="sequence_parallel"``;
3. Ulysses sequence parallelism on the ``sp`` axis (each attention core wrapped in all-to-alls);
4. data parallelism or ZeRO over the ranks that hold the same parameters: ``dp`` and ``sp``
   together (:attr:`ParallelDims.grad_mesh`), whose gradients are averaged.

The returned :class:`ParallelModel` is what the training loop drives: forward and backward
of a step's micro-batches (plainly, or through the pipeline schedule), the loss (slicing the
sequence for ``sp``, vocab-parallel cross-entropy for ``tp``), global gradient-norm clipping
over shards, DTensor views of the tensor-parallel shards for checkpoints, and a full model
for sampling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from loomtrain.config import Config
from loomtrain.distributed.data_parallel import CommHook, GradientSynchronizer, apply_data_parallel
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.parallel_dims import ParallelDims, sharded_dtensor
from loomtrain.distributed.pipeline.executor import PipelineExecutor
from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.pipeline.split import measure_layer_seconds, partition_layers, prune_to_rank
from loomtrain.distributed.sequence_parallel import apply_ulysses
from loomtrain.distributed.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from loomtrain.distributed.traffic import Traffic
from loomtrain.distributed.zero import TensorParallelLayout, ZeroSynchronizer, apply_zero
from loomtrain.models.llama import Transformer
from loomtrain.optim import clip_grad_norm_


@dataclass
class ParallelModel:
    """A parallelized model and what the training loop needs to drive it.

    Attributes:
        model: the module, changed in place (its parameters are this rank's shards).
        sync: the gradient synchronizer (plain data parallel or ZeRO) over ``dims.grad_mesh``.
        dims: the layout.
        tp_shards: ``{parameter name: (dim split over tp, full shape)}`` for tensor-parallel shards.
        traffic: bytes sent by tensor, sequence and pipeline parallelism, per mesh axis.
        pipeline: the schedule executor when ``pp > 1``, else ``None``.
    """

    model: Transformer
    sync: GradientSynchronizer | ZeroSynchronizer
    dims: ParallelDims
    tp_shards: dict[str, tuple[int, torch.Size]]
    traffic: Traffic
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
            return vocab_parallel_cross_entropy(logits.float(), target, self.dims.group("tp"), self.traffic)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def _pipeline_batches(self, micro_batches, device) -> tuple[list, int]:
        cut = self.dims.sequence_slice(micro_batches[0][0].shape[1])
        return [(x[:, cut].to(device), y[:, cut].to(device)) for x, y in micro_batches], cut.start

    def forward_backward(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float,
                         autocast: Callable, device: torch.device) -> float:  # fmt: skip
        """Forward and backward of one step's micro-batches (``[(x, y)]``, each
        ``LongTensor[micro_batch, seq_len]``), leaving the gradients of ``mean loss · scale`` to
        be reduced; returns this rank's mean loss (nats). ``autocast()`` gives the compute
        context.

        Not pipelined: every micro-batch but the last runs under ``sync.no_sync()``, so only
        the last backward communicates. Pipelined: the schedule runs them, and each stage's
        last backward communicates.
        """
        if self.pipeline is not None:
            batches, start = self._pipeline_batches(micro_batches, device)
            return self.pipeline.train_step(batches, self.logits_loss, start, scale, self.sync, autocast)
        total, last = 0.0, len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            with self.sync.no_sync() if i < last else contextlib.nullcontext():
                with autocast():
                    loss = self.loss(x.to(device), y.to(device))
                (loss * scale / len(micro_batches)).backward()
            total += loss.item()
        return total / len(micro_batches)

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], autocast: Callable,
                  device: torch.device) -> float:  # fmt: skip
        """Mean loss (nats) of ``batches`` (as for :meth:`forward_backward`), forwards only."""
        if self.pipeline is not None:
            batches, start = self._pipeline_batches(batches, device)
            return self.pipeline.eval_step(batches, self.logits_loss, start, autocast)
        total = 0.0
        for x, y in batches:
            with autocast():
                total += self.loss(x.to(device), y.to(device)).item()
        return total / len(batches)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the (already averaged) gradients so their global L2 norm is at most ``max_norm``
        (the rule of ``torch.nn.utils.clip_grad_norm_``: factor ``min(1, max_norm / (norm + 1e-6))``).

        The norm is that of the full, unsharded gradient: squares of tensor-parallel shards are
        summed over ``tp`` (one all-reduce), replicated parameters are counted once.
        Returns the norm before clipping.
        """
        sharded, replicated = [], []
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                (sharded if name in self.tp_shards else replicated).append(p.grad)
        tp_group = self.dims.group("tp") if self.dims.tp > 1 else None
        pp_group = self.dims.group("pp") if self.dims.pp > 1 else None
        return clip_grad_norm_(sharded, replicated, max_norm, tp_group=tp_group, pp_group=pp_group)

    def _as_dtensor(self, name: str, local: torch.Tensor) -> DTensor:
        dim, shape = self.tp_shards[name]
        return sharded_dtensor(local, self.dims.mesh["tp"], [Shard(dim)], shape)

    def wrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """In place: the tensor-parallel shards in a model and an optimizer state dict (as
        ``get_state_dict`` returns them, keyed by parameter name) become ``Shard(dim)`` DTensors
        on the ``tp`` axis that share the local storage, so DCP saves and loads the full
        tensors and reshards them to another tensor-parallel degree."""
        for name in self.tp_shards:
            # ZeRO masters are DTensors already (placed on dp and tp); only plain shards change.
            if name in model_sd and not isinstance(model_sd[name], DTensor):
                model_sd[name] = self._as_dtensor(name, model_sd[name])
            if name in optim_sd.get("state", {}):
                # A new dict: get_state_dict may hand out the optimizer's own per-parameter state.
                optim_sd["state"][name] = {
                    key: self._as_dtensor(name, v) if self._is_plain_shard(v) else v
                    for key, v in optim_sd["state"][name].items()
                }

    @staticmethod
    def _is_plain_shard(value) -> bool:
        # Moments are shaped like the shard; the step count is a scalar, the same on every rank.
        return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0

    def unwrap_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        """Undo :meth:`wrap_state_dicts`: the DTensors it made back to their local shards."""
        if not self.tp_shards or isinstance(self.sync, ZeroSynchronizer):
            return
        for sd in (model_sd, *optim_sd.get("state", {}).values()):
            for key, value in sd.items():
                if isinstance(value, DTensor):
                    sd[key] = value.to_local()

    @torch.no_grad()
    def full_model(self) -> Transformer:
        """A plain single-process model with the full parameters, on every rank (a collective
        over ``tp`` and ``pp``); the model itself when nothing is split. For sampling after
        training; call ``sync.remove()`` first so ZeRO shards are whole again."""
        if self.dims.tp == 1 and self.dims.sp == 1 and self.dims.pp == 1:
            return self.model
        full = {
            name: self._as_dtensor(name, p.detach()).full_tensor() if name in self.tp_shards else p.detach()
            for name, p in self.model.named_parameters(remove_duplicate=False)
        }
        device = next(self.model.parameters()).device
        if self.dims.pp > 1:
            # Each pipeline rank holds other layers: every rank gets all of them (small models only).
            parts: list[dict] = [{} for _ in range(self.dims.pp)]
            dist.all_gather_object(parts, {k: v.cpu() for k, v in full.items()}, group=self.dims.group("pp"))
            full = {k: v.to(device) for part in parts for k, v in part.items()}
        plain = Transformer(self.model.cfg).to(device)
        plain.load_state_dict(full)
        return plain


def parallelize_llama(model: Transformer, dims: ParallelDims, cfg: Config, hook: CommHook) -> ParallelModel:
    """Apply tensor, sequence and data parallelism (or ZeRO) to ``model`` in place.

    ``hook`` reduces gradients over :attr:`ParallelDims.grad_mesh` (``dp`` × ``sp``).
    The checks of shapes against degrees are done earlier, on the config (see ``Config``).

    Returns:
        The :class:`ParallelModel` the training loop drives.
    """
    traffic = Traffic()
    tp_shards: dict[str, tuple[int, torch.Size]] = {}
    stage_layers = split_pipeline(model, dims, cfg) if dims.pp > 1 else None
    if dims.tp > 1:
        # Every name a parameter is registered under: a tied head is split too.
        full_shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
        split = apply_tensor_parallel(
            model, dims.group("tp"), sequence_parallel=cfg.parallel.tp_mode == "sequence_parallel", traffic=traffic
        )
        tp_shards = {name: (dim, full_shapes[name]) for name, dim in split.items()}
    if dims.sp > 1:
        apply_ulysses(model, dims.group("sp"), traffic=traffic)
    dp = cfg.data_parallel
    if dp.zero_stage == 0:
        sync = apply_data_parallel(model, dims.grad_mesh.get_group(), dp.bucket_size_mb, hook)
    else:
        mp = MixedPrecision.from_names(dp.param_dtype, dp.reduce_dtype)
        scaler = DynamicLossScaler(dp.loss_scale_init, dp.loss_scale_growth_interval)
        tp = TensorParallelLayout(dims.grad_tp_mesh, tp_shards) if dims.tp > 1 else None
        pp_group = dims.group("pp") if dims.pp > 1 else None
        sync = apply_zero(model, dims.grad_mesh, dp.zero_stage, mp, hook, scaler if dp.param_dtype == "fp16" else None,
                          tp=tp, pp_group=pp_group)  # fmt: skip
    pipeline = None
    if stage_layers is not None:
        p = cfg.parallel
        comm = PipelineComm(dims.pp_groups, dims.pp_rank, dims.pp, next(model.parameters()).device, traffic)
        pipeline = PipelineExecutor(model, stage_layers, p.pipeline_schedule, cfg.grad_accum_steps(dims.dp), dims.pp,
                                    p.virtual_stages, comm)  # fmt: skip
    return ParallelModel(model, sync, dims, tp_shards, traffic, pipeline)


def split_pipeline(model: Transformer, dims: ParallelDims, cfg: Config) -> dict[int, list[str]]:
    """Cut ``model`` into ``pp × virtual_stages`` stages (by ``parallel.stage_boundaries``, by
    measured layer time, or by count) and prune it, in place, to this rank's stages.

    Returns:
        ``{stage: [layer keys]}`` of this rank's stages.
    """
    p, t = cfg.parallel, cfg.training
    costs = None
    if p.pipeline_split == "time" and not p.stage_boundaries:
        device = next(model.parameters()).device
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len), device=device,
                               generator=torch.Generator(device).manual_seed(0))  # fmt: skip
        # Every rank measures; the mean is the one split all agree on.
        seconds = torch.tensor(measure_layer_seconds(model, tokens), dtype=torch.float64, device=device)
        dist.all_reduce(seconds)
        costs = (seconds / dims.world_size).tolist()
    plan = partition_layers(cfg.model.n_layers, p.n_stages, p.stage_boundaries, costs)
    return prune_to_rank(model, plan, dims.pp_rank, dims.pp)
