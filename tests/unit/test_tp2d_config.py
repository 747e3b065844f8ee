"""2D tensor parallelism before launch: the config's refusal of shapes and layouts a q × q grid
cannot take (``parallel.tp_mode="2d"``), and where the grid's ranks go on hosts. No processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loomtrain.config import ConfigError, ParallelConfig, load_config
from loomtrain.distributed.parallel_dims import Axis, ParallelDims
from loomtrain.distributed.tensor_parallel_2d import check_2d_shapes, padded_vocab
from loomtrain.distributed.topology import place_ranks, placement_report
from tests.unit.test_placement import INTERLEAVED, topology

GOOD = ["--model.n_heads=8", "--model.n_kv_heads=4", "--model.dim=64", "--model.ffn_hidden_dim=96",
        "--training.micro_batch_size=8", "--parallel.tp_mode=2d"]  # fmt: skip


def config(tp: int, *extra: str):
    return load_config(None, [*GOOD, f"--parallel.tensor_parallel_degree={tp}", *extra])


def test_a_valid_grid_is_accepted():
    """Catches: a valid q × q degree refused, the 1D rule (heads divisible by tp = 16) applied
    to a grid that splits heads only q = 4 ways, or tied embeddings refused (TiedEmbedding2D)."""
    assert config(16).parallel.tensor_parallel_degree == 16
    assert config(4, "--model.tie_embeddings=true").parallel.tp_mode == "2d"


@pytest.mark.parametrize(("tp", "nearest"), [(8, "4 (2×2) and 9 (3×3)"), (2, "1 (1×1) and 4 (2×2)"),
                                             (12, "9 (3×3) and 16 (4×4)")])  # fmt: skip
def test_a_degree_that_is_not_a_perfect_square_is_refused_with_the_nearest_sizes(tp, nearest):
    """Catches: tp = 8 accepted (a 2 × 4 grid would break SUMMA's square blocks), or refused
    without naming the field or the valid sizes next to it."""
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_degree") as err:
        config(tp)
    assert nearest in str(err.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--model.dim=30", "--model.n_heads=3", "--model.n_kv_heads=3"], "model.dim=30"),
        (["--model.n_heads=2", "--model.n_kv_heads=2", "--model.dim=32"], "model.n_heads=2"),
        (["--model.n_kv_heads=2"], "model.n_kv_heads=2"),
        (["--model.ffn_hidden_dim=102"], "model.ffn_hidden_dim=102"),
        (["--training.micro_batch_size=6"], "training.micro_batch_size=6"),
    ],
)
def test_each_indivisible_field_is_named(extra, field):
    """Catches: a hidden size, head count, kv head count, SwiGLU width or micro-batch that q = 4
    does not divide let through to fail inside a collective, or refused without the field."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as err:
        config(16, *extra)
    assert "multiple of 4" in str(err.value)


def test_layouts_the_grid_does_not_join_yet_are_refused_before_launch():
    """Catches: per-rank batch balancing accepted with 2D, where it would fail at the first step;
    or Ulysses, ZeRO, the sync-family local modes or async refused, which compose (Ulysses'
    heads per rank count the grid's q-way head split, not tp's q²; ZeRO shards each 2D block over
    dp; local SGD/DiLoCo/streaming average each rank's blocks over its dp group, async exchanges
    them with the server's rank at the same grid position)."""
    with pytest.raises(ConfigError, match="balance.data"):
        config(4, "--balance.data=true")
    assert config(4, "--parallel.sequence_parallel_degree=2").parallel.sequence_parallel_degree == 2
    assert config(4, "--data_parallel.zero_stage=3").data_parallel.zero_stage == 3
    for mode in ("local_sgd", "diloco", "streaming_diloco", "async"):
        assert config(4, f"--data_parallel.mode={mode}").parallel.tp_mode == "2d"
    with pytest.raises(ConfigError, match="fewer than parallel.sequence_parallel_degree=8"):
        config(4, "--parallel.sequence_parallel_degree=8")


def test_every_problem_is_reported_at_once():
    """Catches: only the first offending field reported, so the user fixes one per launch."""
    with pytest.raises(ValueError) as err:
        check_2d_shapes(9, dim=64, n_heads=8, n_kv_heads=4, ffn_hidden_dim=100, micro_batch_size=4)
    for field in ("model.dim=64", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden_dim=100",
                  "training.micro_batch_size=4"):  # fmt: skip
        assert field in str(err.value)


def test_the_vocabulary_is_padded_not_refused():
    """Catches: a vocabulary not divisible by q refused (it is padded), or padded past the next multiple."""
    assert config(4, "--model.vocab_size=50257").model.vocab_size == 50257
    assert [padded_vocab(v, 4) for v in (64, 65, 67, 68)] == [64, 68, 68, 68]


def test_grid_rows_stay_inside_a_host_when_the_whole_grid_does_not_fit():
    """Catches: a 2 × 2 grid on 2 hosts × 2 interleaved ranks left in the launcher's order (each
    grid row, whose SUMMA broadcasts carry the most bytes per step, would cross the network),
    or a placement refused because the tp group itself is not ascending (under 2D only the grid
    axes' groups must be)."""
    topo = topology(INTERLEAVED)
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_degree=4, tp_mode="2d"), 4)
    placed = replace(dims, rank_order=place_ranks(topo, dims))
    rows, columns = placed.grid_groups(Axis.TP_COL), placed.grid_groups(Axis.TP_ROW)
    assert rows == [[0, 2], [1, 3]] and columns == [[0, 1], [2, 3]]
    assert all(len({topo.host_of(r) for r in row}) == 1 for row in rows)
    report = placement_report(placed, topo)
    assert "tp_col 2 (grid rows): inside one host" in report and "tp_row 2: crosses hosts" in report
    assert "warning: 2D grid rows" in placement_report(dims, topo)
