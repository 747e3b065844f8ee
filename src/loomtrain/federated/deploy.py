"""A federated run as real processes on this host: one Flower SuperLink, one SuperNode per client.

``loomtrain fl run --deployment`` starts ``flower-superlink`` and ``--clients`` ``flower-supernode``
processes (each with its ``partition-id`` node config), writes a Flower App whose components are
loomtrain's :data:`loomtrain.federated.server.app` and :data:`loomtrain.federated.client.app`, submits
it with ``flwr run`` and stops every process it started afterwards. Flower 1.42 serves the SuperLink's
Fleet, Control and ServerAppIo APIs on one HTTP port (``--port``) and starts a fresh ``flwr-clientapp``
process for every message, so each message costs a process start (seconds). Masking's four message
rounds keep a client's secrets between them in its node's ``context.state``, which the SuperNode
carries from one ClientApp process to the next (:mod:`loomtrain.federated.client`).

With ``cluster`` (``--cluster NAME``: an emulated cluster that ``loomtrain cluster up`` made,
docs/cluster.md) the processes run on its hosts instead of localhost: the SuperLink and ``flwr run``
on host 0, client ``i``'s SuperNode on host ``1 + i mod (hosts - 1)`` (host 0 too when the cluster
has one host), so every message between the server and a client crosses that client's shaped
link; the bytes each link carried are written to ``<out>/links.json``.

Flower's own state (``~/.flwr``) goes under ``<out>/flower`` (``HOME`` of the processes), its logs
into ``<out>/flower/*.log``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from loomtrain.federated.settings import FLSettings
from loomtrain.federated.state import ServerState, load_state
from loomtrain.federated.wire import FederatedError

_APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "loomtrain-fl"
version = "1.0.0"
description = "loomtrain federated run"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "loomtrain"

[tool.flwr.app.components]
serverapp = "loomtrain.federated.server:app"
clientapp = "loomtrain.federated.client:app"

[tool.flwr.app.config]
settings = {settings}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Placement:
    """Where each Flower process runs: this host's loopback, or an emulated cluster's hosts."""

    def __init__(self, cluster=None) -> None:
        self.cluster = cluster

    def host_of_client(self, client: int) -> int:
        hosts = len(self.cluster.host_ns) if self.cluster else 1
        return 1 + client % (hosts - 1) if hosts > 1 else 0

    def address(self, host: int) -> str:
        return self.cluster.address(host) if self.cluster else "127.0.0.1"

    def argv(self, host: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``host`` (inside its network namespace for a cluster, which keeps the environment)."""
        return self.cluster.exec_argv(host, cmd) if self.cluster else cmd

    def start(self, host: int, cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
        """A Flower process in its own session, so stopping it also stops the helpers it spawns (superexec)."""
        with open(log, "wb") as f:
            return subprocess.Popen(self.argv(host, cmd), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                    start_new_session=True)  # fmt: skip

    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """Per host, the bytes its link carried so far (host → switch, switch → host); empty on localhost."""
        return {h: self.cluster.link_bytes(h) for h in range(len(self.cluster.host_ns))} if self.cluster else {}


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _write_app(settings: FLSettings, flower: Path, address: str) -> Path:
    """The Flower App directory and the Flower config naming our SuperLink; returns the app directory."""
    app = flower / "app"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(_APP_TOML.replace("{settings}", json.dumps(json.dumps(_as_dict(settings)))))
    config = flower / ".flwr" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{address}"\ninsecure = true\n')
    return app


def _as_dict(settings: FLSettings) -> dict:
    d = dataclasses.asdict(settings)
    d["out"], d["keys"] = str(Path(d["out"]).resolve()), str(Path(d["keys"]).resolve()) if d["keys"] else ""
    return d


def run_deployment(settings: FLSettings, cluster=None) -> ServerState:
    """Run ``settings`` over real SuperLink/SuperNode processes, on localhost or on the hosts of
    ``cluster`` (a :class:`loomtrain.cluster.emulated.Cluster`; module docstring); the final server state.

    Raises:
        FederatedError: ``flwr run`` failed or left no state (its output is in ``<out>/flower/run.log``).
    """
    flower = Path(settings.out).resolve() / "flower"
    flower.mkdir(parents=True, exist_ok=True)
    where, port = _Placement(cluster), _free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "HOME": str(flower), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    app = _write_app(settings, flower, f"{where.address(0)}:{port}")
    before = where.link_bytes()
    procs = _start_flower(settings, where, port, flower, env, bin_dir)
    try:
        with open(flower / "run.log", "wb") as log:
            submit = where.argv(0, [f"{bin_dir}/flwr", "run", str(app), "local", "--stream"])
            done = subprocess.run(submit, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=app,
                                  timeout=settings.timeout_s * 10)  # fmt: skip
    finally:
        _stop(procs)
    _write_link_bytes(settings, where, before)
    state = load_state(Path(settings.out))
    if done.returncode != 0 or state is None or state.round < settings.rounds:
        raise FederatedError(f"the deployment run ended at round {state.round if state else 0} of {settings.rounds}; "
                             f"see {flower}/run.log and the *.log beside it")  # fmt: skip
    return state


def _start_flower(settings: FLSettings, where: _Placement, port: int, flower: Path, env: dict, bin_dir: str) -> list:
    """The SuperLink on host 0 (its state in memory: no ``--database``) and one SuperNode per client,
    Flower's commands from ``bin_dir``."""
    link = [
        f"{bin_dir}/flower-superlink",
        "--insecure",
        "--host",
        where.address(0),
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    procs = [where.start(0, link, flower / "superlink.log", env)]
    try:
        time.sleep(3)
        for i in range(settings.clients):
            config = f"partition-id={i} num-partitions={settings.clients}"
            node = [f"{bin_dir}/flower-supernode", "--insecure", "--superlink", f"{where.address(0)}:{port}",
                    "--port", str(_free_port()), "--node-config", config]  # fmt: skip
            procs.append(where.start(where.host_of_client(i), node, flower / f"supernode_{i}.log", env))
    except BaseException:
        _stop(procs)
        raise
    return procs


def _write_link_bytes(settings: FLSettings, where: _Placement, before: dict[int, tuple[int, int]]) -> None:
    """``<out>/links.json``: per emulated host, the bytes its link carried during the run, each way."""
    after = where.link_bytes()
    if not after:
        return
    carried = {
        h: {"up": after[h][0] - before[h][0], "down": after[h][1] - before[h][1],
            "clients": [c for c in range(settings.clients) if where.host_of_client(c) == h]}
        for h in after
    }  # fmt: skip
    (Path(settings.out) / "links.json").write_text(json.dumps(carried, indent=1))
