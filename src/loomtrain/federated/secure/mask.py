"""Pairwise-mask secure aggregation (Bonawitz et al., CCS 2017, §4 and Fig. 4, honest-but-curious variant).

The server learns ``sum(q_u)`` over the clients that sent a masked input, and nothing else about
any one ``q_u``, even when clients drop out after sending their shares. Stages, one message
round each, driven by a server (e.g. a Flower ServerApp) over ``MaskClient`` / ``MaskServer``:

0. AdvertiseKeys: ``MaskClient.advertise_keys`` -> ``MaskServer.collect_keys``; ``roster()`` (U1).
1. ShareKeys: ``MaskClient.share_keys(roster)`` -> ``collect_shares``; ``forward_shares(id)`` (U2).
   Each client Shamir-splits (t of |U1|) its mask seed b_u and its mask secret key s_u^SK, and
   sends each peer its shares, encrypted (AES-GCM) under an X25519 key agreed with that peer.
2. MaskedInputCollection: ``MaskClient.masked_input(update, weight, forwarded)`` ->
   ``collect_masked`` (U3). ``y_u = q_u + PRG(b_u) + sum_v ±PRG(s_uv) mod 2^32``, where
   ``s_uv = KA(s_u^SK, s_v^PK)`` over v in U2; the pairwise terms cancel in the sum over U3.
3. Unmasking: ``unmask_request()`` -> ``MaskClient.unmask(survivors, dropped)`` ->
   ``collect_unmask``; ``result()``. Survivors reveal their shares of the dropped clients'
   s^SK (to rebuild and remove their pairwise masks) and of the survivors' b (to remove the
   self masks); never both for one client, so no q_u is ever exposed.

The consistency-check round and signatures of the malicious-server variant (§4, Round 3) and the
k-regular graph of SecAgg+ (Bell et al., CCS 2020) are not built: every client pairs with every
other (O(n^2) key agreements; fine for tens of clients).

Field: Z_{2^32}, one uint32 word per value, so a masked input is (size + 1) * 4 bytes: the update
plus its weight, 1.0x the fp32 bytes for large updates. Quantization (``quantize``): clip to
[-clip, clip], scale by ``levels`` (so n_clients * max_weight * levels < 2^31: the signed sum
never wraps), round to nearest, multiply by the integer weight.

Primitives, all from ``cryptography`` except Shamir: X25519 key agreement (RFC 7748) + HKDF-SHA256
(RFC 5869) with a label per use; PRG = AES-256-CTR keystream (NIST SP 800-38A) keyed by the
32-byte seed (a fresh key per round, so a zero nonce is safe): numpy's PCG64 is not a
cryptographic PRG (its state follows from its output, so a mask would be predictable);
authenticated share encryption = AES-256-GCM (NIST SP 800-38D) with the (sender, recipient) ids
as associated data; Shamir t-of-n over GF(2^128) from pycryptodome (``Crypto.Protocol.
SecretSharing.Shamir``, the implementation Flower's SecAgg+ wraps), on each 16-byte half of a
32-byte secret.

Every message is a dict of ints, bytes, lists of those, or one numpy array: a Flower
ConfigRecord / ArrayRecord as is. ``MaskServer`` stores public keys, encrypted shares, the
running sum of masked inputs (never one client's input alone) and, between ``collect_unmask``
and ``result``, the revealed shares; the secrets it rebuilds live only inside ``result``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from loomtrain.federated.secure.errors import SecureAggregationError

FIELD_BITS = 32
_WORD = np.dtype("<u4")
_SECRET_BYTES = 32
_SHARE_BYTES = 32  # two 16-byte GF(2^128) shares, one per half of a 32-byte secret
_NONCE_BYTES = 12
_TAG_BYTES = 16
SHARE_CIPHERTEXT_BYTES = _NONCE_BYTES + 2 * _SHARE_BYTES + _TAG_BYTES
_MASK_INFO = b"loomtrain secagg pairwise mask"
_SHARE_INFO = b"loomtrain secagg share encryption"


@dataclass(frozen=True)
class MaskConfig:
    """One round's public parameters, the same on the server and every client.

    ``size``: update length (values). ``n_clients``: most clients in the round (|U1|).
    ``threshold``: t, survivors needed to unmask; t > n_clients / 2 (Bonawitz §6: the server
    plus fewer than t colluding clients learn nothing; a majority also stops two disjoint
    survivor sets). ``clip``: updates are clipped to [-clip, clip]. ``max_weight``: largest
    integer weight (example count) a client may send. Raises ValueError naming the field.
    """

    size: int
    n_clients: int
    threshold: int
    clip: float = 1.0
    max_weight: int = 1024

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size={self.size}: must be >= 1 (the flattened update length)")
        if self.n_clients < 2:
            raise ValueError(f"n_clients={self.n_clients}: masking needs >= 2 clients")
        if not self.n_clients / 2 < self.threshold <= self.n_clients:
            raise ValueError(
                f"threshold={self.threshold}: must be in ({self.n_clients / 2:g}, {self.n_clients}] "
                "(more than half the clients); raise it or lower n_clients"
            )
        if not self.clip > 0:
            raise ValueError(f"clip={self.clip}: must be > 0 (the update's clipping bound)")
        if self.levels < 1:
            raise ValueError(
                f"max_weight={self.max_weight}: n_clients * max_weight must be < 2^31 for 32-bit words; lower it"
            )

    @property
    def levels(self) -> int:
        """Quantization steps per ``clip`` at weight 1: the resolution is clip / levels."""
        return (2 ** (FIELD_BITS - 1) - 1) // (self.n_clients * self.max_weight)


def quantize(update: np.ndarray, weight: int, config: MaskConfig) -> np.ndarray:
    """Fixed-point ``[weight * round(clip(update) / clip * levels), weight]`` in Z_{2^32}: uint32, shape (size+1,).

    ``update``: 1-D finite floats of length ``config.size``; ``weight``: integer in
    [1, config.max_weight]. Raises ValueError naming the field.
    """
    update = np.asarray(update, dtype=np.float64)
    if update.shape != (config.size,):
        raise ValueError(f"update: shape {update.shape}, expected ({config.size},) from MaskConfig.size")
    if not np.isfinite(update).all():
        raise ValueError("update: holds NaN or inf; fix the local training step before masking")
    if isinstance(weight, bool) or int(weight) != weight or not 1 <= weight <= config.max_weight:
        raise ValueError(f"weight={weight}: must be an integer in [1, {config.max_weight}] (MaskConfig.max_weight)")
    steps = np.rint(np.clip(update, -config.clip, config.clip) / config.clip * config.levels).astype(np.int64)
    return np.append(steps * int(weight), int(weight)).astype(_WORD)


def to_signed(words: np.ndarray) -> np.ndarray:
    """Integers taken mod 2^FIELD_BITS (uint32 words, or an int64 sum of them) as the signed values
    in [-2^31, 2^31) they stand for: int64, same shape. A sum of quantized updates that fits that
    range (``MaskConfig.levels`` sees to it) comes back exactly."""
    signed = np.asarray(words).astype(np.int64) % 2**FIELD_BITS
    signed[signed >= 2 ** (FIELD_BITS - 1)] -= 2**FIELD_BITS
    return signed


def dequantize(total: np.ndarray, total_weight: int, config: MaskConfig) -> np.ndarray:
    """Weighted mean from ``MaskServer.result()``: ``total * clip / (levels * total_weight)``, float64 (size,)."""
    if total_weight < 1:
        raise ValueError(f"total_weight={total_weight}: must be >= 1 (no client's weight reached the sum)")
    return np.asarray(total, dtype=np.float64) * config.clip / (config.levels * total_weight)


def wire_bytes(message: dict) -> int:
    """Payload bytes of one stage message: bytes and arrays at their length, ints at 8 bytes."""

    def size(value) -> int:
        if isinstance(value, bytes):
            return len(value)
        if isinstance(value, np.ndarray):
            return value.nbytes
        if isinstance(value, list):
            return sum(size(v) for v in value)
        return 8

    return sum(size(v) for v in message.values())


def _agree(private: X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def _prg(seed: bytes, n: int) -> np.ndarray:
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(4 * n)) + encryptor.finalize(), dtype=_WORD)


def _split(secret: bytes, threshold: int, n: int) -> list[bytes]:
    """Shamir t-of-n shares of a 32-byte secret; share i (0-based) belongs to share index i + 1."""
    halves = [Shamir.split(threshold, n, secret[i : i + 16]) for i in (0, 16)]
    return [lo[1] + hi[1] for lo, hi in zip(*halves, strict=True)]


def _combine(shares: dict[int, bytes]) -> bytes:
    """Rebuild a 32-byte secret from {share index (1-based): 32-byte share}."""
    return b"".join(Shamir.combine([(i, s[h : h + 16]) for i, s in shares.items()]) for h in (0, 16))


def _share_ad(sender: int, recipient: int) -> bytes:
    return sender.to_bytes(8, "little") + recipient.to_bytes(8, "little")


def _check_id(client_id, field: str) -> int:
    if isinstance(client_id, bool) or not isinstance(client_id, int | np.integer) or not 0 <= client_id < 2**64:
        raise SecureAggregationError(f"{field}: {client_id!r} is not a client id (int in [0, 2^64))")
    return int(client_id)


class MaskClient:
    """One client's side of a round; holds its secrets (two X25519 keys, the mask seed b_u).

    A fresh object per round: keys and seeds are never reused across rounds.
    """

    def __init__(self, client_id: int, config: MaskConfig) -> None:
        self.client_id = _check_id(client_id, "client_id")
        self.config = config
        self._c_sk = X25519PrivateKey.generate()  # encrypts shares
        self._s_sk = X25519PrivateKey.generate()  # pairwise masks; revealed to the server if this client drops
        self._b = os.urandom(_SECRET_BYTES)
        self._roster: dict[int, tuple[bytes, bytes]] = {}
        self._held: dict[int, tuple[bytes, bytes]] = {}  # sender -> (its b share, its s^SK share) for me
        self._u2: list[int] = []

    def advertise_keys(self) -> dict:
        """Stage 0: ``{"c_pk": 32 bytes, "s_pk": 32 bytes}`` (X25519 public keys)."""
        return {"c_pk": self._c_sk.public_key().public_bytes_raw(), "s_pk": self._s_sk.public_key().public_bytes_raw()}

    def share_keys(self, roster: dict) -> dict:
        """Stage 1: ``{"to": [peer ids], "ct": [encrypted shares]}`` for every other roster entry.

        ``roster``: ``MaskServer.roster()``. Each ``ct`` is AES-GCM(nonce 12 B || b share 32 B ||
        s^SK share 32 B || tag 16 B) = 92 bytes. Raises SecureAggregationError (client None) if
        the roster lacks this client's keys, repeats an id, or has fewer than t or more than
        n_clients entries.
        """
        self._roster = _parse_roster(roster, self.config)
        me = self.advertise_keys()
        if self._roster.get(self.client_id) != (me["c_pk"], me["s_pk"]):
            raise SecureAggregationError(
                f"roster: does not list client {self.client_id} with its advertised keys; resend stage 0"
            )
        ids = sorted(self._roster)
        b_shares = _split(self._b, self.config.threshold, len(ids))
        sk_shares = _split(self._s_sk.private_bytes_raw(), self.config.threshold, len(ids))
        out: dict = {"to": [], "ct": []}
        for index, peer in enumerate(ids):
            if peer == self.client_id:
                self._held[peer] = (b_shares[index], sk_shares[index])
                continue
            key = _agree(self._c_sk, self._roster[peer][0], _SHARE_INFO)
            nonce = os.urandom(_NONCE_BYTES)
            sealed = AESGCM(key).encrypt(nonce, b_shares[index] + sk_shares[index], _share_ad(self.client_id, peer))
            out["to"].append(peer)
            out["ct"].append(nonce + sealed)
        return out

    def masked_input(self, update: np.ndarray, weight: int, shares_received: dict) -> np.ndarray:
        """Stage 2: ``quantize(update, weight) + PRG(b_u) + sum_v ±PRG(s_uv)`` mod 2^32, uint32 (size+1,).

        ``shares_received``: ``MaskServer.forward_shares(client_id)``; its senders plus this
        client are U2, the peers masked against. Raises SecureAggregationError naming the
        sender of a share that does not decrypt (sent to the wrong peer, altered, another key),
        ValueError on a bad update or weight (``quantize``).
        """
        quantized = quantize(update, weight, self.config)
        senders = _ids_and_blobs(shares_received, "from", "ct")
        for sender, blob in senders:
            self._held[sender] = self._open_share(sender, blob)
        self._u2 = sorted({self.client_id, *(s for s, _ in senders)})
        if len(self._u2) < self.config.threshold:
            raise SecureAggregationError(
                f"shares_received: {len(self._u2)} clients in U2 < threshold {self.config.threshold}; abort the round"
            )
        masked = quantized + _prg(self._b, quantized.size)
        for peer in self._u2:
            if peer != self.client_id:
                masked += _pairwise_mask(self._s_sk, self._roster[peer][1], self.client_id, peer, quantized.size)
        return masked

    def _open_share(self, sender: int, blob: bytes) -> tuple[bytes, bytes]:
        if sender not in self._roster or sender == self.client_id:
            raise SecureAggregationError(f"shares_received: sender {sender} is not a peer in the roster", sender)
        fix = "sent to the wrong peer, altered, or under another key; the sender must rerun share_keys"
        if len(blob) != SHARE_CIPHERTEXT_BYTES:
            raise SecureAggregationError(
                f"share for client {self.client_id}: {len(blob)} bytes, expected {SHARE_CIPHERTEXT_BYTES}; {fix}",
                sender,
            )
        key = _agree(self._c_sk, self._roster[sender][0], _SHARE_INFO)
        try:
            plain = AESGCM(key).decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], _share_ad(sender, self.client_id))
        except InvalidTag:
            raise SecureAggregationError(
                f"share for client {self.client_id}: does not authenticate; {fix}", sender
            ) from None
        return plain[:_SHARE_BYTES], plain[_SHARE_BYTES:]

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict:
        """Stage 3: ``{"b_from", "b_share", "sk_from", "sk_share"}``: shares of each survivor's b and each dropped s^SK.

        ``survivors`` (U3, this client among them) and ``dropped`` (U2 minus U3) come from
        ``MaskServer.unmask_request()``. Raises SecureAggregationError (client None) unless
        they are disjoint, cover exactly this client's U2, and survivors >= t: a server that
        asked for both shares of one client would learn that client's input.
        """
        survivors, dropped = [_check_id(i, "survivors") for i in survivors], [_check_id(i, "dropped") for i in dropped]
        if set(survivors) & set(dropped) or sorted(survivors + dropped) != self._u2:
            raise SecureAggregationError(
                "unmask_request: survivors and dropped must be disjoint and make up U2 of stage 2; "
                "refusing to reveal both shares of one client"
            )
        if self.client_id not in survivors or len(survivors) < self.config.threshold:
            raise SecureAggregationError(
                f"unmask_request: {len(survivors)} survivors (this client among them?) < threshold "
                f"{self.config.threshold}; abort the round"
            )
        return {
            "b_from": survivors,
            "b_share": [self._held[u][0] for u in survivors],
            "sk_from": dropped,
            "sk_share": [self._held[v][1] for v in dropped],
        }

    def to_bytes(self) -> bytes:
        """This client's round so far, secrets included (both private keys, the mask seed, the
        shares it holds), for a runtime that does not keep the object between stages: Flower's
        deployment starts a new ClientApp process per message, and the client keeps this in its
        node's ``context.state``, never sends it. :meth:`from_bytes` inverts it."""
        pairs = lambda d: {str(k): [a.hex(), b.hex()] for k, (a, b) in d.items()}  # noqa: E731
        return json.dumps({
            "client_id": self.client_id, "config": dataclasses.asdict(self.config),
            "c_sk": self._c_sk.private_bytes_raw().hex(), "s_sk": self._s_sk.private_bytes_raw().hex(),
            "b": self._b.hex(), "roster": pairs(self._roster), "held": pairs(self._held), "u2": self._u2,
        }).encode()  # fmt: skip

    @classmethod
    def from_bytes(cls, blob: bytes) -> MaskClient:
        """The client :meth:`to_bytes` saved.

        Raises:
            SecureAggregationError: ``blob`` is not a saved client (names the fix).
        """
        try:
            d = json.loads(blob)
            client = cls(d["client_id"], MaskConfig(**d["config"]))
            client._c_sk = X25519PrivateKey.from_private_bytes(bytes.fromhex(d["c_sk"]))
            client._s_sk = X25519PrivateKey.from_private_bytes(bytes.fromhex(d["s_sk"]))
            client._b = bytes.fromhex(d["b"])
            for name in ("roster", "held"):
                setattr(
                    client, f"_{name}", {int(k): (bytes.fromhex(a), bytes.fromhex(b)) for k, (a, b) in d[name].items()}
                )
            client._u2 = [int(u) for u in d["u2"]]
        except (ValueError, KeyError, TypeError) as e:
            raise SecureAggregationError(f"saved masking state is unreadable ({e}); restart the round") from None
        return client


def _pairwise_mask(private: X25519PrivateKey, peer_pk: bytes, me: int, peer: int, n: int) -> np.ndarray:
    """``p_{me,peer} = +PRG(s)`` if me < peer else ``-PRG(s)`` (mod 2^32), so p_{u,v} + p_{v,u} = 0."""
    stream = _prg(_agree(private, peer_pk, _MASK_INFO), n)
    return stream if me < peer else (-stream.astype(np.int64)).astype(_WORD)


def _parse_roster(roster: dict, config: MaskConfig) -> dict[int, tuple[bytes, bytes]]:
    try:
        ids, c_pks, s_pks = list(roster["ids"]), list(roster["c_pk"]), list(roster["s_pk"])
    except (KeyError, TypeError):
        raise SecureAggregationError(
            'roster: expected {"ids", "c_pk", "s_pk"} lists from MaskServer.roster()'
        ) from None
    ids = [_check_id(i, "roster.ids") for i in ids]
    if not len(ids) == len(c_pks) == len(s_pks) or len(set(ids)) != len(ids):
        raise SecureAggregationError("roster: ids, c_pk, s_pk differ in length or repeat an id")
    if not config.threshold <= len(ids) <= config.n_clients:
        raise SecureAggregationError(
            f"roster: {len(ids)} clients, expected between threshold {config.threshold} "
            f"and n_clients {config.n_clients}"
        )
    return {i: (bytes(c), bytes(s)) for i, c, s in zip(ids, c_pks, s_pks, strict=True)}


def _ids_and_blobs(message: dict, id_key: str, blob_key: str) -> list[tuple[int, bytes]]:
    try:
        ids, blobs = list(message[id_key]), list(message[blob_key])
    except (KeyError, TypeError):
        raise SecureAggregationError(f"message: expected lists {id_key!r} and {blob_key!r}") from None
    if len(ids) != len(blobs) or len(set(ids)) != len(ids):
        raise SecureAggregationError(f"message: {id_key!r} and {blob_key!r} differ in length or repeat an id")
    for blob in blobs:
        if not isinstance(blob, bytes):
            raise SecureAggregationError(f"message: {blob_key!r} holds {type(blob).__name__}, expected bytes")
    return [(_check_id(i, id_key), b) for i, b in zip(ids, blobs, strict=True)]


class MaskServer:
    """The server's side of a round: relays shares, sums masked inputs, removes the masks.

    Holds no client secret and no single client's input (docstring of this module; the test
    inspects every attribute). Each ``collect_*`` validates one client's message and raises
    SecureAggregationError naming that client; a stage closes at the first call of the next
    stage's server method (``roster``, ``forward_shares``, ``unmask_request``, ``result``).
    """

    def __init__(self, config: MaskConfig) -> None:
        self.config = config
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._u1: list[int] | None = None
        self._shares: dict[int, dict[int, bytes]] = {}  # sender -> recipient -> encrypted share
        self._u2: list[int] | None = None
        self._masked_sum = np.zeros(config.size + 1, dtype=_WORD)
        self._u3: list[int] = []
        self._dropped: list[int] | None = None
        self._revealed: dict[int, dict] = {}  # survivor -> its stage-3 message

    def collect_keys(self, client_id: int, message: dict) -> None:
        """Stage 0: record ``{"c_pk", "s_pk"}`` (two 32-byte X25519 public keys) of one client."""
        client_id = _check_id(client_id, "client_id")
        if self._u1 is not None or client_id in self._keys:
            raise SecureAggregationError(
                "keys: sent twice or after the roster was fixed; send once per round", client_id
            )
        keys = []
        for field in ("c_pk", "s_pk"):
            value = message.get(field) if isinstance(message, dict) else None
            try:
                X25519PublicKey.from_public_bytes(value)
            except (TypeError, ValueError):
                raise SecureAggregationError(
                    f"{field}: not a 32-byte X25519 public key; send MaskClient.advertise_keys()", client_id
                ) from None
            keys.append(value)
        if len(self._keys) >= self.config.n_clients:
            raise SecureAggregationError(f"keys: more than n_clients={self.config.n_clients} clients", client_id)
        self._keys[client_id] = (keys[0], keys[1])

    def roster(self) -> dict:
        """Close stage 0: ``{"ids": [...], "c_pk": [...], "s_pk": [...]}`` (U1), sorted by id, to every client.

        Raises SecureAggregationError if fewer than t clients advertised keys.
        """
        if self._u1 is None:
            _require(len(self._keys), self.config.threshold, "clients advertised keys")
            self._u1 = sorted(self._keys)
        return {
            "ids": list(self._u1),
            "c_pk": [self._keys[i][0] for i in self._u1],
            "s_pk": [self._keys[i][1] for i in self._u1],
        }

    def collect_shares(self, client_id: int, message: dict) -> None:
        """Stage 1: record ``{"to", "ct"}``: one 92-byte encrypted share for every other U1 client."""
        client_id = _check_id(client_id, "client_id")
        if self._u1 is None or self._u2 is not None or client_id not in self._u1 or client_id in self._shares:
            raise SecureAggregationError(
                "shares: not in the roster, sent twice, or sent outside stage 1; send share_keys(roster) once",
                client_id,
            )
        pairs = _ids_and_blobs(message, "to", "ct")
        expected = set(self._u1) - {client_id}
        if {i for i, _ in pairs} != expected:
            raise SecureAggregationError(
                f"shares.to: must address exactly the other roster clients {sorted(expected)}", client_id
            )
        for peer, blob in pairs:
            if len(blob) != SHARE_CIPHERTEXT_BYTES:
                raise SecureAggregationError(
                    f"shares.ct for client {peer}: {len(blob)} bytes, expected {SHARE_CIPHERTEXT_BYTES}; "
                    "rerun share_keys",
                    client_id,
                )
        self._shares[client_id] = dict(pairs)

    def forward_shares(self, client_id: int) -> dict:
        """Close stage 1 (U2 = clients whose shares arrived): ``{"from", "ct"}``, the shares addressed to ``client_id``.

        Raises SecureAggregationError if fewer than t clients sent shares, or ``client_id`` is not in U2.
        """
        if self._u2 is None:
            _require(len(self._shares), self.config.threshold, "clients sent shares")
            self._u2 = sorted(self._shares)
        if client_id not in self._u2:
            raise SecureAggregationError(
                "forward_shares: sent no shares in stage 1, so it is not in this round", client_id
            )
        senders = [s for s in self._u2 if s != client_id]
        return {"from": senders, "ct": [self._shares[s][client_id] for s in senders]}

    def collect_masked(self, client_id: int, masked: np.ndarray) -> None:
        """Stage 2: add one client's masked input (uint32, shape (size+1,)) to the running sum mod 2^32."""
        client_id = _check_id(client_id, "client_id")
        if self._u2 is None or self._dropped is not None or client_id not in self._u2 or client_id in self._u3:
            raise SecureAggregationError(
                "masked input: not in U2, sent twice, or sent outside stage 2; send masked_input once", client_id
            )
        want = (self.config.size + 1,)
        if not isinstance(masked, np.ndarray) or masked.dtype != np.uint32 or masked.shape != want:
            got = f"{masked.dtype} {masked.shape}" if isinstance(masked, np.ndarray) else type(masked).__name__
            raise SecureAggregationError(
                f"masked input: {got}, expected uint32 {want} (MaskConfig.size + 1); same model on every client?",
                client_id,
            )
        self._masked_sum += masked
        self._u3.append(client_id)

    def unmask_request(self) -> dict:
        """Close stage 2: ``{"survivors": U3, "dropped": U2 - U3}`` for every survivor.

        Raises SecureAggregationError if fewer than t masked inputs arrived (the masks of the
        dropped clients could not be removed: the round must be abandoned, never summed).
        """
        if self._dropped is None:
            _require(len(self._u3), self.config.threshold, "masked inputs arrived")
            self._u3.sort()
            self._dropped = sorted(set(self._u2) - set(self._u3))
        return {"survivors": list(self._u3), "dropped": list(self._dropped)}

    def collect_unmask(self, client_id: int, message: dict) -> None:
        """Stage 3: record one survivor's revealed shares (32 bytes each) after checking whose they are."""
        client_id = _check_id(client_id, "client_id")
        if self._dropped is None or client_id not in self._u3 or client_id in self._revealed:
            raise SecureAggregationError("unmask: not a survivor, sent twice, or sent outside stage 3", client_id)
        b = _ids_and_blobs(message, "b_from", "b_share")
        sk = _ids_and_blobs(message, "sk_from", "sk_share")
        if [i for i, _ in b] != self._u3 or [i for i, _ in sk] != self._dropped:
            raise SecureAggregationError(
                "unmask: b_from must be the survivors and sk_from the dropped clients", client_id
            )
        if any(len(s) != _SHARE_BYTES for _, s in b + sk):
            raise SecureAggregationError(f"unmask: a share is not {_SHARE_BYTES} bytes; resend unmask()", client_id)
        self._revealed[client_id] = {"b": dict(b), "sk": dict(sk)}

    def result(self) -> tuple[np.ndarray, int]:
        """Close stage 3: (``sum(q_u)`` over U3 as int64, shape (size,); ``sum(weight_u)``).

        Rebuilds each dropped client's s^SK (checked against its advertised public key) and each
        survivor's b from t revealed shares, removes their masks, then forgets the shares.
        Raises SecureAggregationError if fewer than t survivors answered the unmask request,
        or a rebuilt key does not match (a corrupt share).
        """
        if self._dropped is None:
            raise SecureAggregationError("result: called before unmask_request(); finish stages 2 and 3 first")
        _require(len(self._revealed), self.config.threshold, "survivors answered unmask")
        index = {c: i + 1 for i, c in enumerate(self._u1)}
        responders = sorted(self._revealed)[: self.config.threshold]
        total = self._masked_sum.copy()
        for u in self._u3:
            total -= _prg(_combine({index[r]: self._revealed[r]["b"][u] for r in responders}), total.size)
        for v in self._dropped:
            s_sk = self._rebuild_key(v, {index[r]: self._revealed[r]["sk"][v] for r in responders})
            for u in self._u3:
                total -= _pairwise_mask(s_sk, self._keys[u][1], u, v, total.size)
        self._revealed.clear()
        signed = to_signed(total)
        return signed[:-1], int(signed[-1])

    def _rebuild_key(self, client: int, shares: dict[int, bytes]) -> X25519PrivateKey:
        key = X25519PrivateKey.from_private_bytes(_combine(shares))
        if key.public_key().public_bytes_raw() != self._keys[client][1]:
            raise SecureAggregationError(
                "unmask: revealed shares of its mask key do not rebuild its advertised s_pk (a corrupt share)", client
            )
        return key

    def dequantize(self, total: np.ndarray, total_weight: int) -> np.ndarray:
        """``dequantize`` with this round's config: the weighted mean update, float64 (size,)."""
        return dequantize(total, total_weight, self.config)


def _require(have: int, threshold: int, what: str) -> None:
    if have < threshold:
        raise SecureAggregationError(
            f"{have} {what}, fewer than threshold t={threshold}: the masks cannot be removed; "
            "abandon this round and rerun it with the clients still connected"
        )
