"""Stage 4 of the pass: a decision's fused call in its site's place. Matches nothing, so it cannot refuse half-way.

``replace`` puts the call where the site's loss stood, with the helpers below::

    rows   = <the chain's row views replayed on hidden * scale, with D in place of V>      (M, D)
    weight = weight (in the logits' dtype; .t() of a (D, V) weight),  bias = bias * scale
    loss   = <the form's emitter>(graph, record, decision, rows, weight, bias)
    <every use of the loss>  ->  loss.to(<the dtype the loss had>)
    <logits returned from the graph>  ->  lazy_logits(rows', weight, bias, steps)   (lazy_logits, the default: computed
                                            on first use; see cce_inductor/_lazy_logits.py), or
                                          dropped_logits(...)   (drop_logits; see cce_inductor/_dropped_logits.py)

and :func:`retire` erases the chain. Each form registers its emitter (``register_replacement``, as Inductor's), once.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _dropped_logits, _lazy_logits
from .graph_facts import transposed_source
from .head_chain import RowStep
from .sites import Decision, Escaping, Record, Site
from .spellings import MATMUL, example_value, matches

# A form's emitter: given the record, its decision and the call's operands (rows (M, D), weight (V, D), bias), emit
# the fused call and return the node that takes each replaced loss's place, one per site of ``decision.sites``.
Emitter = Callable[[fx.Graph, Record, Decision, fx.Node, fx.Node, fx.Node | None], list[fx.Node]]
_EMITTERS: dict[str, Emitter] = {}


def register_replacement(form: str, emitter: Emitter) -> None:
    """``emitter`` makes the fused call of every rewrite decided for ``form`` (once per form, at import)."""
    _EMITTERS[form] = emitter


def replace(graph: fx.Graph, record: Record, decision: Decision) -> None:
    """The decided call in place of the sites of ``decision``: their operands (:func:`operands`), the call from the
    form's emitter, then each site's loss retired (:func:`retire`). Nothing where the site is left alone, or is a
    chunk that its head's first chunk's call replaces."""
    if not decision.sites:
        return
    first = decision.sites[0]
    with graph.inserting_before(first.insert_before or first.cross_entropy):
        rows, weight, bias = operands(graph, decision.sites, as_stored=decision.compute_dtype is not None)
        losses = _EMITTERS[decision.replacement](graph, record, decision, rows, weight, bias)
    for site, loss in zip(decision.sites, losses):
        retire(graph, site, loss, decision.escaping)


def operands(graph: fx.Graph, group: tuple[Site, ...], as_stored: bool) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """``(rows, weight, bias)`` of one fused call over ``group`` (one site, or the chunks of one head: their rows
    concatenated): in the logits' dtype, or as stored (``as_stored``: the op gets ``compute_dtype``, see
    ``decide.op_compute_dtype``, and converts them for its call only)."""
    rows = [rows_of(graph, site, in_logits_dtype=not as_stored) for site in group]
    rows = rows[0] if len(rows) == 1 else graph.call_function(torch.cat, (rows, 0))
    weight, bias = head_operands(graph, group[0], in_logits_dtype=not as_stored)  # the same for every chunk
    return rows, weight, bias


def cast(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    if example_value(node).dtype == dtype:
        return node
    return graph.call_method("to", (node, dtype))


def _hidden_size(graph: fx.Graph, hidden: fx.Node) -> int | fx.Node:
    size = example_value(hidden).shape[-1]
    if isinstance(size, int):
        return size
    return graph.call_method("size", (hidden, -1))


def rows_of(graph: fx.Graph, site: Site, in_logits_dtype: bool = True) -> fx.Node:
    """The hidden states as the loss's rows: the chain's row views replayed on them, the scale folded in; in the
    logits' dtype, or as stored (``in_logits_dtype=False``: ``decide.op_compute_dtype``)."""
    rows = cast(graph, site.hidden, site.compute_dtype) if in_logits_dtype else site.hidden
    if site.scale != 1.0:
        rows = graph.call_function(operator.mul, (rows, site.scale))
    hidden_size = _hidden_size(graph, site.hidden)
    for step in site.row_steps:
        if step.kind == "reshape":
            rows = graph.call_method("reshape", (rows, *step.args, hidden_size))
        elif step.kind == "flatten":
            rows = graph.call_method("flatten", (rows, *step.args))
        else:
            rows = graph.call_function(operator.getitem, (rows, *step.args))
    return rows


def head_operands(graph: fx.Graph, site: Site, in_logits_dtype: bool = True) -> tuple[fx.Node, fx.Node | None]:
    """``(weight (V, D), bias)``, the scale folded into the bias; in the logits' dtype, or as stored."""

    def operand(node: fx.Node) -> fx.Node:
        return cast(graph, node, site.compute_dtype) if in_logits_dtype else node

    weight = operand(site.weight)
    if site.weight_is_transposed:
        weight = graph.call_method("t", (weight,))
    bias = None if site.bias is None else operand(site.bias)
    if bias is not None and site.scale != 1.0:
        bias = graph.call_function(operator.mul, (bias, site.scale))
    return weight, bias


def retire(graph: fx.Graph, site: Site, loss: fx.Node, escaping: Escaping) -> None:
    """``loss`` (fp32, or fp64 for fp64 logits) takes the place of the site's loss node; the escaping logits become
    what ``escaping`` says: ``lazy_logits`` or ``dropped_logits`` placeholders, from its recipes; the chain goes."""
    ce = site.cross_entropy
    out_dtype = example_value(ce).dtype
    if out_dtype != torch.float32:
        with graph.inserting_after(loss):
            loss = graph.call_method("to", (loss, out_dtype))
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)

    if site.escaping:
        output = next(n for n in graph.nodes if n.op == "output")
        for node, recipe in zip(site.escaping, escaping.recipes, strict=True):
            with graph.inserting_before(output):
                if escaping.kind == "lazy":  # logits computed on first use (cce_inductor/_lazy_logits.py)
                    placeholder = _emit_lazy(graph, site, node, *recipe)
                else:  # drop_logits: a placeholder that raises on use, of the shape its recipe builds
                    placeholder = _dropped_logits.emit(graph, node, site, recipe)
            output.replace_input_with(node, placeholder)
        for node in site.escaping:  # the returned branches (casts, views of the chain) go; the chain goes below
            while node not in site.chain and not node.users:
                source = node.args[0]
                graph.erase_node(node)
                node = source

    for node in reversed(site.chain):
        if not node.users:
            transposed_weight = site.head.args[1] if node is site.head and matches(site.head, MATMUL) else None
            graph.erase_node(node)
            if isinstance(transposed_weight, fx.Node) and not transposed_weight.users:
                if transposed_source(transposed_weight) is not None:
                    graph.erase_node(transposed_weight)


def _emit_lazy(graph: fx.Graph, site: Site, node: fx.Node, row_steps: list[RowStep], steps: list[tuple]) -> fx.Node:
    """``lazy_logits(rows, weight, bias, steps)`` standing for ``node`` (its ``site_facts.lazy_recipe``): the rows are
    the hidden states in the head's compute dtype with the path's row views replayed on them; every input detached
    (module docstring of ``cce_inductor._lazy_logits``)."""
    rows = rows_of(graph, dataclasses.replace(site, scale=1.0, row_steps=row_steps))
    weight = site.weight if not site.weight_is_transposed else graph.call_method("t", (site.weight,))
    operands = [graph.call_method("detach", (x,)) if x is not None else None for x in (rows, weight, site.bias)]
    meta = example_value(node)
    wants_grad = isinstance(meta, torch.Tensor) and meta.requires_grad
    return _lazy_logits.emit(graph, *operands, steps=steps, requires_grad=wants_grad)
