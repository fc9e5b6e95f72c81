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

is replaced by (a token's log-probability is minus its cross-entropy)::

    rows = <the row views replayed on hidden>.flatten(0, -2)                       (M, D)
    nll  = cce_inductor::linear_cross_entropy(rows, weight, ids.flatten(), bias, cap, NO_TARGET, "none", 0.0,
                                              options.encode(), False)[0]
    out  = (-nll).view_as(<gather's index, or its squeezed form>).to(<log_softmax's dtype>)

``NO_TARGET`` is an ``ignore_index`` no token equals: every row counts, and an out-of-range id fails as in eager.
Everything after the gather (masks, advantages, ratios) is left as it is. Anything else reading the logits or the
log-softmax (an entropy bonus, a KL term against all tokens) keeps the site as it is, with the reason in ``stats()``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import diagnostics
from ..options import CCEOptions
from . import linear_cross_entropy as lce

LOG_SOFTMAX = lce.functions(F.log_softmax, torch.log_softmax) | lce.methods("log_softmax")
GATHER = lce.functions(torch.gather) | lce.methods("gather")
SQUEEZE = lce.functions(torch.squeeze) | lce.methods("squeeze")

NO_TARGET = -(2**63)


def _last_dim(node: fx.Node, index: int, name: str, ndim: int) -> bool:
    dim = lce.call_arg(node, index, name)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _match(gather: fx.Node) -> tuple[lce.Site, fx.Node]:
    """The site of one ``gather(log_softmax(logits), -1, ids)``, and the node its value replaces."""
    log_probs, index = lce.call_arg(gather, 0, "input"), lce.call_arg(gather, 2, "index")
    if not lce.matches(log_probs, LOG_SOFTMAX):
        raise lce.NoMatch("the gathered tensor is not a log_softmax")
    logits = lce.call_arg(log_probs, 0, "input")
    logits_meta, index_meta = lce.example_value(logits), lce.example_value(index)
    if not isinstance(logits_meta, torch.Tensor) or not isinstance(index_meta, torch.Tensor):
        raise lce.NoMatch("log_softmax input or gather index is not a tensor")
    ndim = logits_meta.dim()
    if ndim < 2 or not _last_dim(log_probs, 1, "dim", ndim) or not _last_dim(gather, 1, "dim", ndim):
        raise lce.NoMatch("log_softmax and gather are not both over the last (vocabulary) dimension")
    if log_probs.kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in log_probs.args[2:]):
        raise lce.NoMatch("log_softmax has a dtype argument")
    if gather.kwargs.get("sparse_grad", False) or (len(gather.args) > 3 and gather.args[3]):
        raise lce.NoMatch("gather with sparse_grad")
    if index_meta.dtype != torch.int64 or index_meta.dim() != ndim or index_meta.shape[-1] != 1:
        raise lce.NoMatch(f"gather index of shape {tuple(index_meta.shape)} / {index_meta.dtype}: one int64 id per row")
    if tuple(index_meta.shape[:-1]) != tuple(logits_meta.shape[:-1]):
        raise lce.NoMatch("gather index does not cover every row of the logits")
    squeeze = next(iter(gather.users)) if len(gather.users) == 1 else None
    if squeeze is not None and not (lce.matches(squeeze, SQUEEZE) and _last_dim(squeeze, 1, "dim", ndim)):
        squeeze = None
    last = squeeze if squeeze is not None else gather

    walked = lce.walk_logits(logits, last)
    chain = walked.chain + [log_probs, gather] + ([squeeze] if squeeze is not None else [])
    escaping = lce.private_chain(chain[:-1], last)
    if any(node in (log_probs, gather, squeeze) for node in escaping):
        raise lce.NoMatch("the log-softmax is returned from the graph")
    fields = walked.fields()
    fields["chain"] = chain[:-1]
    site = lce.Site(cross_entropy=last, targets=index, ignore_index=NO_TARGET, reduction="none", label_smoothing=0.0,
                    escaping=escaping, lse_users=[], **fields)  # fmt: skip
    return site, index


def _checked(site: lce.Site, index: fx.Node, options: CCEOptions) -> tuple[lce.Site, fx.Node]:
    lce.check_escaping(site, options)
    if any(lce.is_dtensor(lce.example_value(n)) for n in (site.hidden, site.weight, index)):
        raise lce.NoMatch("token log-probs on DTensors are not rewritten")
    return site, index


def _token_log_probs(options: CCEOptions, index: fx.Node, squeezed: bool):
    def emit(graph: fx.Graph, site: lce.Site, rows, weight, targets, bias) -> fx.Node:
        ids = graph.call_method("squeeze", (index, -1)) if squeezed else index
        fused = graph.call_function(
            torch.ops.cce_inductor.linear_cross_entropy.default,
            (graph.call_method("flatten", (rows, 0, -2)), weight, graph.call_method("flatten", (ids,)), bias,
             site.softcap, NO_TARGET, "none", 0.0, options.encode(), False),
        )  # fmt: skip
        log_prob = graph.call_function(operator.neg, (graph.call_function(operator.getitem, (fused, 0)),))
        return graph.call_method("view_as", (log_prob, ids))

    return emit


def rewrite_token_log_probs(graph: fx.Graph, options: CCEOptions, graph_id: Optional[int] = None) -> int:
    """Rewrite every ``gather`` of a ``log_softmax`` of head logits in ``graph``; returns the count."""
    gathers = [n for n in graph.nodes if lce.matches(n, GATHER) and lce.matches(lce.call_arg(n, 0, "input"), LOG_SOFTMAX)]
    if not gathers:
        return 0
    if graph_id is None:
        graph_id = diagnostics.new_graph()
    rewritten = 0
    for gather in gathers:
        matched = lce.decide(graph_id, gather, lambda gather=gather: _checked(*_match(gather), options),
                             prefix="token log-probs: ")  # fmt: skip
        if matched is None:
            continue
        site, index = matched
        loss_settings = ("reduction=", "ignore_index=")  # fixed here: "none", and no id ignored
        parts = [part for part in lce.describe_site(site).split(", ") if not part.startswith(loss_settings)]
        description = f"token log-probs of {index.name}: {', '.join(parts)}"
        lce.replace_site(graph, site, _token_log_probs(options, index, squeezed=site.cross_entropy is not gather))
        rewritten += 1
        diagnostics.record(diagnostics.SiteDecision(graph_id, gather.name, True, description))
    if rewritten:
        graph.lint()
    return rewritten
