"""The lean backward's plan, decided before its kernels launch: the row chunk, the G block's width and which
products multiply, handed to ``kernels.backward`` as explicit arguments. The layout constants the plan and the
memory model (``cce_inductor.paths``) share live with the kernels, in ``kernels/_layout.py``.

The G block is ``_layout.block_width`` wide, and up to ``max_widen`` times wider again where the row-skipping
products would otherwise wait on the host (:func:`row_skipping_widen`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .kernels import _layout


def row_skipping_widen(counted_hint: float, max_widen: int = 4) -> int:
    """How many times wider the row-skipping products' G block is where the earlier calls of the head counted as
    little as ``counted_hint`` of their rows: ``ceil(0.5 / hint)``, 1 to ``max_widen``, so that a block holds at least
    half a narrow block's counted entries (each vocabulary chunk costs the host a few launches whatever its counted
    rows, so the calls that count fewest rows would wait on the host)."""
    return max(1, min(max_widen, math.ceil(0.5 / max(counted_hint, 1e-6))))


def g_block_widen(*, triton_products: bool, counted_hint: float | None, one_row_chunk: bool) -> int:
    """How many times wider than ``_layout.block_width``'s base a backward's G block is: for the row-skipping
    products their :func:`row_skipping_widen` after an earlier call's ``counted_hint`` (one row chunk only: several
    keep the narrow block, or their dC sums would grow); 1 for cuBLAS's products."""
    if triton_products and counted_hint is not None and one_row_chunk:
        return row_skipping_widen(counted_hint)
    return 1


class BackwardPlan(NamedTuple):
    """The lean backward's decisions, handed to ``kernels.backward`` as its keyword arguments."""

    row_chunk: int  # rows per G block (all rows: N)
    block_width: int  # columns per G block
    products: str  # "cublas" (every row), "triton" (row-skipping kernels), "prefix" (cuBLAS over a counted prefix)
    counted_hint: float | None  # an earlier call's share of counted rows (sizes the prefix), or None


def backward_plan(
    rows: int,
    vocab: int,
    *,
    products: str,
    backward_row_chunk: int,
    counted_hint: float | None = None,
    row_skipping: bool = True,
    layout: dict | None = None,
) -> BackwardPlan:
    """The lean backward's plan for ``rows`` x ``vocab``. ``products``: ``"cublas"``, ``"triton"`` or
    ``"counted_prefix"`` (as decided per call by ``cce_inductor._counted_share``); ``row_skipping``: whether the
    row-skipping kernels can read these operands (``kernels.row_skipping_ok``; else cuBLAS runs). ``counted_hint``
    sizes the counted prefix, or (row-skipping products) widens a single row chunk's block (:func:`g_block_widen`)."""
    row_chunk = min(rows, backward_row_chunk or rows) if rows else 0
    if not row_skipping:
        kind = "cublas"
    else:
        kind = {"counted_prefix": "prefix"}.get(products, products)
    hint = counted_hint if kind in ("triton", "prefix") else None
    if kind == "prefix" and hint is None:
        kind = "cublas"
    widen = g_block_widen(
        triton_products=kind == "triton",
        counted_hint=hint,
        one_row_chunk=rows <= row_chunk,
    )
    width = _layout.block_width(rows, row_chunk, vocab, widen, layout)
    return BackwardPlan(row_chunk, width, kind, hint)
