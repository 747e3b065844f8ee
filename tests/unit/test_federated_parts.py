"""Federated learning's in-process parts: tasks, local training, compression, server state, aggregation rules."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, RecordDict  # noqa: E402

from loomtrain import cli  # noqa: E402
from loomtrain.config import ConfigError  # noqa: E402
from loomtrain.federated.client import flat_params, load_flat, local_train  # noqa: E402
from loomtrain.federated.compress import compress  # noqa: E402
from loomtrain.federated.privacy import epsilon, round_noise_multiplier  # noqa: E402
from loomtrain.federated.server import FederatedServer, decode_update  # noqa: E402
from loomtrain.federated.settings import FLSettings  # noqa: E402
from loomtrain.federated.state import STATE_FILE, ServerState, load_state, save_state  # noqa: E402
from loomtrain.federated.tasks import TabularTask, dirichlet_split  # noqa: E402
from loomtrain.federated.wire import FederatedError, arrays  # noqa: E402


@pytest.fixture(scope="module")
def tabular():
    return TabularTask(10)


def test_dirichlet_split_partitions_with_label_skew():
    """Catches: a split that loses or duplicates rows, or ignores α (every client with the global label mix)."""
    labels = np.repeat([0, 1], [200, 300])
    parts = dirichlet_split(labels, 10, 0.5, np.random.default_rng(0))
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(500))
    shares = [labels[p].mean() for p in parts if len(p) >= 10]
    assert max(shares) - min(shares) > 0.5  # far from the global 0.6 everywhere


def test_tabular_task_split_and_errors(tabular):
    """Catches: test rows leaking into training, a client left without data, or an unclear error for
    more clients than the data can serve (it must name --clients)."""
    assert len(tabular.y_train) + len(tabular.y_test) == 569
    assert min(tabular.n_examples(c) for c in range(10)) >= 4
    assert sum(tabular.n_examples(c) for c in range(10)) == len(tabular.y_train)
    with pytest.raises(ConfigError, match="--clients 300"):
        TabularTask(300)


def test_client_without_data_is_named():
    """Catches: a client with no training rows that trains on nothing (NaN loss) or fails anonymously."""
    task = TabularTask(60, min_examples=0)
    empty = next(c for c in range(60) if task.n_examples(c) == 0)
    with pytest.raises(ValueError, match=f"client {empty} holds no training data"):
        local_train(task, empty, None, FLSettings(clients=60), 1)


def test_local_training_is_deterministic_and_learns(tabular):
    """Catches: unseeded local batches (a resumed or secure run could not match plain FedAvg) or a
    training loop that does not lower the loss."""
    s = FLSettings(local_steps=30)
    a, b = local_train(tabular, 1, None, s, 3), local_train(tabular, 1, None, s, 3)
    np.testing.assert_array_equal(a.params, b.params)
    start = tabular.build_model()
    trained = tabular.build_model()
    load_flat(trained, a.params, 1)
    assert tabular.evaluate(trained).loss < tabular.evaluate(start).loss


def test_local_data_parallelism_equals_one_process(tabular):
    """Catches: a client's data-parallel training that differs from one process on the same data (a
    rank training on the whole batch, gradients summed instead of averaged, the proximal term counted
    once per rank, the loss of one rank reported): 2 local gloo processes with FedProx must reach one
    process's parameters and loss to float rounding (tolerance 1e-6 on parameters of scale ~0.1)."""
    start = local_train(tabular, 1, None, FLSettings(local_steps=3), 1).params
    s = FLSettings(local_steps=10, strategy="fedprox", proximal_mu=1.0)
    one = local_train(tabular, 2, start, s, 2)
    two = local_train(tabular, 2, start, FLSettings(**{**s.__dict__, "local_procs": 2}), 2)
    np.testing.assert_allclose(two.params, one.params, atol=1e-6)
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    with pytest.raises(ValueError, match="--local-procs 3"):
        FLSettings(local_procs=3, batch_size=32).validate()


def test_fedprox_term_pulls_towards_the_global_model(tabular):
    """Catches: --strategy fedprox without its proximal term: with a huge μ the local model must stay
    much closer to its start than under FedAvg."""
    start = flat_params(tabular.build_model())
    avg = local_train(tabular, 2, start, FLSettings(local_steps=20), 1).params
    prox = local_train(tabular, 2, start, FLSettings(local_steps=20, strategy="fedprox", proximal_mu=10.0), 1).params
    assert np.linalg.norm(prox - start) < 0.5 * np.linalg.norm(avg - start)


def test_load_flat_rejects_other_model_size(tabular):
    """Catches: a global model of another architecture silently truncated into the client's model."""
    model = tabular.build_model()
    with pytest.raises(ValueError, match="client 7: the global model has 5 parameters"):
        load_flat(model, np.zeros(5, np.float32), 7)


@pytest.mark.parametrize("method", ["int8", "topk"])
def test_error_feedback_loses_nothing(method):
    """Catches: error feedback that drops the residual: over many rounds what was sent plus what is
    still held must equal the sum of the updates."""
    rng = np.random.default_rng(0)
    updates = [rng.standard_normal(3000).astype(np.float32) for _ in range(6)]
    residual, sent = None, np.zeros(3000, np.float64)
    for u in updates:
        payload, residual = compress(u, residual, method, topk_ratio=0.05)
        sent += payload.decode(1024)
    np.testing.assert_allclose(sent + residual, np.sum(updates, axis=0), atol=1e-4)
    dense = updates[0].nbytes
    assert payload.nbytes < (0.3 if method == "int8" else 0.11) * dense


def test_decode_update_names_client_with_wrong_size():
    """Catches: an update of another model size averaged into the global model (a broadcast error or
    silent corruption) instead of an error naming the client."""
    payload, _ = compress(np.ones(10, np.float32), None, "none")
    content = RecordDict({"update": arrays({"method": np.frombuffer(b"none", np.uint8), **payload.arrays()})})
    np.testing.assert_array_equal(decode_update(3, content, 10), np.ones(10))
    with pytest.raises(FederatedError, match="client 3: update has 10 values, the global model 12") as err:
        decode_update(3, content, 12)
    assert err.value.client == 3
    with pytest.raises(FederatedError, match="client 4: malformed update"):
        decode_update(4, RecordDict({"other": ConfigRecord({"a": 1})}), 10)


def test_server_state_roundtrip_and_garbage(tmp_path):
    """Catches: a checkpoint that loses the CKKS aggregate's chunk boundaries or FedAdam's moments, or a
    corrupt state file read as a fresh start instead of an error naming it."""
    state = ServerState(4, np.arange(5, dtype=np.float32), [b"ab", b"", b"cde"], np.ones(5), np.zeros(5), {"a": 1})
    save_state(tmp_path, state)
    back = load_state(tmp_path)
    assert back.round == 4 and back.ciphertexts == [b"ab", b"", b"cde"] and back.settings == {"a": 1}
    np.testing.assert_array_equal(back.params, state.params)
    np.testing.assert_array_equal(back.adam_m, state.adam_m)
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # no temporary file left behind
    (tmp_path / STATE_FILE).write_bytes(b"not a state")
    with pytest.raises(ValueError, match=STATE_FILE):
        load_state(tmp_path)


def test_fedadam_step_follows_reddi_et_al(tmp_path):
    """Catches: FedAdam applied as FedAvg, or moments not carried between rounds (Reddi et al. 2021, Alg. 2)."""
    s = FLSettings(strategy="fedadam", server_lr=0.1, out=str(tmp_path))
    server = FederatedServer(None, s)
    server.state.params = np.zeros(3, np.float32)
    d1, d2 = np.array([1.0, -2.0, 0.0], np.float32), np.array([0.5, 0.5, 0.5], np.float32)
    server.apply_mean_update(d1)
    server.apply_mean_update(d2)
    m1, v1 = 0.1 * d1, 0.01 * d1**2
    m2, v2 = 0.9 * m1 + 0.1 * d2, 0.99 * v1 + 0.01 * d2**2
    x1 = 0.1 * m1 / (np.sqrt(v1) + 1e-3)
    np.testing.assert_allclose(server.state.params, x1 + 0.1 * m2 / (np.sqrt(v2) + 1e-3), rtol=1e-5)


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--secure", "ckks", "--strategy", "fedadam"], "--strategy fedadam needs the mean update in the clear"),
        (["--secure", "mask", "--compress", "topk"], "--compress topk with --secure mask"),
        (["--secure", "mask", "--clients", "3", "--fraction", "0.3"], "--secure mask needs at least 2 clients"),
        (["--fraction", "0"], "--fraction 0.0: must lie in (0, 1]"),
        (["--dp-clip", "1", "--dp-noise", "1", "--dp-delta", "1"], "--dp-delta 1.0: must lie in (0, 1)"),
        (["--cluster", "fl"], "--cluster fl: emulated hosts run real processes; add --deployment"),
    ],
)
def test_fl_run_rejects_bad_flags(flags, needle, capsys, tmp_path):
    """Catches: a flag combination that cannot work (FedAdam without a plaintext mean, compression
    before masking, masking with one client, a δ outside (0, 1), emulated hosts for a simulation)
    starting a simulation instead of one error line."""
    assert cli.main(["fl", "run", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_fl_keys_writes_client_and_server_contexts(tmp_path, capsys):
    """Catches: `loomtrain fl keys` writing no key for some client, or a server context with the secret key."""
    from loomtrain.federated.secure import ckks

    assert cli.main(["fl", "keys", "--clients", "3", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client_0.ctx", "client_1.ctx", "client_2.ctx", "server.ctx"]
    assert not ckks.load_context(tmp_path / "server.ctx").has_secret_key()


def test_round_noise_multiplier_follows_what_the_server_sees():
    """Catches: ε computed from the clients' nominal z whatever the server sees: each update in the
    clear under `none` (z/√m), a sum missing the dropped clients' noise, or a weighted sum in which
    a large client's update stands out of the others' noise (both smaller than z)."""
    assert round_noise_multiplier(1.0, 4, [1, 1, 1, 1], "none") == pytest.approx(0.5)
    assert round_noise_multiplier(1.0, 4, [1, 1, 1, 1], "mask") == pytest.approx(1.0)
    assert round_noise_multiplier(1.0, 4, [3, 3], "ckks") == pytest.approx(np.sqrt(2 / 4))
    assert round_noise_multiplier(1.0, 2, [3, 1], "mask") == pytest.approx(np.sqrt(10) / (np.sqrt(2) * 3))
    with pytest.raises(ValueError, match="weights"):
        round_noise_multiplier(1.0, 2, [1, 1, 1], "mask")


def test_epsilon_composes_rounds_with_opacus_rdp():
    """Catches: rounds not composed (ε flat over rounds), subsampling ignored, a noiseless round given
    a finite ε, or a δ outside (0, 1) accepted. Reference: Opacus's RDPAccountant stepped directly."""
    from opacus.accountants import RDPAccountant

    history = [[1.1, 0.5]] * 5
    reference = RDPAccountant()
    for z, q in history:
        reference.step(noise_multiplier=z, sample_rate=q)
    assert epsilon(history, 1e-5) == pytest.approx(reference.get_epsilon(1e-5))
    assert epsilon(history[:1], 1e-5) < epsilon(history[:3], 1e-5) < epsilon(history, 1e-5)
    assert epsilon([[1.1, 0.2]] * 5, 1e-5) < epsilon(history, 1e-5)
    assert epsilon([[0.0, 0.5]], 1e-5) == float("inf") and epsilon([], 1e-5) == 0.0
    with pytest.raises(ValueError, match="--dp-delta"):
        epsilon(history, 1.0)
