"""The launcher's console story: one line per event, the raw output in a debug log.

``loomtrain train`` starts torchrun agents (``loomtrain.launch``) whose stderr carries, besides
the trainer's own messages, torchrun's log records (``E1202 00:29:21.449000 19078 api.py:1002]
failed (exitcode: -9) local_rank: 1 (pid: 19125) ...``), the workers' uncaught tracebacks
(prefixed ``[rank0]:`` by torch.distributed's excepthook) and torchrun's own ``SignalException``
traceback when a stop request reaches it. Each agent's stdout and stderr are captured: every
byte goes, unchanged, to ``<run>/logs/agent_<i>.log``; the console gets the training output
(progress lines, JSON lines, the trainer's messages) live, and instead of the noise one line
per recognised event (a worker's exit, a restart, the checkpoint a restart resumed from, a
stop, an agent lost) saying what happened and what happens next. The launcher's events are
appended to ``events.jsonl`` with their details. A failure that is not recognised ends with the
last lines of the raw log and its path.

The record formats parsed are torchrun's (PyTorch 2.x ``torch.distributed.elastic``: the
glog-style ``logging`` format, ``multiprocessing/api.py``'s ``failed (exitcode: ...)`` record)
and the trainer's ``[loomtrain] kind: key=value, ...`` event lines (``loomtrain.metrics.EventLog``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# torch's logging records and C++ (glog) messages: "E1202 00:29:21.449000 19078 path:1002] msg".
TORCH_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ?(.*)$")
WORKER_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
LOOM_EVENT = re.compile(r"^\[loomtrain\] (\w+): ?(.*)$")
EVENT_FIELD = re.compile(r"(\w+)=(.*?)(?=, \w+=|$)")
# Python's lines between two chained tracebacks (traceback module, "chained exceptions").
CHAIN_LINES = ("", "During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")  # fmt: skip
# torchrun's own exceptions that only wrap a worker's failure or a stop request: never a cause.
WRAPPER_ERRORS = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
                  "torch.distributed.elastic.multiprocessing.api.SignalException")  # fmt: skip
# Trainer events the launcher's own lines say better; the rest of a resume is merged into one line.
HIDDEN_EVENTS = {"start", "failure_detected", "restart", "preempted"}
RESUME_EVENTS = ("checkpoint_loaded", "world_size_change", "steps_redone")
# Seconds a resume's event lines wait for the rest of the group before their line is printed.
RESUME_SETTLE_S = 0.5
TAIL_LINES = 12
# Set by the launcher when its own stderr is a terminal: the workers' stderr is a pipe to it.
TTY_ENV = "LOOMTRAIN_CONSOLE_IS_TTY"


def exit_description(exitcode: int) -> str:
    """A process exit status as a person reads it: ``-9`` → ``died with SIGKILL`` (a negative
    status is the signal that ended it, Python's ``Popen.returncode`` convention), ``1`` →
    ``exited with code 1``."""
    if exitcode < 0:
        try:
            return f"died with {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"died with signal {-exitcode}"
    return f"exited with code {exitcode}"


def parse_event_fields(text: str) -> dict[str, str]:
    """``"step=10, path=/r/c/step_00000010"`` → ``{"step": "10", "path": "/r/c/step_00000010"}``
    (``EventLog``'s console format; values stay strings)."""
    return {k: v for k, v in EVENT_FIELD.findall(text)}


@dataclass(frozen=True)
class Line:
    """One classified stderr line: ``kind`` is ``"show"`` (console material), ``"hide"`` (debug
    log only), ``"worker_exit"`` (``exit`` = (local_rank, pid, exitcode)) or ``"event"`` (a
    trainer event: ``event`` = (kind, fields))."""

    kind: str
    exit: tuple[int, int, int] | None = None
    event: tuple[str, dict[str, str]] | None = None


class StderrFilter:
    """Classifies one agent's stderr line by line (a state machine over tracebacks and
    torchrun's ``=====`` failure summaries) and keeps the last exception line seen, the
    probable cause of the next worker exit."""

    def __init__(self) -> None:
        self.last_error: str | None = None
        self._in_traceback = False
        self._in_summary = False

    def feed(self, text: str) -> Line:
        """Classify ``text`` (one line, without its newline)."""
        text = text.rsplit("\r", 1)[-1]
        prefixed = RANK_PREFIX.match(text) is not None
        bare = RANK_PREFIX.sub("", text)
        if self._traceback_line(bare) or prefixed:
            return Line("hide")
        if bare.startswith("=" * 20):
            self._in_summary = not self._in_summary
            return Line("hide")
        if self._in_summary:
            return Line("hide")
        log = TORCH_LOG.match(bare)
        if log:
            found = WORKER_EXIT.search(log.group(1))
            if found is None:
                return Line("hide")
            return Line("worker_exit", exit=(int(found[2]), int(found[3]), int(found[1])))
        event = LOOM_EVENT.match(bare)
        if event:
            return Line("event", event=(event[1], parse_event_fields(event[2])))
        return Line("show")

    def _traceback_line(self, bare: str) -> bool:
        """Whether ``bare`` belongs to a traceback; records its exception line."""
        if bare.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
            return True
        if not self._in_traceback:
            return False
        if bare.startswith((" ", "\t")) or bare in CHAIN_LINES:
            return True
        if not bare.startswith(WRAPPER_ERRORS):
            self.last_error = bare.strip()[:200]
        self._in_traceback = False
        return True


@dataclass
class AgentState:
    """What the story knows of one agent: its debug log, restarts used, a resume being told and
    the trainer's attempt number it belongs to (0: the first start)."""

    log_path: Path
    filter: StderrFilter = field(default_factory=StderrFilter)
    failures: int = 0
    resume: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    resume_since: float = 0.0
    attempt: int = 0


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory when inside it (what the user typed), else absolute."""
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else rel


class Story:
    """Turns the agents' events into console lines and ``events.jsonl`` records.

    Args:
        run_dir: the run directory (``events.jsonl``; checkpoints under ``checkpoints/``).
        log_paths: each agent's debug log.
        max_restarts: torchrun's ``--max-restarts`` (0: a failure ends the job).
        console: where the story's lines go (the launcher's stderr).
    """

    def __init__(self, run_dir: Path, log_paths: list[Path], max_restarts: int, console=None):
        self.run_dir, self.max_restarts = run_dir, max_restarts
        self.agents = [AgentState(p) for p in log_paths]
        self.console = console or sys.stderr
        self.lock = threading.RLock()
        self.stop_signal: int | None = None
        self.explained: set[int] = set()

    def say(self, text: str) -> None:
        """Print one story line on the console."""
        with self.lock, contextlib.suppress(OSError, ValueError):  # a closed console (see Pump._write)
            print(text, file=self.console, flush=True)

    def record(self, kind: str, **fields) -> None:
        """Append a launcher event to ``events.jsonl`` (``EventLog``'s record format)."""
        with self.lock, (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), "event": kind, "source": "launcher", **fields}) + "\n")

    def worker(self, agent: int, local_rank: int) -> str:
        """How a worker is named: its rank with one agent; agent and local rank with several."""
        if len(self.agents) == 1:
            return f"worker rank {local_rank}"
        return f"agent {agent}'s worker local_rank {local_rank}"

    def worker_exited(self, agent: int, local_rank: int, pid: int, exitcode: int) -> None:
        """A worker of ``agent`` failed: say what happened, why if known, and what happens next."""
        state = self.agents[agent]
        with self.lock:
            state.failures += 1
            cause = state.filter.last_error if exitcode > 0 else None
            state.filter.last_error = None
            action = self._next_action(agent)
            self.say(f"{self.worker(agent, local_rank)} (pid {pid}) {exit_description(exitcode)}"
                     f"{f' ({cause})' if cause else ''}; {action}; details: {shown_path(state.log_path)}")  # fmt: skip
            self.explained.add(agent)
            self.record("worker_failed", agent=agent, local_rank=local_rank, pid=pid, exitcode=exitcode,
                        error=cause, action=action, log=str(state.log_path))  # fmt: skip

    def _next_action(self, agent: int) -> str:
        state = self.agents[agent]
        if self.stop_signal is not None:
            return "stopping (stop requested)"
        if self.max_restarts == 0:
            return "the job stops (start it with --elastic to restart failed workers)"
        if state.failures > self.max_restarts:
            who = "the job stops" if len(self.agents) == 1 else f"agent {agent} gives up"
            return f"no restarts left ({self.max_restarts} used); {who}"
        from loomtrain.checkpoint import find_latest_checkpoint

        latest = find_latest_checkpoint(self.run_dir / "checkpoints", warn=False, hashes=False)
        start = f"checkpoint {latest.name}" if latest else "step 0 (no checkpoint yet)"
        return f"restarting all workers from {start} (restart {state.failures} of {self.max_restarts})"

    def event(self, agent: int, kind: str, fields: dict[str, str], raw: str) -> None:
        """A trainer event line: hidden, merged into a resume line, or shown as it came."""
        with self.lock:
            if kind == "restart":
                attempt = fields.get("attempt", "")
                self.agents[agent].attempt = int(attempt) if attempt.isdigit() else 0
            if kind in HIDDEN_EVENTS:
                return
            if kind in RESUME_EVENTS:
                state = self.agents[agent]
                state.resume.append((kind, fields))
                state.resume_since = time.monotonic()
                if kind == RESUME_EVENTS[-1]:
                    self.flush(agent)
                return
            self.flush(agent)
            self.say(raw)

    def flush(self, agent: int, older_than_s: float = 0.0) -> None:
        """Print the resume line of ``agent`` once its events have settled for ``older_than_s``."""
        state = self.agents[agent]
        with self.lock:
            if not state.resume or time.monotonic() - state.resume_since < older_than_s:
                return
            self.say(resume_line(dict(state.resume), state.attempt))
            state.resume.clear()
            state.attempt = 0

    def flush_settled(self) -> None:
        """Print every resume line whose events have settled (called from the launcher's wait loop)."""
        for agent in range(len(self.agents)):
            self.flush(agent, RESUME_SETTLE_S)

    def agent_exited(self, agent: int, exitcode: int, others_running: bool) -> None:
        """An agent ended with a failure status: say so unless a worker's exit already did, with
        the cause (its last exception) or, for an unexplained exit code, its log's last lines."""
        state = self.agents[agent]
        with self.lock:
            self.record("agent_exited", agent=agent, exitcode=exitcode, log=str(state.log_path))
            if agent in self.explained or self.stop_signal is not None:
                return
            cause = state.filter.last_error
            nxt = "the other agents go on" if others_running else "no agent is left"
            self.say(f"agent {agent} {exit_description(exitcode)}{f' ({cause})' if cause else ''}; {nxt}; "
                     f"details: {shown_path(state.log_path)}")  # fmt: skip
            if cause is None and exitcode > 0:  # a death by signal is its own explanation
                self.show_tail(state.log_path)
            self.explained.add(agent)

    def stopped(self, preempted: dict | None, code: int) -> None:
        """The one line of a stop request: the checkpoint written (``preempted`` event) or none."""
        name = signal.Signals(self.stop_signal).name
        if preempted is not None:
            self.say(f"stop requested ({name}): checkpoint at step {preempted['step']} written "
                     f"({preempted['checkpoint']}), exiting {code}")  # fmt: skip
        else:
            self.say(f"stop requested ({name}): no checkpoint written, exiting {code}; "
                     f"details: {shown_path(self.agents[0].log_path)}")  # fmt: skip
        self.record("stop", signal=name, step=None if preempted is None else preempted["step"], exitcode=code)

    def failed(self, codes: list[int | None], code: int) -> None:
        """The job's last line when it fails; the raw log's tail when no event explained it."""
        agent = next((i for i, c in enumerate(codes) if c), 0)
        path = self.agents[agent].log_path
        self.say(f"job failed (exit code {code}); details: {shown_path(path)}")
        if not self.explained:
            self.show_tail(path)

    def show_tail(self, path: Path) -> None:
        """Print the last lines of a debug log: a failure no event explains stays visible."""
        self.say(f"last lines of {shown_path(path)}:")
        for line in tail(path, TAIL_LINES):
            self.say(f"  {line}")


def resume_line(events: dict[str, dict[str, str]], restart: int) -> str:
    """One line for a resume: ``restart 1: resumed from checkpoint step_00000010 (step 10,
    world size 2); steps 11-18 are redone``. ``events`` maps the trainer's resume event kinds
    (``checkpoint_loaded``, ``world_size_change``, ``steps_redone``) to their fields."""
    loaded = events.get("checkpoint_loaded", {})
    where = Path(loaded.get("path", "?")).name
    text = f"resumed from checkpoint {where} (step {loaded.get('step', '?')}"
    change = events.get("world_size_change")
    if change:
        text += f", world size {change.get('before')} -> {change.get('after')})"
    else:
        text += f", world size {loaded.get('saved_world_size', '?')})"
    redone = events.get("steps_redone")
    if redone:
        text += f"; steps {redone.get('from_step')}-{redone.get('to_step')} are redone"
    return f"restart {restart}: {text}" if restart else text


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` non-empty lines of a text file (bytes that are not UTF-8 replaced)."""
    with path.open("rb") as f:
        last = deque((b.rstrip(b"\r\n") for b in f if b.strip()), maxlen=lines)
    return [b.decode(errors="replace").rsplit("\r", 1)[-1] for b in last]


class Pump:
    """Copies one agent's stdout or stderr pipe, live, to its debug log (every byte) and to the
    console (what :class:`StderrFilter` lets through; stdout all of it, so ``log.format =
    "json"`` keeps stdout pure JSON), handing recognised events to the :class:`Story`.

    A progress bar's redraws (text after a carriage return, no newline yet: tqdm's terminal
    output) go to the console at once and stay out of the log.

    Args:
        story: the job's story (its lock also orders writes to the logs and the console).
        agent: the agent's index.
        log: the agent's debug log, opened for binary append.
        console: the launcher's own stream the pipe's content belongs on (binary).
        is_stderr: whether the pipe is the agent's stderr (classified) or stdout (passed on).
    """

    def __init__(self, story: Story, agent: int, log: BinaryIO, console: BinaryIO, is_stderr: bool):
        self.story, self.agent, self.log, self.console, self.is_stderr = story, agent, log, console, is_stderr

    def run(self, pipe: BinaryIO) -> None:
        """Read ``pipe`` until end of file (every writer closed it: the agent and its workers ended)."""
        pending = b""
        while chunk := os.read(pipe.fileno(), 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self.route(raw + b"\n")
            if self.is_stderr and b"\r" in pending:
                self._write(self.console, pending)
                pending = b""
        if pending:
            self.route(pending + b"\n")

    def route(self, raw: bytes) -> None:
        """Log one line and send it, or the event it records, on."""
        story = self.story
        with story.lock:
            self._write(self.log, raw)
            if not self.is_stderr:
                story.flush(self.agent)
                self._write(self.console, raw)
                return
            try:
                self._tell(raw)
            except (OSError, ValueError):
                # Telling it failed (the run directory gone, say): the line itself must not be lost.
                self._write(self.console, raw)

    def _tell(self, raw: bytes) -> None:
        story, text = self.story, raw.decode(errors="replace").rstrip("\r\n")
        line = story.agents[self.agent].filter.feed(text)
        if line.kind == "show":
            story.flush(self.agent)
            self._write(self.console, raw)
        elif line.kind == "worker_exit":
            story.worker_exited(self.agent, *line.exit)
        elif line.kind == "event":
            story.event(self.agent, *line.event, text)

    @staticmethod
    def _write(stream: BinaryIO, data: bytes) -> None:
        # A console closed by the reader (``loomtrain train | head``) or a full disk must not end
        # the pump: the agent and its workers would block on the undrained pipe and the job hang.
        with contextlib.suppress(OSError, ValueError):
            stream.write(data)
            stream.flush()
