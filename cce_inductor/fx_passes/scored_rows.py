"""What the two RL forms share: a computation over every row of the head's logits, scored against one id per row.

``token_log_probs.py`` (the log-probabilities of given tokens) and ``entropy.py`` (the softmax's entropy, alone or
with those log-probabilities) each match their own nodes; both end in the same site and the same call::

    gather(log_softmax(logits, -1), -1, ids) [.squeeze(-1)]        gathered_log_probs: one id per row, int64
    site  = scored_rows_site(logits, inner, replaced, ids)          the head chain up to logits + the form's nodes
    fused = cce_inductor::linear_cross_entropy(rows.flatten(0, -2), weight, ids.flatten(), bias, cap, NO_TARGET,
                                               "none", 0.0, options, False, entropy)            (fused_token_call)
    log_probs = (-fused[0]).view_as(ids)                                                         (log_probs_of)

``NO_TARGET`` is an ``ignore_index`` no token equals: every row counts, and an out-of-range id fails as in eager.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import ops
from . import head_chain, sites
from . import spellings as sp

GATHER = sp.functions(torch.gather) | sp.methods("gather")
SQUEEZE = sp.functions(torch.squeeze) | sp.methods("squeeze")

NO_TARGET = -(2**63)


def last_dim(node: fx.Node, index: int, name: str, ndim: int) -> bool:
    """Argument ``index`` / ``name`` of ``node`` is the last of ``ndim`` dimensions."""
    dim = sp.call_arg(node, index, name)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def is_row_softmax(node: fx.Node) -> bool:
    """``node`` (a softmax or log_softmax call) is over the last dimension, with no dtype argument."""
    meta = sp.example_value(node)
    return isinstance(meta, torch.Tensor) and last_dim(node, 1, "dim", meta.dim()) and sp.dtype_arg(node) is None


def gathered_log_probs(gather: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None]:
    """``(log_softmax node, logits, ids, squeeze | None)`` of ``gather(log_softmax(logits, -1), -1, ids)``
    [``.squeeze(-1)``], or NoMatch."""
    log_probs, index = sp.call_arg(gather, 0, "input"), sp.call_arg(gather, 2, "index")
    if not sp.matches(log_probs, sp.LOG_SOFTMAX):
        raise head_chain.NoMatch("the gathered tensor is not a log_softmax")
    logits = sp.call_arg(log_probs, 0, "input")
    logits_meta, index_meta = sp.example_value(logits), sp.example_value(index)
    if not isinstance(logits_meta, torch.Tensor) or not isinstance(index_meta, torch.Tensor):
        raise head_chain.NoMatch("log_softmax input or gather index is not a tensor")
    ndim = logits_meta.dim()
    if ndim < 2 or not last_dim(log_probs, 1, "dim", ndim) or not last_dim(gather, 1, "dim", ndim):
        raise head_chain.NoMatch("log_softmax and gather are not both over the last (vocabulary) dimension")
    if sp.dtype_arg(log_probs) is not None:
        raise head_chain.NoMatch("log_softmax has a dtype argument")
    if gather.kwargs.get("sparse_grad", False) or (len(gather.args) > 3 and gather.args[3]):
        raise head_chain.NoMatch("gather with sparse_grad")
    if index_meta.dtype != torch.int64 or index_meta.dim() != ndim or index_meta.shape[-1] != 1:
        raise head_chain.NoMatch(
            f"gather index of shape {tuple(index_meta.shape)} / {index_meta.dtype}: one int64 id per row"
        )
    if tuple(index_meta.shape[:-1]) != tuple(logits_meta.shape[:-1]):
        raise head_chain.NoMatch("gather index does not cover every row of the logits")
    squeeze = next(iter(gather.users)) if len(gather.users) == 1 else None
    if squeeze is not None and not (sp.matches(squeeze, SQUEEZE) and last_dim(squeeze, 1, "dim", ndim)):
        squeeze = None
    return log_probs, logits, index, squeeze


def scored_rows_site(logits: fx.Node, inner: list[fx.Node], replaced: list[fx.Node], ids: fx.Node | None) -> sites.Site:
    """The site of a computation over every row of ``logits`` (token log-probs, entropy): ``inner`` its own nodes,
    of which ``replaced`` take the op's values; the others must be private to it. The op goes where the first of
    ``replaced`` stood (its ids must be computed by then); ``ids``: the scored tokens, or None (entropy alone)."""
    position = {node: i for i, node in enumerate(logits.graph.nodes)}
    first, last = min(replaced, key=position.get), max(replaced, key=position.get)
    for node in inner:
        others = [user for user in node.users if user not in inner]
        if node not in replaced and others:
            raise head_chain.NoMatch(f"{node.name} is also used by {', '.join(u.name for u in others)}")
    if ids is not None and position.get(ids, -1) > position[first]:
        raise head_chain.NoMatch(f"the token ids ({ids.name}) are computed after {first.name}")
    walked = head_chain.walk_logits(logits, last)
    escaping = head_chain.private_chain(walked.chain, first, allowed=inner)
    fields = walked.fields()
    fields["chain"] = sorted(set(walked.chain) | (set(inner) - {first}), key=position.get)
    return sites.Site(
        cross_entropy=first,
        targets=ids,
        ignore_index=NO_TARGET,
        reduction="none",
        label_smoothing=0.0,
        escaping=escaping,
        lse_users=[],
        **fields,
    )


def dtensor_refusal(site: sites.Site, what: str) -> str:
    """Why an RL-form site is left alone for its operands (``what`` on DTensors is not rewritten), or ""."""
    operands = [site.hidden, site.weight] + ([site.targets] if site.targets is not None else [])
    return f"{what} on DTensors is not rewritten" if any(sp.is_dtensor(sp.example_value(n)) for n in operands) else ""


def fused_token_call(
    graph: fx.Graph, site: sites.Site, decision: sites.Decision, rows, weight, ids, bias, entropy: bool
) -> fx.Node:
    """The op over every row of ``rows`` (..., D) with ``ids`` (one per row, none ignored): outputs
    ``(-log-prob of each id, lse, entropy | empty, argmax | empty)``, flat."""
    return ops.lean_call(
        graph.call_method("flatten", (rows, 0, -2)),
        weight,
        graph.call_method("flatten", (ids,)),
        bias,
        softcap=site.softcap,
        ignore_index=NO_TARGET,
        reduction="none",
        options=decision.options,
        entropy=entropy,
        compute_dtype=decision.compute_dtype,
    ).emit(graph)


def log_probs_of(graph: fx.Graph, fused: fx.Node, ids: fx.Node) -> fx.Node:
    log_prob = graph.call_function(operator.neg, (graph.call_function(operator.getitem, (fused, 0)),))
    return graph.call_method("view_as", (log_prob, ids))
