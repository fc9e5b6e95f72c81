"""Rewrite per-token log-probabilities of given tokens (RL fine-tuning: GRPO, PPO) into the fused op.

Policy-gradient trainers score sampled tokens with the log-probability the policy gives them, usually after a
constant temperature, then mask and weight the result (advantages, clipped ratios against detached old
log-probabilities). The matched graph::

    hidden (..., D)     weight (V, D)     [bias (V,)]
           \\                 |              /
            linear | matmul  -> logits (..., V)  -> row views / upcasts / scale (1 / temperature) / softcap
                                     |
                     log_softmax(logits, -1)                    F.log_softmax, torch.log_softmax, .log_softmax
                                     |
                     gather(-1, ids.unsqueeze(-1))  [.squeeze(-1)]   ids (..., 1) int64, logits' leading shape

and so are the other spellings of the same values (TRL's ``selective_log_softmax``, both branches)::

    squeeze(gather(logits, -1, ids.unsqueeze(-1)), -1) - logsumexp(logits, -1)          (fp32: gather - logsumexp)
        with logsumexp(logits, -1) also as  stack([logsumexp(row, -1) for row in logits])      (a loop over dim 0)
    stack([log_softmax(row, -1).gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)                (16-bit: a loop over
           for row, row_ids in zip(logits, ids)])                                              the batch rows)

Each is replaced by (a token's log-probability is minus its cross-entropy)::

    rows = <the row views replayed on hidden>.flatten(0, -2)                       (M, D)
    nll  = cce_inductor::linear_cross_entropy(rows, weight, ids.flatten(), bias, cap, NO_TARGET, "none", 0.0,
                                              options.encode(), False, False)[0]
    out  = (-nll).view_as(<gather's index, or its squeezed form>).to(<log_softmax's dtype>)

``NO_TARGET`` is an ``ignore_index`` no token equals: every row counts, and an out-of-range id fails as in eager.
Everything after the gather (masks, advantages, ratios) is left as it is. Anything else reading the logits or the
log-softmax (an entropy bonus, a KL term against all tokens) keeps the site as it is, with the reason in ``stats()``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from . import head_chain, sites
from . import spellings as sp

GATHER = sp.functions(torch.gather) | sp.methods("gather")
SQUEEZE = sp.functions(torch.squeeze) | sp.methods("squeeze")
UNSQUEEZE = sp.functions(torch.unsqueeze) | sp.methods("unsqueeze")
STACK = sp.functions(torch.stack)

NO_TARGET = -(2**63)
FORM = "token_log_probs"


def _last_dim(node: fx.Node, index: int, name: str, ndim: int) -> bool:
    dim = sp.call_arg(node, index, name)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def gathered_log_probs(gather: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None]:
    """``(log_softmax node, logits, ids, squeeze | None)`` of ``gather(log_softmax(logits, -1), -1, ids)``
    [``.squeeze(-1)``], or NoMatch. Shared with ``entropy.py`` (log-probs and entropy of the same logits)."""
    log_probs, index = sp.call_arg(gather, 0, "input"), sp.call_arg(gather, 2, "index")
    if not sp.matches(log_probs, sp.LOG_SOFTMAX):
        raise head_chain.NoMatch("the gathered tensor is not a log_softmax")
    logits = sp.call_arg(log_probs, 0, "input")
    logits_meta, index_meta = sp.example_value(logits), sp.example_value(index)
    if not isinstance(logits_meta, torch.Tensor) or not isinstance(index_meta, torch.Tensor):
        raise head_chain.NoMatch("log_softmax input or gather index is not a tensor")
    ndim = logits_meta.dim()
    if ndim < 2 or not _last_dim(log_probs, 1, "dim", ndim) or not _last_dim(gather, 1, "dim", ndim):
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
    if squeeze is not None and not (sp.matches(squeeze, SQUEEZE) and _last_dim(squeeze, 1, "dim", ndim)):
        squeeze = None
    return log_probs, logits, index, squeeze


def is_row_softmax(node: fx.Node) -> bool:
    """``node`` (a softmax or log_softmax call) is over the last dimension, with no dtype argument."""
    meta = sp.example_value(node)
    return isinstance(meta, torch.Tensor) and _last_dim(node, 1, "dim", meta.dim()) and sp.dtype_arg(node) is None


def _match(gather: fx.Node) -> sites.Site:
    """The site of one ``gather(log_softmax(logits), -1, ids)``: its value replaces the gather's squeeze, if any."""
    log_probs, logits, index, squeeze = gathered_log_probs(gather)
    last = squeeze if squeeze is not None else gather

    walked = head_chain.walk_logits(logits, last)
    chain = walked.chain + [log_probs, gather] + ([squeeze] if squeeze is not None else [])
    escaping = head_chain.private_chain(chain[:-1], last)
    if any(node in (log_probs, gather, squeeze) for node in escaping):
        raise head_chain.NoMatch("the log-softmax is returned from the graph")
    fields = walked.fields()
    fields["chain"] = chain[:-1]
    return sites.Site(
        cross_entropy=last,
        targets=index,
        ignore_index=NO_TARGET,
        reduction="none",
        label_smoothing=0.0,
        escaping=escaping,
        lse_users=[],
        **fields,
    )


# ------------------------------------------------------------------------------------------------------------
# The other spellings: gather - logsumexp, and loops over the batch rows
# ------------------------------------------------------------------------------------------------------------


def _is_last_dim_gather(node: Any) -> bool:
    """``node`` is a gather over the last dimension, without sparse gradients."""
    if not sp.matches(node, GATHER):
        return False
    meta = sp.example_value(sp.call_arg(node, 0, "input"))
    sparse = node.kwargs.get("sparse_grad", False) or (len(node.args) > 3 and node.args[3])
    return isinstance(meta, torch.Tensor) and _last_dim(node, 1, "dim", meta.dim()) and not sparse


def _squeezed_last(node: Any) -> fx.Node | None:
    """``x`` of ``x.squeeze(-1)``, else None."""
    if not sp.matches(node, SQUEEZE):
        return None
    meta = sp.example_value(node.args[0])
    return node.args[0] if isinstance(meta, torch.Tensor) and _last_dim(node, 1, "dim", meta.dim()) else None


def _stacked_rows(stack: Any, per_row) -> tuple[fx.Node, list] | None:
    """``(source, [per_row(item) ...])`` if ``stack`` is ``torch.stack([f(source[0]), ..., f(source[n - 1])])`` over
    every row of ``source`` (dim 0; ``per_row(item)`` returns ``(row node, payload)`` or None), else None."""
    if not sp.matches(stack, STACK) or sp.call_arg(stack, 1, "dim", 0) != 0:
        return None
    items = sp.call_arg(stack, 0, "tensors")
    if not isinstance(items, (list, tuple)) or not items:
        return None
    found = [per_row(item) if isinstance(item, fx.Node) else None for item in items]
    if any(f is None for f in found):
        return None
    rows = [row for row, _ in found]
    source = rows[0].args[0] if sp.matches(rows[0], sp.GETITEM) else None
    meta = sp.example_value(source)
    if not isinstance(meta, torch.Tensor) or meta.dim() < 2 or meta.shape[0] != len(rows):
        return None
    if any(not sp.matches(row, sp.GETITEM) or row.args != (source, i) for i, row in enumerate(rows)):
        return None
    return source, [payload for _, payload in found]


def _row_logsumexp(item: fx.Node) -> tuple[fx.Node, list] | None:
    row = sp.call_arg(item, 0, "input")
    if not isinstance(row, fx.Node) or not sp.is_row_logsumexp(item, row):
        return None
    return row, [row, item]


def _logsumexp_of(node: Any) -> tuple[fx.Node, list] | None:
    """``(logits, nodes)`` if ``node`` is ``logsumexp(logits, -1)`` or its loop over the rows of dim 0."""
    if sp.matches(node, sp.LOGSUMEXP):
        logits = sp.call_arg(node, 0, "input")
        return (logits, [node]) if isinstance(logits, fx.Node) and sp.is_row_logsumexp(node, logits) else None
    stacked = _stacked_rows(node, _row_logsumexp)
    if stacked is None:
        return None
    logits, parts = stacked
    return logits, [n for part in parts for n in part] + [node]


@dataclasses.dataclass
class Spelling:
    """One spelling of the log-probs: the node replaced, what it reads, the ids of the rows' tokens."""

    root: fx.Node
    logits: fx.Node
    index: fx.Node  # the ids: (..., 1) when ``squeezed`` (the gather's index), else shaped as the logits' rows
    squeezed: bool
    nodes: list[fx.Node]  # the spelling's own nodes, root included, forward order


def gather_minus_logsumexp(sub: fx.Node) -> Spelling | None:
    """``gather(logits, -1, index).squeeze(-1) - logsumexp(logits, -1)`` (or the logsumexp's row loop)."""
    if not sp.matches(sub, sp.SUB) or len(sub.args) != 2 or sub.kwargs:
        return None
    gather = _squeezed_last(sub.args[0])
    lse = _logsumexp_of(sub.args[1])
    if not _is_last_dim_gather(gather) or lse is None:
        return None
    logits, index = sp.call_arg(gather, 0, "input"), sp.call_arg(gather, 2, "index")
    if logits is not lse[0] or not isinstance(index, fx.Node):
        return None
    return Spelling(sub, logits, index, True, [gather, sub.args[0]] + lse[1] + [sub])


def _row_log_prob(item: fx.Node) -> tuple[fx.Node, tuple] | None:
    """``log_softmax(row, -1).gather(-1, ids[i].unsqueeze(-1)).squeeze(-1)``: (row, (ids[i], nodes))."""
    gather = _squeezed_last(item)
    if not _is_last_dim_gather(gather):
        return None
    log_probs, index = sp.call_arg(gather, 0, "input"), sp.call_arg(gather, 2, "index")
    if not sp.matches(log_probs, sp.LOG_SOFTMAX) or not sp.matches(index, UNSQUEEZE) or not is_row_softmax(log_probs):
        return None
    row = sp.call_arg(log_probs, 0, "input")
    return row, (index.args[0], [row, log_probs, index, gather, item])


def stacked_row_log_probs(stack: fx.Node) -> Spelling | None:
    """``torch.stack([...])`` of the rows' log-probs, a loop over ``zip(logits, ids)``."""
    stacked = _stacked_rows(stack, _row_log_prob)
    if stacked is None:
        return None
    logits, parts = stacked
    ids_rows = [ids_row for ids_row, _ in parts]
    ids = ids_rows[0].args[0] if sp.matches(ids_rows[0], sp.GETITEM) else None
    if any(not sp.matches(r, sp.GETITEM) or r.args != (ids, i) for i, r in enumerate(ids_rows)):
        return None
    meta, logits_meta = sp.example_value(ids), sp.example_value(logits)
    if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(logits_meta.shape[:-1]):
        return None
    return Spelling(stack, logits, ids, False, ids_rows + [n for _, nodes in parts for n in nodes] + [stack])


def _match_spelling(spelling: Spelling) -> sites.Site:
    index_meta = sp.example_value(spelling.index)
    if not isinstance(index_meta, torch.Tensor) or index_meta.dtype != torch.int64:
        raise head_chain.NoMatch(f"the token ids {spelling.index.name} are not int64")
    logits_meta = sp.example_value(spelling.logits)
    rows_shape = tuple(index_meta.shape[:-1]) if spelling.squeezed else tuple(index_meta.shape)
    if spelling.squeezed and index_meta.shape[-1] != 1 or rows_shape != tuple(logits_meta.shape[:-1]):
        raise head_chain.NoMatch(f"the ids {spelling.index.name} are not one per row of the logits")
    return scored_rows_site(spelling.logits, spelling.nodes, [spelling.root], spelling.index)


def scored_rows_site(logits: fx.Node, inner: list[fx.Node], replaced: list[fx.Node], ids: fx.Node | None) -> sites.Site:
    """The site of a computation over every row of ``logits`` (token log-probs, entropy): ``inner`` its own nodes,
    of which ``replaced`` take the op's values; the others must be private to it. The op goes where the first of
    ``replaced`` stood (its ids must be computed by then); ``ids``: the scored tokens, or None (entropy alone).
    Shared with ``entropy.py``."""
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


def emit_token_log_probs(
    graph: fx.Graph, record: sites.Record, decision: sites.Decision, rows, weight, bias
) -> list[fx.Node]:
    """The token log-probs from one call of the op (module docstring)."""
    site = record.site
    ids = graph.call_method("squeeze", (site.targets, -1)) if record.squeezed else site.targets
    return [log_probs_of(graph, fused_token_call(graph, site, decision, rows, weight, ids, bias, False), ids)]


def find_token_log_probs(graph: fx.Graph) -> list[sites.Record]:
    """Stage 1: a record of every per-token log-probs spelling over head logits in ``graph``, matched or
    refused."""
    spellings = [
        found
        for node in graph.nodes
        if (found := stacked_row_log_probs(node) or gather_minus_logsumexp(node)) is not None
    ]
    members = {node for spelling in spellings for node in spelling.nodes}
    gathers = [
        n
        for n in graph.nodes
        if n not in members and sp.matches(n, GATHER) and sp.matches(sp.call_arg(n, 0, "input"), sp.LOG_SOFTMAX)
    ]
    return [_record(s.root, s) for s in spellings] + [_record(g, None) for g in gathers]


def _record(node: fx.Node, spelling: Spelling | None) -> sites.Record:
    try:
        site = _match_spelling(spelling) if spelling is not None else _match(node)
    except Exception as exc:  # noqa: BLE001
        return sites.Record(FORM, node, refused=sites.why_not(exc))
    # the log_softmax-gather spelling: squeezed where a squeeze follows the gather (and its value replaces that)
    squeezed = spelling.squeezed if spelling is not None else site.cross_entropy is not node
    label = f"token log-probs of {site.targets.name}"
    return sites.Record(
        FORM, node, site, dtensor=dtensor_refusal(site, "token log-probs"), label=label, squeezed=squeezed
    )
