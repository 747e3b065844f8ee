"""Bad input: one clear line naming the field, exit status 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from loomtrain import cli

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char.toml")


@dataclass
class Result:
    returncode: int
    stderr: str


def run_subprocess(tmp_path: Path, *args: str) -> Result:
    """``loomtrain train`` as its own interpreter: what a user's shell runs."""
    cmd = [sys.executable, "-m", "loomtrain.cli", "train", "--config", CONFIG, f"--run.out_dir={tmp_path}/runs", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return Result(done.returncode, done.stderr)


@pytest.fixture
def run_cli(tmp_path, capsys, monkeypatch):
    """``loomtrain train`` through ``cli.main`` in this process: the console script's code path
    without a 3 s interpreter and torch start-up per case (one case runs as a real subprocess
    in ``test_console_script_prints_one_error_line``). An uncaught exception fails the test,
    as a traceback would fail the subprocess check."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> Result:
        code = cli.main(["train", "--config", CONFIG, f"--run.out_dir={tmp_path}/runs", *args])
        return Result(code, capsys.readouterr().err)

    return run


def check_rejected(result: Result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def empty_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    return str(tmp_path / "empty.txt")


CASES = {
    "unknown_key": (["--training.lrr=0.1"], ["training.lrr", "unknown config key"]),
    "wrong_type": (["--training.steps=many"], ["training.steps", "many"]),
    "batch_not_divisible": (["--nproc", "5"], ["training.global_batch_size=12", "micro_batch_size=6"]),
    "context_too_long": (["--training.seq_len=128"], ["training.seq_len=128", "model.max_seq_len=64"]),
    "missing_file": (["--data.dataset=files", '--data.paths=["nope.txt"]'], ["data.paths", "nope.txt"]),
    "nproc_zero": (["--nproc", "0"], ["--nproc=0"]),
    "unknown_val_play": (['--data.val_plays=["hamlett"]'], ["data.val_plays", "hamlett"]),
    "bad_override_syntax": (["--training.lr"], ["--training.lr"]),
    "run_name_escapes_out_dir": (["--run.name=..", "--overwrite"], ["run.name", "one path component"]),
    "resume_and_overwrite": (["--resume", "auto", "--overwrite"], ["--overwrite and --resume"]),
    "nccl_without_gpu": (["--distributed.backend=nccl"], ["distributed.backend='nccl'", "gloo"]),
    "lr_schedule_rises": (["--training.min_lr=0.01"], ["training.min_lr=0.01", "training.lr=0.001"]),
    "explicit_resume_not_a_checkpoint": (["--resume", "."], ["checkpoint.resume='.'", "no manifest"]),
    "heads_not_divisible_by_tp": (["--parallel.tensor_parallel_degree=3"], ["model.n_heads=4", "degree=3"]),
    "seq_not_divisible_by_sp": (
        ["--parallel.sequence_parallel_degree=3", "--training.seq_len=32"],
        ["training.seq_len=32", "parallel.sequence_parallel_degree=3"],
    ),
    "interleaved_micro_batches_not_multiple_of_pp": (
        [
            "--nproc",
            "2",
            "--parallel.pipeline_parallel_degree=2",
            "--parallel.pipeline_schedule=interleaved_1f1b",
            "--parallel.virtual_stages=2",
            "--training.micro_batch_size=4",
        ],
        ["micro-batches per step (3", "pipeline_parallel_degree=2"],
    ),
    "fewer_layers_than_stages": (
        ["--parallel.pipeline_parallel_degree=8"],
        ["model.n_layers=4", "8 stages"],
    ),
    "tied_embedding_across_stages": (
        ["--parallel.pipeline_parallel_degree=2", "--model.tie_embeddings=true"],
        ["model.tie_embeddings", "pipeline_parallel_degree"],
    ),
    "replicas_without_zero": (
        ["--nproc", "4", "--training.micro_batch_size=3", "--parallel.data_parallel_replicate_degree=2"],
        ["parallel.data_parallel_replicate_degree=2", "zero_stage >= 1"],
    ),
    "world_not_divisible_by_tp": (
        ["--nproc", "3", "--parallel.tensor_parallel_degree=2"],
        ["world size 3", "tensor_parallel_degree=2"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_rejected_before_anything_is_written(tmp_path, case, run_cli):
    """Catches: a bad value that starts workers, writes a run directory or ends in a traceback
    instead of one ``error:`` line naming the field (each case in ``CASES``)."""
    args, needles = CASES[case]
    result = run_cli(*args)
    check_rejected(result, *needles)
    assert not (tmp_path / "runs").exists()


def test_empty_data_file_is_rejected(tmp_path, empty_file, run_cli):
    """Catches: an empty corpus file accepted, failing later inside a worker with a shape error."""
    result = run_cli("--data.dataset=files", f'--data.paths=["{empty_file}"]')
    check_rejected(result, "data.paths", "empty")
    assert not (tmp_path / "runs").exists()


def test_existing_checkpoints_are_not_overwritten_without_resume_or_overwrite(tmp_path, run_cli):
    """Catches: a fresh start in a run directory that holds checkpoints, which would mix two runs
    and let retention delete the earlier run's checkpoints."""
    ckpt = tmp_path / "runs" / "shakespeare_char" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"step": 10, "world_size": 1, "files": {}}')
    result = run_cli()
    check_rejected(result, "--resume auto", "--overwrite")
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json"]


def test_non_utf8_data_file_is_rejected(tmp_path, run_cli):
    """Catches: a Latin-1 file ending in a ``UnicodeDecodeError`` traceback instead of a clear error."""
    (tmp_path / "latin1.txt").write_bytes("café ".encode("latin-1") * 100)
    result = run_cli("--data.dataset=files", f'--data.paths=["{tmp_path}/latin1.txt"]')
    check_rejected(result, "data.paths", "not UTF-8")


def fake_run(tmp_path: Path) -> Path:
    """A run directory as a finished default run leaves it: config and one complete checkpoint."""
    from loomtrain.config import load_config

    run = tmp_path / "runs" / "shakespeare_char"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "manifest.json").write_text('{"step": 10, "world_size": 2, "files": {}}')
    (run / "config.toml").write_text(load_config(CONFIG).to_toml())
    return run


def test_resume_with_another_model_shape_is_refused(tmp_path, run_cli):
    """Catches: DCP silently loading a subset of keys into a differently shaped model."""
    run = fake_run(tmp_path)
    before = (run / "config.toml").read_text()
    check_rejected(run_cli("--resume", "auto", "--model.n_layers=2"), "model.n_layers=2", "4")
    assert (run / "config.toml").read_text() == before


def test_damaged_checkpoint_named_by_resume_is_refused_before_workers_start(tmp_path, run_cli):
    """Catches: a named checkpoint whose size is right but whose bytes are not passing the
    launcher's checks, so workers start and the refusal ends in a torchrun traceback (exit 1)
    instead of one error line."""
    step = fake_run(tmp_path) / "checkpoints" / "step_00000010"
    (step / "__0_0.distcp").write_bytes(b"x" * 64)
    digest = hashlib.sha256(b"y" * 64).hexdigest()  # the manifest describes other bytes of the same size
    (step / "manifest.json").write_text(
        json.dumps({"step": 10, "world_size": 2, "files": {"__0_0.distcp": {"bytes": 64, "sha256": digest}}})
    )
    check_rejected(run_cli("--nproc", "2", "--resume", str(step)), "checkpoint.resume=", "SHA-256")


def test_overwrite_refuses_a_directory_loomtrain_did_not_write(tmp_path, run_cli):
    """Catches: --overwrite deleting a user's unrelated directory."""
    precious = tmp_path / "runs" / "shakespeare_char" / "thesis.tex"
    precious.parent.mkdir(parents=True)
    precious.write_text("years of work")
    check_rejected(run_cli("--overwrite"), "not a loomtrain run", "not deleting")
    assert precious.read_text() == "years of work"


def test_overwrite_accepts_a_run_whose_workers_left_only_launcher_logs(tmp_path):
    """Catches: --overwrite refusing a run directory that holds only the launcher's
    logs/agent_<i>.log (workers that failed before writing config.toml), or deleting one in
    which anything else lies beside those logs."""
    from loomtrain.config import ConfigError, load_config
    from loomtrain.preflight import check_run_dir

    cfg = load_config(CONFIG, [f"--run.out_dir={tmp_path}", "--run.overwrite=true"])
    (cfg.run_dir / "logs").mkdir(parents=True)
    (cfg.run_dir / "logs" / "agent_0.log").write_text("worker failed")
    assert check_run_dir(cfg) is None
    (cfg.run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a loomtrain run"):
        check_run_dir(cfg)


def test_saved_config_holds_no_per_launch_choices(tmp_path):
    """Catches: a config.toml fed back with --config deleting or redirecting the run."""
    from loomtrain.config import load_config

    text = load_config(CONFIG, ["--run.overwrite=true", "--checkpoint.resume=auto"]).to_toml()
    assert "overwrite" not in text and "resume" not in text


def test_console_script_prints_one_error_line(tmp_path):
    """Catches: an error path that works when called in-process but prints a traceback or
    exits with another status from the real console entry point (``python -m loomtrain.cli``)."""
    check_rejected(run_subprocess(tmp_path, "--training.lrr=0.1"), "training.lrr", "unknown config key")
    assert not (tmp_path / "runs").exists()


def test_run_whose_every_checkpoint_is_damaged_is_not_restarted_from_scratch(tmp_path, run_cli):
    """Catches (issue #23, item 3): ``--resume auto`` on a run whose every checkpoint is damaged
    warning, starting from step 0 and exiting 0, after which retention deleted the damaged
    checkpoints and the logs were truncated: the run's history lost without being asked."""
    run = fake_run(tmp_path)
    step = run / "checkpoints" / "step_00000010"
    (step / "__0_0.distcp").write_bytes(b"x" * 64)
    digest = hashlib.sha256(b"y" * 64).hexdigest()
    (step / "manifest.json").write_text(
        json.dumps({"step": 10, "world_size": 2, "files": {"__0_0.distcp": {"bytes": 64, "sha256": digest}}})
    )
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 2.0}\n')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    check_rejected(run_cli("--resume", "auto"), "every checkpoint", "step_00000010", "--overwrite")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_fresh_start_does_not_truncate_a_previous_runs_metrics(tmp_path, run_cli):
    """Catches (issue #23, item 3): a plain start in a run directory whose previous run ended
    before its first checkpoint truncating that run's ``metrics.jsonl``."""
    run = tmp_path / "runs" / "shakespeare_char"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 2.0}\n')
    check_rejected(run_cli(), "metrics.jsonl", "--overwrite")
    assert (run / "metrics.jsonl").read_text() == '{"step": 3, "loss": 2.0}\n'
