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

``NO_TARGET`` (``scored_rows.py``) is an ``ignore_index`` no token equals: every row counts, and an out-of-range id
fails as in eager. Everything after the gather (masks, advantages, ratios) is left as it is. Anything else reading
the logits or the log-softmax (an entropy bonus, a KL term against all tokens) keeps the site as it is, with the
reason in ``stats()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from . import head_chain, sites
from . import scored_rows as sr
from . import spellings as sp

UNSQUEEZE = sp.functions(torch.unsqueeze) | sp.methods("unsqueeze")
STACK = sp.functions(torch.stack)

FORM = "token_log_probs"


def _match(gather: fx.Node) -> sites.Site:
    """The site of one ``gather(log_softmax(logits), -1, ids)``: its value replaces the gather's squeeze, if any."""
    log_probs, logits, index, squeeze = sr.gathered_log_probs(gather)
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
        ignore_index=sr.NO_TARGET,
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
    if not sp.matches(node, sr.GATHER):
        return False
    meta = sp.example_value(sp.call_arg(node, 0, "input"))
    sparse = node.kwargs.get("sparse_grad", False) or (len(node.args) > 3 and node.args[3])
    return isinstance(meta, torch.Tensor) and sr.last_dim(node, 1, "dim", meta.dim()) and not sparse


def _squeezed_last(node: Any) -> fx.Node | None:
    """``x`` of ``x.squeeze(-1)``, else None."""
    if not sp.matches(node, sr.SQUEEZE):
        return None
    meta = sp.example_value(node.args[0])
    return node.args[0] if isinstance(meta, torch.Tensor) and sr.last_dim(node, 1, "dim", meta.dim()) else None


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
    if not (sp.matches(log_probs, sp.LOG_SOFTMAX) and sp.matches(index, UNSQUEEZE) and sr.is_row_softmax(log_probs)):
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
    return sr.scored_rows_site(spelling.logits, spelling.nodes, [spelling.root], spelling.index)


def emit_token_log_probs(
    graph: fx.Graph, record: sites.Record, decision: sites.Decision, rows, weight, bias
) -> list[fx.Node]:
    """The token log-probs from one call of the op (module docstring)."""
    site = record.site
    ids = graph.call_method("squeeze", (site.targets, -1)) if record.squeezed else site.targets
    return [sr.log_probs_of(graph, sr.fused_token_call(graph, site, decision, rows, weight, ids, bias, False), ids)]


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
        if n not in members and sp.matches(n, sr.GATHER) and sp.matches(sp.call_arg(n, 0, "input"), sp.LOG_SOFTMAX)
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
        FORM, node, site, dtensor=sr.dtensor_refusal(site, "token log-probs"), label=label, squeezed=squeezed
    )
