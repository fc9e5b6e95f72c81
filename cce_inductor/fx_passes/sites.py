"""The data the pass's stages hand on, one record per site: no graph is read or edited here.

::

    <form>.find_*(graph)        -> Record     the site matched (a :class:`Site`: a head chain and its loss), or why not
    site_facts.read(records)    -> Record     + :class:`SiteFacts`: what deciding and replacing need from the graph
    decide.decide(records, ...) -> Decision   rewrite (the path, the op's arguments) or leave alone (the reason)
    replace.replace(graph, record, decision)  the fused call in the site's place

A :class:`Site` is a :class:`~cce_inductor.fx_passes.head_chain.Logits` chain plus the loss that reads it (a
``cross_entropy``, or the last node of an RL form).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .head_chain import NoMatch, RowStep
from .upstream import UpstreamGradient

# The form whose sites may take the balanced path and share one call per head: stages 2 and 3 treat it apart.
CROSS_ENTROPY_FORM = "linear_cross_entropy"


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


@dataclasses.dataclass(frozen=True)
class SiteFacts:
    """What deciding and replacing need from the graph about one matched site, read once (``site_facts.read``), so
    that neither stage walks the graph again."""

    rows: Any  # the loss's rows (an int, or the SymInt of a dynamic batch)
    hidden_size: Any
    vocab: Any
    stored_dtypes: tuple[torch.dtype, ...]  # hidden, weight[, bias] as the graph stores them
    device: torch.device
    needs_grad: bool  # the loss requires grad
    operand_grads: tuple[bool, bool, bool]  # hidden, weight, bias require grad
    head_kind: str  # "matmul" | "linear", as stats() names the head
    # per returned node (``Site.escaping``), its recipe as lazy logits / as a placeholder, or why there is none
    lazy: tuple | str = ()
    drop: tuple | str = ()
    upstream: UpstreamGradient = UpstreamGradient()  # a cross_entropy's: its gradient's scale in the graph
    argmax_rows: tuple[tuple[RowStep, ...], ...] = ()  # per argmax user, the row views up to what it reads
    head_call: int = -1  # a cross_entropy's: the one call it shares with the other chunks of its head


@dataclasses.dataclass(frozen=True, eq=False)
class Record:
    """One site a form's ``find_*`` looked at, as plain data: ``decide`` reads it, ``replace`` and the form's emitter
    edit the graph with it. Matched (``site``, and after ``site_facts.read`` its ``facts``) or refused (``refused``)."""

    form: str  # the module that found it, which keys its emitter: "linear_cross_entropy", "entropy", ...
    node: fx.Node  # the node stats() names
    site: Site | None = None
    refused: str = ""
    dtensor: str = ""  # why operands on DTensors keep a matched site as it is (told after its returned logits' checks)
    label: str = ""  # what stats() calls a rewritten site before its description (forms other than cross_entropy)
    log_probs: fx.Node | None = None  # entropy: the token log-probs of the same logits, replaced by the same call
    squeezed: bool = False  # token log-probs, entropy: the ids are (..., 1), squeezed for the op
    facts: SiteFacts | None = None


class Escaping(NamedTuple):
    """What a site's returned logits become (``decide.check_escaping``): ``kind`` "lazy" (computed on first use),
    "drop" (a placeholder that raises on use) or "" (the graph returns none), and per returned node (``Site.escaping``)
    its recipe: the lazy logits' ``(row steps, elementwise steps)`` (``site_facts.lazy_recipe``) or the placeholder's
    shape (``_dropped_logits.shape_recipe``), read with the site's facts, so that replacing matches nothing."""

    kind: str = ""
    recipes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``decide`` makes of one record: plain data, read by ``replace``, recorded in stats()."""

    rewrite: bool
    reason: str  # what was matched and why this path (a rewrite), or why the site is left alone
    path: str = ""  # a rewrite's path: "lean" or "balanced"
    replacement: str = ""  # the form whose registered emitter makes the call
    sites: tuple[Site, ...] = ()  # what the call replaces: the site, or on a head's first chunk every chunk (else none)
    escaping: Escaping = Escaping()  # what the returned logits become (a head's chunks return none)
    compute_dtype: torch.dtype | None = None  # the op's compute_dtype: the operands reach it as stored
    plain_sum: bool = False  # the balanced path sums dC in its own 16-bit dtype
    options: str = ""  # CCEOptions.encode(): the op's options argument
    grad_scale: tuple = ()  # the balanced op's upstream gradient, as ``upstream.UpstreamGradient.steps`` (else none)
    de_pair: bool = False  # where dC is the balanced path's pair, a 16-bit dE is one too (``paths.BalancedPlan``)


def why_not(exc: Exception) -> str:
    """A record's ``refused`` where a match or check raised ``exc``: a NoMatch's message, or for any other error
    "not understood" (a graph shape the matcher does not know must never break compilation)."""
    return str(exc) if isinstance(exc, NoMatch) else f"not understood ({type(exc).__name__}: {exc})"
