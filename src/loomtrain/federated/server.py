"""The ServerApp: our round loop on Flower's Message API (``Grid.send_and_receive``).

Each round: sample ``--fraction`` of the clients (seeded by round, so a resumed run samples the
same ones), send them the global model, collect updates, aggregate, let client 0 evaluate, write
one accounting row and checkpoint the state atomically. Flower's strategies (``flwr.serverapp.strategy``)
own their own loop and aggregate plaintext ``ArrayRecord``s, so they cannot drive CKKS ciphertexts
or the four message rounds of masking; the aggregation rules are therefore ours:

- FedAvg: mean of the updates weighted by example count (McMahan et al., AISTATS 2017, Alg. 1);
- FedProx: FedAvg's aggregation, the proximal term is the clients' (Li et al., MLSys 2020);
- FedAdam: Adam on the mean update as pseudo-gradient (Reddi et al., ICLR 2021, Alg. 2).

A client whose reply is a Flower error or does not come within ``--timeout`` is dropped with an
event (``client_dropped``) and the round is aggregated without it; a client that answers with a
rejection, or with an update of the wrong size, stops the run with a :class:`FederatedError`
naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from loomtrain.federated.compress import CompressedUpdate
from loomtrain.federated.privacy import epsilon, round_noise_multiplier
from loomtrain.federated.settings import FLSettings
from loomtrain.federated.state import ServerState, load_state, save_state
from loomtrain.federated.wire import FederatedError, arrays, payload_bytes, unpack

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# A live client answers hello at once (after its first imports); silence means the runtime is gone.
HELLO_TIMEOUT_S = 120.0


@dataclass
class RoundLog:
    """One accounting row: bytes (payload, see :mod:`loomtrain.federated.wire`) down/up per client,
    client compute seconds per client, server compute seconds, wall seconds, losses, events; under
    ``--dp-noise``, the round's noise multiplier and the run's ε so far at ``--dp-delta``
    (:mod:`loomtrain.federated.privacy`)."""

    round: int
    clients: list[int] = field(default_factory=list)
    bytes_down: dict[int, int] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    client_compute_s: dict[int, float] = field(default_factory=dict)
    server_compute_s: float = 0.0
    wall_s: float = 0.0
    train_loss: float = float("nan")
    test_loss: float = float("nan")
    test_accuracy: float = float("nan")
    events: list[dict] = field(default_factory=list)
    dp_noise_multiplier: float | None = None
    dp_epsilon: float | None = None

    def add_bytes(self, client: int, down: int, up: int) -> None:
        """Count one message exchange of ``client``: ``down``/``up`` payload bytes."""
        self.bytes_down[client] = self.bytes_down.get(client, 0) + down
        self.bytes_up[client] = self.bytes_up.get(client, 0) + up


class FederatedServer:
    """Runs ``settings.rounds`` rounds over ``grid`` and writes ``settings.out``.

    ``settings.out`` receives ``server_state.npz`` (each round), ``metrics.jsonl`` (one
    :class:`RoundLog` per round) and ``settings.json``.

    Raises:
        FederatedError: fewer clients connected than ``--clients``, a client's rejection or malformed
            update (names it), every client of a round dropped, or ``--resume`` with other settings.
    """

    def __init__(self, grid: Grid, settings: FLSettings):
        self.grid, self.s = grid, settings.validate()
        self.out = Path(settings.out)
        self.nodes: dict[int, int] = {}  # client id -> Flower node id
        self.examples: dict[int, int] = {}
        self.state = ServerState(settings=self._identity())

    def _identity(self) -> dict:
        """The settings that must match for a resume (not rounds, out, resume, drop, timeout, local processes)."""
        d = dataclasses.asdict(self.s)
        return {k: v for k, v in d.items() if k not in ("rounds", "out", "resume", "drop", "timeout_s", "local_procs")}

    def run(self) -> ServerState:
        """Connect, resume if asked, run the remaining rounds; returns the final state."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "settings.json").write_text(json.dumps(dataclasses.asdict(self.s), indent=1))
        self._resume()
        self._connect()
        for rnd in range(self.state.round + 1, self.s.rounds + 1):
            self._round(rnd)
        return self.state

    def _resume(self) -> None:
        saved = load_state(self.out) if self.s.resume else None
        if saved is None:
            (self.out / METRICS_FILE).write_text("")
            return
        if saved.settings != self.state.settings:
            diff = sorted(k for k in self.state.settings if saved.settings.get(k) != self.state.settings[k])
            raise FederatedError(f"--resume: {self.out} was run with other settings ({', '.join(diff)}); "
                                 "repeat the original flags or use another --out")  # fmt: skip
        self.state = saved
        rows = [r for r in _read_rows(self.out) if r["round"] <= saved.round]
        (self.out / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        log.info("resuming %s after round %d", self.out, saved.round)

    def _connect(self) -> None:
        """Wait for the clients (up to ``--timeout``) and learn each node's client id and example count."""
        deadline = time.monotonic() + self.s.timeout_s
        while len(node_ids := list(self.grid.get_node_ids())) < self.s.clients:
            if time.monotonic() > deadline:
                raise FederatedError(
                    f"{len(node_ids)} clients connected within --timeout {self.s.timeout_s} s, --clients is "
                    f"{self.s.clients}; start more SuperNodes or lower --clients"
                )
            time.sleep(0.05)
        replies = self._exchange("query.hello", {n: RecordDict() for n in node_ids}, 0, None, HELLO_TIMEOUT_S)
        for node, reply in replies.items():
            metrics = reply.content["metrics"]
            self.nodes[int(metrics["client"])] = node
            self.examples[int(metrics["client"])] = int(metrics["n_examples"])
        missing = sorted(set(range(self.s.clients)) - set(self.nodes))
        if missing:
            raise FederatedError(
                f"clients {missing} did not answer hello within {HELLO_TIMEOUT_S:.0f} s: Flower's runtime failed (see "
                "its log above) or a SuperNode's partition-id node config is wrong"
            )

    def _exchange(self, kind: str, contents: dict[int, RecordDict], rnd: int, rlog: RoundLog | None,
                  timeout_s: float | None = None) -> dict[int, Message]:  # fmt: skip
        """Send ``contents`` (node id → records) as ``kind`` messages, wait up to ``timeout_s`` (default
        ``--timeout``); returns node id → reply of those that answered without a Flower error (the others
        are logged dropped)."""
        config = ConfigRecord({**self.s.client_config(), "round": rnd})
        messages = []
        for node, content in contents.items():
            content["config"] = config
            messages.append(Message(content, dst_node_id=node, message_type=kind, group_id=str(rnd)))
        replies = {
            m.metadata.src_node_id: m
            for m in self.grid.send_and_receive(messages, timeout=timeout_s or self.s.timeout_s)
        }
        answered = {}
        for node, content in contents.items():
            client = self._client_of(node)
            reply = replies.get(node)
            if reply is None or reply.has_error():
                reason = "no reply within --timeout" if reply is None else _last_line(reply.error.reason)
                self._event(rlog, "client_dropped", client, stage=kind, reason=reason)
                continue
            if "rejected" in reply.content:
                raise FederatedError(str(reply.content["rejected"]["reason"]), client)
            answered[node] = reply
            if rlog is not None:
                rlog.add_bytes(client, payload_bytes(content), payload_bytes(reply.content))
        return answered

    def _client_of(self, node: int) -> int:
        return next((c for c, n in self.nodes.items() if n == node), -1)

    def _event(self, rlog: RoundLog | None, kind: str, client: int | None, **details) -> None:
        event = {"event": kind, "client": client, **details}
        log.warning("federated event: %s", event)
        if rlog is not None:
            rlog.events.append(event)

    def sample(self, rnd: int) -> list[int]:
        """Client ids of round ``rnd``: ``--fraction`` of them, drawn from a generator seeded by (seed, round)."""
        rng = np.random.default_rng([self.s.seed, rnd])
        return sorted(rng.choice(self.s.clients, self.s.sampled(), replace=False).tolist())

    def _global_records(self) -> dict:
        """The global model as this mode sends it (nothing before the first aggregate)."""
        if self.state.ciphertexts is not None:
            return {"global_ct": ConfigRecord({"ct": self.state.ciphertexts})}
        if self.state.params is not None:
            return {"global": arrays({"params": self.state.params})}
        return {}

    def _round(self, rnd: int) -> None:
        t0 = time.perf_counter()
        rlog = RoundLog(rnd, self.sample(rnd))
        aggregate = _AGGREGATORS[self.s.secure]
        server_s, losses = aggregate(self, rnd, rlog)
        rlog.server_compute_s = server_s
        rlog.train_loss = float(np.mean(losses)) if losses else float("nan")
        self._account(rlog)
        self._evaluate(rnd, rlog)
        rlog.wall_s = time.perf_counter() - t0
        self.state.round = rnd
        save_state(self.out, self.state)
        with open(self.out / METRICS_FILE, "a") as f:
            f.write(json.dumps(dataclasses.asdict(rlog)) + "\n")
        log.info("round %d: test loss %.4f acc %.4f", rnd, rlog.test_loss, rlog.test_accuracy)

    def _account(self, rlog: RoundLog) -> None:
        """Add the round to the privacy ledger and record its noise multiplier and the run's ε; the
        clients whose update was aggregated are those with a compute time."""
        if self.s.dp_noise <= 0:
            return
        weights = [float(self.examples[c]) for c in rlog.client_compute_s]
        m = self.s.sampled()  # the clients scaled their noise by it (client.py's privatize)
        z = round_noise_multiplier(self.s.dp_noise, m, weights, self.s.secure)
        self.state.privacy.append([z, m / self.s.clients])
        rlog.dp_noise_multiplier, rlog.dp_epsilon = z, epsilon(self.state.privacy, self.s.dp_delta)

    def _fit(self, rnd: int, rlog: RoundLog, extra: Callable[[int], dict] | None = None) -> dict[int, Message]:
        """Send ``train.fit`` with the global model to the round's clients; client id → reply."""
        contents = {}
        for c in rlog.clients:
            records = self._global_records() | (extra(c) if extra else {})
            contents[self.nodes[c]] = RecordDict(records)
        replies = self._exchange("train.fit", contents, rnd, rlog)
        out = {self._client_of(n): m for n, m in replies.items()}
        if not out:
            raise FederatedError(f"round {rnd}: every client dropped ({rlog.events}); nothing to aggregate")
        for c, m in out.items():
            rlog.client_compute_s[c] = float(m.content["metrics"]["compute_s"])
        return out

    def _evaluate(self, rnd: int, rlog: RoundLog) -> None:
        """Client 0 evaluates the new global model (it holds a key under ``ckks``); the server gets metrics only."""
        node = self.nodes[0]
        replies = self._exchange("evaluate.global", {node: RecordDict(self._global_records())}, rnd, None)
        if node in replies:
            m = replies[node].content["metrics"]
            rlog.test_loss, rlog.test_accuracy = float(m["loss"]), float(m["accuracy"])

    def apply_mean_update(self, mean_delta: np.ndarray) -> None:
        """New global model from the weighted mean update (float32 ``[N]``): FedAvg/FedProx add it,
        FedAdam takes an Adam step with it as pseudo-gradient (Reddi et al. 2021, Alg. 2, lines 13-15)."""
        if self.s.strategy != "fedadam":
            self.state.params = self.state.params + mean_delta
            return
        st, s = self.state, self.s
        st.adam_m = s.beta1 * (st.adam_m if st.adam_m is not None else 0) + (1 - s.beta1) * mean_delta
        st.adam_v = s.beta2 * (st.adam_v if st.adam_v is not None else 0) + (1 - s.beta2) * mean_delta**2
        st.params = (st.params + s.server_lr * st.adam_m / (np.sqrt(st.adam_v) + s.tau)).astype(np.float32)


def _initial_params(server: FederatedServer) -> np.ndarray:
    """The seeded initial model, built by the server in the plaintext modes (the architecture is public)."""
    from loomtrain.federated.client import cached_task, flat_params

    return flat_params(cached_task(server.s.task, server.s.clients, server.s.seed).build_model())


def decode_update(client: int, content: RecordDict, size: int) -> np.ndarray:
    """The dense update (float32 ``[size]``) in the content of a plaintext ``train.fit`` reply.

    Raises:
        FederatedError: the update is missing, of another size (another model), or malformed; names the client.
    """
    try:
        named = unpack(content["update"])
        method = named.pop("method").tobytes().decode()
    except (KeyError, ValueError, TypeError) as e:
        raise FederatedError(f"client {client}: malformed update (no {e}); the client must run the same loomtrain "
                             "version", client) from None  # fmt: skip
    if method == "none" and named.get("values", np.empty(0)).size != size:
        raise FederatedError(f"client {client}: update has {named['values'].size} values, the global model {size}; "
                             "every client must train the same --task model", client)  # fmt: skip
    try:
        return CompressedUpdate(method, size, **named).decode(chunk_size=1024)
    except (ValueError, TypeError) as e:
        raise FederatedError(f"client {client}: malformed {method} update ({e})", client) from None


def _aggregate_plain(server: FederatedServer, rnd: int, rlog: RoundLog) -> tuple[float, list[float]]:
    """FedAvg/FedProx/FedAdam on plaintext updates; returns (server seconds, training losses)."""
    if server.state.params is None:
        server.state.params = _initial_params(server)
    replies = server._fit(rnd, rlog)
    t0 = time.perf_counter()
    size = server.state.params.size
    total = sum(float(m.content["metrics"]["n_examples"]) for m in replies.values())
    mean = np.zeros(size, np.float64)
    for c, m in replies.items():
        mean += float(m.content["metrics"]["n_examples"]) / total * decode_update(c, m.content, size)
    server.apply_mean_update(mean.astype(np.float32))
    return time.perf_counter() - t0, [float(m.content["metrics"]["train_loss"]) for m in replies.values()]


def _aggregate_ckks(server: FederatedServer, rnd: int, rlog: RoundLog) -> tuple[float, list[float]]:
    """Sum the clients' ciphertexts with the public ``server.ctx``; the sum becomes the (encrypted) global.

    Each client encrypts its model weighted by its share of the round's examples (a weight ≤ 1
    keeps ``weight·params`` far under the plaintext modulus); clients decrypt the weighted mean.
    A payload that fails validation stops the run naming the client (SecureAggregationError).
    """
    from loomtrain.federated.secure import ckks

    shares_of = example_shares({c: server.examples[c] for c in rlog.clients})
    replies = server._fit(rnd, rlog, lambda c: {"weight": ConfigRecord({"share": shares_of[c]})})
    t0 = time.perf_counter()
    ctx = ckks.load_context(Path(server.s.keys) / "server.ctx")
    payloads = {c: list(m.content["update_ct"]["ct"]) for c, m in replies.items()}
    server.state.ciphertexts = ckks.aggregate(ctx, payloads)
    return time.perf_counter() - t0, [float(m.content["metrics"]["train_loss"]) for m in replies.values()]


def example_shares(examples: dict[int, int]) -> dict[int, float]:
    """Each client's FedAvg weight as its share ``n_i / Σn`` of the round's examples (each ≤ 1)."""
    total = sum(examples.values())
    return {c: n / total for c, n in examples.items()}


def _mask_exchange(server: FederatedServer, stage: str, rnd: int, rlog: RoundLog, contents: dict[int, dict],
                   ) -> dict[int, Message]:  # fmt: skip
    """One masking stage: client id → records out, client id → reply of those that answered."""
    replies = server._exchange(f"train.{stage}", {server.nodes[c]: RecordDict(r) for c, r in contents.items()},
                               rnd, rlog)  # fmt: skip
    return {server._client_of(n): m for n, m in replies.items()}


def _aggregate_mask(server: FederatedServer, rnd: int, rlog: RoundLog) -> tuple[float, list[float]]:
    """Pairwise-mask secure aggregation (Bonawitz et al. 2017 §4) as four message rounds over
    :class:`~loomtrain.federated.secure.mask.MaskServer`; the server learns only the sum of the
    quantized updates of the clients that sent one. Clients that drop after sharing their keys are
    unmasked through the survivors' Shamir shares (event ``client_dropped``).

    Each client masks its update pre-scaled by its example share ``r_i = n_i / Σn`` with integer
    weight 1 (``MaskConfig.max_weight = 1``, so the fixed point has ``2³¹ / m`` levels per clip:
    about 2e-9 resolution for 10 clients, where integer example-count weights would leave ~1e-5);
    the server divides the sum by the survivors' ``Σ r_i``, which it knows, as it knows who survived."""
    from loomtrain.federated.secure.mask import MaskConfig, MaskServer

    if server.state.params is None:
        server.state.params = _initial_params(server)
    m = len(rlog.clients)
    cfg = MaskConfig(server.state.params.size, m, m // 2 + 1, server.s.mask_clip, max_weight=1)
    ms, clock = MaskServer(cfg), _Clock()
    spec = ConfigRecord({"size": cfg.size, "n_clients": m, "threshold": cfg.threshold, "clip": cfg.clip,
                         "max_weight": cfg.max_weight})  # fmt: skip
    keys = _mask_exchange(server, "mask_keys", rnd, rlog, {c: {"mask": spec} for c in rlog.clients})
    with clock:
        for c, reply in keys.items():
            ms.collect_keys(c, dict(reply.content["keys"]))
        roster = ConfigRecord(ms.roster())
    shares = _mask_exchange(server, "mask_shares", rnd, rlog, {c: {"mask": spec, "roster": roster} for c in keys})
    with clock:
        for c, reply in shares.items():
            ms.collect_shares(c, dict(reply.content["shares"]))
        shares_of = example_shares({c: server.examples[c] for c in rlog.clients})
        inputs_out = {
            c: {
                "mask": spec,
                "forwarded": ConfigRecord(ms.forward_shares(c)),
                "weight": ConfigRecord({"share": shares_of[c]}),
            }
            | server._global_records()
            for c in shares
        }
    inputs = _mask_exchange(server, "mask_input", rnd, rlog, inputs_out)
    with clock:
        for c, reply in inputs.items():
            ms.collect_masked(c, unpack(reply.content["masked"])["y"])
            rlog.client_compute_s[c] = float(reply.content["metrics"]["compute_s"])
            if int(reply.content["metrics"]["clipped"]):
                server._event(rlog, "mask_clipped", c, values=int(reply.content["metrics"]["clipped"]))
        request = ConfigRecord(ms.unmask_request())
    unmasked = _mask_exchange(server, "mask_unmask", rnd, rlog, {c: {"request": request} for c in inputs})
    with clock:
        for c, reply in unmasked.items():
            ms.collect_unmask(c, dict(reply.content["reveal"]))
        total, total_weight = ms.result()  # Σ quantize(r_i·u_i) over the survivors, and their count
        weighted_sum = ms.dequantize(total, total_weight) * total_weight
        server.apply_mean_update((weighted_sum / sum(shares_of[c] for c in inputs)).astype(np.float32))
    return clock.seconds, [float(r.content["metrics"]["train_loss"]) for r in inputs.values()]


class _Clock:
    """Accumulates the seconds spent inside ``with`` blocks (the server's own compute)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._t0


_AGGREGATORS = {"none": _aggregate_plain, "ckks": _aggregate_ckks, "mask": _aggregate_mask}


def _last_line(reason: str) -> str:
    """The last line of a Flower error's reason (the client's exception), without Flower's repr tail."""
    lines = [line for line in reason.strip().splitlines() if line.strip()] or ["(no reason given)"]
    return lines[-1].removesuffix("'>").split("occurred. Message: ")[-1].strip()


def _read_rows(out: Path) -> list[dict]:
    path = out / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_server_app(runs: list[FLSettings], results: list | None = None) -> ServerApp:
    """A ServerApp that runs each of ``runs`` in turn on the same clients (one simulation start-up for
    several runs); each run's final :class:`ServerState`, or the exception that ended it, is appended
    to ``results`` when given."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # The simulation's InMemoryGrid polls for replies every 0.1 s; a masked round has five
        # exchanges, so polling would dominate a small model's round time.
        if hasattr(grid, "pull_interval"):
            grid.pull_interval = 0.01
        for settings in runs:
            try:
                outcome = FederatedServer(grid, settings).run()
            except Exception as e:  # handed to the caller: Flower's simulation only logs a ServerApp's error
                outcome = e
            if results is not None:
                results.append(outcome)
            if isinstance(outcome, FederatedError) and outcome.client is None and "hello" in str(outcome):
                break  # the clients are gone (Ray's runtime died): every later run would wait for them too

    return server_app


app = ServerApp()


@app.main()
def deployed(grid: Grid, context: Context) -> None:
    """The ServerApp of a real deployment (:mod:`loomtrain.federated.deploy`): the run's settings come as
    JSON in the Flower run config ``settings``."""
    settings = FLSettings(**json.loads(str(context.run_config["settings"])))
    FederatedServer(grid, settings).run()
