"""Losing the host that started an elastic job, rendezvous included (issue #23, item 1): with
``--distributed.rendezvous=etcd`` every emulated host runs an etcd member and its agent talks to
its own member, so the survivors of any one host keep a quorum and the job goes on.

Skipped, with the reason, without root and namespaces, or without etcd and python-etcd.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loomtrain.checkpoint import find_latest_checkpoint
from loomtrain.cluster.emulated import missing_requirements, pids_in_netns
from loomtrain.cluster.etcd import CLIENT_PORT, ROOT_PREFIX, _data_parent, etcd_members, missing_etcd
from tests.integration.test_multihost import audit, cluster, wait_for_logged_step, world_sizes
from tests.integration.test_train import TINY

pytestmark = [
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
    pytest.mark.skipif(missing_etcd() is not None, reason=str(missing_etcd())),
]

# Writes KEY=VALUE through the etcd member at argv[1] (v2 API, as torchrun's backend does) and
# reads back every key it is given, printing them; run inside one emulated host. A write that
# reached a leader just lost times out (etcd: "request timed out, possibly due to previous leader
# failure"), so writes are tried for up to 30 s: a quorum must then have elected a new leader.
CLIENT = """
import sys, time, etcd
host, port = sys.argv[1].split(":")
client = etcd.Client(host=host, port=int(port), read_timeout=10)
deadline = time.monotonic() + 30
while True:
    try:
        client.write("/t/" + sys.argv[2], sys.argv[3])
        break
    except etcd.EtcdException:
        if time.monotonic() > deadline:
            raise
print(",".join(client.read("/t/" + k, quorum=True).value for k in sys.argv[4:]))
"""


# Makes the member at argv[1] the etcd leader (v3 API through etcd's JSON gateway,
# Maintenance.MoveLeader, sent to the current leader) and waits until it leads; argv[2:] are the
# client URLs of every live member. Retries while there is no leader (an election under way).
LEAD = """
import json, sys, time, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def call(url, path, body):
    request = urllib.request.Request(url + path, json.dumps(body).encode(), method="POST")
    with opener.open(request, timeout=10) as r:
        return json.load(r)
def leads(url):
    status = call(url, "/v3/maintenance/status", {})
    return status.get("leader") == status["header"]["member_id"]  # no "leader" during an election
target = call(sys.argv[1], "/v3/maintenance/status", {})["header"]["member_id"]
deadline = time.monotonic() + 30
while not leads(sys.argv[1]):
    assert time.monotonic() < deadline, "leadership did not move"
    try:
        leader = next(u for u in sys.argv[2:] if leads(u))
        call(leader, "/v3/maintenance/transfer-leadership", {"targetID": target})
    except (OSError, StopIteration):
        pass
    time.sleep(0.1)
"""


# One rendezvous-state write and read through loomtrain's retrying backend around torchrun's
# etcd-v2 backend, at the member argv[1], issued when a line arrives on stdin: the moment the
# leader's host is lost, when a plain write times out ("request timed out, possibly due to
# previous leader failure").
RETRYING = """
import sys, etcd
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from loomtrain.cluster.etcd_backend import RetryingBackend
host, port = sys.argv[1].split(":")
backend = RetryingBackend(EtcdRendezvousBackend(etcd.Client(host=host, port=int(port), read_timeout=10), "r"))
print("ready", flush=True)
sys.stdin.readline()
_, _, written = backend.set_state(b"after the leader was lost")
assert written and backend.get_state()[0] == b"after the leader was lost"
"""


def write_as_the_leader_dies(c, writer: int, endpoint: str, leader: int) -> None:
    """Kill every process of host ``leader`` while a rendezvous write through ``endpoint``
    (from inside host ``writer``) is issued at the same moment; the write must succeed."""
    proc = subprocess.Popen(c.exec_argv(writer, [sys.executable, "-c", RETRYING, endpoint]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        c.kill_host(leader)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=90) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()


def make_leader(c, host: int, live: list[int]) -> None:
    """Move the etcd leadership to ``host``'s member, ``live`` the hosts whose members run. Before
    losing a host: the worst case (the survivors must elect a new leader, and writes in flight
    to the old one are lost). After: waits until the survivors have elected one."""
    url = {h: f"http://{c.address(h)}:{CLIENT_PORT}" for h in live}
    r = subprocess.run(c.exec_argv(host, [sys.executable, "-c", LEAD, url[host], *url.values()]),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


def etcd_client(c, host: int, endpoint: str, key: str, value: str, *read: str) -> str:
    """Write ``key`` and read ``read`` (quorum reads) through ``endpoint`` from inside ``host``."""
    r = subprocess.run(c.exec_argv(host, [sys.executable, "-c", CLIENT, endpoint, key, value, *read]),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def data_roots(pid: int) -> list[Path]:
    """The etcd data roots that process ``pid`` made."""
    return list(_data_parent().glob(f"{ROOT_PREFIX}{pid}-*"))


def test_members_form_one_cluster_that_outlives_any_host_and_leave_nothing(tmp_path):
    """Catches: members that do not form one cluster (a key written on host 1 missing on host 2),
    a cluster that loses its quorum with host 0 (writes on the survivors would fail), a
    rendezvous write issued while the survivors elect a new leader that fails instead of being
    retried (the agent would die), and members or data directories left behind."""
    with cluster(tmp_path, 3, 1) as c:
        with etcd_members(c, token="t") as members:
            ends = [m.endpoint for m in members]
            make_leader(c, 0, [0, 1, 2])
            assert etcd_client(c, 1, ends[1], "a", "1", "a") == "1"
            assert etcd_client(c, 2, ends[2], "b", "2", "a", "b") == "1,2"
            write_as_the_leader_dies(c, 1, ends[1], leader=0)
            make_leader(c, 2, [1, 2])
            assert etcd_client(c, 2, ends[2], "c", "3", "a", "c") == "1,3"
            assert etcd_client(c, 1, ends[1], "d", "4", "b", "c", "d") == "2,3,4"
            assert data_roots(os.getpid())
        assert not any(pids_in_netns(c.netns(h)) for h in range(3))
        assert not data_roots(os.getpid())


def train_with_etcd(c, tmp_path: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "LOOMTRAIN_CLUSTER_DIR": str(tmp_path / "clusters"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--cluster", c.spec.name, "--elastic", "--min-nodes=2",
           "--max-restarts=3", "--distributed.rendezvous=etcd", *TINY, "--training.global_batch_size=12",
           f"--training.steps={steps}", "--checkpoint.interval=4", "--metrics.record_samples=true",
           "--distributed.timeout_s=20", f"--run.out_dir={tmp_path}", "--run.name=job"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def stop_launcher(proc: subprocess.Popen) -> None:
    """SIGTERM first, so the launcher stops its etcd members and deletes their data itself."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_job_survives_losing_every_process_of_host_0(tmp_path):
    """Catches: an elastic job that dies with ``RendezvousConnectionError`` (or waits for ever)
    when the host it was started from, which served the rendezvous, is lost with its agent,
    workers and etcd member; the survivors not resuming from the last checkpoint, not
    finishing every step, or losing or repeating samples across the shrink."""
    steps, run = 24, tmp_path / "job"
    with cluster(tmp_path, 3, 1) as c:
        proc = train_with_etcd(c, tmp_path, steps)
        try:
            wait_for_logged_step(run, 6, proc)
            make_leader(c, 0, [0, 1, 2])
            assert c.kill_host(0)
            assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
        finally:
            stop_launcher(proc)
        assert not any(pids_in_netns(c.netns(h)) for h in range(3)), "etcd or agents outlived the launcher"
    assert find_latest_checkpoint(run / "checkpoints").name == f"step_{steps:08d}"
    assert world_sizes(run)[0] == 3 and world_sizes(run)[-1] == 2
    audit(run, steps)
    assert not data_roots(proc.pid)
