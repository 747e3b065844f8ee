"""A stage's backward split in two, for zero-bubble schedules (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, §2): ``B`` computes only the gradient of the stage input, which the previous
stage is waiting for; ``W``, later, computes the gradients of the stage's parameters.

How, on any autograd graph (no change to the model's layers): the graph of ``out`` splits into the
nodes from which the stage input is reachable (the *input path*) and the rest, which lead only to
parameters. Where an input-path node has an edge into the rest (a matmul's edge to its weight), the
gradient arriving at that node is the one its weight gradient needs. ``B`` runs
``autograd.grad(out, x)``: the engine then computes only the input path, every node only the outputs
toward ``x`` (a matmul skips its weight gradient), and a hook on each such *boundary* node keeps the
gradient that arrives there. ``W`` resumes from every boundary node with its kept gradient, restricted
to the parameters under it, so nothing on the input path runs twice and every parameter's ``.grad``
accumulates (with its hooks: data-parallel reduction, ZeRO) as under a plain backward.

Memory: ``B`` keeps the graph (``retain_graph``); ``W`` releases each node as it runs, and the graph
is gone once the returned :class:`WeightGrad` has run and is dropped. A micro-batch therefore holds
its activations from its ``F`` to its ``W``, which the schedules count (``peak_in_flight``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Boundary:
    node: Node
    params: list[torch.Tensor]
    grads: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class WeightGrad:
    """The deferred ``W`` of one micro-batch on one stage: :meth:`run` once, then drop it.

    Attributes:
        boundaries: the input-path nodes with parameters below them, in the order ``B`` reached them.
        whole: ``(out, grad)`` when the stage input needs no gradient (the first stage): ``W`` is then
            the whole backward, ``B`` nothing.
    """

    boundaries: list[_Boundary] = field(default_factory=list)
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def run(self) -> None:
        """Accumulate the parameters' gradients into ``.grad`` and release the graph.

        Raises:
            RuntimeError: run twice (the graph is gone), or a boundary node got no gradient in ``B``.
        """
        if self.whole is None and not self.boundaries:
            raise RuntimeError("this weight gradient already ran: its graph has been released")
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            torch.autograd.backward(out, grad)
        missing = [str(part.node) for part in self.boundaries if part.grads is None]
        if missing:
            raise RuntimeError(f"the input-gradient pass never reached {', '.join(missing)}; run it before W")
        for part in self.boundaries:
            edges = [GradientEdge(part.node, i) for i, g in enumerate(part.grads) if g is not None]
            if edges:
                torch.autograd.backward(edges, [g for g in part.grads if g is not None], inputs=part.params)
        self.boundaries.clear()


def backward_input(out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None) -> tuple[torch.Tensor | None,
                                                                                            WeightGrad]:  # fmt: skip
    """``B``: the gradient of stage input ``x`` from the gradient ``grad`` of stage output ``out``
    (same shape as ``out``; ``None`` for a scalar loss), with no parameter gradient computed.

    Returns:
        ``(dx, w)``: ``dx`` shaped like ``x`` (``None`` if ``x`` needs no gradient), and the
        :class:`WeightGrad` to run as ``W``.

    Raises:
        RuntimeError: a parameter is used by two boundary nodes (a weight shared inside the stage):
            its gradient could not be split without computing part of the input path twice.
    """
    if not x.requires_grad:
        return None, WeightGrad(whole=(out, grad))
    boundaries = _boundaries(out.grad_fn, get_gradient_edge(x).node)
    handles = [part.node.register_prehook(_keeper(part)) for part in boundaries]
    try:
        (dx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return dx, WeightGrad(boundaries=boundaries)


def _keeper(part: _Boundary):
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        part.grads = tuple(grad_outputs)

    return keep


def _nodes(root: Node) -> list[Node]:
    """Every node of the graph under ``root``, parents before children (reverse post-order)."""
    order, seen, stack = [], {root}, [(root, iter(_children(root)))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            order.append(stack.pop()[0])
        elif child not in seen:
            seen.add(child)
            stack.append((child, iter(_children(child))))
    return order[::-1]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _boundaries(root: Node, x_node: Node) -> list[_Boundary]:
    """The input-path nodes with an edge off the input path toward parameters, each with those parameters."""
    nodes = _nodes(root)
    on_path = {x_node}
    for node in reversed(nodes):  # children first
        if any(child in on_path for child in _children(node)):
            on_path.add(node)
    owner: dict[Node, Node] = {}
    boundaries = []
    for node in nodes:
        if node not in on_path:
            continue
        params = [p for child in _children(node) if child not in on_path for p in _params_under(child, node, owner)]
        if params:
            boundaries.append(_Boundary(node, params))
    return boundaries


def _params_under(start: Node, boundary: Node, owner: dict[Node, Node]) -> list[torch.Tensor]:
    """The parameters below ``start`` (off the input path); each node may belong to one boundary only."""
    params, stack, seen = [], [start], set()
    while stack:
        node = stack.pop()
        first = owner.setdefault(node, boundary)
        if first is not boundary:
            raise RuntimeError(
                f"{node} is used under two input-gradient nodes ({first} and {boundary}): a weight shared "
                "inside a pipeline stage cannot be split into B and W; use another parallel.pipeline_schedule"
            )
        if node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            params.append(node.variable)
        stack.extend(_children(node))
    return params
