"""Run reports: ``loomtrain report runs/<a> [runs/<b> ...] [--out DIR]``.

Reads each run's ``metrics.jsonl`` (one record per logged step, see docs/metrics.md),
``summary.json`` (when the run finished), ``config.toml`` and ``events.jsonl``, and draws
every run on one figure, one colour per run:

- training loss (solid) and validation loss (dashed, dots) over steps and over wall time;
- tokens/s and MFU over steps;
- peak memory (bytes, the largest over ranks so far) and bytes sent per step and mesh axis.

Two files are written to the output directory: ``report.png`` (the figure) and
``report.html``, a self-contained page (the figure and each pipelined run's timeline embedded
as base64 PNG, no external assets) with a table of every run's ``summary.json`` figures and,
for several runs, the config fields in which they differ. The pipeline timeline itself
(``trace.json`` and ``timeline.png`` next to ``timeline.json``) is drawn by
:mod:`loomtrain.report`.
"""

from __future__ import annotations

import base64
import html
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loomtrain.report import TIMELINE_FILE, bubble_summary, load_timeline, write_report

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_PNG = "report.png"
REPORT_HTML = "report.html"
_MIB = 2**20
_COLOURS = "tab10"
# Line style per mesh axis in the bytes panel (colour stays the run's).
_AXIS_STYLES = {"dp": "-", "tp": "--", "sp": ":", "pp": "-.", "inter_host": (0, (1, 3))}
_TIME_UNITS = ((3600 * 3, 3600.0, "h"), (300, 60.0, "min"), (0, 1.0, "s"))


@dataclass
class RunRecords:
    """What one run directory recorded.

    Attributes:
        path: the run directory.
        label: its name in legends and table headers.
        records: ``metrics.jsonl``, one dict per logged step, in file order.
        summary: ``summary.json``, or None (the run has not finished, or was preempted).
        config: ``config.toml`` flattened to ``section.key`` → value ({} if absent).
        start_time: Unix seconds of the run's first start (``events.jsonl``), else of its
            first record; the origin of the wall-time axis.
    """

    path: Path
    label: str
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    start_time: float | None = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of ``path`` (a line still being written by a live run is skipped).

    Raises:
        ValueError: a complete line is not JSON.
    """
    lines = path.read_text().split("\n")[:-1]
    try:
        return [json.loads(line) for line in lines if line]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} holds a line that is not JSON ({e}); it was not written by loomtrain") from e


def load_run(run_dir: Path, label: str) -> RunRecords:
    """Read one run directory's records.

    Raises:
        FileNotFoundError: ``run_dir`` is not a directory or has no ``metrics.jsonl``.
        ValueError: ``metrics.jsonl`` or ``summary.json`` is not JSON.
    """
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}; give a run directory written by `loomtrain train`")
    run = RunRecords(run_dir, label, read_jsonl(run_dir / METRICS_FILE))
    if (run_dir / SUMMARY_FILE).is_file():
        try:
            run.summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{run_dir / SUMMARY_FILE} is not valid JSON ({e})") from e
    if (run_dir / "config.toml").is_file():
        run.config = flatten(tomllib.loads((run_dir / "config.toml").read_text()))
    starts = [e["time"] for e in _events(run_dir) if e.get("event") == "start"]
    times = [r["time"] for r in run.records if "time" in r]
    origins = starts or times
    run.start_time = min(origins) if origins else None
    return run


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return read_jsonl(path) if path.is_file() else []


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name, or its whole path where two runs share a name."""
    names = [Path(d).name for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs, strict=True)]


def _series(run: RunRecords, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) of the records holding ``key``; ``x`` is ``step`` or ``time`` (seconds since start)."""
    rows = [r for r in run.records if key in r and (x == "step" or ("time" in r and run.start_time is not None))]
    xs = [r["step"] if x == "step" else r["time"] - run.start_time for r in rows]
    return xs, [r[key] for r in rows]


def _time_unit(runs: list[RunRecords]) -> tuple[float, str]:
    """Seconds per unit and its name for the wall-time axis: s, min or h by the longest run."""
    longest = max((x for run in runs for x in _series(run, "loss", "time")[0]), default=0.0)
    return next((scale, name) for threshold, scale, name in _TIME_UNITS if longest >= threshold)


def _plot_loss(ax: Any, runs: list[RunRecords], colours: list[Any], x: str) -> None:
    """Training loss (solid) and validation loss (dashed, dots) of every run against ``x``."""
    scale, unit = _time_unit(runs) if x == "time" else (1.0, "")
    for run, colour in zip(runs, colours, strict=True):
        xs, ys = _series(run, "loss", x)
        ax.plot([v / scale for v in xs], ys, color=colour, linewidth=1.2, label=run.label)
        xs, ys = _series(run, "val_loss", x)
        ax.plot([v / scale for v in xs], ys, color=colour, linestyle="--", marker="o", markersize=3)
    if x == "step":
        _integer_steps(ax)
    ax.set_xlabel("step" if x == "step" else f"wall time since start ({unit})")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss: training solid, validation dashed" + ("" if x == "step" else ", over wall time"))
    if x == "step":
        ax.legend(fontsize=8)


def _plot_metric(ax: Any, runs: list[RunRecords], colours: list[Any], key: str, scale: float, ylabel: str) -> None:
    """``key`` / ``scale`` of every run over steps; a note in the panel when no run recorded it."""
    drawn = False
    for run, colour in zip(runs, colours, strict=True):
        xs, ys = _series(run, key)
        drawn |= bool(xs)
        ax.plot(xs, [v / scale for v in ys], color=colour, linewidth=1.2, marker="." if len(xs) < 30 else None)
    _finish_panel(ax, drawn, ylabel)


def _plot_bytes(ax: Any, runs: list[RunRecords], colours: list[Any]) -> None:
    """Bytes a rank sent per step (MiB), one line per run and mesh axis (``comm_bytes_<axis>``)."""
    from matplotlib.lines import Line2D

    drawn: set[str] = set()
    for run, colour in zip(runs, colours, strict=True):
        axes = sorted({k.removeprefix("comm_bytes_") for r in run.records for k in r if k.startswith("comm_bytes_")})
        for axis in axes:
            xs, ys = _series(run, f"comm_bytes_{axis}")
            ax.plot(xs, [v / _MIB for v in ys], color=colour, linestyle=_AXIS_STYLES.get(axis, "-"), linewidth=1.2)
        drawn.update(axes)
    if drawn:
        # The colour is the run's; the legend explains the line styles, one entry per axis.
        handles = [Line2D([], [], color="grey", linestyle=_AXIS_STYLES.get(a, "-"), label=a) for a in sorted(drawn)]
        ax.legend(handles=handles, fontsize=8, title="mesh axis", title_fontsize=8)
    _finish_panel(ax, bool(drawn), "MiB sent per step per rank")


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish_panel(ax: Any, drawn: bool, ylabel: str) -> None:
    _integer_steps(ax)
    ax.set_xlabel("step")
    ax.set_title(ylabel)
    ax.set_ylim(bottom=0)
    if not drawn:
        ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="grey")


def draw_runs(runs: list[RunRecords]) -> Any:
    """The runs' curves as a matplotlib ``Figure`` of six panels, one colour per run, in order:
    loss over steps, loss over wall time; tokens/s and MFU (%) over steps; peak memory (MiB,
    largest over ranks so far) and bytes sent per step and mesh axis (MiB) over steps. A key
    that no run recorded (a run from an older loomtrain) leaves its panel marked "not recorded".
    """
    # The Agg canvas directly, not pyplot: no global backend switched, no figure left open.
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    palette = colormaps[_COLOURS]
    colours = [palette(i % palette.N) for i in range(len(runs))]
    fig = Figure(figsize=(11, 10), dpi=90)
    (loss, loss_time), (speed, mfu), (memory, sent) = fig.subplots(3, 2)
    _plot_loss(loss, runs, colours, "step")
    _plot_loss(loss_time, runs, colours, "time")
    _plot_metric(speed, runs, colours, "tokens_per_s", 1.0, "tokens/s (whole job)")
    _plot_metric(mfu, runs, colours, "mfu", 0.01, "MFU (%)")
    _plot_metric(memory, runs, colours, "peak_memory_bytes", _MIB, "peak memory (MiB, max over ranks)")
    _plot_bytes(sent, runs, colours)
    fig.tight_layout()
    return fig


def plot_runs(runs: list[RunRecords], path: Path) -> None:
    """Save :func:`draw_runs`'s figure to ``path`` (PNG, 990 × 900 pixels)."""
    draw_runs(runs).savefig(path, format="png")


_STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1150px;color:#222}"
    "table{border-collapse:collapse;font-size:13px;margin-bottom:1.5em}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left;font-family:monospace}img{max-width:100%}"
)


def format_value(key: str, value: Any) -> str:
    """A ``summary.json`` or config value as the table shows it: bytes in MiB, MFU and fractions
    in %, seconds with ``s``, rates and counts with thousands separators, None as a dash."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value).lower() if isinstance(value, bool) else str(value)
    if "bytes" in key:
        return f"{value / _MIB:,.2f} MiB"
    if key == "mfu" or key.endswith("fraction"):
        return f"{value:.2%}"
    if key.endswith("per_s"):
        return f"{value:,.0f}"
    if key.endswith("_s"):
        return f"{value:,.1f} s"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def summary_table(runs: list[RunRecords]) -> str:
    """HTML table: one row per ``summary.json`` key (nested keys as ``a.b``), one column per run."""
    flat = [flatten(run.summary or {}) for run in runs]
    keys = list(dict.fromkeys(k for summary in flat for k in summary))
    if not keys:
        return "<p>No run has a summary.json yet (it is written when a run reaches training.steps).</p>"
    rows = [[key] + [format_value(key, s.get(key)) for s in flat] for key in keys]
    return _table(["summary.json"] + [run.label for run in runs], rows)


def config_table(runs: list[RunRecords]) -> str:
    """HTML table of the ``config.toml`` fields whose values differ between the runs."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config))
    differing = [k for k in keys if len({json.dumps(run.config.get(k)) for run in runs}) > 1]
    if not differing:
        return "<p>The runs' configs are identical.</p>"
    rows = [[key] + [format_value("", run.config.get(key)) for run in runs] for key in differing]
    return _table(["config.toml"] + [run.label for run in runs], rows)


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(runs: list[RunRecords], figure_png: bytes, timelines: dict[str, bytes]) -> str:
    """The self-contained report page: the figure, the summary table, the config differences
    (several runs) and each pipelined run's timeline (``label`` → PNG bytes), images inline."""
    names = ", ".join(run.label for run in runs)
    parts = [
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>loomtrain report: {html.escape(names)}</title>',
        f"<style>{_STYLE}</style></head><body><h1>loomtrain report</h1><ul>",
        *(f"<li>{html.escape(run.label)}: <code>{html.escape(str(run.path))}</code></li>" for run in runs),
        "</ul>", _image(figure_png, f"curves of {names}"), "<h2>Summary</h2>", summary_table(runs),
    ]  # fmt: skip
    if len(runs) > 1:
        parts += ["<h2>Config differences</h2>", config_table(runs)]
    for label, png in timelines.items():
        parts += [f"<h2>Pipeline timeline: {html.escape(label)}</h2>", _image(png, f"pipeline timeline of {label}")]
    return "\n".join(parts + ["</body></html>\n"])


@dataclass
class ReportFiles:
    """What :func:`write_reports` wrote.

    Attributes:
        figure: ``report.png``, or None when no run had ``metrics.jsonl``.
        page: ``report.html``, or None likewise.
        timelines: per pipelined run: (run directory, ``{"trace": ..., "gantt": ...}`` paths,
            the bubble line of :func:`loomtrain.report.bubble_summary`).
    """

    figure: Path | None = None
    page: Path | None = None
    timelines: list[tuple[Path, dict[str, Path], str]] = field(default_factory=list)


def _check_runs(run_dirs: list[Path], step: int | None) -> tuple[list[Path], dict[Path, str]]:
    """The runs with metrics, and the bubble line of each pipelined run; nothing written yet.

    Raises:
        FileNotFoundError: a path is not a directory, or holds neither file.
        ValueError: a broken timeline, or ``step`` not in a run's timeline.
    """
    with_metrics, bubbles = [], {}
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir} is not a directory; give a run directory, e.g. runs/<name>")
        has_metrics, has_timeline = (run_dir / METRICS_FILE).is_file(), (run_dir / TIMELINE_FILE).is_file()
        if not (has_metrics or has_timeline):
            raise FileNotFoundError(
                f"{run_dir} has neither {METRICS_FILE} (written by `loomtrain train`) nor {TIMELINE_FILE} (pipelined "
                "runs); give a run directory, e.g. runs/<name>"
            )
        if has_metrics:
            with_metrics.append(run_dir)
        if has_timeline:
            bubbles[run_dir] = bubble_summary(load_timeline(run_dir), step)
    return with_metrics, bubbles


def write_reports(run_dirs: list[Path], out_dir: Path | None = None, step: int | None = None) -> ReportFiles:
    """Write ``report.png`` and ``report.html`` for ``run_dirs`` into ``out_dir`` (default: the
    first run's directory, created if missing), and each pipelined run's ``trace.json`` and
    ``timeline.png`` into its own directory (``step``: the timeline step, default the last).

    Every input is read and checked before the first file is written.

    Raises:
        FileNotFoundError: a path is not a directory, or holds neither ``metrics.jsonl`` nor
            ``timeline.json``.
        ValueError: a file that is not loomtrain's JSON, or ``step`` not in a run's timeline.
    """
    run_dirs = [Path(d) for d in run_dirs]
    with_metrics, bubbles = _check_runs(run_dirs, step)
    labels = dict(zip(run_dirs, run_labels(run_dirs), strict=True))
    runs = [load_run(d, labels[d]) for d in with_metrics]
    files = ReportFiles()
    for run_dir, bubble in bubbles.items():
        files.timelines.append((run_dir, write_report(run_dir, step), bubble))
    if runs:
        out = Path(out_dir) if out_dir is not None else run_dirs[0]
        out.mkdir(parents=True, exist_ok=True)
        files.figure, files.page = out / REPORT_PNG, out / REPORT_HTML
        plot_runs(runs, files.figure)
        timelines = {labels[d]: paths["gantt"].read_bytes() for d, paths, _ in files.timelines}
        files.page.write_text(render_html(runs, files.figure.read_bytes(), timelines))
    return files
