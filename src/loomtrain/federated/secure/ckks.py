"""CKKS secure aggregation with TenSEAL: clients share one secret key, the server adds ciphertexts.

Flow (docs/secure_aggregation.md): ``write_keys`` (the ``loomtrain fl keys`` step) writes one
``client_<i>.ctx`` per client (parameters + the shared secret key) and ``server.ctx`` (parameters
only: no secret, public, relinearization or Galois key; adding ciphertexts needs none). Each
client ``encrypt``s ``[weight * update, weight, 1]`` packed over as many ciphertexts as the
length needs, two values per slot (below); the sum then carries the sum of weights and the
client count (a decryption under another key gives noise in the count slot, not a small
integer). The server ``aggregate``s
(slot-wise sum) with ``server.ctx``; each client ``decrypt_mean``s the sum:
``sum(w_i * u_i) / sum(w_i)``.

Compactness: CKKS (Cheon, Kim, Kim, Song, ASIACRYPT 2017) with N = 4096 and coefficient
modulus bits (56, 53): 109 bits, the 128-bit bound for N = 4096 in the HomomorphicEncryption.org
Security Standard (Albrecht et al., 2018, Table 1, ternary secret; SEAL's
``CoeffModulus::MaxBitCount(4096, tc128)``). The 53-bit prime is SEAL's special (key) prime, so a
ciphertext lives at the single 56-bit data prime from the start: the same effect as switching
to the last modulus before sending, without a modulus chain. Below 2^56 every coefficient's top
byte is zero, which SEAL's zstd compression removes (the sum downloads at 3.9x, not 4x); scale
2^37 leaves 2^18 of headroom for the sum. Clients encrypt with the secret key (SEAL's
``encrypt_symmetric``), whose serialized form replaces the uniform polynomial ``c1`` by the PRNG
seed that regenerates it (SEAL 3.6+ seeded ciphertexts): about half the bytes.

Two values per slot: a CKKS slot holds a complex number, and the encoding (the inverse of the
canonical embedding, Cheon et al. §3.1) treats real and imaginary parts alike, so the pair
``(v[2k], v[2k+1])`` rides as ``v[2k] + i·v[2k+1]``; slot-wise addition adds both parts
independently. A ciphertext of N = 4096 thus carries 4096 values, not 2048: half the
ciphertexts, half the bytes and half the encryption, sum and decryption time, at the same error
(1.2e-8 absolute on a sum of 10 values of magnitude 0.05 either way). Measured: 1.95x the fp32
bytes up, 3.9x down, error 1e-9 of the updates' scale (benchmarks/bench_secure_aggregation.py).

TenSEAL's Python API serializes ciphertexts only in their expanded form, so the seeded
encryption, the sum and the decryption go through TenSEAL's own SEAL bindings
(``tenseal.sealapi``), which save and load through files: each call uses a private temporary
directory.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tenseal as ts
from tenseal import sealapi

from loomtrain.federated.secure.errors import SecureAggregationError

POLY_MODULUS_DEGREE = 4096
COEFF_MOD_BIT_SIZES = (56, 53)
SCALE_BITS = 37
# The per-client value bound leaves room for the sum over this many clients.
MAX_CLIENTS = 128
_KEYS_FIX = "use the client_<i>.ctx / server.ctx pair written by one `loomtrain fl keys` run"


def write_keys(
    directory: Path,
    n_clients: int,
    *,
    poly_modulus_degree: int = POLY_MODULUS_DEGREE,
    coeff_mod_bit_sizes: Sequence[int] = COEFF_MOD_BIT_SIZES,
) -> None:
    """Write ``client_<i>.ctx`` (i = 0..n_clients-1, the shared secret key) and ``server.ctx``.

    The client files hold the CKKS parameters and the one secret key all clients share (as
    NVFlare provisions it, out of band); ``server.ctx`` holds the parameters only. Each file is
    written to a temporary name and renamed (``os.replace``), so a crash never leaves half a key.
    Raises ValueError for ``n_clients < 1`` or parameters under 128-bit security (SEAL's check
    against the HomomorphicEncryption.org standard table).
    """
    if n_clients < 1:
        raise ValueError(f"n_clients={n_clients}: need at least one client; pass --clients >= 1")
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree,
        coeff_mod_bit_sizes=list(coeff_mod_bit_sizes),
        encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
        n_threads=1,
    )
    client = ctx.serialize(save_public_key=False, save_secret_key=True, save_galois_keys=False, save_relin_keys=False)
    server = ctx.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n_clients):
        _write_atomic(directory / f"client_{i}.ctx", client)
    _write_atomic(directory / "server.ctx", server)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def load_context(path: str | Path) -> ts.Context:
    """Load a context file written by ``write_keys``; raises ValueError naming the file if it is not one."""
    try:
        return ts.context_from(Path(path).read_bytes())
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: not a TenSEAL context ({exc}); {_KEYS_FIX}") from None


def slot_count(ctx: ts.Context) -> int:
    """Complex slots per ciphertext: N/2 (2048 for N = 4096)."""
    return ctx.seal_context().data.first_context_data().parms().poly_modulus_degree() // 2


def values_per_chunk(ctx: ts.Context) -> int:
    """Real values per ciphertext: two per complex slot, N (4096 for N = 4096)."""
    return 2 * slot_count(ctx)


def n_chunks(ctx: ts.Context, size: int) -> int:
    """Ciphertexts in one client's payload for an update of ``size`` values (weight and count add two values)."""
    return math.ceil((size + 2) / values_per_chunk(ctx))


def value_bound(ctx: ts.Context, scale_bits: float = SCALE_BITS) -> float:
    """Largest ``|weight * update|`` (and weight) one client may send: the sum of ``MAX_CLIENTS`` such
    values times 2^scale_bits must stay under half the data prime (CKKS decodes centred mod q).

    A plaintext coefficient is at most the largest slot's modulus times the scale (each is an
    average of the N/2 slots times roots of unity), and a slot packing two values of magnitude
    at most x has modulus at most √2·x: hence the √2.
    """
    data_bits = ctx.seal_context().data.first_context_data().total_coeff_modulus_bit_count()
    return 2.0 ** (data_bits - 1 - scale_bits) / MAX_CLIENTS / math.sqrt(2)


# RAM-backed where the OS has one: a disk-backed temp file cost 3-4 ms per ciphertext, ten times the load.
_SCRATCH_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@contextmanager
def _scratch() -> Iterator[str]:
    """A private file path for SEAL's file-only save/load, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="loomtrain-ckks-", dir=_SCRATCH_DIR) as d:
        yield os.path.join(d, "ct")


def encrypt(ctx: ts.Context, update: np.ndarray, weight: float, *, scale_bits: float = SCALE_BITS) -> list[bytes]:
    """Encrypt ``[weight * update, weight, 1]`` (length size+2) as ``n_chunks(ctx, size)`` seeded ciphertexts,
    two values per complex slot.

    ``update``: 1-D finite floats, shape (size,). ``weight``: > 0 (e.g. the client's example
    count). The weight rides in the slot after the last value, so the server's sum carries the
    sum of weights encrypted too. Returns one bytes object per ciphertext (about 1.9x the fp32
    bytes of the chunk). Raises ValueError on a non-1-D or non-finite update, a weight <= 0, a
    context without the secret key, or values above ``value_bound`` (they would wrap mod q).
    """
    values = _weighted_values(ctx, update, weight, scale_bits)
    sc = ctx.seal_context().data
    encryptor = sealapi.Encryptor(sc, _secret_key(ctx))
    encoder = sealapi.CKKSEncoder(sc)
    slots = encoder.slot_count()
    # Pairs of consecutive float64s read as one complex128 (an odd length gets a zero partner).
    pairs = np.concatenate([values, np.zeros(values.size % 2)]).view(np.complex128)
    out = []
    with _scratch() as path:
        for start in range(0, pairs.size, slots):
            plain = sealapi.Plaintext()
            encoder.encode(pairs[start : start + slots].tolist(), 2.0**scale_bits, plain)
            encryptor.encrypt_symmetric(plain).save(path)
            out.append(Path(path).read_bytes())
    return out


def _weighted_values(ctx: ts.Context, update: np.ndarray, weight: float, scale_bits: float) -> np.ndarray:
    update = np.asarray(update, dtype=np.float64)
    if update.ndim != 1 or update.size == 0:
        raise ValueError(f"update: shape {update.shape}, expected a non-empty 1-D array; flatten the model delta")
    if not np.isfinite(update).all():
        raise ValueError("update: holds NaN or inf; fix the local training step before encrypting")
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight={weight}: must be a finite number > 0 (e.g. the client's example count)")
    values = np.concatenate([weight * update, [weight, 1.0]])
    bound = value_bound(ctx, scale_bits)
    if np.abs(values).max() >= bound:
        raise ValueError(
            f"weight * update: max |value| {np.abs(values).max():.4g} >= {bound:.4g}, the sum over {MAX_CLIENTS} "
            f"clients would overflow the modulus at scale 2^{scale_bits}; pass a smaller weight "
            "(e.g. example count / 1000) or a smaller scale_bits"
        )
    return values


def _secret_key(ctx: ts.Context) -> sealapi.SecretKey:
    if not ctx.has_secret_key():
        raise ValueError(f"ctx: holds no secret key (server.ctx?); encrypt/decrypt need a client_<i>.ctx ({_KEYS_FIX})")
    return ctx.secret_key().data


def aggregate(
    server_ctx: ts.Context, payloads: Mapping[int | str, Sequence[bytes]], *, size: int | None = None
) -> list[bytes]:
    """Slot-wise sum of every client's payload; runs with ``server.ctx`` (no secret key).

    Adding complex slots adds real and imaginary parts separately, so both values packed in a
    slot are summed as unpacked ones would be.

    ``payloads``: client id -> that client's ``encrypt`` output. ``size``: the update length,
    if known, fixes the expected chunk count; otherwise the most common count among clients is
    expected. Returns the encrypted sum, one bytes object per chunk (unseeded: twice a client's
    upload). Raises SecureAggregationError naming the client whose payload has the wrong number
    of chunks, undecodable or truncated bytes, a ciphertext of other parameters, or another
    scale; and (client None) when ``server_ctx`` holds the secret key or ``payloads`` is empty.
    """
    if server_ctx.has_secret_key():
        raise SecureAggregationError(f"server_ctx: holds the secret key; the server must load server.ctx ({_KEYS_FIX})")
    if not payloads:
        raise SecureAggregationError("payloads: empty; aggregate needs at least one client's ciphertexts")
    expected = n_chunks(server_ctx, size) if size is not None else _common_chunk_count(payloads)
    sc = server_ctx.seal_context().data
    evaluator = sealapi.Evaluator(sc)
    total, scale = None, None
    with _scratch() as path:
        for client, payload in payloads.items():
            _check_chunk_count(client, payload, expected)
            cts = [_load_ciphertext(sc, data, path, client, i) for i, data in enumerate(payload)]
            scale = _check_scale(client, cts, scale)
            if total is None:
                total = cts
            else:
                for acc, ct in zip(total, cts, strict=True):
                    evaluator.add_inplace(acc, ct)
        return [_save(ct, path) for ct in total]


def _common_chunk_count(payloads: Mapping[int | str, Sequence[bytes]]) -> int:
    return Counter(len(p) for p in payloads.values()).most_common(1)[0][0]


def _check_chunk_count(client: int | str, payload: Sequence[bytes], expected: int) -> None:
    if isinstance(payload, bytes | str) or len(payload) != expected:
        got = "one bytes object" if isinstance(payload, bytes | str) else f"{len(payload)} chunks"
        raise SecureAggregationError(
            f"payload: {got}, expected a list of {expected} ciphertexts; the client's update size differs "
            "from the others' (same model on every client?)",
            client,
        )


def _load_ciphertext(sc: sealapi.SEALContext, data: bytes, path: str, client: int | str | None, index: int):
    fix = f"re-encrypt with loomtrain.federated.secure.ckks.encrypt ({_KEYS_FIX})"
    if not isinstance(data, bytes | bytearray):
        raise SecureAggregationError(f"payload[{index}]: {type(data).__name__}, expected bytes; {fix}", client)
    Path(path).write_bytes(data)
    ct = sealapi.Ciphertext()
    try:
        ct.load(sc, path)
    except (RuntimeError, ValueError) as exc:
        raise SecureAggregationError(
            f"payload[{index}]: not a ciphertext of this context ({exc}); {fix}", client
        ) from None
    if ct.parms_id() != sc.first_parms_id():
        raise SecureAggregationError(
            f"payload[{index}]: not at this context's data level (other parameters); {fix}", client
        )
    if ct.size() != 2:
        raise SecureAggregationError(
            f"payload[{index}]: {ct.size()} polynomials, a fresh encryption has 2; {fix}", client
        )
    return ct


def _check_scale(client: int | str, cts: list, scale: float | None) -> float:
    for i, ct in enumerate(cts):
        if scale is not None and ct.scale != scale:
            raise SecureAggregationError(
                f"payload[{i}]: scale 2^{math.log2(ct.scale):.1f} differs from 2^{math.log2(scale):.1f}; "
                "every client must encrypt with the same scale_bits",
                client,
            )
        scale = ct.scale
    return scale


def _save(ct: sealapi.Ciphertext, path: str) -> bytes:
    ct.save(path)
    return Path(path).read_bytes()


def decrypt_sum(ctx: ts.Context, payload: Sequence[bytes], size: int) -> tuple[np.ndarray, float, int]:
    """Decrypt ``aggregate``'s output: (``sum(w_i * u_i)`` float64 shape (size,), ``sum(w_i)``, client count).

    Raises SecureAggregationError (client None) if the payload has the wrong chunk count for
    ``size``, a chunk does not decode under ``ctx``, or the client-count slot is not a positive
    integer (to within 1e-3): the clients encrypted under another key, or the sum wrapped;
    ValueError if ``ctx`` holds no secret key.
    """
    if isinstance(payload, bytes) or len(payload) != n_chunks(ctx, size):
        raise SecureAggregationError(
            f"aggregate: {len(payload)} chunks, expected {n_chunks(ctx, size)} for size={size}; "
            "pass the update length the clients encrypted"
        )
    sc = ctx.seal_context().data
    decryptor = sealapi.Decryptor(sc, _secret_key(ctx))
    encoder = sealapi.CKKSEncoder(sc)
    values = []
    with _scratch() as path:
        for i, data in enumerate(payload):
            plain = sealapi.Plaintext()
            decryptor.decrypt(_load_ciphertext(sc, data, path, None, i), plain)
            values.append(np.asarray(encoder.decode_complex(plain), np.complex128).view(np.float64))
    flat = np.concatenate(values)
    count = flat[size + 1]
    if not (round(count) >= 1 and abs(count - round(count)) < 1e-3):
        raise SecureAggregationError(
            f"aggregate: decrypted client count {count:.4g} is not a positive integer; the clients encrypted "
            f"under another key than ctx, or the sum overflowed ({_KEYS_FIX})"
        )
    return flat[:size], float(flat[size]), round(count)


def decrypt_mean(ctx: ts.Context, payload: Sequence[bytes], size: int) -> np.ndarray:
    """Decrypt ``aggregate``'s output to the weighted mean ``sum(w_i * u_i) / sum(w_i)``, float64, shape (size,).

    Errors as ``decrypt_sum``. Precision: the CKKS noise on ``sum(w_i * u_i)`` is about 1e-8
    absolute for 10 clients at scale 2^37 (docs/secure_aggregation.md), divided by ``sum(w_i)`` here.
    """
    weighted, total_weight, _ = decrypt_sum(ctx, payload, size)
    return weighted / total_weight
