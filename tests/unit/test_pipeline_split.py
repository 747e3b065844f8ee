"""Stage split, pruning, the model's partial forward, and the pipeline's config checks."""

from __future__ import annotations

import itertools

import pytest
import torch

from loomtrain.config import ConfigError, ModelConfig, load_config
from loomtrain.distributed.pipeline.split import partition_layers
from loomtrain.models import Transformer
from loomtrain.models.parallelize import prune_to_rank


def test_split_by_count_gives_the_first_stages_the_extra_layers():
    """Catches: layers dropped or repeated when they do not divide evenly into the stages."""
    assert partition_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert partition_layers(3, 3) == [[0], [1], [2]]


def test_split_by_cost_minimises_the_slowest_stage():
    """Catches: a balanced split worse than the best contiguous one (checked by brute force)."""
    costs = [5.0, 1.0, 1.0, 1.0, 4.0, 2.0, 2.0, 3.0]
    stages = partition_layers(len(costs), 3, costs=costs)
    assert [i for s in stages for i in s] == list(range(len(costs)))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True))
        for cuts in itertools.combinations(range(1, len(costs)), 2)
    )
    assert max(sum(costs[i] for i in s) for s in stages) == best


def test_explicit_boundaries_override_and_are_checked():
    """Catches: boundaries ignored, or bad ones accepted (a stage with no layer)."""
    assert partition_layers(6, 3, boundaries=[1, 5]) == [[0], [1, 2, 3, 4], [5]]
    with pytest.raises(ValueError, match="increasing"):
        partition_layers(6, 3, boundaries=[3, 3])
    with pytest.raises(ValueError, match="cannot fill"):
        partition_layers(2, 3)


def tiny(n_layers: int = 4) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(n_layers=n_layers, n_heads=2, dim=16, max_seq_len=8, vocab_size=32))


def test_stage_forwards_compose_to_the_whole_model():
    """Catches: a stage that re-embeds hidden states, applies the head early, or skips a layer:
    running the stages one after another must give the whole model's logits."""
    model, x = tiny(), torch.randint(0, 32, (2, 8))
    h = model(x, layers=["0", "1"])
    assert h.shape == (2, 8, 16)
    torch.testing.assert_close(model(h, layers=["2", "3"]), model(x), rtol=0, atol=0)


def test_pruning_keeps_names_and_only_the_ranks_stages():
    """Catches: renamed parameters (checkpoints would not load across pipeline degrees) or a
    rank keeping layers, the embedding or the head of another rank's stages."""
    names = dict(tiny().named_parameters())
    plan = partition_layers(4, 4)  # pp = 2, v = 2: rank 0 holds stages 0 and 2
    rank0, rank1 = tiny(), tiny()
    assert prune_to_rank(rank0, plan, 0, 2) == {0: ["0"], 2: ["2"]}
    assert prune_to_rank(rank1, plan, 1, 2) == {1: ["1"], 3: ["3"]}
    kept0, kept1 = dict(rank0.named_parameters()), dict(rank1.named_parameters())
    assert kept0.keys() | kept1.keys() == names.keys() and not kept0.keys() & kept1.keys()
    assert "tok_embeddings.weight" in kept0 and "output.weight" in kept1 and "norm.weight" in kept1
    assert all(torch.equal(p, names[n]) for n, p in (*kept0.items(), *kept1.items()))


PP2 = "--parallel.pipeline_parallel_degree=2"
INTERLEAVED = "--parallel.pipeline_schedule=interleaved_1f1b"


@pytest.mark.parametrize(
    "overrides, needles",
    [
        ([PP2, "--parallel.virtual_stages=2"], ["interleaved_1f1b"]),
        (["--parallel.virtual_stages=2", INTERLEAVED], ["pipeline_parallel_degree > 1"]),
        ([PP2, INTERLEAVED], ["virtual_stages >= 2"]),
        ([PP2, "--parallel.stage_boundaries=[0]"], ["stage_boundaries=[0]"]),
        ([PP2, "--parallel.stage_boundaries=[1, 2]"], ["1 strictly increasing"]),
        (["--parallel.pipeline_split=time"], ["pipeline_split='time' needs parallel.pipeline_parallel_degree > 1"]),
    ],
)
def test_bad_pipeline_layouts_name_the_field(overrides, needles):
    """Catches: a layout the executor cannot run getting past the config."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.n_layers=4", *overrides])
    for needle in needles:
        assert needle in str(err.value)
