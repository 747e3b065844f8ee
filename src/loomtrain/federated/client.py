"""The ClientApp: a site that trains a loomtrain model on its own data and sends only an update.

Message types it answers (Flower's ``<category>.<action>`` routing):

- ``query.hello``: its client id (partition) and example count;
- ``train.fit``: train from the global model; reply the update, plain (``--secure none``,
  compressed with error feedback) or encrypted (``ckks``: the weighted model under CKKS);
- ``train.mask_keys`` / ``train.mask_shares`` / ``train.mask_input`` / ``train.mask_unmask``: the
  four rounds of pairwise-mask secure aggregation (Bonawitz et al., CCS 2017, §4, Fig. 4), driving
  :class:`loomtrain.federated.secure.mask.MaskClient`;
- ``evaluate.global``: evaluate the global model (decrypting it under ``ckks``) on the task's
  held-out set.

Local training runs in this process, or with ``--local-procs k`` on ``k`` local gloo processes with
loomtrain's data parallelism (:func:`local_train`).
A client that cannot take part (no data, a global model of the wrong size) answers with a
``"rejected"`` record naming itself, which the server turns into a :class:`FederatedError`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from loomtrain.distributed.data_parallel import apply_data_parallel
from loomtrain.federated.compress import compress
from loomtrain.federated.settings import FLSettings
from loomtrain.federated.tasks import Task, build_task, task_loss
from loomtrain.federated.wire import arrays, unpack

app = ClientApp()


@functools.cache
def cached_task(name: str, n_clients: int, seed: int) -> Task:
    """The task, built once per process (the text task reads and tokenizes 5 MB of plays)."""
    return build_task(name, n_clients, seed)


def flat_params(model: nn.Module) -> np.ndarray:
    """All parameters of ``model`` in ``named_parameters`` order as float32 ``[N]``."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().astype(np.float32)


def load_flat(model: nn.Module, flat: np.ndarray, client: int) -> None:
    """Copy ``flat`` (float32 ``[N]``) into ``model``'s parameters.

    Raises:
        ValueError: ``flat`` has another size than the model (names ``client``).
    """
    n = sum(p.numel() for p in model.parameters())
    if flat.shape != (n,):
        raise ValueError(f"client {client}: the global model has {flat.size} parameters, this client's model {n}; "
                         "the server and clients must run the same --task and model")  # fmt: skip
    # A copy: vector_to_parameters makes the parameters views of its input, which training would overwrite.
    torch.nn.utils.vector_to_parameters(torch.tensor(flat, dtype=torch.float32), model.parameters())


@dataclass
class LocalResult:
    """Outcome of local training: ``params`` float32 ``[N]``, mean training ``loss`` (nats), ``seconds``."""

    params: np.ndarray
    loss: float
    seconds: float


def local_train(task: Task, client: int | None, start: np.ndarray | None, s: FLSettings, rnd: int) -> LocalResult:
    """``s.local_steps`` optimiser steps on ``client``'s data from the model ``start`` (``None``: the
    seeded initial model). ``client=None`` trains on all data (the centralized baseline).

    SGD for ``tabular``, AdamW (state fresh each round) for ``text``. With ``s.strategy == "fedprox"``
    the loss gains FedProx's proximal term ``μ/2·‖w − w_start‖²`` (Li et al., MLSys 2020, eq. 2).
    Batches are drawn from a generator seeded by (seed, round, client), so a round replays exactly.
    With ``s.local_procs > 1`` the client trains with loomtrain's data parallelism over that many
    local gloo processes (:func:`_data_parallel_rank`): each takes every ``k``-th row of each batch
    and the gradients are averaged, the same steps as one process up to float rounding.

    Raises:
        ValueError: the client has no data, or ``start`` does not fit the model (both name the client).
        RuntimeError, TimeoutError: a local process failed or hung (``local_procs > 1``; from ``spawn``).
    """
    t0 = time.perf_counter()
    if client is not None:
        task.check_client(client)
    if s.local_procs > 1:
        from loomtrain.distributed.spawn import spawn

        if (task.name, task.n_clients) != (s.task, s.clients):  # the local processes rebuild it from s
            raise ValueError(f"client {client}: task {task.name} over {task.n_clients} clients is not the "
                             f"settings' ({s.task} over {s.clients}); the local processes would differ")  # fmt: skip

        params, loss = spawn(_data_parallel_rank, s.local_procs, client, start, s, rnd, timeout_s=s.timeout_s)[0]
    else:
        params, loss = _train_steps(task, client, start, s, rnd)
    return LocalResult(params, loss, time.perf_counter() - t0)


def _data_parallel_rank(client: int | None, start: np.ndarray | None, s: FLSettings, rnd: int) -> tuple:
    """One local process of a client's data-parallel training (inside ``spawn``'s process group)."""
    torch.set_num_threads(1)
    return _train_steps(cached_task(s.task, s.clients, s.seed), client, start, s, rnd, parallel=True)


def _train_steps(task: Task, client: int | None, start: np.ndarray | None, s: FLSettings, rnd: int,
                 parallel: bool = False) -> tuple[np.ndarray, float]:  # fmt: skip
    """The loop of :func:`local_train`: ``(flat params, mean loss)``; with ``parallel``, this rank's rows of
    each batch, gradients averaged over the process group by :func:`apply_data_parallel`."""
    model = task.build_model()
    if start is not None:
        load_flat(model, start, client)
    sync = apply_data_parallel(model, dist.group.WORLD) if parallel else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = (torch.optim.SGD if task.name == "tabular" else torch.optim.AdamW)(model.parameters(), lr=s.lr)
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + rnd * 1009 + (client if client is not None else 997))
    losses = []
    for _ in range(s.local_steps):
        x, y = task.sample_batch(client, s.batch_size, gen)
        loss = task_loss(model, (x[rank::world], y[rank::world]))
        if s.strategy == "fedprox":
            loss = loss + s.proximal_mu / 2 * sum(
                (p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
            )
        if sync is None:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        if sync is not None:
            sync.finish_gradient_sync()  # .grad now holds the average over the ranks' rows
        opt.step()
        if sync is not None:
            sync.zero_grad()  # the protocol of distributed/sync.py: the buckets zeroed in place
        losses.append(loss.item())
    mean = torch.tensor(float(np.mean(losses)))
    if parallel:
        dist.all_reduce(mean)
        mean /= world
    return flat_params(model), float(mean)


def privatize(update: np.ndarray, s: FLSettings) -> np.ndarray:
    """Client-side Gaussian mechanism on an update (float32 ``[N]``): clip to L2 norm ``dp_clip`` and add
    N(0, (z·C)²/m) noise per coordinate, m = clients per round, so the noise of the mean is z·C/m as in
    DP-FedAvg (McMahan et al., ICLR 2018, Alg. 1). Flower's ``clip_inputs_inplace`` and
    ``add_gaussian_noise_inplace`` (flwr.supercore.differential_privacy) do the work."""
    from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, clip_inputs_inplace

    if s.dp_clip <= 0:
        return update
    out = [update.astype(np.float32, copy=True)]
    clip_inputs_inplace(out, s.dp_clip)
    if s.dp_noise > 0:
        add_gaussian_noise_inplace(out, s.dp_noise * s.dp_clip / np.sqrt(s.sampled()))
    return out[0]


def _identity(context: Context) -> int:
    """This client's id: Flower's ``partition-id`` node config (set by the simulation or ``--node-config``)."""
    return int(context.node_config["partition-id"])


def _reply(msg: Message, rnd: int, records: dict, client: int, **metrics) -> Message:
    """A reply carrying ``records`` plus a ``"metrics"`` record with the client id and ``metrics``."""
    content = RecordDict({**records, "metrics": ConfigRecord({"client": client, "round": rnd, **metrics})})
    return Message(content, reply_to=msg)


def _rejected(msg: Message, client: int, error: Exception) -> Message:
    return Message(RecordDict({"rejected": ConfigRecord({"client": client, "reason": str(error)})}), reply_to=msg)


def _start(msg: Message, context: Context, stage: str) -> tuple[FLSettings, int, int, Task]:
    """Settings, client id, round and task of a message; disconnects when fault injection says so."""
    s = FLSettings.from_config(msg.content["config"])
    client, rnd = _identity(context), int(msg.content["config"]["round"])
    if s.drops(client, rnd, stage):
        raise ConnectionAbortedError(f"client {client} disconnects at {stage} of round {rnd} (--drop)")
    return s, client, rnd, cached_task(s.task, s.clients, s.seed)


def key_path(s: FLSettings, context: Context, client: int) -> Path:
    """This client's CKKS key file: node config ``key-file`` if given, else ``<keys>/client_<id>.ctx``."""
    given = context.node_config.get("key-file")
    return Path(str(given)) if given else Path(s.keys) / f"client_{client}.ctx"


@functools.cache
def _ckks_context(path: Path):
    """This client's CKKS context (with the shared secret key), loaded once per process.

    Raises:
        ValueError: the key file is missing or not a context (names the file and the fix).
    """
    from loomtrain.federated.secure import ckks

    if not path.is_file():
        raise ValueError(f"CKKS key file {path} is missing; run `loomtrain fl keys --clients N --out DIR` and pass "
                         "--keys DIR (or the node config key-file)")  # fmt: skip
    return ckks.load_context(path)


def global_model(msg: Message, s: FLSettings, context: Context, client: int, size: int) -> np.ndarray | None:
    """The round's global model (float32 ``[N]``) from a message: plain ``"global"`` arrays, or the
    encrypted aggregate in ``"global_ct"`` decrypted with this client's key; ``None`` before round 1's
    aggregate exists (every party then starts from the seeded initial model)."""
    if "global" in msg.content:
        return unpack(msg.content["global"])["params"]
    if "global_ct" in msg.content:
        from loomtrain.federated.secure import ckks

        ctx = _ckks_context(key_path(s, context, client))
        return np.asarray(ckks.decrypt_mean(ctx, list(msg.content["global_ct"]["ct"]), size), np.float32)
    return None


def _model_size(task: Task) -> int:
    return sum(p.numel() for p in task.build_model().parameters())


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Introduce this client: its id and example count (FedAvg's weight)."""
    s, client, rnd, task = _start(msg, context, "hello")
    return _reply(msg, rnd, {}, client, n_examples=task.n_examples(client) if client < task.n_clients else 0)


@app.train("fit")
def fit(msg: Message, context: Context) -> Message:
    """Train locally and reply the update: compressed delta (plain) or CKKS ciphertexts of the model."""
    t0 = time.perf_counter()  # decryption, training, encryption/masking: all of the client's work
    s, client, rnd, task = _start(msg, context, "fit")
    try:
        ctx = _ckks_context(key_path(s, context, client)) if s.secure == "ckks" else None
        start = global_model(msg, s, context, client, _model_size(task))
        result = local_train(task, client, start, s, rnd)
    except ValueError as e:
        return _rejected(msg, client, e)
    weight = float(task.n_examples(client))
    base = start if start is not None else flat_params(task.build_model())
    if ctx is not None:
        from loomtrain.federated.secure import ckks

        share = float(msg.content["weight"]["share"])  # this client's share of the round's examples, <= 1
        # The model whose change from the global one is clipped and noised (every client starts from
        # the same global model, so the encrypted weighted sum is the global model plus the noised mean).
        params = base + privatize(result.params - base, s) if s.dp_clip > 0 else result.params
        ct = ckks.encrypt(ctx, params, share)
        records = {"update_ct": ConfigRecord({"ct": ct})}
    else:
        records = {"update": arrays(_compressed(result.params - base, s, context))}
    seconds = time.perf_counter() - t0
    return _reply(msg, rnd, records, client, n_examples=weight, train_loss=result.loss, compute_s=seconds)


def _compressed(delta: np.ndarray, s: FLSettings, context: Context) -> dict[str, np.ndarray]:
    """Privatize and compress ``delta``; the error-feedback residual stays in ``context.state``."""
    delta = privatize(delta, s)
    state = context.state.get("residual")
    residual = unpack(state)["e"] if state is not None else None
    payload, residual = compress(delta, residual, s.compress, s.topk_ratio)
    if residual is not None:
        context.state["residual"] = arrays({"e": residual})
    return {"method": np.frombuffer(payload.method.encode(), np.uint8), **payload.arrays()}


@app.evaluate("global")
def evaluate_global(msg: Message, context: Context) -> Message:
    """Evaluate the global model on the task's held-out set; reply log-loss and accuracy."""
    s, client, rnd, task = _start(msg, context, "evaluate")
    model = task.build_model()
    t0 = time.perf_counter()
    params = global_model(msg, s, context, client, _model_size(task))
    if params is not None:
        load_flat(model, params, client)
    ev = task.evaluate(model)
    return _reply(msg, rnd, {}, client, loss=ev.loss, accuracy=ev.accuracy, compute_s=time.perf_counter() - t0)


def _mask_config(msg: Message):
    from loomtrain.federated.secure.mask import MaskConfig

    spec = msg.content["mask"]
    return MaskConfig(int(spec["size"]), int(spec["n_clients"]), int(spec["threshold"]), float(spec["clip"]),
                      int(spec["max_weight"]))  # fmt: skip


@app.train("mask_keys")
def mask_keys(msg: Message, context: Context) -> Message:
    """Masking stage 0: a fresh MaskClient for this round; reply its two X25519 public keys."""
    from loomtrain.federated.secure.mask import MaskClient

    s, client, rnd, _ = _start(msg, context, "mask_keys")
    mc = MaskClient(client, _mask_config(msg))
    _keep_mask_client(context, s, rnd, mc)  # replaces an earlier round's: its secrets are never needed again
    return _reply(msg, rnd, {"keys": ConfigRecord(mc.advertise_keys())}, client)


def _keep_mask_client(context: Context, s: FLSettings, rnd: int, mc) -> None:
    """Keep this round's masking client in the node's ``context.state``, which Flower carries from one
    message to the next on this node (also in deployment, where each message gets a new process)."""
    context.state["mask"] = ConfigRecord({"out": s.out, "round": rnd, "client": mc.to_bytes()})


def _mask_client(context: Context, s: FLSettings, rnd: int, client: int):
    from loomtrain.federated.secure.mask import MaskClient

    kept = context.state.get("mask")
    if kept is None or (kept["out"], kept["round"]) != (s.out, rnd):
        raise ConnectionResetError(f"client {client}: no masking state for round {rnd} (restarted mid-round)")
    return MaskClient.from_bytes(kept["client"])


@app.train("mask_shares")
def mask_shares(msg: Message, context: Context) -> Message:
    """Masking stage 1: Shamir-share the mask secrets, encrypted to each peer of the roster."""
    s, client, rnd, _ = _start(msg, context, "mask_shares")
    mc = _mask_client(context, s, rnd, client)
    out = mc.share_keys(dict(msg.content["roster"]))
    _keep_mask_client(context, s, rnd, mc)
    return _reply(msg, rnd, {"shares": ConfigRecord(out)}, client)


@app.train("mask_input")
def mask_input(msg: Message, context: Context) -> Message:
    """Masking stage 2: train, then reply the masked, quantized update scaled by this client's example share
    (uint32 ``[N+1]``)."""
    t0 = time.perf_counter()  # decryption, training, encryption/masking: all of the client's work
    s, client, rnd, task = _start(msg, context, "mask_input")
    mc = _mask_client(context, s, rnd, client)
    try:
        start = global_model(msg, s, context, client, _model_size(task))
        result = local_train(task, client, start, s, rnd)
    except ValueError as e:
        return _rejected(msg, client, e)
    base = start if start is not None else flat_params(task.build_model())
    # Pre-scaled by the example share, weight 1: the server divides by the survivors' shares.
    scaled = privatize(result.params - base, s) * float(msg.content["weight"]["share"])
    clipped = int((np.abs(scaled) > mc.config.clip).sum())
    masked = mc.masked_input(scaled, 1, dict(msg.content["forwarded"]))
    _keep_mask_client(context, s, rnd, mc)
    seconds = time.perf_counter() - t0
    return _reply(msg, rnd, {"masked": arrays({"y": masked})}, client, train_loss=result.loss, compute_s=seconds,
                  clipped=clipped)  # fmt: skip


@app.train("mask_unmask")
def mask_unmask(msg: Message, context: Context) -> Message:
    """Masking stage 3: reveal the survivors' self-mask shares and the dropped clients' key shares."""
    s, client, rnd, _ = _start(msg, context, "mask_unmask")
    request = msg.content["request"]
    reveal = _mask_client(context, s, rnd, client).unmask(list(request["survivors"]), list(request["dropped"]))
    del context.state["mask"]  # the round is over: its keys and seed are never needed again (Bonawitz et al. §4)
    return _reply(msg, rnd, {"reveal": ConfigRecord(reveal)}, client)
