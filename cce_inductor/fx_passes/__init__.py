"""Every graph pass of cce_inductor (as ``torch/_inductor/fx_passes``): the machinery apart, one module per form.

The machinery every pass shares, as Inductor keeps ``pattern_matcher.py`` apart from its patterns:

* ``spellings.py``: how each operation can be spelled in a Dynamo graph (the matchers' vocabulary, as data);
* ``head_chain.py``: the walk from what a loss reads back to the linear head (row views, upcasts, scale, softcap);
* ``added_bias.py``: a bias added to the head's product on its own, which the walk takes as the head's bias;
* ``sites.py``: a matched site, the record and the decision made of it (plain data), the graph edits they share;
* ``pipeline.py``: the stages after ``find_*``: ``decide`` (records -> decisions) and ``replace`` (a decision's edit);
* ``upstream.py``: the loss's scale after the cross-entropy, which the balanced op computes its gradients at.

The matched forms, each module's docstring showing the graph it matches, each with a ``find_*`` (graph -> records)
and an ``emit_*`` of its fused call (registered below for ``pipeline.replace``):

* ``nll_loss.py``: ``nll_loss(log_softmax(logits))`` normalised into ``cross_entropy(logits)`` (run first);
* ``linear_cross_entropy.py``: ``linear -> [softcap] -> cross_entropy`` on plain tensors -> the fused op;
* ``chunked_heads.py``: the cross_entropy sites of one head's chunks -> one call (grouped by ``decide``);
* ``tensor_parallel.py``: the same site on a vocabulary-sharded DTensor head -> the vocabulary-parallel loss;
* ``entropy.py``: the entropy of the head's softmax (RL's entropy bonus), alone or with the token log-probs of the
  same logits -> one call of the op;
* ``token_log_probs.py``: ``log_softmax(logits).gather(-1, ids)`` (RL's per-token log-probabilities) -> the op.

:func:`rewrite_graph` runs them all on one graph (what ``CCEGraphPass`` calls).
"""

from __future__ import annotations

import torch.fx as fx

from .. import diagnostics
from ..options import CCEOptions
from . import chunked_heads, entropy, linear_cross_entropy, pipeline, sites, tensor_parallel, token_log_probs
from .nll_loss import normalize_nll_loss

__all__ = ["rewrite_graph"]

# Each form's emitter of its fused call, for pipeline.replace: registered once, as Inductor's register_replacement.
pipeline.register_replacement(linear_cross_entropy.FORM, linear_cross_entropy.emit_fused_loss)
pipeline.register_replacement(chunked_heads.FORM, chunked_heads.emit_one_call)
pipeline.register_replacement(tensor_parallel.FORM, tensor_parallel.emit_vocab_parallel_loss)
pipeline.register_replacement(entropy.FORM, entropy.emit_entropy)
pipeline.register_replacement(token_log_probs.FORM, token_log_probs.emit_token_log_probs)


def rewrite_graph(graph: fx.Graph, options: CCEOptions) -> int:
    """Every rewrite of cce_inductor on ``graph``, form by form (DTensor sites first): its ``find_*``, then
    ``pipeline.decide`` and ``pipeline.replace``; returns the number of sites rewritten."""
    graph_id = diagnostics.new_graph()
    for node, why in normalize_nll_loss(graph):
        diagnostics.record(diagnostics.SiteDecision(graph_id, node, False, why))
    rewritten = _apply(graph, tensor_parallel.find_dtensor_sites(graph), options, graph_id)
    records = linear_cross_entropy.find_cross_entropy(graph)
    if not records:
        diagnostics.log.debug("cce_inductor: graph %d has no cross_entropy call on plain tensors", graph_id)
    rewritten += _apply(graph, records, options, graph_id)
    # entropy before token log-probs: it takes the log-probs beside an entropy
    rewritten += _apply(graph, entropy.find_entropy(graph), options, graph_id)
    return rewritten + _apply(graph, token_log_probs.find_token_log_probs(graph), options, graph_id)


def _apply(graph: fx.Graph, records: list[sites.Record], options: CCEOptions, graph_id: int) -> int:
    """One form's records decided and replaced, each decision recorded for ``stats()``; returns how many rewritten."""
    decided = pipeline.decide(records, options)
    for record, decision in decided:
        pipeline.replace(graph, record, decision)
        diagnostics.record(
            diagnostics.SiteDecision(graph_id, record.node.name, decision.rewrite, decision.reason, decision.path)
        )
    done = sum(decision.rewrite for _, decision in decided)
    if done:
        graph.lint()
    return done
