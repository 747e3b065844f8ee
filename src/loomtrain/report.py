"""Pipeline timeline report: ``loomtrain report runs/<name> [--step N]``.

A run with pipeline parallelism (``parallel.pipeline_parallel_degree > 1``) records when each
pipeline rank ran each forward and backward action in ``<run_dir>/timeline.json``. This module
turns one recorded step of it into two files next to it:

- ``trace.json``: Chrome Trace Event Format, one row per pipeline rank, one box per action.
  Open it at https://ui.perfetto.dev (drag the file in) or at chrome://tracing (Load).
- ``timeline.png``: the same step as a Gantt chart, with the measured and theoretical bubble
  fractions in the title.

A timeline of emulated devices (``--simulate.device``; its ``emulated`` entry names the device)
says so in every output: the bubble line, the trace's process name and the chart's title.

``timeline.json`` holds times in seconds, relative to the start of each step's window (the
earliest action start over all ranks of the pipeline); stage ``s`` runs on pipeline rank
``s % pp``, so ``s // pp`` is its virtual chunk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "loomtrain-timeline-1"
TIMELINE_FILE = "timeline.json"
TRACE_FILE = "trace.json"
GANTT_FILE = "timeline.png"
_REQUIRED_KEYS = ("schedule", "pp", "virtual_stages", "micro_batches", "steps")
_US_PER_S = 1e6
_MS_PER_S = 1e3
# "B" is a whole backward, or under a zero-bubble schedule (zb_h1) its input-gradient half, "W"
# the weight-gradient half.
_CATEGORY = {"F": "forward", "B": "backward", "W": "weight gradient"}
# One colour family per kind, so forwards and backwards read apart at a glance, and a shade per
# virtual chunk within it.
_COLOURMAP = {"F": "Blues", "B": "Oranges", "W": "Greens"}
_LABEL_FONT_PT = 7


def load_timeline(run_dir: Path) -> dict[str, Any]:
    """Read and check ``<run_dir>/timeline.json``.

    Raises:
        FileNotFoundError: ``run_dir`` or its ``timeline.json`` does not exist.
        ValueError: the file is not JSON, has an unknown ``format``, or lacks a required key.
    """
    run_dir = Path(run_dir)
    path = run_dir / TIMELINE_FILE
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory; give a run directory, e.g. runs/<name>")
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no {TIMELINE_FILE}: it is written by runs with parallel.pipeline_parallel_degree > 1"
        )
    try:
        timeline = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); rerun training to rewrite it") from e
    if not isinstance(timeline, dict) or timeline.get("format") != FORMAT:
        found = timeline.get("format") if isinstance(timeline, dict) else type(timeline).__name__
        raise ValueError(f"{path} has format {found!r}, expected {FORMAT!r}; it was written by another version")
    missing = [k for k in _REQUIRED_KEYS if k not in timeline]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; rerun training to rewrite it")
    return timeline


def _select_step(timeline: dict[str, Any], step: int | None) -> dict[str, Any]:
    steps = timeline["steps"]
    if not steps:
        raise ValueError("the timeline records no steps; the run ended before its first timed step")
    if step is None:
        return steps[-1]
    for record in steps:
        if record["step"] == step:
            return record
    recorded = ", ".join(str(r["step"]) for r in steps)
    raise ValueError(f"step {step} is not in the timeline; recorded steps: {recorded}")


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.1%}"


def bubble_summary(timeline: dict[str, Any], step: int | None = None) -> str:
    """One line with the step's measured and theoretical bubble fractions, as percentages.

    Raises:
        ValueError: ``step`` was not recorded, or no step was.
    """
    record = _select_step(timeline, step)
    measured, theoretical = record.get("bubble_fraction"), record.get("theoretical_bubble")
    line = f"step {record['step']}: bubble {_percent(measured)} measured, {_percent(theoretical)} theoretical"
    return _emulated_prefix(timeline) + line


def _emulated_prefix(timeline: dict[str, Any]) -> str:
    """``"EMULATED <device>: "`` for a timeline of emulated devices, else nothing."""
    emulated = timeline.get("emulated")
    return "" if emulated is None else f"EMULATED {emulated['device']} (cost model, not hardware): "


def chrome_trace(timeline: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """One step of the timeline in Chrome Trace Event Format.

    Every action becomes a complete event (``ph`` "X", ``ts``/``dur`` in microseconds, ``pid``
    0, ``tid`` the pipeline rank); one ``thread_name`` metadata event per rank labels the rows
    and one ``process_name`` event names the step.

    Args:
        step: the training step to show; None means the last one recorded.

    Raises:
        ValueError: ``step`` was not recorded, or no step was.
    """
    record = _select_step(timeline, step)
    name = _emulated_prefix(timeline) + f"loomtrain step {record['step']}"
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": name}}]
    for rank in record["ranks"]:
        tid = rank["pp_rank"]
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": f"pp rank {tid}"}})
        events.extend(_trace_event(e, tid) for e in rank["events"])
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _trace_event(event: dict[str, Any], tid: int) -> dict[str, Any]:
    kind, stage, mb = event["kind"], event["stage"], event["micro_batch"]
    return {
        "ph": "X",
        "name": f"{kind} mb{mb} s{stage}",
        "cat": _CATEGORY[kind],
        "ts": event["start"] * _US_PER_S,
        "dur": (event["end"] - event["start"]) * _US_PER_S,
        "pid": 0,
        "tid": tid,
        "args": {"stage": stage, "micro_batch": mb, "kind": kind},
    }


def _colour(kind: str, chunk: int, chunks: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    # Stay in the middle of the map: its light end vanishes on white, its dark end hides text.
    shade = 0.45 if chunks == 1 else 0.3 + 0.4 * chunk / (chunks - 1)
    return colormaps[_COLOURMAP[kind]](shade)


def plot_gantt(timeline: dict[str, Any], path: Path, step: int | None = None) -> None:
    """Draw one step as a Gantt chart and save it to ``path`` (PNG).

    One row per pipeline rank, rank 0 on top; x axis in milliseconds from the step's start.
    Forwards are blue, backwards orange and split-off weight gradients (zero-bubble schedules)
    green, a darker shade for each later virtual chunk; the micro-batch number is written in each
    box wide enough for it.

    Args:
        step: the training step to show; None means the last one recorded.

    Raises:
        ValueError: ``step`` was not recorded, or no step was.
    """
    # The Agg canvas is used directly rather than through pyplot, so no global backend is
    # switched and no figure is left registered for the caller to close.
    from matplotlib.figure import Figure

    record = _select_step(timeline, step)
    pp, chunks = timeline["pp"], timeline["virtual_stages"]
    fig = Figure(figsize=(12, 1.2 + 0.6 * pp), dpi=120)
    ax = fig.add_subplot()
    boxes = [(rank["pp_rank"], e) for rank in record["ranks"] for e in rank["events"]]
    for row, e in boxes:
        start_ms, width_ms = e["start"] * _MS_PER_S, (e["end"] - e["start"]) * _MS_PER_S
        colour = _colour(e["kind"], e["stage"] // pp, chunks)
        ax.barh(row, width_ms, left=start_ms, height=0.8, color=colour, edgecolor="white", linewidth=0.5)
    end_ms = max((e["end"] for _, e in boxes), default=0.0) * _MS_PER_S
    ax.set_xlim(0, end_ms or 1.0)
    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(pp), [f"pp rank {r}" for r in range(pp)])
    ax.set_xlabel("time in step (ms)")
    ax.set_title(_gantt_title(timeline, record), fontsize=10)
    _add_legend(ax, chunks, {e["kind"] for _, e in boxes})
    fig.tight_layout()
    _label_boxes(ax, boxes)
    fig.savefig(path, format="png")


def _add_legend(ax: Any, chunks: int, kinds: set[str]) -> None:
    from matplotlib.patches import Patch

    handles = []
    for kind, name in _CATEGORY.items():
        if kind not in kinds:
            continue
        for chunk in range(chunks):
            label = name if chunks == 1 else f"{name}, chunk {chunk}"
            handles.append(Patch(color=_colour(kind, chunk, chunks), label=label))
    # Outside the axes, right of the last rank's boxes, so it never covers an action.
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _gantt_title(timeline: dict[str, Any], record: dict[str, Any]) -> str:
    setup = (
        f"{timeline['schedule']}  pp={timeline['pp']} v={timeline['virtual_stages']} "
        f"m={timeline['micro_batches']}  step {record['step']}"
    )
    bubble = f"bubble {_percent(record.get('bubble_fraction'))} measured, "
    return f"{_emulated_prefix(timeline)}{setup}\n{bubble}{_percent(record.get('theoretical_bubble'))} theoretical"


def _label_boxes(ax: Any, boxes: list[tuple[int, dict[str, Any]]]) -> None:
    """Write the micro-batch number in each box whose on-screen width holds it.

    Runs after the layout is final, since the widths in pixels depend on it.
    """
    px_per_pt = ax.figure.dpi / 72
    for row, e in boxes:
        text = str(e["micro_batch"])
        (x0, _), (x1, _) = ax.transData.transform([(e["start"] * _MS_PER_S, row), (e["end"] * _MS_PER_S, row)])
        # A digit is about 0.6 em wide; leave a little room either side.
        if x1 - x0 >= (len(text) * 0.6 * _LABEL_FONT_PT + 4) * px_per_pt:
            mid_ms = (e["start"] + e["end"]) / 2 * _MS_PER_S
            ax.text(mid_ms, row, text, ha="center", va="center", fontsize=_LABEL_FONT_PT)


def write_report(run_dir: Path, step: int | None = None) -> dict[str, Path]:
    """Write ``<run_dir>/trace.json`` and ``<run_dir>/timeline.png`` for one step.

    Args:
        step: the training step to show; None means the last one recorded.

    Returns:
        ``{"trace": <trace.json path>, "gantt": <timeline.png path>}``.

    Raises:
        FileNotFoundError: as :func:`load_timeline`.
        ValueError: as :func:`load_timeline`, or ``step`` was not recorded.
    """
    run_dir = Path(run_dir)
    timeline = load_timeline(run_dir)
    trace = chrome_trace(timeline, step)  # checks the step before any file is written
    paths = {"trace": run_dir / TRACE_FILE, "gantt": run_dir / GANTT_FILE}
    paths["trace"].write_text(json.dumps(trace))
    plot_gantt(timeline, paths["gantt"], step)
    return paths
