"""Hugging Face round trip: a tiny random ``LlamaForCausalLM`` (GQA, non-default rotary base and
norm epsilon, vocabulary larger than the tokenizer's) → loomtrain under tp 2 × dp 2 (4 gloo
processes, 2 steps) → ``loomtrain export --to hf`` → ``transformers`` again.

Tolerances (fp32): the step-1 loss equals HF's own loss on the run's first global batch within
``1e-5`` relative; tp 2 splits each matmul's sum over two ranks and dp averages two half-batch
means, which moves the loss by ~1e-7 relative, whereas a wrong rotary convention, a swapped
projection or a lost norm epsilon moves it by ~1e-2 or more. Exported weights are copies,
compared exactly; logits of the exported model within ``1e-5`` absolute of loomtrain's (the two
implementations order their fp32 sums differently, ~5e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig

from loomtrain.checkpoint import find_latest_checkpoint, load_model_weights
from loomtrain.cli import main
from loomtrain.config import load_config
from loomtrain.data import load_corpus, load_tokenizer
from loomtrain.distributed.spawn import spawn
from loomtrain.interop.hf import hf_name, resolve_init_from
from loomtrain.models import Transformer
from loomtrain.trainer import train
from tests.integration.test_train import losses

LOSS_RTOL = 1e-5
LOGIT_ATOL = 1e-5
HF_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=64, max_position_embeddings=64, rope_theta=5e5, rms_norm_eps=1e-6,
                tie_word_embeddings=False)  # fmt: skip
RUN_ARGS = [
    "--training.seq_len=32", "--training.global_batch_size=8", "--training.micro_batch_size=2",
    "--training.steps=2", "--training.warmup_steps=0", "--training.log_interval=1", "--training.eval_interval=1000",
    "--training.eval_batches=1", "--sample.max_new_tokens=0", "--metrics.progress_bar=false",
    "--metrics.tensorboard=false", "--metrics.record_samples=true", "--checkpoint.interval=2",
    "--distributed.probe_topology=false", "--data.dataset=files",
]  # fmt: skip
TEXT = "".join(f"Line {i}: the quick brown fox jumps over {i % 7} lazy dogs; WHY? Because.\n" for i in range(120))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random HF Llama saved with ``save_pretrained``; weights scaled up from the 0.02 init so
    that a wrong mapping shows in the loss, not only in its last digits."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_dir) -> Path:
    """The HF model trained 2 steps by loomtrain on 4 processes, tp 2 × dp 2; as ``loomtrain
    train`` does, the config is resolved from the checkpoint before any process starts."""
    out = tmp_path_factory.mktemp("runs")
    corpus = out / "corpus.txt"
    corpus.write_text(TEXT)
    args = [*RUN_ARGS, f"--data.paths=['{corpus}']", f"--model.init_from=hf:{hf_dir}", f"--run.out_dir={out}",
            "--run.name=from_hf", "--parallel.tensor_parallel_degree=2"]  # fmt: skip
    # The trainer itself as the spawned function: the children then never import transformers.
    spawn(train, 4, resolve_init_from(load_config(None, args)), timeout_s=240)
    return out / "from_hf"


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    assert main(["export", "--run", str(run), "--to", "hf", "--out", str(out)]) == 0
    return out


def first_batch(run: Path) -> torch.Tensor:
    """The windows of ``seq_len + 1`` tokens that step 1 trained on, from the sample ids every
    rank recorded (a tp pair records the same ones): ``LongTensor[global_batch, seq_len + 1]``."""
    cfg = load_config(run / "config.toml")
    ids = set()
    for path in (run / "samples").glob("rank_*.jsonl"):
        record = json.loads(path.read_text().splitlines()[0])
        assert record["step"] == 1
        ids.update(i for micro in record["samples"] for i in micro)
    assert len(ids) == cfg.training.global_batch_size
    tokens = load_tokenizer(run / "tokenizer").encode_tensor(load_corpus(cfg.data)[0])
    s = cfg.training.seq_len
    return torch.stack([tokens[i * s : i * s + s + 1] for i in sorted(ids)])


def test_step1_loss_equals_hf_loss(run, hf_dir):
    """Catches: q/k rows permuted as for an interleaved rotary convention, grouped key/value
    heads mapped in the wrong order, gate and up projections swapped, the HF rotary base or
    norm epsilon not taken over, the embedding rows mapped at an offset, and HF weights loaded
    after tp sharding (so some rank keeps its random init)."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    batch = first_batch(run)
    with torch.no_grad():  # HF shifts the labels itself: position t predicts token t + 1
        want = hf(input_ids=batch, labels=batch).loss.item()
    assert losses(run)[1] == pytest.approx(want, rel=LOSS_RTOL)


def assert_same_weights(run: Path, exported: Path) -> dict[str, torch.Tensor]:
    """The exported weights, after checking that they are exactly the run's final checkpoint."""
    final = find_latest_checkpoint(run / "checkpoints")
    dcp_to_torch_save(final, exported.parent / "final.pt")
    ours = torch.load(exported.parent / "final.pt", weights_only=False)["model"]
    reloaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert set(reloaded) == {hf_name(k) for k in ours}
    for name, value in ours.items():
        assert reloaded[hf_name(name)].dtype == torch.float32
        assert torch.equal(reloaded[hf_name(name)], value), name
    return reloaded


def logit_diff(run: Path, exported: Path) -> float:
    """Max |logits| difference of the exported model in HF and the run's final checkpoint in
    loomtrain, over 4 random sequences of the model's full length."""
    cfg = load_config(run / "config.toml")
    cfg.model.vocab_size = cfg.model.vocab_size or load_tokenizer(run / "tokenizer").vocab_size
    ours = Transformer(cfg.model).eval()
    load_model_weights(find_latest_checkpoint(run / "checkpoints"), ours)
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.max_seq_len), generator=generator)
    with torch.no_grad():
        return (hf(tokens).logits - ours(tokens)).abs().max().item()


def test_export_reloads_with_identical_weights(run, exported, hf_dir):
    """Catches: a tensor renamed to the wrong HF name, a shard of a tp checkpoint exported in
    place of the whole tensor, the initial instead of the trained weights, and a config.json
    whose shapes or dtype make HF rebuild or cast a weight."""
    assert find_latest_checkpoint(run / "checkpoints").name == "step_00000002"
    reloaded = assert_same_weights(run, exported)
    initial = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    assert not torch.equal(reloaded["lm_head.weight"], initial["lm_head.weight"]), "training did not move the weights"


def test_exported_logits_equal_loomtrain(run, exported):
    """Catches: an exported config that HF reads differently (rotary base, epsilon, GQA heads,
    tying), so that the same weights compute other logits."""
    diff = logit_diff(run, exported)
    print(f"max |logits HF - loomtrain| = {diff:.2e}")
    assert diff <= LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["--data_parallel.zero_stage=3", "--model.tie_embeddings=true"], ["--parallel.pipeline_parallel_degree=2"]],
    ids=["zero3_tied", "pp2"],
)
def test_export_from_other_layouts(layout, tmp_path):
    """Catches: an export that reads only one rank's ZeRO-3 shards or one pipeline stage's
    layers, and a tied head that safetensors refuses (shared tensors) or HF does not re-tie.
    A loomtrain-initialised model (2 processes, 2 steps, the char tokenizer), not an HF one."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    args = [*RUN_ARGS, f"--data.paths=['{corpus}']", "--model.n_layers=2", "--model.dim=32", "--model.n_heads=2",
            "--model.max_seq_len=32", f"--run.out_dir={tmp_path}", "--run.name=layout", *layout]  # fmt: skip
    spawn(train, 2, load_config(None, args), timeout_s=240)
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "layout"), "--to", "hf", "--out", str(out)]) == 0
    assert_same_weights(tmp_path / "layout", out)
    assert logit_diff(tmp_path / "layout", out) <= LOGIT_ATOL


def test_exported_char_tokenizer_round_trips(run, exported):
    """Catches: a character tokenizer exported with other ids, with a pre-tokenizer that merges
    or drops whitespace and newlines, or a decoder that puts spaces between characters."""
    ours = load_tokenizer(run / "tokenizer")
    hf = AutoTokenizer.from_pretrained(exported)
    text = "Line 3: WHY?  the\nlazy dogs;\n"
    ids = hf(text)["input_ids"]
    assert ids == ours.encode(text)
    assert hf.decode(ids) == text


def test_export_errors_are_one_line(run, exported, tmp_path, capsys):
    """Catches: a traceback or exit status 1 instead of a one-line error for a missing run, a
    missing step, an occupied --out, and a model HF Llama cannot express (dropout on the
    residual branches); and an export that overwrites a directory it was not given empty."""
    fake = tmp_path / "with_dropout"
    fake.mkdir()
    config = (run / "config.toml").read_text()
    assert "dropout = 0.0" in config
    (fake / "config.toml").write_text(config.replace("dropout = 0.0", "dropout = 0.1"))
    cases = {
        "not a run directory": ["--run", str(tmp_path / "nope"), "--out", str(tmp_path / "a")],
        "--step=7": ["--run", str(run), "--step", "7", "--out", str(tmp_path / "b")],
        "not an empty directory": ["--run", str(run), "--out", str(exported)],
        "model.dropout=0.1": ["--run", str(fake), "--out", str(tmp_path / "c")],
    }
    for needle, args in cases.items():
        assert main(["export", "--to", "hf", *args]) == 2, needle
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_init_from_errors_name_the_field(hf_dir, tmp_path, capsys):
    """Catches: `loomtrain train --model.init_from` that starts workers (or fails with a
    traceback) for a missing directory, a non-Llama model, a Llama variant loomtrain cannot run
    (scaled rotary embedding, biases), and shapes that do not fit the parallel layout."""
    mistral, scaled = tmp_path / "mistral", tmp_path / "scaled"
    MistralConfig(**{k: v for k, v in HF_SHAPE.items() if k != "rope_theta"}).save_pretrained(mistral)
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
    LlamaConfig(**{**HF_SHAPE, "rope_parameters": llama3, "attention_bias": True}).save_pretrained(scaled)
    cases = {
        "does not exist": [f"--model.init_from=hf:{tmp_path / 'missing'}"],
        "'mistral' model": [f"--model.init_from=hf:{mistral}"],
        "rope_type='llama3'": [f"--model.init_from=hf:{scaled}"],
        "attention_bias=true": [f"--model.init_from=hf:{scaled}"],
        "parallel.tensor_parallel_degree=4": [f"--model.init_from=hf:{hf_dir}", "--parallel.tensor_parallel_degree=4"],
    }
    for needle, args in cases.items():
        assert main(["train", f"--run.out_dir={tmp_path}", "--training.seq_len=32", *args]) == 2, needle
        err = capsys.readouterr().err.strip()
        assert needle in err and "model.init_from" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "shakespeare_char").exists()
