"""Apply 2D tensor parallelism (Optimus, on a q × q grid) to the Llama model from outside.

Every ``nn.Linear`` of a block (``wq``, ``wk``, ``wv``, ``wo``, ``w1``, ``w2``, ``w3``) and the
output head become :class:`~loomtrain.distributed.tensor_parallel_2d.Linear2D` (SUMMA), every
RMSNorm a :class:`RMSNorm2D`, the token embedding an :class:`Embedding2D`; the model's own
forward code runs unchanged on the blocks: attention finds its ``H/q`` local heads with
``view(..., -1, head_dim)`` and attends over its ``B/q`` whole sequences (heads split over grid
columns, sequences over grid rows; see ``distributed/tensor_parallel_2d.py``). The loss is
:func:`cross_entropy_2d` over the padded vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from loomtrain.distributed.tensor_parallel_2d import (
    BATCH_DIM,
    Embedding2D,
    Grid2D,
    GridShard,
    Linear2D,
    RMSNorm2D,
    TiedEmbedding2D,
    VocabHead2D,
    check_2d_shapes,
    cross_entropy_2d,
)
from loomtrain.distributed.traffic import Traffic
from loomtrain.models.llama import Transformer

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")  # fmt: skip
NORMS = ("attention_norm", "ffn_norm")


class Transformer2D(nn.Module):
    """A :class:`Transformer` whose layers were replaced by their 2D versions, and its loss.

    ``forward(tokens, target)``: ``tokens``, ``target`` ``LongTensor[B, S]``, the whole
    micro-batch on every rank → the mean next-token cross-entropy over all ``B·S`` positions, a
    float32 scalar equal on every rank to ``F.cross_entropy`` of the unsharded model's logits.
    ``logits(tokens)`` → this rank's block ``[B/q, S, V_pad/q]`` (padding columns unmasked).
    Parameter names are the unsharded model's with the prefix ``model.``.
    """

    def __init__(self, model: Transformer, grid: Grid2D, traffic: Traffic | None = None):
        super().__init__()
        self.model, self.grid, self.traffic = model, grid, traffic

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's logits block: ``LongTensor[B, S]`` → ``[B/q, S, V_pad/q]``.

        Raises:
            ValueError: ``B`` not divisible by ``q``, or ``S`` over ``model.max_seq_len``.
        """
        return self.model(tokens)

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)  # first: the embedding refuses a micro-batch not divisible by q
        mine = self.grid.block(target, row_dim=BATCH_DIM, col_dim=None)
        return cross_entropy_2d(logits, mine, self.model.cfg.vocab_size, self.grid, self.traffic)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the unsharded model's parameter ``name`` (a ``state_dict`` key of
        :class:`Transformer`), or of its gradient: how the parameter was sharded.

        Raises:
            AttributeError: ``name`` is not a parameter of this model.

        """
        module_name = name.rsplit(".", 1)[0]
        module = self.model.get_submodule(module_name)
        return type(module).local_part(self.grid, full)


def shard_2d(model: Transformer, grid: Grid2D, traffic: Traffic | None = None) -> dict[str, GridShard]:
    """Shard what ``model`` holds over ``grid`` in place (Optimus §3): every block's linears and
    norms, and the embedding, final norm and head where present (a pipeline stage holds only
    some of them).

    Every rank must hold the same full parameters (built and initialised the same way): they
    are copied into this rank's blocks. The embedding and head get ``V_pad = ceil(V/q)·q`` rows,
    the padding rows zero. Parameters per rank: ``1/q²`` of each matrix, ``1/q`` of each norm
    weight. Bytes per collective: see ``docs/tensor_parallel_2d.md``.

    Returns:
        ``{parameter name: (placements on (tp_row, tp_col), full unpadded shape)}``, for
        :func:`~loomtrain.distributed.tensor_parallel_2d.grid_dtensor`.
    Raises:
        ValueError: the model's shapes do not split on a ``q × q`` grid (see :func:`check_2d_shapes`).
    """
    cfg = model.cfg
    check_2d_shapes(grid.q**2, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                    ffn_hidden_dim=cfg.hidden_dim)  # fmt: skip
    full_shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}
    for layer in model.layers.values():
        for path in LINEARS:
            parent, name = path.split(".")
            owner = getattr(layer, parent)
            setattr(owner, name, Linear2D.from_linear(getattr(owner, name), grid, traffic))
        for name in NORMS:
            setattr(layer, name, RMSNorm2D.from_norm(getattr(layer, name), grid, traffic))
    if model.output is not None:
        model.norm = RMSNorm2D.from_norm(model.norm, grid, traffic)
        model.output = VocabHead2D.from_linear(model.output, grid, traffic)
    if cfg.tie_embeddings:  # the config keeps tied models out of pipelines: both ends are here
        model.tok_embeddings = TiedEmbedding2D(model.output.weight, grid, traffic)
    elif model.tok_embeddings is not None:
        model.tok_embeddings = Embedding2D.from_embedding(model.tok_embeddings, grid, traffic)
    return {name: (model.get_submodule(name.rsplit(".", 1)[0]).PLACEMENTS, full_shapes[name])
            for name, _ in model.named_parameters(remove_duplicate=False)}  # fmt: skip


def parallelize_2d(model: Transformer, grid: Grid2D, traffic: Traffic | None = None) -> Transformer2D:
    """:func:`shard_2d` of a whole model, returned with its 2D loss (for layer-level checks and
    benchmarks; training runs go through ``parallelize_llama``).

    Raises:
        ValueError: as :func:`shard_2d`, or ``model`` is a pipeline stage (embedding or head removed).
    """
    if model.tok_embeddings is None or model.output is None:
        raise ValueError("parallelize_2d needs the whole model; a pipeline stage goes through parallelize_llama")
    shard_2d(model, grid, traffic)
    return Transformer2D(model, grid, traffic)
