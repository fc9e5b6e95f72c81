"""Stage 3 of the pass: a decision per record, from the record alone (its site's nodes are names here, its facts
the graph's): rewrite, with the path and the op's arguments, or leave alone, with the reason stats() records.

::

    refused by find_* or site_facts        -> left alone, the reason
    returned logits (check_escaping)       -> "lazy" / "drop" with their recipes, or left alone
    cross_entropy, by head (head_call)     -> the path of paths.choose (lean | balanced), one call per head
    entropy, token log-probs, DTensor head -> the lean path

Nothing here walks or edits a graph.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _dispatch, _dropped_logits, paths
from ..options import CCEOptions
from .head_chain import NoMatch
from .sites import CROSS_ENTROPY_FORM, Decision, Escaping, Record, Site, SiteFacts, why_not

# What stats() puts before the reason a site of these forms is left alone.
_REFUSED_AS = {"token_log_probs": "token log-probs: ", "entropy": "entropy: "}


def decide(records: list[Record], options: CCEOptions) -> list[tuple[Record, Decision]]:
    """A decision for each record of one form (after ``site_facts.read``), in the order ``replace`` applies them and
    stats() records them: the records' order, but a cross_entropy's refusals before its rewrites, which go by head
    (``SiteFacts.head_call``: the chunks of one head become one call)."""
    decided: list[tuple[Record, Decision]] = []
    by_call: dict[int, list[tuple[Record, Escaping]]] = {}
    for record in records:
        escaping, why = Escaping(), record.refused
        if not why:
            try:
                escaping, why = check_escaping(record.site, record.facts, options), record.dtensor
            except Exception as exc:  # noqa: BLE001
                why = why_not(exc)
        if why:
            decided.append((record, Decision(False, _REFUSED_AS.get(record.form, "") + why)))
        elif record.form == CROSS_ENTROPY_FORM:
            by_call.setdefault(record.facts.head_call, []).append((record, escaping))
        else:
            decided.append((record, _lean(record, escaping, options)))
    for call in sorted(by_call):
        decided += _by_head(by_call[call], options)
    return decided


def _by_head(group: list[tuple[Record, Escaping]], options: CCEOptions) -> list[tuple[Record, Decision]]:
    """The decisions of one cross_entropy site, or of the chunks of one head: one call with reduction="none" (per-row
    outputs, the lean path). Class weights and the argmax: the op with them has the lean path only."""
    chunks = tuple(record.site for record, _ in group) if len(group) > 1 else ()
    merged = f"; one call with {len(group) - 1} other chunk(s) of this head" if chunks else ""
    decided, encoded = [], options.encode()
    for record, escaping in group:
        site, facts = record.site, record.facts
        extended = site.class_weight is not None or bool(site.argmax_users)
        stored_as = op_compute_dtype(site, facts)
        choice = choose_path(site, facts, options, stored_as, per_row_outputs=bool(chunks) or extended)
        reason = f"{describe_site(site, facts, escaping.kind)}{merged}; {choice.reason}"
        grad_scale = facts.upstream.steps if choice.path == "balanced" and not chunks else ()
        if grad_scale:
            reason += f"; its gradients computed at the loss's scale after the cross-entropy ({facts.upstream.named})"
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
    parts = describe_site(site, record.facts, escaping.kind).split(", ")
    if record.form == "tensor_parallel":  # its loss converts no operand: they reach it in the logits' dtype
        why, compute_dtype = "the vocabulary-parallel loss has no balanced form", None
    else:  # fixed for per-row values: "none", and no id ignored
        parts = [part for part in parts if not part.startswith(("reduction=", "ignore_index="))]
        why = "per-row outputs (the balanced path computes 'mean' and 'sum' losses)"
        compute_dtype = op_compute_dtype(site, record.facts)
    asked = " (a balanced path was asked for)" if options.path == "balanced" or options.scratch_mb else ""
    reason = f"{record.label}: {', '.join(parts)}; lean path: {why}{asked}"
    return Decision(True, reason, "lean", record.form, (site,), escaping, compute_dtype, options=options.encode())


def op_compute_dtype(site: Site, facts: SiteFacts) -> torch.dtype | None:
    """The fused op's ``compute_dtype``: the logits' dtype where an operand is stored in another (autocast: fp32
    hidden states or head, 16-bit logits), so that the op converts them for its call only and returns each gradient
    in its operand's dtype; None where every operand is in the logits' dtype (the graph needs no cast)."""
    if all(dtype == site.compute_dtype for dtype in facts.stored_dtypes):
        return None
    return site.compute_dtype


def check_escaping(site: Site, facts: SiteFacts, options: CCEOptions) -> Escaping:
    """What the logits the graph returns become, with the recipe of each (read with the site's facts), or NoMatch:
    "lazy" (computed on first use, ``_lazy_logits.py``), "drop" (a placeholder of their shape and dtype that raises
    on use, ``_dropped_logits.py``: where the user opted in and the shape can be rebuilt from nodes that stay in the
    graph), "" where the graph returns none."""
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
    kind, recipes = ("drop", facts.drop) if options.drop_logits else ("lazy", facts.lazy)
    if isinstance(recipes, str):  # why the recipes could not be made
        raise NoMatch(recipes)
    return Escaping(kind, recipes)


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


def describe_site(site: Site, facts: SiteFacts, escaping_as: str) -> str:
    parts = [f"{site.head.name}: {facts.head_kind}"]
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
    facts: SiteFacts,
    options: CCEOptions,
    stored_as: torch.dtype | None,
    *,
    per_row_outputs: bool = False,
) -> paths.PathChoice:
    """The path of this site (:func:`cce_inductor.paths.choose`) from the shapes Dynamo traced (a dynamic batch: the
    size it was traced with). What requires grad is known here: Dynamo traced the graph with it, and guards on it (the
    loss itself: a head computed with grad whose loss is taken under no_grad needs no gradient). Logits the graph
    returns (``site.escaping``) count in torch.compile's estimated peak: it must materialise them, the rewrite
    returns them lazily or drops them. Operands stored wider than the logits (autocast's fp32 hidden states or head)
    reach the op as stored (``replace``): their gradients, and the op's converted copies, count at their widths, as
    the op counts them when it sizes its scratch at run time (``stored_as``: the op's ``compute_dtype``,
    :func:`op_compute_dtype`). ``facts.upstream``: the graph's scale of the loss (``upstream.py``); one the op cannot
    be given (``unknown``) makes a 16-bit dC the exact pair."""
    hidden_dtype, weight_dtype = facts.stored_dtypes[:2]
    stored = paths.storage_facts(hidden_dtype, weight_dtype, site.compute_dtype) if stored_as is not None else {}
    head = _dispatch.head_facts(
        facts.rows,
        facts.hidden_size,
        facts.vocab,
        site.compute_dtype,
        facts.device,
        site.reduction,
        needs_grad=facts.needs_grad,
        lse_reused=bool(site.lse_users),
        per_row_outputs=per_row_outputs,
        returned_logits=bool(site.escaping),
        softcapped=site.softcap is not None,
        loss_scale=facts.upstream.unknown,
        **stored,
    )
    choice = paths.choose_for(head, options)
    missing = _dispatch.no_kernels_note(facts.device, site.compute_dtype)
    if missing:
        choice = dataclasses.replace(choice, reason=choice.reason + missing)
    if isinstance(facts.rows, int):
        return choice
    # a symbolic batch: the path holds for every batch this graph serves, the estimates were made at one of them
    traced = "a typical batch" if _dispatch.size_hint(facts.rows) is None else "the batch it was traced with"
    return dataclasses.replace(
        choice,
        reason=f"{choice.reason}; the batch is symbolic: chosen for {head.rows} rows "
        f"({traced}), and kept for every batch this graph serves",
    )
