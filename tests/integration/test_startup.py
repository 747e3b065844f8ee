"""Start-up work done once: a resumed start reads each checkpoint file's checksum once, on
rank 0, and every rank gets the same verdict."""

from __future__ import annotations

from unittest import mock

import pytest

from loomtrain import checkpoint
from loomtrain.config import ConfigError
from loomtrain.distributed.spawn import spawn
from tests.integration.test_train import TINY, run_train


def hashed_resume(overrides: list[str]) -> tuple[list[str], dict]:
    """Resume ``overrides``' run; the files this rank hashed and the summary."""
    hashed: list[str] = []
    real = checkpoint._sha256

    def counting(path):
        hashed.append(f"{path.parent.name}/{path.name}")
        return real(path)

    with mock.patch.object(checkpoint, "_sha256", counting):
        summary = run_train([*overrides, "--checkpoint.resume=auto", "--training.steps=7"])
    return hashed, summary


# Slow (make test-all, 16 s: two 2-process runs): a start-up cost, not a correctness property;
# the bad-checkpoint test below covers rank 0 resolving for every rank.
@pytest.mark.slow
def test_a_resumed_start_hashes_each_checkpoint_file_once_on_rank_0(tmp_path):
    """Catches: checkpoint files hashed by every rank and again by rank 0's resolve (N + 2
    reads of every byte per start), and ranks resolving different checkpoints."""
    overrides = [*TINY, f"--run.out_dir={tmp_path}", "--run.name=resume", "--training.steps=5"]
    spawn(run_train, 2, overrides, timeout_s=180)
    files = sorted(f.name for f in (tmp_path / "resume" / "checkpoints" / "step_00000005").iterdir())
    (rank0, summary), (rank1, _) = spawn(hashed_resume, 2, overrides, timeout_s=180)
    # Writing the manifest of the run's own new checkpoint (step 7) hashes its files too: not a check.
    read = sorted(name for name in rank0 if name.startswith("step_00000005/"))
    assert read == [f"step_00000005/{f}" for f in files if f != "manifest.json"]
    assert not [name for name in rank1 if name.startswith("step_00000005/")]
    assert summary["start_step"] == 5 and summary["final_step"] == 7


def resume_from(overrides: list[str], path: str) -> str:
    try:
        run_train([*overrides, f"--checkpoint.resume={path}"])
    except ConfigError as err:
        return str(err)
    return "no error"


def test_a_bad_checkpoint_found_on_rank_0_stops_every_rank_with_its_message(tmp_path):
    """Catches: rank 0 refusing a damaged checkpoint while the other ranks wait for it in a
    collective (a hang until the timeout), or ranks that report different errors."""
    overrides = [*TINY, f"--run.out_dir={tmp_path}", "--run.name=bad", "--training.steps=5"]
    spawn(run_train, 2, overrides, timeout_s=180)
    step = tmp_path / "bad" / "checkpoints" / "step_00000005"
    data = next(f for f in step.iterdir() if f.suffix == ".distcp")
    damaged = bytearray(data.read_bytes())
    damaged[-1] ^= 0xFF  # same size: only the checksum can tell
    data.write_bytes(bytes(damaged))
    errors = spawn(resume_from, 2, [*overrides, "--training.steps=7"], str(step), timeout_s=180)
    assert errors[0] == errors[1]
    assert "checkpoint.resume=" in errors[0] and "SHA-256" in errors[0]
