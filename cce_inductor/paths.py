"""Which path a rewritten site takes: lean (the default) or balanced (``CCEOptions.scratch_mb``)."""

from __future__ import annotations

from typing import Optional


def lean_path_reason(options, reduction: str, needs_grad: bool) -> Optional[str]:
    """None where a loss takes the balanced path (``options.scratch_mb > 0``, reduction "mean" or "sum", a gradient
    needed), else why it takes the lean path (``stats()`` shows it)."""
    if options.scratch_mb == 0:
        return "scratch_mb=0"
    if reduction not in ("mean", "sum"):
        return f"reduction={reduction!r} (the balanced path computes 'mean' and 'sum')"
    if not needs_grad:
        return "no gradient is needed (no input of the head requires grad, or grad mode is off)"
    return None
