"""Pipeline timeline report (trace.json, timeline.png, `loomtrain report`): each test names the bug it would catch."""

from __future__ import annotations

import json

import pytest

from loomtrain.cli import main
from loomtrain.report import bubble_summary, chrome_trace, load_timeline, plot_gantt, write_report

F_S, B_S = 0.001, 0.002  # forward and backward durations, seconds

# 1F1B, pp=2, m=4: rank 0 warms up with one forward, rank 1 (the last stage) with none.
ORDER_1F1B = {
    0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
    1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
}


def _events(actions: list[tuple[str, int, int]], start: float) -> list[dict]:
    """Lay actions (kind, stage, micro_batch) end to end from `start` seconds."""
    events, t = [], start
    for kind, stage, mb in actions:
        end = t + (F_S if kind == "F" else B_S)
        events.append({"kind": kind, "stage": stage, "micro_batch": mb, "start": t, "end": end})
        t = end
    return events


def _step(step: int, per_rank: dict[int, list[tuple[str, int, int]]], bubble: float, theory: float) -> dict:
    ranks = [
        {"pp_rank": r, "global_rank": 2 * r, "events": _events(actions, start=r * F_S)}
        for r, actions in per_rank.items()
    ]
    return {"step": step, "bubble_fraction": bubble, "theoretical_bubble": theory, "ranks": ranks}


def _timeline(schedule: str, pp: int, v: int, m: int, steps: list[dict]) -> dict:
    return {
        "format": "loomtrain-timeline-1",
        "schedule": schedule,
        "pp": pp,
        "virtual_stages": v,
        "micro_batches": m,
        "steps": steps,
    }


def one_f_one_b(steps: tuple[int, ...] = (5,)) -> dict:
    per_rank = {r: [(a[0], r, int(a[1:])) for a in order] for r, order in ORDER_1F1B.items()}
    return _timeline("1f1b", 2, 1, 4, [_step(s, per_rank, 0.21, 0.2) for s in steps])


def interleaved() -> dict:
    """pp=2, v=2, m=4: rank r holds stages r and r + 2; forwards by chunk, backwards in reverse."""
    per_rank = {
        r: [("F", c * 2 + r, mb) for c in (0, 1) for mb in range(4)]
        + [("B", c * 2 + r, mb) for c in (1, 0) for mb in range(4)]
        for r in (0, 1)
    }
    return _timeline("interleaved_1f1b", 2, 2, 4, [_step(3, per_rank, 0.15, 1 / 9)])


def zero_bubble() -> dict:
    """pp=2, m=2 under zb_h1: backwards split into input-gradient B and weight-gradient W."""
    per_rank = {
        0: [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)],
        1: [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1), ("W", 1, 0), ("W", 1, 1)],
    }
    return _timeline("zb_h1", 2, 1, 2, [_step(1, per_rank, 0.1, 1 / 7)])


def _actions(timeline: dict, index: int = -1) -> list[tuple[int, dict]]:
    return [(r["pp_rank"], e) for r in timeline["steps"][index]["ranks"] for e in r["events"]]


def _write(run_dir, timeline: dict):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "timeline.json").write_text(json.dumps(timeline))
    return run_dir


@pytest.mark.parametrize("timeline", [one_f_one_b(), interleaved()], ids=["1f1b", "interleaved"])
def test_chrome_trace_has_one_event_per_action_plus_row_labels(timeline):
    """Catches dropped or duplicated actions (e.g. only one virtual chunk exported) and unlabelled rows."""
    events = chrome_trace(timeline)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    pp, v, m = timeline["pp"], timeline["virtual_stages"], timeline["micro_batches"]
    assert len(complete) == len(_actions(timeline)) == 2 * pp * v * m  # a forward and a backward per stage and mb
    assert len(events) == len(complete) + len(meta)
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {0: "pp rank 0", 1: "pp rank 1"}
    assert [e["name"] for e in meta if e["name"] == "process_name"] == ["process_name"]


@pytest.mark.parametrize("timeline", [one_f_one_b(), interleaved()], ids=["1f1b", "interleaved"])
def test_chrome_trace_times_are_microseconds_on_the_recorded_rank(timeline):
    """Catches seconds or milliseconds in ts/dur, dur written as an end time, and tid not being the pp rank."""
    complete = [e for e in chrome_trace(timeline)["traceEvents"] if e["ph"] == "X"]
    for (rank, action), event in zip(_actions(timeline), complete, strict=True):
        assert event["ts"] == pytest.approx(action["start"] * 1e6)
        assert event["dur"] == pytest.approx((action["end"] - action["start"]) * 1e6)
        assert event["pid"] == 0
        assert event["tid"] == rank == action["stage"] % timeline["pp"]
        assert event["name"] == f"{action['kind']} mb{action['micro_batch']} s{action['stage']}"
        assert event["cat"] == {"F": "forward", "B": "backward"}[action["kind"]]
        assert event["args"] == {"stage": action["stage"], "micro_batch": action["micro_batch"], "kind": action["kind"]}
    assert sorted({round(e["dur"]) for e in complete}) == [1000, 2000]  # F_S and B_S in microseconds


def test_step_selection_defaults_to_last_and_honours_explicit_step():
    """Catches `step=None` showing the first step, and an explicit step being ignored."""
    timeline = one_f_one_b(steps=(5, 10))
    timeline["steps"][0]["bubble_fraction"] = 0.5

    def process_name(step):
        return chrome_trace(timeline, step)["traceEvents"][0]["args"]["name"]

    assert process_name(None) == "loomtrain step 10"
    assert process_name(5) == "loomtrain step 5"
    assert bubble_summary(timeline) == "step 10: bubble 21.0% measured, 20.0% theoretical"
    assert bubble_summary(timeline, 5) == "step 5: bubble 50.0% measured, 20.0% theoretical"


def test_unknown_step_raises_listing_recorded_steps():
    """Catches an unknown step silently falling back to another one, or an error that hides which steps exist."""
    with pytest.raises(ValueError, match=r"step 7 .*recorded steps: 5, 10"):
        chrome_trace(one_f_one_b(steps=(5, 10)), step=7)


def test_load_timeline_explains_missing_and_foreign_files(tmp_path):
    """Catches a bare KeyError/JSONDecodeError reaching the user, and files of another format being read as ours."""
    with pytest.raises(FileNotFoundError, match="no timeline.json.*pipeline_parallel_degree > 1"):
        load_timeline(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_timeline(tmp_path / "missing")
    (tmp_path / "timeline.json").write_text("{not json")
    with pytest.raises(ValueError, match="timeline.json is not valid JSON"):
        load_timeline(tmp_path)
    _write(tmp_path, {**one_f_one_b(), "format": "loomtrain-timeline-0"})
    with pytest.raises(ValueError, match="format 'loomtrain-timeline-0'"):
        load_timeline(tmp_path)
    assert load_timeline(_write(tmp_path, one_f_one_b())) == one_f_one_b()


@pytest.mark.parametrize(
    "timeline", [one_f_one_b(), interleaved(), zero_bubble()], ids=["1f1b", "interleaved", "zb_h1"]
)
def test_write_report_writes_png_and_trace_json(tmp_path, timeline):
    """Catches an empty or non-PNG chart (e.g. saved before drawing, wrong format), a trace that is
    not JSON, and a zero-bubble timeline's weight-gradient actions (``W``) that the chart or the
    trace has no category for (a KeyError)."""
    paths = write_report(_write(tmp_path / "run", timeline))
    assert paths == {"trace": tmp_path / "run" / "trace.json", "gantt": tmp_path / "run" / "timeline.png"}
    png = paths["gantt"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    assert json.loads(paths["trace"].read_text()) == chrome_trace(timeline)


def test_unknown_step_writes_no_files(tmp_path):
    """Catches a failed report leaving a trace.json from the wrong step next to an older chart."""
    run = _write(tmp_path / "run", one_f_one_b())
    with pytest.raises(ValueError, match="recorded steps: 5"):
        write_report(run, step=6)
    assert sorted(p.name for p in run.iterdir()) == ["timeline.json"]


def test_plot_gantt_leaves_no_open_pyplot_figure(tmp_path):
    """Catches figures piling up in pyplot's registry (a memory leak when reports are drawn in a loop)."""
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plot_gantt(interleaved(), tmp_path / "g.png")
    assert plt.get_fignums() == before
    assert (tmp_path / "g.png").stat().st_size > 0


def test_cli_report_without_timeline_prints_one_error_and_exits_2(tmp_path, capsys):
    """Catches a traceback (instead of one `error:` line, status 2) for a run trained without pipeline parallelism."""
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "timeline.json" in err[0]
    assert main(["report", str(_write(tmp_path, one_f_one_b())), "--step", "9"]) == 2
    assert "recorded steps: 5" in capsys.readouterr().err


def test_cli_report_prints_paths_and_bubble(tmp_path, capsys):
    """Catches the subcommand not being registered, its --step being dropped, or output that omits the file paths."""
    run = _write(tmp_path / "run", one_f_one_b(steps=(5, 10)))
    assert main(["report", str(run), "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert str(run / "trace.json") in out and str(run / "timeline.png") in out
    assert "step 5: bubble 21.0% measured, 20.0% theoretical" in out
    assert json.loads((run / "trace.json").read_text())["traceEvents"][0]["args"]["name"] == "loomtrain step 5"
