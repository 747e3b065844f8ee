"""Which ranks share a host, and how fast the links between hosts are.

A :class:`Topology` is learned once at start (:func:`discover_topology`), identical on every
rank, logged, written to the run directory as ``topology.json`` and loadable offline
(:meth:`Topology.load`). Placement (``ParallelDims``) and the hierarchical collectives
(``collectives.py``) read it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import struct
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from loomtrain.config import ConfigError, ParallelConfig
from loomtrain.distributed.parallel_dims import MESH_AXES, Axis, ParallelDims


@dataclass(frozen=True)
class Topology:
    """Hosts and measured links of a job.

    Attributes:
        hosts: the global ranks on each host, ascending; hosts ordered by their lowest rank.
        host_keys: what identified each host (hostname, boot id, network-namespace inode).
        addresses: each host's address as its peers reach it (IP, or hostname when unknown).
        link_bandwidth: ``[i][j]``, bytes/s measured from host ``i``'s first rank to host
            ``j``'s; the diagonal ``[i][i]`` is rank-to-rank bandwidth inside host ``i``
            (``nan`` when it has one rank). ``None`` when not probed.
        link_latency: ``[i][j]``, seconds, one-way (half a measured round trip); same layout.
        gpu_p2p: ``[a][b]``, whether local GPU ``a`` can access GPU ``b`` directly (NVLink or
            PCIe peer-to-peer), as torch reports it; ``None`` without CUDA.
    """

    hosts: tuple[tuple[int, ...], ...]
    host_keys: tuple[str, ...]
    addresses: tuple[str, ...]
    link_bandwidth: tuple[tuple[float, ...], ...] | None = None
    link_latency: tuple[tuple[float, ...], ...] | None = None
    gpu_p2p: tuple[tuple[bool, ...], ...] | None = None

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def procs_per_host(self) -> int | None:
        """Ranks per host, or ``None`` when hosts hold different numbers of ranks."""
        sizes = {len(h) for h in self.hosts}
        return sizes.pop() if len(sizes) == 1 else None

    def host_of(self, rank: int) -> int:
        """Index of the host that runs global rank ``rank``.

        Raises:
            ValueError: ``rank`` is on no host of this topology.
        """
        for i, ranks in enumerate(self.hosts):
            if rank in ranks:
                return i
        raise ValueError(f"rank {rank} is not in the topology's hosts {self.hosts}")

    def inter_host_bandwidth(self) -> float | None:
        """The slowest measured host-to-host bandwidth, bytes/s (``None``: one host or not probed)."""
        return self._slowest(self.link_bandwidth, min)

    def inter_host_latency(self) -> float | None:
        """The largest measured host-to-host one-way latency, seconds (``None`` as above)."""
        return self._slowest(self.link_latency, max)

    def intra_host_bandwidth(self) -> float | None:
        """The slowest measured rank-to-rank bandwidth inside a host, bytes/s (``None``: no
        host has two ranks, or not probed)."""
        if self.link_bandwidth is None:
            return None
        values = [self.link_bandwidth[i][i] for i in range(self.num_hosts) if not math.isnan(self.link_bandwidth[i][i])]
        return min(values) if values else None

    def intra_host_latency(self) -> float | None:
        """The largest measured one-way latency inside a host, seconds (``None`` as above)."""
        if self.link_latency is None:
            return None
        values = [self.link_latency[i][i] for i in range(self.num_hosts) if not math.isnan(self.link_latency[i][i])]
        return max(values) if values else None

    def _slowest(self, matrix, pick) -> float | None:
        if matrix is None or self.num_hosts < 2:
            return None
        return pick(matrix[i][j] for i in range(self.num_hosts) for j in range(self.num_hosts) if i != j)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        def nested(m, kind):
            return None if m is None else tuple(tuple(kind(v) for v in row) for row in m)

        return cls(
            hosts=nested(d["hosts"], int),
            host_keys=tuple(d["host_keys"]),
            addresses=tuple(d["addresses"]),
            link_bandwidth=nested(d.get("link_bandwidth"), float),
            link_latency=nested(d.get("link_latency"), float),
            gpu_p2p=nested(d.get("gpu_p2p"), bool),
        )

    def save(self, path: str | Path) -> None:
        """Write as JSON (``nan`` for unmeasured entries)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a ``topology.json`` written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def describe(self) -> str:
        """A few lines for the log: each host (ranks, key, address), then the inter-host links
        (slowest and fastest bandwidth in Mbit/s and MB/s, one-way latency in us or ms) and each
        host's rank-to-rank figures."""
        ppn = self.procs_per_host
        per_host = f"{ppn} per host" if ppn is not None else "uneven per host"
        lines = [f"{self.num_hosts} host(s), {self.world_size} ranks ({per_host})"]
        for i, ranks in enumerate(self.hosts):
            lines.append(f"host {i}: ranks {_rank_list(ranks)}, address {self.addresses[i]}, key {self.host_keys[i]}")
        if self.link_bandwidth is None or self.link_latency is None:
            return "\n".join([*lines, "links: not probed"])
        if self.num_hosts > 1:
            lines += self._describe_inter_host()
        for i in range(self.num_hosts):
            bw, lat = self.link_bandwidth[i][i], self.link_latency[i][i]
            if not math.isnan(bw):
                lines.append(f"inside host {i}: {_format_bandwidth(bw)}, latency {_format_seconds(lat)}")
        return "\n".join(lines)

    def _describe_inter_host(self) -> list[str]:
        pairs = [(i, j) for i in range(self.num_hosts) for j in range(self.num_hosts) if i != j]
        by_bw = sorted(pairs, key=lambda p: self.link_bandwidth[p[0]][p[1]])
        by_lat = sorted(pairs, key=lambda p: self.link_latency[p[0]][p[1]])
        lines = []
        for label, pair in (("slowest", by_bw[0]), ("fastest", by_bw[-1])):
            lines.append(f"inter-host bandwidth, {label}: host {pair[0]} -> {pair[1]} "
                         f"{_format_bandwidth(self.link_bandwidth[pair[0]][pair[1]])}")  # fmt: skip
        for label, pair in (("lowest", by_lat[0]), ("highest", by_lat[-1])):
            lines.append(f"inter-host latency, {label}: host {pair[0]} -> {pair[1]} "
                         f"{_format_seconds(self.link_latency[pair[0]][pair[1]])} one-way")  # fmt: skip
        return lines


def _rank_list(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks)


def _format_bandwidth(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:.1f} Mbit/s ({bytes_per_s / 1e6:.1f} MB/s)"


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


# ---------------------------------------------------------------------------- host identity

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address (netdevice(7))


def host_key() -> str:
    """What identifies this process's host: ``hostname/boot-id/netns-inode``.

    The hostname alone is not enough: containers and the project's emulated hosts (Linux
    network namespaces on one machine, see ``cluster/``) share the hostname and the boot id
    (``/proc/sys/kernel/random/boot_id``, proc(5)) and differ only in the inode of their
    network namespace (``/proc/self/ns/net``, namespaces(7)). A part that the OS does not
    offer (no /proc: macOS, Windows) is ``-``, so the key degrades to the hostname.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "-"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "-"
    return f"{socket.gethostname()}/{boot_id}/{netns}"


def host_address(backend: str = "gloo") -> str:
    """This host's IPv4 address as peers reach it.

    The interface named by ``GLOO_SOCKET_IFNAME`` (gloo) or ``NCCL_SOCKET_IFNAME`` (nccl; the
    other variable when the backend's own is unset) is the one the collectives use, so its
    address is taken (first entry of a comma list; NCCL's ``=`` prefix is stripped, a ``^``
    exclusion list names no interface). Otherwise the address of the interface that routes to
    ``MASTER_ADDR`` (a UDP ``connect``, which sends nothing). The hostname when neither works.
    """
    names = ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
    if backend == "nccl":
        names.reverse()
    for var in names:
        first = os.environ.get(var, "").split(",")[0].strip().lstrip("=")
        if first and not first.startswith("^") and (address := _interface_ipv4(first)):
            return address
    return _route_address(os.environ.get("MASTER_ADDR")) or socket.gethostname()


def _interface_ipv4(name: str) -> str | None:
    """IPv4 address of interface ``name`` by the SIOCGIFADDR ioctl; ``None`` where the OS has no
    such ioctl (``fcntl`` missing, other ioctl numbers) or the interface has no IPv4 address."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
    except OSError:
        return None
    return socket.inet_ntoa(ifreq[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (port, address)


def _route_address(master: str | None) -> str | None:
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # UDP connect only picks the route; nothing is sent
            return s.getsockname()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------- discovery


def discover_topology(probe: bool = True, probe_budget_s: float = 3.0) -> Topology:
    """Learn the hosts of the job and, with ``probe``, the speed of the links between them.

    Collective over the default process group (gloo or NCCL; under NCCL each rank's CUDA device
    must be set, ``torch.cuda.set_device``, before the call): every rank must call it. Ranks
    with the same :func:`host_key` form a host; hosts are ordered by their lowest rank. The
    probe (:func:`_probe_links`, more than one rank only) measures, one pair at a time while
    the other ranks wait at a barrier, each ordered pair of hosts' first ranks and each host's
    first two ranks; then rank 0 assembles the matrices and broadcasts the whole Topology, so
    every rank holds a float-identical copy and decisions taken from it agree.

    Cost: two object collectives without the probe; with it, at most about ``probe_budget_s``:
    the time left is shared between the pairs still to measure (``H·(H-1)`` inter-host pairs
    plus one per host with two or more ranks: 64 for 8 hosts of several ranks), each pair
    shrinking its ping count and transfer size to its share. A pair needs at least ~7 round
    trips (warm-up, 3 pings, one 64 KiB transfer, its barrier), so links whose round trip
    exceeds ``probe_budget_s / (7·pairs)`` overrun the budget. Under NCCL the first send between
    two ranks also creates their pair communicator, which the budget does not bound. Measured on
    gloo, 2 shared CPU cores: 4 processes on one host 0.05-0.12 s (0.015 s unprobed); 4 emulated
    hosts of one rank on 100 Mbit/s links (12 pairs) 1.8 s of a 3 s budget.

    Returns:
        The :class:`Topology`; ``gpu_p2p`` from rank 0's local CUDA devices (``None`` without CUDA).
    Raises:
        RuntimeError: no default process group (torch's error; call ``init_process_group`` first).
    """
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    entries: list = [None] * world
    dist.all_gather_object(entries, (host_key(), host_address(backend)))
    hosts, keys, addresses = _group_hosts(entries)
    links = _probe_links(hosts, device, probe_budget_s) if probe and world > 1 else None
    result: list = [None]
    if dist.get_rank() == 0:
        bandwidth, latency = (None, None) if links is None else links
        result[0] = Topology(hosts, keys, addresses, bandwidth, latency, _gpu_p2p())
    dist.broadcast_object_list(result, src=0, device=device)
    return result[0]


def _group_hosts(entries: list) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...], tuple[str, ...]]:
    """``entries[rank] = (host key, address)`` → ranks per host (hosts by lowest rank), keys,
    addresses (each host's lowest rank's)."""
    ranks: dict[str, list[int]] = {}
    address: dict[str, str] = {}
    for rank, (key, addr) in enumerate(entries):
        ranks.setdefault(key, []).append(rank)
        address.setdefault(key, addr)
    return tuple(tuple(r) for r in ranks.values()), tuple(ranks), tuple(address.values())


def _gpu_p2p() -> tuple[tuple[bool, ...], ...] | None:
    """``[a][b]``: whether local CUDA device ``a`` can read device ``b`` directly (a device
    always reaches itself), as ``torch.cuda.can_device_access_peer`` reports; ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return tuple(tuple(a == b or torch.cuda.can_device_access_peer(a, b) for b in range(n)) for a in range(n))


# ---------------------------------------------------------------------------- link probe

MIN_PINGS, MAX_PINGS = 3, 10
FIRST_PAYLOAD, MAX_PAYLOAD = 64 * 1024, 16 * 1024 * 1024  # bytes
TARGET_TRANSFER_S = 0.05  # a transfer this long dwarfs timer and scheduling noise
LATENCY_SHARE = 0.25  # of a pair's time; the rest goes to the bandwidth transfers


def _probe_pairs(hosts: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int, int]]:
    """``(i, j, sender, receiver)`` for each measured matrix entry, row-major: the first ranks
    of hosts ``i != j``, and the first two ranks of a host ``i == j`` that has two or more."""
    pairs = []
    for i, src in enumerate(hosts):
        for j, dst in enumerate(hosts):
            if i != j:
                pairs.append((i, j, src[0], dst[0]))
            elif len(src) >= 2:
                pairs.append((i, i, src[0], src[1]))
    return pairs


def _probe_links(hosts, device: torch.device, budget_s: float):
    """Measure every pair of :func:`_probe_pairs` in turn, then gather the figures on rank 0.

    Each pair's sender gets an equal share of the time left (``budget_s`` less what the
    earlier pairs and barriers took, over the pairs left), so a slow barrier or pair shrinks
    the later ones instead of overrunning. Returns ``(bandwidth, latency)`` matrices (bytes/s,
    seconds; ``nan`` where not measured) on rank 0, ``None`` elsewhere.
    """
    pairs, rank = _probe_pairs(hosts), dist.get_rank()
    buffer = torch.zeros(MAX_PAYLOAD, dtype=torch.uint8, device=device)
    _barrier(device)
    start, measured = time.perf_counter(), {}
    for k, (i, j, sender, receiver) in enumerate(pairs):
        share = (budget_s - (time.perf_counter() - start)) / (len(pairs) - k)
        if rank == sender:
            measured[(i, j)] = _measure_pair(receiver, buffer, share)
        elif rank == receiver:
            _answer_pair(sender, buffer)
        _barrier(device)
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(measured, gathered, dst=0)
    if rank != 0:
        return None
    n = len(hosts)
    bandwidth, latency = [[math.nan] * n for _ in range(n)], [[math.nan] * n for _ in range(n)]
    for (i, j), (bw, lat) in ((key, v) for part in gathered for key, v in part.items()):
        bandwidth[i][j], latency[i][j] = bw, lat
    return tuple(map(tuple, bandwidth)), tuple(map(tuple, latency))


def _measure_pair(peer: int, buffer: torch.Tensor, share_s: float) -> tuple[float, float]:
    """The sender's side: ping-pongs, then transfers. Returns ``(bytes/s, one-way seconds)``.

    Latency is half the median round trip of tiny messages (the ping-pong of the OSU latency
    benchmark). Bandwidth times one transfer of ``M`` bytes and a tiny ack, growing ``M`` ×4 from
    64 KiB until a transfer takes ``TARGET_TRANSFER_S`` or ``M`` reaches 16 MiB (or the next
    one would not fit the pair's share); it reports ``M / (t - RTT)`` of the last transfer:
    the round trip of its first byte and the ack is latency, already in the latency figure,
    so ``latency + bytes / bandwidth`` models a transfer (Hockney's alpha-beta model). When the
    round trip is more than half of ``t`` the subtraction is too noisy and ``M / t`` is kept.
    """
    rtt = _ping_pong(peer, buffer.device, share_s * LATENCY_SHARE)
    size, seconds = _transfer(peer, buffer, share_s * (1 - LATENCY_SHARE))
    wire = seconds - rtt if seconds - rtt >= seconds / 2 else seconds
    return size / wire, rtt / 2


def _ping_pong(peer: int, device: torch.device, share_s: float) -> float:
    """Median round trip, seconds, of ``MIN_PINGS``..``MAX_PINGS`` ping-pongs after one untimed
    warm-up (which connects lazily created channels). Each ping carries 1 (more follow) or 0
    (last), so the answering rank needs no count agreed in advance."""
    flag = torch.ones(1, dtype=torch.int64, device=device)
    _exchange(peer, flag, flag)
    trips: list[float] = []
    begin = time.perf_counter()
    while True:
        more = len(trips) + 1 < MAX_PINGS and (len(trips) + 1 < MIN_PINGS or time.perf_counter() - begin < share_s)
        flag.fill_(int(more))
        t0 = time.perf_counter()
        _exchange(peer, flag, flag)
        trips.append(time.perf_counter() - t0)
        if not more:
            return statistics.median(trips)


def _transfer(peer: int, buffer: torch.Tensor, share_s: float) -> tuple[int, float]:
    """Grow the payload as :func:`_measure_pair` says; returns the last ``(bytes, seconds)``.
    A header announcing each size (0: done) precedes it, since a receive needs the size."""
    header = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    ack = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    size, begin = FIRST_PAYLOAD, time.perf_counter()
    while True:
        header.fill_(size)
        dist.send(header, peer)
        t0 = time.perf_counter()
        _exchange(peer, buffer[:size], ack)
        seconds = time.perf_counter() - t0
        fits = time.perf_counter() - begin + 4 * seconds <= share_s
        if seconds >= TARGET_TRANSFER_S or size >= MAX_PAYLOAD or not fits:
            header.fill_(0)
            dist.send(header, peer)
            return size, seconds
        size *= 4


def _answer_pair(peer: int, buffer: torch.Tensor) -> None:
    """The receiver's side of :func:`_measure_pair`: echo pings until the last, then receive
    payloads and ack each until the header says 0."""
    flag = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    while True:
        _recv(flag, peer)
        dist.send(flag, peer)
        if flag.item() == 0:
            break
    header = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    while True:
        _recv(header, peer)
        size = int(header.item())
        if size == 0:
            return
        _recv(buffer[:size], peer)
        dist.send(header, peer)


def _exchange(peer: int, out: torch.Tensor, back: torch.Tensor) -> None:
    """Send ``out`` to ``peer`` and wait until ``back`` has arrived from it."""
    dist.send(out, peer)
    _recv(back, peer)


def _recv(tensor: torch.Tensor, peer: int) -> None:
    dist.recv(tensor, peer)
    if tensor.is_cuda:  # NCCL's recv only orders the stream; the host clock needs the data here
        torch.cuda.synchronize(tensor.device)


def _barrier(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL's barrier must know the device, or it guesses one from the rank
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


# ---------------------------------------------------------------------------- placement

# Innermost first: the axes that talk most, which should stay inside a host in this priority.
KEEP_INSIDE_HOST = (Axis.TP, Axis.SP, Axis.DP_SHARD)
_FIX = {
    Axis.TP: "lower parallel.tensor_parallel_degree to a divisor of the ranks per host",
    Axis.SP: "lower parallel.sequence_parallel_degree (or tp) until tp × sp divides the ranks per host",
    Axis.DP_SHARD: "raise parallel.data_parallel_replicate_degree until tp × sp × dp_shard divides them",
}


def place_ranks(topology: Topology, dims: ParallelDims) -> tuple[int, ...]:
    """A ``rank_order`` for ``dims`` (degrees only; its own ``rank_order`` is ignored): the ranks
    host-major, so that tp, then sp, then dp_shard groups stay inside a host where they fit
    (with 2D tensor parallelism, at least each grid row where the whole grid does not fit).

    The mesh lays the order out row-major with tp innermost, then sp, dp_shard, dp_replicate,
    pp, so ``block = tp`` (``tp × sp``, ``tp × sp × dp_shard``) consecutive entries form one
    group of the innermost axes. The largest such block that divides every host's rank count is
    cut from each host's ascending ranks; only the outer axes then cross hosts. The blocks are
    ordered by their first rank, because torch numbers a group's ranks ascending and
    :class:`ParallelDims` refuses a group listed otherwise; for the launchers' numberings (block:
    rank r on node ``r // n``; SLURM cyclic: node ``r mod nodes``) every group then ascends.
    Where it would not (another numbering), the next smaller block is tried, down to the
    launcher's order (``0..world_size-1``), which always ascends.

    Raises:
        ValueError: ``topology`` and ``dims`` count different numbers of ranks.
    """
    _check_same_world(dims, topology)
    gcd = math.gcd(*(len(h) for h in topology.hosts))
    blocks = [math.prod(dims.degree(a) for a in KEEP_INSIDE_HOST[:k]) for k in range(len(KEEP_INSIDE_HOST), 0, -1)]
    # 2D tensor parallelism: a grid row (q consecutive tp ranks) is the block of last resort.
    blocks += [dims.grid_side] if dims.tp_2d else []
    for block in (b for b in blocks if gcd % b == 0):
        chunks = [h[i : i + block] for h in topology.hosts for i in range(0, len(h), block)]
        order = tuple(r for chunk in sorted(chunks) for r in chunk)
        try:
            replace(dims, rank_order=order)
        except ConfigError:
            continue
        return order
    return tuple(range(dims.world_size))


def _check_same_world(dims: ParallelDims, topology: Topology) -> None:
    if topology.world_size != dims.world_size:
        raise ValueError(
            f"the topology has {topology.world_size} ranks but the parallel dims {dims.world_size}; "
            "discover the topology in the job that builds the dims"
        )


def placement_report(dims: ParallelDims, topology: Topology, sharded: bool = True) -> str:
    """Where each mesh axis of degree > 1 runs: one line per axis, innermost first, e.g.
    ``tp 2: inside one host`` or ``dp_replicate 2: crosses hosts (2 hosts per group)``, then a
    ``warning:`` line for each of tp, sp, dp_shard (the axes that should stay inside a host, in
    that priority) that crosses hosts, saying why and what to change. ``sharded``: whether
    dp_shard shards model state (ZeRO); plain data-parallel replicas may cross hosts freely.

    Raises:
        ValueError: ``topology`` and ``dims`` count different numbers of ranks.
    """
    _check_same_world(dims, topology)
    lines, warnings = [], []
    for axis in _reported_axes(dims):
        degree = dims.degree(axis)
        if degree == 1:
            continue
        spans = _host_spans(dims, topology, axis)
        name = f"{axis} {degree}" + (" (grid rows)" if axis == Axis.TP_COL else "")
        if max(spans) == 1:
            lines.append(f"{name}: inside one host")
            continue
        per_group = str(max(spans)) if min(spans) == max(spans) else f"{min(spans)}-{max(spans)}"
        lines.append(f"{name}: crosses hosts ({per_group} hosts per group)")
        if axis == Axis.TP_COL:
            warnings.append(f"warning: 2D grid rows cross hosts: q={degree} does not divide the ranks of every "
                            "host, or they are not numbered host-major; each SUMMA step then broadcasts across "
                            "hosts along rows too")  # fmt: skip
        elif axis in KEEP_INSIDE_HOST and (sharded or axis != Axis.DP_SHARD):
            warnings.append(f"warning: {axis} {degree} crosses hosts: {_why_crossing(dims, topology, axis)}")
    return "\n".join(lines + warnings)


GRID_AXES = (Axis.TP_COL, Axis.TP_ROW)


def _reported_axes(dims: ParallelDims) -> list[Axis]:
    """The mesh axes innermost first, led by the two grid axes under 2D tensor parallelism."""
    return [*(GRID_AXES if dims.tp_2d else ()), *reversed(MESH_AXES)]


def _why_crossing(dims: ParallelDims, topology: Topology, axis: Axis) -> str:
    """Why the groups of ``axis`` (one of :data:`KEEP_INSIDE_HOST`) span hosts, and the fix."""
    per_host = topology.procs_per_host
    if per_host is None:
        sizes = ",".join(str(len(h)) for h in topology.hosts)
        return f"hosts hold different numbers of ranks ({sizes}), so no order aligns every group with a host"
    inner = KEEP_INSIDE_HOST[: KEEP_INSIDE_HOST.index(axis) + 1]
    block = math.prod(dims.degree(a) for a in inner)
    if per_host % block:
        expr = " × ".join(f"{a} {dims.degree(a)}" for a in inner)
        verb = "does not fit" if block > per_host else "does not divide"
        return f"{expr} {verb} {per_host} ranks per host; {_FIX[axis]}"
    placed = replace(dims, rank_order=place_ranks(topology, dims))
    if max(_host_spans(placed, topology, axis)) == 1:
        return "the rank order is not host-major; pass rank_order=place_ranks(topology, dims) to ParallelDims"
    return ("no host-major order keeps every group's ranks ascending, as torch's process groups need; number "
            "the ranks host-major at launch (torchrun's default, SLURM --distribution=block)")  # fmt: skip


def _host_spans(dims: ParallelDims, topology: Topology, axis: Axis) -> list[int]:
    """How many hosts each group of ``axis`` spans."""
    groups = dims.grid_groups(axis) if axis in GRID_AXES else dims.axis_groups(axis)
    return [len({topology.host_of(r) for r in group}) for group in groups]


def placement_summary(dims: ParallelDims, topology: Topology) -> dict[str, dict]:
    """Per mesh axis of degree > 1 (and grid axis, under 2D tensor parallelism): ``degree``,
    ``max_hosts_per_group`` and ``inside_one_host``;
    what ``<run>/placement.json`` records (with ``rank_order``).

    Raises:
        ValueError: ``topology`` and ``dims`` count different numbers of ranks.
    """
    _check_same_world(dims, topology)
    out: dict[str, dict] = {}
    for axis in _reported_axes(dims):
        degree = dims.degree(axis)
        if degree > 1:
            spans = _host_spans(dims, topology, axis)
            out[str(axis)] = {"degree": degree, "max_hosts_per_group": max(spans),
                              "inside_one_host": max(spans) == 1}  # fmt: skip
    return out


def placed_dims(cfg: ParallelConfig, topology: Topology, device_type: str = "cpu") -> ParallelDims:
    """The :class:`ParallelDims` of ``cfg`` for ``topology``'s ranks, placed by :func:`place_ranks`.

    Raises:
        ConfigError: degrees that do not fit the world size.
    """
    plain = ParallelDims.from_config(cfg, topology.world_size, device_type)
    return ParallelDims.from_config(cfg, topology.world_size, device_type, rank_order=place_ranks(topology, plain))


def write_topology(run_dir: Path, topology: Topology, dims: ParallelDims) -> None:
    """Write ``<run>/topology.json`` and ``<run>/placement.json`` (the rank order and, per mesh
    axis, whether its groups stay inside one host)."""
    topology.save(run_dir / "topology.json")
    placement = {"rank_order": list(dims.mesh_ranks().flatten().tolist()), **placement_summary(dims, topology)}
    (run_dir / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
