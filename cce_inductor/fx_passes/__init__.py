"""Every graph pass of cce_inductor (as ``torch/_inductor/fx_passes``): the machinery apart, one module per form.

The machinery every pass shares, as Inductor keeps ``pattern_matcher.py`` apart from its patterns:

* ``spellings.py``: how each operation can be spelled in a Dynamo graph (the matchers' vocabulary, as data);
* ``head_chain.py``: the walk from what a loss reads back to the linear head (row views, upcasts, scale, softcap);
* ``added_bias.py``: a bias added to the head's product on its own, which the walk takes as the head's bias;
* ``sites.py``: a matched site, its replacement by a fused call, and the record ``stats()`` keeps of it.

The matched forms, each module's docstring showing the graph it matches:

* ``nll_loss.py``: ``nll_loss(log_softmax(logits))`` normalised into ``cross_entropy(logits)`` (run first);
* ``linear_cross_entropy.py``: ``linear -> [softcap] -> cross_entropy`` on plain tensors -> the fused op;
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
from .entropy import rewrite_entropy
from .linear_cross_entropy import rewrite_linear_cross_entropy
from .nll_loss import normalize_nll_loss
from .tensor_parallel import rewrite_tensor_parallel_sites
from .token_log_probs import rewrite_token_log_probs

__all__ = [
    "rewrite_entropy",
    "rewrite_graph",
    "rewrite_linear_cross_entropy",
    "rewrite_tensor_parallel_sites",
    "rewrite_token_log_probs",
]


def rewrite_graph(graph: fx.Graph, options: CCEOptions) -> int:
    """Every rewrite of cce_inductor on ``graph`` (DTensor sites first); returns the number of sites rewritten."""
    graph_id = diagnostics.new_graph()
    for node, why in normalize_nll_loss(graph):
        diagnostics.record(diagnostics.SiteDecision(graph_id, node, False, why))
    return (
        rewrite_tensor_parallel_sites(graph, options, graph_id)
        + rewrite_linear_cross_entropy(graph, options, graph_id)
        + rewrite_entropy(graph, options, graph_id)  # before token_log_probs: it takes the log-probs beside an entropy
        + rewrite_token_log_probs(graph, options, graph_id)
    )
