"""The loss's upstream gradient as the graph makes it: what the balanced path computes its gradients at.

The balanced op computes its gradients in the forward, at an upstream gradient it must assume, and its backward
multiplies them by the one that arrives; a 16-bit gradient summed without a remainder (the plain dC sum) is rounded
once more there unless the two agree (up to a power of two, which scales exactly). The graph often says what will
arrive: a loss scaled after the cross-entropy gets the scale as its gradient from ``loss.backward()``::

    loss = cross_entropy(...)                       one path of these from the loss to the graph's outputs:
    [views, casts, sum / mean, + other terms]       (they pass the gradient on unchanged)
    loss = loss / num_items_in_batch                a product or quotient by a number, a SymInt or a 0-dim tensor
    [loss = loss * 0.5 ...]

gives the op ``grad_scale = ones() * 0.5 / num_items_in_batch`` (the factors outermost first, in fp32, as autograd
forms the gradient), before the fused call: a factor the graph computes after the loss is computed again there
where it is a few pure steps from earlier nodes (Hugging Face's ``num_items_in_batch.to(loss.device)``). Where the
loss's uses branch, or a factor is of another kind, the scale is only named (``unknown``, ``stats()``), and the
planner sums a 16-bit dC as the exact pair (``paths.balanced_plan``). A scale applied outside the compiled graph is
not seen.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from .spellings import (
    ADD,
    DIV,
    DTYPE_METHODS,
    IDENTITY_VIEW,
    MUL,
    NEG,
    RESHAPE,
    SUB,
    TO_DTYPE,
    example_value,
    functions,
    matches,
    methods,
    short,
)

# What passes the loss's gradient on unchanged in scale (followed), and what scales it (its factor read)
_SCALE_KEEPING = ADD | SUB | NEG | TO_DTYPE | RESHAPE | IDENTITY_VIEW | methods(*DTYPE_METHODS, "sum", "mean")
_SCALING_MUL = MUL | functions(operator.imul)
_SCALING_DIV = DIV | functions(operator.itruediv)
# Pure steps a factor computed after the loss may take from earlier nodes: computed again before the fused call
_RECOMPUTABLE = (
    TO_DTYPE
    | IDENTITY_VIEW
    | methods(*DTYPE_METHODS, "sum", "ne", "eq", "clamp", "clamp_min", "detach")
    | functions(operator.ne, operator.eq, torch.ne, torch.eq, torch.sum, torch.clamp)
)
_RECOMPUTE_AT_MOST = 4  # steps


@dataclasses.dataclass(frozen=True)
class UpstreamGradient:
    """The scales, other than powers of two, between the loss and the graph's outputs."""

    # ("mul" | "div", factor, nodes to compute again before the call, in order) outermost first; a factor is a number
    # or a node of the graph
    steps: tuple[tuple[str, Any, tuple[fx.Node, ...]], ...] = ()
    unknown: str = ""  # a scale that ``steps`` cannot stand for, named for stats() ("" where none)
    named: str = ""  # the steps' nodes, named for stats()


def upstream_gradient(loss: fx.Node, before: fx.Node) -> UpstreamGradient:
    """What the graph scales ``loss``'s gradient by (module docstring); factor nodes must come before ``before``
    (where the fused call goes). Other uses (a logged ``exp(loss)``, a ``detach``) are not followed."""
    position = {node: i for i, node in enumerate(loss.graph.nodes)}
    factors: list[tuple[str, Any, str, tuple]] = []  # (op, factor, its name for stats(), to compute again), outwards
    why_not, branches, todo, seen = "", False, [loss], set()
    while todo:
        node = todo.pop()
        followed = [user for user in node.users if _followed(user)]
        branches = branches or len(followed) > 1 or any(user in seen for user in followed)
        for user in followed:
            if user in seen:
                continue
            seen.add(user)
            todo.append(user)
            factor = _factor(user, node)
            if factor is None:
                continue
            op, value, named = factor
            again = _recomputed(value, position, position[before])
            if op == "?":
                why_not = why_not or named
            elif again is None or not _representable(value):
                why_not = why_not or f"{named}: not a number or a 0-dim tensor computed before the loss without grad"
            factors.append((op, value, named, again or ()))
    if not factors:
        return UpstreamGradient()
    if why_not or branches:
        return UpstreamGradient(unknown=why_not or f"{factors[0][2]}; the loss's uses branch")
    return UpstreamGradient(
        steps=tuple((op, value, again) for op, value, _, again in reversed(factors)),
        named=", ".join(named for _, _, named, _ in factors),
    )


def _followed(user: fx.Node) -> bool:
    return matches(user, _SCALE_KEEPING) or matches(user, _SCALING_MUL) or matches(user, _SCALING_DIV)


def _factor(user: fx.Node, node: fx.Node) -> tuple[str, Any, str] | None:
    """``(op, factor, name)`` where ``user`` scales ``node`` by other than a power of two (``op`` "?" where it is no
    plain product or quotient of it: ``x / loss``, ``loss * loss``, a rounding mode, an ``alpha``, a broadcast of the
    loss to several elements, whose sum would multiply its gradient), else None."""
    meta = example_value(user)
    if isinstance(meta, torch.Tensor) and meta.numel() != 1:
        return "?", None, f"{short(user)} broadcasts the loss to {tuple(meta.shape)}"
    if not (matches(user, _SCALING_MUL) or matches(user, _SCALING_DIV)):
        alpha = user.kwargs.get("alpha", 1)
        return None if _power_of_two(alpha) else ("?", alpha, f"{short(user)} by alpha={alpha!r}")
    others = [a for a in user.args if a is not node]
    plain = len(others) == 1 and len(user.args) == 2 and not user.kwargs
    if plain and _power_of_two(others[0]):
        return None
    other = others[0] if len(others) == 1 else tuple(others)
    by = other.name if isinstance(other, fx.Node) else repr(other) if others else "itself"
    if not plain or (matches(user, _SCALING_DIV) and user.args[0] is not node):
        return "?", None, f"{short(user)} by {by}"
    return ("mul" if matches(user, _SCALING_MUL) else "div"), other, f"{short(user)} by {by}"


def _recomputed(value: Any, position: dict, insert_at: int) -> tuple[fx.Node, ...] | None:
    """The nodes of ``value`` to compute again before ``insert_at``, in order (none for a number or a node before
    it); None where it cannot be (more than a few pure steps from nodes before it)."""
    if not isinstance(value, fx.Node) or position[value] < insert_at:
        return ()
    again: list[fx.Node] = []

    def visit(node: fx.Node) -> bool:
        if position[node] < insert_at or node in again:
            return True
        if not matches(node, _RECOMPUTABLE) or len(again) >= _RECOMPUTE_AT_MOST:
            return False
        inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        if not all(visit(a) for a in inputs):
            return False
        again.append(node)
        return True

    return tuple(again) if visit(value) else None


def _representable(value: Any) -> bool:
    """A factor the op can be given: a finite number, or a node that holds a SymInt / SymFloat or a 0-dim real tensor
    that needs no gradient."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value)
    if not isinstance(value, fx.Node):
        return False
    meta = example_value(value)
    if isinstance(meta, (torch.SymInt, torch.SymFloat)):
        return True
    return isinstance(meta, torch.Tensor) and meta.dim() == 0 and not meta.is_complex() and not meta.requires_grad


def _power_of_two(value: Any) -> bool:
    """A Python number that is +-2^k (a tensor or a symbolic size: unknown, False)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0 or not math.isfinite(value):
        return False
    mantissa, _ = math.frexp(abs(value))
    return mantissa == 0.5


def emit_grad_scale(graph: fx.Graph, steps: tuple, device: torch.device) -> fx.Node | None:
    """The op's ``grad_scale``: a 0-dim fp32 tensor on ``device`` formed from ``steps`` as autograd forms the loss's
    gradient from 1, the factors computed after the loss computed again here (None without steps)."""
    if not steps:
        return None
    scale = graph.call_function(torch.ones, ((),), {"dtype": torch.float32, "device": device})
    copies: dict[fx.Node, fx.Node] = {}
    for op, factor, again in steps:
        for node in again:
            copies[node] = graph.node_copy(node, lambda arg: copies.get(arg, arg))
        factor = copies.get(factor, factor) if isinstance(factor, fx.Node) else factor
        scale = graph.call_function(operator.mul if op == "mul" else operator.truediv, (scale, factor))
    return scale
