"""torchrun's ``etcd-v2`` rendezvous backend, made to ride out an etcd leader election.

When the etcd member that leads the Raft group is lost (its host died), a write that reached it
or was in flight fails after etcd's request timeout ("request timed out, possibly due to
previous leader failure"), and a read may fail while no leader exists. The survivors elect a
new leader within about one election timeout (1 s by default; Ongaro and Ousterhout, "In Search
of an Understandable Consensus Algorithm", USENIX ATC 2014, section 5.2), but torchrun's backend
(``torch.distributed.elastic.rendezvous.etcd_rendezvous_backend``) raises at the first failure
and the agent that issued it dies. :class:`RetryingBackend` retries such a read or write for up
to ``retry_s`` seconds.

A call must also give up before etcd does. A member that lost its leader holds a request until
etcd's server-side request timeout, 5 s plus two election timeouts (7 s by default; etcd's
``ServerConfig.ReqTimeout``), and torchrun's agent holds its rendezvous lock meanwhile: a
keep-alive write stuck there kept the survivors' agents from seeing their failed workers for
7.4-7.7 s (measured, a lost host whose member led). So each call waits at most ``read_timeout``
(``READ_TIMEOUT_S`` unless ``--rdzv-conf read_timeout=N`` says otherwise) and is then retried,
by then against the newly elected leader.

A retried write is safe: the backend's writes are compare-and-swap on the state's etcd index
(the ``Token``). If a failed attempt had in fact been applied, the retry finds the index moved
and returns the current state with ``False``, which torchrun's dynamic rendezvous handles as
any lost race: it re-reads and goes on. Once a round has completed, a leader exists, so the
agents' later store traffic (``EtcdStore``) needs no retries of its own.

Registered with torchrun as the rendezvous backend ``loomtrain-etcd`` through the
``torchrun.handlers`` entry point (pyproject.toml), so a plain ``torchrun --rdzv-backend
loomtrain-etcd`` on a real cluster uses it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler

T = TypeVar("T")
NAME = "loomtrain-etcd"  # the --rdzv-backend name this module registers
RETRY_S = 30.0  # several election timeouts, and well inside torchrun's 600 s join timeout
RETRY_PAUSE_S = 0.2
# Seconds one etcd call may take: thousands of LAN round trips, and under etcd's 7 s request
# timeout, so a call held by a member without a leader is abandoned and retried (module doc).
READ_TIMEOUT_S = 2


class RetryingBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` that retries ``inner``'s reads and writes while they fail
    with :class:`RendezvousConnectionError`, for up to ``retry_s`` seconds each.

    Args:
        inner: the backend to wrap (torchrun's ``EtcdRendezvousBackend``).
        retry_s: seconds to keep retrying one call; after that the last error is raised.
        pause_s: seconds between tries.

    Raises (from its methods):
        RendezvousConnectionError: every try of a call failed for ``retry_s`` seconds.
    """

    def __init__(self, inner: RendezvousBackend, retry_s: float = RETRY_S, pause_s: float = RETRY_PAUSE_S):
        self.inner, self.retry_s, self.pause_s = inner, retry_s, pause_s

    @property
    def name(self) -> str:
        return NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._retry(self.inner.get_state)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        return self._retry(lambda: self.inner.set_state(state, token))

    def _retry(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return call()
            except RendezvousConnectionError:
                if time.monotonic() + self.pause_s > deadline:
                    raise
                time.sleep(self.pause_s)


def create_retrying_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's dynamic rendezvous handler over a :class:`RetryingBackend` around its
    ``etcd-v2`` backend (same parameters: ``--rdzv-endpoint`` an etcd client ``HOST:PORT``;
    ``read_timeout`` defaults to ``READ_TIMEOUT_S`` seconds instead of torchrun's 60)."""
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    params.config.setdefault("read_timeout", READ_TIMEOUT_S)
    backend, store = create_backend(params)
    return create_handler(store, RetryingBackend(backend), params)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torchrun calls it once and registers what it
    returns under the entry point's name (``loomtrain-etcd``)."""
    return create_retrying_handler
