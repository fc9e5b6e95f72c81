"""What the pass did: per-site decisions, counted across compilations, and logged on ``cce_inductor``.

    >>> cce_inductor.stats()
    {'graphs': 1, 'rewritten': 0, 'skipped': 1,
     'reasons': {'logits escape the compiled region (...); set CCE_INDUCTOR_DROP_LOGITS=1 ...': 1}, 'sites': [...]}
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


_sites: list[SiteDecision] = []
_graphs = 0


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


def stats() -> dict[str, Any]:
    """Counts over every graph the pass has seen in this process (see :func:`reset_stats`)."""
    with _lock:
        sites = list(_sites)
        graphs = _graphs
    reasons = collections.Counter(site.reason for site in sites if not site.rewritten)
    rewritten = sum(site.rewritten for site in sites)
    return {
        "graphs": graphs,
        "rewritten": rewritten,
        "skipped": len(sites) - rewritten,
        "reasons": dict(reasons),
        "sites": [dataclasses.asdict(site) for site in sites],
        "summary": _summary(graphs, rewritten, reasons),
    }


def _summary(graphs: int, rewritten: int, reasons: collections.Counter) -> str:
    if graphs == 0:
        return (
            "the pass has not seen any graph: nothing was compiled with it yet, or every graph came from "
            "Inductor's cache (cached graphs that were rewritten still call the fused op)"
        )
    line = f"rewrote {rewritten} of {rewritten + sum(reasons.values())} cross_entropy sites in {graphs} graphs"
    if reasons:
        reason, count = reasons.most_common(1)[0]
        line += f"; left {sum(reasons.values())} alone, most often ({count}x) because {reason}"
    elif rewritten == 0:
        line += "; no cross_entropy call was found in the compiled graphs"
    return line


def reset_stats() -> None:
    global _graphs
    with _lock:
        _sites.clear()
        _graphs = 0
