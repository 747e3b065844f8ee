"""Federated training end to end in Flower's simulation: plain, CKKS and masked FedAvg on the tabular task.

Ray's start-up costs about 10 s, so one simulation (module fixture) plays every run below on the
same 5 clients, 2 rounds each, and the tests assert on their outputs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("tenseal")

from loomtrain.federated.run import evaluate_params, final_params, read_metrics, simulate  # noqa: E402
from loomtrain.federated.secure import ckks  # noqa: E402
from loomtrain.federated.settings import FLSettings  # noqa: E402
from loomtrain.federated.state import load_state  # noqa: E402
from loomtrain.federated.wire import FederatedError  # noqa: E402

CLIENTS, ROUNDS = 5, 2
DROPS = {"fit": ["2@2:fit", "3@2:fit"], "mask_input": ["2@2:mask_input", "3@2:mask_input"]}
# Client-side DP: an L2 clipping norm well under the tabular updates' norms, and a noise multiplier.
CLIP, NOISE = 0.05, 1.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this module in one simulation: name → (settings, final state or exception)."""
    root = tmp_path_factory.mktemp("fl")
    short_keys = root / "keys4"
    ckks.write_keys(short_keys, CLIENTS - 1)  # no key for client 4

    def s(name, **kw):
        return name, FLSettings(
            **{"task": "tabular", "clients": CLIENTS, "rounds": ROUNDS, "out": str(root / name), **kw}
        )

    plan = [
        s("none"),
        s("ckks", secure="ckks"),
        s("mask", secure="mask"),
        s("none_drop", drop=DROPS["fit"]),
        s("ckks_drop", secure="ckks", drop=DROPS["fit"]),
        s("mask_drop", secure="mask", drop=DROPS["mask_input"]),
        s("resumed", rounds=1),
        s("resumed", resume=True),
        s("ckks_nokey", secure="ckks", keys=str(short_keys)),
        s("partial", fraction=0.6, strategy="fedadam", compress="topk", topk_ratio=0.1),
        s("none_clip", dp_clip=CLIP),
        s("ckks_clip", secure="ckks", dp_clip=CLIP),
        s("none_dp", dp_clip=CLIP, dp_noise=NOISE),
        s("dp_resumed", dp_clip=CLIP, dp_noise=NOISE, rounds=1),
        s("dp_resumed", dp_clip=CLIP, dp_noise=NOISE, resume=True),
    ]
    outcomes = simulate([settings for _, settings in plan], raise_errors=False)
    return {name: (settings, outcome) for (name, settings), outcome in zip(plan, outcomes, strict=True)}


def _final(runs, name):
    settings, outcome = runs[name]
    assert not isinstance(outcome, Exception), f"{name} failed: {outcome!r}"
    params = final_params(settings, outcome)
    return params, evaluate_params(settings, params)


@pytest.mark.parametrize("secure", ["ckks", "mask"])
def test_secure_runs_predict_as_plain_fedavg(runs, secure):
    """Catches: a secure aggregation that is not the weighted mean plain FedAvg computes (wrong weights,
    masks left in, CKKS scale or slot misplacement): its model would predict differently."""
    plain_params, plain = _final(runs, "none")
    params, ev = _final(runs, secure)
    assert np.abs(params - plain_params).max() < 1e-3
    assert (ev.predictions == plain.predictions).mean() >= 0.99
    assert abs(ev.loss - plain.loss) <= 0.005 * plain.loss
    assert plain.loss < 0.69  # it learned: log 2 is a coin flip


@pytest.mark.parametrize("secure,stage", [("ckks", "fit"), ("mask", "mask_input")])
def test_dropped_clients_leave_exact_round_of_survivors(runs, secure, stage):
    """Catches: a round that hangs, fails or sums masks of departed clients when 2 of 5 clients disconnect
    mid-round: the result must equal plain FedAvg over the same survivors, with a client_dropped event each."""
    ref_params, _ = _final(runs, "none_drop")
    params, _ = _final(runs, f"{secure}_drop")
    assert np.abs(params - ref_params).max() < 1e-3
    rows = read_metrics(runs[f"{secure}_drop"][0].out)
    events = [e for e in rows[1]["events"] if e["event"] == "client_dropped"]
    assert sorted(e["client"] for e in events) == [2, 3]
    assert all(stage in e["stage"] and "disconnects" in e["reason"] for e in events)
    assert rows[0]["events"] == []


def test_ckks_server_keeps_only_ciphertexts(runs):
    """Catches: a CKKS server that stores the model in the clear or that sees more than ciphertexts: its
    checkpoint must hold the encrypted aggregate and no plaintext parameters."""
    settings, state = runs["ckks"]
    saved = load_state(settings.out)
    assert saved.params is None and state.params is None
    assert saved.ciphertexts == state.ciphertexts and len(saved.ciphertexts) >= 1
    plain_bytes = read_metrics(runs["none"][0].out)[0]["bytes_up"]["0"]
    ckks_bytes = read_metrics(settings.out)[0]["bytes_up"]["0"]
    assert plain_bytes < ckks_bytes < 8 * plain_bytes


def test_resume_continues_from_the_round_checkpoint(runs):
    """Catches: a resume that restarts from round 1, repeats a round or loses the model: a run stopped
    after round 1 and resumed must end exactly where the uninterrupted run ends, with one row per round."""
    ref, _ = _final(runs, "none")
    params, _ = _final(runs, "resumed")
    np.testing.assert_array_equal(params, ref)
    settings = runs["resumed"][0]
    assert [r["round"] for r in read_metrics(settings.out)] == [1, 2]
    with open(settings.out + "/settings.json") as f:
        assert json.load(f)["resume"] is True


def test_client_without_key_is_named(runs):
    """Catches: a client that cannot take part (no key material) turned into a silent drop or a hang:
    the run must stop with an error naming that client and the fix."""
    _, outcome = runs["ckks_nokey"]
    assert isinstance(outcome, FederatedError)
    assert outcome.client == 4 and "client_4.ctx" in str(outcome) and "fl keys" in str(outcome)


def test_partial_participation_and_compression(runs):
    """Catches: --fraction ignored (every client every round) or top-k not shrinking the upload: 3 of 5
    clients per round, each sending about a tenth of the dense bytes (values + int32 indices)."""
    rows = read_metrics(runs["partial"][0].out)
    dense = read_metrics(runs["none"][0].out)[0]["bytes_up"]["0"]
    for row in rows:
        assert len(row["clients"]) == 3 and sorted(map(int, row["bytes_up"])) == row["clients"]
        assert all(b < 0.25 * dense for b in row["bytes_up"].values())
    _final(runs, "partial")


def _cli(*args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loomtrain.cli", "fl", "run", "--task", "tabular", "--clients", "3", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, **kw)


@pytest.mark.slow
def test_killed_server_resumes_from_round_checkpoint(tmp_path):
    """Catches: a checkpoint written non-atomically or not every round, or a resume that does not pick up
    where a SIGKILLed server stopped: the resumed run must end with the uninterrupted run's model."""
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _cli("--rounds", "4", "--out", str(ref)).wait(timeout=600) == 0
    proc = _cli("--rounds", "4", "--out", str(cut))
    deadline = time.monotonic() + 600
    while not ((cut / "metrics.jsonl").is_file() and len(read_metrics(cut)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 2 <= load_state(cut).round < 4
    assert _cli("--rounds", "4", "--out", str(cut), "--resume").wait(timeout=600) == 0
    settings = FLSettings(task="tabular", clients=3, rounds=4)
    np.testing.assert_array_equal(final_params(settings, load_state(cut)), final_params(settings, load_state(ref)))
    assert [r["round"] for r in read_metrics(cut)] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("secure", ["ckks", "mask"])
def test_real_processes_match_simulation(tmp_path, secure):
    """Catches: a ServerApp/ClientApp that only works inside the simulation (settings not reaching the
    deployed apps, client ids not taken from the SuperNodes' node config, masking secrets lost
    between message rounds when every message gets a new ClientApp process): real SuperLink and
    SuperNode processes must produce the simulation's model."""
    from loomtrain.federated.deploy import run_deployment

    sim = FLSettings(task="tabular", clients=2, rounds=2, secure=secure, out=str(tmp_path / "sim"))
    dep = FLSettings(
        task="tabular", clients=2, rounds=2, secure=secure, out=str(tmp_path / "dep"), keys=str(tmp_path / "k")
    )
    sim.keys = dep.keys
    ckks.write_keys(tmp_path / "k", 2)
    (sim_state,) = simulate([sim])
    dep_state = run_deployment(dep)
    np.testing.assert_allclose(final_params(dep, dep_state), final_params(sim, sim_state), atol=1e-6)


def test_ckks_clients_clip_their_update_like_plain_clients(runs):
    """Catches: --dp-clip/--dp-noise silently ignored under --secure ckks (clients encrypted their
    model unclipped, so the docs' "the server never sees an un-noised update" was false): with
    clipping only (deterministic), the CKKS run must end where the plain run ends, within CKKS
    precision, and away from the unclipped CKKS run."""
    clipped, _ = _final(runs, "none_clip")
    ckks_clipped, _ = _final(runs, "ckks_clip")
    unclipped, _ = _final(runs, "ckks")
    np.testing.assert_allclose(ckks_clipped, clipped, atol=1e-5)
    assert np.abs(unclipped - clipped).max() > 100 * 1e-5


def test_privacy_ledger_reports_epsilon_per_round_and_survives_resume(runs):
    """Catches: no ε reported under --dp-noise, ε from the nominal z when the server sees each update
    in the clear (it must use z/√m), rounds not composed, or a resumed run whose ε forgets the
    rounds before the crash."""
    from loomtrain.federated.privacy import epsilon

    rows = read_metrics(runs["none_dp"][0].out)
    z = NOISE / np.sqrt(CLIENTS)
    assert [r["dp_noise_multiplier"] for r in rows] == pytest.approx([z, z])
    expected = [epsilon([[z, 1.0]] * n, 1e-5) for n in (1, 2)]
    assert [r["dp_epsilon"] for r in rows] == pytest.approx(expected) and expected[0] < expected[1]
    resumed = read_metrics(runs["dp_resumed"][0].out)
    assert [r["dp_epsilon"] for r in resumed] == pytest.approx(expected)
    assert all(r["dp_epsilon"] is None for r in read_metrics(runs["none_clip"][0].out))


@pytest.mark.slow
def test_supernodes_on_emulated_hosts_match_simulation(tmp_path):
    """Catches: a deployment that only works on localhost (the SuperLink bound to loopback, a SuperNode
    dialling 127.0.0.1, `flwr run` outside the SuperLink's namespace), or masking's messages not crossing
    the clients' links: SuperLink on host 0 and two SuperNodes on hosts 1 and 2 of an emulated cluster
    must end where the simulation ends, and each client's link must have carried at least its payload."""
    import uuid

    from loomtrain.cluster.emulated import ClusterSpec, emulated_cluster, missing_requirements
    from loomtrain.federated.deploy import run_deployment

    if missing_requirements() is not None:
        pytest.skip(str(missing_requirements()))
    sim = FLSettings(task="tabular", clients=2, rounds=2, secure="mask", out=str(tmp_path / "sim"))
    dep = FLSettings(task="tabular", clients=2, rounds=2, secure="mask", out=str(tmp_path / "dep"))
    (sim_state,) = simulate([sim])
    spec = ClusterSpec(hosts=3, procs_per_host=1, inter_rate="1gbit", name="f" + uuid.uuid4().hex[:6])
    with emulated_cluster(spec, state_dir=tmp_path / "clusters") as c:
        dep_state = run_deployment(dep, c)
    np.testing.assert_allclose(final_params(dep, dep_state), final_params(sim, sim_state), atol=1e-6)
    links = json.loads((tmp_path / "dep" / "links.json").read_text())
    rows = read_metrics(dep.out)
    for host, client in (("1", 0), ("2", 1)):
        assert links[host]["clients"] == [client]
        assert links[host]["up"] >= sum(r["bytes_up"][str(client)] for r in rows)
        assert links[host]["down"] >= sum(r["bytes_down"][str(client)] for r in rows)
