"""Chunked heads: the ``cross_entropy`` sites that share a head become one ``cce_inductor::linear_cross_entropy`` call.

torchtune-style code applies the head to chunks of the hidden states and takes a cross-entropy per chunk::

    chunk_k = hidden.chunk(n, dim=1)[k]
    loss_k = cross_entropy(linear(chunk_k, W).reshape(-1, V), labels_k)          for k = 0 .. n-1

each site matched by ``linear_cross_entropy.match_site``. One fused call per chunk would pay the per-call costs n
times (a full V x D dC per chunk, summed by autograd, and underfilled grids). Sites with the same head (weight, bias,
scale, softcap) and loss settings, every operand computed before the first loss and none changed in place between
the losses, are replaced by::

    fused = cce_inductor::linear_cross_entropy(cat([rows_0, .., rows_n-1]), W, cat([labels_0, ..]), ..., "none", ...)
    loss_k = split(fused[0], [M_0, .., M_n-1])[k]  reduced as cross_entropy k asked (sum; mean over its counted rows)

so every use of every chunk's loss sees eager's value (reduction "none": per-row outputs, the lean path).
``site_facts.read`` groups the sites (``site_facts.chunk_groups``); :func:`emit_one_call` emits the call.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import ops
from .sites import Decision, Record
from .spellings import example_value

FORM = "chunked_heads"


def _row_count(graph: fx.Graph, targets: fx.Node) -> int | fx.Node:
    size = example_value(targets).shape[0]
    return size if isinstance(size, int) else graph.call_method("size", (targets, 0))


def emit_one_call(graph: fx.Graph, _record: Record, decision: Decision, rows, weight, bias) -> list[fx.Node]:
    """The one call of a chunked head (``decision.sites``; ``rows``: theirs, concatenated) and each chunk's loss."""
    group = decision.sites
    head = group[0]
    targets = graph.call_function(torch.cat, ([site.targets for site in group], 0))
    fused = ops.lean_call(
        rows,
        weight,
        targets,
        bias,
        softcap=head.softcap,
        ignore_index=head.ignore_index,
        reduction="none",
        label_smoothing=head.label_smoothing,
        options=decision.options,
    ).emit(graph)
    row_loss = graph.call_function(operator.getitem, (fused, 0))
    pieces = graph.call_function(torch.split, (row_loss, [_row_count(graph, site.targets) for site in group]))
    losses = []
    for k, site in enumerate(group):
        piece = graph.call_function(operator.getitem, (pieces, k))
        if site.reduction == "sum":
            piece = graph.call_method("sum", (piece,))
        elif site.reduction == "mean":  # over the chunk's counted rows: 0/0 = NaN when all are ignored, as eager
            counted = graph.call_function(operator.ne, (site.targets, site.ignore_index))
            piece = graph.call_function(
                operator.truediv, (graph.call_method("sum", (piece,)), graph.call_method("sum", (counted,)))
            )
        losses.append(piece)
    return losses
