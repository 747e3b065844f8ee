"""Collective benchmark: flat, hierarchical and ``auto`` collectives over message sizes.

Run on every rank of a job (``torchrun --nproc-per-node=... -m loomtrain.collective_bench``
or the ``loomtrain bench collectives`` command): for each op and message size ``S``, every mode
is warmed up once, then the modes are timed in turn, repeat after repeat; rank 0 prints a table
and writes the rows as JSON. ``auto`` runs the collective of the path it chose.

Each repeat starts after a barrier, its time is the slowest rank's, and a point's time is the
median over repeats (robust to other load on the hosts). Bandwidths are nccl-tests'
(``doc/PERFORMANCE.md``): ``algbw = S / t``; ``busbw`` = ``algbw·2(n−1)/n`` for all-reduce and ``algbw·(n−1)/n`` for
reduce-scatter, all-gather and all-to-all, which is what each rank's link carries in the ring
(or pairwise) algorithm, so it compares with the link's rate: ``link_fraction = busbw / rate``
(the configured rate when given, else the slowest measured inter-host bandwidth). ``S`` is the
whole buffer: the input of reduce-scatter, the output of all-gather, each rank's input of
all-to-all. A hierarchical collective moves fewer bytes across hosts, so its ``busbw`` may
exceed the link's rate.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.cluster.emulated import qdisc_sent_bytes, rate_bytes_per_s
from loomtrain.distributed.collectives import (
    FLAT,
    HIERARCHICAL,
    OPS,
    CostModel,
    HostGroups,
    calibrated_choice,
    hierarchical_all_gather,
    hierarchical_all_reduce,
    hierarchical_all_to_all,
    hierarchical_reduce_scatter,
    measure_winners,
    new_host_groups,
)
from loomtrain.distributed.topology import Topology, discover_topology

MODES = (FLAT, HIERARCHICAL, "auto")
KIB, MIB = 2**10, 2**20


def message_sizes(min_bytes: int = KIB, max_bytes: int = 256 * MIB, factor: int = 4) -> list[int]:
    """``min_bytes, min_bytes·factor, ...`` up to ``max_bytes`` (bytes).

    Raises:
        ValueError: ``min_bytes`` < 1, ``max_bytes`` < ``min_bytes`` or ``factor`` < 2.
    """
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' definitions)."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def flat_op(op: str, group: dist.ProcessGroup | None = None) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """``op`` of :data:`~loomtrain.distributed.collectives.OPS` over ``group`` (default: every rank) as a
    call ``(out, input)`` on the buffers of :func:`collective_buffers`."""
    return {
        "all_reduce": lambda out, t: dist.all_reduce(t, group=group),
        "reduce_scatter": lambda out, t: dist.reduce_scatter_single(out, t, group=group),
        "all_gather": lambda out, t: dist.all_gather_single(out, t, group=group),
        "all_to_all": lambda out, t: dist.all_to_all_single(out, t, group=group),
    }[op]


def _hierarchical_op(op: str, groups: HostGroups) -> Callable[[torch.Tensor, torch.Tensor], object]:
    return {
        "all_reduce": lambda out, t: hierarchical_all_reduce(t, groups),
        "reduce_scatter": lambda out, t: hierarchical_reduce_scatter(out, t, groups),
        "all_gather": lambda out, t: hierarchical_all_gather(out, t, groups),
        "all_to_all": lambda out, t: hierarchical_all_to_all(out, t, groups),
    }[op]


def collective_buffers(op: str, nbytes: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(out, input, S)``: fp32 zeros (sums stay finite over repeats), ``S`` rounded down to
    whole chunks of ``4·n`` bytes (at least one); all-reduce works in place (empty ``out``)."""
    chunk = max(1, nbytes // (4 * n))
    full, part = torch.zeros(n * chunk), torch.zeros(chunk)
    out = {"reduce_scatter": part, "all_gather": full, "all_to_all": torch.zeros(n * chunk)}.get(op, torch.empty(0))
    return out, part if op == "all_gather" else full, full.numel() * 4


def _time_modes(
    runs: dict[str, Callable[[], object]], min_iters: int, max_seconds: float, max_iters: int,
    link_counter: Callable[[], int] | None = None,
) -> dict[str, tuple[float, int, float | None]]:  # fmt: skip
    """Per mode: the median over repeats of the slowest rank's time of ``runs[mode]()``
    (seconds), the number of repeats, and (with ``link_counter``) the median over repeats of
    the busiest host link's bytes/s during the call. The modes are timed in turn within each
    repeat, so that load which drifts during the run (other jobs on the host) falls on all of
    them alike. One warm-up call each; repeats go on until ``min_iters`` are done and took
    ``max_seconds`` per mode, or ``max_iters`` are done (decided on the all-reduced times, so
    every rank stops together)."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    link: dict[str, list[float]] = {mode: [] for mode in runs}
    done = 0
    while done < max_iters and (done < min_iters or sum(map(sum, times.values())) < max_seconds * len(runs)):
        for mode, run in runs.items():
            elapsed, sent = _timed(run, link_counter)
            times[mode].append(elapsed)
            link[mode].append(sent / elapsed)
        done += 1
    return {
        mode: (statistics.median(t), done, statistics.median(link[mode]) if link_counter else None)
        for mode, t in times.items()
    }


def _timed(run: Callable[[], object], link_counter: Callable[[], int] | None) -> tuple[float, float]:
    """The slowest rank's seconds for ``run()`` and the most bytes any host link sent meanwhile
    (0 without a counter). The counter is read outside the timed span (it starts a process)."""
    before = link_counter() if link_counter else 0
    dist.barrier()
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    sent = (link_counter() - before) if link_counter else 0
    result = torch.tensor([elapsed, float(sent)], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return result[0].item(), result[1].item()


def host_link_counter(topology: Topology, device: str) -> Callable[[], int]:
    """A counter of the bytes this rank's host sent on ``device`` (its tc root qdisc), read by
    the first rank of each host; the other ranks read 0, so a MAX over ranks is the busiest
    host link. For emulated hosts (``loomtrain.cluster``), where each host is a namespace."""
    first = dist.get_rank() == topology.hosts[topology.host_of(dist.get_rank())][0]
    return (lambda: qdisc_sent_bytes(device)) if first else (lambda: 0)


def _paths(topology: Topology, groups: HostGroups | None, margin: float) -> Callable[[str, str, int], str]:
    """``path(mode, op, nbytes)``: the path a mode runs. ``auto`` decides as the training hook
    does: all-reduce by :func:`calibrated_choice` (timed here, at start), the other ops by the
    cost model; flat without a model. A collective (the calibration)."""
    try:
        model = CostModel.from_topology(topology)
    except ValueError:
        model = None
    winners = measure_winners(groups, dist.group.WORLD) if model is not None and groups is not None else {}

    def path(mode: str, op: str, nbytes: int) -> str:
        if mode != "auto" or model is None:
            return mode if mode != "auto" else FLAT
        if op == "all_reduce":
            return calibrated_choice(nbytes, winners, model, margin)
        return model.choice(op, nbytes, margin)

    return path


def run_collective_bench(
    topology: Topology,
    ops: Sequence[str] = OPS,
    sizes: Sequence[int] | None = None,
    modes: Sequence[str] = MODES,
    min_iters: int = 3,
    max_seconds_per_point: float = 1.0,
    link_rate_bytes_per_s: float | None = None,
    max_iters: int = 200,
    margin: float = 0.1,
    link_counter: Callable[[], int] | None = None,
) -> list[dict]:
    """Time each op × size × mode on the default process group (CPU tensors: gloo).

    A collective: every rank calls it with the same arguments. ``topology`` must cover the
    world (``discover_topology()``); ``hierarchical`` needs hosts of equal size.

    Args:
        ops: among ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``.
        sizes: message sizes ``S`` in bytes (default :func:`message_sizes`, 1 KiB to 256 MiB).
        modes: among ``flat``, ``hierarchical``, ``auto`` (the cost model's choice per point).
        min_iters, max_seconds_per_point, max_iters: timed repeats per point (see
            :func:`_time_modes`; the modes of a point are timed interleaved).
        link_rate_bytes_per_s: the inter-host link's configured rate, for ``link_fraction``
            (preferred over the measured bandwidth).
        margin: ``auto``'s margin (:meth:`CostModel.choice`).
        link_counter: bytes sent by this rank's host link so far (:func:`host_link_counter`),
            for ``link_utilization``.
    Returns:
        One dict per point: ``op``, ``mode``, ``path`` (what ran), ``bytes``, ``seconds``,
        ``algbw`` and ``busbw`` (bytes/s), ``link_fraction`` (``None`` without a rate),
        ``link_utilization`` (bytes the busiest host link really sent / (seconds × rate), from
        its counters; ``None`` without a counter or rate), ``iters``, ``ranks``, ``hosts``.
    Raises:
        ValueError: an unknown op or mode, a topology of another world size, or
            ``hierarchical`` on hosts of unequal sizes.
    """
    _check(ops, modes, topology)
    n, sizes = dist.get_world_size(), message_sizes() if sizes is None else sizes
    groups = new_host_groups(topology.hosts) if topology.procs_per_host else None
    rate = link_rate_bytes_per_s or topology.inter_host_bandwidth()
    path_of = _paths(topology, groups, margin)
    rows = []
    for op in ops:
        for nbytes in sizes:
            out, t, actual = collective_buffers(op, nbytes, n)
            paths = {mode: path_of(mode, op, actual) for mode in modes}
            runs = {mode: partial(flat_op(op) if p == FLAT else _hierarchical_op(op, groups), out, t)
                    for mode, p in paths.items()}  # fmt: skip
            timed = _time_modes(runs, min_iters, max_seconds_per_point, max_iters, link_counter)
            for mode, (seconds, iters, link_rate) in timed.items():
                row = _row(op, mode, paths[mode], actual, seconds, iters, n, topology.num_hosts, rate)
                row["link_utilization"] = link_rate / rate if link_rate is not None and rate else None
                rows.append(row)
    return rows


def _check(ops: Sequence[str], modes: Sequence[str], topology: Topology) -> None:
    bad = [o for o in ops if o not in OPS] + [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown op or mode {bad}: ops are {OPS}, modes {MODES}")
    if topology.world_size != dist.get_world_size():
        raise ValueError(
            f"the topology has {topology.world_size} ranks, the process group {dist.get_world_size()}: "
            "discover it in this job (discover_topology())"
        )
    if HIERARCHICAL in modes and topology.procs_per_host is None:
        raise ValueError(
            f"mode 'hierarchical' needs the same number of ranks on every host; hosts are {topology.hosts}: "
            "run with --modes flat,auto"
        )


def _row(op, mode, path, nbytes, seconds, iters, n, hosts, rate) -> dict:
    algbw = nbytes / seconds
    busbw = algbw * bus_factor(op, n)
    return {
        "op": op, "mode": mode, "path": path, "bytes": nbytes, "seconds": seconds, "algbw": algbw,
        "busbw": busbw, "link_fraction": busbw / rate if rate else None, "iters": iters, "ranks": n, "hosts": hosts,
    }  # fmt: skip


def human_bytes(nbytes: float) -> str:
    """``nbytes`` with a binary prefix: ``1 KiB``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _human_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


_COLUMNS = (("op", "<15"), ("mode", "<14"), ("path", "<14"), ("size", ">10"), ("time", ">12"),
            ("algbw MB/s", ">13"), ("busbw MB/s", ">13"), ("busbw/link", ">11"), ("link busy", ">10"))  # fmt: skip


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width table; bandwidths in MB/s (10**6 bytes/s); ``busbw/link``:
    busbw in percent of the link's rate; ``link busy``: the busiest host link's measured bytes/s
    in percent of its rate (``link_utilization``)."""

    def line(cells: Sequence[str]) -> str:
        return "".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, _COLUMNS, strict=True))

    header = line([name for name, _ in _COLUMNS])
    lines = [header, "-" * len(header)]
    for r in rows:
        link = "n/a" if r["link_fraction"] is None else f"{100 * r['link_fraction']:.0f}%"
        busy = "n/a" if r.get("link_utilization") is None else f"{100 * r['link_utilization']:.0f}%"
        lines.append(line([r["op"], r["mode"], r["path"], human_bytes(r["bytes"]), _human_seconds(r["seconds"]),
                           f"{r['algbw'] / 1e6:.2f}", f"{r['busbw'] / 1e6:.2f}", link, busy]))  # fmt: skip
    return "\n".join(lines)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?", re.IGNORECASE)


def parse_bytes(text: str, flag: str) -> int:
    """``"64M"``, ``"64MiB"``, ``"1k"``, ``"4096"`` → bytes (binary prefixes).

    Raises:
        ValueError: not a size; the message names ``flag``.
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{flag}={text!r} is not a size; write e.g. 4096, 64K or 256M (binary prefixes)")
    return int(float(m.group(1)) * {"": 1, "k": KIB, "m": MIB, "g": 2**30}[m.group(2).lower()])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loomtrain bench collectives", description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, among {','.join(OPS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {','.join(MODES)}")
    p.add_argument("--min-bytes", default="1K", help="smallest message size (default 1K)")
    p.add_argument("--max-bytes", default="256M", help="largest message size (default 256M); sizes step by x4")
    p.add_argument("--iters", type=int, default=3, help="timed repeats per point, at least (default 3)")
    p.add_argument("--max-seconds", type=float, default=1.0, help="repeat a point until this long (default 1)")
    p.add_argument("--link-rate", help="the inter-host link's configured rate, as tc writes it (e.g. 100mbit)")
    p.add_argument("--probe-budget", type=float, default=3.0, help="seconds for measuring the links (default 3)")
    p.add_argument("--json", type=Path, help="write the rows here (rank 0)")
    p.add_argument("--link-device", help="read each host's bytes sent on this device from tc (emulated hosts: eth0)")
    return p


def main_worker(argv: Sequence[str] | None = None) -> list[dict]:
    """The benchmark on one rank of a torchrun job: parse ``argv``, join the process group
    from torchrun's environment (gloo; gloo itself honours ``GLOO_SOCKET_IFNAME``) unless
    already joined, discover the topology (with a link probe), run, print the table and write
    ``--json`` on rank 0.

    Returns:
        The rows (every rank).
    Raises:
        ValueError: a bad flag value (the message names the flag).
    """
    args = _parser().parse_args(argv)
    sizes = message_sizes(parse_bytes(args.min_bytes, "--min-bytes"), parse_bytes(args.max_bytes, "--max-bytes"))
    rate = None if args.link_rate is None else rate_bytes_per_s(args.link_rate, "--link-rate")
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo")
    try:
        topology = discover_topology(probe=True, probe_budget_s=args.probe_budget)
        counter = None if args.link_device is None else host_link_counter(topology, args.link_device)
        rows = run_collective_bench(topology, args.ops.split(","), sizes, args.modes.split(","), args.iters,
                                    args.max_seconds, rate, link_counter=counter)  # fmt: skip
        if dist.get_rank() == 0:
            print(topology.describe())
            print(format_table(rows))
            if args.json is not None:
                args.json.write_text(json.dumps({"topology": topology.to_dict(), "rows": rows}, indent=1) + "\n")
    finally:
        if joined:
            dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main_worker()
