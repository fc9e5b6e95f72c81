"""A matched loss site, and how any pass replaces it: what every rewrite shares.

A :class:`Site` is a :class:`~cce_inductor.fx_passes.head_chain.Logits` chain plus the loss that reads it (a
``cross_entropy``, or the last node of an RL form). :func:`replace_site` puts the fused call in the loss's place::

    rows   = <the chain's row views replayed on hidden * scale, with D in place of V>      (M, D)
    weight = weight (in the logits' dtype; .t() of a (D, V) weight),  bias = bias * scale
    loss   = emit_loss(graph, site, rows, weight, targets, bias)        (the pass's own call of the op)
    <every use of the loss>  ->  loss.to(<the dtype the loss had>)
    <logits returned from the graph>  ->  lazy_logits(rows', weight, bias, steps)   (lazy_logits, the default: computed
                                            on first use; see cce_inductor/_lazy_logits.py), or
                                          dropped_logits(...)   (drop_logits; see cce_inductor/_dropped_logits.py)

and erases the chain. :func:`decide` runs a matcher and records a refused site's reason for ``stats()``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import _dispatch, _dropped_logits, _lazy_logits, diagnostics, paths
from ..options import CCEOptions
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
    requires_grad,
    short,
)


@dataclasses.dataclass
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
    escaping_as: str = ""  # what the escaping logits become: "lazy" or "drop" (set by check_escaping)
    class_weight: fx.Node | None = None  # cross_entropy's weight= (V,)
    argmax_users: list[fx.Node] = dataclasses.field(default_factory=list)  # argmax(chain node, -1): fed by the op
    argmax_branches: list[fx.Node] = dataclasses.field(default_factory=list)  # upcasts between the chain and those
    argmax_round: str = ""  # the dtype eager's logits have where the argmax reads them ("" without argmax users)
    insert_before: fx.Node | None = None  # where the fused call goes, if not at the loss (an argmax before it)


# What a rewrite puts in place of the loss: given the hidden-state rows (M, D), the (V, D) weight, the targets and
# the bias (None or (V,)), all in the logits' dtype, emit the loss nodes and return the last one.
EmitLoss = Callable[[fx.Graph, Site, fx.Node, fx.Node, fx.Node, fx.Node | None], fx.Node]


def replace_site(graph: fx.Graph, site: Site, emit_loss: EmitLoss, stored_operands: bool = True) -> None:
    """Replace the matched site by ``emit_loss``'s nodes (module docstring). ``stored_operands``: an emitter that
    calls the fused ops with ``compute_dtype=op_compute_dtype(site)`` gets the operands as stored (the op converts
    them for its call); else in the logits' dtype."""
    keep = stored_operands and op_compute_dtype(site) is not None
    with graph.inserting_before(site.insert_before or site.cross_entropy):
        rows = rows_of(graph, site, in_logits_dtype=not keep)
        weight, bias = head_operands(graph, site, in_logits_dtype=not keep)
        loss = emit_loss(graph, site, rows, weight, site.targets, bias)
    retire(graph, site, loss)


def op_compute_dtype(site: Site) -> torch.dtype | None:
    """The fused op's ``compute_dtype``: the logits' dtype where an operand is stored in another (autocast: fp32
    hidden states or head, 16-bit logits), so that the op converts them for its call only and returns each gradient
    in its operand's dtype; None where every operand is in the logits' dtype (the graph needs no cast)."""
    operands = [site.hidden, site.weight] + ([site.bias] if site.bias is not None else [])
    if all(example_value(node).dtype == site.compute_dtype for node in operands):
        return None
    return site.compute_dtype


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
    logits' dtype, or as stored (``in_logits_dtype=False``: :func:`op_compute_dtype`)."""
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


def retire(graph: fx.Graph, site: Site, loss: fx.Node) -> None:
    """``loss`` (fp32, or fp64 for fp64 logits) takes the place of the site's loss node; the escaping logits become
    ``dropped_logits`` placeholders (drop_logits); the chain goes."""
    ce = site.cross_entropy
    out_dtype = example_value(ce).dtype
    if out_dtype != torch.float32:
        with graph.inserting_after(loss):
            loss = graph.call_method("to", (loss, out_dtype))
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)

    if site.escaping:
        output = next(n for n in graph.nodes if n.op == "output")
        for node in site.escaping:
            with graph.inserting_before(output):
                if site.escaping_as == "lazy":  # logits computed on first use (cce_inductor/_lazy_logits.py)
                    placeholder = _emit_lazy(graph, site, node)
                else:  # drop_logits: a placeholder that raises on use; check_escaping made sure its shape can be built
                    recipe = _dropped_logits.shape_recipe(node, _dropped_logits.shape_sources(site))
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


def decide(graph_id: int, node: fx.Node, match: Callable[[], Any], prefix: str = "") -> Any:
    """``match()`` for the site at ``node``, or None with the reason recorded for ``stats()``: a NoMatch's message,
    or for any other error "not understood" (a graph shape the matcher does not know must never break compilation).
    Shared by every pass."""
    try:
        return match()
    except NoMatch as why:
        reason = str(why)
    except Exception as exc:  # noqa: BLE001
        reason = f"not understood ({type(exc).__name__}: {exc})"
    diagnostics.record(diagnostics.SiteDecision(graph_id, node.name, False, prefix + reason))
    return None


def check_escaping(site: Site, options: CCEOptions) -> None:
    """Logits returned from the graph may only be replaced by a placeholder (same shape and dtype, raising on any
    use; see ``cce_inductor/_dropped_logits.py``) when the user opted in, and only when their shape can be rebuilt
    from nodes that stay in the graph."""
    if not site.escaping:
        return
    names = ", ".join(n.name for n in site.escaping)
    if not (options.drop_logits or options.lazy_logits):
        raise NoMatch(
            f"logits escape the compiled region ({names} is a graph output, as in Hugging Face models) and "
            "lazy_logits is off (CCE_INDUCTOR_LAZY_LOGITS=0); turn it back on to return them computed on first use, "
            "or set CCE_INDUCTOR_DROP_LOGITS=1 or cce_inductor.make_backend(drop_logits=True) "
            "to return, in their place, a placeholder that raises on use"
        )
    if _compiling_with_cuda_graphs() and not _placeholders_run_between_cuda_graphs():
        # A CUDA graph hands its outputs back as plain tensors over the recorded memory: a placeholder recorded in
        # one would come back as an ordinary (NaN-filled) tensor that neither computes nor raises on use.
        missing = "" if _dropped_logits.CUDAGRAPH_UNSAFE else ", and the cudagraph_unsafe tag, which this torch lacks"
        raise NoMatch(
            f"logits escape the compiled region ({names}) and this graph is compiled with CUDA graphs "
            f"(mode='reduce-overhead') without Inductor's graph partition (torch._inductor.config.graph_partition"
            f"{missing}), "
            "so the op that returns them would be recorded in the graph, which returns plain tensors: neither lazy "
            "logits nor a dropped-logits placeholder can be returned there"
        )
    if options.drop_logits:
        for node in site.escaping:
            recipe = _dropped_logits.shape_recipe(node, _dropped_logits.shape_sources(site))
            if isinstance(recipe, str):
                raise NoMatch(f"the returned logits cannot be replaced by a placeholder: {recipe}")
        site.escaping_as = "drop"
        return
    for node in site.escaping:
        lazy_recipe(site, node)  # raises NoMatch where the path cannot be replayed
    site.escaping_as = "lazy"


def _placeholders_run_between_cuda_graphs() -> bool:
    """Whether Inductor records its CUDA graphs around our placeholder ops and runs them as Python between the
    replays (graph partition, on by default in torch 2.11-2.15, splits a graph at ops tagged ``cudagraph_unsafe``), so
    their real impl's :class:`~cce_inductor.LazyLogits` / ``DroppedLogits`` reaches the caller. Without partitioning
    the tag would make Inductor skip CUDA graphs for the whole graph: the site is left alone instead, and the user
    keeps the CUDA graphs they asked for."""
    import torch._inductor.config as inductor_config  # only needed while compiling

    return bool(_dropped_logits.CUDAGRAPH_UNSAFE) and bool(getattr(inductor_config, "graph_partition", False))


def _compiling_with_cuda_graphs() -> bool:
    """Whether the graph being compiled will run as Inductor CUDA graphs (``mode="reduce-overhead"`` sets this
    config for the duration of the compile, the pre-grad pass included)."""
    import torch._inductor.config as inductor_config  # only needed while compiling

    return bool(inductor_config.triton.cudagraphs)


def describe_site(site: Site) -> str:
    parts = [f"{site.head.name}: {'matmul' if matches(site.head, MATMUL) else 'linear'}"]
    if site.bias is not None:
        parts.append("bias")
    if site.scale != 1.0:
        parts.append(f"scale={site.scale:g}")
    if site.softcap is not None:
        parts.append(f"softcap={site.softcap:g}")
    parts.append(f"reduction={site.reduction}")
    parts.append(f"ignore_index={site.ignore_index}")
    if site.label_smoothing:
        parts.append(f"label_smoothing={site.label_smoothing:g}")
    if site.lse_users:
        parts.append("log-sum-exp reused")
    if site.class_weight is not None:
        parts.append("class weights")
    if site.argmax_users:
        parts.append(f"argmax fused ({', '.join(n.name for n in site.argmax_users)})")
    if site.escaping:
        parts.append(
            (
                "returned logits computed on first use"
                if site.escaping_as == "lazy"
                else "logits dropped from the outputs"
            )
            + (" (their op runs between Inductor's CUDA graphs)" if _compiling_with_cuda_graphs() else "")
        )
    return ", ".join(parts)


def choose_path(site: Site, options: CCEOptions, *, per_row_outputs: bool = False) -> paths.PathChoice:
    """The path of this site (:func:`cce_inductor.paths.choose`) from the shapes Dynamo traced (a dynamic batch: the
    size it was traced with). What requires grad is known here: Dynamo traced the graph with it, and guards on it (the
    loss itself: a head computed with grad whose loss is taken under no_grad needs no gradient). Logits the graph
    returns (``site.escaping``) count in torch.compile's estimated peak: it must materialise them, the rewrite
    returns them lazily or drops them. Operands stored wider than the logits (autocast's fp32 hidden states or head)
    reach the op as stored (:func:`replace_site`): their gradients, and the op's converted copies, count at their
    widths, as the op counts them when it sizes its scratch at run time."""
    logits, hidden = example_value(site.chain[-1]), example_value(site.hidden)
    stored = (
        paths.storage_facts(hidden.dtype, example_value(site.weight).dtype, site.compute_dtype)
        if op_compute_dtype(site) is not None
        else {}
    )
    facts = _dispatch.head_facts(
        logits.shape[0],
        hidden.shape[-1],
        logits.shape[-1],
        site.compute_dtype,
        hidden.device,
        site.reduction,
        needs_grad=requires_grad(site.cross_entropy),
        lse_reused=bool(site.lse_users),
        per_row_outputs=per_row_outputs,
        returned_logits=bool(site.escaping),
        softcapped=site.softcap is not None,
        **stored,
    )
    choice = paths.choose_for(facts, options)
    missing = _dispatch.no_kernels_note(hidden.device, site.compute_dtype)
    if missing:
        choice = dataclasses.replace(choice, reason=choice.reason + missing)
    if isinstance(logits.shape[0], int):
        return choice
    # a symbolic batch: the path holds for every batch this graph serves, the estimates were made at one of them
    traced = "a typical batch" if _dispatch.size_hint(logits.shape[0]) is None else "the batch it was traced with"
    return dataclasses.replace(
        choice,
        reason=f"{choice.reason}; the batch is symbolic: chosen for {facts.rows} rows "
        f"({traced}), and kept for every batch this graph serves",
    )


PER_ROW_OUTPUTS = "per-row outputs (the balanced path computes 'mean' and 'sum' losses)"


def lean_only(options: CCEOptions, why: str = PER_ROW_OUTPUTS) -> str:
    """The suffix of the record of a site that always takes the lean path (per-row outputs: token log-probs,
    entropy; the vocabulary-parallel loss): why, where a balanced path was asked for."""
    asked = options.path == "balanced" or options.scratch_mb
    return f"; lean path: {why}" + (" (a balanced path was asked for)" if asked else "")


def path_decision(graph_id: int, site: Site, description: str, choice: paths.PathChoice) -> diagnostics.SiteDecision:
    """The rewritten site's record for ``stats()``: what was matched, which path it got and why."""
    return diagnostics.SiteDecision(
        graph_id, site.cross_entropy.name, True, f"{description}; {choice.reason}", choice.path
    )


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


def _emit_lazy(graph: fx.Graph, site: Site, node: fx.Node) -> fx.Node:
    """``lazy_logits(rows, weight, bias, steps)`` standing for ``node``: the rows are the hidden states in the head's
    compute dtype with the path's row views replayed on them; every input detached (module docstring of
    ``cce_inductor._lazy_logits``)."""
    row_steps, steps = lazy_recipe(site, node)
    rows = rows_of(graph, dataclasses.replace(site, scale=1.0, row_steps=row_steps))
    weight = site.weight if not site.weight_is_transposed else graph.call_method("t", (site.weight,))
    operands = [graph.call_method("detach", (x,)) if x is not None else None for x in (rows, weight, site.bias)]
    meta = example_value(node)
    wants_grad = isinstance(meta, torch.Tensor) and meta.requires_grad
    return _lazy_logits.emit(graph, *operands, steps=steps, requires_grad=wants_grad)
