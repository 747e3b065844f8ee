"""Rank 0's console progress (bar, plain lines, JSON lines): each test names the bug it would catch.

The run without a terminal is in tests/integration/test_report_runs.py."""

from __future__ import annotations

import io
import json
import math
import os
import pty
import sys

from loomtrain.console import Console, format_eta, plain_line

RECORD = {"loss": 3.10251, "lr": 4e-4, "tokens_per_s": 5588.4, "mfu": 0.1724, "val_loss": 3.2}


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def test_terminal_keeps_the_bar_and_metrics_progress_bar_false_prints_lines(monkeypatch, capsys):
    """Catches: the bar dropped on a real terminal (isatty asked of the wrong stream, or inverted), and
    `metrics.progress_bar = false` silencing the console instead of printing lines."""
    controller, terminal = pty.openpty()
    with os.fdopen(terminal, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        console = Console(total_steps=10, start_step=0, log_format="text", progress_bar=True)
        console.advance()
        console.log(1, RECORD)
        console.close()
        tty.flush()
        assert console.mode == "bar" and b"\r" in _read_all(controller)
        assert capsys.readouterr().out == ""
        quiet = Console(total_steps=10, start_step=0, log_format="text", progress_bar=False)
        quiet.advance()
        quiet.log(1, RECORD)
    os.close(controller)
    assert quiet.mode == "lines" and capsys.readouterr().out.startswith("step 1/10 | loss 3.1025 |")


def test_line_and_json_formats(monkeypatch, capsys):
    """Catches: a line that drops a figure or prints MFU as a raw fraction, an ETA in the wrong unit, and JSON
    output that is not one parsable object per call or that mixes other messages into stdout."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    line = plain_line(40, 2000, RECORD, 192.4)
    assert line == "step 40/2000 | loss 3.1025 | lr 4.00e-04 | 5,588 tok/s | MFU 17.24% | ETA 3:12"
    assert (format_eta(3725), format_eta(59.6), format_eta(math.nan)) == ("1:02:05", "1:00", "?")
    console = Console(total_steps=6, start_step=2, log_format="json", progress_bar=True)
    console.message("step 3: train loss 3.1, val loss 3.2")
    console.log(2, RECORD)
    console.advance(2)
    console.log(4, RECORD)
    first, second = (json.loads(text) for text in capsys.readouterr().out.splitlines())
    assert first == {"step": 2, "total_steps": 6, **RECORD, "eta_s": None}  # no step timed yet
    assert second["step"] == 4 and second["eta_s"] >= 0
    assert "val loss 3.2" in sys.stderr.getvalue()
