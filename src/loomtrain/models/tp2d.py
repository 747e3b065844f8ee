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

from loomtrain.config import ModelConfig
from loomtrain.distributed.tensor_parallel_2d import (
    BATCH_DIM,
    Embedding2D,
    Grid2D,
    Linear2D,
    RMSNorm2D,
    VocabHead2D,
    check_2d_shapes,
    cross_entropy_2d,
)
from loomtrain.distributed.traffic import Traffic
from loomtrain.models.llama import Transformer

LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")  # fmt: skip
NORMS = ("attention_norm", "ffn_norm")


def check_tp2d_config(model: ModelConfig, tp: int, micro_batch_size: int) -> int:
    """The checks of :func:`check_2d_shapes` on a model config (pure: for the config's
    validation before launch).

    Returns:
        The grid side ``q``.
    Raises:
        ValueError: ``tp`` is not a perfect square (naming the nearest valid sizes), or
            ``model.dim``, ``n_heads``, ``n_kv_heads``, ``ffn_hidden_dim`` or
            ``training.micro_batch_size`` is not a multiple of ``q``, or the embeddings are tied.
    """
    return check_2d_shapes(tp, dim=model.dim, n_heads=model.n_heads, n_kv_heads=model.kv_heads,
                           ffn_hidden_dim=model.hidden_dim, micro_batch_size=micro_batch_size,
                           tie_embeddings=model.tie_embeddings)  # fmt: skip


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


def parallelize_2d(model: Transformer, grid: Grid2D, traffic: Traffic | None = None) -> Transformer2D:
    """Shard ``model`` over ``grid`` in place (Optimus §3) and return it with its 2D loss.

    Every rank must hold the same full model (built and initialised the same way): parameters
    are copied into this rank's blocks. The embedding and head get ``V_pad = ceil(V/q)·q`` rows,
    the padding rows zero. Parameters per rank: ``1/q²`` of each matrix, ``1/q`` of each norm
    weight. Bytes per collective: see ``docs/tensor_parallel_2d.md``.

    Raises:
        ValueError: the model's shapes do not split on a ``q × q`` grid (see
            :func:`check_2d_shapes`), or it is a pipeline stage (embedding or head removed).
    """
    if model.tok_embeddings is None or model.output is None:
        raise ValueError("parallelize_2d needs the whole model; pipeline parallelism with 2D is not supported yet")
    cfg = model.cfg
    check_2d_shapes(grid.q**2, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads,
                    ffn_hidden_dim=cfg.hidden_dim, tie_embeddings=cfg.tie_embeddings)  # fmt: skip
    for layer in model.layers.values():
        for path in LINEARS:
            parent, name = path.split(".")
            owner = getattr(layer, parent)
            setattr(owner, name, Linear2D.from_linear(getattr(owner, name), grid, traffic))
        for name in NORMS:
            setattr(layer, name, RMSNorm2D.from_norm(getattr(layer, name), grid, traffic))
    model.tok_embeddings = Embedding2D.from_embedding(model.tok_embeddings, grid, traffic)
    model.norm = RMSNorm2D.from_norm(model.norm, grid, traffic)
    model.output = VocabHead2D.from_linear(model.output, grid, traffic)
    return Transformer2D(model, grid, traffic)
