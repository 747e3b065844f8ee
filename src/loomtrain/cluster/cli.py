"""``loomtrain cluster up | down | status | run``: an emulated multi-host cluster on this machine.

::

    sudo loomtrain cluster up --hosts 4 --procs-per-host 2 --inter-rate 1gbit
    sudo loomtrain cluster run 0 -- python -c "import socket; print(socket.gethostname())"
    sudo loomtrain cluster status
    sudo loomtrain cluster down

See ``loomtrain.cluster.emulated`` for what is made and ``docs/cluster.md`` for measured rates.
"""

from __future__ import annotations

import argparse
import subprocess

from loomtrain.cluster.emulated import (
    Cluster,
    ClusterError,
    ClusterSpec,
    cluster_down,
    cluster_up,
    load_cluster,
    rate_bytes_per_s,
)


def cluster_parser() -> argparse.ArgumentParser:
    """The ``loomtrain cluster`` parser: subcommands ``up``, ``down``, ``status``, ``run``."""
    p = argparse.ArgumentParser(
        prog="loomtrain cluster",
        description="An emulated multi-host cluster on this machine: network namespaces joined by a bridge, "
        "links shaped with tc (needs root).",
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="{up,down,status,run}")
    up = sub.add_parser("up", help="make the hosts, links and state file")
    up.add_argument("--hosts", type=int, required=True, help="number of emulated hosts (1..254)")
    up.add_argument("--procs-per-host", type=int, required=True, help="processes a launcher starts on each host")
    up.add_argument("--inter-rate", default="100mbit",
                    help="each host's link rate, each way (tc units: 100mbit, 1gbit, 12mbps = bytes/s)")  # fmt: skip
    up.add_argument("--intra-rate", help="shape each host's loopback (traffic between its own processes) to this rate")
    up.add_argument("--inter-delay", help="one-way delay between hosts, e.g. 2ms (needs the kernel's netem qdisc)")
    down = sub.add_parser("down", help="stop a cluster's processes and remove it")
    status = sub.add_parser("status", help="hosts, addresses, link byte counters")
    run = sub.add_parser("run", help="run a command inside a host: loomtrain cluster run HOST -- CMD ...")
    run.add_argument("host", type=int, metavar="HOST", help="host index, 0..hosts-1")
    for cmd in (up, down, status, run):
        cmd.add_argument("--name", default="loom", help="cluster name, 1-8 of [a-z0-9] (default loom)")
    return p


def cmd_cluster(argv: list[str]) -> int:
    """Run ``loomtrain cluster ...``; the exit status (``run``: the command's).

    Raises:
        ConfigError (``ClusterError``): bad flags, not root, no such cluster, ``up`` twice.
    """
    head, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = cluster_parser().parse_args(head)
    if args.action == "run":
        if not command:
            raise ClusterError("run needs the command after --, e.g. loomtrain cluster run 0 -- hostname")
        return _run(load_cluster(args.name), args.host, command)
    if command:
        raise ClusterError(f"`-- {' '.join(command)}` only goes with run, e.g. loomtrain cluster run 0 -- CMD")
    if args.action == "up":
        spec = ClusterSpec(args.hosts, args.procs_per_host, args.inter_rate, args.intra_rate, args.inter_delay,
                           args.name)  # fmt: skip
        _print_cluster(cluster_up(spec), counters=False)
    elif args.action == "down":
        removed = cluster_down(args.name)
        print(f"removed {', '.join(removed)}" if removed else f"cluster {args.name!r} was not up; nothing to remove")
    else:
        _print_cluster(load_cluster(args.name), counters=True)
    return 0


def _run(cluster: Cluster, host: int, command: list[str]) -> int:
    """``command`` inside ``host``; its exit status (128 + N when killed by signal N, as shells say)."""
    code = subprocess.call(cluster.exec_argv(host, command))
    return 128 - code if code < 0 else code


def _print_cluster(c: Cluster, counters: bool) -> None:
    """The cluster as ``up`` and ``status`` print it; ``counters`` adds bytes sent each way per link."""
    s = c.spec
    delay = f", delay {s.inter_delay} one way" if s.inter_delay else ""
    intra = f"{s.intra_rate} (tbf on lo)" if s.intra_rate else "unshaped (loopback)"
    print(f"cluster {s.name!r}: {s.hosts} host(s) x {s.procs_per_host} procs, subnet 198.18.{c.subnet}.0/24, "
          f"switch namespace {c.switch_ns}, state {c.state_path}")  # fmt: skip
    print(f"  inter-host: {s.inter_rate} each way per host ({rate_bytes_per_s(s.inter_rate) / 1e6:g} MB/s, "
          f"tbf){delay}; intra-host: {intra}")  # fmt: skip
    for i in range(s.hosts):
        line = f"  host {i}: {c.netns(i)}  {c.address(i)}  dev {c.interface}"
        if counters:
            sent, received = c.link_bytes(i)
            line += f"  sent {sent / 1e6:.3f} MB  received {received / 1e6:.3f} MB  procs {len(c.host_pids(i))}"
        print(line)
    if not counters:
        print(f"run on a host: loomtrain cluster run 0 --name {s.name} -- CMD (sets GLOO_SOCKET_IFNAME={c.interface})")
