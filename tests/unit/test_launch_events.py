"""The launcher's console story (loomtrain.agent_log, launch.run_agents): one line per event,
the raw output in the debug log. Each test names the bug it would catch.

The stderr samples are the record formats PyTorch 2.x's torchrun and torch.distributed print
(seen in runs of this project); the real torchrun is exercised in
tests/integration/test_console_events.py. The agents of the run_agents tests are small Python
processes that print those formats: real processes, pipes and signals, without torch's start-up.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from loomtrain.agent_log import Pump, StderrFilter, Story, exit_description, resume_line
from loomtrain.checkpoint import MANIFEST
from loomtrain.console import stderr_is_terminal
from loomtrain.launch import run_agents

TORCH_LOG = "W1202 00:27:35.963000 17647 .venv/lib/python3.11/site-packages/torch/distributed/elastic/"
SIGTERM_STDERR = f"""INFO 1 host(s), 2 ranks (2 per host)
{TORCH_LOG}agent/server/api.py:753] Received 15 death signal, shutting down workers
{TORCH_LOG}multiprocessing/api.py:1028] Sending process 17742 closing signal SIGTERM
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86
    raise SignalException(f"Process {{os.getpid()}} got signal: {{sigval}}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 17647 got signal: 15
"""
GLOO_TRACEBACK = """[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/src/loomtrain/trainer.py", line 63, in train_step
[rank0]:     sync.finish_gradient_sync()
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:18105: Connection reset by peer.
"""
WORKER_EXIT = (
    "E1202 00:29:21.449000 19078 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
    "api.py:1002] failed (exitcode: {code}) local_rank: {rank} (pid: {pid}) of binary: /usr/bin/python3"
)
SUMMARY = """Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 290, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
loomtrain.cli FAILED
------------------------------------------------------------
Root Cause (first observed failure):
  exitcode  : -9 (pid: 19125)
============================================================
"""


def kinds(text: str, f: StderrFilter | None = None) -> list[str]:
    f = f or StderrFilter()
    return [f.feed(line).kind for line in text.splitlines()]


def test_noise_is_hidden_and_the_trainers_messages_are_shown():
    """Catches: torchrun's SignalException traceback, its log records, a worker's rank-prefixed gloo
    traceback or the ChildFailedError summary reaching the console; or the trainer's own log lines hidden."""
    assert kinds(SIGTERM_STDERR) == ["show"] + ["hide"] * 8
    f = StderrFilter()
    assert set(kinds(GLOO_TRACEBACK + SUMMARY, f)) == {"hide"}
    assert f.last_error.startswith("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error")
    assert kinds("placement:\ndp_shard 2: inside one host\nUserWarning: x") == ["show"] * 3


def test_worker_exit_and_trainer_event_lines_are_parsed():
    """Catches: a worker's exit record not recognised (so no failure line), local_rank and pid swapped, a
    signal death told as an exit code, or an event's fields cut at the wrong comma."""
    line = StderrFilter().feed(WORKER_EXIT.format(code=-9, rank=1, pid=19125))
    assert (line.kind, line.exit) == ("worker_exit", (1, 19125, -9))
    assert (exit_description(-9), exit_description(-15), exit_description(1)) == (
        "died with SIGKILL", "died with SIGTERM", "exited with code 1")  # fmt: skip
    event = StderrFilter().feed("[loomtrain] checkpoint_loaded: path=/r/job/checkpoints/step_00000010, step=10, "
                                "saved_world_size=2").event  # fmt: skip
    assert event == ("checkpoint_loaded", {"path": "/r/job/checkpoints/step_00000010", "step": "10",
                                           "saved_world_size": "2"})  # fmt: skip


def story(tmp_path: Path, agents: int = 1, max_restarts: int = 3) -> tuple[Story, io.StringIO]:
    """A story over ``tmp_path`` holding complete checkpoint step_00000010 and an unfinished step_00000012."""
    for step in (10, 12):
        (tmp_path / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000010" / MANIFEST).write_text(json.dumps({"files": {}}))
    (tmp_path / "logs").mkdir()
    paths = [tmp_path / "logs" / f"agent_{i}.log" for i in range(agents)]
    for p in paths:
        p.write_bytes(b"")
    out = io.StringIO()
    return Story(tmp_path, paths, max_restarts, out), out


def test_restart_tells_one_failure_line_and_one_resume_line(tmp_path):
    """Catches: a failure line without what happens next (restart count, the complete checkpoint it
    resumes from, not an unfinished newer one), the trainer's five start/failure/restart/loaded/redone
    lines shown one by one, or the launcher's events missing from events.jsonl."""
    s, out = story(tmp_path, max_restarts=3)
    f = s.agents[0].filter
    for text in [*GLOO_TRACEBACK.splitlines(), WORKER_EXIT.format(code=-9, rank=1, pid=42),
                 "[loomtrain] start: world_size=2, attempt=1", "[loomtrain] failure_detected: failed_attempt=0",
                 "[loomtrain] restart: attempt=1",
                 "[loomtrain] checkpoint_loaded: path=/r/checkpoints/step_00000010, step=10, saved_world_size=2",
                 "[loomtrain] steps_redone: count=8, from_step=11, to_step=18"]:  # fmt: skip
        line = f.feed(text)
        if line.kind == "worker_exit":
            s.worker_exited(0, *line.exit)
        elif line.kind == "event":
            s.event(0, *line.event, text)
    assert out.getvalue().splitlines() == [
        "worker rank 1 (pid 42) died with SIGKILL; restarting all workers from checkpoint step_00000010 "
        f"(restart 1 of 3); details: {tmp_path / 'logs' / 'agent_0.log'}",
        "restart 1: resumed from checkpoint step_00000010 (step 10, world size 2); steps 11-18 are redone",
    ]
    record = json.loads((tmp_path / "events.jsonl").read_text())
    assert (record["event"], record["exitcode"], record["pid"], record["source"]) == ("worker_failed", -9, 42,
                                                                                     "launcher")  # fmt: skip


def test_failure_cause_and_no_restarts_left(tmp_path):
    """Catches: a worker's exception not named in its failure line, restarts counted past --max-restarts, a
    plain launch promising a restart, and a lost node's agent (killed) told with a log tail or not at all."""
    s, out = story(tmp_path, max_restarts=1)
    f = s.agents[0].filter
    for text in ["[rank0]: Traceback (most recent call last):", "[rank0]:   File x", "[rank0]: ValueError: bad"]:
        f.feed(text)
    s.worker_exited(0, 0, 7, 1)
    s.worker_exited(0, 0, 8, -9)
    first, second = out.getvalue().splitlines()
    assert first.startswith("worker rank 0 (pid 7) exited with code 1 (ValueError: bad); restarting all workers")
    assert "(ValueError" not in second and "no restarts left (1 used); the job stops" in second
    plain, plain_out = story(tmp_path / "plain", max_restarts=0)
    plain.worker_exited(0, 1, 9, -9)
    assert "the job stops (start it with --elastic" in plain_out.getvalue()
    two, two_out = story(tmp_path / "two", agents=2)
    two.agent_exited(1, -9, others_running=True)
    lost = f"agent 1 died with SIGKILL; the other agents go on; details: {two.agents[1].log_path}\n"
    assert two_out.getvalue() == lost
    assert resume_line({"checkpoint_loaded": {"path": "/c/step_00000004", "step": "4"},
                        "world_size_change": {"before": "3", "after": "2"}}, 0) == (
        "resumed from checkpoint step_00000004 (step 4, world size 3 -> 2)")  # fmt: skip


def test_pump_forwards_lines_live_logs_everything_and_keeps_stdout_pure(tmp_path):
    """Catches: output held until the agent ends (no live progress), stdout lines filtered or
    reordered (log.format=json no longer pure JSON), a bar redraw that waits for a newline, or bytes
    missing from the debug log."""
    s, _ = story(tmp_path)
    log, console_out, console_err = io.BytesIO(), io.BytesIO(), io.BytesIO()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    threads = [threading.Thread(target=Pump(s, 0, log, con, err).run, args=(os.fdopen(r, "rb"),))
               for r, con, err in ((r_out, console_out, False), (r_err, console_err, True))]  # fmt: skip
    for t in threads:
        t.start()
    os.write(w_out, b'{"step": 1, "loss": 4.4}\n')
    os.write(w_err, b"\r 10%|#   | 1/10")
    deadline = time.monotonic() + 5
    while (not console_out.getvalue() or not console_err.getvalue()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert console_out.getvalue() == b'{"step": 1, "loss": 4.4}\n'  # shown while the pipe is still open
    assert console_err.getvalue() == b"\r 10%|#   | 1/10"
    os.write(w_err, SIGTERM_STDERR.encode())
    os.write(w_out, b'{"step": 2, "loss": "Traceback"}\n')
    os.close(w_out)
    os.close(w_err)
    for t in threads:
        t.join(timeout=5)
    assert [json.loads(x)["step"] for x in console_out.getvalue().splitlines()] == [1, 2]
    assert b"Traceback" not in console_err.getvalue() and b"INFO 1 host(s)" in console_err.getvalue()
    assert SIGTERM_STDERR.encode() in log.getvalue() and b"1/10" not in log.getvalue()


class ClosedConsole(io.BytesIO):
    """The launcher's console after its reader went away (``loomtrain train | head``)."""

    def write(self, data):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_console_does_not_stop_the_pump(tmp_path):
    """Catches: a pump thread that dies at the first write to a console whose reader is gone:
    the agent's pipe then fills (64 KiB) and the agent and its workers block, a hung job. Every
    line must still be drained into the debug log, and the story lines must not raise."""
    s, _ = story(tmp_path)
    s.console = io.TextIOWrapper(ClosedConsole())
    s.say("a story line")
    log = io.BytesIO()
    r, w = os.pipe()
    thread = threading.Thread(target=Pump(s, 0, log, ClosedConsole(), True).run, args=(os.fdopen(r, "rb"),))
    thread.start()
    lines = b"".join(b"INFO line %d of the trainer's output\n" % i for i in range(5000))  # > a pipe buffer
    with os.fdopen(w, "wb") as pipe:
        pipe.write(lines)
    thread.join(timeout=10)
    assert not thread.is_alive() and log.getvalue() == lines


AGENT = "import sys, time, json; sys.stdout.write('step 1/9 | loss 4.4\\n'); sys.stdout.flush(); "


def agent(code: str) -> list[str]:
    return [sys.executable, "-c", AGENT + code]


def stop_launcher_when(ready: Path) -> None:
    """SIGTERM to this process (the launcher of the test) once the agent has its handler installed."""
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)


def test_run_agents_failure_stop_and_unrecognised_failure(tmp_path, capfd):
    """Catches: a launcher that shows agents' tracebacks, loses a failure's details (no debug log, no
    pointer to it), keeps an unrecognised failure silent (no raw tail), or breaks the stop path
    (SIGTERM forwarded to the agents; exit 0 only with a preemption checkpoint logged)."""
    (tmp_path / "a").mkdir()
    worker_dies = (f"sys.stderr.write({GLOO_TRACEBACK!r} + {WORKER_EXIT.format(code=1, rank=0, pid=5)!r} + "
                   f"'\\n' + {SUMMARY!r}); sys.exit(1)")  # fmt: skip
    assert run_agents([agent(worker_dies)], dict(os.environ), tmp_path / "a") == 1
    out, err = capfd.readouterr()
    assert out == "step 1/9 | loss 4.4\n" and "Traceback" not in err and "=====" not in err
    assert err.splitlines() == [
        f"worker rank 0 (pid 5) exited with code 1 (RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
        f"[127.0.0.1]:18105: Connection reset by peer.); the job stops (start it with --elastic to restart failed "
        f"workers); details: {tmp_path}/a/logs/agent_0.log",
        f"job failed (exit code 1); details: {tmp_path}/a/logs/agent_0.log",
    ]
    # The stdout line may land anywhere among the stderr lines (two reader threads), so it is set aside.
    logged = (tmp_path / "a" / "logs" / "agent_0.log").read_text().replace("step 1/9 | loss 4.4\n", "")
    assert GLOO_TRACEBACK in logged

    assert run_agents([agent("sys.stderr.write('odd failure\\n'); sys.exit(3)")], dict(os.environ), tmp_path) == 3
    err = capfd.readouterr().err
    assert err.splitlines()[1:3] == [f"agent 0 exited with code 3; no agent is left; details: {tmp_path}/logs/"
                                     "agent_0.log", f"last lines of {tmp_path}/logs/agent_0.log:"]  # fmt: skip
    # The agent's stdout and stderr are read by two threads: their order in the log is not fixed.
    assert "  odd failure" in err.splitlines()[3:-1]
    assert err.splitlines()[-1] == f"job failed (exit code 3); details: {tmp_path}/logs/agent_0.log"

    preempts = ("import signal, os; signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'a').write("
                "json.dumps({'time': time.time(), 'event': 'preempted', 'step': 6, 'checkpoint': 'step_00000006'})"
                " + '\\n'), os._exit(0))); open(sys.argv[2], 'w').close(); time.sleep(60)")  # fmt: skip
    ready = tmp_path / "ready"
    threading.Thread(target=stop_launcher_when, args=(ready,), daemon=True).start()
    events = str(tmp_path / "a" / "events.jsonl")
    assert run_agents([[*agent(preempts), events, str(ready)]], dict(os.environ), tmp_path / "a") == 0
    assert capfd.readouterr().err.splitlines()[-1] == (
        "stop requested (SIGTERM): checkpoint at step 6 written (step_00000006), exiting 0"
    )


def test_bar_kept_when_the_launchers_stderr_is_a_terminal(monkeypatch):
    """Catches: workers whose stderr is the launcher's pipe falling back to plain lines on a terminal."""
    monkeypatch.setenv("LOOMTRAIN_CONSOLE_IS_TTY", "1")
    assert stderr_is_terminal()
    monkeypatch.delenv("LOOMTRAIN_CONSOLE_IS_TTY")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not stderr_is_terminal()
