"""What an FX node does to storage, as the matchers must know it: which tensor an in-place node writes, what a
tensor may be a view of, and whether a node is a 2-D transpose. Pattern-free graph facts, shared by the matched
forms (``head_chain.py``'s walk, ``site_facts.py``'s grouping of a head's chunks, ``replace.py``'s head operands)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .spellings import (
    INPLACE_FUNCTIONS,
    TRANSPOSE_2D,
    TRANSPOSE_ATTR_OPS,
    TRANSPOSE_ATTRS,
    VIEW_LIKE,
    matches,
    normalize_dim,
    spelling,
)


def transposed_source(node: fx.Node) -> fx.Node | None:
    """``w`` if ``node`` is ``w.T`` / ``w.t()`` / ``w.transpose(0, 1)`` / ``w.permute(1, 0)`` of a 2-D ``w``."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] in TRANSPOSE_ATTRS:
        return node.args[0]
    if matches(node, TRANSPOSE_ATTR_OPS):
        return node.args[0]
    if matches(node, TRANSPOSE_2D):
        src, dims = node.args[0], node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        dims = tuple(normalize_dim(d, 2) for d in dims if isinstance(d, int))
        kind = spelling(node)[1]
        if kind in ("t", torch.t):
            return src
        if kind in ("transpose", torch.transpose) and sorted(dims) == [0, 1]:
            return src
        if kind in ("permute", torch.permute) and dims == (1, 0):  # permute(0, 1) is the identity
            return src
    return None


def mutated_tensor(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place node writes to, or None if the node does not mutate."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.args[0] if node.args else None
    if node.op == "call_function":
        if spelling(node) in INPLACE_FUNCTIONS:
            return node.args[0]
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and node.args:
            return node.args[0]
        schema = getattr(node.target, "_schema", None)
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return node.args[0] if node.args else None
    return None


def storage_roots(node: Any) -> set:
    """``node`` and everything it may be a view of."""
    roots, stack = set(), [node]
    while stack:
        current = stack.pop()
        if not isinstance(current, fx.Node) or current in roots:
            continue
        roots.add(current)
        if matches(current, VIEW_LIKE) or (current.op == "call_function" and current.target is getattr):
            stack.append(current.args[0])
    return roots
