"""2D tensor parallelism on a q × q grid of ranks (Optimus): SUMMA linear layers, a 2D RMSNorm,
a 2D embedding and a vocabulary-parallel cross-entropy; model-agnostic (the Llama plan is
``models/tp2d.py``).

Sources: Xu, Li, Zhang, You, "An Efficient 2D Method for Training Super-Large Deep Learning
Models" (Optimus, 2021) §3; van de Geijn & Watts, "SUMMA: Scalable Universal Matrix
Multiplication Algorithm" (1997) §2-3.

Layout. Rank ``(i, j)`` (grid row ``i``, grid column ``j``) holds block ``(i, j)`` of every
matrix: rows ``[i·R/q, (i+1)·R/q)`` and columns ``[j·C/q, (j+1)·C/q)`` of an ``[R, C]`` matrix,
every split even. Activations ``[B, S, D]`` are matrices ``[B·S, D]`` split by sequence
(``B/q`` whole sequences per grid row) and by feature: rank ``(i, j)`` holds ``[B/q, S, D/q]``.
A linear weight ``W`` ``[in, out]`` (``nn.Linear.weight`` is ``Wᵀ``) is split by input features
over ``i`` and output features over ``j``. Every tensor is ``1/q²`` of the full one, except the
norm weights (``D/q``, replicated over a grid column).

Heads. A projection to ``H·head_dim`` features gives rank ``(i, j)`` output columns
``[j·H·head_dim/q, (j+1)·H·head_dim/q)``: the whole query heads ``[j·H/q, (j+1)·H/q)`` of its
``B/q`` sequences, and likewise the key/value heads ``[j·Hkv/q, (j+1)·Hkv/q)``. With ``H`` and
``Hkv`` divisible by ``q`` these are the key/value heads that the query heads of column ``j``
read under grouped-query attention (query head ``h`` reads key/value head ``h·Hkv/H``), so
attention runs locally on each rank, over ``B/q`` sequences × ``H/q`` heads, with no
communication; heads are split ``q`` ways (over grid columns) and sequences ``q`` ways (over
grid rows).

Communication counting (recorded in an optional :class:`~loomtrain.distributed.traffic.Traffic`
under the grid's two axis names): the collectives along a grid row count under
``Grid2D.row_axis``, those along a grid column under ``Grid2D.col_axis``. A broadcast or a
reduce of ``M`` bytes over ``n`` ranks counts ``(n−1)/n·M`` bytes per rank: a pipelined chain
moves ``(n−1)·M`` bytes in all (every rank but one sends the message once), which is also
what an all-gather of ``M`` bytes in all moves, so they are recorded as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from loomtrain.distributed.parallel_dims import sharded_dtensor
from loomtrain.distributed.tensor_parallel import (
    _record,
    all_reduce_grad_hook,
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter_along,
    vocab_parallel_cross_entropy,
)
from loomtrain.distributed.traffic import Traffic

BATCH_DIM = 0
# A 2D shard's layout: its placements on the grid mesh (tp_row, tp_col) and its full shape.
GridShard = tuple[tuple[Placement, Placement], torch.Size]


@dataclass(frozen=True)
class Grid2D:
    """This rank's place on a ``q × q`` grid: grid row ``row`` (``i``) and column ``col`` (``j``).

    ``row_group`` joins the ``q`` ranks of grid row ``i`` (columns ``0..q−1``), ``col_group``
    the ``q`` ranks of grid column ``j``. ``row_ranks[k]`` is the global rank at ``(i, k)``,
    ``col_ranks[k]`` the one at ``(k, j)``. A rank's rank in ``row_group`` is its column and in
    ``col_group`` its row (checked): reduce-scatters and the cross-entropy rely on it.
    ``row_axis`` and ``col_axis`` name the two directions in a traffic count.
    ``transpose_rank``: the global rank at ``(j, i)``, which holds the transposed block (tied
    embeddings exchange with it).
    """

    q: int
    row: int
    col: int
    row_group: dist.ProcessGroup
    col_group: dist.ProcessGroup
    row_ranks: tuple[int, ...]
    col_ranks: tuple[int, ...]
    row_axis: str = "tp_row"
    col_axis: str = "tp_col"
    transpose_rank: int | None = None

    def __post_init__(self) -> None:
        for name, group, coord in (("row", self.row_group, self.col), ("column", self.col_group, self.row)):
            if dist.get_rank(group) != coord:
                raise ValueError(
                    f"this rank is rank {dist.get_rank(group)} of its grid {name} group but at coordinate {coord}; "
                    "order each grid row and column by increasing global rank (a rank order that keeps them sorted)"
                )

    @classmethod
    def from_ranks(cls, ranks: Sequence[int], row_axis: str = "tp_row", col_axis: str = "tp_col") -> Grid2D:
        """The grid of ``ranks`` (``q²`` global ranks, row-major: ``ranks[i·q + j]`` is at
        ``(i, j)``). Every process of the default group must call it with the same ``ranks``
        (``dist.new_group`` is collective), the ranks in ``ranks`` too.

        Raises:
            ValueError: ``len(ranks)`` is not a perfect square, this rank is not in ``ranks``,
                or a grid row or column is not in increasing rank order.
        """
        q = math.isqrt(len(ranks))
        if q * q != len(ranks):
            raise ValueError(f"a 2D grid needs q² ranks, got {len(ranks)}; {nearest_squares(len(ranks))}")
        ranks = [int(r) for r in ranks]
        rows = [ranks[i * q : (i + 1) * q] for i in range(q)]
        cols = [ranks[j::q] for j in range(q)]
        groups = [dist.new_group(g) for g in rows + cols]
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not in the grid's ranks {ranks}; build a grid for each q² ranks")
        i, j = divmod(ranks.index(me), q)
        return cls(q, i, j, groups[i], groups[q + j], tuple(rows[i]), tuple(cols[j]), row_axis, col_axis,
                   transpose_rank=ranks[j * q + i])  # fmt: skip

    @classmethod
    def from_mesh(cls, mesh, row_dim: str, col_dim: str) -> Grid2D:
        """The grid of two named dimensions of a ``DeviceMesh`` of equal size ``q``: ``row_dim``
        indexes grid rows (``i``), ``col_dim`` grid columns (``j``). Traffic is counted under
        the dimension names: along a grid row (varying ``j``) as ``col_dim``, along a grid column
        as ``row_dim``.

        Raises:
            ValueError: the two dimensions differ in size, or their groups are not in coordinate order.
        """
        q, q_col = mesh.size(mesh.mesh_dim_names.index(row_dim)), mesh.size(mesh.mesh_dim_names.index(col_dim))
        if q != q_col:
            raise ValueError(f"mesh dimensions {row_dim!r}={q} and {col_dim!r}={q_col} must have equal sizes (q × q)")
        row_group, col_group = mesh.get_group(col_dim), mesh.get_group(row_dim)
        i, j = mesh.get_local_rank(row_dim), mesh.get_local_rank(col_dim)
        grid_ranks = mesh[(row_dim, col_dim)].mesh
        return cls(q, i, j, row_group, col_group,
                   tuple(dist.get_process_group_ranks(row_group)), tuple(dist.get_process_group_ranks(col_group)),
                   row_axis=col_dim, col_axis=row_dim, transpose_rank=int(grid_ranks[j, i]))  # fmt: skip

    def block(self, full: torch.Tensor, row_dim: int | None, col_dim: int | None) -> torch.Tensor:
        """This rank's block of ``full``, split evenly ``q`` ways along ``row_dim`` by the grid
        row and along ``col_dim`` by the grid column (``None``: not split that way); a new
        contiguous tensor.

        Raises:
            ValueError: a split dimension is not divisible by ``q``.
        """
        out = full.detach()
        for dim, index in ((row_dim, self.row), (col_dim, self.col)):
            if dim is None:
                continue
            if out.shape[dim] % self.q:
                raise ValueError(f"dimension {dim} of size {out.shape[dim]} is not divisible by grid side q={self.q}")
            size = out.shape[dim] // self.q
            out = out.narrow(dim, index * size, size)
        return out.clone(memory_format=torch.contiguous_format)


def nearest_squares(n: int) -> str:
    """The perfect squares just below and above ``n``, as a sentence for error messages."""
    low = math.isqrt(n)
    return f"the nearest valid sizes are {low * low} ({low}×{low}) and {(low + 1) ** 2} ({low + 1}×{low + 1})"


def check_2d_shapes(
    tp: int,
    *,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_hidden_dim: int,
    micro_batch_size: int | None = None,
) -> int:
    """Refuse a model and batch that 2D tensor parallelism over ``tp`` ranks cannot split evenly;
    pure (no process group), for the config's checks before launch.

    ``tp`` must be ``q²``; ``dim`` (hidden size), ``n_heads``, ``n_kv_heads`` (whole heads per
    grid column, see the module docstring), ``ffn_hidden_dim`` (SwiGLU width, a SUMMA block
    dimension) and ``micro_batch_size`` (whole sequences per grid row; ``None``: not checked
    here, the embedding checks each micro-batch) must be multiples of ``q``. The vocabulary
    needs no check (it is padded); tied embeddings are :class:`TiedEmbedding2D`.

    Returns:
        ``q``.
    Raises:
        ValueError: naming every offending field and the fix.
    """
    q = math.isqrt(tp) if tp >= 1 else 0
    if q * q != tp or tp < 1:
        raise ValueError(
            f"parallel.tensor_parallel_degree={tp} is not a perfect square: 2D tensor parallelism needs a q × q "
            f"grid; {nearest_squares(max(tp, 1))}"
        )
    fields = {"model.dim": dim, "model.n_heads": n_heads, "model.n_kv_heads": n_kv_heads,
              "model.ffn_hidden_dim": ffn_hidden_dim, "training.micro_batch_size": micro_batch_size}  # fmt: skip
    problems = [f"{name}={value} is not a multiple of q={q}" for name, value in fields.items()
                if value is not None and value % q]  # fmt: skip
    if problems:
        raise ValueError(
            f"2D tensor parallelism on a {q}×{q} grid (parallel.tensor_parallel_degree={tp}): "
            + "; ".join(problems)
            + f"; make each of these a multiple of {q} or choose another degree"
        )
    return q


def _broadcast(x: torch.Tensor, src: int, group, ranks: Sequence[int], me: int, traffic, axis: str) -> torch.Tensor:
    """``x`` of the rank at coordinate ``src`` along ``group`` (this rank is at ``me``); every
    rank's ``x`` has the same shape. The source's tensor is returned as it is, not copied."""
    buf = x.contiguous() if me == src else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = len(ranks)
    if n > 1:
        dist.broadcast(buf, src=ranks[src], group=group)
        _record(traffic, "all_gather", axis, buf.numel() * buf.element_size(), n)
    return buf


def _reduce(x: torch.Tensor, dst: int, group, ranks: Sequence[int], traffic, axis: str) -> torch.Tensor:
    """Sum of ``x`` over ``group``, valid on the rank at coordinate ``dst`` (in place in ``x``)."""
    n = len(ranks)
    if n > 1:
        dist.reduce(x, dst=ranks[dst], group=group)
        _record(traffic, "reduce_scatter", axis, x.numel() * x.element_size(), n)
    return x


def _row_bcast(x, src: int, g: Grid2D, traffic):
    return _broadcast(x, src, g.row_group, g.row_ranks, g.col, traffic, g.row_axis)


def _col_bcast(x, src: int, g: Grid2D, traffic):
    return _broadcast(x, src, g.col_group, g.col_ranks, g.row, traffic, g.col_axis)


def summa_ab(a: torch.Tensor, b: torch.Tensor, g: Grid2D, traffic: Traffic | None = None) -> torch.Tensor:
    """``C = A·B`` by SUMMA (van de Geijn & Watts §2): at step ``k`` the rank at ``(i, k)``
    broadcasts ``A_ik`` along grid row ``i`` and the rank at ``(k, j)`` broadcasts ``B_kj``
    along grid column ``j``; every rank adds ``A_ik·B_kj`` to its ``C_ij``.

    Shapes: ``a`` ``[m/q, k/q]``, ``b`` ``[k/q, n/q]`` (this rank's blocks) → ``[m/q, n/q]``.
    Per rank: ``q`` broadcasts of ``A``'s block on the row axis and of ``B``'s on the column axis.
    """
    c = a.new_zeros(a.shape[0], b.shape[1])
    for k in range(g.q):
        c.addmm_(_row_bcast(a, k, g, traffic), _col_bcast(b, k, g, traffic))
    return c


def summa_abt(c: torch.Tensor, b: torch.Tensor, g: Grid2D, traffic: Traffic | None = None) -> torch.Tensor:
    """``A = C·Bᵀ`` (the input gradient of ``C = A·B``; Optimus §3): at step ``k`` the rank at
    ``(k, j)`` broadcasts ``B_kj`` along grid column ``j``, every rank forms ``C_ij·B_kjᵀ``, and
    these are reduced (summed over ``j``) along grid row ``i`` onto the rank at ``(i, k)``.

    Shapes: ``c`` ``[m/q, n/q]``, ``b`` ``[k/q, n/q]`` → ``[m/q, k/q]``. Per rank: ``q``
    broadcasts of ``B``'s block (column axis) and ``q`` reduces of ``A``'s block (row axis).
    """
    out = None
    for k in range(g.q):
        part = _reduce(c @ _col_bcast(b, k, g, traffic).t(), k, g.row_group, g.row_ranks, traffic, g.row_axis)
        if k == g.col:
            out = part
    return out


def summa_atb(a: torch.Tensor, c: torch.Tensor, g: Grid2D, traffic: Traffic | None = None) -> torch.Tensor:
    """``B = Aᵀ·C`` (the weight gradient of ``C = A·B``; Optimus §3): at step ``k`` the rank at
    ``(i, k)`` broadcasts ``A_ik`` along grid row ``i``, every rank forms ``A_ikᵀ·C_ij``, and
    these are reduced (summed over ``i``) along grid column ``j`` onto the rank at ``(k, j)``.

    Shapes: ``a`` ``[m/q, k/q]``, ``c`` ``[m/q, n/q]`` → ``[k/q, n/q]``. Per rank: ``q``
    broadcasts of ``A``'s block (row axis) and ``q`` reduces of ``B``'s block (column axis).
    """
    out = None
    for k in range(g.q):
        part = _reduce(_row_bcast(a, k, g, traffic).t() @ c, k, g.col_group, g.col_ranks, traffic, g.col_axis)
        if k == g.row:
            out = part
    return out


class _SummaMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, grid, traffic):
        ctx.save_for_backward(a, b)
        ctx.comm = (grid, traffic)
        return summa_ab(a, b, grid, traffic)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = summa_abt(grad, b, *ctx.comm) if ctx.needs_input_grad[0] else None
        grad_b = summa_atb(a, grad, *ctx.comm) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None


def summa_matmul(a: torch.Tensor, b: torch.Tensor, grid: Grid2D, traffic: Traffic | None = None) -> torch.Tensor:
    """Differentiable ``A·B`` of 2D-blocked matrices (Optimus §3): forward :func:`summa_ab`,
    backward :func:`summa_abt` for ``dA = dC·Bᵀ`` and :func:`summa_atb` for ``dB = Aᵀ·dC``.
    The broadcast blocks are not kept for backward but sent again (memory stays ``O(1/q²)``).

    Shapes: ``a`` ``[m/q, k/q]``, ``b`` ``[k/q, n/q]`` → ``[m/q, n/q]``; every rank's blocks of
    one matrix have the same shape. Bytes per rank, ``e`` bytes per element, in forward
    ``(q−1)/q²·(mk + kn)·e``, in backward twice that (see ``docs/tensor_parallel_2d.md``).
    """
    return _SummaMatmul.apply(a, b, grid, traffic)


class Linear2D(nn.Module):
    """``y = x·Wᵀ`` (``nn.Linear`` without bias) as a SUMMA product on the grid.

    ``weight`` ``[out/q, in/q]`` is block ``(j, i)`` of the ``[out, in]`` ``nn.Linear`` weight
    (block ``(i, j)`` of ``W = weightᵀ``). Shapes: ``x`` ``[B/q, S, in/q]`` → ``[B/q, S, out/q]``.
    ``PLACEMENTS``: the weight's layout on the grid mesh ``(tp_row, tp_col)``, for DTensor.
    """

    PLACEMENTS: tuple[Placement, Placement] = (Shard(1), Shard(0))

    def __init__(self, weight: nn.Parameter, grid: Grid2D, traffic: Traffic | None = None):
        super().__init__()
        self.weight = weight
        self.grid = grid
        self.traffic = traffic

    @staticmethod
    def local_part(grid: Grid2D, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full ``[out, in]`` weight (or its gradient).

        Raises:
            ValueError: ``out`` or ``in`` not divisible by ``q``.
        """
        return grid.block(full, row_dim=1, col_dim=0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid2D, traffic: Traffic | None = None) -> Linear2D:
        """This rank's block of ``linear`` (copied).

        Raises:
            ValueError: ``linear`` has a bias, or a feature count is not divisible by ``q``.
        """
        if linear.bias is not None:
            raise ValueError("2D linear layers take no bias; build the nn.Linear with bias=False")
        weight = nn.Parameter(cls.local_part(grid, linear.weight), requires_grad=linear.weight.requires_grad)
        return cls(weight, grid, traffic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_matmul(x.reshape(-1, x.shape[-1]), self.weight.t(), self.grid, self.traffic)
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, q={self.grid.q}"


def sum_over_row(x: torch.Tensor, grid: Grid2D, traffic: Traffic | None = None) -> torch.Tensor:
    """Sum of ``x`` over the grid row, differentiable for a sum that each rank then uses on its
    own data: its gradient is the sum of every rank's gradient. That is Megatron's ``f``
    (identity, all-reduce in backward) followed by ``g`` (all-reduce, identity in backward):
    ``2·(q−1)/q·|x|`` bytes on the row axis in forward and the same in backward."""
    x = copy_to_parallel(x, grid.row_group, traffic, grid.row_axis)
    return reduce_from_parallel(x, grid.row_group, traffic, grid.row_axis)


class RMSNorm2D(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) of activations whose features are split over grid
    columns: each rank sums the squares of its ``D/q`` features, one all-reduce along the grid
    row completes the sum (Optimus §3, its layer norm).

    ``weight`` ``[D/q]``: the grid column's features, replicated over the ``q`` ranks of the
    column, each applying it to other sequences; a gradient hook sums its gradient over the grid
    column (all-reduce of ``D/q`` elements per backward). Computed in float32 or the input's
    dtype if wider, cast back.

    Shapes: ``x`` ``[B/q, S, D/q]`` → same. Bytes per call on the row axis:
    ``2·(q−1)/q·(B/q)·S`` elements of the compute dtype in forward, the same in backward.
    """

    PLACEMENTS: tuple[Placement, Placement] = (Replicate(), Shard(0))

    def __init__(self, weight: nn.Parameter, eps: float, grid: Grid2D, traffic: Traffic | None = None):
        super().__init__()
        self.weight, self.eps, self.grid, self.traffic = weight, eps, grid, traffic
        self.dim = weight.numel() * grid.q
        all_reduce_grad_hook(weight, grid.col_group, traffic, grid.col_axis)

    @staticmethod
    def local_part(grid: Grid2D, full: torch.Tensor) -> torch.Tensor:
        """This rank's features of a full ``[D]`` norm weight (or its gradient)."""
        return grid.block(full, row_dim=None, col_dim=0)

    @classmethod
    def from_norm(cls, norm: nn.Module, grid: Grid2D, traffic: Traffic | None = None) -> RMSNorm2D:
        """This rank's part of an RMSNorm with ``weight`` ``[D]`` and ``eps`` (copied)."""
        weight = nn.Parameter(cls.local_part(grid, norm.weight), requires_grad=norm.weight.requires_grad)
        return cls(weight, norm.eps, grid, traffic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = sum_over_row(xf.pow(2).sum(dim=-1, keepdim=True), self.grid, self.traffic)
        normed = xf * torch.rsqrt(squares / self.dim + self.eps)
        return (normed * self.weight.to(xf.dtype)).to(x.dtype)


def padded_vocab(vocab_size: int, q: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``q``: the rows the 2D embedding and head hold."""
    return -(-vocab_size // q) * q


def _pad_vocab(full: torch.Tensor, q: int) -> torch.Tensor:
    """``[V, D]`` → ``[V_pad, D]`` with zero rows appended."""
    return F.pad(full.detach(), (0, 0, 0, padded_vocab(full.shape[0], q) - full.shape[0]))


class VocabHead2D(Linear2D):
    """The output head ``[V, D]`` as a :class:`Linear2D` over the vocabulary padded to ``V_pad``
    (zero rows): logits ``[B/q, S, V_pad/q]``, vocabulary split over grid columns, whose padding
    columns :func:`cross_entropy_2d` masks."""

    @staticmethod
    def local_part(grid: Grid2D, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full ``[V, D]`` head weight (or its gradient), padded to ``V_pad`` rows.

        Raises:
            ValueError: ``D`` not divisible by ``q``.
        """
        return Linear2D.local_part(grid, _pad_vocab(full, grid.q))


class Embedding2D(nn.Module):
    """Token embedding with the table ``[V_pad, D]`` split by vocabulary over grid rows and by
    feature over grid columns; ``V_pad`` is the vocabulary padded to a multiple of ``q`` with
    zero rows that no token id reaches.

    Rank ``(i, j)`` looks up every token of the micro-batch in its vocabulary rows (zero rows
    for the others) and features, ``[B, S, D/q]``; a reduce-scatter along the grid column sums
    over the vocabulary blocks and leaves each grid row its sequences (Megatron's vocab-parallel
    embedding, with the batch scattered instead of replicated).

    Shapes: ``tokens`` ``LongTensor[B, S]`` (every rank the same) → ``[B/q, S, D/q]``. Bytes on
    the column axis: ``(q−1)/q·B·S·D/q`` elements in forward, the same in backward (all-gather).

    Raises (in forward):
        ValueError: ``B`` not divisible by ``q``.
    """

    PLACEMENTS: tuple[Placement, Placement] = (Shard(0), Shard(1))

    def __init__(self, weight: nn.Parameter, grid: Grid2D, traffic: Traffic | None = None):
        super().__init__()
        self.weight, self.grid, self.traffic = weight, grid, traffic
        self.vocab_start = grid.row * weight.shape[0]

    @staticmethod
    def local_part(grid: Grid2D, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full ``[V, D]`` table (or its gradient), padded to ``V_pad`` rows."""
        return grid.block(_pad_vocab(full, grid.q), row_dim=0, col_dim=1)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, grid: Grid2D, traffic: Traffic | None = None) -> Embedding2D:
        """This rank's block of ``emb`` (copied).

        Raises:
            ValueError: the embedding width is not divisible by ``q``.
        """
        weight = nn.Parameter(cls.local_part(grid, emb.weight), requires_grad=emb.weight.requires_grad)
        return cls(weight, grid, traffic)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_batch(tokens, self.grid.q)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along(rows, BATCH_DIM, self.grid.col_group, self.traffic, self.grid.col_axis)


class _Transpose(torch.autograd.Function):
    """Swap a block with the rank at the transposed grid position, ``(i, j) ↔ (j, i)`` (diagonal
    ranks keep theirs); backward swaps the gradients back."""

    @staticmethod
    def forward(ctx, x, grid, traffic):
        ctx.grid, ctx.traffic = grid, traffic
        return _swap(x, grid, traffic)

    @staticmethod
    def backward(ctx, grad):
        return _swap(grad, ctx.grid, ctx.traffic), None, None


def _swap(x: torch.Tensor, grid: Grid2D, traffic: Traffic | None) -> torch.Tensor:
    if grid.transpose_rank is None:
        raise ValueError("this grid has no transpose rank; build it with Grid2D.from_ranks or from_mesh")
    if grid.transpose_rank == dist.get_rank():
        return x
    x, out = x.contiguous(), torch.empty_like(x)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, grid.transpose_rank),
                                    dist.P2POp(dist.irecv, out, grid.transpose_rank)])  # fmt: skip
    for work in works:
        work.wait()
    if traffic is not None:
        # Neither along a row nor a column: counted with the row axis (the embedding's other traffic).
        traffic.point_to_point(grid.row_axis, x.numel() * x.element_size())
    return out


class TiedEmbedding2D(nn.Module):
    """The token embedding sharing the output head's 2D block (``model.tie_embeddings``): rank
    ``(i, j)`` holds block ``(j, i)`` of the ``[V_pad, D]`` table (vocabulary block ``j``,
    features block ``i``), the head's :class:`VocabHead2D` weight itself.

    Rank ``(i, j)`` looks up every token in its vocabulary rows (zeros elsewhere), a
    reduce-scatter along the grid row sums the vocabulary blocks and leaves it sequences block
    ``j`` with features ``i``, and an exchange with the rank at ``(j, i)`` (which holds sequences
    ``i``, features ``j``) gives the activation layout ``[B/q, S, D/q]`` of block ``(i, j)``.
    The tied parameter's gradient sums both uses (one ``Parameter``).

    Shapes: ``tokens`` ``LongTensor[B, S]`` (every rank the same) → ``[B/q, S, D/q]``. Bytes:
    ``(q−1)/q·B·S·D/q`` elements on the row axis, plus ``B/q·S·D/q`` for the exchange (off the
    diagonal), the same in backward.

    Raises (in forward):
        ValueError: ``B`` not divisible by ``q``.
    """

    PLACEMENTS: tuple[Placement, Placement] = Linear2D.PLACEMENTS
    local_part = VocabHead2D.local_part

    def __init__(self, weight: nn.Parameter, grid: Grid2D, traffic: Traffic | None = None):
        super().__init__()
        self.weight, self.grid, self.traffic = weight, grid, traffic
        self.vocab_start = grid.col * weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _check_batch(tokens, self.grid.q)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        mine = reduce_scatter_along(rows, BATCH_DIM, self.grid.row_group, self.traffic, self.grid.row_axis)
        return _Transpose.apply(mine, self.grid, self.traffic)


def _check_batch(tokens: torch.Tensor, q: int) -> None:
    if tokens.shape[BATCH_DIM] % q:
        raise ValueError(
            f"micro-batch of {tokens.shape[BATCH_DIM]} sequences is not divisible by the grid side "
            f"q={q}; make training.micro_batch_size a multiple of q"
        )


def cross_entropy_2d(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, grid: Grid2D, traffic: Traffic | None = None
) -> torch.Tensor:
    """Mean cross-entropy over the whole micro-batch of logits split by sequence over grid rows
    and by vocabulary over grid columns, without gathering them.

    The padding columns (ids ``≥ vocab_size``) are set to ``−∞``, so they are never predicted
    and get no gradient. Within a grid row, :func:`vocab_parallel_cross_entropy` (Megatron §3)
    gives the row's mean loss (two all-reduces on the row axis: ``N + 1`` and ``2N`` float32
    elements, ``N = B/q·S``); one all-reduce of a float32 scalar on the column axis averages the
    ``q`` rows' means (equal token counts). Backward: ``(softmax − onehot)/(B·S)`` locally.

    Shapes: ``logits`` ``[B/q, S, V_pad/q]``, ``target`` ``LongTensor[B/q, S]`` (this grid row's
    sequences, ids ``< vocab_size``) → a float32 scalar, the same on every rank, equal to
    ``F.cross_entropy`` of the full logits.
    """
    first = grid.col * logits.shape[-1]
    padding = torch.arange(first, first + logits.shape[-1], device=logits.device) >= vocab_size
    logits = logits.masked_fill(padding, float("-inf"))
    row_loss = vocab_parallel_cross_entropy(logits, target, grid.row_group, traffic, grid.row_axis)
    total = reduce_from_parallel(row_loss.reshape(1), grid.col_group, traffic, grid.col_axis)
    return total[0] / grid.q


def grid_dtensor(local: torch.Tensor, mesh, placements: Sequence[Placement], shape: Sequence[int]) -> DTensor:
    """A 2D shard (this rank's block, storage shared) as a DTensor of the unpadded full tensor of
    ``shape`` on the grid ``mesh`` (two dimensions, ``(tp_row, tp_col)``, or a mesh ending in
    them), for checkpoints that reshard to other layouts and for gathering a full model.

    A vocabulary padded to ``V_pad = q·ceil(V/q)`` rows (:func:`padded_vocab`) holds
    ``ceil(V/q)`` rows per block, which is DTensor's chunk layout of the ``V`` real rows: the
    block keeps its leading real rows (all but the last blocks' padding).
    """
    dims = mesh.mesh_dim_names[-2:]
    for mesh_dim, placement in zip(dims, placements, strict=True):
        if isinstance(placement, Shard):
            d, per_block = placement.dim, local.shape[placement.dim]
            start = mesh.get_local_rank(mesh_dim) * per_block
            local = local.narrow(d, 0, max(0, min(per_block, shape[d] - start)))
    return sharded_dtensor(local, mesh[dims], placements, shape)
