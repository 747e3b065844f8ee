"""``--parallel.auto=true`` (planner/auto.py): a planner layout as config overrides, the choice of the
fastest layout loomtrain accepts, the refusal of fields the planner sets, and one real launch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from loomtrain import cli
from loomtrain.config import ConfigError, load_config
from loomtrain.planner.arch import from_model_config
from loomtrain.planner.auto import auto_cluster, choose_layout, describe, plan_overrides, vocab_size
from loomtrain.planner.memory import Layout, precision_for
from loomtrain.planner.search import search
from loomtrain.preflight import check_world

SPEC = """name = "a100x4"
source = "test: one host of four A100s"

[[hosts]]
count = 1
devices_per_host = 4
device = "a100"
intra_gb_per_s = 300
intra_latency_us = 5

[network]
inter_gb_per_s = 25
inter_latency_us = 10
link_efficiency = 0.8
"""
# A tiny model with the char tokenizer's Shakespeare vocabulary left to the tokenizer (vocab_size=0).
TINY = ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=2", "--model.max_seq_len=32",
        "--training.seq_len=32", "--training.global_batch_size=8"]  # fmt: skip


@pytest.fixture
def spec(tmp_path) -> str:
    path = tmp_path / "a100x4.toml"
    path.write_text(SPEC)
    return str(path)


def auto(spec: str, *extra: str):
    return load_config(None, [*TINY, "--parallel.auto=true", f"--parallel.auto_cluster={spec}", *extra])


def ranked(cfg, world: int):
    """The planner's plans for ``cfg`` in search order, computed here independently of choose_layout."""
    arch = from_model_config(cfg.model.model_copy(update={"vocab_size": vocab_size(cfg)}))
    t = cfg.training
    return search(arch, auto_cluster(cfg, world), t.global_batch_size, seq_len=t.seq_len, world=world,
                  precision=precision_for(t.dtype, 0), log_interval=t.log_interval).plans  # fmt: skip


# Plain data parallelism with ZeRO-1; HSDP × Megatron SP × an interleaved pipeline; Ulysses × tp × pp.
LAYOUTS = [
    Layout(seq_len=32, micro_batch=2, dp=4, zero_stage=1, recompute="selective"),
    Layout(seq_len=32, micro_batch=1, dp=4, dp_replicate=2, tp=2, sequence_parallel=True, zero_stage=2, pp=2,
           n_micro=4, schedule="interleaved_1f1b", virtual_stages=2, recompute="full"),
    Layout(seq_len=32, micro_batch=4, dp=1, sp=2, tp=2, pp=4, recompute="none"),
]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overrides_give_a_config_that_runs_the_layout(layout):
    """Catches: an override with a wrong field name or value (Megatron SP as tp_mode, Ulysses sp,
    HSDP replicas, the interleaved schedule's virtual stages, recomputation), or a field left out."""
    cfg = load_config(None, ["--model.n_layers=8", "--model.n_heads=4", *plan_overrides(layout)])
    p, dp, t = cfg.parallel, cfg.data_parallel, cfg.training
    got = (p.data_parallel_degree, p.data_parallel_replicate_degree, p.tensor_parallel_degree,
           p.tp_mode == "sequence_parallel", p.sequence_parallel_degree, p.pipeline_parallel_degree,
           p.pipeline_schedule, p.virtual_stages, dp.zero_stage, t.micro_batch_size,
           t.activation_checkpointing)  # fmt: skip
    want = (layout.dp, layout.dp_replicate, layout.tp, layout.sequence_parallel, layout.sp, layout.pp,
            layout.schedule, layout.virtual_stages, layout.zero_stage, layout.micro_batch,
            layout.recompute)  # fmt: skip
    assert got == want


def test_char_vocabulary_is_the_corpus_characters(spec):
    """Catches: planning with a vocabulary other than the one the run's char tokenizer builds."""
    from loomtrain.data import build_tokenizer, load_corpus

    cfg = auto(spec)
    train_text, val_text = load_corpus(cfg.data)
    assert vocab_size(cfg) == build_tokenizer("char", train_text + val_text, 0).vocab_size


def test_bpe_without_vocab_size_is_refused(spec):
    """Catches: planning a BPE run with a guessed vocabulary instead of asking for model.vocab_size."""
    with pytest.raises(ConfigError, match="model.vocab_size=2048"):
        choose_layout(auto(spec, "--data.tokenizer=bpe"), 4, auto_cluster(auto(spec), 4))


# Settings under which loomtrain accepts only some layouts: the local-SGD mode runs one whole replica
# per rank (no ZeRO, tp, sp, pp or HSDP); a fixed split of the batch over two ranks needs dp = 2
# and no pipeline. The fastest plan cannot pass both (dp = 4 for the first, 2 for the second), so
# at least one case skips a faster plan.
ACCEPTS = {
    "tied": (["--model.tie_embeddings=true"], lambda lay: lay.pp == 1),
    "fixed_split": (["--balance.samples_per_rank=[4, 4]"], lambda lay: lay.dp == 2 and lay.pp == 1),
}  # fmt: skip


def test_choice_is_the_fastest_accepted_plan_and_refused_ones_are_skipped(spec):
    """Catches: a refused layout chosen (the launch would fail), an accepted faster one passed
    over, a runner-up that is not the next accepted plan, or a choice check_world refuses."""
    skipped = []
    for extra, accepts in ACCEPTS.values():
        cfg = auto(spec, *extra)
        choice = choose_layout(cfg, 4, auto_cluster(cfg, 4))
        plans = ranked(cfg, 4)
        accepted = [plan for plan in plans if accepts(plan.layout)]
        assert (choice.chosen, choice.runner_up) == (accepted[0], accepted[1])
        assert choice.refused == plans.index(choice.chosen)
        check_world(choice.config, 4)
        assert not choice.config.parallel.auto
        assert choice.config.data_parallel.mode == cfg.data_parallel.mode
        skipped.append(choice.refused)
    assert max(skipped) > 0


def test_describe_prints_both_plans_as_predictions(spec):
    """Catches: the runner-up or the figures missing from the printed choice, or the predictions
    presented as measurements."""
    cfg = auto(spec)
    choice = choose_layout(cfg, 4, auto_cluster(cfg, 4))
    text = describe(choice)
    lay = choice.chosen.layout
    assert f"chosen: dp={lay.dp} zero_stage={lay.zero_stage} tp={lay.tp}" in text
    assert f"runner-up: dp={choice.runner_up.layout.dp} " in text
    assert f"{choice.chosen.tokens_per_s:,.0f} tokens/s" in text and "GiB/device" in text
    assert f"step {choice.chosen.step.total:.4g} s" in text and "predictions" in text


def test_no_layout_is_a_config_error(spec):
    """Catches: a traceback, or a silent start on a default layout, when no plan fits or is accepted."""
    # 6.4 billion parameters: 103 GB of fp32 weights, gradients and AdamW moments on one 80 GB device.
    big = auto(spec, "--model.dim=16384", "--model.n_heads=128", "--model.vocab_size=32000")
    with pytest.raises(ConfigError, match="no layout fits 1 × a100.*memory.*global_batch_size"):
        choose_layout(big, 1, auto_cluster(big, 1))
    # One head: no tp or sp; a batch of 2 on 4 ranks leaves only 2-stage pipelines, which a tied
    # embedding forbids.
    cfg = auto(spec, "--model.n_heads=1", "--training.global_batch_size=2", "--model.tie_embeddings=true")
    with pytest.raises(ConfigError, match="refuses all .* layouts .*tie_embeddings"):
        choose_layout(cfg, 4, auto_cluster(cfg, 4))


@pytest.mark.parametrize("field", ["--parallel.tensor_parallel_degree=2", "--training.micro_batch_size=2",
                                   "--data_parallel.zero_stage=1", "--parallel.pipeline_schedule=1f1b"])  # fmt: skip
def test_planned_field_given_with_auto_is_refused_before_launch(tmp_path, spec, capsys, field):
    """Catches: a layout field the user gave silently replaced by the planner's (even one equal to
    its default), or the conflict found only after workers start."""
    code = cli.main(["train", *TINY, f"--run.out_dir={tmp_path}/runs", "--parallel.auto=true",
                     f"--parallel.auto_cluster={spec}", field])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and field[2:].split("=")[0] in err and "drop parallel.auto" in err, err
    assert not (tmp_path / "runs").exists()


def test_planned_field_in_the_config_file_is_replaced_and_named(tmp_path, spec):
    """Catches: a config file written for one layout (the default job sets micro_batch_size) that
    cannot run with --parallel.auto=true, or the plan replacing its value without saying so."""
    path = tmp_path / "job.toml"
    path.write_text("[training]\nmicro_batch_size = 3\n")
    args, _, cfg = cli._parse_train_args(["--config", str(path), *TINY, "--parallel.auto=true",
                                          f"--parallel.auto_cluster={spec}"])  # fmt: skip
    assert args.replaced == ["training.micro_batch_size=3"]
    assert choose_layout(cfg, 2, auto_cluster(cfg, 2)).config.training.micro_batch_size in (1, 2, 4, 8)


def test_auto_in_a_torchrun_worker_is_refused(spec, monkeypatch, capsys):
    """Catches: torchrun workers ignoring parallel.auto (running the default layout) or each
    planning on its own."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cli.main(["train", *TINY, "--parallel.auto=true", f"--parallel.auto_cluster={spec}"]) == 2
    assert "launcher" in capsys.readouterr().err


def test_train_runs_the_planned_layout(tmp_path, spec):
    """Catches: a launch that prints a choice but runs another layout (workers planning again, the
    overrides not passed on), or a run that does not start with it. Planned with the run's logging
    interval, which the planner prices."""
    cfg = auto(spec, "--training.log_interval=1")
    choice = choose_layout(cfg, 2, auto_cluster(cfg, 2))
    args = [sys.executable, "-m", "loomtrain.cli", "train", "--nproc", "2", *TINY, "--parallel.auto=true",
            f"--parallel.auto_cluster={spec}", f"--run.out_dir={tmp_path}", "--run.name=auto", "--training.steps=2",
            "--training.warmup_steps=1", "--training.eval_interval=1000", "--training.eval_batches=1",
            "--training.log_interval=1", "--sample.max_new_tokens=0", "--metrics.progress_bar=false"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert describe(choice) in done.stdout
    saved = tomllib.loads((Path(tmp_path) / "auto" / "config.toml").read_text())
    lay = choice.chosen.layout
    assert saved["parallel"]["auto"] is False
    assert (saved["parallel"]["data_parallel_degree"], saved["parallel"]["tensor_parallel_degree"],
            saved["parallel"]["sequence_parallel_degree"], saved["parallel"]["pipeline_parallel_degree"],
            saved["data_parallel"]["zero_stage"], saved["training"]["micro_batch_size"],
            saved["training"]["activation_checkpointing"]) == (
        lay.dp, lay.tp, lay.sp, lay.pp, lay.zero_stage, lay.micro_batch, lay.recompute)  # fmt: skip
    assert len((Path(tmp_path) / "auto" / "metrics.jsonl").read_text().splitlines()) >= 2


@pytest.mark.parametrize(
    ("extra", "nproc", "message"),
    [
        ([], "3", "measures --nproc=3 ranks, and the measurement needs a power of two"),
        (["--parallel.auto_cluster=nope"], "2", "parallel.auto_cluster='nope': no such file or spec name"),
        (["--parallel.auto_cluster=dgx-a100", "--data_parallel.mode=diloco"], "2",
         "the planner prices synchronous data parallelism only"),
        (["--parallel.auto_cluster=dgx-a100", "--parallel.pipeline_schedule=gpipe"], "2",
         "parallel.auto=true chooses parallel.pipeline_schedule itself"),
    ],
)  # fmt: skip
def test_auto_input_errors_are_clear(tmp_path, capsys, extra, nproc, message):
    """Catches (a fresh user's break test): a traceback about a `--ranks` flag never given for
    `--nproc 3`, a spec error naming `--cluster` (another flag of `loomtrain train`), a plan for
    synchronous training silently applied to DiLoCo, and a planned field reported by its value's
    own validation instead of the conflict with auto."""
    code = cli.main(["train", *TINY, "--nproc", nproc, f"--run.out_dir={tmp_path}/runs", "--parallel.auto=true",
                     *extra])  # fmt: skip
    assert code == 2 and message in capsys.readouterr().err
