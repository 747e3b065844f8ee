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

A heterogeneous spec is priced as its slowest and smallest parts (:meth:`ClusterSpec.to_cluster`):
synchronous training waits for the slowest rank, and every rank of a layout holds the same share.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loomtrain.planner.cost import Device, device
from loomtrain.planner.time import Cluster

# configs/clusters/ of the source tree (src/loomtrain/planner/cluster.py → repository root).
SPEC_DIR = Path(__file__).resolve().parents[3] / "configs" / "clusters"
_HOST_FIELDS = {"count", "devices_per_host", "device", "intra_gb_per_s", "intra_latency_us", "gemm_efficiency"}
_NETWORK_FIELDS = {"inter_gb_per_s", "inter_latency_us", "link_efficiency"}
_TOP_FIELDS = {"name", "source", "hosts", "network"}


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
    """

    count: int
    devices_per_host: int
    device: Device
    intra_bytes_per_s: float
    intra_latency_s: float
    gemm_efficiency: float


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster as a spec file describes it (module docstring).

    Attributes:
        name, source: label and where the figures come from.
        hosts: the host groups (one for a homogeneous cluster).
        inter_bytes_per_s, inter_latency_s: the network between hosts, per GPU and direction.
        link_efficiency: busbw over link bandwidth for a large collective.
    """

    name: str
    source: str
    hosts: tuple[HostGroup, ...]
    inter_bytes_per_s: float
    inter_latency_s: float
    link_efficiency: float

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
        achievable GEMM rate, then the least HBM), the fewest devices per host, the slowest intra-host
        link and its largest latency over all host groups; the total host count."""
        slowest = min(self.hosts, key=lambda g: (g.device.peak_flops_per_s * g.gemm_efficiency, g.device.memory_bytes))
        smallest = min(g.device.memory_bytes for g in self.hosts)
        dev = replace(slowest.device, memory_bytes=smallest)
        return Cluster(
            device=dev,
            gemm_efficiency=slowest.gemm_efficiency,
            devices_per_host=min(g.devices_per_host for g in self.hosts),
            intra_bytes_per_s=min(g.intra_bytes_per_s for g in self.hosts),
            inter_bytes_per_s=self.inter_bytes_per_s,
            link_efficiency=self.link_efficiency,
            intra_latency_s=max(g.intra_latency_s for g in self.hosts),
            inter_latency_s=self.inter_latency_s,
            hosts=sum(g.count for g in self.hosts),
            name=self.name,
            source=self.source,
        )


def _number(where: str, table: dict[str, Any], field: str, low: float, high: float = math.inf) -> float:
    value = table.get(field)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
        bound = f"in ({low}, {high}]" if high < math.inf else f"above {low}"
        raise ClusterSpecError(f"{where}.{field}={value!r}: give a number {bound}")
    return float(value)


def _unknown(where: str, table: dict[str, Any], known: set[str]) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise ClusterSpecError(f"{where}: unknown field(s) {', '.join(extra)}; known: {', '.join(sorted(known))}")


def _host_group(where: str, table: Any) -> HostGroup:
    if not isinstance(table, dict):
        raise ClusterSpecError(f"{where}: each [[hosts]] entry must be a table")
    _unknown(where, table, _HOST_FIELDS)
    for field in ("count", "devices_per_host"):
        if not isinstance(table.get(field), int) or isinstance(table.get(field), bool) or table[field] < 1:
            raise ClusterSpecError(f"{where}.{field}={table.get(field)!r}: give a whole number of at least 1")
    try:
        dev = device(table.get("device", ""), field=f"{where}.device")
    except ValueError as err:
        raise ClusterSpecError(str(err)) from None
    efficiency = table.get("gemm_efficiency", dev.mamf_flops_per_s / dev.peak_flops_per_s)
    return HostGroup(
        count=table["count"],
        devices_per_host=table["devices_per_host"],
        device=dev,
        intra_bytes_per_s=_number(where, table, "intra_gb_per_s", 0) * 1e9,
        intra_latency_s=_number(where, table, "intra_latency_us", -1e-12) / 1e6,
        gemm_efficiency=_number(where, {"gemm_efficiency": efficiency}, "gemm_efficiency", 0, 1),
    )


def parse_cluster_spec(doc: dict[str, Any], where: str = "cluster spec") -> ClusterSpec:
    """The :class:`ClusterSpec` of a parsed TOML document.

    Raises:
        ClusterSpecError: a missing, unknown or out-of-range field (the message names it as
            ``<where>.hosts[i].<field>`` or ``<where>.network.<field>``), or an unknown device kind.
    """
    _unknown(where, doc, _TOP_FIELDS)
    hosts = doc.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise ClusterSpecError(f"{where}.hosts: give at least one [[hosts]] table (count, devices_per_host, ...)")
    network = doc.get("network")
    if not isinstance(network, dict):
        raise ClusterSpecError(f"{where}.network: give a [network] table (inter_gb_per_s, inter_latency_us, ...)")
    _unknown(f"{where}.network", network, _NETWORK_FIELDS)
    return ClusterSpec(
        name=str(doc.get("name", "")),
        source=str(doc.get("source", "")),
        hosts=tuple(_host_group(f"{where}.hosts[{i}]", table) for i, table in enumerate(hosts)),
        inter_bytes_per_s=_number(f"{where}.network", network, "inter_gb_per_s", 0) * 1e9,
        inter_latency_s=_number(f"{where}.network", network, "inter_latency_us", -1e-12) / 1e6,
        link_efficiency=_number(f"{where}.network", network, "link_efficiency", 0, 1),
    )


def spec_path(name_or_path: str) -> Path:
    """The file of a spec given as a path, or as a name of ``configs/clusters/`` (``dgx-a100`` or
    ``dgx_a100``).

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
    raise ClusterSpecError(f"--cluster={name_or_path!r}: no such file or spec name; known names: {known}")


def load_cluster_spec(name_or_path: str) -> ClusterSpec:
    """Read and validate a cluster spec (a TOML path, or a name of ``configs/clusters/``).

    Raises:
        ClusterSpecError: as :func:`spec_path` and :func:`parse_cluster_spec`, or invalid TOML.
    """
    path = spec_path(name_or_path)
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ClusterSpecError(f"{path}: not valid TOML ({err})") from None
    return parse_cluster_spec(doc, where=path.name)
