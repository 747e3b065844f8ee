"""Pairwise-mask secure aggregation driven in one process: 10 clients, dropouts, what the server holds, bad input.

The aggregate is compared bit for bit with the integer sum of the survivors' ``quantize``
outputs; the dequantized mean with the float weighted mean of the clipped updates, within the
rounding bound 0.5 * clip / levels.
"""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from loomtrain.federated.secure import SecureAggregationError
from loomtrain.federated.secure.mask import (
    SHARE_CIPHERTEXT_BYTES,
    MaskClient,
    MaskConfig,
    MaskServer,
    dequantize,
    quantize,
    wire_bytes,
)

SIZE = 500
CONFIG = MaskConfig(size=SIZE, n_clients=10, threshold=6, clip=1.0, max_weight=100)
IDS = [3 + 7 * i for i in range(10)]  # ids that are not positions, so index/id mix-ups show


class Round:
    """Ten clients and a server taken through the stages; drops are simulated by skipping a client."""

    def __init__(self, seed: int = 0, config: MaskConfig = CONFIG) -> None:
        rng = np.random.default_rng(seed)
        self.config = config
        self.clients = {i: MaskClient(i, config) for i in IDS}
        self.server = MaskServer(config)
        self.updates = {i: rng.normal(size=config.size) * 0.4 for i in IDS}
        self.weights = {i: int(w) for i, w in zip(IDS, rng.integers(1, config.max_weight + 1, len(IDS)), strict=True)}
        self.messages: list[dict] = []

    def send(self, message):
        self.messages.append(message if isinstance(message, dict) else {"masked": message})
        return message

    def share(self) -> None:
        for i, c in self.clients.items():
            self.server.collect_keys(i, self.send(c.advertise_keys()))
        roster = self.send(self.server.roster())
        for i, c in self.clients.items():
            self.server.collect_shares(i, self.send(c.share_keys(roster)))

    def mask(self, senders: list[int]) -> None:
        for i in senders:
            forwarded = self.send(self.server.forward_shares(i))
            masked = self.clients[i].masked_input(self.updates[i], self.weights[i], forwarded)
            self.server.collect_masked(i, self.send(masked))

    def unmask(self, responders: list[int]) -> tuple[np.ndarray, int]:
        request = self.send(self.server.unmask_request())
        for i in responders:
            self.server.collect_unmask(i, self.send(self.clients[i].unmask(**request)))
        return self.server.result()

    def expected(self, senders: list[int]) -> np.ndarray:
        total = sum(quantize(self.updates[i], self.weights[i], self.config).astype(np.int64) for i in senders)
        return (total + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize(
    ("drop_before_input", "drop_before_unmask"),
    [(0, 0), (2, 0), (4, 0), (2, 1)],
    ids=["none", "2-after-shares", "4-after-shares", "2-after-shares+1-after-input"],
)
def test_aggregate_is_the_exact_sum_of_survivors(drop_before_input, drop_before_unmask):
    """Catches: a dropped client's pairwise masks left in the sum, a survivor's self mask not removed,
    a sign or index slip in the masks, the weight lost: any of them breaks bit-exactness."""
    r = Round()
    r.share()
    senders = IDS[drop_before_input:]
    r.mask(senders)
    total, total_weight = r.unmask(senders[drop_before_unmask:])
    expected = r.expected(senders)
    assert np.array_equal(total, expected[:-1]) and total_weight == expected[-1] == sum(r.weights[i] for i in senders)
    ref = sum(r.weights[i] * np.clip(r.updates[i], -1, 1) for i in senders) / total_weight
    assert np.abs(dequantize(total, total_weight, CONFIG) - ref).max() <= 0.5 / CONFIG.levels + 1e-12


def test_too_few_masked_inputs_raise_instead_of_summing():
    """Catches: a server that returns a sum (or hangs) with fewer than t inputs: masks it cannot remove."""
    r = Round()
    r.share()
    r.mask(IDS[5:])
    with pytest.raises(SecureAggregationError, match="5 masked inputs arrived, fewer than threshold t=6"):
        r.server.unmask_request()


def test_too_few_unmask_answers_raise_instead_of_summing():
    """Catches: reconstruction from fewer than t shares, which Shamir turns into a wrong key without error."""
    r = Round()
    r.share()
    r.mask(IDS[2:])
    with pytest.raises(SecureAggregationError, match="5 survivors answered unmask, fewer than threshold t=6"):
        r.unmask(IDS[2:7])


def test_client_refuses_to_reveal_both_shares_of_one_client():
    """Catches: a curious server listing a survivor as dropped to get its b and s^SK shares, so its input."""
    r = Round()
    r.share()
    r.mask(IDS)
    with pytest.raises(SecureAggregationError, match="disjoint"):
        r.clients[IDS[0]].unmask(survivors=IDS, dropped=[IDS[1]])
    with pytest.raises(SecureAggregationError, match="threshold"):
        r.clients[IDS[0]].unmask(survivors=IDS[:5], dropped=IDS[5:])


def secrets_of(client: MaskClient) -> list[bytes]:
    return [client._c_sk.private_bytes_raw(), client._s_sk.private_bytes_raw(), client._b]


def stored(obj) -> list:
    """Every leaf value the object holds, through dicts, lists, tuples, sets and attributes."""
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in stored(k) + stored(v)]
    if isinstance(obj, list | tuple | set):
        return [leaf for v in obj for leaf in stored(v)]
    if hasattr(obj, "__dict__") and not isinstance(obj, np.ndarray):
        return stored(vars(obj))
    return [obj]


def test_server_never_holds_a_secret_or_a_single_input():
    """Catches: the server keeping a client's secret key, its mask seed, a rebuilt key of a dropped
    client, or one client's (quantized or raw) input, at any stage; and non-serializable messages."""
    r = Round(seed=3)
    secrets = [s for c in r.clients.values() for s in secrets_of(c)]
    inputs = [quantize(r.updates[i], r.weights[i], CONFIG) for i in IDS] + list(r.updates.values())

    def inspect() -> None:
        for leaf in stored(r.server):
            assert not isinstance(leaf, X25519PrivateKey)
            if isinstance(leaf, bytes):
                assert not any(s in leaf for s in secrets)
            if isinstance(leaf, np.ndarray):
                assert not any(leaf.shape == x.shape and np.array_equal(leaf, x) for x in inputs)

    r.share()
    inspect()
    r.mask(IDS[2:])
    inspect()
    r.unmask(IDS[2:])
    inspect()
    for message in r.messages:
        assert all(isinstance(key, str) for key in message)
        assert all(isinstance(leaf, int | bytes | np.ndarray) for leaf in stored(list(message.values())))


def test_masked_bytes_within_target_of_fp32():
    """Catches: a field wider than 32-bit words (e.g. int64 masks: 2x) or a padded encoding."""
    r = Round()
    r.share()
    masked = r.clients[IDS[0]].masked_input(r.updates[IDS[0]], 1, r.server.forward_shares(IDS[0]))
    assert masked.dtype == np.uint32 and wire_bytes({"y": masked}) / (4 * SIZE) <= 1.1


def test_share_for_another_peer_or_undecodable_names_the_sender():
    """Catches: a share accepted that was encrypted for someone else or altered (AES-GCM tag unchecked)."""
    r = Round()
    r.share()
    me, sender, other = IDS[0], IDS[1], IDS[2]
    forwarded = r.server.forward_shares(me)
    pos = forwarded["from"].index(sender)
    for bad in (r.server._shares[sender][other], bytes(SHARE_CIPHERTEXT_BYTES), b"short"):
        tampered = {"from": forwarded["from"], "ct": [*forwarded["ct"][:pos], bad, *forwarded["ct"][pos + 1 :]]}
        with pytest.raises(SecureAggregationError) as err:
            r.clients[me].masked_input(r.updates[me], 1, tampered)
        assert err.value.client == sender and f"client {sender}: share for client {me}" in str(err.value)


def test_mismatched_update_size_names_the_client():
    """Catches: a client of another model shape summed into (or crashing) the aggregate."""
    r = Round()
    r.share()
    r.mask(IDS[:-1])
    with pytest.raises(SecureAggregationError) as err:
        r.server.collect_masked(IDS[-1], np.zeros(SIZE + 7, dtype=np.uint32))
    assert err.value.client == IDS[-1] and "MaskConfig.size" in str(err.value)
    with pytest.raises(SecureAggregationError, match="float64"):
        r.server.collect_masked(IDS[-1], np.zeros(SIZE + 1))


def test_bad_keys_and_shares_name_the_client():
    """Catches: a malformed public key or share list accepted at collection, to fail later unattributed."""
    r = Round()
    with pytest.raises(SecureAggregationError) as err:
        r.server.collect_keys(5, {"c_pk": b"\x01" * 31, "s_pk": b"\x01" * 32})
    assert err.value.client == 5 and "c_pk" in str(err.value)
    r.share()
    server = MaskServer(CONFIG)
    for i, c in r.clients.items():
        server.collect_keys(i, c.advertise_keys())
    roster = server.roster()
    good = r.clients[IDS[0]].share_keys(roster)
    with pytest.raises(SecureAggregationError) as err:
        server.collect_shares(IDS[0], {"to": good["to"][:-1], "ct": good["ct"][:-1]})
    assert err.value.client == IDS[0] and "shares.to" in str(err.value)
    with pytest.raises(SecureAggregationError, match="92"):
        server.collect_shares(IDS[0], {"to": good["to"], "ct": [b"x"] * len(good["ct"])})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": 5}, "threshold"),
        ({"threshold": 11}, "threshold"),
        ({"clip": 0.0}, "clip"),
        ({"max_weight": 2**30}, "max_weight"),
        ({"size": 0}, "size"),
    ],
)
def test_config_rejects_unsafe_or_impossible_values(kwargs, field):
    """Catches: t <= n/2 (a minority could unmask), a field too small for n * max_weight, a zero clip."""
    with pytest.raises(ValueError, match=field):
        MaskConfig(**{"size": 10, "n_clients": 10, "threshold": 6, **kwargs})


@pytest.mark.parametrize("weight", [0, 101, 2.5, True])
def test_quantize_rejects_weights_outside_the_integer_range(weight):
    """Catches: a weight that could wrap the 32-bit sum or a fractional weight truncated silently."""
    with pytest.raises(ValueError, match="weight"):
        quantize(np.zeros(SIZE), weight, CONFIG)


def test_clients_saved_and_restored_between_stages_aggregate_the_same():
    """Catches: a masking client that loses a secret, a share or its U2 when saved between stages (as
    Flower's deployment does: one process per message), which breaks unmasking of dropped clients or
    bit-exactness; and an unreadable saved state accepted."""
    r = Round()

    def reload() -> None:
        r.clients = {i: MaskClient.from_bytes(c.to_bytes()) for i, c in r.clients.items()}

    reload()
    r.share()
    reload()
    senders = IDS[2:]  # two drop after sharing: their masks are rebuilt from saved shares
    r.mask(senders)
    reload()
    total, total_weight = r.unmask(senders)
    expected = r.expected(senders)
    assert np.array_equal(total, expected[:-1]) and total_weight == expected[-1]
    with pytest.raises(SecureAggregationError, match="unreadable"):
        MaskClient.from_bytes(b'{"client_id": 3}')
