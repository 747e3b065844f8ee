"""The one error secure aggregation raises on bad input from a client or a malformed message."""

from __future__ import annotations


class SecureAggregationError(ValueError):
    """A client's message (ciphertext, key, share or masked input) failed validation.

    ``client`` is the id of the client whose message is at fault, or None when the fault is not
    one client's (too few survivors, a context that does not fit). The message names the client,
    the field and the fix, e.g. ``client 3: payload[2]: not a ciphertext of this context
    (undecodable bytes); re-encrypt with the client_<i>.ctx written by `loomtrain fl keys```.
    """

    def __init__(self, message: str, client: int | str | None = None) -> None:
        prefix = f"client {client}: " if client is not None else ""
        super().__init__(prefix + message)
        self.client = client
