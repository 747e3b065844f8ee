"""A federated run as real processes on this host: one Flower SuperLink, one SuperNode per client.

``loomtrain fl run --deployment`` starts ``flower-superlink`` and ``--clients`` ``flower-supernode``
processes (each with its ``partition-id`` node config), writes a Flower App whose components are
loomtrain's :data:`loomtrain.federated.server.app` and :data:`loomtrain.federated.client.app`, submits
it with ``flwr run`` and stops every process it started afterwards. Flower 1.42 serves the SuperLink's
Fleet, Control and ServerAppIo APIs on one HTTP port (``--port``) and starts a fresh ``flwr-clientapp``
process for every message, so each message costs a process start (seconds): plaintext and CKKS runs
work; masking does not, because a client's masking secrets live in its process between the four
message rounds (:mod:`loomtrain.federated.client`), and it is refused.

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


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    """A Flower process in its own session, so stopping it also stops the helpers it spawns (superexec)."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent, start_new_session=True
        )


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _write_app(settings: FLSettings, flower: Path, port: int) -> Path:
    """The Flower App directory and the Flower config naming our SuperLink; returns the app directory."""
    app = flower / "app"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(_APP_TOML.replace("{settings}", json.dumps(json.dumps(_as_dict(settings)))))
    config = flower / ".flwr" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    return app


def _as_dict(settings: FLSettings) -> dict:
    d = dataclasses.asdict(settings)
    d["out"], d["keys"] = str(Path(d["out"]).resolve()), str(Path(d["keys"]).resolve()) if d["keys"] else ""
    return d


def run_deployment(settings: FLSettings) -> ServerState:
    """Run ``settings`` over real SuperLink/SuperNode processes on localhost; the final server state.

    Raises:
        ValueError: ``--secure mask`` (see the module docstring).
        FederatedError: ``flwr run`` failed or left no state (its output is in ``<out>/flower/run.log``).
    """
    if settings.secure == "mask":
        raise ValueError(
            "--deployment with --secure mask: Flower 1.42 starts a new ClientApp process per message, so masking "
            "secrets do not survive between its message rounds; use the simulation"
        )
    flower = Path(settings.out).resolve() / "flower"
    flower.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "HOME": str(flower), "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    app = _write_app(settings, flower, port)
    # No --database: the SuperLink keeps its state in memory.
    link = [
        f"{bin_dir}/flower-superlink",
        "--insecure",
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    procs = [_start(link, flower / "superlink.log", env)]
    try:
        time.sleep(3)
        for i in range(settings.clients):
            config = f"partition-id={i} num-partitions={settings.clients}"
            node = [f"{bin_dir}/flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                    "--port", str(_free_port()), "--node-config", config]  # fmt: skip
            procs.append(_start(node, flower / f"supernode_{i}.log", env))
        with open(flower / "run.log", "wb") as log:
            submit = [f"{bin_dir}/flwr", "run", str(app), "local", "--stream"]
            done = subprocess.run(submit, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=app,
                                  timeout=settings.timeout_s * 10)  # fmt: skip
    finally:
        _stop(procs)
    state = load_state(Path(settings.out))
    if done.returncode != 0 or state is None or state.round < settings.rounds:
        raise FederatedError(f"the deployment run ended at round {state.round if state else 0} of {settings.rounds}; "
                             f"see {flower}/run.log and the *.log beside it")  # fmt: skip
    return state
