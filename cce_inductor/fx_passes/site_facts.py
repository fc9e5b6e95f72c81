"""Stage 2 of the pass: each matched site's facts read from the graph, once, as plain data (``sites.SiteFacts``).

Deciding (``decide.py``) and replacing (``replace.py``) then read records alone: what the op is given and how the
site is described come from here, and so do the recipes of what can only be rebuilt from the graph::

    shapes, dtypes, device, what requires grad         the path's estimates, the op's compute dtype and gradients
    lazy_recipe(site, returned node)                   the returned logits computed on first use (or why not)
    _dropped_logits.shape_recipe(returned node, ...)   their placeholder's shape (or why not)
    upstream_gradient(loss, ...)                       the loss's gradient scale in the graph (a cross_entropy's)
    lazy_recipe(site, argmax input)[0]                 the rows an argmax user reads
    chunk_groups(sites)                                the cross_entropy sites of one head that become one call
                                                       (``chunked_heads.py``)

A site whose facts cannot be read is left alone, with the reason (``sites.why_not``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import _dropped_logits
from .graph_facts import mutated_tensor, storage_roots
from .head_chain import NoMatch, RowStep, _row_step, branch_path, upcast_target
from .sites import CROSS_ENTROPY_FORM, Record, Site, SiteFacts, why_not
from .spellings import (
    DIV,
    FLATTEN,
    GETITEM,
    GRAD_MODE,
    MATMUL,
    MUL,
    RESHAPE,
    TANH,
    call_arg,
    const_float,
    example_value,
    matches,
    requires_grad,
    short,
)
from .upstream import UpstreamGradient, upstream_gradient


def read(records: list[Record]) -> list[Record]:
    """Stage 2: the records of one form's ``find_*``, each matched one with its facts; the cross_entropy sites that
    share a head numbered by the call they become (``SiteFacts.head_call``, in ``chunk_groups``' order)."""
    read_records = [_with_facts(record) for record in records]
    grouped = [
        record
        for record in read_records
        if record.form == CROSS_ENTROPY_FORM and record.facts is not None and not record.dtensor
    ]
    call_of = {
        site.cross_entropy: call
        for call, group in enumerate(chunk_groups([record.site for record in grouped]))
        for site in group
    }
    return [
        dataclasses.replace(record, facts=dataclasses.replace(record.facts, head_call=call_of[record.node]))
        if record.facts is not None and record.node in call_of
        else record
        for record in read_records
    ]


def _chunk_key(site: Site) -> tuple | None:
    if site.escaping or site.lse_users or site.argmax_users or site.class_weight is not None:
        return None
    return (
        site.weight,
        site.weight_is_transposed,
        site.bias,
        site.scale,
        site.softcap,
        site.ignore_index,
        site.label_smoothing,
        site.compute_dtype,
    )


def chunk_groups(sites: list[Site]) -> list[list[Site]]:
    """Sites grouped for one call each (``chunked_heads.py``): same head and settings, and every operand computed
    before the first loss of the group (the call goes there)."""
    groups: dict = {}
    singles = []
    for site in sites:
        key = _chunk_key(site)
        if key is None:
            singles.append([site])
        else:
            groups.setdefault(key, []).append(site)
    result = singles
    for group in groups.values():
        if len(group) == 1:
            result.append(group)
            continue
        position = {node: i for i, node in enumerate(group[0].cross_entropy.graph.nodes)}
        group.sort(key=lambda site: position[site.cross_entropy])
        operands = [
            n for site in group for n in (site.hidden, site.targets, site.weight, site.bias) if isinstance(n, fx.Node)
        ]
        first = group[0].cross_entropy
        if all(position[n] < position[first] for n in operands) and not _changed_between(group[0], group[-1], operands):
            result.append(group)
        else:
            result.extend([site] for site in group)
    return result


def _changed_between(first: Site, last: Site, operands: list[fx.Node]) -> bool:
    """Whether, between the group's first and last loss, an operand is updated in place or grad mode switches: the
    one call runs at the first loss, so every loss must read what it would have read there."""
    roots = set().union(*(storage_roots(n) for n in operands))
    node = first.cross_entropy.next
    while node is not last.cross_entropy:
        mutated = mutated_tensor(node)
        if matches(node, GRAD_MODE) or (mutated is not None and storage_roots(mutated) & roots):
            return True
        node = node.next
    return False


def _with_facts(record: Record) -> Record:
    if record.site is None:
        return record
    try:
        return dataclasses.replace(record, facts=facts_of(record.site, record.form == CROSS_ENTROPY_FORM))
    except Exception as exc:  # noqa: BLE001
        return dataclasses.replace(record, refused=why_not(exc))


def facts_of(site: Site, is_cross_entropy: bool) -> SiteFacts:
    """The site's facts (``sites.SiteFacts``); the loss's rows, vocabulary and upstream gradient for a cross_entropy
    (the one form with a balanced path), whose input is the (M, V) logits."""
    hidden = example_value(site.hidden)
    stored = [site.hidden, site.weight] + ([site.bias] if site.bias is not None else [])
    rows = vocab = None
    upstream = UpstreamGradient()
    if is_cross_entropy:
        logits = example_value(site.chain[-1])
        rows, vocab = logits.shape[0], logits.shape[-1]
        upstream = upstream_gradient(site.cross_entropy, site.insert_before or site.cross_entropy)
    return SiteFacts(
        rows=rows,
        hidden_size=hidden.shape[-1],
        vocab=vocab,
        stored_dtypes=tuple(example_value(node).dtype for node in stored),
        device=hidden.device,
        needs_grad=requires_grad(site.cross_entropy),
        operand_grads=(
            requires_grad(site.hidden),
            requires_grad(site.weight),
            site.bias is not None and requires_grad(site.bias),
        ),
        head_kind="matmul" if matches(site.head, MATMUL) else "linear",
        lazy=_lazy_recipes(site),
        drop=_drop_recipes(site),
        upstream=upstream,
        argmax_rows=tuple(tuple(lazy_recipe(site, call_arg(user, 0, "input"))[0]) for user in site.argmax_users),
    )


def _lazy_recipes(site: Site) -> tuple | str:
    try:
        return tuple(lazy_recipe(site, node) for node in site.escaping)
    except Exception as exc:  # noqa: BLE001
        return why_not(exc)


def _drop_recipes(site: Site) -> tuple | str:
    try:
        sources = _dropped_logits.shape_sources(site)
        recipes = [_dropped_logits.shape_recipe(node, sources) for node in site.escaping]
    except Exception as exc:  # noqa: BLE001
        return why_not(exc)
    refused = next((recipe for recipe in recipes if isinstance(recipe, str)), None)
    if refused is not None:
        return f"the returned logits cannot be replaced by a placeholder: {refused}"
    return tuple(recipes)


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
