"""Apply the parallel plan to a Llama model from outside; the model file knows nothing of it.

Order (each step sees the module the previous one produced):

1. tensor parallelism on the ``tp`` axis (Megatron column/row linears, vocab-parallel
   embedding and head), with Megatron sequence parallelism if ``tp_mode="sequence_parallel"``;
2. Ulysses sequence parallelism on the ``sp`` axis (each attention core wrapped in all-to-alls);
3. data parallelism or ZeRO over the ranks that hold the same parameters: ``dp`` and ``sp``
   together (:attr:`ParallelDims.grad_mesh`), whose gradients are averaged.

The returned :class:`ParallelModel` is what the training loop drives: the loss of a
micro-batch (slicing the sequence for ``sp``, vocab-parallel cross-entropy for ``tp``), global
gradient-norm clipping over shards, DTensor views of the tensor-parallel shards for
checkpoints, and a full model for sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from loomtrain.config import Config
from loomtrain.distributed.data_parallel import CommHook, GradientSynchronizer, apply_data_parallel
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.parallel_dims import ParallelDims, sharded_dtensor
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
        traffic: bytes sent by tensor and sequence parallelism, per mesh axis.
    """

    model: Transformer
    sync: GradientSynchronizer | ZeroSynchronizer
    dims: ParallelDims
    tp_shards: dict[str, tuple[int, torch.Size]]
    traffic: Traffic

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of this rank's tokens of a micro-batch.

        ``x``, ``y``: ``LongTensor[micro_batch, seq_len]``, the whole sequences of this ``dp``
        rank; each ``sp`` rank takes its slice of positions. With ``tp > 1`` the logits are
        vocabulary shards and the loss is the vocab-parallel cross-entropy.
        """
        cut = self.dims.sequence_slice(x.shape[1])
        logits = self.model(x[:, cut], start_pos=cut.start)
        target = y[:, cut]
        if self.dims.tp > 1:
            return vocab_parallel_cross_entropy(logits.float(), target, self.dims.group("tp"), self.traffic)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

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
        return clip_grad_norm_(sharded, replicated, max_norm, tp_group=tp_group)

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
        over ``tp``); the model itself when nothing is tensor-parallel. For sampling after
        training; call ``sync.remove()`` first so ZeRO shards are whole again."""
        if self.dims.tp == 1 and self.dims.sp == 1:
            return self.model
        full = {
            name: self._as_dtensor(name, p.detach()).full_tensor() if name in self.tp_shards else p.detach()
            for name, p in self.model.named_parameters(remove_duplicate=False)
        }
        device = next(self.model.parameters()).device
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
        sync = apply_zero(model, dims.grad_mesh, dp.zero_stage, mp, hook, scaler if dp.param_dtype == "fp16" else None,
                          tp=tp)  # fmt: skip
    return ParallelModel(model, sync, dims, tp_shards, traffic)
