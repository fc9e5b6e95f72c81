"""Rewrite a vocabulary-sharded (DTensor) head and its ``loss_parallel`` cross-entropy into
:func:`cce_inductor.distributed.dtensor_linear_cross_entropy`.

A ``ColwiseParallel(use_local_output=False)`` head under ``loss_parallel()``, as Dynamo records it::

    hidden (DTensor Replicate)   weight (DTensor Shard(0))   [bias (DTensor Shard(0))]
              \\                        |                    /
                       linear(hidden, weight, bias)                  logits: DTensor Shard(-1)
                                   |
                       [redistribute to the same placements]         ColwiseParallel's output hook: a no-op
                                   |
                       row views / upcasts / scale / softcap         (as in linear_cross_entropy.py)
                                   |
                       cross_entropy(logits2d, targets, ...)         loss_parallel's sharded cross-entropy

is replaced by::

    loss = dtensor_linear_cross_entropy(rows, weight, targets, bias=..., softcap=..., ignore_index=..., reduction=...,
                                        options=options.encode())

The site is matched by ``linear_cross_entropy.match_site`` and replaced by ``replace.replace``; only the checks of
the parallel layout (:func:`find_dtensor_sites`) and the loss call (:func:`emit_vocab_parallel_loss`) are this
module's. Sites on plain tensors are left to ``linear_cross_entropy.py``.
"""

from __future__ import annotations

import torch.fx as fx

from . import linear_cross_entropy as lce
from . import sites
from . import spellings as sp

FORM = "tensor_parallel"


def _is_redistribute(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "redistribute"
    # torch <= 2.11: Dynamo captures DTensor.redistribute as a generated function named prim_redistribute
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "prim_redistribute"


def _is_noop_redistribute(node: fx.Node) -> bool:
    """``x.redistribute(...)`` whose output has the placements of its input (ColwiseParallel's output hook)."""
    from torch.distributed.tensor import DTensor  # only where a DTensor site exists

    if not _is_redistribute(node) or not node.args:
        return False
    src, out = sp.example_value(node.args[0]), sp.example_value(node)
    return (
        isinstance(src, DTensor)
        and isinstance(out, DTensor)
        and src.device_mesh == out.device_mesh
        and tuple(src.placements) == tuple(out.placements)
        and src.dtype == out.dtype
        and src.shape == out.shape
    )


def _tensor_parallel_reason(site: sites.Site) -> str | None:
    """Why ``site`` (matched on DTensor example values) is not a vocabulary-parallel head, or None if it is."""
    from torch.distributed.tensor import DTensor, Shard

    weight, logits = sp.example_value(site.weight), sp.example_value(site.head)
    if not isinstance(weight, DTensor) or not isinstance(logits, DTensor):
        return "mixed DTensor and plain tensors between head and loss"
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return f"head weight placements {weight.placements} (need Shard(0) on a 1-D mesh)"
    (placement,) = logits.placements
    if not (placement.is_shard() and placement.dim in (-1, logits.dim() - 1)):
        return f"logits placements {logits.placements} (need the vocabulary dimension sharded)"
    for name, node in (("hidden states", site.hidden), ("targets", site.targets)):
        meta = sp.example_value(node)
        if isinstance(meta, DTensor) and not all(p.is_replicate() for p in meta.placements):
            return f"{name} are {meta.placements}, not replicated"
    if site.weight_is_transposed:
        return "a (D, V) head weight under tensor parallelism"
    if site.bias is not None:
        bias = sp.example_value(site.bias)
        if not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),):
            return "head bias is not Shard(0)"
    if site.escaping:
        return "the logits escape the compiled region"
    if site.label_smoothing:
        return "label smoothing (the vocabulary-parallel loss has none)"
    if site.lse_users:
        return "the log-sum-exp is used beyond the loss (the vocabulary-parallel loss does not return it)"
    return None


def find_dtensor_sites(graph: fx.Graph) -> list[sites.Record]:
    """Stage 1: a record of every DTensor site ``linear(h, W: Shard(0)) -> [no-op redistribute] ->
    views -> [softcap] -> cross_entropy`` in ``graph``, matched or refused. Where there is one, the no-op
    redistributes go first (they change no value, and the walk to the head does not pass them)."""
    losses = [
        node
        for node in graph.nodes
        if sp.matches(node, sp.CROSS_ENTROPY) and sp.is_dtensor(sp.example_value(lce.cross_entropy_input(node)))
    ]
    if losses:
        for node in list(graph.nodes):
            if _is_noop_redistribute(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
    return [_record(ce) for ce in losses]


def _record(ce: fx.Node) -> sites.Record:
    try:
        site = lce.match_site(ce)
        reason = _tensor_parallel_reason(site)
    except Exception as exc:  # noqa: BLE001
        return sites.Record(FORM, ce, refused=sites.why_not(exc))
    if reason is not None:
        return sites.Record(FORM, ce, refused=f"tensor parallel: {reason}")
    return sites.Record(FORM, ce, site, label="tensor parallel (vocabulary-sharded head)")


def emit_vocab_parallel_loss(
    graph: fx.Graph, record: sites.Record, decision: sites.Decision, rows, weight, bias
) -> list[fx.Node]:
    """The vocabulary-parallel loss in place of the site's (module docstring)."""
    from ..distributed import dtensor_linear_cross_entropy  # imports torch.distributed

    site = record.site
    kwargs = dict(bias=bias, softcap=site.softcap, ignore_index=site.ignore_index, reduction=site.reduction)
    kwargs["options"] = decision.options
    return [graph.call_function(dtensor_linear_cross_entropy, (rows, weight, site.targets), kwargs)]
