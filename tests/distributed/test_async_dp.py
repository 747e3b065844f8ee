"""Asynchronous local SGD (``distributed/async_dp.py``): the server/worker exchange on real gloo
processes (one 3-process spawn), the trainer's async mode with a checkpoint resume (one
2-process spawn), replicas of two ranks (tp, pp, ZeRO-3 inside; one 4-process spawn) and of two
tp workers (6 processes, ``slow``), and the staleness rule and config checks in-process.

Tolerance of the one-worker equivalence: 1e-6 relative (fp32). With one worker every delta has
staleness 0 and weight 1, and the async run performs the same float operations in the same
order as the single-process reference (DiLoCo with one replica), so it agrees bit for bit in
practice; a lost round, a delta of the wrong sign or a stale base moves the parameters by ~1e-2.
"""

from __future__ import annotations

import copy
import heapq
import io
import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from loomtrain.config import ConfigError, DataParallelConfig, ModelConfig, load_config
from loomtrain.distributed.async_dp import (
    AsyncOuter,
    AsyncTimeoutError,
    AsyncWorker,
    DelayedNesterov,
    ParameterServer,
    Round,
    RoundPlanner,
    delta_weight,
    local_steps,
    pause_steps,
    plan_rounds,
    saved_async_state,
    server_delta_weight,
)
from loomtrain.distributed.local_sgd import flatten, write_flat
from loomtrain.distributed.spawn import spawn
from loomtrain.models import Transformer
from loomtrain.preflight import check_world
from tests.distributed.checks import check_result, run_checks, spawn_once
from tests.integration.test_local_sgd_train import replica_momentum
from tests.integration.test_train import TINY, run_train

CFG = ModelConfig(n_layers=1, n_heads=2, dim=16, max_seq_len=8, vocab_size=32)
RTOL = 1e-6
SLOW_FIRST_S = 1.5  # the slow worker's first round: long enough for the fast one to do several
TIMEOUT_S = 2.0  # the dead-worker check's deadline


def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker batch at stream position ``position``: 2 sequences of 8 tokens."""
    g = torch.Generator().manual_seed(position)
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_model() -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(CFG)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def inner_steps(model, opt, rnd: Round, sleep_s: float = 0.0) -> float:
    """``rnd``'s inner steps on its own batches; returns the mean loss."""
    total = 0.0
    for j in range(rnd.steps):
        x, y = batch(rnd.offset + j)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total += loss.item()
    time.sleep(sleep_s)
    return total / rnd.steps


def serve_or_work(group, workers: list[int], steps: int, cfg: DataParallelConfig, timeout_s: float, sleep=None,
                  step_s: dict[int, float] | None = None) -> dict:  # fmt: skip
    """Run the exchange of a ``steps``-step run on this rank (server: rank 0; ``workers``
    train). ``sleep(worker, rounds_done)``: extra seconds a worker spends in a round; ``step_s``:
    extra seconds per inner step, by worker. Returns the server's settled rounds, θ_global and
    applied local-step counts, or the worker's rounds done and final parameters."""
    model, opt = make_model()
    outer = AsyncOuter(list(model.parameters()), opt, cfg)
    rank = dist.get_rank()
    if rank == 0:
        settled = []
        planner = RoundPlanner(steps, cfg.resolved_inner_steps, len(workers))
        ParameterServer(outer, group, workers, planner, timeout_s, settled.append).serve()
        return {"settled": settled, "global": outer.global_flat.clone(), "version": outer.version,
                "local_steps": outer.local_steps, "lanes": planner.lanes}  # fmt: skip
    holder = {}

    def train_round(rnd: Round) -> float:
        extra = sleep(rank, worker.rounds_done) if sleep else 0.0
        return inner_steps(model, opt, rnd, extra + (step_s or {}).get(rank, 0.0) * rnd.steps)

    worker = holder["w"] = AsyncWorker(outer, group, 0, timeout_s, train_round)
    end = worker.run()
    return {"rounds_done": worker.rounds_done, "params": flatten(list(model.parameters())), "end": end}


def reference(rounds: list[Round], cfg: DataParallelConfig) -> tuple[list[float], torch.Tensor]:
    """One process, no messages: DiLoCo with one replica over ``rounds`` (θ_local ← θ_global,
    the round's inner steps, outer Nesterov SGD on θ_global − θ_local)."""
    model, opt = make_model()
    params = list(model.parameters())
    theta = flatten(params)
    outer = torch.optim.SGD([theta], lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    losses = []
    for rnd in rounds:
        write_flat(theta, params)
        losses.append(inner_steps(model, opt, rnd))
        with torch.no_grad():
            theta.grad = theta - flatten(params)
        outer.step()
    return losses, theta


def one_worker_equals_reference():
    """Server 0 and worker 1 on their own group; rank 2 computes the reference meanwhile."""
    group = dist.new_group([0, 1], backend="gloo")
    cfg = DataParallelConfig(mode="async", inner_steps=3)
    rounds = plan_rounds(8, 3, 1)  # rounds of 3, 3 and 2 steps
    if dist.get_rank() == 2:
        return reference(rounds, cfg)
    return serve_or_work(group, [1], 8, cfg, 60.0)


def slow_worker_does_not_hold_back_the_fast():
    """Server 0, workers 1 (fast) and 2 (slow: its first round takes SLOW_FIRST_S longer,
    each later one 0.2 s), 16 rounds of 2 steps, τ ≤ 2 applied with weight 1/(2(1+τ))."""
    group = dist.new_group([0, 1, 2], backend="gloo")
    cfg = DataParallelConfig(mode="async", inner_steps=2, max_staleness=2, staleness_policy="scale")

    def sleep(rank: int, done: int) -> float:
        return 0.0 if rank == 1 else SLOW_FIRST_S if done == 0 else 0.2

    return serve_or_work(group, [1, 2], 16, cfg, 60.0, sleep)


class Died(Exception):
    """A worker that stops answering (the check's stand-in for a crashed or hung process)."""


def dead_worker_times_out():
    """Worker 2 takes a round and never returns it; the server's deadline is TIMEOUT_S."""
    group = dist.new_group([0, 1, 2], backend="gloo")
    cfg = DataParallelConfig(mode="async", inner_steps=1)

    def sleep(rank: int, done: int) -> float:
        if rank == 2:
            time.sleep(TIMEOUT_S + 1.5)
            raise Died
        return 0.0

    start = time.monotonic()
    try:
        out = serve_or_work(group, [1, 2], 4, cfg, TIMEOUT_S, sleep)
    except (AsyncTimeoutError, Died, RuntimeError) as err:  # RuntimeError: gloo's, once the server is gone
        out = {"error": type(err).__name__, "message": str(err)}
    out["elapsed_s"] = time.monotonic() - start
    return out


DYLU_STEPS, DYLU_H = 40, 8
DYLU_STEP_S = {1: 0.01, 2: 0.04}  # seconds slept per inner step: worker 2 at about a quarter of worker 1's speed


def dynamic_local_steps_follow_speed():
    """Server 0, workers 1 (fast) and 2 (slow, DYLU_STEP_S), DyLU on, H = 8, 40 steps (80
    worker steps); every delta applied (max_staleness 100), so the applied counts cover all."""
    group = dist.new_group([0, 1, 2], backend="gloo")
    cfg = DataParallelConfig(mode="async", inner_steps=DYLU_H, max_staleness=100, dynamic_local_steps=True)
    return serve_or_work(group, [1, 2], DYLU_STEPS, cfg, 60.0, step_s=DYLU_STEP_S)


def all_checks() -> dict:
    return run_checks({
        "one_worker_equals_reference": one_worker_equals_reference,
        "slow_worker_does_not_hold_back_the_fast": slow_worker_does_not_hold_back_the_fast,
        "dead_worker_times_out": dead_worker_times_out,
        "dynamic_local_steps_follow_speed": dynamic_local_steps_follow_speed,
    })  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return spawn_once(all_checks, 3, timeout_s=120)


def test_one_worker_equals_single_process_reference(results):
    """Catches: a delta of the wrong sign or taken against the wrong base, a lost or repeated
    round, a round's batches or inner step count that depend on the worker, the outer Nesterov
    step or its momentum not applied as DiLoCo's, and a worker that does not continue from the
    server's model."""
    ref_losses, ref_theta = check_result(results, "one_worker_equals_reference", 2)
    server = check_result(results, "one_worker_equals_reference", 0)
    worker = check_result(results, "one_worker_equals_reference", 1)
    assert [s.round.index for s in server["settled"]] == [0, 1, 2]
    assert [s.tau for s in server["settled"]] == [0, 0, 0] and [s.weight for s in server["settled"]] == [1.0] * 3
    torch.testing.assert_close([s.loss for s in server["settled"]], ref_losses, rtol=RTOL, atol=0)
    torch.testing.assert_close(server["global"], ref_theta, rtol=RTOL, atol=1e-7)
    assert torch.equal(worker["params"], server["global"]) and worker["end"] == "done"


def test_fast_worker_never_waits_and_staleness_rule_holds(results):
    """Catches: a server that serves workers in turn (the fast worker would wait for the slow
    one), a delta applied beyond max_staleness or rejected within it, a wrong staleness count
    (τ must count the updates applied since the worker's model), the 1/(W(1+τ)) weight not
    applied, and workers left with another model than θ_global at the end."""
    server = check_result(results, "slow_worker_does_not_hold_back_the_fast", 0)
    settled = server["settled"]
    by_worker = {w: [s for s in settled if s.worker == w] for w in (1, 2)}
    assert sorted(s.round.index for s in settled) == list(range(16))
    assert len(by_worker[1]) > len(by_worker[2]) >= 1
    first_slow = settled.index(by_worker[2][0])
    assert first_slow >= 3  # the fast worker returned 3+ rounds while the slow one held its first
    assert by_worker[2][0].tau >= 3 and by_worker[2][0].weight is None
    version = 0
    for s in settled:
        if s.tau <= 2:
            assert s.weight == pytest.approx(1 / (2 * (1 + s.tau))), s
            version += 1
        else:
            assert s.weight is None, s
        assert s.version == version
    assert server["version"] == version
    for rank in (1, 2):
        worker = check_result(results, "slow_worker_does_not_hold_back_the_fast", rank)
        assert torch.equal(worker["params"], server["global"])
        assert worker["rounds_done"] == len(by_worker[rank])


def test_dead_worker_is_a_clear_timeout(results):
    """Catches: a server that waits forever on a worker that died or hangs (the test would hit
    the spawn's timeout instead), an error that does not name the missing rank or the setting
    to change, and a worker left waiting forever by the failed server."""
    server = check_result(results, "dead_worker_times_out", 0)
    assert server["error"] == "AsyncTimeoutError"
    assert "worker rank 2" in server["message"] and "distributed.timeout_s" in server["message"]
    assert server["elapsed_s"] < TIMEOUT_S + 10
    # The live worker's end waits for the dead one's round (it would carry the final θ_global), so it
    # fails with the server: its own deadline, or gloo's closed connection if the server exits first.
    survivor = check_result(results, "dead_worker_times_out", 1)
    assert survivor["error"] in ("AsyncTimeoutError", "RuntimeError") and survivor["elapsed_s"] < TIMEOUT_S + 10
    assert check_result(results, "dead_worker_times_out", 2)["error"] == "Died"


def test_dynamic_local_steps_shorten_the_slow_workers_rounds(results):
    """Catches, on real processes: DyLU lengths not reaching the workers (the header's round),
    a speed measured wrongly or not at all (the slow worker kept at H), batches skipped or
    repeated or trained at another learning-rate step under variable rounds, and applied deltas
    whose local steps are not recorded."""
    server = check_result(results, "dynamic_local_steps_follow_speed", 0)
    settled = server["settled"]
    slow = [s.round.steps for s in settled if s.worker == 2]
    fast = [s.round.steps for s in settled if s.worker == 1]
    assert slow[0] == fast[0] == DYLU_H  # nobody measured yet
    assert len(slow) >= 2 and max(slow[1:]) < DYLU_H == max(fast)
    assert sum(slow) / len(slow) < sum(fast) / len(fast)
    assert all(s.speed > 0 for s in settled)
    positions = sorted(s.round.offset + j for s in settled for j in range(s.round.steps))
    assert positions == list(range(DYLU_STEPS * 2)) and server["lanes"] == [DYLU_STEPS] * 2
    want = lr_step_of_batch(DYLU_STEPS, DYLU_H, 2)
    for s in settled:
        assert [want[s.round.offset + j] for j in range(s.round.steps)] == [
            s.round.first_step + j for j in range(s.round.steps)
        ]
    assert server["local_steps"] == Counter(slow + fast)
    for rank in (1, 2):
        worker = check_result(results, "dynamic_local_steps_follow_speed", rank)
        assert torch.equal(worker["params"], server["global"]) and worker["end"] == "done"


def test_staleness_weights_and_rejection():
    """Catches: the bound applied as < instead of <=, a reject policy that scales, a scale
    policy that does not, or a weight without the 1/W share."""
    assert delta_weight(0, 2, "scale", 1) == 1.0
    assert delta_weight(2, 2, "scale", 2) == pytest.approx(1 / 6)
    assert delta_weight(3, 2, "scale", 2) is None
    assert delta_weight(2, 2, "reject", 4) == 0.25
    assert delta_weight(3, 2, "reject", 4) is None
    assert delta_weight(0, 0, "reject", 3) == pytest.approx(1 / 3)


def test_rounds_hold_the_sync_runs_tokens():
    """Catches: rounds that cover more or fewer worker steps than ``steps × W`` (the async run
    would train on other tokens than the sync one), overlapping batch offsets, and checkpoint
    pauses placed inside a period."""
    rounds = plan_rounds(7, 3, 2)
    assert [(r.first_step, r.steps) for r in rounds] == [(0, 3), (0, 3), (3, 3), (3, 3), (6, 1), (6, 1)]
    assert [r.offset for r in rounds] == [0, 3, 6, 9, 12, 13]
    assert sum(r.steps for r in rounds) == 7 * 2
    assert pause_steps(7, 3, 3, 0) == [3, 6]  # the period starts of rounds 2 and 4
    assert pause_steps(7, 3, 4, 3) == [6]
    assert pause_steps(7, 3, 2, 0) == [3, 6]  # 2 and 4 round up to period starts, 6 once
    with pytest.raises(ValueError, match="at least 1"):
        plan_rounds(0, 3, 2)


def test_dynamic_local_steps_rule():
    """Catches: DyLU's ⌊H·v_w / max_j v_j⌋ rounded up or to nearest, taken against the mean or
    sum of the speeds instead of the fastest, a worker given 0 steps, an unmeasured worker not
    given H, and dynamic lengths used with ``dynamic_local_steps`` off."""
    on = {h: DataParallelConfig(mode="async", inner_steps=h, dynamic_local_steps=True) for h in (3, 6, 8)}
    speeds = [1.0, 0.25, 0.7]
    assert [local_steps(on[8], v, speeds) for v in speeds] == [8, 2, 5]
    assert local_steps(on[6], 0.25, speeds) == 1  # ⌊1.5⌋
    assert local_steps(on[3], 0.25, speeds) == 1  # ⌊0.75⌋ = 0, raised to 1
    assert local_steps(on[8], None, speeds) == 8
    assert local_steps(DataParallelConfig(mode="async", inner_steps=8), 0.25, speeds) == 8


def simulated_plan(cfg: DataParallelConfig, planner: RoundPlanner, speeds: dict[int, float], before: int,
                   measured: dict[int, float], index: int = 0) -> list[tuple[int, Round]]:  # fmt: skip
    """The server's cuts, without processes, from round ``index`` on: workers of ``speeds``
    (steps/s) ask in the order their rounds end (the earliest first, the lower rank on a tie);
    a returned round enters its worker's speed in ``measured``; cutting stops at step
    ``before``. Returns (worker, round) in hand-out order."""
    out: list[tuple[int, Round]] = []
    queue: list[tuple[float, int]] = [(0.0, w) for w in sorted(speeds)]
    while queue:
        now, worker = heapq.heappop(queue)
        if any(w == worker for w, _ in out):
            measured[worker] = speeds[worker]
        length = local_steps(cfg, measured.get(worker), list(measured.values()))
        rnd = planner.cut(index + len(out), length, before)
        if rnd is not None:
            out.append((worker, rnd))
            heapq.heappush(queue, (now + rnd.steps / speeds[worker], worker))
    return out


def lr_step_of_batch(steps: int, h: int, workers: int) -> dict[int, int]:
    """Worker batch position → its learning-rate step in the fixed plan (rounds of H)."""
    return {r.offset + j: r.first_step + j for r in plan_rounds(steps, h, workers) for j in range(r.steps)}


def test_dynamic_plan_is_a_quarter_for_a_quarter_speed_and_covers_the_run_once():
    """Catches: a slow worker's DyLU rounds not ⌊H/4⌋ at a quarter of the speed, a round cut
    across a period (its batches would not be contiguous), batches skipped or repeated, a batch
    trained at another learning-rate step than in the fixed plan (and so the sync run), and a
    checkpoint pause that leaves a lane beyond the pause step. H = 6, 20 steps (the last period
    of 2), speeds 1 and 0.25 steps/s, a pause at step 12."""
    cfg = DataParallelConfig(mode="async", inner_steps=6, dynamic_local_steps=True)
    planner, speeds, measured = RoundPlanner(20, 6, 2), {1: 1.0, 2: 0.25}, {}
    rounds = simulated_plan(cfg, planner, speeds, 12, measured)
    assert planner.lanes == [12, 12]
    rounds += simulated_plan(cfg, planner, speeds, 20, measured, len(rounds))
    assert planner.done and [r.index for _, r in rounds] == list(range(len(rounds)))
    slow = [r.steps for w, r in rounds if w == 2]
    fast = [r.steps for w, r in rounds if w == 1]
    assert slow[0] == 6 and set(slow[1:]) == {1}  # ⌊6·0.25⌋ = 1 once measured
    assert max(fast) == 6 and len(fast) > len(slow)
    positions = sorted(r.offset + j for _, r in rounds for j in range(r.steps))
    assert positions == list(range(40))
    want = lr_step_of_batch(20, 6, 2)
    for _, r in rounds:
        assert r.first_step // 6 == (r.first_step + r.steps - 1) // 6, r
        assert [want[r.offset + j] for j in range(r.steps)] == list(range(r.first_step, r.first_step + r.steps)), r


def test_dynamic_local_steps_off_plans_exactly_todays_rounds():
    """Catches: the default (``dynamic_local_steps`` off) plan changed by the planner or by the
    measured speeds: with workers at speeds 1 and 0.25 the rounds handed out, by index, are
    plan_rounds' fixed list (W rounds of H per period, offsets in order)."""
    cfg = DataParallelConfig(mode="async", inner_steps=3)
    rounds = simulated_plan(cfg, RoundPlanner(7, 3, 2), {1: 1.0, 2: 0.25}, 7, {})
    assert [r for _, r in rounds] == plan_rounds(7, 3, 2)


def test_planner_state_resumes_the_plan():
    """Catches: the lanes or the measured speeds missing from the async checkpoint state (a
    resume would repeat or skip batches, or restart every worker at H): after uneven cuts, the
    planner rebuilt from a torch.save/load round trip of AsyncOuter's state cuts the same rounds
    as the uninterrupted one."""
    cfg = DataParallelConfig(mode="async", inner_steps=4, dynamic_local_steps=True)
    whole = RoundPlanner(10, 4, 2)
    outer = dn_outer(1)
    outer.lanes, outer.speeds = whole.lanes, {1: 3.0, 2: 1.0}
    for k, length in enumerate([4, 1]):
        whole.cut(k, length, 10)
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(outer.state_dict()), buffer)
    buffer.seek(0)
    resumed = dn_outer(1)
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.lanes == [4, 1] and resumed.speeds == {1: 3.0, 2: 1.0}
    again = RoundPlanner(10, 4, 2, resumed.lanes)
    lengths = [local_steps(cfg, resumed.speeds[w], list(resumed.speeds.values())) for w in (2, 1, 2, 1, 2)]
    got = [again.cut(k, n, 10) for k, n in enumerate(lengths, 2)]
    assert got == [whole.cut(k, n, 10) for k, n in enumerate(lengths, 2)]
    assert again.lanes == whole.lanes


DELAY4 = ["--data_parallel.mode=async", "--data_parallel.outer_momentum_delay=4"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["--data_parallel.max_staleness=2"], "data_parallel.max_staleness only applies to data_parallel.mode='async'"),
        (["--data_parallel.staleness_policy=reject"], "staleness_policy only applies"),
        (["--data_parallel.mode=async", "--data_parallel.max_staleness=-1"], "max_staleness"),
        (["--data_parallel.mode=async", "--data_parallel.zero_stage=1"], "mode='async' with data_parallel.zero_stage"),
        (
            ["--data_parallel.mode=async", "--parallel.tensor_parallel_degree=2", "--data_parallel.zero_stage=1"],
            "mode='async' with data_parallel.zero_stage",
        ),
        (["--data_parallel.mode=async", "--simulate.speed_change=3:1:0.5"], "simulate.speed_change"),
        (
            ["--data_parallel.mode=diloco", "--data_parallel.outer_momentum_delay=4"],
            "data_parallel.outer_momentum_delay only applies to data_parallel.mode='async'",
        ),
        (["--data_parallel.mode=async", "--data_parallel.outer_momentum_delay=0"], "outer_momentum_delay"),
        (
            ["--data_parallel.mode=diloco", "--data_parallel.dynamic_local_steps=true"],
            "data_parallel.dynamic_local_steps only applies to data_parallel.mode='async'.*drop them or set the mode",
        ),
        ([*DELAY4, "--data_parallel.outer_momentum=0"], "outer_momentum_delay=4 delays the outer Nesterov"),
        ([*DELAY4, "--data_parallel.outer_nesterov=false"], "set outer_momentum_delay=1 or use Nesterov momentum"),
    ],
)
def test_async_config_refusals(overrides, match):
    """Catches: async settings (Delayed Nesterov, DyLU too) accepted (and silently ignored) in another mode, a negative
    bound, and async combined with ZeRO on single-rank or tp replicas or speed changes, which it does not support; a
    Delayed Nesterov delay below 1, or one without Nesterov momentum (it would only divide the
    outer learning rate by N)."""
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_async_world_checks():
    """Catches: async started on one process (no worker, or no server) or with a global batch
    the workers cannot split, which would only fail after the process group is up; and the
    defaults (DiLoCo's outer optimizer and H, staleness bound 4, scaling, no momentum delay)
    drifting."""
    cfg = load_config(None, ["--data_parallel.mode=async", "--training.global_batch_size=8",
                             "--training.micro_batch_size=2"])  # fmt: skip
    with pytest.raises(ConfigError, match="needs at least 2 model replicas.*--nproc"):
        check_world(cfg, 1)
    with pytest.raises(ConfigError, match="not divisible by the 3 async workers"):
        check_world(cfg, 4)  # 3 workers × 2 samples do not divide 8
    check_world(cfg, 3)
    check_world(cfg, 5)
    dp = cfg.data_parallel
    assert (dp.resolved_inner_steps, dp.outer_lr, dp.outer_momentum, dp.outer_nesterov) == (500, 0.7, 0.9, True)
    assert (dp.max_staleness, dp.staleness_policy, dp.outer_momentum_delay) == (4, "scale", 1)
    assert dp.dynamic_local_steps is False
    assert load_config(
        None, ["--data_parallel.mode=async", "--data_parallel.dynamic_local_steps=true"]
    ).data_parallel.dynamic_local_steps
    assert load_config(None, DELAY4).data_parallel.outer_momentum_delay == 4
    assert load_config(None, ["--data_parallel.mode=async", "--data_parallel.outer_lr=1"]).data_parallel.outer_lr == 1


# Delayed Nesterov (DN) on the server's outer optimizer, in-process: 7 weighted deltas of 2 small tensors.
DN_LR, DN_BETA = 0.7, 0.9
DN_WEIGHTS = [1.0, 0.5, 1 / 3, 0.5, 1.0, 0.25, 0.5]


def dn_deltas() -> list[torch.Tensor]:
    """The 7 deltas (1-D fp32, 6 elements: the two parameters of :func:`dn_outer`), all different."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(6, generator=g) * 1e-2 for _ in DN_WEIGHTS]


def dn_outer(delay: int) -> AsyncOuter:
    """An :class:`AsyncOuter` (no group: no collective) on a 2×2 and a 2-element parameter."""
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(2, 2)), torch.nn.Parameter(torch.randn(2))]
    cfg = DataParallelConfig(mode="async", outer_lr=DN_LR, outer_momentum=DN_BETA, outer_momentum_delay=delay)
    return AsyncOuter(params, torch.optim.SGD(params, lr=0.1, momentum=0.9), cfg)


def dn_trajectory(outer: AsyncOuter, deltas: list[torch.Tensor], weights: list[float]) -> list[torch.Tensor]:
    """θ_global after each delta applied with its weight."""
    out = []
    for delta, weight in zip(deltas, weights, strict=True):
        outer.apply(delta.clone(), weight)
        out.append(outer.global_flat.clone())
    return out


def nesterov_reference(theta: torch.Tensor, deltas: list[torch.Tensor], weights: list[float]) -> list[torch.Tensor]:
    """The server's outer step before Delayed Nesterov: ``torch.optim.SGD`` with Nesterov, one
    step per weighted delta."""
    theta = theta.clone()
    sgd = torch.optim.SGD([theta], lr=DN_LR, momentum=DN_BETA, nesterov=True)
    out = []
    for delta, weight in zip(deltas, weights, strict=True):
        theta.grad = delta * weight
        sgd.step()
        out.append(theta.detach().clone())
    return out


def dn_by_hand(theta: torch.Tensor, grads: list[torch.Tensor], n: int, mean_of: int = 0,
               step_of: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """Delayed Nesterov written out (Liu et al. 2024) in float64: each gradient g is
    applied as θ ← θ − ε·g/N; at every N-th, m ← β·m + (sum of the last N)/N and θ moves by
    −ε·β·m as well. ``mean_of`` / ``step_of``, if set, replace the N of the mean / of the
    in-between step (the bugs the test must tell apart)."""
    theta, m, window, out = theta.double(), torch.zeros_like(theta, dtype=torch.float64), [], []
    for k, g in enumerate(grads, start=1):
        g = g.double()
        window.append(g)
        theta = theta - DN_LR * g / (step_of or n)
        if k % n == 0:
            m = DN_BETA * m + sum(window) / (mean_of or n)
            theta, window = theta - DN_LR * DN_BETA * m, []
        out.append(theta)
    return out


def test_delayed_nesterov_deltas_drop_the_one_over_w_share():
    """Catches: Delayed Nesterov applied to deltas already weighted 1/W (its own 1/N on top: the
    step W-fold too short; measured, 3 workers at N = 3 ended 5.7 % above the per-delta step's
    validation loss) or the per-delta step losing its 1/W share; staleness scaling kept in both."""
    per_delta = DataParallelConfig(mode="async", staleness_policy="scale")
    delayed = DataParallelConfig(mode="async", staleness_policy="scale", outer_momentum_delay=3)
    assert server_delta_weight(0, per_delta, 3) == pytest.approx(1 / 3)
    assert server_delta_weight(1, per_delta, 3) == pytest.approx(1 / 6)
    assert server_delta_weight(0, delayed, 3) == 1.0
    assert server_delta_weight(1, delayed, 3) == pytest.approx(1 / 2)
    assert server_delta_weight(per_delta.max_staleness + 1, delayed, 3) is None


def test_outer_momentum_delay_1_is_the_nesterov_step_per_delta():
    """Catches: outer_momentum_delay = 1 (the default) changing the server's outer step at all:
    its θ_global after each of 7 weighted deltas must equal Nesterov SGD's bit for bit, and so
    must DelayedNesterov's own N = 1 case (its formula degenerates to the same float ops)."""
    outer = dn_outer(1)
    want = nesterov_reference(outer.global_flat, dn_deltas(), DN_WEIGHTS)
    got = dn_trajectory(outer, dn_deltas(), DN_WEIGHTS)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    theta = dn_outer(1).global_flat.clone()
    dn = DelayedNesterov([theta], DN_LR, DN_BETA, 1)
    for delta, weight, expected in zip(dn_deltas(), DN_WEIGHTS, want, strict=True):
        theta.grad = delta * weight
        dn.step()
        assert torch.equal(theta, expected)


def test_delayed_nesterov_follows_the_hand_computed_recurrence():
    """Catches: momentum applied at every delta (plain Nesterov per delta), the momentum buffer
    fed the sum of the N deltas instead of their mean, a delta's weight dropped, the in-between
    steps taken at the full learning rate, and a delta sum not reset after a momentum update.
    N = 3, 7 weighted deltas (two momentum updates and one delta into the third window):
    θ_global after every delta equals the recurrence within 1e-6 relative, and the first four
    bugs' trajectories (computed here) are at least 100 times further from it than that."""
    outer = dn_outer(3)
    theta = outer.global_flat.clone()
    grads = [d * w for d, w in zip(dn_deltas(), DN_WEIGHTS, strict=True)]
    want = dn_by_hand(theta, grads, 3)
    got = dn_trajectory(outer, dn_deltas(), DN_WEIGHTS)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-9)
    wrong = {
        "momentum every delta": nesterov_reference(theta, dn_deltas(), DN_WEIGHTS),
        "sum, not mean": dn_by_hand(theta, grads, 3, mean_of=1),
        "weights dropped": dn_by_hand(theta, dn_deltas(), 3),
        "full lr between": dn_by_hand(theta, grads, 3, step_of=1),
    }
    scale = want[-1].norm().item()
    for name, trajectory in wrong.items():
        apart = max((a.double() - b).norm().item() for a, b in zip(trajectory, want, strict=True))
        assert apart > 100 * 1e-6 * scale, name


def test_delayed_nesterov_state_resumes_mid_window_bit_for_bit():
    """Catches: the delta sum or the count of the current window (or the momentum) missing from
    the async checkpoint state: resumed after 5 deltas (2 into the second window of N = 3),
    through a torch.save/load round trip into a fresh AsyncOuter, the next 2 deltas (the second
    completes the window) must give the uninterrupted run's θ_global bit for bit. Also: a state
    saved with another outer_momentum_delay is refused with the fix."""
    whole = dn_outer(3)
    want = dn_trajectory(whole, dn_deltas(), DN_WEIGHTS)
    first = dn_outer(3)
    dn_trajectory(first, dn_deltas()[:5], DN_WEIGHTS[:5])
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(first.state_dict()), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    window = state["outer_optimizer"]["state"][0]
    assert window["received"] == 5 and window["delta_sum"].abs().sum() > 0  # mid-window: the test is not vacuous
    resumed = dn_outer(3)
    resumed.load_state_dict(state)
    got = dn_trajectory(resumed, dn_deltas()[5:], DN_WEIGHTS[5:])
    assert all(torch.equal(a, b) for a, b in zip(got, want[5:], strict=True))
    assert resumed.version == whole.version == 7
    with pytest.raises(ValueError, match="resume with data_parallel.outer_momentum_delay=3"):
        dn_outer(2).load_state_dict(state)


# Through the trainer: one worker, 8 steps, H = 2, a checkpoint (a pause) at step 4 (~20 s on the
# loaded 2-core machine, process start-up most of it): also the reference of the replicas of two
# ranks below.
ASYNC = ["--training.steps=8", "--checkpoint.interval=4", "--checkpoint.keep_last=3",
         "--data_parallel.mode=async", "--data_parallel.inner_steps=2",
         "--distributed.probe_topology=false"]  # fmt: skip


def train_and_resume(out: str) -> list[dict]:
    """In one spawn: the whole run, then a run resumed from its step-4 checkpoint."""
    from loomtrain.trainer import train

    whole = train(load_config(None, [*TINY, *ASYNC, f"--run.out_dir={out}", "--run.name=whole"]))
    resumed = train(load_config(None, [*TINY, *ASYNC, f"--run.out_dir={out}", "--run.name=resumed",
                                       f"--checkpoint.resume={out}/whole/checkpoints/step_00000004"]))  # fmt: skip
    return [whole, resumed]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async")
    spawn_once(train_and_resume, 2, str(out), timeout_s=240)
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_model(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    target = tmp / f"{run.name}.pt"
    dcp_to_torch_save(run / "checkpoints" / "step_00000008", target)
    return torch.load(target, weights_only=False)["model"]


def test_trainer_async_resume_continues_the_run(trained, tmp_path):
    """Catches: the server's θ_global, outer momentum or round counter, or the worker's inner
    optimizer state lost across a checkpoint (the resumed losses and final model would differ),
    a resume that repeats or skips rounds, and a checkpoint taken with rounds still out."""
    whole, resumed = records(trained / "whole"), records(trained / "resumed")
    assert [r["round"] for r in whole] == [0, 1, 2, 3]
    assert [(r["round"], r["loss"]) for r in resumed if r["step"] > 4] == [
        (r["round"], r["loss"]) for r in whole if r["step"] > 4
    ]
    want, got = final_model(trained / "whole", tmp_path), final_model(trained / "resumed", tmp_path)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_trainer_records_staleness_of_every_delta(trained):
    """Catches: deltas applied without their τ in metrics.jsonl or summary.json, and a summary
    whose outer step count or throughput does not come from the server's rounds."""
    whole = records(trained / "whole")
    assert all(r["staleness"] == 0 and r["applied"] == 1 for r in whole)
    summary = json.loads((trained / "whole" / "summary.json").read_text())
    assert summary["outer_steps"] == 4 and summary["staleness_applied"] == {"0": 4}
    assert summary["staleness_rejected"] == {} and summary["final_step"] == 8
    assert summary["tokens_per_s"] > 0 and summary["val_loss"] < whole[0]["loss"]


# Async with replicas of two ranks (4 processes: a server replica and one worker replica): the same
# 8-step run as `trained`'s one-rank replicas, with a server evaluation every 2 steps (the server's
# two ranks evaluate together), and the tp 2 run resumed from its step-4 checkpoint.
LAYOUTS = {
    "tp2": ["--parallel.tensor_parallel_degree=2"],
    "pp2": ["--parallel.pipeline_parallel_degree=2"],
    "r2_zero3": ["--parallel.data_parallel_replicate_degree=2", "--data_parallel.zero_stage=3"],
}
EVAL2 = ["--training.eval_interval=2"]


RESUMED = ("tp2", "r2_zero3")


def train_layouts(out: str) -> None:
    """Each of :data:`LAYOUTS` in one spawn, then those of :data:`RESUMED` resumed from their
    step-4 checkpoints."""
    from loomtrain.trainer import train

    for name, extra in LAYOUTS.items():
        train(load_config(None, [*TINY, *ASYNC, *EVAL2, *extra, f"--run.out_dir={out}", f"--run.name={name}"]))
    for name in RESUMED:
        train(load_config(None, [*TINY, *ASYNC, *EVAL2, *LAYOUTS[name], f"--run.out_dir={out}",
                                 f"--run.name={name}_resumed",
                                 f"--checkpoint.resume={out}/{name}/checkpoints/step_00000004"]))  # fmt: skip


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("async_layouts")
    spawn_once(train_layouts, 4, str(out), timeout_s=300)
    return out


def test_replicas_of_several_ranks_equal_one_rank_replicas(trained, layouts, tmp_path):
    """Catches, for async replicas split by tp 2, a pipeline of 2 stages or 2 dp_shard ranks
    with ZeRO-3 (the server replica holding θ_global split the same way): a server rank other
    than the leader that does not repeat the leader's sends and settlements (its shard of
    θ_global would stay at the initial weights or drift), ranks paired with the wrong server
    rank, a worker replica's batch not split over its dp_shard ranks or its loss not averaged
    over them, ZeRO's full copies not refreshed when θ_global is written, and a server
    evaluation that the server's other ranks do not join (it would hang). One worker: every
    delta has staleness 0, so each layout must give the one-rank replicas' round losses (1e-5
    relative: tp and ZeRO change only the order of float sums) and final model (1e-5 relative
    or 1e-6 absolute: AdamW's m/√v turns a reordered sum's last bit on a near-zero gradient into
    up to 4e-7 here; a shard left behind is off by ~1e-3) and the same validation losses as
    each other."""
    want_losses = [r["loss"] for r in records(trained / "whole")]
    want_model = final_model(trained / "whole", tmp_path)
    val = {}
    for name in LAYOUTS:
        got = records(layouts / name)
        assert [r["round"] for r in got if "round" in r] == [0, 1, 2, 3], name
        torch.testing.assert_close([r["loss"] for r in got if "round" in r], want_losses, rtol=1e-5, atol=0)
        val[name] = [r["val_loss"] for r in got if "val_loss" in r]
        model = final_model(layouts / name, tmp_path)
        assert model.keys() == want_model.keys(), name
        for key in want_model:
            torch.testing.assert_close(model[key], want_model[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    assert len(val["tp2"]) == 3
    torch.testing.assert_close(val["pp2"], val["tp2"], rtol=1e-5, atol=0)
    torch.testing.assert_close(val["r2_zero3"], val["tp2"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_of_replicas_of_two_ranks_continues_the_run(layouts, tmp_path, name):
    """Catches: a server follower's (or a worker's second rank's) θ_global shard, outer momentum
    or inner optimizer state lost across a checkpoint of replicas of two ranks, and a per-rank
    file that cannot be read back (ZeRO's inner moments are DTensors, whose mesh does not
    unpickle under ``weights_only``: the resume crashed before they were saved as local
    tensors): the resumed tp 2 and ZeRO-3 runs must repeat the uninterrupted ones' rounds after
    step 4 and end on their final models bit for bit."""
    whole, resumed = records(layouts / name), records(layouts / f"{name}_resumed")
    assert [(r["round"], r["loss"]) for r in resumed if r["step"] > 4 and "round" in r] == [
        (r["round"], r["loss"]) for r in whole if r["step"] > 4 and "round" in r
    ]
    want, got = final_model(layouts / name, tmp_path), final_model(layouts / f"{name}_resumed", tmp_path)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def train_two_tp_workers(out: str) -> dict:
    """6 processes: a server replica and two worker replicas of tp 2, 16 steps, τ ≤ 1 applied."""
    from loomtrain.trainer import train

    return train(load_config(None, [*TINY, *ASYNC, *LAYOUTS["tp2"], "--training.steps=16",
                                    "--data_parallel.max_staleness=1", f"--run.out_dir={out}",
                                    "--run.name=two_workers"]))  # fmt: skip


@pytest.mark.slow  # 6 processes on 2 cores: ~25 s
def test_two_tensor_parallel_workers_keep_the_staleness_rule(tmp_path):
    """Catches, with deltas of two tp 2 worker replicas arriving in any order: a server
    follower that settles another worker's delta than its leader did, or takes them in another
    order (its version or the round index would disagree: it raises), a delta applied beyond
    max_staleness, and a run that does not end with every worker round settled."""
    spawn_once(train_two_tp_workers, 6, str(tmp_path), timeout_s=300)
    got = [r for r in records(tmp_path / "two_workers") if "round" in r]
    assert sorted(r["round"] for r in got) == list(range(len(got))) and {r["worker"] for r in got} == {2, 4}
    assert sum(r["local_steps"] for r in got) == 2 * 16
    assert all(r["applied"] == (r["staleness"] <= 1) for r in got)
    summary = json.loads((tmp_path / "two_workers" / "summary.json").read_text())
    assert summary["outer_steps"] == sum(r["applied"] for r in got) and summary["final_step"] == 16


# Async replicas that are 2×2 grids of 2D tp: plain, and with ZeRO-1 over a dp_shard group of one rank.
GRIDS = {"grid": [], "grid_zero1": ["--parallel.data_parallel_replicate_degree=2", "--data_parallel.zero_stage=1"]}


def train_grid_replicas(out: str) -> None:
    """8 processes: a server replica and one worker replica, each a 2×2 grid of 2D tp, for
    each of :data:`GRIDS`."""
    from loomtrain.trainer import train

    grid = ["--parallel.tensor_parallel_degree=4", "--parallel.tp_mode=2d"]
    for name, extra in GRIDS.items():
        train(load_config(None, [*TINY, *ASYNC, *EVAL2, *grid, *extra, f"--run.out_dir={out}", f"--run.name={name}"]))


@pytest.mark.slow  # 8 processes on 2 cores: ~45 s for both layouts (load 12)
def test_replicas_of_a_2d_grid_equal_one_rank_replicas(trained, tmp_path):
    """Catches, for async replicas that are 2×2 grids of 2D tp (SUMMA's reductions on the
    grid's rows and columns, the norm weights' sum over a grid column): a server rank that
    does not repeat its leader's exchanges on its 2D block, a block exchanged with another grid
    position's, or a 2D reduction lost with the dp all-reduce: one worker's round losses and
    final model must equal the one-rank replicas' (as in the test of tp, pp and ZeRO replicas).
    The same with ZeRO-1 inside each grid replica (a dp_shard group of one rank): also catches
    its masters cut over dp_replicate as in HSDP (the server and the worker would share one
    ZeRO state)."""
    spawn_once(train_grid_replicas, 8, str(tmp_path), timeout_s=300)
    want = final_model(trained / "whole", tmp_path)
    for name in GRIDS:
        got = [r for r in records(tmp_path / name) if "round" in r]
        torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in records(trained / "whole")],
                                   rtol=1e-5, atol=0, msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
        model = final_model(tmp_path / name, tmp_path)
        assert model.keys() == want.keys(), name
        for key in want:
            torch.testing.assert_close(model[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def with_inner_state(outer: AsyncOuter) -> AsyncOuter:
    """``outer`` with a momentum buffer in its inner optimizer's state (as a checkpoint loads one)."""
    outer.inner_optimizer.state[outer.params[0]] = {"momentum_buffer": torch.ones(2, 2)}
    return outer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the in-process dcp.save
def test_another_world_size_keeps_the_saved_servers_outer_momentum(tmp_path):
    """Catches: an async resume at another world size (a worker lost, an elastic restart) that
    drops the server's outer momentum or version (the next deltas would take a first Nesterov
    step again), that carries over the old workers' round plan (its lanes are of another W), or
    that takes a split server's shard for the whole model (a checkpoint without the server's
    resharded state, written before it existed, must restart it: version 0); and one that keeps
    an async checkpoint's DCP copy of the inner optimizer state (the server ranks' zero first
    moments beside a worker's second moments: steps of 1e6 times the learning rate, seen) or
    drops a sync checkpoint's (the same on every rank, worth keeping). In-process: a server
    state after 5 Delayed Nesterov deltas, adopted by a fresh one, continues the same trajectory
    bit for bit."""
    from loomtrain.distributed.async_dp import resume_at_another_layout

    def resume(outer: AsyncOuter, checkpoint: Path, saved: dict, now: dict) -> None:
        resume_at_another_layout(outer, checkpoint, saved, now, torch.nn.ParameterList(outer.params), None, True)

    whole = dn_outer(3)
    want = dn_trajectory(whole, dn_deltas(), DN_WEIGHTS)
    first = dn_outer(3)
    dn_trajectory(first, dn_deltas()[:5], DN_WEIGHTS[:5])
    first.lanes, first.next_round = [6, 4], 3
    torch.save({"rank_state": {"outer_sync": first.state_dict()}}, tmp_path / "rank_00000.pt")
    one_rank = {"pp": 1, "dp": 3, "dp_replicate": 1, "sp": 1, "tp": 1}
    resumed = with_inner_state(dn_outer(3))
    resume(resumed, tmp_path, one_rank, {**one_rank, "dp": 2})
    assert (resumed.version, resumed.lanes, resumed.next_round) == (5, [], 0)
    assert not resumed.inner_optimizer.state
    got = dn_trajectory(resumed, dn_deltas()[5:], DN_WEIGHTS[5:])
    assert all(torch.equal(a, b) for a, b in zip(got, want[5:], strict=True))
    dcp.save({"model": {"0": first.params[0].detach()}}, checkpoint_id=tmp_path)  # no param_state
    for saved, now in (({**one_rank, "tp": 2}, one_rank), (one_rank, {**one_rank, "pp": 2})):  # a split server
        split = with_inner_state(dn_outer(3))
        resume(split, tmp_path, saved, now)
        assert split.version == 0 and not split.outer_optimizer.state and not split.inner_optimizer.state
    sync = tmp_path / "sync"
    sync.mkdir()
    torch.save({"rank_state": {}}, sync / "rank_00000.pt")
    kept = with_inner_state(dn_outer(3))
    resume(kept, sync, one_rank, {**one_rank, "dp": 2})
    assert kept.version == 0 and kept.inner_optimizer.state
    assert saved_async_state(tmp_path / "missing") is None


def train_three(out: str) -> None:
    from loomtrain.trainer import train

    train(load_config(None, [*TINY, *ASYNC, "--data_parallel.max_staleness=8", f"--run.out_dir={out}",
                             "--run.name=three"]))  # fmt: skip


def resume_on_two(out: str) -> None:
    from loomtrain.trainer import train

    resume = f"--checkpoint.resume={out}/three/checkpoints/step_00000004"
    train(load_config(None, [*TINY, *ASYNC, "--data_parallel.max_staleness=8", f"--run.out_dir={out}",
                             "--run.name=two", resume]))  # fmt: skip


@pytest.mark.slow  # a 3- and a 2-process spawn: ~35 s
def test_resume_with_a_worker_fewer_continues_the_outer_versions(tmp_path):
    """Catches, through the trainer: a resume of a server with 2 workers on a server with one
    that restarts the outer state (the first delta would be version 1 again) or replays the old
    plan's rounds: the resumed run's versions continue from the checkpoint's and its rounds cover
    steps 4 to 8 once."""
    spawn_once(train_three, 3, str(tmp_path), timeout_s=240)
    saved = [r for r in records(tmp_path / "three") if "round" in r and r["step"] <= 4]
    spawn_once(resume_on_two, 2, str(tmp_path), timeout_s=240)
    resumed = [r for r in records(tmp_path / "two") if "round" in r]
    applied = sum(r["applied"] for r in saved)
    assert [r["outer_version"] for r in resumed] == list(range(applied + 1, applied + 1 + len(resumed)))
    assert sum(r["local_steps"] for r in resumed) == 8 - 4 and {r["worker"] for r in resumed} == {1}


def train_async(out: Path, name: str, world: int, *extra: str) -> Path:
    """An async run of :data:`ASYNC` on ``world`` processes (a fresh spawn), in ``out/name``."""
    spawn(run_train, world, [*TINY, *ASYNC, f"--run.out_dir={out}", f"--run.name={name}", *extra], timeout_s=240)
    return out / name


DN2 = ["--data_parallel.outer_momentum_delay=2"]  # 3 deltas in 6 steps: a momentum and a delta sum of one


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        pytest.param((4, LAYOUTS["tp2"], [0, 1]), (2, [], [0]), id="tp2_server_to_one_rank"),
        pytest.param(
            (2, DN2, [0]),
            (4, [*DN2, *LAYOUTS["r2_zero3"]], [0, 1]),
            id="dn_one_rank_to_zero3_server",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_resume_at_another_layout_keeps_a_split_servers_outer_state(saved, resumed, tmp_path):
    """An elastic restart of async whose server is split (tp 2 before, or 2 ZeRO-3 ranks after) at
    another layout. Catches: the server's outer momentum (Delayed Nesterov's delta sum and delta
    count too), version or staleness counts restarted there (each server rank's file holds only
    its part of the momentum, so only a copy resharded from DCP carries it over: with the
    adoption removed the version is 0), or resharded wrongly (a parameter's momentum in
    another's place, pieces misplaced): the resumed run ends at once (its steps are the
    checkpoint's) and saves the adopted state, which, put together whole from the server ranks'
    files (:func:`replica_momentum`, independent of the DCP entries), must equal the saved
    server's bit for bit."""
    (world, extra, ranks), (world_after, extra_after, ranks_after) = saved, resumed
    run = train_async(tmp_path, "saved", world, *extra, "--training.steps=6")
    checkpoint = run / "checkpoints" / "step_00000006"
    again = train_async(tmp_path, "resumed", world_after, *extra_after, f"--checkpoint.resume={checkpoint}",
                        "--training.steps=6")  # fmt: skip
    before, after = saved_async_state(checkpoint), saved_async_state(again / "checkpoints" / "step_00000006")
    assert before["version"] == after["version"] == 3
    assert (after["applied"], after["rejected"], after["local_steps"]) == (
        before["applied"], before["rejected"], before["local_steps"])  # fmt: skip
    keys = sorted(before["outer_optimizer"]["state"][0])
    assert sorted(after["outer_optimizer"]["state"][0]) == keys
    for key in keys:
        if key == "received":  # Delayed Nesterov's delta count
            assert after["outer_optimizer"]["state"][0][key] == before["outer_optimizer"]["state"][0][key] == 3
            continue
        want, got = replica_momentum(run, 6, ranks, key), replica_momentum(again, 6, ranks_after, key)
        assert all(m.abs().sum() > 0 for m in want.values()), key
        for name in want:
            assert torch.equal(got[name], want[name]), f"{key}: {name}"
