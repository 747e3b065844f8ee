"""An emulated multi-host cluster on one Linux machine: network namespaces, veth pairs, a bridge, tc.

Each host is a network namespace ``lt-<name>-h<i>`` holding one interface ``eth0`` with the
address ``198.18.<k>.<i+1>/24`` (RFC 2544's benchmarking range; ``k`` is one subnet byte per
cluster). Its veth peer ``v<i>`` is a port of the bridge ``br0`` in the switch namespace
``lt-<name>-sw``, which has no address. Nothing is created in the root namespace and no
namespace has a route out, so emulated traffic never leaves the machine.

Links are shaped with the token-bucket filter (``tbf``, tc-tbf(8)) on both ends of every
host link: the host's ``eth0`` (host → switch) and the switch port ``v<i>`` (switch → host),
so each host has ``--inter-rate`` each way, full duplex. Processes inside one host talk over
the namespace's loopback (also through the host's own 198.18 address), unshaped unless
``--intra-rate`` puts a tbf on ``lo``. ``--inter-delay`` adds a netem (tc-netem(8)) delay on
each host's egress, so the one-way delay between two hosts is the delay given.

The cluster's description is kept as JSON in a state directory (``/run/loomtrain/clusters``,
``$LOOMTRAIN_CLUSTER_DIR``), written before anything is created, so ``cluster_down`` can
remove what a crashed ``cluster_up`` left behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from loomtrain.config import ConfigError

DEFAULT_STATE_DIR = Path("/run/loomtrain/clusters")
INTERFACE = "eth0"
NETNS_DIR = Path("/run/netns")  # where `ip netns add` bind-mounts named namespaces (ip-netns(8))
_NAME = re.compile(r"[a-z0-9]{1,8}")
# tc(8) "RATES": SI prefixes are powers of 1000, IEC (ki, mi, gi, ti) powers of 1024;
# "bit" units count bits per second, "bps" units bytes per second.
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(|k|m|g|t|ki|mi|gi|ti)(bit|bps)", re.IGNORECASE)
_TIME = re.compile(r"(\d+(?:\.\d+)?)\s*(s|sec|ms|msec|us|usec)", re.IGNORECASE)
_TIME_UNIT = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
# tbf: a bucket of at least this many bytes holds a whole 64 KiB GSO/TSO segment plus headers,
# so tbf never has to split one (tc-tbf(8): "burst" must exceed the largest packet).
_MIN_BURST = 96 * 1024
_BURST_SECONDS = 1e-3  # at high rates, the bucket holds 1 ms of traffic, so timer slack costs no rate
_QUEUE_SECONDS = 0.02  # tbf "latency": the longest a packet may wait, which sets the queue length


class ClusterError(ConfigError):
    """The emulated cluster cannot be made, found or used; the message names the flag or the fix."""


def rate_bytes_per_s(rate: str, flag: str = "--inter-rate") -> float:
    """A tc rate string (tc(8) "RATES") as bytes/s: ``100mbit`` → 12.5e6, ``10mbps`` → 10e6.

    Units: ``bit kbit mbit gbit tbit`` (bits/s, SI) and ``bps kbps mbps gbps tbps`` (bytes/s),
    with IEC prefixes ``ki mi gi ti`` allowed; case-insensitive. A bare number is refused, since
    tc would read it as bits/s and users often mean bytes.

    Raises:
        ClusterError: not a positive rate with a unit; the message names ``flag``.
    """
    m = _RATE.fullmatch(rate.strip())
    if m is None:
        raise ClusterError(
            f"{flag}={rate!r} is not a rate; write it as tc does, e.g. 100mbit (bits/s) or 12mbps (bytes/s)"
        )
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()] / (8 if m.group(3).lower() == "bit" else 1)
    if value < 1:
        raise ClusterError(f"{flag}={rate!r} must be at least 8bit (1 byte/s)")
    return value


def delay_seconds(delay: str, flag: str = "--inter-delay") -> float:
    """A tc time string (tc(8) "TIMES": ``s``, ``ms``, ``us``) as seconds: ``2ms`` → 0.002.

    Raises:
        ClusterError: not a non-negative time with a unit; the message names ``flag``.
    """
    m = _TIME.fullmatch(delay.strip())
    if m is None:
        raise ClusterError(f"{flag}={delay!r} is not a time; write it with a unit, e.g. 2ms or 500us")
    return float(m.group(1)) * _TIME_UNIT[m.group(2).lower()]


@dataclass(frozen=True)
class ClusterSpec:
    """What ``loomtrain cluster up`` builds.

    Attributes:
        hosts: number of emulated hosts, 1..254 (one /24 subnet).
        procs_per_host: processes a launcher should start per host (recorded for launchers;
            no resource is made per process).
        inter_rate: rate of each host's link, each way (tc rate, e.g. ``100mbit``).
        intra_rate: rate of each host's loopback (shared by all its processes), or ``None``
            for unshaped.
        inter_delay: one-way delay between two hosts (tc time, e.g. ``2ms``; needs netem), or
            ``None``.
        name: cluster name, 1 to 8 characters ``[a-z0-9]``; it prefixes every namespace.

    Raises:
        ClusterError: on any invalid field, naming its command-line flag and the fix.
    """

    hosts: int
    procs_per_host: int
    inter_rate: str = "100mbit"
    intra_rate: str | None = None
    inter_delay: str | None = None
    name: str = "loom"

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 254:
            raise ClusterError(f"--hosts={self.hosts} must be between 1 and 254 (one /24 subnet)")
        if self.procs_per_host < 1:
            raise ClusterError(f"--procs-per-host={self.procs_per_host} must be at least 1")
        rate_bytes_per_s(self.inter_rate, "--inter-rate")
        if self.intra_rate is not None:
            rate_bytes_per_s(self.intra_rate, "--intra-rate")
        if self.inter_delay is not None:
            delay_seconds(self.inter_delay, "--inter-delay")
        check_name(self.name)


def check_name(name: str) -> str:
    """``name`` if it is a valid cluster name (1 to 8 of ``[a-z0-9]``).

    Raises:
        ClusterError: otherwise, naming ``--name`` and the allowed form.
    """
    if not _NAME.fullmatch(name):
        raise ClusterError(f"--name={name!r} must be 1 to 8 lowercase letters or digits, e.g. --name loom")
    return name


def default_state_dir() -> Path:
    """``$LOOMTRAIN_CLUSTER_DIR`` if set, else ``/run/loomtrain/clusters`` (tmpfs: gone after a reboot,
    as the namespaces are)."""
    return Path(os.environ.get("LOOMTRAIN_CLUSTER_DIR") or DEFAULT_STATE_DIR)


def state_path(name: str, state_dir: Path | None = None) -> Path:
    """The JSON state file of cluster ``name``: ``<state_dir>/<name>.json``."""
    return Path(state_dir or default_state_dir()) / f"{check_name(name)}.json"


def _run(argv: list[str]) -> str:
    """Run one ``ip``/``tc`` command; its stdout.

    Raises:
        ClusterError: it failed; the message holds the command and its stderr.
    """
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {r.stderr.strip() or f'exit status {r.returncode}'}")
    return r.stdout


def netns_names() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _owned(name: str, ns: str) -> bool:
    """Whether namespace ``ns`` is one cluster ``name`` makes (switch, host or netem probe)."""
    return re.fullmatch(rf"lt-{name}-(sw|h\d+|probe)", ns) is not None


def _ns_key(ns: str) -> tuple[int, int]:
    """(device, inode) of a named namespace, as ``stat -L /proc/<pid>/ns/net`` reports for its processes."""
    st = os.stat(NETNS_DIR / ns)
    return st.st_dev, st.st_ino


def pids_in_netns(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (compared by nsfs inode, proc(5))."""
    try:
        key = _ns_key(ns)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # exited meanwhile, or a zombie (its namespaces are already released)
            continue
        if (st.st_dev, st.st_ino) == key:
            pids.append(int(entry))
    return sorted(pids)


def _signal_all(pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each pid still alive (never this process); the pids signalled."""
    sent = []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
            sent.append(pid)
        except ProcessLookupError:
            pass
    return sent


def _tbf(bytes_per_s: float) -> list[str]:
    """tc-tbf(8) arguments for a rate of ``bytes_per_s``: the bucket (``burst``) holds the larger of
    96 KiB and 1 ms of traffic, and a packet may wait at most 20 ms (``latency``)."""
    burst = max(_MIN_BURST, math.ceil(bytes_per_s * _BURST_SECONDS))
    return [
        "tbf",
        "rate",
        f"{round(bytes_per_s * 8)}bit",
        "burst",
        str(burst),
        "latency",
        f"{_QUEUE_SECONDS * 1000:g}ms",
    ]


def _netem(delay: str, bytes_per_s: float) -> list[str]:
    """tc-netem(8) arguments: ``delay`` with a packet limit above the rate-delay product, so the
    delay line never drops (netem's default of 1000 packets is ~1.5 MB)."""
    packets = math.ceil(bytes_per_s * delay_seconds(delay) / 1500)
    return ["netem", "delay", delay, "limit", str(max(1000, 2 * packets + 100))]


def _require_root(action: str) -> None:
    """Raises ClusterError unless this process is root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise ClusterError(f"{action} needs root (CAP_NET_ADMIN) to manage network namespaces; run it with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{action} needs `{tool}` (iproute2), which is not installed; install iproute2")


@cache
def missing_requirements() -> str | None:
    """``None`` if an emulated cluster can be made here, else why not (tests skip with it).

    Checks root, ``ip`` and ``tc``, then makes a throwaway namespace with a veth pair and a
    tbf qdisc and deletes it again.
    """
    try:
        _require_root("an emulated cluster")
    except ClusterError as e:
        return str(e)
    ns = f"ltprobe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "a1"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "a0", "root", *_tbf(rate_bytes_per_s("1gbit"))])
    except ClusterError as e:
        return f"cannot make network namespaces, veth pairs or tbf qdiscs here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def _check_netem(name: str) -> None:
    """Raises ClusterError if this kernel lacks netem; tried on the loopback of a throwaway
    namespace (``lt-<name>-probe``), deleted again, so nothing is left either way."""
    ns = f"lt-{name}-probe"
    _run(["ip", "netns", "add", ns])
    try:
        r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True)  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if r.returncode != 0:
        raise ClusterError("--inter-delay needs the netem qdisc, which this kernel lacks; leave --inter-delay out")


@dataclass
class Cluster:
    """An emulated cluster that :func:`cluster_up` made (or :func:`load_cluster` found).

    Attributes:
        spec: what was asked for.
        switch_ns: the switch namespace (bridge ``br0``, ports ``v<i>``, no address).
        host_ns: host ``i``'s namespace, ``lt-<name>-h<i>``.
        addresses: host ``i``'s IPv4 address on its ``eth0`` (``198.18.<k>.<i+1>``).
        state_path: the JSON file that describes this cluster.
        interface: each host's interface, for ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``.
    """

    spec: ClusterSpec
    switch_ns: str
    host_ns: list[str]
    addresses: list[str]
    state_path: Path
    interface: str = INTERFACE

    @property
    def subnet(self) -> int:
        """The cluster's subnet byte ``k`` of ``198.18.k.0/24``."""
        return int(self.addresses[0].split(".")[2])

    def _host(self, host: int) -> int:
        if not 0 <= host < len(self.host_ns):
            raise ClusterError(
                f"HOST={host} is out of range; cluster '{self.spec.name}' has hosts 0..{len(self.host_ns) - 1}"
            )
        return host

    def netns(self, host: int) -> str:
        """Host ``host``'s namespace name (for ``ip netns exec``, ``tc -n``)."""
        return self.host_ns[self._host(host)]

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address, which its peers and its own processes reach it at."""
        return self.addresses[self._host(host)]

    def port(self, host: int) -> str:
        """The switch-side veth of host ``host``'s link (in :attr:`switch_ns`)."""
        return f"v{self._host(host)}"

    def exec_argv(self, host: int, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside host ``host``: ``ip netns exec NS env K=V ... argv`` (ip-netns(8)).

        The command inherits the caller's environment plus ``GLOO_SOCKET_IFNAME`` and
        ``NCCL_SOCKET_IFNAME`` set to :attr:`interface`, plus ``env`` (which wins).

        Raises:
            ClusterError: ``host`` out of range, or an ``env`` name that is empty or holds ``=``.
        """
        assignments = {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface, **(env or {})}
        for key in assignments:
            if not key or "=" in key:
                raise ClusterError(f"environment variable name {key!r} is invalid; use a name without '='")
        return ["ip", "netns", "exec", self.netns(host), "env", *(f"{k}={v}" for k, v in assignments.items()), *argv]

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (see :meth:`exec_argv`); ``kw`` goes to ``subprocess.Popen``."""
        return subprocess.Popen(self.exec_argv(host, argv, env), **kw)

    def link_bytes(self, host: int) -> tuple[int, int]:
        """Bytes that crossed host ``host``'s link since ``up``: (host → switch, switch → host).

        Read from the root qdisc's counters on the two ends (tc-s(8) "Sent N bytes"), which
        count every frame with its Ethernet/IP/TCP headers, as the link carries it.
        """
        return qdisc_sent_bytes(self.interface, self.netns(host)), qdisc_sent_bytes(self.port(host), self.switch_ns)

    def host_pids(self, host: int) -> list[int]:
        """Every process running in host ``host``'s namespace."""
        return pids_in_netns(self.netns(host))

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process of host ``host`` (a host crash); the pids signalled."""
        return _signal_all(self.host_pids(host), sig)

    def set_link(self, host: int, up: bool) -> None:
        """Cut (``up=False``) or restore host ``host``'s link by setting its switch port down/up.

        Frames to and from the host are then dropped without any TCP reset or ICMP error
        reaching a peer, as when a cable or switch fails: peers see timeouts, not resets.
        Connections survive a short cut (TCP retransmits once the link is back).
        """
        _run(["ip", "-n", self.switch_ns, "link", "set", self.port(host), "up" if up else "down"])
        if up:
            # Address resolution that failed during the cut would refuse connections ("no route
            # to host") for a while after it; a repaired link resolves afresh.
            for i in range(self.spec.hosts):
                _run(["ip", "-n", self.netns(i), "neigh", "flush", "all"])

    def to_json(self, status: str) -> dict:
        """The state file's content; ``status`` is ``starting`` or ``up``."""
        return {"spec": asdict(self.spec), "switch_ns": self.switch_ns, "host_ns": self.host_ns,
                "addresses": self.addresses, "subnet": self.subnet, "interface": self.interface,
                "status": status}  # fmt: skip


def qdisc_sent_bytes(dev: str, ns: str | None = None) -> int:
    """Bytes sent by the root qdisc of ``dev`` in network namespace ``ns`` (``None``: the
    caller's own, e.g. a rank inside an emulated host), from ``tc -s -j`` (text output where
    this tc has no JSON; tc-s(8) "Sent N bytes").

    Raises:
        ClusterError: ``dev`` has no qdisc counters there.
    """
    where = ["-n", ns] if ns else []
    r = subprocess.run(["tc", *where, "-s", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True)
    try:
        return next(int(q["bytes"]) for q in json.loads(r.stdout) if q.get("root"))
    except (ValueError, KeyError, TypeError, StopIteration):
        m = re.search(r"Sent (\d+) bytes", _run(["tc", *where, "-s", "qdisc", "show", "dev", dev]))
        if m is None:
            raise ClusterError(f"no qdisc counters on {dev} in namespace {ns or 'of this process'}") from None
        return int(m.group(1))


def _write_state(cluster: Cluster, status: str) -> None:
    """Write the state file atomically (temporary file, fsync, rename)."""
    path = cluster.state_path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(cluster.to_json(status), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_state(path: Path) -> dict | None:
    """The state file's content, or ``None`` if it is missing or unreadable (a torn write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cluster_from_state(state: dict, path: Path) -> Cluster:
    return Cluster(ClusterSpec(**state["spec"]), state["switch_ns"], list(state["host_ns"]),
                   list(state["addresses"]), path, state.get("interface", INTERFACE))  # fmt: skip


def load_cluster(name: str = "loom", state_dir: Path | None = None) -> Cluster:
    """The cluster ``name`` that is up, from its state file.

    Raises:
        ClusterError: none is up, its ``up`` never finished, or its namespaces are gone; the
            message says which command fixes it.
    """
    path = state_path(name, state_dir)
    state = _read_state(path)
    if state is None:
        raise ClusterError(f"no cluster named {name!r} is up (no {path}); start one with "
                           f"loomtrain cluster up --hosts 2 --procs-per-host 1 --name {name}")  # fmt: skip
    if state.get("status") != "up":
        raise ClusterError(f"cluster {name!r} did not finish starting; run loomtrain cluster down --name {name}, "
                           "then up again")  # fmt: skip
    cluster = _cluster_from_state(state, path)
    if not all((NETNS_DIR / ns).exists() for ns in [cluster.switch_ns, *cluster.host_ns]):
        raise ClusterError(f"cluster {name!r}'s namespaces are gone (reboot, or deleted by hand); "
                           f"run loomtrain cluster down --name {name}")  # fmt: skip
    return cluster


def _subnets_in_use(state_dir: Path) -> set[int]:
    """Subnet bytes held by other emulated clusters: those whose host 0 has an address now (any
    state directory), and those recorded in ``state_dir`` (a cluster still starting)."""
    used = set()
    for ns in netns_names():
        if re.fullmatch(r"lt-[a-z0-9]{1,8}-h0", ns):
            out = subprocess.run(
                ["ip", "-n", ns, "-j", "addr", "show", "dev", INTERFACE], capture_output=True, text=True
            )
            for link in json.loads(out.stdout or "[]"):
                used |= {int(a["local"].split(".")[2]) for a in link.get("addr_info", []) if a.get("family") == "inet"}
    for path in state_dir.glob("*.json"):
        state = _read_state(path)
        if state is not None and "subnet" in state:
            used.add(int(state["subnet"]))
    return used


def choose_subnet(name: str, in_use: set[int]) -> int:
    """The subnet byte ``k`` (``198.18.k.0/24``) for cluster ``name``: the first not in ``in_use``
    from ``crc32(name) mod 256`` on, so a name keeps its subnet whenever it is free.

    Raises:
        ClusterError: all 256 are taken.
    """
    start = zlib.crc32(name.encode()) % 256
    for offset in range(256):
        k = (start + offset) % 256
        if k not in in_use:
            return k
    raise ClusterError("every subnet 198.18.0-255.0/24 is taken by other emulated clusters; take one down first")


def _plan(spec: ClusterSpec, path: Path, subnet: int) -> Cluster:
    hosts = [f"lt-{spec.name}-h{i}" for i in range(spec.hosts)]
    addresses = [f"198.18.{subnet}.{i + 1}" for i in range(spec.hosts)]
    return Cluster(spec, f"lt-{spec.name}-sw", hosts, addresses, path)


def _refuse_if_up(name: str, path: Path) -> None:
    """Raises ClusterError if cluster ``name`` has a state file or any namespace."""
    down = "loomtrain cluster down" + ("" if name == "loom" else f" --name {name}")
    state = _read_state(path)
    if state is not None:
        hosts = len(state.get("host_ns", []))
        raise ClusterError(f"cluster {name!r} is already up ({hosts} hosts, state {path}); run {down} first")
    leftovers = [ns for ns in netns_names() if _owned(name, ns)]
    if leftovers or path.exists():
        found = ", ".join(leftovers) or str(path)
        raise ClusterError(f"cluster {name!r} is already up (found {found}); run {down} first")


def _build_switch(c: Cluster) -> None:
    sw = c.switch_ns
    _run(["ip", "netns", "add", sw])
    _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
    # addrgenmode none: no IPv6 link-local address, so the switch has no address at all and
    # no neighbour discovery chatter lands on the byte counters.
    _run(["ip", "-n", sw, "link", "set", "br0", "addrgenmode", "none"])
    _run(["ip", "-n", sw, "link", "set", "br0", "up"])


def _build_host(c: Cluster, i: int) -> None:
    ns, sw, port, eth = c.host_ns[i], c.switch_ns, c.port(i), c.interface
    _run(["ip", "netns", "add", ns])
    _run(["ip", "link", "add", eth, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw])
    _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "addrgenmode", "none"])
    _run(["ip", "-n", sw, "link", "set", port, "up"])
    _run(["ip", "-n", ns, "link", "set", eth, "addrgenmode", "none"])
    _run(["ip", "-n", ns, "addr", "add", f"{c.addresses[i]}/24", "dev", eth])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", ns, "link", "set", eth, "up"])
    _shape_host(c, i)


def _shape_host(c: Cluster, i: int) -> None:
    """tbf on both ends of host ``i``'s link; netem (delay, then tbf) on its egress with
    ``--inter-delay``; tbf on its ``lo`` with ``--intra-rate``."""
    spec, ns = c.spec, c.host_ns[i]
    rate = rate_bytes_per_s(spec.inter_rate)
    egress = ["tc", "-n", ns, "qdisc", "add", "dev", c.interface]
    if spec.inter_delay is None:
        _run([*egress, "root", *_tbf(rate)])
    else:  # the layout of tc-netem(8)'s "delay, then rate limit" example: netem root, tbf child
        _run([*egress, "root", "handle", "1:", *_netem(spec.inter_delay, rate)])
        _run([*egress, "parent", "1:1", "handle", "10:", *_tbf(rate)])
    _run(["tc", "-n", c.switch_ns, "qdisc", "add", "dev", c.port(i), "root", *_tbf(rate)])
    if spec.intra_rate is not None:
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", *_tbf(rate_bytes_per_s(spec.intra_rate))])


def cluster_up(spec: ClusterSpec, state_dir: Path | None = None) -> Cluster:
    """Make the emulated cluster ``spec`` describes (see the module docstring) and return it.

    The state file is written (status ``starting``) before the first namespace is made, so
    :func:`cluster_down` can clean up after a crash; if making fails midway (or is
    interrupted), what was made is removed and the error re-raised.

    Raises:
        ClusterError: not root, ``ip``/``tc`` missing, the name already up, ``--inter-delay``
            without netem in the kernel, or an ``ip``/``tc`` command failed. In the first four
            cases nothing is created.
    """
    _require_root("loomtrain cluster up")
    state_dir = Path(state_dir or default_state_dir())
    path = state_path(spec.name, state_dir)
    _refuse_if_up(spec.name, path)
    if spec.inter_delay is not None:
        _check_netem(spec.name)
    cluster = _plan(spec, path, choose_subnet(spec.name, _subnets_in_use(state_dir)))
    _write_state(cluster, "starting")
    try:
        _build_switch(cluster)
        for i in range(spec.hosts):
            _build_host(cluster, i)
        _write_state(cluster, "up")
    except BaseException:
        cluster_down(spec.name, state_dir)
        raise
    return cluster


def _stop_processes(namespaces: list[str], grace_s: float = 2.0) -> None:
    """SIGTERM every process in ``namespaces``, then SIGKILL those left after ``grace_s``; waits
    until none is left, since a live process would keep its namespace (and veth) alive."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _signal_all([p for ns in namespaces for p in pids_in_netns(ns)], sig):
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(pids_in_netns(ns) for ns in namespaces):
            time.sleep(0.05)


def cluster_down(name: str = "loom", state_dir: Path | None = None) -> list[str]:
    """Remove cluster ``name``: stop its processes, delete its namespaces (which deletes their
    veths and qdiscs) and its state file. Idempotent.

    Removes the namespaces the state file lists and every namespace named ``lt-<name>-...``,
    so it also cleans up after a crashed ``up`` or a lost state file.

    Returns:
        The namespaces removed (empty if none was there).
    Raises:
        ClusterError: bad name, not root, or ``ip netns del`` failed.
    """
    _require_root("loomtrain cluster down")
    path = state_path(name, state_dir)
    present = netns_names()
    recorded = _read_state(path) or {}
    wanted = {*recorded.get("host_ns", []), recorded.get("switch_ns"), *(ns for ns in present if _owned(name, ns))}
    # hosts before the switch: each host's veth then goes with its own namespace
    namespaces = sorted((ns for ns in present if ns in wanted), key=lambda ns: ns.endswith("-sw"))
    _stop_processes(namespaces)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns])
    path.unlink(missing_ok=True)
    return namespaces


@contextmanager
def emulated_cluster(spec: ClusterSpec, state_dir: Path | None = None) -> Iterator[Cluster]:
    """:func:`cluster_up` for the ``with`` block; :func:`cluster_down` on leaving it, also on an
    exception or ``KeyboardInterrupt``."""
    cluster = cluster_up(spec, state_dir)
    try:
        yield cluster
    finally:
        cluster_down(spec.name, state_dir)
