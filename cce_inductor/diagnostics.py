"""What the pass did: per-site decisions, counted across compilations, and logged on ``cce_inductor``; and how
often the fused ops ran in this process (so a graph served from Inductor's cache, which skips the pass, can still
be seen to use them).

    >>> cce_inductor.stats()
    {'pass': 'on for every torch.compile (enable() or CCE_INDUCTOR)', 'graphs': 1, 'rewritten': 0, 'skipped': 1,
     'reasons': {'logits escape the compiled region (...); set CCE_INDUCTOR_DROP_LOGITS=1 ...': 1}, 'sites': [...],
     'executions': {'linear_cross_entropy': 0, 'vocab_parallel': 0},
     'backward_products': {'cublas': 0, 'row_skipping': 0, 'counted_prefix': 0},
     'balanced_rows': {'every_row': 0, 'counted_prefix': 0, 'cannot_skip': 0, 'lean_after_oom': 0},
     'summary': '...'}
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

log = logging.getLogger("cce_inductor")

_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class SiteDecision:
    """One cross-entropy call the pass looked at."""

    graph: int
    node: str
    rewritten: bool
    reason: str  # what was matched when rewritten, why not otherwise
    path: str = ""  # rewritten sites: "lean" or "balanced" (CCEOptions.scratch_mb); why, in reason


_sites: list[SiteDecision] = []
_graphs = 0
# Forward calls of the fused ops (eager, compiled, or a cached compiled graph). A CUDA graph replays kernels
# without calling the op, so under mode="reduce-overhead" only its recording is counted.
_executions = collections.Counter({"linear_cross_entropy": 0, "vocab_parallel": 0})


# The lean backward's dE / dC products per CUDA backward call (``CCEOptions.products``; "auto" decides per call:
# cce_inductor/_counted_share.py): cuBLAS over every row, the row-skipping Triton products, or cuBLAS over the
# counted prefix of the compacted rows with the row-skipping products past it.
_products = collections.Counter({"cublas": 0, "row_skipping": 0, "counted_prefix": 0})


# The balanced path's row chunks per CUDA call (cce_inductor/_counted_share.py, balanced_prefix): cuBLAS over every
# row as "auto" chose (or "cublas" asked), the counted prefix of the compacted rows with the row-skipping products
# past it, or every row where the earlier calls' share would have skipped rows but the kernels cannot for these
# operands (a bias gradient, autocast's conversion, fp32 gradients, rows the tensor-memory accelerator cannot read);
# and the balanced calls that ran the lean path because the balanced path's buffers could not be allocated.
_balanced_rows = collections.Counter({"every_row": 0, "counted_prefix": 0, "cannot_skip": 0, "lean_after_oom": 0})


def count_balanced_rows(kind: str) -> None:
    with _lock:
        _balanced_rows[kind] += 1


def count_products(products: str) -> None:
    with _lock:
        _products["row_skipping" if products == "triton" else products] += 1


def count_execution(op: str) -> None:
    with _lock:
        _executions[op] += 1


def new_graph() -> int:
    global _graphs
    with _lock:
        _graphs += 1
        return _graphs


def record(decision: SiteDecision) -> None:
    with _lock:
        _sites.append(decision)
    if decision.rewritten:
        log.info("cce_inductor: graph %d: rewrote %s (%s)", decision.graph, decision.node, decision.reason)
    else:
        log.info("cce_inductor: graph %d: left %s alone: %s", decision.graph, decision.node, decision.reason)


def stats(switch: tuple[str, str]) -> dict[str, Any]:
    """Counts over every graph the pass has seen in this process (see :func:`reset_stats`); ``switch``: whether
    plain ``torch.compile`` runs the pass, and why (``cce_inductor.graph_pass.describe``, which ``cce_inductor.stats``
    hands in: the pass sits above this module)."""
    with _lock:
        sites = list(_sites)
        graphs = _graphs
        executions = dict(_executions)
        products = dict(_products)
        balanced_rows = dict(_balanced_rows)
    reasons = collections.Counter(site.reason for site in sites if not site.rewritten)
    rewritten = sum(site.rewritten for site in sites)
    switch, switch_line = switch
    return {
        "pass": switch_line,
        "graphs": graphs,
        "rewritten": rewritten,
        "skipped": len(sites) - rewritten,
        "reasons": dict(reasons),
        "sites": [dataclasses.asdict(site) for site in sites],
        "executions": executions,
        "backward_products": products,
        "balanced_rows": balanced_rows,
        "summary": _summary(
            switch,
            switch_line,
            graphs,
            rewritten,
            reasons,
            sum(executions.values()),
            sum(site.path == "balanced" for site in sites),
            balanced_rows["cannot_skip"],
            balanced_rows["lean_after_oom"],
        ),
    }


def _summary(
    switch: str,
    switch_line: str,
    graphs: int,
    rewritten: int,
    reasons: collections.Counter,
    executions: int,
    balanced: int,
    cannot_skip: int = 0,
    lean_after_oom: int = 0,
) -> str:
    ran = f"the fused op ran {executions} times in this process"
    if lean_after_oom:
        ran += (
            f" ({lean_after_oom} balanced calls ran the lean path: the balanced path's buffers could not be "
            "allocated; stats()['balanced_rows']['lean_after_oom'])"
        )
    if cannot_skip:
        ran += (
            f" ({cannot_skip} balanced calls multiplied ignored rows they could not skip: a bias gradient, autocast's "
            "conversion or fp32 gradients; stats()['balanced_rows'])"
        )
    if switch == "refused":  # CCE_INDUCTOR asked for the pass and could not get it: that comes first
        return f"the pass is {switch_line}; {_sites_line(graphs, rewritten, reasons, balanced)}; {ran}"
    if graphs == 0:
        where = "" if switch == "on" else f": it is {switch_line}"
        return (
            f"the pass has not seen any graph{where} (nothing was compiled with it yet, or every graph came from "
            f"Inductor's cache); {ran}"
        )
    return f"{_sites_line(graphs, rewritten, reasons, balanced)}; {ran}"


def _sites_line(graphs: int, rewritten: int, reasons: collections.Counter, balanced: int) -> str:
    if graphs == 0:
        return "it has seen no graph"
    # a site: a cross_entropy, a token log-probs gather or an entropy of head logits
    line = f"rewrote {rewritten} of {rewritten + sum(reasons.values())} loss sites in {graphs} graphs"
    if balanced:
        line += f" ({balanced} on the balanced path)"
    if reasons:
        reason, count = reasons.most_common(1)[0]
        line += f"; left {sum(reasons.values())} alone, most often ({count}x) because {reason}"
    elif rewritten == 0:
        line += "; no cross_entropy, token log-probs or entropy of head logits was found in the compiled graphs"
    return line


def reset_stats() -> None:
    global _graphs
    with _lock:
        _sites.clear()
        _graphs = 0
        for op in _executions:
            _executions[op] = 0
        for kind in _products:
            _products[kind] = 0
        for kind in _balanced_rows:
            _balanced_rows[kind] = 0
