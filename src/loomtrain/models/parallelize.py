"""Apply the parallel plan to a Llama model from outside; the model file knows nothing of it,
and ``distributed/`` knows no model class: the Llama-specific parts live here (which linears
are column- or row-parallel, where attention's core is, how a model is pruned to a pipeline
rank's stages).

Order (each step sees the module the previous one produced):

1. pipeline split on the ``pp`` axis: the model is pruned to this rank's stages (layers, and
   the embedding or head where they belong) before anything else, so no rank splits or
   shards layers it does not hold;
2. tensor parallelism on the ``tp`` axis (Megatron column/row linears, vocab-parallel
   embedding and head), with Megatron sequence parallelism if ``tp_mode="sequence_parallel"``;
   with ``tp_mode="2d"`` the tp ranks form a ``q × q`` grid and every layer is sharded both ways
   (``models/tp2d.py``, on :attr:`ParallelDims.grid_mesh`), and the model is a
   :class:`GridParallelModel` (2D loss, 2D checkpoint layout);
3. Ulysses sequence parallelism on the ``sp`` axis (each attention core wrapped in all-to-alls);
4. ``torch.compile`` of each block's forward (``training.compile``): after the layers that
   communicate are in place, so the compiled code is the code that runs; the forward only, not
   the module call, so the hooks of steps 5-6 stay eager;
5. activation checkpointing (``training.activation_checkpointing``): each block, or each
   block's attention core (the innermost one, inside Ulysses' all-to-alls, so recomputing it
   sends nothing), recomputed in backward; after the modules are final (steps 2-4: the
   recomputation runs what the forward ran, collectives and compiled code included) and before
   step 6 hooks onto them;
6. data parallelism or ZeRO over the ranks that hold the same parameters: ``dp`` and ``sp``
   together (:attr:`ParallelDims.grad_mesh`), whose gradients are averaged; ZeRO shards over
   ``dp_shard × sp`` and replicates over ``dp_replicate`` (HSDP). Its hooks fire around the
   block's call and on gradients, so a recomputation in backward does not re-trigger them.

The returned :class:`~loomtrain.distributed.parallel_model.ParallelModel` is what the training
loop drives.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from loomtrain.config import Config, ConfigError
from loomtrain.distributed.activation_checkpoint import apply_activation_checkpointing
from loomtrain.distributed.clip import NormLayout
from loomtrain.distributed.data_parallel import CommHook, apply_data_parallel
from loomtrain.distributed.local_sgd import replicas_sync_inside
from loomtrain.distributed.mixed_precision import DynamicLossScaler, MixedPrecision
from loomtrain.distributed.parallel_dims import Axis, ParallelDims
from loomtrain.distributed.parallel_model import GridParallelModel, ParallelModel
from loomtrain.distributed.pipeline.emulated import EmulatedStages, device, emulated_loss
from loomtrain.distributed.pipeline.executor import PipelineExecutor
from loomtrain.distributed.pipeline.p2p import PipelineComm
from loomtrain.distributed.pipeline.schedule import rank_stages
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.distributed.sequence_parallel import UlyssesAttention
from loomtrain.distributed.sync import GradientSync
from loomtrain.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_grad_hook,
    check_vocab_split,
    enter_parallel_region,
)
from loomtrain.distributed.tensor_parallel_2d import Grid2D, GridShard, Linear2D, RMSNorm2D
from loomtrain.distributed.traffic import Traffic
from loomtrain.distributed.zero import apply_zero
from loomtrain.distributed.zero_layout import TensorParallelLayout
from loomtrain.hardware import synchronize
from loomtrain.models.llama import CoreAttention, Transformer
from loomtrain.models.tp2d import shard_2d


def parallelize_llama(model: Transformer, dims: ParallelDims, cfg: Config, hook: CommHook) -> ParallelModel:
    """Apply pipeline, tensor, sequence and data parallelism (or ZeRO), compilation and
    activation checkpointing to ``model`` in place, in the order of the module docstring.

    ``hook`` reduces gradients over :attr:`ParallelDims.grad_mesh` (``dp`` × ``sp``) and counts
    its bytes in the returned model's traffic counter. The checks of shapes against degrees are
    done earlier, on the config (see ``Config``).

    Returns:
        The :class:`ParallelModel` the training loop drives.
    """
    traffic = Traffic()
    hook.count_into(traffic)
    stage_layers = split_pipeline(model, dims, cfg) if dims.pp > 1 else None
    split = split_tensors(model, dims, cfg, traffic)
    if dims.sp > 1:
        apply_ulysses(model, dims.group(Axis.SP), traffic=traffic)
    if cfg.training.compile:
        compile_blocks(model)
    apply_activation_checkpointing(checkpointed_modules(model, cfg.training.activation_checkpointing))
    sync = apply_gradient_sync(model, dims, cfg, hook, split.norm, split.zero_tp)
    pipeline = _pipeline_executor(model, dims, cfg, stage_layers, traffic)
    parts = (model, sync, dims, split.tp_shards, traffic, lambda: Transformer(model.cfg), pipeline)
    if split.grid is not None:
        vocab = model.cfg.vocab_size
        return GridParallelModel(*parts, grid=split.grid, grid_shards=split.grid_shards, vocab_size=vocab)
    return ParallelModel(*parts)


@dataclass
class TensorSplit:
    """How step 2 split the model over ``tp``: what the later steps and the checkpoints need.

    Attributes:
        norm: the tensor-parallel names and groups for the gradient norm (its ``tp_group`` and
            ``pp_group`` are filled in by :func:`apply_gradient_sync`).
        tp_shards: 1D: ``{parameter name: (dim split over tp, full shape)}``.
        zero_tp: 1D: the shards as ZeRO records them in its masters.
        grid, grid_shards: 2D: the grid and ``{parameter name: (placements, full shape)}``.
    """

    norm: NormLayout
    tp_shards: dict[str, tuple[int, torch.Size]] = dataclasses.field(default_factory=dict)
    zero_tp: TensorParallelLayout | None = None
    grid: Grid2D | None = None
    grid_shards: dict[str, GridShard] = dataclasses.field(default_factory=dict)


def split_tensors(model: Transformer, dims: ParallelDims, cfg: Config, traffic: Traffic) -> TensorSplit:
    """Step 2: Megatron 1D tensor parallelism (with sequence parallelism if asked), 2D tensor
    parallelism (Optimus) on the grid axes of ``dims``, or nothing when ``tp = 1``. Under 2D the
    blocks are split over all of tp and the norm weights over a grid row, for the norm."""
    if dims.tp_2d:
        grid = Grid2D.from_mesh(dims.grid_mesh, str(Axis.TP_ROW), str(Axis.TP_COL))
        grid_shards = shard_2d(model, grid, traffic)
        blocks = frozenset(name for name, (placements, _) in grid_shards.items() if placements != RMSNorm2D.PLACEMENTS)
        return TensorSplit(NormLayout(blocks, replicated_group=grid.row_group), grid=grid, grid_shards=grid_shards)
    if dims.tp == 1:
        return TensorSplit(NormLayout())
    # Every name a parameter is registered under: a tied head is split too.
    full_shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    split = apply_tensor_parallel(
        model, dims.group(Axis.TP), sequence_parallel=cfg.parallel.tp_mode == "sequence_parallel", traffic=traffic
    )
    tp_shards = {name: (dim, full_shapes[name]) for name, dim in split.items()}
    # A local mode's replicas each hold their own ZeRO state: no replicate axis in its masters.
    zero_mesh = dims.shard_tp_mesh if replicas_sync_inside(cfg.data_parallel, dims) else dims.zero_tp_mesh
    return TensorSplit(NormLayout(frozenset(tp_shards)), tp_shards, TensorParallelLayout(zero_mesh, tp_shards))


def _pipeline_executor(model: Transformer, dims: ParallelDims, cfg: Config, stage_layers: dict[int, list[str]] | None,
                       traffic: Traffic) -> PipelineExecutor | None:  # fmt: skip
    """The schedule's executor for this rank's stages, or ``None`` without a pipeline."""
    if stage_layers is None:
        return None
    p = cfg.parallel
    comm = PipelineComm(dims.pp_groups, dims.pp_rank, dims.pp, next(model.parameters()).device, traffic)
    return PipelineExecutor(model, stage_layers, p.pipeline_schedule, cfg.grad_accum_steps(dims.dp), dims.pp,
                            p.virtual_stages, comm)  # fmt: skip


class EmulatedParallelModel(ParallelModel):
    """A :class:`ParallelModel` of emulated pipeline stages (``simulate.device``): the last
    stage's loss is :func:`~loomtrain.distributed.pipeline.emulated.emulated_loss` (zero; the
    stages compute nothing), and there is no full model to sample from."""

    def logits_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Zero, with a gradient of the real activation shape (see ``emulated_loss``)."""
        return emulated_loss(logits, target)


def parallelize_emulated(cfg: Config, dims: ParallelDims, hook: CommHook) -> EmulatedParallelModel:
    """This rank's pipeline stages of ``cfg.model`` on the emulated ``simulate.device``
    (``EmulatedStages``: each forward and backward takes the cost model's time for
    ``training.micro_batch_size × seq_len`` tokens), split by ``parallel.stage_boundaries`` or
    by layer count, driven by the real executor on the stages' own device clock. The stages'
    one-element parameters get the (single-rank) data-parallel synchronizer the trainer expects.
    """
    p, t = cfg.parallel, cfg.training
    plan = partition_layers(cfg.model.n_layers, p.n_stages, p.stage_boundaries)
    stage_layers = {s: [str(i) for i in plan[s]] for s in rank_stages(dims.pp_rank, dims.pp, p.virtual_stages)}
    model = EmulatedStages(cfg.model, stage_layers, p.n_stages, t.seq_len, t.micro_batch_size,
                           device(cfg.simulate.device))  # fmt: skip
    traffic = Traffic()
    hook.count_into(traffic)
    sync = apply_gradient_sync(model, dims, cfg, hook, NormLayout())
    comm = PipelineComm(dims.pp_groups, dims.pp_rank, dims.pp, torch.device("cpu"), traffic)
    pipeline = PipelineExecutor(model, stage_layers, p.pipeline_schedule, cfg.grad_accum_steps(dims.dp), dims.pp,
                                p.virtual_stages, comm, clock=model.clock)  # fmt: skip
    return EmulatedParallelModel(model, sync, dims, {}, traffic, lambda: model, pipeline)


def apply_gradient_sync(model: Transformer, dims: ParallelDims, cfg: Config, hook: CommHook, norm: NormLayout,
                        zero_tp: TensorParallelLayout | None = None) -> GradientSync:  # fmt: skip
    """Plain data parallelism (``zero_stage=0``) or ZeRO over the ranks that share parameters;
    ZeRO's units are the transformer blocks. ``norm``: the tensor-parallel split of the
    gradient (its ``tp_group`` and ``pp_group`` are filled in from ``dims``); ``zero_tp``: 1D
    tensor parallelism's shards, recorded in ZeRO's masters. A local mode's replicas of
    ``dp_shard`` ranks (:func:`~loomtrain.distributed.local_sgd.replicas_sync_inside`) average
    their gradients inside the replica only: the outer step is what crosses ``dp_replicate``."""
    dp = cfg.data_parallel
    inside = replicas_sync_inside(dp, dims)
    norm = replace(norm, tp_group=dims.group_or_none(Axis.TP), pp_group=dims.group_or_none(Axis.PP))
    # Every rank creates the subgroups of every gradient group (hierarchical hooks need them).
    shard_groups = dims.axis_groups(Axis.DP_SHARD_SP) if dims.dp_replicate > 1 else []
    hook.setup(dims.axis_groups(Axis.DP_SP) + shard_groups)
    if dp.zero_stage == 0:
        group = (dims.shard_mesh if inside else dims.grad_mesh).get_group()
        return apply_data_parallel(model, group, dp.bucket_size_mb, hook, **vars(norm))
    mp = MixedPrecision.from_names(dp.param_dtype, dp.reduce_dtype)
    scaler = None
    if dp.param_dtype == "fp16":
        scaler = DynamicLossScaler(dp.loss_scale_init, dp.loss_scale_growth_interval)
    mesh = dims.shard_mesh if inside else dims.zero_mesh
    return apply_zero(model, mesh, dp.zero_stage, list(model.layers.values()), mp, hook, scaler, tp=zero_tp,
                      **vars(norm))  # fmt: skip


def apply_tensor_parallel(
    model: Transformer,
    group: dist.ProcessGroup,
    *,
    sequence_parallel: bool = False,
    traffic: Traffic | None = None,
    axis: str = "tp",
) -> dict[str, int]:
    """Split ``model`` over the tensor-parallel ``group`` in place (Megatron §3; with
    ``sequence_parallel``, Korthikanti et al. §4.2.2).

    In every block, the input of the attention and of the feed-forward enters the parallel
    region once (``f``: a forward pre-hook on the module), ``wq``, ``wk``, ``wv``, ``w1``, ``w3``
    become :class:`ColumnParallelLinear` (whole heads per rank) and ``wo``, ``w2``
    :class:`RowParallelLinear` (``g``). That is 4 collectives of ``B·S·dim`` elements per block
    and step, 8·B·S·dim·(t−1)/t elements on the wire, in either mode. ``tok_embeddings`` becomes
    a :class:`VocabParallelEmbedding`; ``output`` a :class:`ColumnParallelLinear` over the
    vocabulary whose logits ``[B, S, V_local]`` (full sequence in both modes) feed
    :func:`vocab_parallel_cross_entropy`. With tied embeddings both hold the same local
    Parameter. With ``sequence_parallel`` the norms and residuals see ``[B, S/t, dim]`` and the
    norm weights get :func:`all_reduce_grad_hook`.

    The model's parameters are copied, not re-initialised: build (and initialise) the full model
    the same way on every rank first.

    Returns:
        ``{fqn: shard_dim}`` for every sharded parameter, by ``state_dict`` key (both
        ``tok_embeddings.weight`` and ``output.weight`` when tied); the rest are replicated.
    Raises:
        ValueError: ``n_heads`` or ``n_kv_heads`` not divisible by the group size, or a
            vocabulary too small to give every rank rows; in forward, with
            ``sequence_parallel``, a sequence length not divisible by the group size.
    """
    _check_divisible(model.cfg, dist.get_world_size(group))
    comm = {"sequence_parallel": sequence_parallel, "traffic": traffic, "axis": axis}
    shards: dict[str, int] = {}
    for i, layer in model.layers.items():
        shards |= _split_module(layer.attention, f"layers.{i}.attention", ("wq", "wk", "wv"), ("wo",), group, comm)
        shards |= _split_module(layer.feed_forward, f"layers.{i}.feed_forward", ("w1", "w3"), ("w2",), group, comm)
        if sequence_parallel:
            all_reduce_grad_hook(layer.attention_norm.weight, group, traffic, axis)
            all_reduce_grad_hook(layer.ffn_norm.weight, group, traffic, axis)
    if sequence_parallel and model.norm is not None:
        all_reduce_grad_hook(model.norm.weight, group, traffic, axis)
    return shards | _split_vocab(model, group, comm)


def _check_divisible(cfg, n: int) -> None:
    for field, heads in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads)):
        if heads % n:
            raise ValueError(
                f"model.{field}={heads} is not divisible by parallel.tensor_parallel_degree={n}; "
                "each rank must hold whole heads: choose a degree that divides both head counts"
            )
    check_vocab_split(cfg.vocab_size, n)


def _split_module(module: nn.Module, prefix: str, columns, rows, group, comm: dict) -> dict[str, int]:
    """Column-split ``columns``, row-split ``rows``; the module's input enters the parallel
    region once, in a forward pre-hook, for all the column layers that read it."""

    def enter(_module: nn.Module, args: tuple) -> tuple:
        return (enter_parallel_region(args[0], group, **comm), *args[1:])

    module.register_forward_pre_hook(enter)
    shards = {}
    for name in columns:
        setattr(module, name, ColumnParallelLinear.from_linear(getattr(module, name), group, enter=False, **comm))
        shards[f"{prefix}.{name}.weight"] = 0
    for name in rows:
        setattr(module, name, RowParallelLinear.from_linear(getattr(module, name), group, **comm))
        shards[f"{prefix}.{name}.weight"] = 1
    return shards


def _split_vocab(model: Transformer, group, comm: dict) -> dict[str, int]:
    # A pipeline stage may hold the embedding, the head, or neither (tied: both, on one stage).
    shards = {}
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding.from_embedding(model.tok_embeddings, group, **comm)
        shards["tok_embeddings.weight"] = 0
    if model.output is not None:
        if model.cfg.tie_embeddings:
            model.output = ColumnParallelLinear(model.tok_embeddings.weight, group, **comm)
        else:
            model.output = ColumnParallelLinear.from_linear(model.output, group, **comm)
        shards["output.weight"] = 0
    return shards


def apply_ulysses(
    model: Transformer, group: dist.ProcessGroup, traffic: Traffic | None = None, axis: str = "sp"
) -> None:
    """Make ``model`` sequence parallel over ``group`` (Ulysses), in place: every
    ``model.layers[i].attention.core`` is wrapped in a :class:`UlyssesAttention`.

    The caller gives group rank ``r`` positions ``[r·S/sp, (r+1)·S/sp)`` of each length-``S``
    sequence, ``model(tokens[:, r·S/sp:(r+1)·S/sp], start_pos=r·S/sp)``
    (``ParallelDims.sequence_slice``, which rejects an ``S`` not divisible by ``sp``), and
    averages gradients over ``group`` with the data-parallel ranks.
    """
    for layer in model.layers.values():
        layer.attention.core = UlyssesAttention(layer.attention.core, group, traffic, axis)


def checkpointed_modules(model: Transformer, mode: str) -> list[nn.Module]:
    """The modules that ``training.activation_checkpointing=mode`` recomputes in backward.

    ``"full"``: every transformer block this rank holds (Korthikanti et al. 2022 §4: full
    recomputation keeps only each block's input). ``"selective"``: every block's attention core,
    the only part of a block whose saved state grows with ``s²`` (§4.3: softmax, its dropout and
    the attention over ``v``; with the fused SDPA kernel only its log-sum-exp); under Ulysses
    the core inside the all-to-alls, so recomputing it communicates nothing. ``"none"``: no
    module. See :func:`block_activation_bytes` for what each mode leaves saved.

    Raises:
        ValueError: ``mode`` is not ``none``, ``full`` or ``selective``.
    """
    if mode == "none":
        return []
    if mode == "full":
        return list(model.layers.values())
    if mode == "selective":
        return [m for block in model.layers.values() for m in block.modules() if isinstance(m, CoreAttention)]
    raise ValueError(f"training.activation_checkpointing={mode!r}; choose none, full or selective")


def block_activation_bytes(cfg: Config, mode: str, tp: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes one transformer block saves for backward in one micro-batch's forward on one rank
    (fp32 activations on CPU; ``tp``-way Megatron tensor parallelism, not sequence parallel),
    derived in ``docs/activation_checkpointing.md`` by the method of Korthikanti et al. 2022
    §4.1 applied to this block (RMSNorm, rotary attention with grouped key/value heads, SwiGLU).

    In elements, with ``b`` micro-batch, ``s`` sequence, ``h`` width, ``a`` heads, ``k`` the
    key/value width (``n_kv_heads · head_dim``), ``f`` the SwiGLU width, heads and ``f`` split
    over ``t = tp`` (rank 0's share when ``f`` does not divide):

    - ``"full"``: the block's input, ``sbh``;
    - ``"selective"``: ``6sbh + 2sb + (2sbh + 2sbk + 4sbf)/t`` (norm inputs and outputs,
      residual, rotated ``q``, ``k``, ``v``, attention output, SwiGLU), plus ``2sbh`` for the
      two residual dropout masks when ``model.dropout > 0``;
    - ``"none"``, ``model.dropout = 0`` (the fused SDPA kernel): ``"selective"`` plus the
      kernel's log-sum-exp, ``abs/t``;
    - ``"none"``, ``model.dropout > 0`` (the math kernel): ``8sbh + 2sb + (4sbh + 3as²b +
      4sbf)/t``: it keeps scaled copies of ``q``, ``k``, ``v`` (grouped heads repeated) instead
      of the rotated ones, and the softmax, its dropout mask and the dropped scores.

    Raises:
        ValueError: an unknown ``mode``, or a ``tp`` that does not divide the head counts.
    """
    m, t = cfg.model, cfg.training
    if m.n_heads % tp or m.kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide model.n_heads={m.n_heads} and n_kv_heads={m.kv_heads}")
    b, s, h = t.micro_batch_size, t.seq_len, m.dim
    a, hq, k, f = m.n_heads // tp, m.dim // tp, m.kv_heads * m.head_dim // tp, -(-m.hidden_dim // tp)
    if mode == "full":
        return bytes_per_element * s * b * h
    masks = 2 * s * b * h if m.dropout > 0 else 0
    split = {"selective": 2 * s * b * hq + 2 * s * b * k}
    if m.dropout == 0:
        split["none"] = split["selective"] + a * s * b
    else:
        split["none"] = 4 * s * b * hq + 3 * a * s * s * b
    if mode not in split:
        raise ValueError(f"training.activation_checkpointing={mode!r}; choose none, full or selective")
    return bytes_per_element * (6 * s * b * h + masks + 2 * s * b + split[mode] + 4 * s * b * f)


def cpp_compiler() -> str | None:
    """Path of the C++ compiler inductor builds CPU kernels with (its ``cpp.cxx`` setting:
    ``$CXX``, else ``g++``; ``clang++`` on macOS), or ``None`` when there is none."""
    from torch._inductor import config as inductor_config

    names = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, tuple | list) else (inductor_config.cpp.cxx,)
    return next((path for path in map(shutil.which, filter(None, names)) if path), None)


def compile_blocks(model: Transformer) -> None:
    """``torch.compile`` (inductor) the forward of every transformer block this rank holds, in
    place, for the forwards that record gradients (training, and its recomputation). All blocks
    share the compiled code, built at the first training step. Forwards without gradients
    (evaluation, sampling) stay eager: each would need graphs of its own (sampling one per
    shape until dynamo makes the length dynamic), tens of seconds of compiling on CPU for a
    small part of a run's work.

    The block's call and its hooks stay eager (ZeRO's gathering around it). So do the layers
    and hooks that communicate inside it, tensor parallelism's and Ulysses' collectives: they
    are ``torch.autograd.Function`` s that count their bytes in Python, which dynamo would trace as
    side effects, guard on the counts and recompile at every call; disabled, each is a graph
    break, and the code between them is compiled once.

    Raises:
        ConfigError: the model is on CPU and no C++ compiler is found.
    """
    if next(model.parameters()).device.type == "cpu" and cpp_compiler() is None:
        raise ConfigError(
            "training.compile=true on CPU needs a C++ compiler for inductor's kernels ($CXX or g++ on PATH); "
            "install one or set training.compile=false"
        )
    for block in model.layers.values():
        _keep_collectives_eager(block)
        block.forward = _compiled_with_gradients(block.forward)


def _keep_collectives_eager(block: nn.Module) -> None:
    """``torch.compiler.disable`` the forwards inside ``block`` that issue collectives
    (row-parallel linears, column-parallel ones that gather their input, Ulysses' attention,
    2D linears and norms) and the forward pre-hooks of its submodules (tensor parallelism's region entries, the only
    ones there)."""
    for module in block.modules():
        gathers = isinstance(module, ColumnParallelLinear) and module.enter_input
        if gathers or isinstance(module, RowParallelLinear | UlyssesAttention | Linear2D | RMSNorm2D):
            module.forward = torch.compiler.disable(module.forward)
        if module is not block:
            hooks = module._forward_pre_hooks
            for key, hook in hooks.items():
                hooks[key] = torch.compiler.disable(hook)


def _compiled_with_gradients(forward):
    compiled = torch.compile(forward)

    def forward_or_compiled(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else forward)(*args, **kwargs)

    return forward_or_compiled


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


def measure_layer_seconds(model: Transformer, tokens: torch.Tensor, repeats: int = 3) -> list[float]:
    """Forward plus backward seconds of each block of ``model`` on one micro-batch (median of
    ``repeats`` after a warm-up), for a balanced split. ``tokens``: ``LongTensor[B, S]``.

    Every rank measures; callers average over ranks so all agree on one split.
    """
    with torch.no_grad():
        h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[: tokens.shape[1]], model.rope_sin[: tokens.shape[1]]
    seconds = []
    for layer in model.layers.values():
        x = h.detach().requires_grad_(True)
        times = []
        for _ in range(repeats + 1):
            synchronize(tokens.device)
            start = time.perf_counter()
            layer(x, cos, sin).sum().backward()
            synchronize(tokens.device)
            times.append(time.perf_counter() - start)
        seconds.append(sorted(times[1:])[len(times[1:]) // 2])
        with torch.no_grad():
            h = layer(h, cos, sin)
    model.zero_grad(set_to_none=True)
    return seconds


def prune_to_rank(model: Transformer, stage_layers: list[list[int]], pp_rank: int, pp: int) -> dict[int, list[str]]:
    """Keep, in place, only what pipeline rank ``pp_rank`` runs: its stages' layers, the
    embedding if it holds stage 0, the final norm and head if it holds the last stage.
    Parameter names do not change (``layers.7.…`` stays ``layers.7.…``), so checkpoints load
    across pipeline degrees.

    Returns:
        ``{stage: [layer keys]}`` for this rank's stages, in stage order.
    """
    n_stages = len(stage_layers)
    mine = rank_stages(pp_rank, pp, n_stages // pp)
    keep = {str(i) for s in mine for i in stage_layers[s]}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if 0 not in mine:
        model.tok_embeddings = None
    if n_stages - 1 not in mine:
        model.norm = None
        model.output = None
    return {s: [str(i) for i in stage_layers[s]] for s in mine}
