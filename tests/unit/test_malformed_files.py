"""Malformed files given to ``loomtrain train`` (issue #23, item 5): one ``error:`` line naming
the file and the fix, exit status 2, nothing written; never a Python traceback.

Run in-process through ``cli.main`` (the same code path as the console script, minus the
interpreter start-up): every case is refused before any process group or run directory exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loomtrain import cli
from loomtrain.config import load_config

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char.toml")
BINARY = bytes(range(256)) * 4


def train(tmp_path: Path, capsys, *args: str) -> str:
    """Run ``loomtrain train`` with ``args``; return its one stderr line after checking exit 2."""
    code = cli.main(["train", f"--run.out_dir={tmp_path}/runs", *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def resumable_run(tmp_path: Path, config_text: bytes) -> Path:
    """A run directory with one checkpoint and ``config_text`` as its saved config.toml."""
    run = tmp_path / "runs" / "shakespeare_char"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "manifest.json").write_text('{"step": 10, "world_size": 1, "files": {}}')
    (run / "config.toml").write_bytes(config_text)
    return run


SAVED = {
    "invalid_toml": (b"[model\nn_layers = 4\n", "not valid TOML"),
    "binary": (BINARY, "not UTF-8 text"),
    "wrong_shape": (b"model = 3\n", "'model' is not a [section] table"),
}


@pytest.mark.parametrize("case", sorted(SAVED))
def test_damaged_saved_config_is_refused_on_resume(tmp_path, capsys, case):
    """Catches: a run directory's config.toml that is invalid TOML, binary or of the wrong shape
    ending in ``TOMLDecodeError`` / ``UnicodeDecodeError`` / ``AttributeError`` tracebacks on
    ``--resume auto``, or the run's files being touched."""
    text, needle = SAVED[case]
    run = resumable_run(tmp_path, text)
    before = sorted(str(p) for p in run.rglob("*"))
    line = train(tmp_path, capsys, "--config", CONFIG, "--resume", "auto")
    assert "config.toml" in line and needle in line and "--overwrite" in line, line
    assert sorted(str(p) for p in run.rglob("*")) == before
    assert (run / "config.toml").read_bytes() == text


def test_binary_config_file_is_refused(tmp_path, capsys):
    """Catches: a binary ``--config`` ending in a ``UnicodeDecodeError`` traceback."""
    (tmp_path / "model.bin").write_bytes(BINARY)
    line = train(tmp_path, capsys, "--config", str(tmp_path / "model.bin"))
    assert "model.bin" in line and "not UTF-8 text" in line and "configs/" in line, line
    assert not (tmp_path / "runs").exists()


def test_directory_as_config_is_refused_as_a_directory(tmp_path, capsys):
    """Catches: a directory given as ``--config`` reported as "does not exist", which sends the
    user looking for a typo in a path that is there."""
    line = train(tmp_path, capsys, "--config", str(tmp_path))
    assert "is a directory" in line and "does not exist" not in line, line


def test_directory_as_data_path_is_refused_as_a_directory(tmp_path, capsys):
    """Catches: a directory in ``data.paths`` reported as "does not exist" instead of telling the
    user to list the files inside it."""
    (tmp_path / "corpus").mkdir()
    line = train(tmp_path, capsys, "--config", CONFIG, "--data.dataset=files", f"--data.paths=['{tmp_path}/corpus']")
    assert "data.paths" in line and "is a directory" in line and "list the files" in line, line
    assert not (tmp_path / "runs").exists()


def test_a_valid_config_still_loads():
    """Catches: the stricter reader refusing the shipped config (every section a table)."""
    assert load_config(CONFIG).model.n_layers >= 1
