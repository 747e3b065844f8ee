"""Running federated jobs: Flower's simulation (default), the final model, the centralized baseline, plots.

The simulation (``flwr.simulation.run_simulation``, Ray backend) runs every ClientApp in one Ray
actor: the machine is shared and the clients' masking secrets must stay in one process between
message rounds (see :mod:`loomtrain.federated.client`). Ray's start-up (about 10 s) is paid once
per call, so :func:`simulate` takes several runs and plays them one after another on the same clients.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from loomtrain.federated.settings import FLSettings
from loomtrain.federated.state import ServerState, load_state
from loomtrain.federated.wire import FederatedError

log = logging.getLogger(__name__)


def prepare(settings: FLSettings) -> FLSettings:
    """Validate ``settings``; under ``ckks`` without ``--keys``, write keys into ``<out>/keys`` (the
    ``loomtrain fl keys`` step done for you) and point ``keys`` there. Returns ``settings``.

    Raises:
        ValueError: invalid settings; ``--keys`` given but holding no ``server.ctx``.
    """
    settings.validate()
    if settings.secure != "ckks":
        return settings
    from loomtrain.federated.secure import ckks

    if not settings.keys:
        settings.keys = str(Path(settings.out) / "keys")
        if not (Path(settings.keys) / f"client_{settings.clients - 1}.ctx").is_file():
            ckks.write_keys(Path(settings.keys), settings.clients)
    if not (Path(settings.keys) / "server.ctx").is_file():
        raise ValueError(f"--keys {settings.keys}: no server.ctx there; run `loomtrain fl keys --clients "
                         f"{settings.clients} --out {settings.keys}` first")  # fmt: skip
    return settings


def simulate(runs: list[FLSettings], raise_errors: bool = True) -> list[ServerState | Exception]:
    """Run each of ``runs`` (all with the same ``clients``) in one Flower simulation; their final states
    (with ``raise_errors=False``, the exception of a run that failed stands in its place).

    Raises:
        ValueError: runs with different client counts, or invalid settings.
        FederatedError (or the run's own exception): with ``raise_errors``, the first run that failed.
    """
    from flwr.simulation import run_simulation

    from loomtrain.federated.client import app as client_app
    from loomtrain.federated.server import make_server_app

    if len({s.clients for s in runs}) != 1:
        raise ValueError("simulate: every run of one simulation must have the same --clients")
    for s in runs:
        prepare(s)
    results: list = []
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    backend = {"init_args": {"num_cpus": 1, "logging_level": "ERROR", "log_to_driver": True},
               "client_resources": {"num_cpus": 1}}  # fmt: skip
    run_simulation(make_server_app(runs, results), client_app, num_supernodes=runs[0].clients, backend_config=backend)
    if len(results) != len(runs):
        raise FederatedError(f"the simulation ended after {len(results)} of {len(runs)} runs; see Flower's log above")
    for outcome in results:
        if raise_errors and isinstance(outcome, Exception):
            raise outcome
    return results


def final_params(settings: FLSettings, state: ServerState | None = None) -> np.ndarray:
    """The global model (float32 ``[N]``) a run ended with. Under ``ckks`` the server's state holds only
    ciphertexts: this decrypts them with client 0's key, as a client (not the server) would.

    Raises:
        FileNotFoundError: no state in ``settings.out``.
    """
    state = state or load_state(Path(settings.out))
    if state is None:
        raise FileNotFoundError(f"{settings.out}: no server_state.npz; run `loomtrain fl run --out {settings.out}`")
    if state.ciphertexts is None:
        return state.params
    from loomtrain.federated.client import cached_task
    from loomtrain.federated.secure import ckks

    size = sum(
        p.numel() for p in cached_task(settings.task, settings.clients, settings.seed).build_model().parameters()
    )
    ctx = ckks.load_context(Path(settings.keys) / "client_0.ctx")
    return np.asarray(ckks.decrypt_mean(ctx, state.ciphertexts, size), np.float32)


def evaluate_params(settings: FLSettings, params: np.ndarray):
    """The task's :class:`~loomtrain.federated.tasks.Evaluation` of the flat model ``params``."""
    from loomtrain.federated.client import cached_task, load_flat

    task = cached_task(settings.task, settings.clients, settings.seed)
    model = task.build_model()
    load_flat(model, params, 0)
    return task.evaluate(model)


def centralized(settings: FLSettings) -> np.ndarray:
    """Baseline: one party holding all the data trains ``rounds · local_steps`` steps with the same
    optimiser and batch size; returns its flat model."""
    from loomtrain.federated.client import cached_task, local_train

    task = cached_task(settings.task, settings.clients, settings.seed)
    steps = FLSettings(**{**settings.__dict__, "local_steps": settings.rounds * settings.local_steps})
    return local_train(task, None, None, steps, 0).params


def read_metrics(out: str | Path) -> list[dict]:
    """The accounting rows (one per round) of a run directory's ``metrics.jsonl``."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(runs: dict[str, str | Path], path: str | Path) -> Path:
    """Two panels into ``path`` (PNG): test accuracy vs round per run, and mean upload bytes per client
    per round per run (label → run directory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, size) = plt.subplots(1, 2, figsize=(10, 4))
    for label, out in runs.items():
        rows = read_metrics(out)
        acc.plot([r["round"] for r in rows], [r["test_accuracy"] for r in rows], marker="o", label=label)
        size.bar(label, np.mean([np.mean(list(r["bytes_up"].values())) for r in rows]))
    acc.set(xlabel="round", ylabel="test accuracy", title="accuracy vs round")
    acc.legend()
    size.set(ylabel="bytes up per client per round", title="bytes vs method", yscale="log")
    size.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
