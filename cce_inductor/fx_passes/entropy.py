"""Rewrite the entropy of the head's softmax (RL entropy bonus or logging), alone or with per-token log-probs of
the same logits, into the fused op.

Policy-gradient trainers (verl, TRL, OpenRLHF) log or regularise the entropy of the policy beside the log-probs of
the sampled tokens. Each form below materialises the N x V logits (and a softmax of them) once more. The matched
graph::

    hidden (..., D)     weight (V, D)     [bias (V,)]
           \\                 |              /
            linear | matmul  -> logits (..., V)  -> row views / upcasts / scale (1 / temperature) / softcap
                                     |
    entropy = logsumexp(logits, -1) - sum(softmax(logits, -1) * logits, -1)                 (verl; TRL < 0.20)
            | -sum(softmax(logits, -1) * log_softmax(logits, -1), -1)
            | -sum(exp(log_softmax(logits, -1)) * log_softmax(logits, -1), -1)             (TRL)
      (sum as torch.sum(x, dim=-1 | axis=-1) or x.sum(-1); the minus before or after the sum; either factor order)
            | cat([<one of the above>(chunk) for chunk in logits.split(n, dim=0)], dim=0)   (TRL's row chunks)

    [ gather(log_softmax(x, -1), -1, ids.unsqueeze(-1)) [.squeeze(-1)]: token log-probs (``token_log_probs.py``),
      x = the entropy's logits or a node of their chain from which only row views and upcasts lead to them (TRL
      scores ``logits`` (B, T, V) and takes the entropy of ``logits.reshape(-1, V)``) ]

is replaced by one call (``H = lse - sum_v p_v z_v``: the sum comes out of the same forward pass as the lse)::

    rows  = <the row views replayed on hidden>                                           (..., D)
    ids   = <ids, squeezed> | zeros(rows.shape[:-1])        (entropy alone: no token is scored)
    fused = cce_inductor::linear_cross_entropy(rows.flatten(0, -2), weight, ids.flatten(), bias, cap, NO_TARGET,
                                               "none", 0.0, options.encode(), False, True)
    entropy   = fused[2].view(rows.shape[:-1]).to(<entropy's dtype>)
    log_probs = (-fused[0]).view_as(ids).to(<log-probs' dtype>)                   (with token log-probs)

The softmax, log-softmax and products of the matched forms must be private to them; an entropy next to a
cross-entropy of the same logits, or a second entropy of them, is left alone with the reason in ``stats()``.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import head_chain, sites
from . import scored_rows as sr
from . import spellings as sp

SOFTMAX = sp.functions(F.softmax, torch.softmax) | sp.methods("softmax")
EXP = sp.functions(torch.exp) | sp.methods("exp")
NEG = sp.functions(operator.neg, torch.neg) | sp.methods("neg")
SUM = sp.functions(torch.sum) | sp.methods("sum")
SPLIT_ROWS = sp.functions(torch.split, torch.chunk) | sp.methods("split", "chunk")
CAT = sp.functions(torch.cat, torch.concat, torch.concatenate)
FORM = "entropy"


@dataclasses.dataclass
class EntropyTerm:
    root: fx.Node  # its value is the per-row entropy
    logits: fx.Node  # what its softmax reads
    nodes: list[fx.Node]  # the term's own nodes, root included


def _row_sum_input(node: fx.Node) -> fx.Node | None:
    """``x`` of ``sum(x, -1)`` (``dim=`` or ``axis=``, or ``[-1]``; no keepdim, no dtype), else None."""
    if not sp.matches(node, SUM):
        return None
    x = sp.call_arg(node, 0, "input")
    return x if sp.reduces_last_dim(node, x) else None


def _factor(node) -> tuple[str, fx.Node | None, list[fx.Node]]:
    """What one factor of the product is: ``("p", logits, nodes)`` for softmax(logits) or exp(log_softmax(logits)),
    ``("logp", logits, nodes)`` for log_softmax(logits), ``("z", node, [])`` for anything else."""
    if sp.matches(node, SOFTMAX) and sr.is_row_softmax(node):
        return "p", sp.call_arg(node, 0, "input"), [node]
    if sp.matches(node, sp.LOG_SOFTMAX) and sr.is_row_softmax(node):
        return "logp", sp.call_arg(node, 0, "input"), [node]
    if sp.matches(node, EXP) and len(node.args) == 1 and not node.kwargs:
        inner = node.args[0]
        if sp.matches(inner, sp.LOG_SOFTMAX) and sr.is_row_softmax(inner):
            return "p", sp.call_arg(inner, 0, "input"), [node, inner]
    return "z", node, []


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _negated(node: fx.Node | None) -> fx.Node | None:
    """``node``'s negation node (its only user), if it has one."""
    user = None if node is None else _only_user(node)
    return user if user is not None and sp.matches(user, NEG) and user.args[0] is node else None


def entropy_term(row_sum: fx.Node) -> EntropyTerm | None:
    """The entropy term built around ``row_sum`` (a ``sum(..., -1)``), or None if it is not one of the forms."""
    product = _row_sum_input(row_sum)
    negated_product = sp.matches(product, NEG)
    if negated_product:
        product = product.args[0]
    if not sp.matches(product, sp.MUL) or len(product.args) != 2 or product.kwargs:
        return None
    (kind_a, logits_a, nodes_a), (kind_b, logits_b, nodes_b) = map(_factor, product.args)
    inner = nodes_a + nodes_b + [product] + ([row_sum.args[0]] if negated_product else []) + [row_sum]
    kinds = {kind_a, kind_b}
    if kinds == {"p", "logp"} and logits_a is logits_b:
        # sum(p * log p) = -H
        if negated_product:
            return EntropyTerm(row_sum, logits_a, inner)
        negation = _negated(row_sum)
        return None if negation is None else EntropyTerm(negation, logits_a, inner + [negation])
    if kinds == {"p", "z"} and not negated_product:
        # sum(p * z) = lse - H, so H = logsumexp(z) - sum(p * z)
        logits = logits_a if kind_a == "p" else logits_b
        if (logits_b if kind_a == "p" else logits_a) is not logits:
            return None
        difference = _only_user(row_sum)
        if difference is None or not sp.matches(difference, sp.SUB) or len(difference.args) != 2:
            return None
        lse, subtracted = difference.args
        if subtracted is not row_sum or not isinstance(lse, fx.Node) or not sp.is_row_logsumexp(lse, logits):
            return None
        return EntropyTerm(difference, logits, inner + [lse, difference])
    return None


def split_entropy_term(cat: fx.Node, terms: dict[fx.Node, EntropyTerm]) -> EntropyTerm | None:
    """``cat([H(chunk_0), H(chunk_1), ...], dim=0)`` over every chunk, in order, of ``logits.split(n, dim=0)`` (or
    ``chunk``): the entropy of ``logits``, one term. ``terms``: the single terms by root."""
    parts = sp.call_arg(cat, 0, "tensors")
    dim = sp.call_arg(cat, 1, "dim", 0)
    if not sp.matches(cat, CAT) or not isinstance(parts, (list, tuple)) or dim not in (0, -1):
        return None
    if not parts or not all(isinstance(part, fx.Node) and part in terms for part in parts):
        return None
    chunks = [terms[part].logits for part in parts]
    split = chunks[0].args[0] if sp.matches(chunks[0], sp.GETITEM) else None
    if not sp.matches(split, SPLIT_ROWS) or sp.call_arg(split, 2, "dim", 0) not in (0, -2):
        return None
    pieces = sp.example_value(split)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != len(chunks):
        return None
    if any(not sp.matches(chunk, sp.GETITEM) or chunk.args != (split, k) for k, chunk in enumerate(chunks)):
        return None
    logits = split.args[0]
    meta = sp.example_value(logits)
    if not isinstance(meta, torch.Tensor) or meta.dim() != 2:
        return None
    nodes = [split] + chunks + [node for part in parts for node in terms[part].nodes] + [cat]
    return EntropyTerm(cat, logits, nodes)


_ROW_ORDER_KEEPING = sp.RESHAPE | sp.FLATTEN | sp.IDENTITY_VIEW


def _token_gathers(chain: list[fx.Node]) -> list[fx.Node]:
    """``gather(log_softmax(x, -1), ...)`` nodes reading the last node of ``chain`` or one of its nodes from which
    only row views that keep the rows' order and upcasts lead to it (the same rows, in the same order)."""
    gathers = []
    for i in range(len(chain) - 1, -1, -1):
        gathers += [
            gather
            for log_probs in chain[i].users
            if sp.matches(log_probs, sp.LOG_SOFTMAX)
            for gather in log_probs.users
            if sp.matches(gather, sr.GATHER)
        ]
        if i and not (sp.matches(chain[i], _ROW_ORDER_KEEPING) or head_chain.upcast_target(chain[i]) is not None):
            break
    return gathers


def _match(term: EntropyTerm, terms_on_logits: int) -> sites.Record:
    if terms_on_logits > 1:
        raise head_chain.NoMatch("two entropies of the same logits")
    gathers = _token_gathers(head_chain.walk_logits(term.logits, term.root).chain)
    if len(gathers) > 1:
        raise head_chain.NoMatch("log-probs of several id tensors gathered from the same logits")
    inner, log_probs_node, index, squeezed = list(term.nodes), None, None, False
    if gathers:
        log_softmax, _, index, squeeze = sr.gathered_log_probs(gathers[0])
        log_probs_node = squeeze if squeeze is not None else gathers[0]
        squeezed = squeeze is not None
        inner += [node for node in (log_softmax, gathers[0], squeeze) if node is not None and node not in inner]
    replaced = [term.root] + ([log_probs_node] if log_probs_node is not None else [])
    site = sr.scored_rows_site(term.logits, inner, replaced, index)
    label = f"entropy and token log-probs of {index.name}" if index is not None else "entropy"
    dtensor = sr.dtensor_refusal(site, "entropy")
    return sites.Record(
        FORM, term.root, site, dtensor=dtensor, label=label, log_probs=log_probs_node, squeezed=squeezed
    )


def _cast(graph: fx.Graph, value: fx.Node, like: fx.Node) -> fx.Node:
    dtype = sp.example_value(like).dtype
    return value if dtype == torch.float32 else graph.call_method("to", (value, dtype))


def emit_entropy(graph: fx.Graph, record: sites.Record, decision: sites.Decision, rows, weight, bias) -> list[fx.Node]:
    """The entropy, and the token log-probs with it, from one call of the op (module docstring)."""
    site = record.site
    leading = graph.call_function(operator.getitem, (graph.call_method("size", (rows,)), slice(None, -1)))
    if site.targets is None:  # entropy alone: no token is scored (row 0's loss is computed and unused)
        ids = graph.call_method("new_zeros", (rows, leading), {"dtype": torch.int64})
    else:
        ids = graph.call_method("squeeze", (site.targets, -1)) if record.squeezed else site.targets
    fused = sr.fused_token_call(graph, site, decision, rows, weight, ids, bias, entropy=True)
    values = {record.node: graph.call_method("view", (graph.call_function(operator.getitem, (fused, 2)), leading))}
    if record.log_probs is not None:
        values[record.log_probs] = sr.log_probs_of(graph, fused, ids)
    for node, value in values.items():
        if node is not site.cross_entropy:
            node.replace_all_uses_with(_cast(graph, value, node))
    return [values[site.cross_entropy]]


def find_entropy(graph: fx.Graph) -> list[sites.Record]:
    """Stage 1: a record of every entropy of head logits in ``graph`` (with the token log-probs of the
    same logits), matched or refused."""
    singles = {term.root: term for node in graph.nodes if (term := entropy_term(node)) is not None}
    split_terms = [term for node in graph.nodes if (term := split_entropy_term(node, singles)) is not None]
    members = {node for term in split_terms for node in term.nodes}
    terms = split_terms + [term for root, term in singles.items() if root not in members]
    per_logits: dict[fx.Node, int] = {}
    for term in terms:
        per_logits[term.logits] = per_logits.get(term.logits, 0) + 1
    return [_record(term, per_logits[term.logits]) for term in terms]


def _record(term: EntropyTerm, terms_on_logits: int) -> sites.Record:
    try:
        return _match(term, terms_on_logits)
    except Exception as exc:  # noqa: BLE001
        return sites.Record(FORM, term.root, refused=sites.why_not(exc))
