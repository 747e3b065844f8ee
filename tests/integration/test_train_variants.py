"""Trainer paths beyond the default: your own files with a BPE tokenizer under bf16 autocast,
fp16 loss scaling across a resume, and (where a GPU exists) CUDA with NCCL."""

from __future__ import annotations

import json

import pytest
import torch

from loomtrain.distributed.spawn import spawn
from tests.integration.test_train import TINY, run_train


def test_own_jsonl_files_with_bpe_and_bf16_train_and_lower_the_loss(tmp_path):
    """Catches: the files path, BPE tokenizer or bf16 autocast breaking the loop, or a loss
    that does not move (the documents repeat, so a working model learns them quickly)."""
    doc = "To be, or not to be, that is the question. " * 40
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"body": doc}) for _ in range(40)))
    (tmp_path / "val.jsonl").write_text(json.dumps({"body": doc}))
    overrides = [
        *TINY, f"--run.out_dir={tmp_path}", "--run.name=bpe", "--training.steps=30", "--training.dtype=bf16",
        "--training.lr=1e-2", "--training.decay_steps=30",
        "--data.dataset=files", f'--data.paths=["{tmp_path}/train.jsonl"]',
        f'--data.val_paths=["{tmp_path}/val.jsonl"]',
        "--data.text_field=body", "--data.tokenizer=bpe", "--data.bpe_vocab_size=300", "--checkpoint.enabled=false",
    ]  # fmt: skip
    summary = spawn(run_train, 2, overrides, timeout_s=180)[0]
    records = [json.loads(x) for x in (tmp_path / "bpe" / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / "bpe" / "tokenizer" / "tokenizer.json").is_file()
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]
    assert summary["val_loss"] < records[0]["loss"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_cuda_nccl_bf16_single_gpu(tmp_path, monkeypatch, zero_stage):
    """Catches: CPU-only assumptions on the CUDA/NCCL path (device placement, peak FLOP/s table,
    ZeRO's sharded bf16 state)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    zero = [f"--data_parallel.zero_stage={zero_stage}"] + (["--data_parallel.param_dtype=bf16"] if zero_stage else [])
    overrides = [*TINY, f"--run.out_dir={tmp_path}", "--training.steps=10", "--training.dtype=bf16",
                 "--run.device=cuda", *zero]  # fmt: skip
    summary = run_train(overrides)
    import torch.distributed as dist

    assert dist.get_backend() == "nccl"
    dist.destroy_process_group()
    assert summary["final_step"] == 10 and 0 < summary["mfu"] < 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compile_equals_eager_and_profile_writes_a_memory_snapshot(tmp_path, monkeypatch):
    """Catches: ``training.compile`` broken on CUDA (inductor's GPU path: a failed compile, or
    compiled blocks that compute another loss: 5 steps within 1e-4 of eager, fp32), and
    ``profile.steps`` on CUDA without its memory snapshot or Perfetto trace."""
    import torch.distributed as dist

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    losses = {}
    for name, extra in (("eager", ["--profile.steps=2:3", "--profile.memory_snapshot=true"]),
                        ("compiled", ["--training.compile=true"])):  # fmt: skip
        run_train([*TINY, f"--run.out_dir={tmp_path}", f"--run.name={name}", "--training.steps=5",
                   "--run.device=cuda", "--checkpoint.enabled=false", *extra])  # fmt: skip
        dist.destroy_process_group()
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["eager"]) == 5
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-4, atol=0)
    assert (tmp_path / "eager" / "profile" / "rank_00000.json").is_file()
    assert (tmp_path / "eager" / "profile" / "memory_rank_00000.pickle").is_file()


def loss_scales(run_dir) -> dict[int, float]:
    """step → ``loss_scale`` logged for it (the scale after that step's update)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss_scale"] for r in records}


@pytest.mark.parametrize(
    "init, growth_interval, expected",
    [
        # 1e30 overflows fp16 at every one of these steps (it takes ~80 halvings to fit): halved each step.
        (1e30, 1000, lambda step: 1e30 * 0.5**step),
        # 1 never overflows: doubled after every 3rd good step in a row.
        # Slow (make test-all): keeps make test under its 20 minutes; backoff covers the resume path.
        pytest.param(1.0, 3, lambda step: 2.0 ** (step // 3), marks=pytest.mark.slow),
    ],
    ids=["backoff", "growth"],
)
def test_fp16_loss_scale_survives_a_resume(tmp_path, init, growth_interval, expected):
    """Catches: a resumed fp16 run restarting at the initial loss scale (it would overflow and
    skip steps again that the uninterrupted run no longer skips), or forgetting its count of
    good steps (it would grow the scale late). Steps 1-4 run, save and stop; the resumed run
    must continue the scale's history through step 8 as if it had never stopped: halving on
    every overflow from 1e30 / 16, or doubling at step 6, three good steps after step 3's
    growth (at step 7 if the count restarted at 0 on resume)."""
    common = [*TINY, f"--run.out_dir={tmp_path}", "--run.name=fp16", "--data_parallel.zero_stage=2",
              "--data_parallel.param_dtype=fp16", f"--data_parallel.loss_scale_init={init}",
              f"--data_parallel.loss_scale_growth_interval={growth_interval}",
              "--checkpoint.interval=1000"]  # fmt: skip
    spawn(run_train, 2, [*common, "--training.steps=4"], timeout_s=180)
    assert loss_scales(tmp_path / "fp16") == {step: expected(step) for step in range(1, 5)}
    again = spawn(run_train, 2, [*common, "--training.steps=8", "--checkpoint.resume=auto"], timeout_s=180)[0]
    assert again["start_step"] == 4
    assert loss_scales(tmp_path / "fp16") == {step: expected(step) for step in range(1, 9)}
    assert again["loss_scale"] == expected(8)
