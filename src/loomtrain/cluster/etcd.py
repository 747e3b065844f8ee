"""A rendezvous that survives the loss of any one host: an etcd cluster with one member per
emulated host, for torchrun's ``etcd-v2`` rendezvous backend.

torchrun's c10d rendezvous keeps its state in a TCP store inside host 0's agent, so losing
host 0 ends the job (``RendezvousConnectionError``). Here every host runs an etcd member
(etcd(1), Raft consensus: Ongaro and Ousterhout, "In Search of an Understandable Consensus
Algorithm", USENIX ATC 2014) listening only on its host's address, and every host's agent
talks to its *own* member (``--rdzv-endpoint=<own address>:2379``). With 3 members, losing any
one host leaves 2, a quorum, reachable from every survivor, which elects a new leader
within the election timeout (1 s, etcd's default) and carries on.

torchrun's ``etcd-v2`` backend (``torch.distributed.elastic.rendezvous.etcd_rendezvous_backend``)
speaks etcd's v2 API through the ``python-etcd`` client (``import etcd``); etcd 3.4 serves
that API only with ``--enable-v2``. After each rendezvous the workers bootstrap from a TCP store
in the rank-0 worker of that round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), whose address
the agents exchange through etcd, so a round after a host loss needs only the survivors.

Members are started with :meth:`Cluster.popen` inside their hosts, checked healthy (each
member's ``/health`` is ``true`` once it has a leader) from inside the same host, and stopped
on leaving :func:`etcd_members`, which deletes their data directories; they also die with the
launcher (``PR_SET_PDEATHSIG``) if it is SIGKILLed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loomtrain.cluster.emulated import Cluster, ClusterError
from loomtrain.launch import die_with_parent

CLIENT_PORT = 2379  # IANA-registered etcd client port (etcd(1) --listen-client-urls default)
PEER_PORT = 2380  # IANA-registered etcd peer port (--listen-peer-urls default)
HEALTH_TIMEOUT_S = 30.0
MIN_HOSTS = 3  # fewer members keep no quorum once one is lost (quorum of n is n // 2 + 1)
INSTALL = "apt-get install etcd-server (Debian/Ubuntu: etcd 3.4) and pip install python-etcd"
FLAG = "--distributed.rendezvous=etcd"
ROOT_PREFIX = "loomtrain-etcd-"
# Polls a member's /health from inside its host until it reports a leader or the deadline passes;
# no proxy, since an http_proxy from the environment cannot reach an emulated host's address.
_PROBE = """
import json, sys, time, urllib.request
url, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
while time.monotonic() < deadline:
    try:
        with opener.open(url, timeout=1) as r:
            if json.load(r).get("health") == "true":
                sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.1)
sys.exit(1)
"""


def missing_etcd() -> str | None:
    """``None`` if etcd rendezvous can run here, else what is missing and the install command.

    Needs the ``etcd`` server binary on ``PATH`` and the ``etcd`` Python module (python-etcd),
    which torchrun's ``etcd-v2`` backend imports, in this interpreter (the agents run it too).
    """
    missing = []
    if shutil.which("etcd") is None:
        missing.append("the `etcd` binary is not on PATH")
    if importlib.util.find_spec("etcd") is None:
        missing.append(f"the `etcd` Python module (python-etcd) is not installed for {sys.executable}")
    return None if not missing else f"{FLAG} needs etcd: {'; '.join(missing)}; install with: {INSTALL}"


@dataclass(frozen=True)
class EtcdMember:
    """One etcd member, run inside emulated host ``host``.

    Attributes:
        host: the emulated host it runs in.
        name: its member name (``--name``), ``h<host>``.
        address: the host's IPv4 address; the member listens there only.
        data_dir: its ``--data-dir`` (WAL and snapshots), deleted when it stops.
    """

    host: int
    name: str
    address: str
    data_dir: Path

    @property
    def client_url(self) -> str:
        """Where clients (the host's torchrun agent) reach it: ``http://ADDRESS:2379``."""
        return f"http://{self.address}:{CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        """Where the other members reach it (Raft traffic): ``http://ADDRESS:2380``."""
        return f"http://{self.address}:{PEER_PORT}"

    @property
    def endpoint(self) -> str:
        """``ADDRESS:2379``, for torchrun's ``--rdzv-endpoint``."""
        return f"{self.address}:{CLIENT_PORT}"


def plan_members(cluster: Cluster, root: Path) -> list[EtcdMember]:
    """One member per host of ``cluster``, with data directories under ``root``.

    Raises:
        ClusterError: the cluster has fewer than 3 hosts (no quorum would survive a loss).
    """
    hosts = cluster.spec.hosts
    if hosts < MIN_HOSTS:
        raise ClusterError(f"{FLAG} needs a cluster of at least {MIN_HOSTS} hosts (cluster '{cluster.spec.name}' "
                           f"has {hosts}): with fewer, losing one leaves no etcd quorum; use "
                           "--distributed.rendezvous=c10d or a larger cluster")  # fmt: skip
    return [EtcdMember(i, f"h{i}", cluster.address(i), root / f"h{i}") for i in range(hosts)]


def member_argv(member: EtcdMember, members: list[EtcdMember], token: str) -> list[str]:
    """The etcd(1) command line of ``member`` in the static bootstrap of ``members`` (etcd docs,
    "Clustering Guide", static): v2 API on, client and peer URLs on the host's address only,
    ``token`` (``--initial-cluster-token``) unique per job so two jobs' members never join."""
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    return ["etcd", "--name", member.name, "--data-dir", str(member.data_dir), "--enable-v2=true",
            "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", token,
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]  # fmt: skip


def _data_parent() -> Path:
    """Where data roots go: ``/dev/shm`` where writable, else the temporary directory. etcd fsyncs
    every write; on tmpfs that costs nothing, and the data lives only as long as the job."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _data_root() -> Path:
    """A fresh directory ``loomtrain-etcd-<pid>-*`` for the members' data. Roots whose launcher
    is gone (SIGKILLed before it could delete them; on tmpfs they hold memory) are deleted first."""
    parent = _data_parent()
    for old in parent.glob(f"{ROOT_PREFIX}*-*"):
        pid = old.name.removeprefix(ROOT_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=parent))


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _start(cluster: Cluster, members: list[EtcdMember], token: str, root: Path) -> list[subprocess.Popen]:
    """Start every member inside its host, its stderr in ``root/<name>.log``."""
    procs = []
    for m in members:
        m.data_dir.mkdir(mode=0o700)
        with open(root / f"{m.name}.log", "wb") as log:
            procs.append(cluster.popen(m.host, member_argv(m, members, token), stdout=log, stderr=log,
                                       preexec_fn=die_with_parent))  # fmt: skip
    return procs


def wait_healthy(cluster: Cluster, members: list[EtcdMember], procs: list[subprocess.Popen], root: Path,
                 timeout_s: float = HEALTH_TIMEOUT_S) -> None:  # fmt: skip
    """Wait until every member reports ``/health`` true from inside its own host (it has joined
    the cluster and sees a leader).

    Raises:
        ClusterError: a member exited, or not all were healthy within ``timeout_s`` seconds; the
            message names the member and the end of its log.
    """
    probes = [cluster.popen(m.host, [sys.executable, "-c", _PROBE, f"{m.client_url}/health", str(timeout_s)])
              for m in members]  # fmt: skip
    try:
        while any(p.poll() is None for p in probes):
            for m, proc in zip(members, procs, strict=True):
                if proc.poll() is not None:
                    raise ClusterError(f"etcd member {m.name} (host {m.host}) exited with status {proc.returncode} "
                                       f"while starting: {_log_tail(root / f'{m.name}.log')}")  # fmt: skip
            time.sleep(0.05)
        sick = [m for m, p in zip(members, probes, strict=True) if p.returncode != 0]
        if sick:
            m = sick[0]
            raise ClusterError(f"etcd member {m.name} at {m.client_url} was not healthy within {timeout_s:g} s "
                               f"({len(sick)} of {len(members)} not): {_log_tail(root / f'{m.name}.log')}")  # fmt: skip
    finally:
        for p in probes:
            if p.poll() is None:
                p.kill()
                p.wait()


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every member still running and reap it. Not SIGTERM: a member's data is deleted
    next, so a clean stop saves nothing, and a leader stopping with a peer gone first tries for
    seconds to hand its leadership over."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@contextmanager
def etcd_members(cluster: Cluster, token: str, timeout_s: float = HEALTH_TIMEOUT_S) -> Iterator[list[EtcdMember]]:
    """Run one etcd member per host of ``cluster`` for the ``with`` block; yields the healthy
    members (host ``i``'s agent uses ``members[i].endpoint``). On leaving, also on an error or
    Ctrl-C, every member is stopped and the data directories are deleted.

    Raises:
        ClusterError: etcd or python-etcd missing (naming the install command), fewer than 3
            hosts, or a member that did not start or become healthy within ``timeout_s``.
    """
    missing = missing_etcd()
    if missing is not None:
        raise ClusterError(missing)
    root = _data_root()
    procs: list[subprocess.Popen] = []
    try:
        members = plan_members(cluster, root)
        procs = _start(cluster, members, token, root)
        wait_healthy(cluster, members, procs, root, timeout_s)
        yield members
    finally:
        stop(procs)
        shutil.rmtree(root, ignore_errors=True)
