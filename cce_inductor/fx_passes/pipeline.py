"""The pass's machinery: a one-way pipeline over the records the forms find, as Inductor's ``pattern_matcher.py``
stands apart from the patterns of ``torch/_inductor/fx_passes``.

Per form (``fx_passes.rewrite_graph`` runs them in turn), three stages, the first two returning plain data::

    records   = <form>.find_*(graph)             one ``sites.Record`` per site: the nodes matched, or why not
    decisions = decide(records, options)         per record: rewrite (the path, the op's arguments, the recipes of
                                                 the logits the graph returns) or leave alone (the reason stats()
                                                 records)
    replace(graph, record, decision)             the fused call in the site's place: the operands here, the call
                                                 from the emitter the form registered (``register_replacement``);
                                                 it matches nothing, so it cannot refuse half-way

The stages call into the forms (``find_*``, ``chunked_heads.chunk_groups``, the registered emitters); no form
calls into this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _dispatch, _dropped_logits, paths
from ..options import CCEOptions
from .chunked_heads import chunk_groups
from .head_chain import NoMatch
from .sites import Decision, Escaping, Record, Site, lazy_recipe, operands, retire, why_not
from .spellings import MATMUL, example_value, matches, requires_grad
from .upstream import UpstreamGradient, upstream_gradient

# A form's emitter: given the record, its decision and the call's operands (rows (M, D), weight (V, D), bias), emit
# the fused call and return the node that takes each replaced loss's place, one per site of ``decision.sites``.
Emitter = Callable[[fx.Graph, Record, Decision, fx.Node, fx.Node, fx.Node | None], list[fx.Node]]
_EMITTERS: dict[str, Emitter] = {}

# What stats() puts before the reason a site of these forms is left alone.
_REFUSED_AS = {"token_log_probs": "token log-probs: ", "entropy": "entropy: "}


def register_replacement(form: str, emitter: Emitter) -> None:
    """``emitter`` makes the fused call of every rewrite decided for ``form`` (once per form, at import)."""
    _EMITTERS[form] = emitter


def decide(records: list[Record], options: CCEOptions) -> list[tuple[Record, Decision]]:
    """Stage 2: a decision for each record of one form's ``find_*``, in the order :func:`replace` applies them and
    stats() records them: the records' order, but a cross_entropy's refusals before its rewrites, which go by head
    (``chunked_heads.chunk_groups``: the chunks of one head become one call)."""
    decided: list[tuple[Record, Decision]] = []
    by_loss: dict[fx.Node, tuple[Record, Escaping]] = {}  # matched cross_entropy sites, with their returned logits
    for record in records:
        escaping, why = Escaping(), record.refused
        if record.site is not None:
            try:
                escaping, why = check_escaping(record.site, options), record.dtensor
            except Exception as exc:  # noqa: BLE001
                why = why_not(exc)
        if why:
            decided.append((record, Decision(False, _REFUSED_AS.get(record.form, "") + why)))
        elif record.form == "linear_cross_entropy":
            by_loss[record.site.cross_entropy] = (record, escaping)
        else:
            decided.append((record, _lean(record, escaping, options)))
    for group in chunk_groups([record.site for record, _ in by_loss.values()]):
        decided += _by_head([by_loss[site.cross_entropy] for site in group], options)
    return decided


def _by_head(group: list[tuple[Record, Escaping]], options: CCEOptions) -> list[tuple[Record, Decision]]:
    """The decisions of one cross_entropy site, or of the chunks of one head: one call with reduction="none" (per-row
    outputs, the lean path). Class weights and the argmax: the op with them has the lean path only."""
    chunks = tuple(record.site for record, _ in group) if len(group) > 1 else ()
    merged = f"; one call with {len(group) - 1} other chunk(s) of this head" if chunks else ""
    decided, encoded = [], options.encode()
    for record, escaping in group:
        site = record.site
        extended = site.class_weight is not None or bool(site.argmax_users)
        upstream = upstream_gradient(site.cross_entropy, site.insert_before or site.cross_entropy)
        stored_as = op_compute_dtype(site)
        choice = choose_path(site, options, stored_as, per_row_outputs=bool(chunks) or extended, upstream=upstream)
        reason = f"{describe_site(site, escaping.kind)}{merged}; {choice.reason}"
        grad_scale = upstream.steps if choice.path == "balanced" and not chunks else ()
        if grad_scale:
            reason += f"; its gradients computed at the loss's scale after the cross-entropy ({upstream.named})"
        if chunks:  # one call over every chunk, on the first's decision: operands in the logits' dtype
            form, replaced, compute_dtype = "chunked_heads", chunks if site is chunks[0] else (), None
        else:
            form, replaced, compute_dtype = record.form, (site,), stored_as
        decision = Decision(
            True, reason, choice.path, form, replaced, escaping, compute_dtype, choice.plain_sum, encoded,
            grad_scale, choice.de_pair,
        )  # fmt: skip
        decided.append((record, decision))
    return decided


def _lean(record: Record, escaping: Escaping, options: CCEOptions) -> Decision:
    """A token log-probs, entropy or tensor-parallel site: the lean path always, and stats() says why (and that a
    balanced path was asked for, where it was)."""
    site = record.site
    parts = describe_site(site, escaping.kind).split(", ")
    if record.form == "tensor_parallel":  # its loss converts no operand: they reach it in the logits' dtype
        why, compute_dtype = "the vocabulary-parallel loss has no balanced form", None
    else:  # fixed for per-row values: "none", and no id ignored
        parts = [part for part in parts if not part.startswith(("reduction=", "ignore_index="))]
        why = "per-row outputs (the balanced path computes 'mean' and 'sum' losses)"
        compute_dtype = op_compute_dtype(site)
    asked = " (a balanced path was asked for)" if options.path == "balanced" or options.scratch_mb else ""
    reason = f"{record.label}: {', '.join(parts)}; lean path: {why}{asked}"
    return Decision(True, reason, "lean", record.form, (site,), escaping, compute_dtype, options=options.encode())


def replace(graph: fx.Graph, record: Record, decision: Decision) -> None:
    """Stage 3: the decided call in place of the sites of ``decision``: their operands (:func:`sites.operands`), the
    call from the form's emitter, then each site's loss retired (``sites.retire``). Nothing where the site is left
    alone, or is a chunk that its head's first chunk's call replaces."""
    if not decision.sites:
        return
    first = decision.sites[0]
    with graph.inserting_before(first.insert_before or first.cross_entropy):
        rows, weight, bias = operands(graph, decision.sites, as_stored=decision.compute_dtype is not None)
        losses = _EMITTERS[decision.replacement](graph, record, decision, rows, weight, bias)
    for site, loss in zip(decision.sites, losses):
        retire(graph, site, loss, decision.escaping)


def op_compute_dtype(site: Site) -> torch.dtype | None:
    """The fused op's ``compute_dtype``: the logits' dtype where an operand is stored in another (autocast: fp32
    hidden states or head, 16-bit logits), so that the op converts them for its call only and returns each gradient
    in its operand's dtype; None where every operand is in the logits' dtype (the graph needs no cast)."""
    inputs = [site.hidden, site.weight] + ([site.bias] if site.bias is not None else [])
    if all(example_value(node).dtype == site.compute_dtype for node in inputs):
        return None
    return site.compute_dtype


def check_escaping(site: Site, options: CCEOptions) -> Escaping:
    """What the logits the graph returns become, with the recipe of each, or NoMatch: "lazy" (computed on first use,
    ``_lazy_logits.py``), "drop" (a placeholder of their shape and dtype that raises on use, ``_dropped_logits.py``:
    where the user opted in and the shape can be rebuilt from nodes that stay in the graph), "" where the graph
    returns none."""
    if not site.escaping:
        return Escaping()
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
        sources = _dropped_logits.shape_sources(site)
        recipes = [_dropped_logits.shape_recipe(node, sources) for node in site.escaping]
        for recipe in recipes:
            if isinstance(recipe, str):
                raise NoMatch(f"the returned logits cannot be replaced by a placeholder: {recipe}")
        return Escaping("drop", tuple(recipes))
    # (lazy_recipe raises NoMatch where a path cannot be replayed)
    return Escaping("lazy", tuple(lazy_recipe(site, node) for node in site.escaping))


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


def describe_site(site: Site, escaping_as: str) -> str:
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
            ("returned logits computed on first use" if escaping_as == "lazy" else "logits dropped from the outputs")
            + (" (their op runs between Inductor's CUDA graphs)" if _compiling_with_cuda_graphs() else "")
        )
    return ", ".join(parts)


def choose_path(
    site: Site,
    options: CCEOptions,
    stored_as: torch.dtype | None,
    *,
    per_row_outputs: bool = False,
    upstream: UpstreamGradient | None = None,
) -> paths.PathChoice:
    """The path of this site (:func:`cce_inductor.paths.choose`) from the shapes Dynamo traced (a dynamic batch: the
    size it was traced with). What requires grad is known here: Dynamo traced the graph with it, and guards on it (the
    loss itself: a head computed with grad whose loss is taken under no_grad needs no gradient). Logits the graph
    returns (``site.escaping``) count in torch.compile's estimated peak: it must materialise them, the rewrite
    returns them lazily or drops them. Operands stored wider than the logits (autocast's fp32 hidden states or head)
    reach the op as stored (:func:`replace`): their gradients, and the op's converted copies, count at their
    widths, as the op counts them when it sizes its scratch at run time (``stored_as``: the op's ``compute_dtype``,
    ``op_compute_dtype``). ``upstream``: the graph's scale of the loss (``upstream.py``); one the op cannot be
    given (``unknown``) makes a 16-bit dC the exact pair."""
    logits, hidden = example_value(site.chain[-1]), example_value(site.hidden)
    stored = (
        paths.storage_facts(hidden.dtype, example_value(site.weight).dtype, site.compute_dtype)
        if stored_as is not None
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
        loss_scale=upstream.unknown if upstream is not None else "",
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
