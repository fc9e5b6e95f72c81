"""What the kernels are asked to do, decided before they launch: the one table of layout constants that the launch
helpers and the memory model (``cce_inductor.paths``) share, and the lean backward's plan.

The kernels (``cce_inductor.kernels``) take every decision as an explicit argument; nothing here imports Triton, so
the memory model can read the same numbers the launches use.

Lean backward (``kernels/_backward.py``): the (rows x vocabulary) plane is cut into G blocks of ``row_chunk`` rows
and ``block_width`` columns, the vocabulary the outer loop. The block is ``block_cols`` columns wide; where all N
rows are one row chunk shorter than ``block_rows``, as many times wider as keeps its bytes (fewer vocabulary steps,
fewer launches); and up to ``max_widen`` times wider again where the row-skipping products would otherwise wait on
the host (:func:`row_skipping_widen`), or where a caller asks (``block_widen``: a longer K for each product, at
the cost of a wider G block).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

# The lean backward's G block: "gpu" for CUDA devices, "interpret" for Triton's interpreter (the CPU tests; small
# blocks keep them fast; block_rows 0: never widened for a short batch).
LEAN_LAYOUT = {
    "gpu": {"block_cols": 4096, "block_rows": 8192, "max_widen": 4},
    "interpret": {"block_cols": 48, "block_rows": 0, "max_widen": 4},
}

# Rows of the balanced path's logits scratch, and every product over a vocabulary dimension, are padded / split at a
# multiple of this many elements: cuBLAS runs a 16-bit product several times slower when one of its dimensions is
# not a multiple of 8 elements, whatever the leading dimensions.
VOCAB_ALIGN = 64
# The balanced path sums a 16-bit dC over its row chunks in the gradient's own dtype (each chunk's product added
# by the product's epilogue, one rounding a chunk, no remainder bytes) over at most this many chunks; past it, the
# sum keeps a 16-bit remainder beside it (the pair, kernels/_pair_sums.py). The bound is the error budget: on flat
# logits (a model at initialisation), where torch.compile's own dC error is the bf16 rounding of one product, each
# further rounding of the running sum adds to it; at this many chunks the error stays within the budget's 1.35x
# torch.compile's, at one more it does not (tests/kernels/test_balanced.py holds both).
PLAIN_SUM_MAX_CHUNKS = 2

# Rows whose target rows of C the lean backward gathers and converts at a time where C is stored wider than the
# products' dtype (autocast's fp32 head): a block of ``TARGET_ROW_BLOCK x D`` in each dtype, not all N rows at once.
TARGET_ROW_BLOCK = 1024


def lean_layout(interpret: bool | None = None) -> dict:
    """The lean G block's layout constants where the kernels run (the interpreter's under ``TRITON_INTERPRET=1``)."""
    if interpret is None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return LEAN_LAYOUT["interpret" if interpret else "gpu"]


def block_width(rows: int, row_chunk: int, vocab: int, widen: int = 1, layout: dict | None = None) -> int:
    """Columns of one lean G block: ``block_cols``; times ``block_rows // rows`` where all ``rows`` are one row chunk
    (``row_chunk`` 0 or >= rows) shorter than ``block_rows`` (a block of the same bytes); times ``widen``; at most V."""
    layout = layout or lean_layout()
    one_chunk = not row_chunk or rows <= row_chunk
    small = max(1, layout["block_rows"] // max(rows, 1)) if layout["block_rows"] and one_chunk else 1
    return min(vocab, layout["block_cols"] * small * widen)


def row_skipping_widen(counted_hint: float, max_widen: int = 4) -> int:
    """How many times wider the row-skipping products' G block is where the earlier calls of the head counted as
    little as ``counted_hint`` of their rows: ``ceil(0.5 / hint)``, 1 to ``max_widen``, so that a block holds at least
    half a narrow block's counted entries (each vocabulary chunk costs the host a few launches whatever its counted
    rows, so the calls that count fewest rows would wait on the host)."""
    return max(1, min(max_widen, math.ceil(0.5 / max(counted_hint, 1e-6))))


def g_block_widen(*, triton_products: bool, counted_hint: float | None, one_row_chunk: bool, block_widen: int) -> int:
    """How many times wider than :func:`block_width`'s base a backward's G block is: the caller's ``block_widen``,
    and for the row-skipping products at least their :func:`row_skipping_widen`
    after an earlier call's ``counted_hint`` (one row chunk only: several keep the narrow block, or their dC sums
    would grow)."""
    if triton_products:
        skipping = row_skipping_widen(counted_hint) if counted_hint is not None and one_row_chunk else 1
        return max(skipping, block_widen)
    return block_widen


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
    block_widen: int = 1,
    row_skipping: bool = True,
    layout: dict | None = None,
) -> BackwardPlan:
    """The lean backward's plan for ``rows`` x ``vocab``. ``products``: ``"cublas"``, ``"triton"`` or
    ``"counted_prefix"`` (as decided per call by ``cce_inductor._counted_share``); ``row_skipping``: whether the
    row-skipping kernels can read these operands (``kernels.row_skipping_ok``; else cuBLAS runs). ``counted_hint``
    sizes the counted prefix, or (row-skipping products) widens a single row chunk's block. ``block_widen``: a
    wider block asked for (:func:`g_block_widen`)."""
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
        block_widen=block_widen,
    )
    width = block_width(rows, row_chunk, vocab, widen, layout)
    return BackwardPlan(row_chunk, width, kind, hint)


def balanced_chunks(
    rows: int, chunk_rows: int, counted_prefix: int | None, plain_sum: bool
) -> tuple[int, list[tuple[int, int]]]:
    """The balanced path's counted prefix and row chunks, ``(prefix, [(first row, rows), ...])`` (the prefix is
    ``rows`` where there is none): ``chunk_rows`` at a time; with a counted prefix
    (rows compacted, counted ones first: cuBLAS over the prefix, the row-skipping products past it) the chunks of the
    prefix, then those past it. With ``plain_sum`` (a 16-bit dC summed in its own dtype, one rounding a chunk) the
    chunks are at most ``PLAIN_SUM_MAX_CHUNKS`` whatever the prefix: ``chunk_rows >= rows / 2`` is the caller's,
    and the prefix is moved into ``[rows - chunk_rows, chunk_rows]``, so that the rows on either side of it are one
    chunk each (cuBLAS then multiplies up to that many ignored rows' poison, or the Triton products that many
    counted rows past it)."""
    step = max(1, min(chunk_rows, rows))
    if plain_sum and -(-rows // step) > PLAIN_SUM_MAX_CHUNKS:
        raise ValueError(f"a plain 16-bit sum takes at most {PLAIN_SUM_MAX_CHUNKS} chunks: {rows} rows of {step}")
    prefix = rows if counted_prefix is None else min(counted_prefix, rows)
    if plain_sum and prefix < rows:
        prefix = min(max(prefix, rows - step), step)
    starts = [*range(0, prefix, step), *range(prefix, rows, step)]
    return prefix, [(r0, min(step, (prefix if r0 < prefix else rows) - r0)) for r0 in starts]
