"""The command lines of etcd rendezvous on an emulated cluster (``loomtrain.cluster.etcd``,
``launch.cluster_commands``), checked without starting anything."""

from __future__ import annotations

import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from loomtrain.cluster.emulated import Cluster, ClusterError, ClusterSpec
from loomtrain.cluster.etcd import member_argv, missing_etcd, plan_members
from loomtrain.cluster.etcd_backend import RetryingBackend, create_retrying_handler
from loomtrain.launch import ETCD_BACKEND, cluster_commands


def planned(hosts: int) -> Cluster:
    """A cluster description as ``cluster_up`` plans it (nothing is made)."""
    spec = ClusterSpec(hosts=hosts, procs_per_host=2, name="u")
    return Cluster(spec, "lt-u-sw", [f"lt-u-h{i}" for i in range(hosts)],
                   [f"198.18.9.{i + 1}" for i in range(hosts)], Path("/nonexistent/u.json"))  # fmt: skip


def flag(argv: list[str], name: str) -> str:
    """The value of ``name VALUE`` or ``name=VALUE`` in ``argv``."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def test_each_member_listens_on_its_own_host_only_and_knows_all_peers(tmp_path):
    """Catches: a member listening on every address (0.0.0.0) or on another host's, a peer list
    missing a member (the cluster would never reach quorum), the v2 API left off (torchrun's
    etcd-v2 backend gets 404s), and data directories outside the job's own root."""
    members = plan_members(planned(3), tmp_path)
    peers = "h0=http://198.18.9.1:2380,h1=http://198.18.9.2:2380,h2=http://198.18.9.3:2380"
    for i, m in enumerate(members):
        argv = member_argv(m, members, "job-7")
        assert argv[0] == "etcd" and flag(argv, "--enable-v2") == "true"
        for name in ("--listen-client-urls", "--advertise-client-urls"):
            assert flag(argv, name) == f"http://198.18.9.{i + 1}:2379"
        for name in ("--listen-peer-urls", "--initial-advertise-peer-urls"):
            assert flag(argv, name) == f"http://198.18.9.{i + 1}:2380"
        assert flag(argv, "--initial-cluster") == peers
        assert flag(argv, "--initial-cluster-token") == "job-7"
        assert flag(argv, "--data-dir") == str(tmp_path / f"h{i}")
        assert flag(argv, "--name") == f"h{i}"


def test_each_agent_uses_its_own_hosts_member_through_etcd_v2():
    """Catches: every agent pointed at host 0's member (losing host 0 would cut the survivors off
    the rendezvous, as with c10d), the c10d backend or its ``is_host`` left in place."""
    c = planned(3)
    endpoints = [m.endpoint for m in plan_members(c, Path("/unused"))]
    for i, cmd in enumerate(cluster_commands(c, ["-m", "loomtrain.cli", "train"], None, "r", etcd_endpoints=endpoints)):
        assert cmd[:4] == ["ip", "netns", "exec", f"lt-u-h{i}"]
        assert flag(cmd, "--rdzv-backend") == "loomtrain-etcd"
        assert flag(cmd, "--rdzv-endpoint") == f"198.18.9.{i + 1}:2379"
        assert flag(cmd, "--local-addr") == f"198.18.9.{i + 1}"
        assert "is_host" not in flag(cmd, "--rdzv-conf")
    c10d = cluster_commands(c, ["-m", "loomtrain.cli", "train"], None, "r")
    assert {flag(cmd, "--rdzv-endpoint") for cmd in c10d} == {"198.18.9.1:29400"}


def test_too_few_hosts_are_refused():
    """Catches: etcd rendezvous accepted on 2 hosts, where losing either leaves no quorum (the
    job would die exactly as with c10d)."""
    with pytest.raises(ClusterError, match="at least 3 hosts"):
        plan_members(planned(2), Path("/unused"))


def test_missing_etcd_binary_names_the_install_command(monkeypatch, tmp_path):
    """Catches: a launch that starts agents although etcd is not installed (they would fail one
    by one with an opaque connection error) instead of one line naming the install command."""
    monkeypatch.setenv("PATH", str(tmp_path))
    message = missing_etcd()
    assert message is not None
    assert "--distributed.rendezvous=etcd" in message and "`etcd` binary" in message
    assert "apt-get install etcd-server" in message and "pip install python-etcd" in message


class FlakyBackend:
    """A rendezvous backend whose first ``failures`` calls fail as torchrun's etcd backend does
    while etcd has no leader; its state is a plain value."""

    def __init__(self, failures: int):
        self.failures, self.calls, self.state = failures, 0, None

    def _call(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise RendezvousConnectionError("The connection to etcd has failed.")

    def get_state(self):
        self._call()
        return self.state

    def set_state(self, state, token=None):
        self._call()
        self.state = (state, 1)
        return state, 1, True


def test_retrying_backend_rides_out_a_leader_election_but_not_a_lost_cluster():
    """Catches: a rendezvous read or write that fails during an etcd leader election ending the
    agent (torchrun's backend raises at once), and retries that never end when the cluster is
    really gone (the job would hang instead of failing)."""
    flaky = FlakyBackend(failures=3)
    backend = RetryingBackend(flaky, retry_s=5, pause_s=0.01)
    assert backend.set_state(b"s") == (b"s", 1, True) and flaky.calls == 4
    assert backend.get_state() == (b"s", 1)
    gone = RetryingBackend(FlakyBackend(failures=10**9), retry_s=0.2, pause_s=0.01)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        gone.get_state()
    assert time.monotonic() - start < 2


def test_an_etcd_call_gives_up_well_before_etcds_own_request_timeout(monkeypatch):
    """Catches: torchrun's 60 s etcd read timeout left in place. A member that lost its leader
    holds a call for etcd's request timeout (7 s), and the agent holds its rendezvous lock
    meanwhile: the survivors of a lost host saw their failed workers 7.4-7.7 s late instead of
    about 2 s (measured). A timeout the user sets (``--rdzv-conf read_timeout=N``) is kept."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters, etcd_rendezvous_backend

    seen = []

    def create_backend(params):
        seen.append(params.get_as_int("read_timeout", 60))
        return FlakyBackend(failures=0), HashStore()

    monkeypatch.setattr(etcd_rendezvous_backend, "create_backend", create_backend)
    create_retrying_handler(RendezvousParameters(ETCD_BACKEND, "198.18.9.1:2379", "r", 2, 3))
    create_retrying_handler(RendezvousParameters(ETCD_BACKEND, "198.18.9.1:2379", "r", 2, 3, read_timeout="9"))
    assert seen[0] <= 3 and seen[1] == 9, seen


def test_torchrun_finds_the_retrying_backend_by_name():
    """Catches: the ``torchrun.handlers`` entry point missing or misnamed, so the agents'
    ``--rdzv-backend loomtrain-etcd`` is unknown to torchrun."""
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401  (registers the plugins)
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    (plugin,) = [e for e in entry_points(group="torchrun.handlers") if e.name == ETCD_BACKEND]
    assert plugin.load()() is create_retrying_handler
    assert rendezvous_handler_registry._registry[ETCD_BACKEND] is create_retrying_handler
