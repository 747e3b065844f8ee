"""Rank 0's console progress: a bar on a terminal, plain lines in a log file, or JSON lines.

A tqdm bar redraws itself with carriage returns; written to a file (CI, ``nohup``, SLURM's
``--output``) those updates pile up into one enormous line. So the bar is shown only when
stderr, where it draws, is a terminal (``isatty``, man page isatty(3)); otherwise each logged
step prints one plain line on stdout. ``log.format = "json"`` prints each logged step as one
JSON object on stdout instead, and sends the other messages to stderr so stdout stays
machine-readable.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from tqdm import tqdm

from loomtrain.agent_log import TTY_ENV


def choose_mode(log_format: str, progress_bar: bool, stderr_is_tty: bool) -> str:
    """``"json"`` for ``log.format = "json"``; ``"bar"`` for text with the bar on and stderr a
    terminal; ``"lines"`` otherwise (no terminal, or ``metrics.progress_bar = false``)."""
    if log_format == "json":
        return "json"
    return "bar" if progress_bar and stderr_is_tty else "lines"


def stderr_is_terminal() -> bool:
    """Whether what this process writes to stderr ends on a terminal: its own stderr is one, or
    ``loomtrain train``'s launcher, which pipes the workers' output through itself, says its is
    (``LOOMTRAIN_CONSOLE_IS_TTY=1``)."""
    return sys.stderr.isatty() or os.environ.get(TTY_ENV) == "1"


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour); ``?`` when not yet known (NaN or infinite)."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def plain_line(step: int, total: int, record: dict[str, Any], eta_s: float) -> str:
    """One log line: ``step 40/2000 | loss 3.1025 | lr 4.00e-04 | 5,588 tok/s | MFU 17.24% | ETA 3:12``.

    ``record`` is a ``metrics.jsonl`` record (``loss``, ``lr``, ``tokens_per_s``, ``mfu``; a
    missing one is left out). The validation loss is not repeated: the trainer prints it on a
    line of its own.
    """
    parts = [f"step {step}/{total}"]
    if "loss" in record:
        parts.append(f"loss {record['loss']:.4f}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.2%}")
    parts.append(f"ETA {format_eta(eta_s)}")
    return " | ".join(parts)


class Console:
    """Progress of a run on rank 0, in the mode :func:`choose_mode` picks.

    The ETA is the wall time per step since this object was made (evaluation and checkpoints
    included, so it is what the clock will show) times the steps left.

    Args:
        total_steps: optimizer steps of the whole run.
        start_step: the step a resumed run starts from.
        log_format: ``"text"`` or ``"json"`` (``log.format``).
        progress_bar: ``metrics.progress_bar``: False prints plain lines even on a terminal.
    """

    def __init__(self, total_steps: int, start_step: int, log_format: str, progress_bar: bool):
        self.total, self.start_step, self.step = total_steps, start_step, start_step
        self.mode = choose_mode(log_format, progress_bar, stderr_is_terminal())
        self.started = time.monotonic()
        self._bar = None
        if self.mode == "bar":
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr,
                             dynamic_ncols=True, mininterval=1.0)  # fmt: skip

    def advance(self, steps: int = 1) -> None:
        """Count ``steps`` finished optimizer steps."""
        self.step += steps
        if self._bar is not None:
            self._bar.update(steps)

    def eta_s(self) -> float:
        """Seconds left at the wall-clock rate so far; NaN before the first step is counted."""
        done = self.step - self.start_step
        if done <= 0:
            return math.nan
        return (time.monotonic() - self.started) / done * (self.total - self.step)

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Show the ``metrics.jsonl`` record of ``step``: the bar's postfix, a line, or a JSON object."""
        if self.mode == "bar":
            if "loss" in record:
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}")
        elif self.mode == "json":
            eta = self.eta_s()
            print(json.dumps({"step": step, "total_steps": self.total, **record,
                              "eta_s": round(eta, 1) if math.isfinite(eta) else None}), flush=True)  # fmt: skip
        else:
            print(plain_line(step, self.total, record, self.eta_s()), flush=True)

    def message(self, text: str) -> None:
        """Print a line of text: above the bar, on stdout with the lines, on stderr beside JSON."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=sys.stderr if self.mode == "json" else sys.stdout, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
