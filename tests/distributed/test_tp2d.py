"""2D tensor parallelism (SUMMA / Optimus) at q = 2 (4 ranks) against the unsharded single process.

Every rank builds the unsharded layer or model from the same seed and runs it as the reference,
then shards a copy with :func:`parallelize_2d` and runs that on its blocks. Outputs and every
parameter and input gradient must equal the reference's matching block within an absolute
tolerance: TOL_FP64 in float64 (only the order of the sums differs), TOL_FP32 in float32. The
vocabulary (65) is not a multiple of q, so the padding row and column are exercised. One spawn
runs every check (``checks.run_checks``); each test reads its own checks' results on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from loomtrain.config import ModelConfig
from loomtrain.distributed.tensor_parallel_2d import Grid2D, Linear2D
from loomtrain.distributed.traffic import Traffic
from loomtrain.models import Transformer
from loomtrain.models.tp2d import Transformer2D, parallelize_2d
from tests.distributed.checks import check_result, run_checks, spawn_once

Q, WORLD = 2, 4
B, S, IN, OUT = 4, 8, 12, 6
TOL_FP64, TOL_FP32 = 1e-10, 1e-5
CFG = ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, dim=16, ffn_hidden_dim=24, max_seq_len=16, vocab_size=65)
TIED = CFG.model_copy(update={"tie_embeddings": True})


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference block {tuple(want.shape)}")
    return float((got.detach() - want.detach()).abs().max())


def _models(
    dtype: torch.dtype, grid: Grid2D, traffic: Traffic | None = None, cfg: ModelConfig = CFG
) -> tuple[Transformer, Transformer2D]:
    torch.manual_seed(0)
    ref = Transformer(cfg).to(dtype)
    return ref, parallelize_2d(copy.deepcopy(ref), grid, traffic)


def _param_diffs(ref: torch.nn.Module, par: Transformer2D, prefix: str) -> dict[str, float]:
    """Max |gradient − reference block| of every parameter of ``ref`` (``prefix``: its path in the model)."""
    out = {}
    for name, p in ref.named_parameters():
        full_name = f"{prefix}{name}"
        got = par.model.get_parameter(full_name).grad
        out[f"grad {full_name}"] = _diff(got, par.local_part(full_name, p.grad))
    return out


def check_linear(grid: Grid2D) -> dict:
    torch.manual_seed(1)
    full = torch.nn.Linear(IN, OUT, bias=False).double()
    x = torch.randn(B, S, IN, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(B, S, OUT, dtype=torch.float64)
    want = full(x)
    (want * gy).sum().backward()
    traffic = Traffic()
    layer = Linear2D.from_linear(full, grid, traffic)
    x_local = grid.block(x, 0, 2).requires_grad_()
    y = layer(x_local)
    (y * grid.block(gy, 0, 2)).sum().backward()
    return {
        "diffs": {
            "output": _diff(y, grid.block(want, 0, 2)),
            "input grad": _diff(x_local.grad, grid.block(x.grad, 0, 2)),
            "weight grad": _diff(layer.weight.grad, Linear2D.local_part(grid, full.weight.grad)),
        },
        "traffic": traffic.snapshot(),
    }


def check_submodule(grid: Grid2D, path: str, with_rope: bool) -> dict:
    """Forward and backward of ``layers.0`` (or a part of it) in float64, from a random input:
    the max differences and the bytes counted."""
    traffic = Traffic()
    ref, par = _models(torch.float64, grid, traffic)
    ref_mod, par_mod = ref.get_submodule(path), par.model.get_submodule(path)
    x = torch.randn(B, S, CFG.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    gy = torch.randn(B, S, CFG.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rope = (ref.rope_cos, ref.rope_sin) if with_rope else ()
    want = ref_mod(x, *rope)
    (want * gy).sum().backward()
    x_local = grid.block(x, 0, 2).requires_grad_()
    y = par_mod(x_local, *rope)
    (y * grid.block(gy, 0, 2)).sum().backward()
    diffs = {"output": _diff(y, grid.block(want, 0, 2)), "input grad": _diff(x_local.grad, grid.block(x.grad, 0, 2))}
    return {"diffs": diffs | _param_diffs(ref_mod, par, f"{path}."), "traffic": traffic.snapshot()}


def check_model(grid: Grid2D, dtype: torch.dtype, cfg: ModelConfig = CFG) -> dict:
    """Loss, logits and every parameter gradient of the whole model."""
    ref, par = _models(dtype, grid, cfg=cfg)
    tokens = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(4))
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    logits = ref(inputs)
    want = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    want.backward()
    loss = par(inputs, target)
    loss.backward()
    padded = F.pad(logits.detach(), (0, Q * -(-CFG.vocab_size // Q) - CFG.vocab_size))
    diffs = {"loss": _diff(loss, want), "logits": _diff(par.logits(inputs), grid.block(padded, 0, 2))}
    return diffs | _param_diffs(ref, par, "")


def check_indivisible_batch(grid: Grid2D) -> str:
    _, par = _models(torch.float32, grid)
    tokens = torch.zeros(3, S, dtype=torch.long)
    try:
        par(tokens, tokens)
    except ValueError as err:
        return str(err)
    return "no error"


def check_mesh_grid(grid: Grid2D) -> tuple:
    mesh = DeviceMesh("cpu", torch.arange(WORLD).view(Q, Q), mesh_dim_names=("tp_row", "tp_col"))
    g = Grid2D.from_mesh(mesh, "tp_row", "tp_col")
    return (g.row, g.col, g.row_ranks, g.col_ranks, g.transpose_rank), (
        grid.row, grid.col, grid.row_ranks, grid.col_ranks, grid.transpose_rank)  # fmt: skip


def run_all() -> dict:
    """Every check of this file, in one spawn of 4 ranks."""
    grid = Grid2D.from_ranks(range(dist.get_world_size()))
    return run_checks(
        {
            "linear": lambda: check_linear(grid),
            "mlp": lambda: check_submodule(grid, "layers.0.feed_forward", with_rope=False),
            "attention": lambda: check_submodule(grid, "layers.0.attention", with_rope=True),
            "block": lambda: check_submodule(grid, "layers.0", with_rope=True),
            "model fp64": lambda: check_model(grid, torch.float64),
            "model fp32": lambda: check_model(grid, torch.float32),
            "model tied fp64": lambda: check_model(grid, torch.float64, TIED),
            "indivisible batch": lambda: check_indivisible_batch(grid),
            "mesh grid": lambda: check_mesh_grid(grid),
        }
    )


def _results() -> list:
    return spawn_once(run_all, WORLD, timeout_s=120)


def _assert_within(name: str, tol: float, key: str | None = None) -> None:
    for rank in range(WORLD):
        got = check_result(_results(), name, rank)
        diffs = got[key] if key else got
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= tol, f"{name}, rank {rank}: {worst} differs by {diffs[worst]:.3g} > {tol:g}"


def test_linear_2d_equals_single_process():
    """Catches: a SUMMA step that broadcasts the wrong block (source row/column swapped), a
    weight block taken as (i, j) of nn.Linear's [out, in] instead of its transpose, a backward
    that reduces dA along the column instead of the row or keeps a non-owner's partial sum."""
    _assert_within("linear", TOL_FP64, "diffs")


def test_linear_2d_counts_summa_bytes():
    """Catches: a broadcast or reduce not counted, counted on the wrong grid axis, counted in
    full instead of (q−1)/q, or backward that sends more than the 2 × forward of the formula."""
    m, e = B * S, 8
    want = {"tp_row": 3 * (Q - 1) * m * IN * e // Q**2, "tp_col": 3 * (Q - 1) * IN * OUT * e // Q**2}
    for rank in range(WORLD):
        assert check_result(_results(), "linear", rank)["traffic"] == want


@pytest.mark.parametrize("name", ["mlp", "attention", "block"])
def test_block_parts_2d_equal_single_process(name):
    """Catches: heads split over the grid differently from the projection columns (query heads
    paired with another column's key/value heads under GQA), a 2D RMSNorm that divides by D/q
    or skips the all-reduce, a norm weight gradient not summed over the grid column."""
    _assert_within(name, TOL_FP64, "diffs")


def test_block_2d_counts_the_documented_bytes():
    """Catches: a block whose counted bytes drift from docs/tensor_parallel_2d.md's formula (a
    GEMM broadcasting its input twice, a norm all-reduce counted on the wrong axis or not at
    all, the norm weights' gradient all-reduce missing)."""
    h, f, kv, m, e = CFG.dim, CFG.hidden_dim, CFG.kv_heads * CFG.head_dim, B * S, 8
    gemm_row = 3 * (Q - 1) * m * e * (6 * h + f) // Q**2
    gemm_col = 3 * (Q - 1) * e * (2 * h * h + 2 * h * kv + 3 * h * f) // Q**2
    norms_row, norms_col = 8 * (Q - 1) * m * e // Q**2, 4 * (Q - 1) * h * e // Q**2
    want = {"tp_row": gemm_row + norms_row, "tp_col": gemm_col + norms_col}
    for rank in range(WORLD):
        assert check_result(_results(), "block", rank)["traffic"] == want


@pytest.mark.parametrize(("name", "tol"), [("model fp64", TOL_FP64), ("model fp32", TOL_FP32),
                                           ("model tied fp64", TOL_FP64)])  # fmt: skip
def test_whole_model_2d_equals_single_process(name, tol):
    """Catches: the padding vocabulary column predicted (loss would count exp(0) for it), the
    loss averaged over one grid row only or summed over rows, embedding rows of the wrong
    vocabulary block, a batch scattered to the wrong grid row, and any gradient not flowing;
    with tied embeddings, the head's block (j, i) looked up as if it were (i, j) (no exchange with
    the transposed rank) or the tied weight's gradient missing one of its two uses."""
    _assert_within(name, tol)


def test_indivisible_micro_batch_is_refused():
    """Catches: a micro-batch of 3 sequences on a 2×2 grid silently split unevenly (or hanging
    in the reduce-scatter) instead of refused with the field to change."""
    for rank in range(WORLD):
        assert "training.micro_batch_size" in check_result(_results(), "indivisible batch", rank)


def test_grid_from_mesh_matches_grid_from_ranks():
    """Catches: the mesh constructor swapping the row and column groups or coordinates, or
    either constructor naming a transposed rank other than the one at (j, i)."""
    for rank in range(WORLD):
        from_mesh, from_ranks = check_result(_results(), "mesh grid", rank)
        assert from_mesh == from_ranks
        assert from_ranks[4] == (rank % Q) * Q + rank // Q
