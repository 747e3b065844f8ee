"""ParallelDims and the layout helpers, checked without any process group.

The mesh, its groups and everything that needs ranks are in
``tests/distributed/test_parallel_dims_groups.py``; here: degrees, their inference and
refusals, the degree of every axis, the manifest layout, the one-line description, the
chunk layout of ``shard_range``/``shard_rows`` and the launcher's environment.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loomtrain.config import ConfigError, ParallelConfig
from loomtrain.distributed.parallel_dims import (
    MESH_AXES,
    Axis,
    LaunchEnv,
    ParallelDims,
    launch_env,
    shard_range,
    shard_rows,
)

# ---------------------------------------------------------------------------- inference


@pytest.mark.parametrize(
    ("world", "parallel", "expected"),
    [
        (8, {}, {"dp": 8, "dp_shard": 8}),
        (8, {"tensor_parallel_degree": 2}, {"dp": 4, "tp": 2}),
        (8, {"sequence_parallel_degree": 2, "pipeline_parallel_degree": 2}, {"dp": 2, "sp": 2, "pp": 2}),
        (16, {"tensor_parallel_degree": 2, "sequence_parallel_degree": 2, "pipeline_parallel_degree": 2}, {"dp": 2}),
        (6, {"tensor_parallel_degree": 3}, {"dp": 2, "tp": 3}),
        (8, {"data_parallel_replicate_degree": 2}, {"dp": 8, "dp_replicate": 2, "dp_shard": 4}),
        (8, {"pipeline_parallel_degree": 2, "data_parallel_replicate_degree": 2}, {"dp": 4, "dp_shard": 2}),
        (4, {"tensor_parallel_degree": 4}, {"dp": 1, "dp_shard": 1}),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}{x}" for k, x in v.items()) or "none",
)
def test_data_parallel_degree_minus_one_takes_what_the_others_leave(world, parallel, expected):
    """Catches: ``dp=-1`` inferred from the wrong product (e.g. forgetting pp or sp), or
    ``dp_replicate`` not carried from the config into ``dp_shard``."""
    dims = ParallelDims.from_config(ParallelConfig(**parallel), world_size=world)
    for field, value in expected.items():
        assert getattr(dims, field) == value, f"{field}: {getattr(dims, field)} != {value} for {parallel}"
    assert dims.pp * dims.dp * dims.sp * dims.tp == world


def test_from_config_copies_every_degree_and_the_device_type():
    """Catches: from_config dropping or swapping a degree (tp for sp, pp for dp_replicate) or
    ignoring ``device_type`` (a CUDA run building a CPU mesh)."""
    cfg = ParallelConfig(
        data_parallel_degree=4,
        data_parallel_replicate_degree=2,
        tensor_parallel_degree=3,
        sequence_parallel_degree=5,
        pipeline_parallel_degree=7,
    )
    dims = ParallelDims.from_config(cfg, world_size=4 * 3 * 5 * 7, device_type="cuda")
    assert (dims.dp, dims.dp_replicate, dims.tp, dims.sp, dims.pp) == (4, 2, 3, 5, 7)
    assert dims.device_type == "cuda"
    assert dims.world_size == 420


def test_explicit_data_parallel_degree_is_kept_not_inferred():
    """Catches: an explicit ``data_parallel_degree`` silently replaced by the inferred one,
    which would hide a degree that does not match the process count."""
    cfg = ParallelConfig(data_parallel_degree=2, tensor_parallel_degree=2)
    assert ParallelDims.from_config(cfg, world_size=4).dp == 2
    with pytest.raises(ConfigError, match="world size 8"):
        ParallelDims.from_config(cfg, world_size=8)


def test_building_dims_needs_no_process_group():
    """Catches: the mesh (a collective) built eagerly in the constructor, which would break
    every caller that checks degrees before ``init_process_group`` (the CLI, this file)."""
    assert not dist.is_initialized()
    dims = ParallelDims(dp=4, world_size=32, tp=2, sp=2, pp=2, dp_replicate=2)
    assert "mesh" not in vars(dims)
    assert (dims.dp_shard, dims.degree(Axis.DP_SP), dims.layout()["dp"]) == (2, 8, 4)
    assert "mesh" not in vars(dims)


@pytest.mark.parametrize("axis", list(Axis), ids=str)
def test_group_or_none_of_a_size_one_axis_is_none_without_a_mesh(axis):
    """Catches: ``group_or_none`` building the mesh (or a group of one) for an axis of size 1,
    where callers skip the collective: one process must run without any process group."""
    dims = ParallelDims(dp=1, world_size=1)
    assert dims.group_or_none(axis) is None
    assert "mesh" not in vars(dims)


# ---------------------------------------------------------------------------- refusals

DEGREE_FIELDS = {
    "data_parallel_degree": "dp",
    "tensor_parallel_degree": "tp",
    "sequence_parallel_degree": "sp",
    "pipeline_parallel_degree": "pp",
    "data_parallel_replicate_degree": "dp_replicate",
}


@pytest.mark.parametrize("value", [0, -1, -3])
@pytest.mark.parametrize("field", list(DEGREE_FIELDS))
def test_degree_below_one_is_refused_and_named(field, value):
    """Catches: a zero or negative degree accepted (``dp=-1`` passed straight to ParallelDims,
    not through from_config's inference, must not mean "the rest"), or a message that does
    not name the field the user has to change."""
    kwargs = {"dp": 1, "world_size": 1, DEGREE_FIELDS[field]: value}
    with pytest.raises(ConfigError, match=rf"parallel\.{field}={value}\b"):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "product"),
    [
        ({"dp": 3, "tp": 2, "world_size": 4}, 6),
        ({"dp": 1, "tp": 2, "world_size": 4}, 2),
        ({"dp": 2, "sp": 2, "world_size": 8}, 4),
        ({"dp": 2, "pp": 2, "sp": 2, "tp": 2, "world_size": 8}, 16),
        ({"dp": 4, "dp_replicate": 2, "world_size": 8}, 4),
    ],
)
def test_degrees_not_multiplying_to_world_size_are_refused(kwargs, product):
    """Catches: a product check that forgets an axis (pp or sp), counts ``dp_replicate`` as a
    separate factor of the world, or accepts a product smaller than the world (idle ranks)."""
    d = {"pp": 1, "sp": 1, "tp": 1, **kwargs}
    message = (
        rf"pp={d['pp']} × dp={d['dp']} × sp={d['sp']} × tp={d['tp']} = {product} "
        rf"do not multiply to the world size {d['world_size']}.*parallel\."
    )
    with pytest.raises(ConfigError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(("dp", "replicate"), [(4, 3), (2, 4), (6, 4), (3, 2)])
def test_data_parallel_degree_not_divisible_by_replicate_degree_is_refused(dp, replicate):
    """Catches: ``dp_shard = dp // dp_replicate`` silently rounding down (fewer shard ranks
    than dp ranks, so some ranks would be missing from the mesh)."""
    with pytest.raises(ConfigError, match=rf"parallel\.data_parallel_replicate_degree={replicate}\b.*degree {dp}\b"):
        ParallelDims(dp=dp, world_size=dp, dp_replicate=replicate)


def test_inferred_data_parallel_degree_not_divisible_by_replicate_degree_is_refused():
    """Catches: the divisibility check skipped when dp is inferred (``-1``) instead of given."""
    cfg = ParallelConfig(tensor_parallel_degree=2, data_parallel_replicate_degree=3)
    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_replicate_degree=3"):
        ParallelDims.from_config(cfg, world_size=8)


@pytest.mark.parametrize(
    ("world", "pp", "tp", "sp"),
    [(6, 1, 4, 1), (8, 1, 1, 3), (8, 3, 1, 1), (12, 2, 2, 2), (2, 1, 4, 1), (1, 2, 1, 1)],
)
def test_world_not_divisible_by_pp_tp_sp_is_refused_naming_each_field(world, pp, tp, sp):
    """Catches: dp inferred by floor division (``6 // 4 == 1``: a layout over fewer ranks than
    were launched) or a world smaller than pp·tp·sp inferring ``dp=0``; and a message that
    does not name the three degrees the user can change."""
    cfg = ParallelConfig(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, sequence_parallel_degree=sp)
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(cfg, world_size=world)
    message = str(err.value)
    assert f"world size {world}" in message
    for field, value in (("pipeline", pp), ("tensor", tp), ("sequence", sp)):
        assert f"parallel.{field}_parallel_degree={value}" in message, message


# ---------------------------------------------------------------------------- degrees, layout, describe

LAYOUTS = [
    # (kwargs, degree of pp, dp_replicate, dp_shard, sp, tp, dp_sp, dp_shard_sp, tp_row, tp_col)
    ({"dp": 8, "world_size": 8}, (1, 1, 8, 1, 1, 8, 8, 1, 1)),
    ({"dp": 2, "pp": 2, "tp": 2, "world_size": 8}, (2, 1, 2, 1, 2, 2, 2, 1, 1)),
    ({"dp": 2, "sp": 2, "tp": 2, "world_size": 8}, (1, 1, 2, 2, 2, 4, 4, 1, 1)),
    ({"dp": 4, "dp_replicate": 2, "sp": 2, "world_size": 8}, (1, 2, 2, 2, 1, 8, 4, 1, 1)),
    ({"dp": 4, "dp_replicate": 2, "pp": 2, "world_size": 8}, (2, 2, 2, 1, 1, 4, 2, 1, 1)),
    (
        {"dp": 6, "dp_replicate": 3, "sp": 5, "tp": 7, "pp": 11, "world_size": 6 * 5 * 7 * 11},
        (11, 3, 2, 5, 7, 30, 10, 1, 1),
    ),
    ({"dp": 4, "dp_replicate": 4, "world_size": 4}, (1, 4, 1, 1, 1, 4, 1, 1, 1)),
    ({"dp": 2, "tp": 9, "tp_2d": True, "world_size": 18}, (1, 1, 2, 1, 9, 2, 2, 3, 3)),
]


@pytest.mark.parametrize(("kwargs", "degrees"), LAYOUTS, ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_degree_of_every_axis(kwargs, degrees):
    """Catches: a wrong size for a mesh axis or a flattened one, e.g. ``dp_sp`` leaving out
    ``dp_replicate`` (gradients averaged within one replica group only) or ``dp_shard_sp``
    including it (ZeRO sharding across replica groups); a new Axis without a degree."""
    dims = ParallelDims(**kwargs)
    order = (
        Axis.PP,
        Axis.DP_REPLICATE,
        Axis.DP_SHARD,
        Axis.SP,
        Axis.TP,
        Axis.DP_SP,
        Axis.DP_SHARD_SP,
        Axis.TP_ROW,
        Axis.TP_COL,
    )
    assert set(order) == set(Axis), "a new Axis needs a row in LAYOUTS"
    got = tuple(dims.degree(axis) for axis in order)
    assert got == degrees, dict(zip(map(str, order), got, strict=True))
    assert dims.dp_shard == degrees[2]
    assert dims.dp_replicate * dims.dp_shard == dims.dp
    assert dims.world_size == dims.degree(Axis.PP) * dims.degree(Axis.DP_SP) * dims.degree(Axis.TP)


def test_mesh_axes_are_outermost_first_in_the_documented_order():
    """Catches: a reordering of the mesh axes, which changes which global rank holds which
    coordinate (and so which ranks share a node) and breaks resuming every checkpoint."""
    assert MESH_AXES == (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.SP, Axis.TP)
    assert [str(a) for a in Axis] == ["pp", "dp_replicate", "dp_shard", "sp", "tp", "dp_sp", "dp_shard_sp", "tp_row",
                                      "tp_col"]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "degrees"), LAYOUTS, ids=lambda v: str(v) if isinstance(v, tuple) else None)
def test_layout_records_every_degree(kwargs, degrees):
    """Catches: the manifest layout missing a degree (a checkpoint from a different
    ``dp_replicate`` taken as the same layout) or recording dp_shard in place of dp."""
    dims = ParallelDims(**kwargs)
    assert dims.layout() == {
        "pp": kwargs.get("pp", 1),
        "dp": kwargs["dp"],
        "dp_replicate": kwargs.get("dp_replicate", 1),
        "sp": kwargs.get("sp", 1),
        "tp": kwargs.get("tp", 1),
    }


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        ({"dp": 4, "world_size": 4}, "pp 1, dp 4, sp 1, tp 1"),
        ({"dp": 4, "dp_replicate": 2, "world_size": 4}, "pp 1, dp 4 (2 replicas × 2), sp 1, tp 1"),
        (
            {"dp": 6, "dp_replicate": 3, "pp": 2, "sp": 5, "tp": 7, "world_size": 420},
            "pp 2, dp 6 (3 replicas × 2), sp 5, tp 7",
        ),
        ({"dp": 4, "dp_replicate": 4, "world_size": 4}, "pp 1, dp 4 (4 replicas × 1), sp 1, tp 1"),
    ],
)
def test_describe(kwargs, line):
    """Catches: the log line swapping degrees or printing dp_shard as the replica count."""
    assert ParallelDims(**kwargs).describe() == line


# ---------------------------------------------------------------------------- sequence_slice without ranks


def test_sequence_slice_without_sequence_parallelism_is_the_whole_sequence():
    """Catches: ``sp == 1`` needing a mesh (a process group) or cutting the sequence."""
    dims = ParallelDims(dp=2, world_size=2)
    for seq_len in (1, 7, 16):
        assert dims.sequence_slice(seq_len) == slice(0, seq_len)
    assert "mesh" not in vars(dims)


@pytest.mark.parametrize(("sp", "seq_len"), [(2, 15), (4, 18), (3, 1)])
def test_sequence_length_not_divisible_by_sp_is_refused(sp, seq_len):
    """Catches: an indivisible sequence split by floor division, silently dropping the last
    tokens (the check must come before any rank lookup, so no process group is needed)."""
    dims = ParallelDims(dp=1, world_size=sp, sp=sp)
    with pytest.raises(ConfigError, match=rf"sequence length {seq_len}\b.*parallel\.sequence_parallel_degree={sp}\b"):
        dims.sequence_slice(seq_len)


# ---------------------------------------------------------------------------- shard_range / shard_rows

SIZES_AND_RANKS = [(size, n) for n in (1, 2, 3, 4, 8) for size in (0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 50)]


@pytest.mark.parametrize(("size", "n"), SIZES_AND_RANKS)
def test_shard_range_matches_torch_chunk(size, n):
    """Catches: a split that differs from ``torch.chunk`` / DTensor ``Shard`` (e.g. a balanced
    ``tensor_split`` layout, or the remainder put on the last rank): ZeRO and TP shards would
    then not line up with the DTensors that checkpoints save. Ranks past the last chunk must
    get an empty range at the end, never a negative or out-of-range one."""
    rows = torch.arange(size)
    chunks = [c.tolist() for c in torch.chunk(rows, n)] if size else []
    chunks += [[]] * (n - len(chunks))
    for rank in range(n):
        start, end = shard_range(size, n, rank)
        assert 0 <= start <= end <= size, (rank, start, end)
        assert rows[start:end].tolist() == chunks[rank], f"rank {rank} of {n}, size {size}"
        assert end - start <= shard_rows(size, n)


@pytest.mark.parametrize(("size", "n"), SIZES_AND_RANKS)
def test_shard_ranges_tile_the_dimension_without_overlap(size, n):
    """Catches: rows lost or held twice between consecutive ranks (an off-by-one in start or
    end), and empty ranks placed anywhere but at the end."""
    ranges = [shard_range(size, n, rank) for rank in range(n)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == size
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert start == end
    lengths = [end - start for start, end in ranges]
    assert lengths == sorted(lengths, reverse=True), lengths


@pytest.mark.parametrize(
    ("size", "n", "rows"),
    [(8, 4, 2), (9, 4, 3), (7, 8, 1), (0, 4, 0), (1, 1, 1), (17, 4, 5), (16, 16, 1), (50, 3, 17)],
)
def test_shard_rows_is_ceil(size, n, rows):
    """Catches: floor division (rows per rank too few, the remainder lost) in the padded shard
    size that ZeRO allocates on every rank."""
    assert shard_rows(size, n) == rows


def test_shard_range_on_sizes_that_leave_trailing_ranks_empty():
    """Catches: the exact layout of an uneven split where later ranks get nothing
    (5 rows on 4 ranks: 2, 2, 1, 0; 3 rows on 8 ranks: 1, 1, 1 then five empty ranks)."""
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [shard_range(3, 8, r) for r in range(8)] == [(0, 1), (1, 2), (2, 3)] + [(3, 3)] * 5
    assert [shard_range(6, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 6)]


# ---------------------------------------------------------------------------- launch_env

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


def _ranks_of(env: LaunchEnv) -> tuple[int, int, int, int]:
    return env.rank, env.local_rank, env.world_size, env.restart_count


def test_launch_env_without_launcher_variables_is_one_process(monkeypatch):
    """Catches: a KeyError (or a wrong default) when run without a launcher: one process,
    rank 0 of 1, first attempt."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    assert _ranks_of(launch_env()) == (0, 0, 1, 0)


def test_launch_env_reads_the_launcher_variables(monkeypatch):
    """Catches: swapped variables (local rank taken for the global rank, as on a second node;
    the restart count for a rank) or values left as strings."""
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    env = launch_env()
    assert _ranks_of(env) == (13, 5, 16, 2)
    assert all(type(v) is int for v in _ranks_of(env))


@pytest.mark.parametrize("present", LAUNCH_VARS)
def test_launch_env_with_one_variable_set_keeps_the_others_default(monkeypatch, present):
    """Catches: one variable's value read for another, or a missing one not defaulted
    (e.g. torchrun without elastic restarts, or the spawn helper, which sets no LOCAL_RANK)."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(present, "3")
    expected = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "TORCHELASTIC_RESTART_COUNT": 0, present: 3}
    assert _ranks_of(launch_env()) == tuple(expected[name] for name in LAUNCH_VARS)
