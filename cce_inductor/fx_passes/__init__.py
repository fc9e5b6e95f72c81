"""Every graph pass of cce_inductor (as ``torch/_inductor/fx_passes``): the machinery apart, one module per form.

:func:`rewrite_graph` runs each form of :data:`FORMS` through the same four stages, each a function that returns
data for the next::

    records   = <form>.find(graph)                  one ``sites.Record`` per site: the nodes matched, or why not
    records   = site_facts.read(records)            + what the graph says of each (shapes, dtypes, recipes)
    decisions = decide.decide(records, options)     rewrite (the path, the op's arguments) or leave alone (why)
    replace.replace(graph, record, decision)        the fused call from the form's emitter, in the site's place

The machinery every form shares, as Inductor keeps ``pattern_matcher.py`` apart from its patterns:

* ``spellings.py``: how each operation can be spelled in a Dynamo graph (the matchers' vocabulary, as data);
* ``graph_facts.py``: what a node does to storage (in-place writes, views, transposes);
* ``head_chain.py``: the walk from what a loss reads back to the linear head (row views, upcasts, scale, softcap);
* ``added_bias.py``: a bias added to the head's product on its own, which the walk takes as the head's bias;
* ``upstream.py``: the loss's scale after the cross-entropy, which the balanced op computes its gradients at;
* ``scored_rows.py``: what the two RL forms share: a site over every row of the logits, one id per row, and its call;
* ``sites.py``: the data the stages hand on; ``site_facts.py``, ``decide.py``, ``replace.py``: stages 2-4.

The matched forms, each module's docstring showing the graph it matches, each a ``find_*`` (graph -> records) and
an ``emit_*`` of its fused call:

* ``nll_loss.py``: ``nll_loss(log_softmax(logits))`` normalised into ``cross_entropy(logits)`` (run first);
* ``tensor_parallel.py``: ``linear -> [softcap] -> cross_entropy`` on a vocabulary-sharded DTensor head -> the
  vocabulary-parallel loss;
* ``linear_cross_entropy.py``: the same on plain tensors -> the fused op;
* ``chunked_heads.py``: the cross_entropy sites of one head's chunks -> one call (an emitter only: its sites are
  ``linear_cross_entropy``'s, grouped by ``site_facts.read``);
* ``entropy.py``: the entropy of the head's softmax (RL's entropy bonus), alone or with the token log-probs of the
  same logits -> one call of the op;
* ``token_log_probs.py``: ``log_softmax(logits).gather(-1, ids)`` (RL's per-token log-probabilities) -> the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch.fx as fx

from .. import diagnostics
from ..options import CCEOptions
from . import (
    chunked_heads,
    decide,
    entropy,
    linear_cross_entropy,
    replace,
    site_facts,
    tensor_parallel,
    token_log_probs,
)
from .nll_loss import normalize_nll_loss
from .sites import Record

__all__ = ["FORMS", "rewrite_graph"]


class Form(NamedTuple):
    name: str  # what its records and decisions are keyed by
    find: Callable[[fx.Graph], list[Record]] | None  # stage 1 (None: a replacement of another form's sites)
    emit: replace.Emitter  # its fused call (stage 4)


# In the order they run: DTensor sites before the plain ones; entropy before token log-probs, as it takes the
# log-probs beside an entropy.
FORMS = (
    Form(tensor_parallel.FORM, tensor_parallel.find_dtensor_sites, tensor_parallel.emit_vocab_parallel_loss),
    Form(linear_cross_entropy.FORM, linear_cross_entropy.find_cross_entropy, linear_cross_entropy.emit_fused_loss),
    Form(chunked_heads.FORM, None, chunked_heads.emit_one_call),
    Form(entropy.FORM, entropy.find_entropy, entropy.emit_entropy),
    Form(token_log_probs.FORM, token_log_probs.find_token_log_probs, token_log_probs.emit_token_log_probs),
)
for _form in FORMS:  # as Inductor's register_replacement, once
    replace.register_replacement(_form.name, _form.emit)


def rewrite_graph(graph: fx.Graph, options: CCEOptions) -> int:
    """Every rewrite of cce_inductor on ``graph`` (what ``CCEGraphPass`` calls): ``nll_loss`` normalised, then each
    form's four stages (module docstring); returns the number of sites rewritten."""
    graph_id = diagnostics.new_graph()
    for node, why in normalize_nll_loss(graph):
        diagnostics.record(diagnostics.SiteDecision(graph_id, node, False, why))
    rewritten = 0
    for form in FORMS:
        if form.find is None:
            continue
        records = form.find(graph)
        if form.name == linear_cross_entropy.FORM and not records:
            diagnostics.log.debug("cce_inductor: graph %d has no cross_entropy call on plain tensors", graph_id)
        rewritten += _apply(graph, site_facts.read(records), options, graph_id)
    return rewritten


def _apply(graph: fx.Graph, records: list[Record], options: CCEOptions, graph_id: int) -> int:
    """One form's records decided and replaced, each decision recorded for ``stats()``; returns how many rewritten."""
    decided = decide.decide(records, options)
    for record, decision in decided:
        replace.replace(graph, record, decision)
        diagnostics.record(
            diagnostics.SiteDecision(graph_id, record.node.name, decision.rewrite, decision.reason, decision.path)
        )
    done = sum(decision.rewrite for _, decision in decided)
    if done:
        graph.lint()
    return done
