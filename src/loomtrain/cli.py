"""Command line: ``loomtrain train | generate | report | export | cluster | bench``.

    loomtrain train --config configs/shakespeare_char.toml --nproc 2 [--section.key=value ...]
    torchrun --nproc-per-node 8 -m loomtrain.cli train --config configs/x.toml
    loomtrain cluster up --hosts 2 --procs-per-host 2 --inter-rate 100mbit   (root; see docs/cluster.md)
    loomtrain train --cluster --config configs/shakespeare_char.toml [--elastic --min-nodes 1]
    loomtrain bench collectives [--cluster | --nproc 4] [--max-bytes 64MB]
    loomtrain generate --run runs/shakespeare_char --prompt "ROMEO:" --max-new-tokens 300
    loomtrain report runs/a [runs/b ...] [--out DIR] [--step 100]
    loomtrain export --run runs/shakespeare_char [--step N] --to hf --out hf/shakespeare_char

Every check that can fail on user input runs here, before any process is launched or any
file written; a failure prints one ``error:`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from loomtrain.cluster.cli import cluster_parser, cmd_cluster
from loomtrain.config import Config, ConfigError, load_config
from loomtrain.distributed.parallel_dims import launch_env
from loomtrain.federated.cli import cmd_fl, fl_parser
from loomtrain.interop.hf import resolve_init_from
from loomtrain.launch import ElasticSpec, die_with_parent, launch
from loomtrain.planner.auto import asks_for_auto, auto_cluster, check_explicit, choose_layout, describe, file_fields
from loomtrain.planner.cli import cmd_plan, plan_parser
from loomtrain.preflight import check_launch, check_world, warn_if_oversubscribed
from loomtrain.run_dir import apply_overwrite

EXIT_USAGE = 2


def _inside_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain train",
        description="Train a model. Any config field can be overridden as --section.key=value.",
    )
    p.add_argument("--config", help="TOML config file (defaults are used without one)")
    p.add_argument("--nproc", type=int, default=1, help="local processes to launch through torchrun (default 1)")
    p.add_argument("--resume", help="'auto' (newest complete checkpoint), 'never', or a checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run directory of the same name")
    p.add_argument("--elastic", action="store_true", help="restart failed workers and resume from checkpoints")
    p.add_argument("--max-restarts", type=int, default=3, help="with --elastic: restarts allowed (default 3)")
    p.add_argument("--min-nproc", type=int, help="with --elastic: smallest world size to go on with")
    p.add_argument("--max-nproc", type=int, help="with --elastic: largest world size to grow to")
    p.add_argument("--cluster", nargs="?", const="loom", metavar="NAME",
                   help="run on the emulated cluster NAME (default 'loom', see `loomtrain cluster up`): one torchrun "
                        "agent per host, its procs-per-host workers each")  # fmt: skip
    p.add_argument("--min-nodes", type=int, help="with --cluster --elastic: fewest hosts to go on with")
    return p


def _parse_train_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], Config]:
    args, rest = _train_parser().parse_known_args(argv)
    unknown = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if unknown:
        raise ConfigError(f"unrecognised argument {unknown[0]!r}; config overrides look like --section.key=value")
    overrides = list(rest)
    if args.resume is not None:
        overrides.append(f"--checkpoint.resume={args.resume}")
    if args.overwrite:
        overrides.append("--run.overwrite=true")
    if asks_for_auto(rest):
        check_explicit(rest)
    cfg = load_config(args.config, overrides)
    if cfg.parallel.auto:  # also set by the config file
        check_explicit(rest)
    # Before resolve_init_from, whose re-validated full dump marks every field as given.
    args.replaced = file_fields(cfg) if cfg.parallel.auto else []
    return args, overrides, resolve_init_from(cfg)


def _elastic_spec(args: argparse.Namespace, cfg: Config) -> ElasticSpec | None:
    """The elastic bounds, checked: every world size in them must fit the batch and degrees.

    Raises:
        ConfigError: bounds out of order, elastic flags without --elastic, or a world size in
            the range that the config cannot run on.
    """
    if not args.elastic:
        if args.min_nproc is not None or args.max_nproc is not None:
            raise ConfigError("--min-nproc/--max-nproc need --elastic")
        return None
    lo = args.nproc if args.min_nproc is None else args.min_nproc
    hi = args.nproc if args.max_nproc is None else args.max_nproc
    if not 1 <= lo <= args.nproc <= hi:
        raise ConfigError(f"need 1 <= --min-nproc={lo} <= --nproc={args.nproc} <= --max-nproc={hi}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts} must be at least 0")
    if cfg.checkpoint.resume not in ("never", "auto"):
        raise ConfigError("--elastic resumes from the newest checkpoint by itself; drop --resume <dir>")
    for world in range(lo, hi + 1):
        check_world(cfg, world)
    return ElasticSpec(lo, hi, args.max_restarts)


def cmd_train(argv: list[str]) -> int:
    args, overrides, cfg = _parse_train_args(argv)
    if _inside_launcher():
        if cfg.parallel.auto:
            raise ConfigError("parallel.auto=true plans in the `loomtrain train` launcher, not in torchrun's "
                              "workers; launch with `loomtrain train --nproc N`, or print the layout with "
                              "`loomtrain plan` and set it")  # fmt: skip
        die_with_parent()
        return _run_worker(cfg)
    if args.cluster is not None:
        return _train_on_cluster(args, overrides, cfg)
    if args.min_nodes is not None:
        raise ConfigError("--min-nodes counts hosts of an emulated cluster; use it with --cluster")
    if cfg.distributed.rendezvous != "c10d":
        raise ConfigError("--distributed.rendezvous=etcd runs one etcd member per host of an emulated cluster; "
                          "use it with --cluster, or drop it")  # fmt: skip
    if cfg.parallel.auto:
        overrides, cfg = _auto_layout(args, overrides, cfg, args.nproc)
    check_launch(cfg, args.nproc)
    warn_if_oversubscribed(args.nproc)
    elastic = _elastic_spec(args, cfg)
    if args.nproc == 1 and elastic is None:
        return _run_worker(cfg)
    return launch(args.nproc, _worker_argv(args, overrides, cfg, elastic), elastic, cfg.run_dir,
                  f"loomtrain-{cfg.run.name}")  # fmt: skip


def _auto_layout(args: argparse.Namespace, overrides: list[str], cfg: Config, world: int) -> tuple[list[str], Config]:
    """``parallel.auto=true`` in the launcher: the planner's layout for ``world`` processes, printed;
    returns the overrides with the choice's appended (so the workers run it without planning) and
    the config that runs it.

    Raises:
        ConfigError: elastic bounds that allow another world size, or what :func:`choose_layout` raises.
    """
    if args.elastic and any(n not in (None, args.nproc) for n in (args.min_nproc, args.max_nproc)):
        raise ConfigError("parallel.auto=true plans for one world size; with --elastic drop --min-nproc/--max-nproc, "
                          "or drop parallel.auto")  # fmt: skip
    choice = choose_layout(cfg, world, auto_cluster(cfg, world))
    print(describe(choice), flush=True)
    if args.replaced:
        print(f"  the plan replaces the config file's {', '.join(args.replaced)}", flush=True)
    return overrides + choice.overrides, choice.config


def _worker_argv(args: argparse.Namespace, overrides: list[str], cfg: Config, elastic: ElasticSpec | None) -> list[str]:
    config_args = [] if args.config is None else ["--config", args.config]
    # The launcher applies --overwrite once, before it opens its debug logs in the run directory:
    # neither a worker nor a restart deletes the run.
    apply_overwrite(cfg)
    overrides = [o for o in overrides if not o.startswith("--run.overwrite=")] + ["--run.overwrite=false"]
    if elastic is not None:
        # Every attempt, the first included, resumes from whatever checkpoint exists.
        overrides = [o for o in overrides if not o.startswith("--checkpoint.resume=")]
        overrides.append("--checkpoint.resume=auto")
    return config_args + overrides


def _cluster_elastic_spec(args: argparse.Namespace, cfg: Config, hosts: int, nproc: int) -> ElasticSpec | None:
    """Elastic bounds in hosts for a cluster launch; every world size they allow is checked.

    Raises:
        ConfigError: --min-nodes out of 1..hosts, or without --elastic; a world size the config
            cannot run on.
    """
    if not args.elastic:
        if args.min_nodes is not None:
            raise ConfigError("--min-nodes needs --elastic")
        return None
    lo = hosts if args.min_nodes is None else args.min_nodes
    if not 1 <= lo <= hosts:
        raise ConfigError(f"--min-nodes={lo} must be between 1 and the cluster's {hosts} hosts")
    if cfg.checkpoint.resume not in ("never", "auto"):
        raise ConfigError("--elastic resumes from the newest checkpoint by itself; drop --resume <dir>")
    for nodes in range(lo, hosts + 1):
        check_world(cfg, nodes * nproc)
    return ElasticSpec(lo, hosts, args.max_restarts)


def _train_on_cluster(args: argparse.Namespace, overrides: list[str], cfg: Config) -> int:
    """``--cluster``: one torchrun agent per emulated host (see ``launch.cluster_commands``)."""
    from loomtrain.cluster.emulated import load_cluster
    from loomtrain.launch import launch_cluster

    if args.min_nproc is not None or args.max_nproc is not None:
        raise ConfigError("--min-nproc/--max-nproc are for one machine; with --cluster use --min-nodes")
    cluster = load_cluster(args.cluster)
    hosts, nproc = cluster.spec.hosts, cluster.spec.procs_per_host
    if args.nproc not in (1, nproc):
        raise ConfigError(f"--nproc={args.nproc} differs from cluster '{args.cluster}''s {nproc} procs per host; "
                          "drop --nproc (the cluster sets it)")  # fmt: skip
    if cfg.parallel.auto:
        if not cfg.parallel.auto_cluster:
            raise ConfigError("parallel.auto=true with --cluster needs parallel.auto_cluster, a spec of the emulated "
                              "cluster's hosts and links (configs/clusters/*.toml format): this machine's measured "
                              "spec does not see the emulated links")  # fmt: skip
        if args.min_nodes not in (None, hosts):
            raise ConfigError("parallel.auto=true plans for one world size; drop --min-nodes, or drop parallel.auto")
        overrides, cfg = _auto_layout(args, overrides, cfg, hosts * nproc)
    check_launch(cfg, hosts * nproc)
    elastic = _cluster_elastic_spec(args, cfg, hosts, nproc)
    worker = ["-m", "loomtrain.cli", "train", *_worker_argv(args, overrides, cfg, elastic)]
    run_id = f"loomtrain-{cfg.run.name}"
    return launch_cluster(cluster, worker, elastic, cfg.run_dir, run_id, cfg.distributed.rendezvous)


def _run_worker(cfg: Config) -> int:
    import torch.distributed as dist

    from loomtrain.emulated_run import run_emulated
    from loomtrain.trainer import train

    rank = launch_env().rank
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        run_emulated(cfg) if cfg.simulate.device else train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loomtrain generate", description="Sample text from a run's latest checkpoint.")
    p.add_argument("--run", required=True, help="run directory, e.g. runs/shakespeare_char")
    p.add_argument("--prompt", default="\n", help="text to continue (every character must be in the vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=300, help="tokens to sample after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; lower is more deterministic")
    p.add_argument("--top-k", type=int, default=200, help="sample only among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same sample")
    return p


def cmd_generate(argv: list[str]) -> int:
    args = _generate_parser().parse_args(argv)
    if not args.prompt:
        raise ConfigError("--prompt is empty; give at least one character, e.g. --prompt 'ROMEO:'")
    for name, value, low in (("--max-new-tokens", args.max_new_tokens, 0), ("--top-k", args.top_k, 1)):
        if value < low:
            raise ConfigError(f"{name}={value} must be at least {low}")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature={args.temperature} must be positive (lower is more deterministic)")
    from loomtrain.generation import generate_from_run

    print(generate_from_run(args.run, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain report",
        description="Draw runs' loss, tokens/s, MFU, memory and bytes per step, several runs on one figure, to "
        "report.png and a self-contained report.html; a pipelined run's timeline also goes to trace.json (Perfetto) "
        "and timeline.png in its own directory.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="run_dir", help="run directories, e.g. runs/a runs/b")
    p.add_argument("--out", help="directory for report.png and report.html (default: the first run's directory)")
    p.add_argument("--step", type=int, help="pipeline timeline step to show (default: the last one recorded)")
    return p


def cmd_report(argv: list[str]) -> int:
    args = _report_parser().parse_args(argv)
    from loomtrain.run_report import write_reports

    try:
        files = write_reports(args.run_dirs, args.out, args.step)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from e
    for _, paths, bubble in files.timelines:
        print(f"trace: {paths['trace']} (open at https://ui.perfetto.dev)")
        print(f"gantt: {paths['gantt']}")
        print(bubble)
    if files.page is not None:
        print(f"figure: {files.figure}")
        print(f"page: {files.page}")
    return 0


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain bench collectives",
        description="Time all-reduce, reduce-scatter, all-gather and all-to-all, flat and hierarchical: algbw, busbw "
        "(nccl-tests definitions) and the fraction of the slowest link's rate. Other options go to the benchmark: "
        "--ops, --min-bytes, --max-bytes, --modes, --iters, --link-rate, --json.",
    )
    p.add_argument("what", choices=["collectives"], help="what to benchmark")
    p.add_argument("--nproc", type=int, default=2, help="local processes (without --cluster; default 2)")
    p.add_argument("--cluster", nargs="?", const="loom", metavar="NAME", help="run on emulated cluster NAME")
    return p


def cmd_bench(argv: list[str]) -> int:
    args, rest = _bench_parser().parse_known_args(argv)
    if _inside_launcher():
        from loomtrain.collective_bench import main_worker

        main_worker(rest)
        return 0
    from loomtrain.launch import launch_cluster, run_agents

    worker = ["-m", "loomtrain.cli", "bench", args.what, *rest]
    if args.cluster is not None:
        from loomtrain.cluster.emulated import load_cluster

        return launch_cluster(load_cluster(args.cluster), worker, None, None, "loomtrain-bench")
    if args.nproc < 2:
        raise ConfigError(f"--nproc={args.nproc}: a collective benchmark needs at least 2 processes")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", *worker]
    return run_agents([cmd], {**os.environ, "OMP_NUM_THREADS": "1"}, None)


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loomtrain export",
        description="Write a run's checkpoint (any parallel layout) as a Hugging Face Llama directory: config.json, "
        "model.safetensors and the tokenizer, loaded by transformers' AutoModelForCausalLM and AutoTokenizer.",
    )
    p.add_argument("--run", required=True, help="run directory, e.g. runs/shakespeare_char")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the newest complete checkpoint)")
    p.add_argument("--to", required=True, choices=["hf"], help="format: 'hf' (Hugging Face transformers)")
    p.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")
    return p


def cmd_export(argv: list[str]) -> int:
    args = _export_parser().parse_args(argv)
    from loomtrain.interop.hf import export_hf

    checkpoint = export_hf(args.run, args.out, args.step)
    print(f"exported {checkpoint} to {args.out}; load it with transformers.AutoModelForCausalLM.from_pretrained("
          f"{args.out!r}) and AutoTokenizer.from_pretrained({args.out!r})")  # fmt: skip
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "report": cmd_report, "cluster": cmd_cluster,
            "bench": cmd_bench, "export": cmd_export, "plan": cmd_plan,
            "fl": cmd_fl}  # fmt: skip
# Each command's argument parser, for its --help and the generated reference (docs/configuration.md).
PARSERS = {"train": _train_parser, "generate": _generate_parser, "report": _report_parser, "cluster": cluster_parser,
           "bench": _bench_parser, "export": _export_parser, "plan": plan_parser,
           "fl": fl_parser}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: loomtrain {{{','.join(COMMANDS)}}} ... (try: loomtrain train --help)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
