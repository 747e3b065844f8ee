"""``--parallel.auto=true``: the planner chooses a run's layout (issue #19).

The launcher of ``loomtrain train`` searches the layouts of the config's model for the world size
on a cluster (:func:`loomtrain.planner.search.search`), takes the fastest one loomtrain accepts
(its config validation and :func:`loomtrain.preflight.check_world`) and the next as the runner-up,
prints both (:func:`describe`), and hands the workers the choice as ordinary ``--section.key=value``
overrides with ``--parallel.auto=false``, so every worker runs the same layout without planning
again and the run's saved ``config.toml`` holds the layout it ran. See docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from loomtrain.config import Config, ConfigError, parse_override
from loomtrain.planner.arch import from_model_config
from loomtrain.planner.cluster import load_cluster_spec
from loomtrain.planner.memory import Layout, precision_for
from loomtrain.planner.search import REASONS, Plan, search
from loomtrain.planner.time import Cluster

# The config fields a plan sets: with parallel.auto=true the user may not set them. The pipeline's
# layer split is here too, since stage_boundaries depend on the chosen stage count and a split
# other than the default is refused without a pipeline.
PLANNED_FIELDS = {
    "parallel": (
        "data_parallel_degree", "data_parallel_replicate_degree", "tensor_parallel_degree",
        "sequence_parallel_degree", "tp_mode", "pipeline_parallel_degree", "pipeline_schedule", "virtual_stages",
        "pipeline_split", "stage_boundaries",
    ),
    "data_parallel": ("zero_stage",),
    "training": ("micro_batch_size", "activation_checkpointing"),
}  # fmt: skip
GIB = 2**30


@dataclass(frozen=True)
class AutoChoice:
    """The planner's choice for a run.

    Attributes:
        chosen: the fastest :class:`~loomtrain.planner.search.Plan` loomtrain accepts.
        runner_up: the next accepted plan (``None``: no other).
        overrides: ``--section.key=value`` arguments that make the config run ``chosen``, ending with
            ``--parallel.auto=false``.
        config: the config with ``overrides`` applied and validated.
        world: processes planned for. cluster: the cluster the plans were priced on.
        refused: plans faster than ``chosen`` that loomtrain refuses.
    """

    chosen: Plan
    runner_up: Plan | None
    overrides: list[str]
    config: Config
    world: int = 1
    cluster: Cluster | None = None
    refused: int = 0


def plan_overrides(layout: Layout) -> list[str]:
    """The ``--section.key=value`` overrides that make a loomtrain config run ``layout`` (its
    degrees, Megatron SP as ``tp_mode``, pipeline schedule, ZeRO stage, micro-batch and
    recomputation; ``dp_replicate`` as ``data_parallel_replicate_degree``)."""
    tp_mode = "sequence_parallel" if layout.sequence_parallel else "tensor_parallel"
    return [
        f"--parallel.data_parallel_degree={layout.dp}",
        f"--parallel.data_parallel_replicate_degree={layout.dp_replicate}",
        f"--parallel.tensor_parallel_degree={layout.tp}",
        f"--parallel.sequence_parallel_degree={layout.sp}",
        f"--parallel.tp_mode={tp_mode}",
        f"--parallel.pipeline_parallel_degree={layout.pp}",
        f"--parallel.pipeline_schedule={layout.schedule}",
        f"--parallel.virtual_stages={layout.virtual_stages}",
        f"--data_parallel.zero_stage={layout.zero_stage}",
        f"--training.micro_batch_size={layout.micro_batch}",
        f"--training.activation_checkpointing={layout.recompute}",
    ]


def _planned(section: str, name: str) -> bool:
    return name in PLANNED_FIELDS.get(section, ())


def asks_for_auto(overrides: list[str]) -> bool:
    """Whether the command line's ``overrides`` leave ``parallel.auto`` true (the last one given wins,
    as in :func:`~loomtrain.config.load_config`: the launcher hands its workers ``--parallel.auto=false``
    after the user's ``--parallel.auto=true``)."""
    values = [parse_override(o)[1] for o in overrides if o.startswith("--parallel.auto=")]
    return bool(values) and values[-1] is True


def check_explicit(overrides: list[str]) -> None:
    """For ``parallel.auto=true``: refuse a planned field (:data:`PLANNED_FIELDS`) given on the command
    line (``overrides``, ``--section.key=value``): the user asked for two things at once. One the config
    file sets is replaced by the plan (:func:`file_fields` names them), so a config written for one
    layout still runs with ``--parallel.auto=true``. Call it before the config is validated, so this
    is the error the user sees rather than one about the refused field's value.

    Raises:
        ConfigError: naming the fields and the fix.
    """
    given = [".".join(path) for path, _ in map(parse_override, overrides) if _planned(*path)]
    if given:
        raise ConfigError(
            f"parallel.auto=true chooses {', '.join(given)} itself; drop {'it' if len(given) == 1 else 'them'} from "
            "the command line, or drop parallel.auto"
        )


def file_fields(cfg: Config) -> list[str]:
    """The planned fields ``cfg`` sets (``section.key=value``): with :func:`check_explicit` passed, the
    config file's, which the plan replaces. Call it on the config as
    :func:`~loomtrain.config.load_config` returns it (a re-validated full dump sets every field)."""
    return [f"{section}.{name}={getattr(getattr(cfg, section), name)}" for section, names in PLANNED_FIELDS.items()
            for name in names if name in getattr(cfg, section).model_fields_set]  # fmt: skip


def auto_cluster(cfg: Config, world: int) -> Cluster:
    """The cluster to plan on: the spec ``parallel.auto_cluster`` names (a TOML path or a name in
    configs/clusters), or when empty this machine for ``world`` processes, measured once and cached
    (:func:`loomtrain.planner.calibrate.local_spec`).

    Raises:
        ConfigError: an unknown or invalid spec.
    """
    if world < 1:
        raise ConfigError(f"--nproc={world} must be at least 1")
    if not cfg.parallel.auto_cluster:
        if world & (world - 1):
            raise ConfigError(
                f"parallel.auto=true on this machine measures --nproc={world} ranks, and the measurement needs a "
                "power of two (1, 2, 4, ...); use such an --nproc, or set parallel.auto_cluster to a spec "
                "(`loomtrain plan --calibrate --ranks N --out spec.toml`, or a name in configs/clusters)"
            )
        from loomtrain.planner.calibrate import local_spec  # measures this machine: only when asked to

        return local_spec(world).to_cluster()
    try:
        return load_cluster_spec(cfg.parallel.auto_cluster, flag="parallel.auto_cluster").to_cluster()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def vocab_size(cfg: Config) -> int:
    """The vocabulary the run's model will have: ``model.vocab_size``, or for the char tokenizer the
    distinct characters of the corpus (what :func:`loomtrain.data.build_data` builds it from).

    Raises:
        ConfigError: ``model.vocab_size=0`` with the BPE tokenizer (its size is known only after
            training it), or an unreadable corpus.
    """
    if cfg.model.vocab_size > 0:
        return cfg.model.vocab_size
    if cfg.data.tokenizer != "char":
        raise ConfigError(
            "model.vocab_size=0 with data.tokenizer='bpe': the planner needs the vocabulary size before the "
            f"tokenizer is trained; set model.vocab_size={cfg.data.bpe_vocab_size} (data.bpe_vocab_size, which the "
            "learned vocabulary never exceeds)"
        )
    from loomtrain.data.corpus import load_corpus
    from loomtrain.data.tokenizer import build_tokenizer

    train_text, val_text = load_corpus(cfg.data)
    return build_tokenizer(cfg.data.tokenizer, train_text + val_text, cfg.data.bpe_vocab_size).vocab_size


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """``cfg`` rebuilt from what it sets, with ``overrides`` applied as ``load_config`` applies them.

    Raises:
        ConfigError, ValidationError: an override that is malformed or makes the config invalid.
    """
    raw: dict[str, Any] = cfg.model_dump(exclude_unset=True)
    for arg in overrides:
        (section, key), value = parse_override(arg)
        raw.setdefault(section, {})[key] = value
    return Config.model_validate(raw)


def _accepted(cfg: Config, overrides: list[str], world: int) -> Config | str:
    """The config that runs ``overrides`` on ``world`` processes, or why loomtrain refuses it."""
    from loomtrain.preflight import check_world  # torch and the checkpoint code: only when a plan is checked

    try:
        planned = with_overrides(cfg, overrides)
        check_world(planned, world)
    except ValidationError as err:
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
    except ConfigError as err:
        return str(err)
    return planned


def choose_layout(cfg: Config, world: int, cluster: Cluster) -> AutoChoice:
    """The fastest layout of ``cfg``'s model for ``world`` processes on ``cluster`` that loomtrain
    accepts, and the runner-up. Plans come from :func:`~loomtrain.planner.search.search` with the
    config's global batch, sequence length, ``training.dtype`` (the ZeRO-0 precision of
    :func:`~loomtrain.planner.memory.precision_for`) and ``training.log_interval``; faster plans whose
    config loomtrain refuses (e.g. Megatron SP with ZeRO-3, a pipeline with a tied embedding) are skipped.

    Raises:
        ConfigError: the vocabulary size cannot be known (:func:`vocab_size`), the cluster has fewer
            devices than ``world``, or no plan fits and is accepted (the message says what to change).
    """
    model = cfg.model.model_copy(update={"vocab_size": vocab_size(cfg)})
    arch = from_model_config(model, cfg.model.preset or "model")
    t = cfg.training
    try:
        result = search(arch, cluster, t.global_batch_size, seq_len=t.seq_len, world=world,
                        precision=precision_for(t.dtype, 0), log_interval=t.log_interval)  # fmt: skip
    except ValueError as err:
        raise ConfigError(f"parallel.auto=true: {err} (parallel.auto_cluster, --nproc)") from None
    found: list[tuple[Plan, list[str], Config]] = []
    refusals: list[str] = []
    for plan in result.plans:
        overrides = [*plan_overrides(plan.layout), "--parallel.auto=false"]
        planned = _accepted(cfg, overrides, world)
        if isinstance(planned, str):
            refusals.append(planned)
            continue
        found.append((plan, overrides, planned))
        if len(found) == 2:
            break
    if not found:
        raise ConfigError(_nothing_runs(result.rejected, len(result.plans), refusals, world, cluster))
    (chosen, overrides, planned), runner_up = found[0], found[1][0] if len(found) > 1 else None
    return AutoChoice(chosen, runner_up, overrides, planned, world, cluster, result.plans.index(chosen))


def _nothing_runs(rejected: dict[str, int], fitting: int, refusals: list[str], world: int, cluster: Cluster) -> str:
    where = f"{world} × {cluster.device.name} ({cluster.device.memory_bytes / GIB:.0f} GiB each)"
    if fitting:
        return (f"parallel.auto=true: loomtrain refuses all {fitting} layouts that fit {where} (the first: "
                f"{refusals[0]}); change that setting, launch more processes, or drop parallel.auto and set the "
                "layout")  # fmt: skip
    reasons = "; ".join(f"{n} {REASONS[r]}" for r, n in sorted(rejected.items())) or "none considered"
    return (f"parallel.auto=true: no layout fits {where} (rejected: {reasons}); launch more processes, lower "
            "training.global_batch_size or training.seq_len, or use a smaller model")  # fmt: skip


def _line(label: str, plan: Plan) -> str:
    lay = plan.layout
    dp = f"{lay.dp} ({lay.dp_replicate} replicas × {lay.dp_shard} shards)" if lay.dp_replicate > 1 else str(lay.dp)
    return (f"  {label}: dp={dp} zero_stage={lay.zero_stage} tp={lay.tp} "
            f"tp_mode={'sequence_parallel' if lay.sequence_parallel else 'tensor_parallel'} sp={lay.sp} pp={lay.pp} "
            f"schedule={lay.schedule} virtual_stages={lay.virtual_stages} micro_batch={lay.micro_batch} "
            f"micro_batches={lay.n_micro} recompute={lay.recompute}: step {plan.step.total:.4g} s, "
            f"{plan.tokens_per_s:,.0f} tokens/s, {plan.memory_bytes / GIB:.3g} GiB/device")  # fmt: skip


def describe(choice: AutoChoice) -> str:
    """The lines the launcher prints: the cluster, the chosen layout and the runner-up (degrees,
    ZeRO stage, schedule, micro-batch, recomputation; predicted step time in s, tokens/s, memory
    per device in GiB), how many faster layouts loomtrain refused, and that these are predictions."""
    cluster = choice.cluster
    where = f" on {cluster.name or 'the cluster'} ({cluster.device.name})" if cluster is not None else ""
    processes = f"{choice.world} process{'' if choice.world == 1 else 'es'}"
    lines = [f"parallel.auto: the planner's layout for {processes}{where}",
             _line("chosen", choice.chosen)]  # fmt: skip
    lines.append(_line("runner-up", choice.runner_up) if choice.runner_up else "  runner-up: none")
    if choice.refused:
        lines.append(f"  skipped {choice.refused} faster layout(s) that loomtrain does not run")
    lines.append("  step time, tokens/s and memory are predictions of the planner's cost model (docs/planner.md), "
                 "not measurements")  # fmt: skip
    return "\n".join(lines)
