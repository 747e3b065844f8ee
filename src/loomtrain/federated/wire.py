"""What travels between the ServerApp and the ClientApps: Flower records, their payload size, errors.

Every message carries a ``ConfigRecord`` named ``"config"`` (the round's settings); model data
goes in an ``ArrayRecord`` (plaintext) or as ``bytes`` / ``list[bytes]`` in a ``ConfigRecord``
(ciphertexts, keys, shares). Payload bytes are counted as the arrays' ``nbytes`` plus the length
of every bytes/str value (8 per number): Flower's own envelope (protobuf framing, metadata) is left
out, so the figure is the same in simulation and over gRPC.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict


class FederatedError(ValueError):
    """A federated run cannot go on: a client sent something unusable or the settings are wrong.

    ``client``: the client id (partition) at fault, or ``None`` when no single client is.
    """

    def __init__(self, message: str, client: int | None = None):
        super().__init__(message)
        self.client = client


def arrays(named: dict[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of numpy arrays by name."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in named.items()})


def unpack(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The numpy arrays of ``record`` by name."""
    return {k: v.numpy() for k, v in record.items()}


def _value_bytes(value) -> int:
    if isinstance(value, bytes | str):
        return len(value)
    if isinstance(value, list):
        return sum(_value_bytes(v) for v in value)
    return 8


def payload_bytes(content: RecordDict) -> int:
    """Payload bytes of a message's content (see the module docstring), excluding the ``"config"`` record."""
    total = 0
    for name, record in content.items():
        if name == "config":
            continue
        if isinstance(record, ArrayRecord):
            total += sum(a.numpy().nbytes for a in record.values())
        elif isinstance(record, ConfigRecord):
            total += sum(_value_bytes(v) for v in record.values())
    return total
