"""Cluster specs in TOML (``configs/clusters/*.toml``): hosts, their devices and links, for the planner.

A spec names its devices by kind, a key of :data:`loomtrain.planner.cost.DEVICES`: the one device
table, which ``--simulate.device`` uses too, with each kind's datasheet peaks (per dtype through
:data:`loomtrain.hardware.GPU_PEAKS`), HBM bandwidth and capacity, SM count and measured GEMM ceiling,
and their sources. Format::

    name = "dgx-a100"
    source = "where the link figures come from"

    [[hosts]]                  # one table per kind of host; several make a heterogeneous cluster
    count = 16                 # hosts of this kind
    devices_per_host = 8
    device = "a100"            # a key of the device table
    intra_gb_per_s = 300       # GPU-to-GPU link inside the host, GB/s per GPU and direction
    intra_latency_us = 5       # per ring step or send
    gemm_efficiency = 0.859    # optional: share of the peak the best GEMM reaches (default: the table's MAMF)

    [network]                  # between hosts
    inter_gb_per_s = 25        # per GPU and direction (one network card per GPU)
    inter_latency_us = 10
    link_efficiency = 0.8      # busbw a large collective reaches over the link bandwidth

A host with one network link shared by its devices (an emulated cluster's shaped veth) gives that
link's rate instead of ``inter_gb_per_s`` (exactly one of the two)::

    [network]
    host_gb_per_s = 0.0125     # the host's link, GB/s per direction: ranks crossing it at once share it

A spec may describe devices the table lacks (a calibrated machine: ``loomtrain plan --calibrate``,
``planner/calibrate.py``) in ``[[devices]]`` tables that its hosts then name, and give a host's
collective figures by group size::

    [[devices]]
    name = "local-cpu"
    peak_tflops = 0.05          # fastest GEMM, TFLOP/s
    memory_gb_per_s = 10        # memory bandwidth
    memory_gib = 12             # memory per device
    element_bytes = 4           # optional: bytes per element of the compute dtype (default 2, bf16)
    gemm_curve = [[1e6, 0.01], [1e9, 0.05]]   # optional: measured [FLOPs, TFLOP/s] of GEMMs by size
    memory_curve = [[1048576, 40], [16777216, 12]]  # optional: measured [tensor bytes, GB/s] of
                                # elementwise kernels by tensor size (memory_gb_per_s: every size)
    attention_curve = [[4e8, 0.02]]  # optional: measured [FLOPs, TFLOP/s] of the fused attention
                                # kernel, forward and backward (the roofline without one)
    optimizer_curve = [[1048576, 20]]  # optional: measured [tensor bytes, GB/s] of PyTorch's AdamW
                                # step by parameter tensor size (memory_curve without one)

    [[hosts]]
    ...
    group_sizes = [2, 4]        # optional, with the two below: measured all-reduce busbw and
    group_gb_per_s = [3.1, 2.2] # latency per ring step of groups of each size inside the host
    group_latency_us = [40, 60]
    comm_overlap = false        # optional (default true): collectives cannot run under compute here
    core_share = 0.5            # optional (default 1): share of a core each rank holds (4 ranks, 2 cores)

    [[hosts.collectives]]       # optional, any number: measured seconds of one collective by size
    op = "all_reduce"           # all_reduce, reduce_scatter, all_gather or all_to_all
    group_size = 2              # ranks in the group, inside the host
    bytes = [65536, 1048576]    # message sizes (nccl-tests' convention), increasing
    microseconds = [900, 1700]  # mean time of one call at each size

A heterogeneous spec is priced as its slowest and smallest parts (:meth:`ClusterSpec.to_cluster`):
synchronous training waits for the slowest rank, and every rank of a layout holds the same share.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loomtrain.distributed.collectives import OPS
from loomtrain.planner.cost import DEVICES, Device, device
from loomtrain.planner.time import Cluster, CollectiveCurve

# configs/clusters/ of the source tree (src/loomtrain/planner/cluster.py → repository root).
SPEC_DIR = Path(__file__).resolve().parents[3] / "configs" / "clusters"
_GROUP_FIELDS = ("group_sizes", "group_gb_per_s", "group_latency_us")
_HOST_FIELDS = {"count", "devices_per_host", "device", "intra_gb_per_s", "intra_latency_us", "gemm_efficiency",
                "comm_overlap", "collectives", "core_share", *_GROUP_FIELDS}  # fmt: skip
_CURVE_FIELDS = {"op", "group_size", "bytes", "microseconds"}
_DEVICE_FIELDS = {"name", "peak_tflops", "memory_gb_per_s", "memory_gib", "element_bytes", "gemm_curve",
                  "memory_curve", "attention_curve", "optimizer_curve", "source"}  # fmt: skip
_RATE_FIELDS = ("inter_gb_per_s", "host_gb_per_s")  # exactly one: per device, or per host and shared
_NETWORK_FIELDS = {*_RATE_FIELDS, "inter_latency_us", "link_efficiency"}
_TOP_FIELDS = {"name", "source", "hosts", "network", "devices"}


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class HostGroup:
    """``count`` identical hosts of ``devices_per_host`` devices of one kind.

    Attributes:
        count, devices_per_host: hosts and devices per host.
        device: the device kind (:class:`~loomtrain.planner.cost.Device`).
        intra_bytes_per_s: the host's GPU-to-GPU link, bytes/s per GPU and direction.
        intra_latency_s: seconds per ring step or send inside the host.
        gemm_efficiency: share of the device's peak the best-shaped GEMM reaches.
        group_links: measured ``(group size, busbw bytes/s, latency s)`` inside the host (may be empty).
        comm_overlap: whether collectives run under compute on this host
            (:attr:`~loomtrain.planner.time.Cluster.comm_overlap`).
        collective_curves: measured ``(op, group size, ((bytes, seconds), ...))`` inside the host
            (:attr:`~loomtrain.planner.time.Cluster.collective_curves`; may be empty).
        core_share: share of a core each rank holds (:attr:`~loomtrain.planner.time.Cluster.core_share`).
    """

    count: int
    devices_per_host: int
    device: Device
    intra_bytes_per_s: float
    intra_latency_s: float
    gemm_efficiency: float
    group_links: tuple[tuple[int, float, float], ...] = ()
    comm_overlap: bool = True
    collective_curves: tuple[CollectiveCurve, ...] = ()
    core_share: float = 1.0


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster as a spec file describes it (module docstring).

    Attributes:
        name, source: label and where the figures come from.
        hosts: the host groups (one for a homogeneous cluster).
        inter_bytes_per_s, inter_latency_s: the network between hosts, bytes/s per GPU and direction
            (per host and direction with ``inter_shared_by_host``) and seconds per ring step or send.
        link_efficiency: busbw over link bandwidth for a large collective.
        inter_shared_by_host: each host has one network link shared by its devices
            (:attr:`~loomtrain.planner.time.Cluster.inter_shared_by_host`).
    """

    name: str
    source: str
    hosts: tuple[HostGroup, ...]
    inter_bytes_per_s: float
    inter_latency_s: float
    link_efficiency: float
    inter_shared_by_host: bool = False

    @property
    def gpus(self) -> int:
        """Devices in the cluster."""
        return sum(g.count * g.devices_per_host for g in self.hosts)

    @property
    def heterogeneous(self) -> bool:
        """More than one kind of host."""
        return len({(g.device.name, g.devices_per_host, g.intra_bytes_per_s) for g in self.hosts}) > 1

    def to_cluster(self) -> Cluster:
        """The time model's :class:`~loomtrain.planner.time.Cluster`: the slowest device (lowest
        achievable GEMM rate, then the least HBM), the slowest intra-host link and its largest
        latency over all host groups, and every device: hosts of the greatest common divisor of the
        groups' devices per host (1×8 + 1×4 GPUs: 3 hosts of 4), so that a group the time model
        keeps inside a host is inside one on every host group."""
        slowest = min(self.hosts, key=lambda g: (g.device.peak_flops_per_s * g.gemm_efficiency, g.device.memory_bytes))
        smallest = min(g.device.memory_bytes for g in self.hosts)
        dev = replace(slowest.device, memory_bytes=smallest)
        per_host = math.gcd(*(g.devices_per_host for g in self.hosts))
        return Cluster(
            device=dev,
            gemm_efficiency=slowest.gemm_efficiency,
            devices_per_host=per_host,
            intra_bytes_per_s=min(g.intra_bytes_per_s for g in self.hosts),
            inter_bytes_per_s=self.inter_bytes_per_s,
            link_efficiency=self.link_efficiency,
            intra_latency_s=max(g.intra_latency_s for g in self.hosts),
            inter_latency_s=self.inter_latency_s,
            hosts=self.gpus // per_host,
            name=self.name,
            source=self.source,
            group_links=_slowest_links(self.hosts),
            comm_overlap=all(g.comm_overlap for g in self.hosts),
            collective_curves=_slowest_curves(self.hosts),
            core_share=max(g.core_share for g in self.hosts),  # the least idle time given to neighbours
            inter_shared_by_host=self.inter_shared_by_host,
        )


def _slowest_links(hosts: tuple[HostGroup, ...]) -> tuple[tuple[int, float, float], ...]:
    """Per group size measured by every host group, its lowest busbw and highest latency."""
    sizes = set.intersection(*({g[0] for g in h.group_links} for h in hosts))
    rows = [[g for h in hosts for g in h.group_links if g[0] == size] for size in sorted(sizes)]
    return tuple((r[0][0], min(g[1] for g in r), max(g[2] for g in r)) for r in rows)


def _slowest_curves(hosts: tuple[HostGroup, ...]) -> tuple[CollectiveCurve, ...]:
    """Per ``(op, group size, message sizes)`` measured by every host group, its slowest time at each size."""
    keys = set.intersection(*({(op, g, tuple(b for b, _ in pts)) for op, g, pts in h.collective_curves} for h in hosts))
    slowest = []
    for op, size, sizes in sorted(keys):
        rows = [pts for h in hosts for o, g, pts in h.collective_curves if (o, g) == (op, size)]
        slowest.append((op, size, tuple((b, max(r[i][1] for r in rows)) for i, b in enumerate(sizes))))
    return tuple(slowest)


def _number(where: str, table: dict[str, Any], field: str, low: float, high: float = math.inf) -> float:
    """``table[field]``, a finite number in ``(low, high]`` (``low < 0``: at least 0)."""
    value = table.get(field)
    if not _finite(value) or not low < value <= high:
        bound = "at least 0" if low < 0 else f"in ({low}, {high}]" if high < math.inf else f"above {low}"
        found = f"{where}.{field} is missing" if value is None else f"{where}.{field}={value!r}"
        raise ClusterSpecError(f"{found}: give a finite number {bound}")
    return float(value)


def _unknown(where: str, table: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ClusterSpecError(f"{where}: unknown field(s) {', '.join(extra)}; known: {', '.join(sorted(known))}")


def _whole(where: str, table: dict[str, Any], field: str) -> int:
    value = table.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClusterSpecError(f"{where}.{field}={value!r}: give a whole number of at least 1")
    return value


def _numbers(where: str, table: dict[str, Any], field: str, length: int, low: float) -> list[float]:
    values = table.get(field)
    if not isinstance(values, list) or len(values) != length:
        raise ClusterSpecError(f"{where}.{field}={values!r}: give a list of {length} numbers, one per group size")
    return [_number(where, {field: v}, field, low) for v in values]


def _group_links(where: str, table: dict[str, Any]) -> tuple[tuple[int, float, float], ...]:
    present = [f for f in _GROUP_FIELDS if f in table]
    if not present:
        return ()
    if len(present) < len(_GROUP_FIELDS):
        raise ClusterSpecError(f"{where}: give all of {', '.join(_GROUP_FIELDS)} or none (found {', '.join(present)})")
    sizes = table["group_sizes"]
    whole = isinstance(sizes, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 2 for g in sizes)
    if not whole or not sizes or len(set(sizes)) != len(sizes):
        raise ClusterSpecError(f"{where}.group_sizes={sizes!r}: give a list of distinct whole numbers of at least 2")
    busbw = _numbers(where, table, "group_gb_per_s", len(sizes), 0)
    latency = _numbers(where, table, "group_latency_us", len(sizes), -1e-12)
    return tuple(sorted((s, b * 1e9, t / 1e6) for s, b, t in zip(sizes, busbw, latency, strict=True)))


def _collective_curve(where: str, table: Any, devices_per_host: int) -> CollectiveCurve:
    """One ``[[hosts.collectives]]`` table as ``(op, group size, ((bytes, seconds), ...))``."""
    if not isinstance(table, dict):
        raise ClusterSpecError(f"{where}: each [[hosts.collectives]] entry must be a table")
    _unknown(where, table, _CURVE_FIELDS)
    if table.get("op") not in OPS:
        raise ClusterSpecError(f"{where}.op={table.get('op')!r}: give one of {', '.join(OPS)}")
    size = _whole(where, table, "group_size")
    if not 2 <= size <= devices_per_host:
        raise ClusterSpecError(f"{where}.group_size={size}: give 2 to devices_per_host={devices_per_host}")
    sizes = table.get("bytes")
    if not isinstance(sizes, list) or not sizes:
        raise ClusterSpecError(f"{where}.bytes={sizes!r}: give a list of increasing message sizes in bytes")
    nbytes = [_number(where, {"bytes": b}, "bytes", 0) for b in sizes]
    if nbytes != sorted(set(nbytes)):
        raise ClusterSpecError(f"{where}.bytes={sizes!r}: give a list of increasing message sizes in bytes")
    times = table.get("microseconds")
    if not isinstance(times, list) or len(times) != len(nbytes):
        raise ClusterSpecError(f"{where}.microseconds={times!r}: give one time per size of bytes ({len(nbytes)})")
    seconds = [_number(where, {"microseconds": t}, "microseconds", 0) / 1e6 for t in times]
    return table["op"], size, tuple(zip(nbytes, seconds, strict=True))


def _curve(where: str, table: dict[str, Any], field: str, units: str, scale: float) -> tuple[tuple[float, float], ...]:
    """A measured ``[[size, rate], ...]`` field as sorted ``(size, rate · scale)`` pairs; ``()`` when absent."""
    if field not in table:
        return ()
    value = table[field]
    ok = isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and all(_finite(x) and x > 0 for x in p) for p in value
    )
    if not ok or not value:
        raise ClusterSpecError(f"{where}.{field}={value!r}: give a list of [{units}] pairs, both positive and finite")
    return tuple(sorted((float(f), float(r) * scale) for f, r in value))


def _finite(x: Any) -> bool:
    """A TOML number (not a boolean, which Python counts as an int) other than ``inf`` or ``nan``."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _spec_device(where: str, table: Any) -> Device:
    """A ``[[devices]]`` table as a :class:`~loomtrain.planner.cost.Device`."""
    if not isinstance(table, dict) or not isinstance(table.get("name"), str) or not table["name"]:
        raise ClusterSpecError(f"{where}: each [[devices]] entry must be a table with a name")
    _unknown(where, table, _DEVICE_FIELDS)
    peak = _number(where, table, "peak_tflops", 0) * 1e12
    element_bytes = table.get("element_bytes", 2)
    if element_bytes not in (1, 2, 4, 8):
        raise ClusterSpecError(f"{where}.element_bytes={element_bytes!r}: give 1, 2, 4 or 8")
    curve = _curve(where, table, "gemm_curve", "FLOPs, TFLOP/s", 1e12)
    if curve and max(rate for _, rate in curve) > peak * (1 + 1e-6):
        raise ClusterSpecError(
            f"{where}.gemm_curve has a rate above peak_tflops={peak / 1e12:g}: the peak is the fastest GEMM; "
            "raise peak_tflops to the curve's top rate or fix the curve"
        )
    return Device(
        name=table["name"].lower(),
        peak_flops_per_s=peak,
        memory_bytes_per_s=_number(where, table, "memory_gb_per_s", 0) * 1e9,
        source=str(table.get("source", "")),
        memory_bytes=_number(where, table, "memory_gib", 0) * 2**30,
        mamf_flops_per_s=peak,
        element_bytes=element_bytes,
        gemm_curve=curve,
        memory_curve=_curve(where, table, "memory_curve", "tensor bytes, GB/s", 1e9),
        attention_curve=_curve(where, table, "attention_curve", "FLOPs, TFLOP/s", 1e12),
        optimizer_curve=_curve(where, table, "optimizer_curve", "tensor bytes, GB/s", 1e9),
    )


def _spec_devices(where: str, doc: dict[str, Any]) -> dict[str, Device]:
    tables = doc.get("devices", [])
    if not isinstance(tables, list):
        raise ClusterSpecError(f"{where}.devices: give [[devices]] tables")
    found = {}
    for i, table in enumerate(tables):
        dev = _spec_device(f"{where}.devices[{i}]", table)
        if dev.name in DEVICES or dev.name in found:
            raise ClusterSpecError(f"{where}.devices[{i}].name={dev.name!r} is already a device; choose another name")
        found[dev.name] = dev
    return found


def _host_device(where: str, table: dict[str, Any], devices: dict[str, Device]) -> Device:
    name = str(table.get("device", "")).lower()
    if name in devices:
        return devices[name]
    try:
        return device(name, field=f"{where}.device")
    except ValueError as err:
        named = f" or a [[devices]] name ({', '.join(devices)})" if devices else ""
        raise ClusterSpecError(f"{err}{named}") from None


def _host_group(where: str, table: Any, devices: dict[str, Device]) -> HostGroup:
    if not isinstance(table, dict):
        raise ClusterSpecError(f"{where}: each [[hosts]] entry must be a table")
    _unknown(where, table, _HOST_FIELDS)
    _whole(where, table, "count"), _whole(where, table, "devices_per_host")
    dev = _host_device(where, table, devices)
    links = _group_links(where, table)
    if any(size > table["devices_per_host"] for size, _, _ in links):
        raise ClusterSpecError(f"{where}.group_sizes={table['group_sizes']!r}: a group inside a host has at most "
                               f"devices_per_host={table['devices_per_host']} devices")  # fmt: skip
    efficiency = table.get("gemm_efficiency", dev.mamf_flops_per_s / dev.peak_flops_per_s)
    return HostGroup(
        count=table["count"],
        devices_per_host=table["devices_per_host"],
        device=dev,
        intra_bytes_per_s=_number(where, table, "intra_gb_per_s", 0) * 1e9,
        intra_latency_s=_number(where, table, "intra_latency_us", -1e-12) / 1e6,
        gemm_efficiency=_number(where, {"gemm_efficiency": efficiency}, "gemm_efficiency", 0, 1),
        group_links=links,
        comm_overlap=_flag(where, table, "comm_overlap", True),
        collective_curves=_collective_curves(where, table),
        core_share=_number(where, {"core_share": table.get("core_share", 1.0)}, "core_share", 0, 1),
    )


def _collective_curves(where: str, table: dict[str, Any]) -> tuple[CollectiveCurve, ...]:
    tables = table.get("collectives", [])
    if not isinstance(tables, list):
        raise ClusterSpecError(f"{where}.collectives: give [[hosts.collectives]] tables")
    curves = [
        _collective_curve(f"{where}.collectives[{i}]", t, table["devices_per_host"]) for i, t in enumerate(tables)
    ]
    keys = [(op, size) for op, size, _ in curves]
    if len(set(keys)) != len(keys):
        raise ClusterSpecError(f"{where}.collectives: one table per (op, group_size); found {sorted(keys)}")
    return tuple(sorted(curves))


def _flag(where: str, table: dict[str, Any], field: str, default: bool) -> bool:
    value = table.get(field, default)
    if not isinstance(value, bool):
        raise ClusterSpecError(f"{where}.{field}={value!r}: give true or false")
    return value


def _network_rate(where: str, network: dict[str, Any]) -> tuple[float, bool]:
    """``(bytes/s, shared by the host's devices)`` of ``[network]``'s one rate field.

    Raises:
        ClusterSpecError: both or neither of ``inter_gb_per_s`` and ``host_gb_per_s``, or not positive.
    """
    given = [f for f in _RATE_FIELDS if f in network]
    if len(given) != 1:
        raise ClusterSpecError(f"{where}: give exactly one of inter_gb_per_s (per device: a network card each) "
                               "and host_gb_per_s (per host: one link its devices share); "
                               f"found {'both' if given else 'neither'}")  # fmt: skip
    return _number(where, network, given[0], 0) * 1e9, given[0] == "host_gb_per_s"


def parse_cluster_spec(doc: dict[str, Any], where: str = "cluster spec") -> ClusterSpec:
    """The :class:`ClusterSpec` of a parsed TOML document.

    Raises:
        ClusterSpecError: a missing, unknown or out-of-range field (the message names it as
            ``<where>.hosts[i].<field>`` or ``<where>.network.<field>``), both or neither of
            ``network.inter_gb_per_s`` and ``network.host_gb_per_s``, or an unknown device kind.
    """
    _unknown(where, doc, _TOP_FIELDS)
    devices = _spec_devices(where, doc)
    hosts = doc.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise ClusterSpecError(f"{where}.hosts: give at least one [[hosts]] table (count, devices_per_host, ...)")
    network = doc.get("network")
    if not isinstance(network, dict):
        raise ClusterSpecError(f"{where}.network: give a [network] table (inter_gb_per_s, inter_latency_us, ...)")
    _unknown(f"{where}.network", network, _NETWORK_FIELDS)
    rate, shared = _network_rate(f"{where}.network", network)
    return ClusterSpec(
        name=str(doc.get("name", "")),
        source=str(doc.get("source", "")),
        hosts=tuple(_host_group(f"{where}.hosts[{i}]", table, devices) for i, table in enumerate(hosts)),
        inter_bytes_per_s=rate,
        inter_latency_s=_number(f"{where}.network", network, "inter_latency_us", -1e-12) / 1e6,
        link_efficiency=_number(f"{where}.network", network, "link_efficiency", 0, 1),
        inter_shared_by_host=shared,
    )


def spec_path(name_or_path: str, flag: str = "--cluster") -> Path:
    """The file of a spec given as a path, or as a name of ``configs/clusters/`` (``dgx-a100`` or
    ``dgx_a100``); ``flag`` names where it was given, for the error.

    Raises:
        ClusterSpecError: neither a file nor a known name; the message lists the known names.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = SPEC_DIR / f"{name_or_path.replace('-', '_')}.toml"
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem.replace("_", "-") for p in SPEC_DIR.glob("*.toml"))) or "none found"
    raise ClusterSpecError(f"{flag}={name_or_path!r}: no such file or spec name; known names: {known}")


def load_cluster_spec(name_or_path: str, flag: str = "--cluster") -> ClusterSpec:
    """Read and validate a cluster spec (a TOML path, or a name of ``configs/clusters/``) given by
    ``flag`` (named in the errors).

    Raises:
        ClusterSpecError: as :func:`spec_path` and :func:`parse_cluster_spec`, or invalid TOML.
    """
    path = spec_path(name_or_path, flag)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ClusterSpecError(f"{path}: not valid TOML ({err})") from None
    return parse_cluster_spec(doc, where=path.name)
