"""``loomtrain plan``: the best parallel layouts of a model on a cluster, from the planner's cost model.

Prints the top layouts (memory per device, predicted step time, tokens/s, MFU) and a summary of the
rejected ones by reason. Every figure is a prediction of ``planner/time.py`` and ``planner/memory.py``
(docs/planner.md: how they compare with published runs), not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from loomtrain.planner.arch import ARCH_PRESETS, Architecture, from_model_config
from loomtrain.planner.cluster import ClusterSpec, load_cluster_spec
from loomtrain.planner.memory import MIXED_ADAM, Precision, precision_for
from loomtrain.planner.search import REASONS, Plan, SearchResult, search

EXIT_USAGE = 2


def plan_parser() -> argparse.ArgumentParser:
    """The ``loomtrain plan`` parser."""
    p = argparse.ArgumentParser(
        prog="loomtrain plan",
        description="Rank the parallel layouts (dp/ZeRO/HSDP, tp, Megatron SP, Ulysses sp, pp, virtual stages, "
        "micro-batch, recomputation) of a model on a cluster by predicted step time.",
    )
    p.add_argument("--model", help="a preset (llama3-8b, llama3-70b, gpt3-175b, ...) or a loomtrain config TOML")
    p.add_argument("--cluster", help="a cluster spec TOML, or a name in configs/clusters (dgx-a100)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all of the cluster's)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of device memory the predicted bytes may fill (default 0.9)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine instead (GEMM rate by size, memory bandwidth, all-reduce per group "
                   "size) and write its cluster spec; --model/--cluster/--global-batch are not used")  # fmt: skip
    p.add_argument("--ranks", type=int, default=2,
                   help="with --calibrate: processes measuring at once, a power of two (default 2)")  # fmt: skip
    p.add_argument("--out", help="with --calibrate: the spec file to write (default: the cache that "
                   "--parallel.auto reads, printed below)")  # fmt: skip
    return p


def resolve_model(name: str) -> Architecture:
    """The :class:`Architecture` of a planner preset, a Llama preset or a loomtrain config TOML (its
    vocabulary from ``model.vocab_size``, or the char tokenizer's corpus: ``planner.auto.vocab_size``).

    Raises:
        ValueError: none of these; the message lists the presets.
        ConfigError: an invalid config file.
    """
    if name in ARCH_PRESETS:
        return ARCH_PRESETS[name]
    from loomtrain.models.presets import PRESETS, preset_config

    if name in PRESETS:
        return from_model_config(preset_config(name), name)
    if Path(name).is_file():
        from loomtrain.config import load_config
        from loomtrain.planner.auto import vocab_size

        cfg = load_config(name)
        return from_model_config(cfg.model.model_copy(update={"vocab_size": vocab_size(cfg)}), Path(name).stem)
    known = ", ".join([*PRESETS, *ARCH_PRESETS])
    raise ValueError(f"--model={name!r}: not a file and not a preset; presets: {known}")


def resolve_training(name: str) -> tuple[Precision, int]:
    """``(element sizes, logging interval)`` ``--model`` is planned with, as ``--parallel.auto`` plans
    a config: a loomtrain config's ``training.dtype`` (the ZeRO-0 precision of
    :func:`~loomtrain.planner.memory.precision_for`) and ``training.log_interval``; a preset's bf16
    mixed precision with fp32 masters (``MIXED_ADAM``: the presets are planned for GPUs) and 0 (no
    trainer's logging priced). A fresh user's break test found an fp32 CPU config planned in bf16 by
    ``plan`` and in fp32 by ``--parallel.auto``, so the same layout had two prices."""
    if not Path(name).is_file() or name in ARCH_PRESETS:
        return MIXED_ADAM, 0
    from loomtrain.config import load_config

    training = load_config(name).training
    return precision_for(training.dtype, 0), training.log_interval


def _count(n: float) -> str:
    """``174.6B``, ``12.6M``, ``65.3K``: a parameter count at a readable scale."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def _row(rank: int, plan: Plan) -> str:
    lay, gib = plan.layout, plan.memory_bytes / 2**30
    dp = f"{lay.dp_replicate}×{lay.dp_shard}" if lay.dp_replicate > 1 else str(lay.dp)
    return (f"| {rank} | {dp} | {lay.zero_stage} | {lay.tp} | {'y' if lay.sequence_parallel else 'n'} | {lay.sp} | "
            f"{lay.pp} | {lay.virtual_stages} | {lay.micro_batch} | {lay.n_micro} | {lay.recompute} | {gib:.1f} | "
            f"{plan.step.total:.3f} | {plan.tokens_per_s:,.0f} | {100 * plan.mfu:.1f} |")  # fmt: skip


def report(result: SearchResult, spec: ClusterSpec, arch: Architecture, top: int, world: int | None = None) -> str:
    """The printed answer: the cluster, the top layouts as a Markdown table, the rejections by reason."""
    cluster = spec.to_cluster()
    lines = [f"{arch.name or 'model'} ({_count(arch.param_count())} parameters) on {spec.name}: "
             f"{world or spec.gpus} of {spec.gpus} × {cluster.device.name}, "
             f"{cluster.device.memory_bytes / 2**30:.0f} GiB each"
             + (" (heterogeneous: priced as its slowest, smallest parts)" if spec.heterogeneous else ""),
             f"{result.considered:,} layouts considered, {len(result.plans):,} fit; top {min(top, len(result.plans))} "
             "by predicted step time (predictions, not measurements):", "",
             "| # | dp | ZeRO | tp | SP | sp | pp | v | b | m | recompute | GiB/device | step s | tokens/s | MFU % |",
             "|" + " ---: |" * 4 + " --- |" + " ---: |" * 5 + " --- |" + " ---: |" * 4]  # fmt: skip
    lines += [_row(i + 1, plan) for i, plan in enumerate(result.plans[:top])]
    if result.rejected:
        lines += ["", "rejected:"] + [f"  {n:,} {REASONS[r]}" for r, n in sorted(result.rejected.items())]
    if not result.plans:
        lines.append(no_fit_advice(result))
    return "\n".join(lines)


def no_fit_advice(result: SearchResult) -> str:
    """What to change when no layout is left: memory advice only where memory refused layouts."""
    if result.rejected.get("memory"):
        return "no layout fits: add GPUs, lower --global-batch or --seq-len, or raise --memory-fraction"
    return (
        "no layout divides the work: give a --global-batch that is a multiple of dp for some dp dividing "
        "--gpus (e.g. a multiple of --gpus), a --seq-len that sp divides, or a --gpus that tp·sp·pp·dp can "
        "make (see the rejections above)"
    )


def cmd_plan(argv: list[str]) -> int:
    """Run ``loomtrain plan``; prints the report, or ``error: ...`` and returns 2 on bad input."""
    args = plan_parser().parse_args(argv)
    if args.calibrate:
        return _calibrate(args.ranks, args.out)
    bad = _bad_numbers(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return EXIT_USAGE
    names = ("model", "cluster", "global_batch")
    missing = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) is None]
    if missing:
        print(f"error: give {', '.join(missing)} (or --calibrate to measure this machine)", file=sys.stderr)
        return EXIT_USAGE
    try:
        arch = resolve_model(args.model)
        spec = load_cluster_spec(args.cluster)
        precision, log_interval = resolve_training(args.model)
        result = search(arch, spec.to_cluster(), args.global_batch, seq_len=args.seq_len, world=args.gpus,
                        precision=precision, memory_fraction=args.memory_fraction,
                        log_interval=log_interval)  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(report(result, spec, arch, args.top, args.gpus))
    return 0 if result.plans else 1


def _bad_numbers(args: argparse.Namespace) -> str:
    """Why a numeric flag is out of range (empty: all fit)."""
    for flag, value in (("--top", args.top), ("--gpus", args.gpus), ("--seq-len", args.seq_len),
                        ("--global-batch", args.global_batch)):  # fmt: skip
        if value is not None and value < 1:
            return f"{flag}={value} must be at least 1"
    if not 0 < args.memory_fraction <= 1:
        return f"--memory-fraction={args.memory_fraction} must be in (0, 1]: the share of device memory to fill"
    return ""


def _out_problem(path: Path) -> str:
    """Why ``path`` cannot receive the spec (empty: it can), checked before measuring."""
    if path.is_dir():
        return "is a directory; give a file name"
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"{parent} is not a directory"
    if parent is not None and not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    try:  # a real file: access() passes for root where the filesystem refuses files (/proc)
        with tempfile.NamedTemporaryFile(dir=parent or Path.cwd(), prefix=".loomtrain-probe-"):
            pass
    except OSError as err:
        return f"cannot create a file in {parent}: {err.strerror}"
    return ""


def _calibrate(ranks: int, out: str | None) -> int:
    """Measure ``ranks`` processes on this machine, write the spec to ``out`` (default: the cache
    :func:`~loomtrain.planner.calibrate.local_spec` reads, unless the measurement was disturbed)
    and print it."""
    from loomtrain.planner.calibrate import DISTURBED_MARK, cache_spec, cached_spec_path, calibrate, write_spec

    path = Path(out) if out else cached_spec_path(ranks)
    problem = _out_problem(path)
    if problem:
        print(f"error: --out={path}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        text = calibrate(ranks)
        if out:
            write_spec(path, text)
        written = bool(out) or cache_spec(ranks, text)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    if text.startswith(DISTURBED_MARK):
        print(f"warning: {text.splitlines()[0].removeprefix(DISTURBED_MARK).strip()}", file=sys.stderr)
    if written:
        print(f"wrote {path}; use it with: loomtrain plan --cluster {path} --model ... --global-batch ...")
    else:
        print("not cached (disturbed): measure again on a quiet machine, or keep it with --out FILE")
    return 0
