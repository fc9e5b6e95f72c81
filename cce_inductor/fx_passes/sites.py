"""A matched loss site, the record a form's ``find_*`` makes of it, and the graph edits every replacement shares.

A :class:`Site` is a :class:`~cce_inductor.fx_passes.head_chain.Logits` chain plus the loss that reads it (a
``cross_entropy``, or the last node of an RL form); a :class:`Record` is what ``find_*`` returns per site, plain data.
``pipeline.replace`` puts the fused call in the loss's place with the helpers here::

    rows   = <the chain's row views replayed on hidden * scale, with D in place of V>      (M, D)
    weight = weight (in the logits' dtype; .t() of a (D, V) weight),  bias = bias * scale
    loss   = <the form's emitter>(graph, record, decision, rows, weight, bias)
    <every use of the loss>  ->  loss.to(<the dtype the loss had>)
    <logits returned from the graph>  ->  lazy_logits(rows', weight, bias, steps)   (lazy_logits, the default: computed
                                            on first use; see cce_inductor/_lazy_logits.py), or
                                          dropped_logits(...)   (drop_logits; see cce_inductor/_dropped_logits.py)

and :func:`retire` erases the chain.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .. import _dropped_logits, _lazy_logits
from .graph_facts import transposed_source
from .head_chain import NoMatch, RowStep, _row_step, branch_path, upcast_target
from .spellings import (
    DIV,
    FLATTEN,
    GETITEM,
    MATMUL,
    MUL,
    RESHAPE,
    TANH,
    const_float,
    example_value,
    matches,
    short,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    cross_entropy: fx.Node  # the loss node the fused call replaces (for RL forms: the first node of the form)
    head: fx.Node
    hidden: fx.Node
    weight: fx.Node
    weight_is_transposed: bool
    bias: fx.Node | None
    compute_dtype: torch.dtype
    row_steps: list[RowStep]
    softcap: float | None
    scale: float
    targets: fx.Node
    ignore_index: int
    reduction: str
    label_smoothing: float
    chain: list[fx.Node]  # head ... the loss's input, forward order
    escaping: list[fx.Node]  # nodes whose values are graph outputs: chain nodes, or casts / row views of them
    lse_users: list[fx.Node]  # logsumexp(loss input, -1) nodes: fed by the op's lse
    class_weight: fx.Node | None = None  # cross_entropy's weight= (V,)
    argmax_users: list[fx.Node] = dataclasses.field(default_factory=list)  # argmax(chain node, -1): fed by the op
    argmax_branches: list[fx.Node] = dataclasses.field(default_factory=list)  # upcasts between the chain and those
    argmax_round: str = ""  # the dtype eager's logits have where the argmax reads them ("" without argmax users)
    insert_before: fx.Node | None = None  # where the fused call goes, if not at the loss (an argmax before it)


@dataclasses.dataclass(frozen=True, eq=False)
class Record:
    """One site a form's ``find_*`` looked at, as plain data: ``pipeline.decide`` reads it, ``pipeline.replace`` and the
    form's emitter edit the graph with it. Matched (``site``) or refused by the match (why in ``refused``)."""

    form: str  # the module that found it, which keys its emitter: "linear_cross_entropy", "entropy", ...
    node: fx.Node  # the node stats() names
    site: Site | None = None
    refused: str = ""
    dtensor: str = ""  # why operands on DTensors keep a matched site as it is (told after its returned logits' checks)
    label: str = ""  # what stats() calls a rewritten site before its description (forms other than cross_entropy)
    log_probs: fx.Node | None = None  # entropy: the token log-probs of the same logits, replaced by the same call
    squeezed: bool = False  # token log-probs, entropy: the ids are (..., 1), squeezed for the op


class Escaping(NamedTuple):
    """What a site's returned logits become (``pipeline.check_escaping``): ``kind`` "lazy" (computed on first use),
    "drop" (a placeholder that raises on use) or "" (the graph returns none), and per returned node (``Site.escaping``)
    its recipe: the lazy logits' ``(row steps, elementwise steps)`` (:func:`lazy_recipe`) or the placeholder's shape
    (``_dropped_logits.shape_recipe``). Made while deciding, so that replacing matches nothing."""

    kind: str = ""
    recipes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``pipeline.decide`` makes of one record: plain data, read by ``pipeline.replace``, recorded in stats()."""

    rewrite: bool
    reason: str  # what was matched and why this path (a rewrite), or why the site is left alone
    path: str = ""  # a rewrite's path: "lean" or "balanced"
    replacement: str = ""  # the form whose registered emitter makes the call
    sites: tuple[Site, ...] = ()  # what the call replaces: the site, or on a head's first chunk every chunk (else none)
    escaping: Escaping = Escaping()  # what the returned logits become (a head's chunks return none: chunk_groups)
    compute_dtype: torch.dtype | None = None  # the op's compute_dtype: the operands reach it as stored
    plain_sum: bool = False  # the balanced path sums dC in its own 16-bit dtype
    options: str = ""  # CCEOptions.encode(): the op's options argument
    grad_scale: tuple = ()  # the balanced op's upstream gradient, as ``upstream.UpstreamGradient.steps`` (else none)
    de_pair: bool = False  # where dC is the balanced path's pair, a 16-bit dE is one too (``paths.BalancedPlan``)


def why_not(exc: Exception) -> str:
    """A record's ``refused`` where a match or check raised ``exc``: a NoMatch's message, or for any other error
    "not understood" (a graph shape the matcher does not know must never break compilation)."""
    return str(exc) if isinstance(exc, NoMatch) else f"not understood ({type(exc).__name__}: {exc})"


def operands(graph: fx.Graph, group: tuple[Site, ...], as_stored: bool) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """``(rows, weight, bias)`` of one fused call over ``group`` (one site, or the chunks of one head: their rows
    concatenated): in the logits' dtype, or as stored (``as_stored``: the op gets ``compute_dtype``, see
    ``pipeline.op_compute_dtype``, and converts them for its call only)."""
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
    logits' dtype, or as stored (``in_logits_dtype=False``: ``pipeline.op_compute_dtype``)."""
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


# --------------------------------------------------------------------------------------------------------------
# Returned logits, computed on first use (lazy_logits)
# --------------------------------------------------------------------------------------------------------------


def lazy_recipe(site: Site, node: fx.Node) -> tuple[list[RowStep], list[tuple]]:
    """How the returned ``node`` comes out of the head: the row views on the way (replayed on the hidden states) and
    its elementwise steps, in order (``cce_inductor._lazy_logits.encode_steps``), or NoMatch."""
    row_steps: list[RowStep] = []
    steps: list[tuple] = []
    vocab = example_value(site.head).shape[-1]
    for step in branch_path(node, site.chain)[1:]:
        cast_to = upcast_target(step)
        if cast_to is not None:
            steps.append(("to", cast_to))
        elif matches(step, RESHAPE) or matches(step, FLATTEN) or matches(step, GETITEM):
            row_steps.append(_row_step(step, vocab))
        elif matches(step, TANH):
            steps.append(("tanh",))
        elif (matches(step, MUL) or matches(step, DIV)) and len(step.args) == 2 and not step.kwargs:
            a, b = step.args
            if matches(step, DIV) and isinstance(a, fx.Node) and const_float(b) is not None:
                steps.append(("div", const_float(b)))
            elif matches(step, MUL) and isinstance(a, fx.Node) and const_float(b) is not None:
                steps.append(("mul", const_float(b)))
            elif matches(step, MUL) and isinstance(b, fx.Node) and const_float(a) is not None:
                steps.append(("mul", const_float(a)))
            else:
                raise NoMatch(f"the returned logits ({node.name}) go through {short(step)}, which cannot be replayed")
        elif step.op == "call_method" and step.target in ("contiguous", "detach") or step.target is torch.detach:
            continue
        else:
            raise NoMatch(f"the returned logits ({node.name}) go through {short(step)}, which cannot be replayed")
    return row_steps, steps


def _emit_lazy(graph: fx.Graph, site: Site, node: fx.Node, row_steps: list[RowStep], steps: list[tuple]) -> fx.Node:
    """``lazy_logits(rows, weight, bias, steps)`` standing for ``node`` (its :func:`lazy_recipe`): the rows are the
    hidden states in the head's compute dtype with the path's row views replayed on them; every input detached
    (module docstring of ``cce_inductor._lazy_logits``)."""
    rows = rows_of(graph, dataclasses.replace(site, scale=1.0, row_steps=row_steps))
    weight = site.weight if not site.weight_is_transposed else graph.call_method("t", (site.weight,))
    operands = [graph.call_method("detach", (x,)) if x is not None else None for x in (rows, weight, site.bias)]
    meta = example_value(node)
    wants_grad = isinstance(meta, torch.Tensor) and meta.requires_grad
    return _lazy_logits.emit(graph, *operands, steps=steps, requires_grad=wants_grad)
