"""The lean backward's row chunks, on the host: what ``_backward_launch.backward`` prepares around its kernels.

Per row chunk of the (rows x vocabulary) plane (``_backward``'s module docstring):

* :class:`_RowChunk`: the chunk's rows of E, their compaction on the device (counted rows first, their number in
  device memory: ``_launch.compact_counted``), each row's poison (0, or NaN where eager's gradient of an ignored row
  is NaN), the compacted copy of E's rows the recompute and the products read (in dE's own rows while those are
  free), and the poison eager's dC receives from the ignored rows;
* :func:`counted_prefix` and :class:`_PrefixTail`: with the counted-prefix products, how many compacted rows cuBLAS
  multiplies (an earlier call's counted share, in whole row blocks) and the row-skipping products past them, sized on
  the device by this call's counted rows beyond the prefix;
* :func:`_target_logits`: every row's target logit, once per call (from the targets' rows of C, a row block at a
  time, where C is stored in another dtype than the products');
* :func:`_uncompact_rows`: dE summed in compacted order, put back in row order at the end;
* :func:`_block`: a ``rows x cols`` view at the start of a flat scratch (the G block; the last chunks are narrower).

No host synchronisation: the counts stay on the device, and every size the host needs is known before the call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _forward, _launch, _layout, _products


def counted_prefix(counted_hint: float, rows: int, block: int = 128) -> int:
    """The compacted rows cuBLAS multiplies where an earlier call counted ``counted_hint`` of its rows: that share of
    ``rows``, rounded up to whole ``block``-row tiles, at most ``rows``."""
    return min(rows, -(-math.ceil(counted_hint * rows) // block) * block)


class _RowChunk(NamedTuple):
    """One row chunk of the backward: its rows, their compaction (counted rows first, their number on the device),
    each row's poison (0, or NaN where eager's gradient of an ignored row is NaN), and where the recompute reads E."""

    r0: int
    rows: int
    e_rows: torch.Tensor
    row_order: torch.Tensor
    num_counted: torch.Tensor
    row_poison: torch.Tensor
    e_compact: torch.Tensor | None
    e_op: object  # E's rows as the recompute reads them: the rows themselves, or a descriptor over e_compact
    ignored_poison: torch.Tensor | None  # what eager's dC receives from the ignored rows (Triton products)

    @classmethod
    def of(cls, e, counted, r0, rows, weight_poison, de_out, block_n, block_d, *, compact, tma, poison_sum):
        e_rows = e[r0 : r0 + rows]
        counted_rows = counted[r0 : r0 + rows]
        row_order, num_counted = _launch.compact_counted(counted_rows)
        row_poison = _launch.nonfinite_rows(e_rows) + weight_poison
        e_compact = None
        if compact:
            # in dE's own rows while they are free (dE is written from its fp32 sums at the very end), so the copy
            # costs no memory where dE is wanted
            e_compact = (
                torch.index_select(e_rows, 0, row_order, out=de_out[r0 : r0 + rows])
                if de_out is not None
                else e_rows.index_select(0, row_order)
            )
        e_op = _launch.descriptor(e_compact, [block_n, block_d]) if tma else e_rows
        ignored_poison = torch.where(counted_rows, 0.0, row_poison).sum().reshape(1) if poison_sum else None
        return cls(r0, rows, e_rows, row_order, num_counted, row_poison, e_compact, e_op, ignored_poison)


class _PrefixTail(NamedTuple):
    """One row chunk's split of its compacted rows: cuBLAS multiplies positions ``[0, h)``, the row-skipping Triton
    products ``[h, rows)`` (sized by ``tail_counted``, the counted positions past h: 0 where the hint held)."""

    h: int
    tail_counted: torch.Tensor | None  # int32 (1,), on the device
    tail_poison: torch.Tensor | None  # per tail position, the poison of its row (dE of ignored positions)
    tail_ids: torch.Tensor | None  # 0 .. rows - h - 1: the tail's dE rows are its own positions

    @classmethod
    def of(cls, chunk: _RowChunk, h: int):
        if h >= chunk.rows:
            return cls(chunk.rows, None, None, None)
        tail_counted = torch.clamp(chunk.num_counted - h, min=0)
        tail_poison = chunk.row_poison[chunk.row_order[h:]]
        tail_ids = torch.arange(chunk.rows - h, device=chunk.row_order.device)
        return cls(h, tail_counted, tail_poison, tail_ids)

    def products(self, grad, c_chunk, chunk, de_rows, dc_chunk, dc32, *, upcast, first_vocab, first_rows, **out_dtype):
        """dE rows (compacted order, fp32) and dC of one G block (compacted rows). dC: where ``dc_chunk`` is the
        16-bit output (one row chunk), cuBLAS sums its prefix in ``dc32`` and the tail adds it and writes
        ``dc_chunk``, one rounding; where it is ``dc32`` itself (several row chunks), both add to it."""
        h, has_tail = self.h, self.tail_counted is not None
        grad_mm = grad.float() if upcast else grad
        if de_rows is not None:
            _launch.product_into(
                de_rows[:h], grad_mm[:h], c_chunk, accumulate=not first_vocab, vocab_dim="k", **out_dtype
            )
        if dc_chunk is not None:
            ec = chunk.e_compact.float() if upcast else chunk.e_compact
            sums_in_dc = dc_chunk.data_ptr() == dc32.data_ptr()
            _launch.product_into(
                dc32, grad_mm[:h].T, ec[:h], accumulate=sums_in_dc and not first_rows, vocab_dim="m", **out_dtype
            )
        # (a chunk without a tail is one of several row chunks, h being shorter than the first: its dC sums stay in
        # dc32, which the caller rounds once into dC)
        if has_tail:  # both tails in one launch, after the cuBLAS products (the dC tail adds to their dc32 sums)
            _products.grad_products(
                grad[h:], self.tail_counted, c_chunk=c_chunk if not upcast else c_chunk.to(grad.dtype),
                de32=None if de_rows is None else de_rows[h:], row_order=self.tail_ids, row_poison=self.tail_poison,
                accumulate_e=not first_vocab, e_compact=None if dc_chunk is None else chunk.e_compact[h:],
                dc_chunk=dc_chunk, ignored_poison=chunk.ignored_poison, accumulate_c=True, acc_in=dc32,
            )  # fmt: skip


def _target_logits(e, c, targets, bias, softcap, compute_dtype):
    """Every row's target logit, fp32 (0 where the target is outside ``[0, V)``); with ``compute_dtype`` (C and bias
    stored wider than the products' dtype) from the targets' rows of C, gathered and converted
    ``_layout.TARGET_ROW_BLOCK`` rows at a time: not all of C, nor all N of its target rows at once."""
    if compute_dtype is None:
        return _forward.target_logits(e, c, targets, bias, softcap=softcap, ignore_index=_forward.EVERY_ROW)
    v, n = c.shape[0], targets.shape[0]
    inside = (targets >= 0) & (targets < v)
    ids = torch.where(inside, targets, 0)
    out = torch.empty((n,), dtype=torch.float32, device=e.device)
    step = _layout.TARGET_ROW_BLOCK
    own = torch.arange(min(n, step), device=targets.device)
    for r0 in range(0, n, step):
        block = ids[r0 : r0 + step]
        out[r0 : r0 + step] = _forward.target_logits(
            e[r0 : r0 + step],
            c.index_select(0, block).to(compute_dtype),
            own[: block.shape[0]],
            None if bias is None else bias.index_select(0, block),
            softcap=softcap,
            ignore_index=_forward.EVERY_ROW,
        )
    return torch.where(inside, out, 0.0)


def _uncompact_rows(out: torch.Tensor, compact32: torch.Tensor, row_order: torch.Tensor, step: int = 2048) -> None:
    """``out[row_order[p]] = compact32[p]`` (rounded to ``out``'s dtype), ``step`` rows at a time (a small
    temporary)."""
    for p0 in range(0, out.shape[0], step):
        out.index_copy_(0, row_order[p0 : p0 + step], compact32[p0 : p0 + step].to(out.dtype))


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``rows x cols`` view at the start of a flat scratch buffer (last chunks are narrower)."""
    return buffer[: rows * cols].view(rows, cols)
