"""A bias added to the head's product on its own: the forms the walk to the head (``head_chain``) takes as the
head's bias, as ``F.linear(hidden, weight, bias)`` would carry it.

Matched, walking back from what the loss reads (``head_chain.walk_logits``)::

    hidden (..., D)   weight (V, D) | weight_t (D, V)
          \\                 |
           linear(hidden, weight) | hidden @ weight.T | matmul(hidden, weight_t)      <- the head, without a bias
                  |
                  |   row views only (view / reshape / flatten of leading dims, contiguous, row slices)
                  v
           logits + bias | bias + logits | torch.add(logits, bias) | logits.add(bias)       bias (V,), alpha 1
           logits += bias | logits.add_(bias)        (in place: made before the loss reads the logits)
                  |
                  |   row views, upcasts, scale, softcap (the rest of the chain)
                  v
            what the loss reads

:func:`match_bias_add` recognises the add; :func:`through_inplace_add` points the readers that follow an in-place
add at the add, so that the walk runs through it; :func:`added_bias_error` says why a matched bias is not fused
(another dtype or device than the head's logits, an in-place add to a tensor that something else reads). The walk
itself refuses a second bias, a bias added after a scale or a softcap, and one added to a head that has its own;
``head_chain.branch_path`` leaves the add out of what returned logits replay.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .spellings import ADD, INPLACE_ADD, const_float, example_value, matches


def match_bias_add(node: fx.Node, vocab: Any) -> tuple[fx.Node, fx.Node] | None:
    """``(x, bias)`` where ``node`` adds a ``(V,)`` tensor to ``x`` (logits rows): ``x + bias``, ``bias + x``,
    ``torch.add(x, bias)``, ``x.add(bias)``, or in place, ``x += bias`` / ``x.add_(bias)``; None for any other node."""
    inplace = matches(node, INPLACE_ADD)
    if not (inplace or matches(node, ADD)) or set(node.kwargs) - {"other", "alpha"} or len(node.args) > 2:
        return None
    if const_float(node.kwargs.get("alpha", 1)) != 1.0:
        return None
    operands = list(node.args) + ([node.kwargs["other"]] if "other" in node.kwargs else [])
    if len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands):
        return None
    metas = [example_value(o) for o in operands]
    if not all(isinstance(m, torch.Tensor) for m in metas):
        return None

    def is_bias(i: int) -> bool:
        return metas[i].dim() == 1 and metas[i].shape[0] == vocab and metas[1 - i].dim() >= 2

    for i in [1] if inplace else [1, 0]:  # in place, the updated tensor is the first operand
        if is_bias(i) and tuple(example_value(node).shape) == tuple(metas[1 - i].shape):
            return operands[1 - i], operands[i]
    return None


def through_inplace_add(node: fx.Node, reader: fx.Node, vocab: Any) -> fx.Node:
    """Where ``node.add_(bias)`` comes before ``reader`` reads ``node`` (``logits.add_(b); loss(logits)``): ``reader``
    and every later reader of ``node`` are pointed at the add's result, which is ``node`` itself, updated (no value
    changes), so that the chain runs through the add; returns the add. Otherwise ``node`` (an update after the read,
    or two of them, are other users of the logits: :func:`head_chain.private_chain` refuses them)."""
    updates = [
        user
        for user in node.users
        if user is not reader and matches(user, INPLACE_ADD) and user.args and user.args[0] is node
    ]
    if len(updates) != 1 or match_bias_add(updates[0], vocab) is None:
        return node
    update = updates[0]
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    if position[update] > position[reader]:
        return node
    for user in list(node.users):
        if user is not update and position[user] > position[update]:
            user.replace_input_with(node, update)
    return update


def added_bias_error(
    add: fx.Node, bias: fx.Node, chain: list[fx.Node], compute_dtype: torch.dtype, device: torch.device
) -> str | None:
    """Why the bias that ``add`` adds to the head's product cannot be the op's bias (None where it can): it is where
    it changes nothing else, the add neither promoting the logits nor moving them (the op adds the bias in the head's
    dtype), and an add in place updating a tensor that nothing else reads (it would see the bias, or miss it, where
    the rewrite computes no logits at all). ``chain``: the walk's nodes, from what the loss reads back to the head."""
    bias_meta, logits_meta = example_value(bias), example_value(add)
    if bias_meta.device != device:
        return (
            f"the bias {bias.name} is on {bias_meta.device}, the logits on {device}: eager raises, so the "
            "site is left to it"
        )
    if bias_meta.dtype != compute_dtype or logits_meta.dtype != compute_dtype:
        return (
            f"{add.name} adds a {bias_meta.dtype} bias to {compute_dtype} logits (into "
            f"{logits_meta.dtype}): only a bias in the head's dtype is fused"
        )
    if matches(add, INPLACE_ADD):
        updated = chain[chain.index(add) + 1 :]  # the updated tensor back to the head: views of one buffer
        shared = next((n for n in updated if len(n.users) != 1), None)
        if shared is not None:
            others = ", ".join(u.name for u in shared.users if u not in chain)
            return f"{add.name} adds the bias in place to {shared.name}, which {others} reads too"
    return None
