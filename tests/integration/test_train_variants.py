"""Trainer paths beyond the default: your own files with a BPE tokenizer under bf16 autocast,
and (where a GPU exists) CUDA with NCCL."""

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


def test_fp16_loss_scale_survives_a_resume(tmp_path):
    """Catches: a resumed fp16 run restarting at the initial loss scale (it would overflow and
    skip steps again that the uninterrupted run no longer skips)."""
    import torch.distributed.checkpoint as dcp

    common = [*TINY, f"--run.out_dir={tmp_path}", "--data_parallel.zero_stage=2", "--data_parallel.param_dtype=fp16",
              "--data_parallel.loss_scale_init=1e30", "--checkpoint.interval=1000"]  # fmt: skip
    first = spawn(run_train, 2, [*common, "--training.steps=6"], timeout_s=180)[0]
    assert first["loss_scale"] < 1e30
    state = {"train": ""}
    dcp.load(state, checkpoint_id=tmp_path / "shakespeare_char" / "checkpoints" / "step_00000006")
    assert json.loads(state["train"])["extra"]["loss_scaler"]["scale"] == first["loss_scale"]
    again = spawn(run_train, 2, [*common, "--training.steps=6", "--checkpoint.resume=auto"], timeout_s=180)[0]
    assert again["loss_scale"] == first["loss_scale"]
