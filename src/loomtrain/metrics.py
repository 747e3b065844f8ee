"""Metrics and run records: console progress bar, ``metrics.jsonl``, TensorBoard, the event
log and the per-rank sample audit.

Only rank 0 writes metrics and events; other ranks construct them with ``enabled=False``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA allocator peak on GPU, else the resident
    set high-water mark (``ru_maxrss``, which Linux reports in KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def last_logged_step(run_dir: Path) -> int:
    """The last step recorded in ``<run>/metrics.jsonl`` (0 if none): how far a failed attempt
    got, or how far a running one has got (safe to call while the file is being written)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    complete = path.read_text().split("\n")[:-1]  # a line still being written is not counted
    return max((json.loads(line)["step"] for line in complete if line), default=0)


def _truncated_jsonl(path: Path, start_step: int):
    """Open ``path`` for appending after dropping records past ``start_step``: steps after the
    checkpoint a run resumes from are redone, and each step must appear once."""
    kept = []
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
    f = path.open("w")
    f.writelines(line + "\n" for line in kept)
    f.flush()
    return f


class MetricsProcessor:
    """Writes one JSON object per logged step to ``<run>/metrics.jsonl`` and the same scalars
    to TensorBoard (``<run>/tensorboard``); shows a progress bar with loss, tokens/s and ETA.

    Args:
        run_dir: the run directory (exists).
        total_steps: optimizer steps of the whole run, for the bar and its ETA.
        start_step: the step a resumed run starts from.
        enabled: False on every rank but 0.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = True,
        progress_bar: bool = True,
    ):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self._jsonl = _truncated_jsonl(run_dir / "metrics.jsonl", start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events after the resumed step, which are about to be redone.
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        if progress_bar:
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record ``values`` for ``step`` (scalars only)."""
        if not self.enabled:
            return
        record = {"step": step, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)
        if self._bar is not None and "loss" in values:
            self._bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{values.get('tokens_per_s', 0):,.0f}")

    def message(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


class EventLog:
    """Run events (start, restart, checkpoint loaded or saved, world-size change, steps redone,
    preemption) appended to ``<run>/events.jsonl`` and printed on rank 0. Never truncated: it
    is the run's history across attempts."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = run_dir / "events.jsonl"
        self.enabled = enabled

    def __call__(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), "event": kind, **fields}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        details = ", ".join(f"{k}={v}" for k, v in fields.items())
        print(f"[loomtrain] {kind}: {details}", file=sys.stderr, flush=True)

    def read(self) -> list[dict[str, Any]]:
        """All events so far (any rank may read)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


class SampleRecorder:
    """Per rank, the window ids of every micro-batch it trained on, one JSON line per step in
    ``<run>/samples/rank_XXXXX.jsonl``: an audit that no sample is skipped or seen twice across
    restarts. Records past the resumed step are dropped, as they are redone."""

    def __init__(self, run_dir: Path, rank: int, start_step: int, enabled: bool):
        self._file = None
        if enabled:
            (run_dir / "samples").mkdir(parents=True, exist_ok=True)
            self._file = _truncated_jsonl(run_dir / "samples" / f"rank_{rank:05d}.jsonl", start_step)

    def record(self, step: int, sample_ids: list[list[int]]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"step": step, "samples": sample_ids}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
