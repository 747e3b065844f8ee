"""Secure aggregation in one process: bytes against plaintext fp32, CKKS precision, masking exactness.

CKKS (``loomtrain.federated.secure.ckks``): ``clients`` clients encrypt updates of ``size``
values (normal, standard deviation 1e-2, the scale of a model delta) with example-count weights
(20..60); reported per client: upload bytes / fp32 bytes, download (the encrypted sum) / fp32
bytes, the error of the decrypted weighted mean relative to the updates' scale (max |update|),
and seconds to encrypt, aggregate and decrypt. Part ``precision``: the absolute error on the
decrypted weighted sum and the mean's error relative to max |update|, for update standard
deviations 1e-1, 1e-2, 1e-4 under example-count weights and under weight 1 (20,000 values).
For reference, NVFlare's default TenSEAL set-up
(N = 8192, coefficient moduli 60/40/40 bits, scale 2^40, ``CKKSVector.serialize``) on one full
ciphertext. Masking (``loomtrain.federated.secure.mask``): the same clients, threshold
``clients // 2 + 1``, ``drop`` of them leaving after their shares (before the masked input);
reported: whether the sum equals the survivors' quantized sum bit for bit, masked-input bytes /
fp32 bytes, every stage's upload bytes per client / fp32 bytes (keys, shares and unmask
included), and seconds per stage. Writes ``benchmarks/results/secure_aggregation.json`` and
prints the CKKS upload ratio last.

    python benchmarks/bench_secure_aggregation.py [--size 100000 --clients 10 --drop 3 --out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tenseal as ts
from tenseal import sealapi

from loomtrain.federated.secure import ckks
from loomtrain.federated.secure.mask import MaskClient, MaskConfig, MaskServer, quantize, to_signed, wire_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "secure_aggregation.json"
CKKS_BYTES_TARGET = 8.0
CKKS_ERROR_TARGET = 1e-6
MASK_BYTES_TARGET = 1.1


def client_updates(size: int, clients: int, seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """Per-client updates (normal, std 1e-2) and integer example-count weights in [20, 60]."""
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=1e-2, size=size) for _ in range(clients)], [int(w) for w in rng.integers(20, 61, clients)]


def measure_ckks(size: int, clients: int) -> dict:
    """One CKKS round: bytes ratios, relative error and seconds per step (see the module docstring)."""
    ups, weights = client_updates(size, clients)
    with tempfile.TemporaryDirectory(prefix="bench-ckks-") as d:
        ckks.write_keys(Path(d), 1)
        client, server = ckks.load_context(Path(d) / "client_0.ctx"), ckks.load_context(Path(d) / "server.ctx")
        server_ctx_bytes = (Path(d) / "server.ctx").stat().st_size
    t0 = time.perf_counter()
    payloads = {i: ckks.encrypt(client, u, w) for i, (u, w) in enumerate(zip(ups, weights, strict=True))}
    t1 = time.perf_counter()
    summed = ckks.aggregate(server, payloads, size=size)
    t2 = time.perf_counter()
    mean = ckks.decrypt_mean(client, summed, size)
    t3 = time.perf_counter()
    ref = sum(w * u for w, u in zip(weights, ups, strict=True)) / sum(weights)
    parms = server.seal_context().data.key_context_data().parms()
    fp32 = 4 * size
    return {
        "poly_modulus_degree": parms.poly_modulus_degree(),
        "coeff_mod_bit_sizes": [m.bit_count() for m in parms.coeff_modulus()],
        "max_bits_128_bit_security": sealapi.CoeffModulus.MaxBitCount(
            parms.poly_modulus_degree(), sealapi.SEC_LEVEL_TYPE.TC128
        ),
        "scale_bits": ckks.SCALE_BITS,
        "chunks_per_client": len(payloads[0]),
        "server_ctx_bytes": server_ctx_bytes,
        "upload_ratio": sum(map(len, payloads[0])) / fp32,
        "download_ratio": sum(map(len, summed)) / fp32,
        "relative_error": float(np.abs(mean - ref).max() / max(np.abs(u).max() for u in ups)),
        "encrypt_s_per_client": (t1 - t0) / clients,
        "aggregate_s": t2 - t1,
        "decrypt_s": t3 - t2,
    }


def precision_sweep(clients: int, size: int = 20_000) -> list[dict]:
    """Per (weights, update std): max abs error on the decrypted sum, and of the mean over max |update|."""
    with tempfile.TemporaryDirectory(prefix="bench-ckks-") as d:
        ckks.write_keys(Path(d), 1)
        client, server = ckks.load_context(Path(d) / "client_0.ctx"), ckks.load_context(Path(d) / "server.ctx")
    rows = []
    for weighting in ("example_counts", "ones"):
        for std in (1e-1, 1e-2, 1e-4):
            ups, counts = client_updates(size, clients)
            ups = [u * (std / 1e-2) for u in ups]
            weights = counts if weighting == "example_counts" else [1] * clients
            payloads = {i: ckks.encrypt(client, u, w) for i, (u, w) in enumerate(zip(ups, weights, strict=True))}
            weighted, total_weight, _ = ckks.decrypt_sum(client, ckks.aggregate(server, payloads), size)
            abs_error = float(np.abs(weighted - sum(w * u for w, u in zip(weights, ups, strict=True))).max())
            scale = max(np.abs(u).max() for u in ups)
            rows.append(
                {"weights": weighting, "sum_of_weights": total_weight, "update_std": std, "abs_error_sum": abs_error}
                | {"relative_error_mean": abs_error / total_weight / scale}
            )
    return rows


def nvflare_default_ratio() -> float:
    """Bytes / fp32 bytes of one full CKKSVector under NVFlare's default TenSEAL parameters."""
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 40], n_threads=1)
    ctx.global_scale = 2.0**40
    values = client_updates(4096, 1)[0][0]
    return len(ts.ckks_vector(ctx, values.tolist()).serialize()) / (4 * values.size)


def measure_mask(size: int, clients: int, drop: int) -> dict:
    """One masking round with ``drop`` clients leaving after their shares (see the module docstring)."""
    ups, weights = client_updates(size, clients)
    config = MaskConfig(size=size, n_clients=clients, threshold=clients // 2 + 1, clip=0.1, max_weight=64)
    ids = list(range(clients))
    members = {i: MaskClient(i, config) for i in ids}
    server = MaskServer(config)
    upload = dict.fromkeys(ids, 0)
    seconds: dict[str, float] = {}

    def stage(name: str, senders: list[int], make, collect) -> None:
        start = time.perf_counter()
        for i in senders:
            message = make(i)
            upload[i] += wire_bytes(message if isinstance(message, dict) else {"y": message})
            collect(i, message)
        seconds[name] = time.perf_counter() - start

    stage("advertise_keys", ids, lambda i: members[i].advertise_keys(), server.collect_keys)
    roster = server.roster()
    stage("share_keys", ids, lambda i: members[i].share_keys(roster), server.collect_shares)
    survivors = ids[drop:]

    def masked(i):
        return members[i].masked_input(ups[i], weights[i], server.forward_shares(i))

    stage("masked_input", survivors, masked, server.collect_masked)
    request = server.unmask_request()
    stage("unmask", survivors, lambda i: members[i].unmask(**request), server.collect_unmask)
    start = time.perf_counter()
    total, total_weight = server.result()
    seconds["server_result"] = time.perf_counter() - start
    expected = to_signed(sum(quantize(ups[i], weights[i], config).astype(np.int64) for i in survivors))
    fp32 = 4 * size
    return {
        "threshold": config.threshold,
        "dropped_after_shares": drop,
        "exact": bool(np.array_equal(total, expected[:-1]) and total_weight == expected[-1]),
        "masked_input_ratio": (size + 1) * 4 / fp32,
        "upload_ratio_all_stages": max(upload[i] for i in survivors) / fp32,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=100_000, help="update length (values)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--drop", type=int, default=3, help="mask: clients that leave after sending their shares")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the JSON result goes")
    args = p.parse_args()
    if not 0 <= args.drop < args.clients - args.clients // 2:
        p.error(f"--drop {args.drop}: the survivors must reach the threshold {args.clients // 2 + 1}")
    result = {"size": args.size, "clients": args.clients, "tenseal": ts.__version__}
    result["ckks"] = c = measure_ckks(args.size, args.clients)
    c["nvflare_default_upload_ratio"] = nvflare_default_ratio()
    c["precision"] = precision_sweep(args.clients)
    c["meets_targets"] = c["upload_ratio"] <= CKKS_BYTES_TARGET and c["relative_error"] <= CKKS_ERROR_TARGET
    result["mask"] = m = measure_mask(args.size, args.clients, args.drop)
    m["meets_targets"] = m["exact"] and m["masked_input_ratio"] <= MASK_BYTES_TARGET
    print(
        f"ckks: N={c['poly_modulus_degree']} moduli {c['coeff_mod_bit_sizes']} (<= {c['max_bits_128_bit_security']} "
        f"bits for 128-bit), upload {c['upload_ratio']:.2f}x fp32 "
        f"(NVFlare default {c['nvflare_default_upload_ratio']:.2f}x), "
        f"download {c['download_ratio']:.2f}x, relative error {c['relative_error']:.2e}, "
        f"encrypt {c['encrypt_s_per_client']:.3f} s/client, aggregate {c['aggregate_s']:.3f} s"
    )
    print(
        f"mask: exact={m['exact']} with {args.drop} of {args.clients} dropped, "
        f"masked input {m['masked_input_ratio']:.4f}x "
        f"fp32, all stages {m['upload_ratio_all_stages']:.4f}x, server unmask {m['seconds']['server_result']:.3f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"CKKS upload bytes / plaintext fp32 bytes: {c['upload_ratio']:.3f}")


if __name__ == "__main__":
    main()
