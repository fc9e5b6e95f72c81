"""The layout constants the kernels launch with, and the memory model (``cce_inductor.paths``) counts with.

Nothing here imports Triton or anything above this folder: the package reads these numbers from here, so a plan
made on a machine without Triton is the plan the launches follow.

Lean backward (``_backward.py``): the (rows x vocabulary) plane is cut into G blocks of ``row_chunk`` rows and
``block_width`` columns, the vocabulary the outer loop. A block is ``block_cols`` columns wide; where all N rows are
one row chunk shorter than ``block_rows``, as many times wider as keeps its bytes (fewer vocabulary steps, fewer
launches); and up to ``max_widen`` times wider again where the caller asks (``widen``).

Balanced path (``_balanced.py``): row chunks of ``chunk_rows`` through one logits scratch whose rows are padded to a
multiple of ``VOCAB_ALIGN``; a 16-bit dC summed in its own dtype takes at most ``PLAIN_SUM_MAX_CHUNKS`` chunks
(:func:`balanced_chunks` lays them out).
"""

from __future__ import annotations

import os

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
# sum keeps a 16-bit remainder beside it (the pair, _pair_sums.py). The bound is the error budget: on flat logits
# (a model at initialisation), where torch.compile's own dC error is the bf16 rounding of one product, each further
# rounding of the running sum adds to it; at this many chunks the error stays within the budget's 1.35x
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
