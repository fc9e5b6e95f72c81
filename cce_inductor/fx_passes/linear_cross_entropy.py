"""Rewrite ``linear -> [softcap] -> cross_entropy`` in Dynamo graphs into ``cce_inductor::linear_cross_entropy``.

Runs on the graph Dynamo hands to Inductor (before AOTAutograd: torch IR with ``call_method`` views), so the
logits are never created, neither in the forward nor as a saved activation for the backward.

The matched graph, read from the loss back to the head (every part but the two ends is optional and may come
in any order)::

    hidden  (..., D)        weight (V, D)      [bias (V,)]
        \\                      |                /
         linear(hidden, weight, bias) | hidden @ weight.T | matmul(hidden, weight_t)
                  |
          logits (..., V)   ---- row views:   view/reshape/flatten over leading dims, contiguous,
                  |                           getitem slices of leading dims (label shift logits[..., :-1, :])
                  |         ---- upcasts:     .float(), .to(torch.float32)
                  |         ---- scale:       logits * k, logits / k  (constant k; before any softcap)
                  |         ---- softcap:     tanh(logits / cap) * cap  (or  * (1 / cap))
          logits2d (M, V)           targets (M,) int   (any computation: shifts, F.pad(labels, (0, 1), value=ignore))
                   \\                /
                 cross_entropy(logits2d, targets, ignore_index=i, reduction=r, label_smoothing=eps, [weight=w])

                 [logsumexp(logits2d, -1), after the cross_entropy: a z-loss, logging]
                 [argmax(<a chain node from which only row reshapes and upcasts lead to logits2d>, -1):
                  token accuracy, predictions; after the cross_entropy, or before it once every operand exists]

is replaced by::

    rows = <the same row views replayed on hidden * k, with D in place of V>       (M, D)
    fused = cce_inductor::linear_cross_entropy(rows, weight, targets, bias, cap, i, r, eps, options.encode(), full_lse,
                                              False[, class_weights=w][, argmax=dtype][, compute_dtype=dtype])
    loss = fused[0].to(<dtype cross_entropy returned>)
    lse = fused[1].to(<dtype logsumexp returned>)          (only with logsumexp users: full_lse, every row's lse)

(``cce_inductor::linear_cross_entropy_with_grads`` instead where the site takes the balanced path). With class
weights ``w`` (V,) (no label smoothing: eager's weighted smoothing is another formula) the op scales each row's loss;
with argmax users its fourth output, each row's argmax (``torch.argmax``'s ties, over the logits rounded to the dtype
they have in the graph), takes the argmax nodes' place, viewed to their shape. Under autocast (fp32 hidden states or
head, 16-bit logits) the operands go to the op as stored, with ``compute_dtype`` (``decide.op_compute_dtype``).

Every ``cross_entropy`` that is not rewritten gets a reason in :func:`cce_inductor.stats` and the
``cce_inductor`` log. The tables below are the whole vocabulary of the matcher. Sites on DTensors belong to
``tensor_parallel.py``, which reuses :func:`match_site` with its own loss call. The walk from the loss back to the
head is ``head_chain.py``'s, the decision ``decide.py``'s, the operands ``replace.py``'s; this module is the
``cross_entropy`` pattern itself (:func:`find_cross_entropy`) and its call (:func:`emit_fused_loss`).
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import _checks, balanced_op, ops
from .head_chain import NoMatch, private_chain, upcast_target, walk_logits
from .replace import rows_of
from .sites import CROSS_ENTROPY_FORM, Decision, Record, Site, why_not
from .spellings import (
    CROSS_ENTROPY,
    FLATTEN,
    GETITEM,
    IDENTITY_VIEW,
    RESHAPE,
    call_arg,
    const_float,
    example_value,
    functions,
    is_dtensor,
    is_row_logsumexp,
    matches,
    methods,
    short,
)
from .upstream import emit_grad_scale

FORM = CROSS_ENTROPY_FORM
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def match_site(ce: fx.Node) -> Site:
    """Match the chain feeding one cross_entropy call, or raise NoMatch with the reason."""
    bound = _CE_SIGNATURE.bind(*ce.args, **ce.kwargs)
    bound.apply_defaults()
    args = bound.arguments
    label_smoothing = const_float(args["label_smoothing"])
    if label_smoothing is None or not 0.0 <= label_smoothing <= 1.0:
        raise NoMatch(f"label_smoothing={args['label_smoothing']!r} is not a constant in [0, 1]")
    if args["size_average"] is not None or args["reduce"] is not None:
        raise NoMatch("cross_entropy uses the deprecated size_average/reduce arguments")
    if not isinstance(args["ignore_index"], int) or not isinstance(args["reduction"], str):
        raise NoMatch("ignore_index or reduction is not a constant")
    if args["reduction"] not in _checks.REDUCTIONS:
        raise NoMatch(f"unknown reduction {args['reduction']!r}")
    logits2d, targets = args["input"], args["target"]
    logits_meta, targets_meta = example_value(logits2d), example_value(targets)
    if not isinstance(logits_meta, torch.Tensor) or not isinstance(targets_meta, torch.Tensor):
        raise NoMatch("cross_entropy input or target is not a tensor")
    if targets_meta.dtype.is_floating_point:
        raise NoMatch("cross_entropy has probability (floating-point) targets")
    if targets_meta.dtype != torch.int64:
        raise NoMatch(f"targets are {targets_meta.dtype}, not int64 (eager cross_entropy rejects them)")
    if logits_meta.dim() != 2 or targets_meta.dim() != 1:
        raise NoMatch(
            f"cross_entropy input is {logits_meta.dim()}-D and target {targets_meta.dim()}-D; "
            "only (N, V) logits with (N,) class targets are matched"
        )
    class_weight = args["weight"]
    if class_weight is not None:
        _check_class_weight(class_weight, logits_meta, label_smoothing)
    logits = walk_logits(logits2d, ce)

    # A log-sum-exp of the loss's own logits (a z-loss) may read them too: the op computes it anyway.
    lse_users = [user for user in logits2d.users if is_row_logsumexp(user, logits2d)]
    position = {node: i for i, node in enumerate(ce.graph.nodes)}
    if any(position[user] < position[ce] for user in lse_users):
        raise NoMatch("logsumexp of the logits comes before the cross_entropy (only the other order is matched)")
    argmax_users, argmax_round = _argmax_users(logits.chain)
    argmax_branches = _branches(argmax_users, logits.chain)
    insert_before = None
    if argmax_users and min(position[user] for user in argmax_users) < position[ce]:
        first = min(argmax_users, key=position.get)
        operands = [
            n for n in (logits.hidden, logits.weight, logits.bias, targets, class_weight) if isinstance(n, fx.Node)
        ]
        late = [n.name for n in operands if position[n] > position[first]]
        if late:
            raise NoMatch(
                f"the argmax of the logits ({first.name}) comes before {', '.join(late)}, which the fused call needs"
            )
        insert_before = first
    return Site(
        cross_entropy=ce,
        targets=targets,
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        label_smoothing=label_smoothing,
        escaping=private_chain(logits.chain, ce, allowed=lse_users + argmax_users + argmax_branches),
        lse_users=lse_users,
        class_weight=class_weight,
        argmax_users=argmax_users,
        argmax_branches=argmax_branches,
        argmax_round=argmax_round,
        insert_before=insert_before,
        **logits.fields(),
    )


def _check_class_weight(weight: Any, logits_meta: torch.Tensor, label_smoothing: float) -> None:
    """``cross_entropy(..., weight=w)`` is rewritten where eager computes it as the op does; otherwise NoMatch (and
    eager's own error for bad weights, as the site is left to it)."""
    meta = example_value(weight)
    if not isinstance(meta, torch.Tensor):
        raise NoMatch("cross_entropy's class weights are not a tensor")
    if label_smoothing != 0.0:
        raise NoMatch(
            "cross_entropy has class weights and label_smoothing: eager's weighted label smoothing "
            "(the smoothing term weighted per class) is not implemented"
        )
    if meta.dim() != 1 or meta.shape[0] != logits_meta.shape[-1]:
        raise NoMatch(f"cross_entropy's class weights have shape {tuple(meta.shape)}, not (V,)")
    if meta.dtype != logits_meta.dtype:
        raise NoMatch(
            f"cross_entropy's class weights are {meta.dtype} but its input is {logits_meta.dtype} "
            "(eager raises: left to it)"
        )
    if meta.requires_grad:
        raise NoMatch("cross_entropy's class weights require grad (their gradient is not computed by the fused op)")


ARGMAX = functions(torch.argmax) | methods("argmax")


def _branches(argmax_users: list[fx.Node], chain: list[fx.Node]) -> list[fx.Node]:
    """The upcasts between the chain and its argmax nodes (``_upcast_branch_argmaxes``): read by those alone."""
    found: list[fx.Node] = []
    for user in argmax_users:
        node = call_arg(user, 0, "input")
        while node not in chain:
            found.append(node)
            node = node.args[0]
    return list(dict.fromkeys(found))


# Views and casts that keep the values and the rows' order: an argmax before them is the argmax of the loss's rows.
_ROW_ORDER_KEEPING = RESHAPE | FLATTEN | IDENTITY_VIEW


def _upcast_branch_argmaxes(node: fx.Node) -> list[fx.Node] | None:
    """The argmax nodes at the end of ``node``, an upcast / ``contiguous`` of a chain node (``logits.float()
    .argmax(-1)``) every user of which is an argmax or another such node; None if it has another user."""
    if not (matches(node, IDENTITY_VIEW) or upcast_target(node) is not None):
        return None
    found = []
    for user in node.users:
        if matches(user, ARGMAX):
            found.append(user)
            continue
        deeper = _upcast_branch_argmaxes(user)
        if deeper is None:
            return None
        found += deeper
    return found or None


def _argmax_users(chain: list[fx.Node]) -> tuple[list[fx.Node], str]:
    """``argmax(x, -1)`` nodes reading a node of the chain (directly, or through upcasts of it that nothing else
    reads), and the dtype the op rounds the logits to before its argmax (the values' dtype in the graph); NoMatch for
    an argmax the op cannot give (before the scale / softcap: other values; before a slice of the rows: other rows)."""

    def keeps_values(node: fx.Node) -> bool:
        return matches(node, _ROW_ORDER_KEEPING) or matches(node, GETITEM) or upcast_target(node) is not None

    last_value = max(i for i, node in enumerate(chain) if i == 0 or not keeps_values(node))
    users = []
    for i, node in enumerate(chain):
        next_node = chain[i + 1] if i + 1 < len(chain) else None
        readers = [user for user in node.users if matches(user, ARGMAX)]
        for user in node.users:
            if user is not next_node and user not in chain and not matches(user, ARGMAX):
                readers += _upcast_branch_argmaxes(user) or []
        for user in readers:
            meta = example_value(node)
            dim = call_arg(user, 1, "dim")
            keepdim = call_arg(user, 2, "keepdim", False)
            if not isinstance(dim, int) or dim not in (-1, meta.dim() - 1) or not isinstance(keepdim, bool):
                raise NoMatch(f"{short(user)} is not over the vocabulary dimension alone")
            if set(user.kwargs) - {"dim", "keepdim"}:
                raise NoMatch(f"{short(user)} has arguments the fused op does not take")
            if i < last_value:
                raise NoMatch(f"{short(user)} reads the logits before their scale / softcap (other values)")
            between = chain[i + 1 :]
            if any(not (matches(n, _ROW_ORDER_KEEPING) or upcast_target(n) is not None) for n in between):
                raise NoMatch(f"{short(user)} reads the logits before a slice of their rows (other rows than the loss)")
            users.append(user)
    rounding = str(example_value(chain[last_value]).dtype).removeprefix("torch.") if users else ""
    return users, rounding


def emit_fused_loss(graph: fx.Graph, record: Record, decision: Decision, rows, weight, bias) -> list[fx.Node]:
    """The fused call of one site (module docstring), on the path ``decision`` took; the loss in its place."""
    site, facts = record.site, record.facts
    common = dict(
        softcap=site.softcap,
        ignore_index=site.ignore_index,
        reduction=site.reduction,
        label_smoothing=site.label_smoothing,
        options=decision.options,
        compute_dtype=decision.compute_dtype,
    )
    if decision.path == "balanced" and site.class_weight is None and not site.argmax_users:
        fused = balanced_op.balanced_call(
            rows,
            weight,
            site.targets,
            bias,
            need_e=facts.operand_grads[0],
            need_c=facts.operand_grads[1],
            need_bias=facts.operand_grads[2],
            returned_logits=bool(site.escaping),
            plain_sum=decision.plain_sum,
            de_pair=decision.de_pair,
            grad_scale=emit_grad_scale(graph, decision.grad_scale, facts.device),
            **common,
        ).emit(graph)
        return [graph.call_function(operator.getitem, (fused, 0))]
    call = ops.lean_call(
        rows,
        weight,
        site.targets,
        bias,
        full_lse=bool(site.lse_users),
        class_weights=site.class_weight,
        argmax=site.argmax_round,
        **common,
    )
    return [_emit_lean(graph, record, call)]


def _feed_lse_users(graph: fx.Graph, site: Site, fused: fx.Node) -> None:
    """The log-sum-exps the graph computes of the loss's logits (a z-loss) read the fused op's (output 1) instead."""
    lse_dtype = torch.float64 if site.compute_dtype == torch.float64 else torch.float32
    for user in site.lse_users:
        lse = graph.call_function(operator.getitem, (fused, 1))
        if example_value(user).dtype != lse_dtype:
            lse = graph.call_method("to", (lse, example_value(user).dtype))
        user.replace_all_uses_with(lse)
        graph.erase_node(user)


def _emit_lean(graph: fx.Graph, record: Record, call: ops.OpCall) -> fx.Node:
    """The lean op (with class weights and / or the argmax where the site has them, module docstring): the lse and
    argmax users take its outputs; the loss is its output 0."""
    site = record.site
    fused = call.emit(graph)
    _feed_lse_users(graph, site, fused)
    if site.argmax_users:
        argmax = graph.call_function(operator.getitem, (fused, 3))
        for user, row_steps in zip(site.argmax_users, record.facts.argmax_rows, strict=True):
            # the rows as the argmax's input has them: the row views up to it, replayed on the hidden states
            rows_there = rows_of(graph, dataclasses.replace(site, scale=1.0, row_steps=list(row_steps)))
            leading = graph.call_function(operator.getitem, (graph.call_method("size", (rows_there,)), slice(None, -1)))
            value = graph.call_method("view", (argmax, leading))
            if call_arg(user, 2, "keepdim", False):
                value = graph.call_method("unsqueeze", (value, -1))
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        for node in reversed(_branches_in_order(graph, site)):
            if not node.users:
                graph.erase_node(node)
    return graph.call_function(operator.getitem, (fused, 0))


def _branches_in_order(graph: fx.Graph, site: Site) -> list[fx.Node]:
    position = {node: i for i, node in enumerate(graph.nodes)}
    return sorted(site.argmax_branches, key=position.get)


def cross_entropy_input(ce: fx.Node) -> Any:
    return call_arg(ce, 0, "input")


def find_cross_entropy(graph: fx.Graph) -> list[Record]:
    """Stage 1: a record of every ``cross_entropy`` on plain tensors in ``graph``, matched or refused.
    Sites whose logits are DTensors are ``tensor_parallel.py``'s."""
    losses = [
        n for n in graph.nodes if matches(n, CROSS_ENTROPY) and not is_dtensor(example_value(cross_entropy_input(n)))
    ]
    return [_record(ce) for ce in losses]


def _record(ce: fx.Node) -> Record:
    try:
        site = match_site(ce)
    except Exception as exc:  # noqa: BLE001
        return Record(FORM, ce, refused=why_not(exc))
    operands = (site.hidden, site.weight, site.bias, site.targets)
    name = next((n.name for n in operands if is_dtensor(example_value(n))), None)
    why = "" if name is None else f"{name} is a DTensor but the logits are not: an unsupported parallel layout"
    return Record(FORM, ce, site, dtensor=why)
