"""``loomtrain fl``: federated training on Flower (docs/federated.md).

Usage::

    loomtrain fl keys --clients 10 --out keys/
    loomtrain fl run --clients 10 --rounds 20 --secure ckks|mask|none [--task tabular|text] [--keys keys/]
    loomtrain fl plot runs/fl_none runs/fl_ckks --out fl.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from loomtrain.federated.compress import METHODS
from loomtrain.federated.settings import SECURE, STRATEGIES, FLSettings

EXIT_USAGE, EXIT_FAILED = 2, 1


def _run_flags(p: argparse.ArgumentParser) -> None:
    d = FLSettings()
    p.add_argument("--clients", type=int, default=d.clients, help="number of clients (sites)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="federated rounds")
    p.add_argument("--secure", choices=SECURE, default=d.secure, help="secure aggregation: CKKS, pairwise masks, none")
    p.add_argument("--task", choices=["tabular", "text"], default=d.task, help="demo task (offline data)")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy, help="aggregation rule")
    p.add_argument("--fraction", type=float, default=d.fraction, help="fraction of clients sampled per round")
    p.add_argument("--out", default=d.out, help="run directory: state checkpoint, metrics.jsonl, plot")
    p.add_argument("--keys", default="", help="CKKS key directory from `fl keys` (default: written into OUT/keys)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's round checkpoint")
    p.add_argument("--deployment", action="store_true",
                   help="real processes: a Flower SuperLink and one SuperNode per client on localhost")  # fmt: skip
    p.add_argument("--cluster", default="", metavar="NAME",
                   help="with --deployment: run the SuperLink and SuperNodes on the hosts of emulated cluster NAME "
                   "(loomtrain cluster up; docs/cluster.md) instead of localhost")  # fmt: skip
    p.add_argument("--local-steps", type=int, default=0, help="optimiser steps per client per round (0: task default)")
    p.add_argument("--batch-size", type=int, default=0, help="local batch size (0: task default)")
    p.add_argument("--local-procs", type=int, default=1,
                   help="processes each client trains on, with loomtrain data parallelism over gloo")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.0, help="local learning rate (0: task default)")
    p.add_argument("--mu", dest="proximal_mu", type=float, default=d.proximal_mu, help="FedProx proximal weight μ")
    p.add_argument("--server-lr", type=float, default=d.server_lr, help="FedAdam server learning rate η")
    p.add_argument("--compress", choices=METHODS, default=d.compress, help="update compression (--secure none)")
    p.add_argument("--topk-ratio", type=float, default=d.topk_ratio, help="fraction of values kept by topk")
    p.add_argument("--dp-clip", type=float, default=0.0, help="client-side DP: L2 clipping norm of the update")
    p.add_argument("--dp-noise", type=float, default=0.0, help="client-side DP: Gaussian noise multiplier z")
    p.add_argument("--dp-delta", type=float, default=d.dp_delta, help="client-side DP: δ of the ε reported per round")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split, the model and the sampling")
    p.add_argument("--drop", action="append", default=[], metavar="CLIENT@ROUND:STAGE",
                   help="fault injection: that client disconnects at that stage (fit, mask_input, ...)")  # fmt: skip
    p.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                   help="seconds to wait for a stage's replies before dropping the silent clients")  # fmt: skip


def fl_parser() -> argparse.ArgumentParser:
    """The ``loomtrain fl`` parser: subcommands ``run``, ``keys``, ``plot``."""
    p = argparse.ArgumentParser(prog="loomtrain fl", description="Federated learning on Flower with secure "
                                "aggregation (docs/federated.md).")  # fmt: skip
    actions = ("run: a federated run (`loomtrain fl run --help` lists its flags); keys: write CKKS key material; "
               "plot: accuracy vs round and bytes vs method of run directories")  # fmt: skip
    sub = p.add_subparsers(dest="action", required=True, metavar="{run,keys,plot}", help=actions)
    _run_flags(sub.add_parser("run", help="a federated run in Flower's simulation"))
    keys = sub.add_parser("keys", help="write CKKS key material: client_<i>.ctx (secret) and server.ctx (public)")
    keys.add_argument("--clients", type=int, required=True, help="number of clients")
    keys.add_argument("--out", required=True, help="directory to write; hand client_<i>.ctx to client i only")
    plot = sub.add_parser("plot", help="accuracy vs round and bytes vs method of some run directories")
    plot.add_argument("runs", nargs="+", help="run directories")
    plot.add_argument("--out", required=True, help="PNG file to write")
    return p


def cmd_fl(argv: list[str]) -> int:
    """Run ``loomtrain fl ...``: 0 on success, 2 on bad flags, 1 when the run fails (the error names the client)."""
    args = fl_parser().parse_args(argv)
    try:
        return {"run": _cmd_run, "keys": _cmd_keys, "plot": _cmd_plot}[args.action](args)
    except ValueError as e:
        from loomtrain.federated.wire import FederatedError

        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED if isinstance(e, FederatedError) else EXIT_USAGE


def _cmd_run(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(FLSettings)}
    settings = FLSettings(**{k: v for k, v in vars(args).items() if k in names}).validate()
    if args.cluster and not args.deployment:
        raise ValueError(f"--cluster {args.cluster}: emulated hosts run real processes; add --deployment")
    # Flower's simulation imports Ray (seconds): only after the flags are known to be good.
    from loomtrain.federated.run import evaluate_params, final_params, plot, prepare, simulate

    if args.deployment:
        from loomtrain.cluster.emulated import load_cluster
        from loomtrain.federated.deploy import run_deployment

        cluster = load_cluster(args.cluster) if args.cluster else None  # refused before anything starts if not up
        run_deployment(prepare(settings), cluster)
    else:
        simulate([settings])
    ev = evaluate_params(settings, final_params(settings))
    png = plot({settings.secure: settings.out}, Path(settings.out) / "federated.png")
    print(json.dumps({"out": settings.out, "test_loss": ev.loss, "test_accuracy": ev.accuracy, "plot": str(png)}))
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from loomtrain.federated.secure import ckks

    if args.clients < 1:
        raise ValueError(f"--clients {args.clients}: need at least 1")
    ckks.write_keys(Path(args.out), args.clients)
    print(f"wrote {args.out}/client_0..{args.clients - 1}.ctx (secret: one per client) and {args.out}/server.ctx")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from loomtrain.federated.run import plot

    print(plot({Path(r).name: r for r in args.runs}, args.out))
    return 0
