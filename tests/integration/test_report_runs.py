"""Console output without a terminal and `loomtrain report`, on two real runs: a 1-process run of a reduced
Llama 3 8B preset (text log, a subprocess) and a pipelined 2-process run (JSON log). Each test names the bug it
would catch."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loomtrain.cli import main
from loomtrain.config import load_config
from loomtrain.data import load_tokenizer
from loomtrain.distributed.spawn import spawn
from loomtrain.models.presets import param_count
from loomtrain.run_report import draw_runs, load_run
from tests.integration.test_train import TINY, run_train

# Steps 1 (always), 2 and 4 (log_interval), 3 and 6 (evaluations; 6 is the last) are logged.
STEPS, LOGGED = 6, [1, 2, 3, 4, 6]
COMMON = [a for a in TINY if not a.startswith("--metrics.progress_bar")] + [
    f"--training.steps={STEPS}", "--training.log_interval=2", "--training.eval_interval=3",
    "--checkpoint.enabled=false", "--metrics.tensorboard=false",
]  # fmt: skip
# Llama 3 8B's shape at 2 layers and width 64: 16 query heads over the preset's 8 key/value heads.
PRESET = ["--model.preset=llama3-8b", "--model.dim=64", "--model.n_heads=16", "--model.vocab_size=0"]
PIPELINE = ["--parallel.pipeline_parallel_degree=2", "--log.format=json"]


def _start(out: Path, name: str, extra: list[str]) -> subprocess.Popen:
    """`loomtrain train` with stdout and stderr on pipes: no terminal, as under nohup, CI or SLURM."""
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", *COMMON, f"--run.out_dir={out}", f"--run.name={name}",
           *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=env, cwd=out)  # fmt: skip


def train_capturing_stdout(stdout_path: str, overrides: list[str]) -> dict:
    """One rank of a spawned run, its console output (rank 0's) written to ``stdout_path``."""
    import torch.distributed as dist

    with open(f"{stdout_path}.{dist.get_rank()}", "w") as f, contextlib.redirect_stdout(f):
        return run_train(overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str, str]]:
    """name → (run directory, stdout, stderr) of the two runs, trained at the same time: the preset run as a
    subprocess, the pipelined one on 2 spawned processes (stderr not kept)."""
    out = tmp_path_factory.mktemp("runs")
    proc = _start(out, "preset", PRESET)
    overrides = [*COMMON, *PIPELINE, f"--run.out_dir={out}", "--run.name=pipeline"]
    spawn(train_capturing_stdout, 2, str(out / "pipeline.stdout"), overrides, timeout_s=240)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    return {
        "preset": (out / "preset", stdout, stderr),
        "pipeline": (out / "pipeline", (out / "pipeline.stdout.0").read_text(), ""),
    }


def _logged_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_no_terminal_prints_one_plain_line_per_logged_step(runs):
    """Catches: the tqdm bar drawn into a log file (carriage returns making one enormous line), or plain lines
    missing, repeated or printed for steps that were not logged."""
    run_dir, stdout, stderr = runs["preset"]
    assert "\r" not in stdout + stderr
    lines = [line for line in stdout.splitlines() if re.match(r"step \d+/\d+ \|", line)]
    assert [int(re.match(r"step (\d+)/6 ", line)[1]) for line in lines] == LOGGED
    records = _logged_steps(run_dir)
    assert [r["step"] for r in records] == LOGGED
    assert all(f"loss {r['loss']:.4f}" in line and "tok/s" in line and "MFU" in line and "ETA" in line
               for r, line in zip(records, lines, strict=True))  # fmt: skip


def test_json_format_prints_one_parsable_object_per_logged_step(runs):
    """Catches: JSON lines mixed with text on stdout (the announcement or the evaluation lines), records missing,
    or console values that differ from metrics.jsonl."""
    run_dir, stdout, _ = runs["pipeline"]
    objects = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert objects[-1]["event"] == "done" and objects[-1]["final_step"] == STEPS
    objects = objects[:-1]
    assert [o["step"] for o in objects] == LOGGED
    for obj, record in zip(objects, _logged_steps(run_dir), strict=True):
        assert obj["loss"] == record["loss"] and obj["total_steps"] == STEPS and "eta_s" in obj
    assert "\r" not in stdout


def test_preset_trains_at_reduced_depth_and_width(runs):
    """Catches: `train` ignoring model.preset (the default model trained instead), or the preset overriding the
    reduced size it was given."""
    run_dir = runs["preset"][0]
    model = load_config(run_dir / "config.toml").model
    assert (model.preset, model.n_layers, model.dim, model.n_heads, model.kv_heads) == ("llama3-8b", 2, 64, 16, 8)
    assert (model.hidden_dim, model.rope_theta) == (224, 500000.0)
    model.vocab_size = load_tokenizer(run_dir / "tokenizer").vocab_size
    assert json.loads((run_dir / "summary.json").read_text())["n_params"] == param_count(model)


def _embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def _check_self_contained(page: str) -> None:
    assert "<script" not in page and "href=" not in page and "<link" not in page
    assert len(re.findall(r'src="', page)) == len(_embedded_pngs(page))  # every image inline


def test_report_of_a_finished_run(runs, capsys):
    """Catches: report files not written, a figure saved empty, a page that loads external assets or whose
    embedded image is not the figure, and a summary table missing the run's figures."""
    run_dir = runs["preset"][0]
    assert main(["report", str(run_dir)]) == 0
    assert f"page: {run_dir / 'report.html'}" in capsys.readouterr().out
    png = (run_dir / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    page = (run_dir / "report.html").read_text()
    _check_self_contained(page)
    assert _embedded_pngs(page) == [png]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"<td>final_step</td><td>{summary['final_step']}</td>" in page
    assert f"<td>mfu</td><td>{summary['mfu']:.2%}</td>" in page


def test_report_of_a_pipelined_run_keeps_its_timeline(runs, capsys):
    """Catches: the pipeline timeline (trace.json, timeline.png, bubble line) lost when a run also has curves, or
    left out of the page."""
    run_dir = runs["pipeline"][0]
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "measured" in out
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    page = (run_dir / "report.html").read_text()
    _check_self_contained(page)
    assert _embedded_pngs(page) == [(run_dir / "report.png").read_bytes(), (run_dir / "timeline.png").read_bytes()]
    assert "Pipeline timeline: pipeline" in page


def test_report_of_two_runs_draws_both_on_one_figure(runs, tmp_path):
    """Catches: only the first run drawn, curves swapped between runs, the wall-time axis dropped, or the
    comparison page lacking a column per run and the config fields in which they differ."""
    dirs = [runs["preset"][0], runs["pipeline"][0]]
    assert main(["report", *map(str, dirs), "--out", str(tmp_path / "cmp")]) == 0
    page = (tmp_path / "cmp" / "report.html").read_text()
    assert "<th>summary.json</th><th>preset</th><th>pipeline</th>" in page
    assert "<td>parallel.pipeline_parallel_degree</td><td>1</td><td>2</td>" in page
    assert (tmp_path / "cmp" / "report.png").read_bytes().startswith(b"\x89PNG")
    loss, loss_time = draw_runs([load_run(d, d.name) for d in dirs]).axes[:2]
    for axes in (loss, loss_time):
        train_lines = axes.get_lines()[0::2]  # each run draws its training loss, then its validation loss
        for line, run_dir in zip(train_lines, dirs, strict=True):
            assert list(line.get_ydata()) == [r["loss"] for r in _logged_steps(run_dir)]
    assert [line.get_label() for line in loss.get_lines()[0::2]] == ["preset", "pipeline"]
