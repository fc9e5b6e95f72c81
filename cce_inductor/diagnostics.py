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
    return {
        "graphs": graphs,
        "rewritten": sum(site.rewritten for site in sites),
        "skipped": sum(not site.rewritten for site in sites),
        "reasons": dict(reasons),
        "sites": [dataclasses.asdict(site) for site in sites],
    }


def reset_stats() -> None:
    global _graphs
    with _lock:
        _sites.clear()
        _graphs = 0
