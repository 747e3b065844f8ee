"""ParallelDims on 8 gloo processes: coordinates, groups, flattened and ZeRO meshes, pipeline
groups and sequence slices, for several layouts, against the rank formula

    rank = ((((pp·R + rep)·S + shard)·SP + sp)·TP + tp)      (R = dp_replicate, S = dp_shard)

One spawn serves every layout (each spawn of 8 processes costs seconds of ``import torch`` on
a small machine): every rank builds each layout's ParallelDims in turn, runs each check under
``_attempt`` so that a failing check returns its traceback instead of killing the rank, and
returns its facts. The parent tests then compare the facts of all ranks with the formula, one
test per check and layout, so a failure names the check, the layout and the rank.
"""

from __future__ import annotations

import itertools
import math
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from loomtrain.config import ConfigError
from loomtrain.distributed.parallel_dims import (
    MESH_AXES,
    Axis,
    ParallelDims,
    is_main_process,
    launch_env,
    shard_range,
    sharded_dtensor,
)
from loomtrain.distributed.spawn import spawn

WORLD = 8
LAYOUTS = {
    "pp2_dp2_tp2": {"pp": 2, "dp": 2, "tp": 2},
    "dp2_sp2_tp2": {"dp": 2, "sp": 2, "tp": 2},
    "dp4rep2_sp2": {"dp": 4, "dp_replicate": 2, "sp": 2},
    "pp2_dp4rep2": {"pp": 2, "dp": 4, "dp_replicate": 2},
    "pp2_dp2rep2_sp2": {"pp": 2, "dp": 2, "dp_replicate": 2, "sp": 2},
    "dp4rep2_tp2": {"dp": 4, "dp_replicate": 2, "tp": 2},
    "dp8": {"dp": 8},
}
SEQ_LENS = (16, 24)
DTENSOR_ROWS = 10  # over 4 shards 3, 3, 3, 1; over 8: 2, 2, 2, 2, 2, then three empty shards


# ---------------------------------------------------------------------------- in the spawned ranks


def _attempt(fn) -> dict[str, Any]:
    """``{"value": fn()}``, or ``{"error": traceback}`` if it raised: one check's failure must
    not hide the others."""
    try:
        return {"value": fn()}
    except Exception:
        return {"error": traceback.format_exc()}


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _group_facts(group) -> dict[str, Any]:
    """Members in group-rank order, this rank's index in the group, and the sum of the members'
    global ranks as an all-reduce over the group computes it (the group really connects them)."""
    total = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return {"ranks": _ranks(group), "group_rank": dist.get_rank(group), "sum": int(total.item())}


def _sequence_facts(dims: ParallelDims) -> dict[int, tuple[int, int, int | None]]:
    out = {}
    for seq_len in SEQ_LENS:
        s = dims.sequence_slice(seq_len)
        out[seq_len] = (s.start, s.stop, s.step)
    return out


def _indivisible_sequence_refused(dims: ParallelDims) -> str | None:
    """The ConfigError's message for a length not divisible by sp (None when sp == 1)."""
    if dims.sp == 1:
        return None
    try:
        dims.sequence_slice(dims.sp * 3 + 1)
    except ConfigError as e:
        return str(e)
    return "no error"


def _pp_group_facts(dims: ParallelDims) -> dict[str, Any]:
    groups = dims.pp_groups
    act, grad = groups["activation"], groups["gradient"]
    return {
        "keys": sorted(groups),
        "activation": _group_facts(act),
        "gradient": _group_facts(grad),
        "same_object": act is grad,
        "same_name": act.group_name == grad.group_name,
        "activation_is_mesh_pp_group": act is dims.group(Axis.PP),
        "cached": dims.pp_groups is groups,
    }


def _mesh_facts(mesh) -> dict[str, Any]:
    return {
        "shape": tuple(mesh.shape),
        "names": tuple(str(n) for n in mesh.mesh_dim_names),
        "ranks": mesh.mesh.tolist(),
        "groups": {str(n): _ranks(mesh.get_group(str(n))) for n in mesh.mesh_dim_names},
        "coords": {str(n): mesh.get_local_rank(str(n)) for n in mesh.mesh_dim_names},
    }


def _dtensor_facts(dims: ParallelDims) -> dict[str, Any]:
    """A (rows, 3) tensor split by ``shard_range`` over the ZeRO mesh as ZeRO places it
    (Replicate over replica groups, Shard(0) within one), rebuilt with ``full_tensor``."""
    mesh = dims.zero_mesh
    n, r = mesh.size(1), mesh.get_local_rank(str(Axis.DP_SHARD_SP))
    full = torch.arange(DTENSOR_ROWS * 3, dtype=torch.float32).reshape(DTENSOR_ROWS, 3)
    start, end = shard_range(DTENSOR_ROWS, n, r)
    local = full[start:end].clone()
    dt = sharded_dtensor(local, mesh, (Replicate(), Shard(0)), full.shape)
    return {
        "shape": tuple(dt.shape),
        "stride": tuple(dt.stride()),
        "shares_storage": dt.to_local().data_ptr() == local.data_ptr() or local.numel() == 0,
        "full_equal": bool(torch.equal(dt.full_tensor(), full)),
    }


def collect_facts(layouts: dict[str, dict[str, int]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per layout, per check: what this rank sees. Collective checks run in the same order on
    every rank; each is wrapped by ``_attempt``."""
    facts: dict[str, dict[str, dict[str, Any]]] = {}
    for name, kwargs in layouts.items():
        dims = ParallelDims(world_size=dist.get_world_size(), **kwargs)
        f: dict[str, dict[str, Any]] = {}
        f["mesh"] = _attempt(lambda dims=dims: _mesh_facts(dims.mesh))
        for axis in MESH_AXES:
            f[f"coord:{axis}"] = _attempt(lambda dims=dims, axis=axis: dims.rank(axis))
            f[f"group:{axis}"] = _attempt(lambda dims=dims, axis=axis: _group_facts(dims.group(axis)))
        f["grad_mesh"] = _attempt(lambda dims=dims: _mesh_facts(dims.grad_mesh))
        f["grad_mesh_group"] = _attempt(lambda dims=dims: _group_facts(dims.grad_mesh.get_group()))
        f["shard_mesh"] = _attempt(lambda dims=dims: _mesh_facts(dims.shard_mesh))
        f["shard_mesh_group"] = _attempt(lambda dims=dims: _group_facts(dims.shard_mesh.get_group()))
        for axis in (Axis.DP_SP, Axis.DP_SHARD_SP):
            f[f"coord:{axis}"] = _attempt(lambda dims=dims, axis=axis: dims.rank(axis))
            f[f"group:{axis}"] = _attempt(lambda dims=dims, axis=axis: _ranks(dims.group(axis)))
        for axis in Axis:
            f[f"group_or_none:{axis}"] = _attempt(
                lambda dims=dims, axis=axis: None if (g := dims.group_or_none(axis)) is None else _ranks(g)
            )
        f["dp_rank"] = _attempt(lambda dims=dims: dims.dp_rank)
        f["pp_rank"] = _attempt(lambda dims=dims: dims.pp_rank)
        f["pp_groups"] = _attempt(lambda dims=dims: _pp_group_facts(dims))
        f["sequence_slice"] = _attempt(lambda dims=dims: _sequence_facts(dims))
        f["sequence_refused"] = _attempt(lambda dims=dims: _indivisible_sequence_refused(dims))
        f["zero_mesh"] = _attempt(lambda dims=dims: _mesh_facts(dims.zero_mesh))
        f["zero_tp_mesh"] = _attempt(lambda dims=dims: _mesh_facts(dims.zero_tp_mesh))
        f["sharded_dtensor"] = _attempt(lambda dims=dims: _dtensor_facts(dims))
        facts[name] = f
    facts["_process"] = {"is_main_process": _attempt(is_main_process), "launch_env": _attempt(launch_env)}
    # A flattened axis asked for by name on a ParallelDims whose grad_mesh / shard_mesh nobody
    # has built yet (each call on a new object, so nothing is cached by an earlier one).
    fresh = {"dp": 4, "dp_replicate": 2, "sp": 2, "world_size": dist.get_world_size()}
    facts["_fresh"] = {
        f"{kind}:{axis}": _attempt(lambda kind=kind, axis=axis: _fresh_lookup(ParallelDims(**fresh), kind, axis))
        for kind in ("group", "rank", "group_or_none")
        for axis in (Axis.DP_SP, Axis.DP_SHARD_SP)
    }
    return facts


def _fresh_lookup(dims: ParallelDims, kind: str, axis: Axis):
    if kind == "rank":
        return dims.rank(axis)
    return _ranks(getattr(dims, kind)(axis))


# ---------------------------------------------------------------------------- expected, from the formula


class Layout:
    """The expected coordinates and groups of a layout, from the rank formula alone."""

    def __init__(self, kwargs: dict[str, int]):
        self.dp = kwargs["dp"]
        rep = kwargs.get("dp_replicate", 1)
        self.sizes = {
            Axis.PP: kwargs.get("pp", 1),
            Axis.DP_REPLICATE: rep,
            Axis.DP_SHARD: self.dp // rep,
            Axis.SP: kwargs.get("sp", 1),
            Axis.TP: kwargs.get("tp", 1),
        }
        assert math.prod(self.sizes.values()) == WORLD

    def rank_of(self, coords: dict[Axis, int]) -> int:
        rank = 0
        for axis in MESH_AXES:
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def coords(self, rank: int) -> dict[Axis, int]:
        out = {}
        for axis in reversed(MESH_AXES):
            rank, out[axis] = divmod(rank, self.sizes[axis])
        return out

    def members(self, rank: int, axes: tuple[Axis, ...]) -> list[int]:
        """The ranks that share ``rank``'s coordinates outside ``axes``, in row-major order of
        ``axes`` (the flattened index along them)."""
        mine = self.coords(rank)
        out = []
        for values in itertools.product(*(range(self.sizes[a]) for a in axes)):
            out.append(self.rank_of({**mine, **dict(zip(axes, values, strict=True))}))
        return out

    def index(self, rank: int, axes: tuple[Axis, ...]) -> int:
        """``rank``'s flattened coordinate along ``axes`` (row-major)."""
        mine, idx = self.coords(rank), 0
        for axis in axes:
            idx = idx * self.sizes[axis] + mine[axis]
        return idx

    def grid(self, rank: int, axes: tuple[Axis, ...]) -> list:
        """The nested list of ranks of a mesh over ``axes`` through ``rank`` (a tuple of axes
        in ``axes`` means one flattened dimension)."""
        mine = self.coords(rank)

        def build(dims):
            if not dims:
                return None
            head, rest = dims[0], dims[1:]
            group = head if isinstance(head, tuple) else (head,)
            out = []
            for values in itertools.product(*(range(self.sizes[a]) for a in group)):
                mine.update(zip(group, values, strict=True))
                sub = build(rest)
                out.append(self.rank_of(mine) if sub is None else sub)
            return out

        return build(list(axes))


GRAD_AXES = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.SP)
SHARD_AXES = (Axis.DP_SHARD, Axis.SP)


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    # generous: on a loaded 2-core machine, starting 8 processes alone can take over a minute
    return spawn(collect_facts, WORLD, LAYOUTS, timeout_s=180)


def values(facts: list[dict], layout: str, check: str) -> list[Any]:
    """Each rank's value for ``check``; fails the test with the first rank's traceback if any
    rank's check raised."""
    out = []
    for rank, per_rank in enumerate(facts):
        result = per_rank[layout][check]
        if "error" in result:
            pytest.fail(f"{layout}: check {check!r} raised on rank {rank}:\n{result['error']}")
        out.append(result["value"])
    return out


def mismatches(got: list[Any], expected: list[Any]) -> str:
    return "\n".join(
        f"  rank {r}: got {g!r}, expected {e!r}" for r, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e
    )


layouts = pytest.mark.parametrize("layout", list(LAYOUTS))


# ---------------------------------------------------------------------------- tests


@layouts
def test_mesh_has_the_five_axes_in_order_with_ranks_by_the_formula(facts, layout):
    """Catches: a mesh with axes in another order or another rank grid (e.g. tp outermost, so
    tensor-parallel ranks land on different nodes), or size-1 axes dropped."""
    spec = Layout(LAYOUTS[layout])
    shape = tuple(spec.sizes[a] for a in MESH_AXES)
    expected_grid = torch.arange(WORLD).reshape(shape).tolist()
    for rank, mesh in enumerate(values(facts, layout, "mesh")):
        assert mesh["names"] == tuple(str(a) for a in MESH_AXES), f"rank {rank}"
        assert mesh["shape"] == shape, f"rank {rank}"
        assert mesh["ranks"] == expected_grid, f"rank {rank}"


@layouts
@pytest.mark.parametrize("axis", MESH_AXES, ids=str)
def test_coordinate_along_each_mesh_axis_follows_the_rank_formula(facts, layout, axis):
    """Catches: ``rank(axis)`` reading another axis's coordinate (e.g. dp_shard for
    dp_replicate), so ranks would load the wrong stage, data or weight slice."""
    spec = Layout(LAYOUTS[layout])
    got = values(facts, layout, f"coord:{axis}")
    expected = [spec.coords(r)[axis] for r in range(WORLD)]
    assert got == expected, f"{layout} {axis}:\n{mismatches(got, expected)}"


@layouts
@pytest.mark.parametrize("axis", MESH_AXES, ids=str)
def test_group_of_each_mesh_axis_holds_the_ranks_the_formula_gives(facts, layout, axis):
    """Catches: ``group(axis)`` returning another axis's group, or a group whose members or
    member order differ from the mesh (an all-reduce over the wrong ranks, or a rank's index
    in the group not its coordinate); the all-reduce sum shows the group really connects them."""
    spec = Layout(LAYOUTS[layout])
    got = values(facts, layout, f"group:{axis}")
    expected = []
    for r in range(WORLD):
        members = spec.members(r, (axis,))
        expected.append({"ranks": members, "group_rank": spec.coords(r)[axis], "sum": sum(members)})
    assert got == expected, f"{layout} {axis}:\n{mismatches(got, expected)}"


@layouts
@pytest.mark.parametrize(
    ("check", "axes", "name"),
    [("grad_mesh", GRAD_AXES, "dp_sp"), ("shard_mesh", SHARD_AXES, "dp_shard_sp")],
    ids=["grad_mesh", "shard_mesh"],
)
def test_flattened_mesh_spans_the_right_axes(facts, layout, check, axes, name):
    """Catches: gradients averaged over the wrong ranks (grad_mesh without dp_replicate or sp:
    replicas or sequence slices diverge; with tp or pp: different parameters averaged) and ZeRO
    sharding across replica groups (shard_mesh including dp_replicate)."""
    spec = Layout(LAYOUTS[layout])
    got_mesh = values(facts, layout, check)
    got_group = values(facts, layout, f"{check}_group")
    for r in range(WORLD):
        members = spec.members(r, axes)
        assert got_mesh[r]["names"] == (name,), f"{layout} rank {r}"
        assert got_mesh[r]["shape"] == (len(members),), f"{layout} rank {r}"
        assert got_mesh[r]["ranks"] == members, f"{layout} rank {r}"
        assert got_mesh[r]["coords"] == {name: spec.index(r, axes)}, f"{layout} rank {r}"
        expected = {"ranks": members, "group_rank": spec.index(r, axes), "sum": sum(members)}
        assert got_group[r] == expected, f"{layout} rank {r}"


@layouts
@pytest.mark.parametrize(
    ("axis", "axes"), [(Axis.DP_SP, GRAD_AXES), (Axis.DP_SHARD_SP, SHARD_AXES)], ids=["dp_sp", "dp_shard_sp"]
)
def test_group_and_rank_of_a_flattened_axis(facts, layout, axis, axes):
    """Catches: ``dims.group(Axis.DP_SP)`` / ``dims.rank(...)`` on the root mesh resolving a
    flattened name to another group than the flattened mesh's own (callers use both)."""
    spec = Layout(LAYOUTS[layout])
    got_ranks = values(facts, layout, f"group:{axis}")
    got_coord = values(facts, layout, f"coord:{axis}")
    expected_ranks = [spec.members(r, axes) for r in range(WORLD)]
    expected_coord = [spec.index(r, axes) for r in range(WORLD)]
    assert got_ranks == expected_ranks, f"{layout} {axis}:\n{mismatches(got_ranks, expected_ranks)}"
    assert got_coord == expected_coord, f"{layout} {axis}:\n{mismatches(got_coord, expected_coord)}"


@layouts
@pytest.mark.parametrize("axis", list(Axis), ids=str)
def test_group_or_none(facts, layout, axis):
    """Catches: ``group_or_none`` returning a group for an axis of one rank (a useless
    collective) or None for a real one (norm or overflow not agreed across ranks); or, for the
    2D grid axes of these 1D layouts, building a grid mesh that does not exist."""
    spec = Layout(LAYOUTS[layout])
    axes = {Axis.DP_SP: GRAD_AXES, Axis.DP_SHARD_SP: SHARD_AXES}.get(axis, (axis,))
    got = values(facts, layout, f"group_or_none:{axis}")
    if axis in (Axis.TP_ROW, Axis.TP_COL):
        assert got == [None] * WORLD, f"{layout} {axis}: {got}"
        return
    expected = [None if len(m := spec.members(r, axes)) == 1 else m for r in range(WORLD)]
    assert got == expected, f"{layout} {axis}:\n{mismatches(got, expected)}"


@layouts
def test_dp_rank_is_replica_major_and_covers_every_data_parallel_index(facts, layout):
    """Catches: two data-parallel ranks reading the same micro-batches (dp_rank repeated, e.g.
    shard-major or ignoring dp_replicate) or an index left unread; sp, tp and pp ranks of one
    dp index must share it (they read the same batch)."""
    spec = Layout(LAYOUTS[layout])
    got = values(facts, layout, "dp_rank")
    expected = [spec.index(r, (Axis.DP_REPLICATE, Axis.DP_SHARD)) for r in range(WORLD)]
    assert got == expected, f"{layout}:\n{mismatches(got, expected)}"
    positions: dict[tuple[int, int, int], list[int]] = {}
    for r in range(WORLD):
        c = spec.coords(r)
        positions.setdefault((c[Axis.PP], c[Axis.SP], c[Axis.TP]), []).append(got[r])
    for position, dp_ranks in positions.items():
        assert sorted(dp_ranks) == list(range(spec.dp)), f"(pp, sp, tp)={position}: {dp_ranks}"


@layouts
def test_pp_rank(facts, layout):
    """Catches: ``pp_rank`` reading another axis, so a rank would build another rank's stages."""
    spec = Layout(LAYOUTS[layout])
    got = values(facts, layout, "pp_rank")
    expected = [spec.coords(r)[Axis.PP] for r in range(WORLD)]
    assert got == expected, f"{layout}:\n{mismatches(got, expected)}"


@layouts
def test_pp_groups_are_two_distinct_groups_over_the_same_pipeline_ranks(facts, layout):
    """Catches: the "gradient" group being the "activation" group (forward and backward sends
    sharing one channel can deadlock in 1F1B), or built over another line of the mesh than the
    pp axis (sends to a rank of another data-parallel replica)."""
    spec = Layout(LAYOUTS[layout])
    for r, got in enumerate(values(facts, layout, "pp_groups")):
        members = spec.members(r, (Axis.PP,))
        expected = {"ranks": members, "group_rank": spec.coords(r)[Axis.PP], "sum": sum(members)}
        assert got["keys"] == ["activation", "gradient"], f"rank {r}"
        assert got["activation"] == expected, f"{layout} rank {r} activation"
        assert got["gradient"] == expected, f"{layout} rank {r} gradient"
        assert not got["same_object"], f"{layout} rank {r}: one group object for both directions"
        assert not got["same_name"], f"{layout} rank {r}: both groups have the same name (one communicator)"
        assert got["activation_is_mesh_pp_group"], f"{layout} rank {r}"
        assert got["cached"], f"{layout} rank {r}: pp_groups builds new groups on every access"


@layouts
def test_sequence_slice_partitions_the_sequence_over_sp_ranks(facts, layout):
    """Catches: sequence slices that overlap or leave a gap (tokens trained twice or never),
    slices ordered by another coordinate than sp, or slices that differ across dp/tp/pp ranks
    of one sp coordinate."""
    spec = Layout(LAYOUTS[layout])
    got = values(facts, layout, "sequence_slice")
    sp = spec.sizes[Axis.SP]
    for seq_len in SEQ_LENS:
        for r in range(WORLD):
            part, c = seq_len // sp, spec.coords(r)[Axis.SP]
            assert got[r][seq_len] == (c * part, (c + 1) * part, None), f"{layout} rank {r} seq_len {seq_len}"
        # the sp ranks of every (pp, dp, tp) position together hold every position exactly once
        for r in range(WORLD):
            covered = sorted(i for m in spec.members(r, (Axis.SP,)) for i in range(*got[m][seq_len][:2]))
            assert covered == list(range(seq_len)), f"{layout} sp group of rank {r}, seq_len {seq_len}"


@layouts
def test_sequence_length_not_divisible_by_sp_is_refused_on_every_rank(facts, layout):
    """Catches: an indivisible sequence split by floor division on some ranks (tokens dropped)."""
    sp = Layout(LAYOUTS[layout]).sizes[Axis.SP]
    for r, message in enumerate(values(facts, layout, "sequence_refused")):
        if sp == 1:
            assert message is None
        else:
            assert message is not None and "parallel.sequence_parallel_degree" in message, f"rank {r}: {message}"


@layouts
@pytest.mark.parametrize(
    ("check", "dims"),
    [
        ("zero_mesh", (Axis.DP_REPLICATE, SHARD_AXES)),
        ("zero_tp_mesh", (Axis.DP_REPLICATE, SHARD_AXES, Axis.TP)),
    ],
    ids=["zero_mesh", "zero_tp_mesh"],
)
def test_zero_meshes_have_the_expected_shape_names_and_ranks(facts, layout, check, dims):
    """Catches: ZeRO master shards placed on the wrong ranks: dimensions swapped (replica
    groups sharded, shards replicated), dp_shard_sp not the flattened dp_shard × sp, or a mesh
    that crosses pipeline ranks (or tp ranks, for the 2-D one)."""
    spec = Layout(LAYOUTS[layout])
    names = tuple("dp_shard_sp" if isinstance(d, tuple) else str(d) for d in dims)
    shape = tuple(math.prod(spec.sizes[a] for a in d) if isinstance(d, tuple) else spec.sizes[d] for d in dims)
    for r, got in enumerate(values(facts, layout, check)):
        assert got["names"] == names, f"{layout} rank {r}"
        assert got["shape"] == shape, f"{layout} rank {r}"
        assert got["ranks"] == spec.grid(r, dims), f"{layout} rank {r}"
        assert got["groups"]["dp_replicate"] == spec.members(r, (Axis.DP_REPLICATE,)), f"{layout} rank {r}"
        assert got["groups"]["dp_shard_sp"] == spec.members(r, SHARD_AXES), f"{layout} rank {r}"
        assert got["coords"]["dp_shard_sp"] == spec.index(r, SHARD_AXES), f"{layout} rank {r}"
        if Axis.TP in dims:
            assert got["groups"]["tp"] == spec.members(r, (Axis.TP,)), f"{layout} rank {r}"


@layouts
def test_sharded_dtensor_on_the_zero_mesh_rebuilds_the_full_tensor(facts, layout):
    """Catches: ``sharded_dtensor`` with a wrong global stride or shape, a copy instead of a
    view of the local part, or shard_range's uneven split disagreeing with DTensor's Shard(0)
    (the full tensor gathered from the shards would differ)."""
    for r, got in enumerate(values(facts, layout, "sharded_dtensor")):
        assert got["shape"] == (DTENSOR_ROWS, 3), f"rank {r}"
        assert got["stride"] == (3, 1), f"rank {r}"
        assert got["shares_storage"], f"rank {r}: to_local() is a copy"
        assert got["full_equal"], f"rank {r}: full_tensor() differs from the tensor that was split"


def test_is_main_process_only_on_global_rank_zero(facts):
    """Catches: the main process decided by a local or mesh rank (several ranks writing the
    same files, or none)."""
    got = []
    for rank, per_rank in enumerate(facts):
        result = per_rank["_process"]["is_main_process"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        got.append(result["value"])
    assert got == [True] + [False] * (WORLD - 1)


def test_launch_env_in_spawned_ranks_matches_the_process_group(facts):
    """Catches: ``launch_env`` reading the launcher's variables wrongly (rank or world size
    not the process group's), under a real launcher environment rather than a monkeypatched one."""
    for rank, per_rank in enumerate(facts):
        result = per_rank["_process"]["launch_env"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        assert (result["value"].rank, result["value"].world_size) == (rank, WORLD)


@pytest.mark.parametrize("kind", ["group", "rank", "group_or_none"])
@pytest.mark.parametrize(
    ("axis", "axes"), [(Axis.DP_SP, GRAD_AXES), (Axis.DP_SHARD_SP, SHARD_AXES)], ids=["dp_sp", "dp_shard_sp"]
)
def test_flattened_axis_by_name_before_its_mesh_was_accessed(facts, kind, axis, axes):
    """Catches: a flattened axis that only resolves if some other code touched ``grad_mesh`` /
    ``shard_mesh`` first, so ``dims.group_or_none(Axis.DP_SP)`` (which ``degree`` accepts) fails
    or works depending on call order."""
    spec = Layout({"dp": 4, "dp_replicate": 2, "sp": 2})
    for rank, per_rank in enumerate(facts):
        result = per_rank["_fresh"][f"{kind}:{axis}"]
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        expected = spec.index(rank, axes) if kind == "rank" else spec.members(rank, axes)
        assert result["value"] == expected, f"rank {rank}"
