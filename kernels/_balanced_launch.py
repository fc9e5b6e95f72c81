"""Launch helpers of the balanced path (the kernels and their math: ``_balanced.py``).

:func:`loss_and_grads` computes a loss and its gradients ``chunk_rows`` rows at a time: per chunk, cuBLAS writes
the chunk's logits into one scratch (rows padded to ``ROW_ALIGN``), the row kernel turns them into G in place, and
cuBLAS (or the row-skipping / pair products) add the chunk's dC and write its dE. Every decision (rows per chunk,
how dC is summed, the counted prefix) is the caller's, an explicit argument; ``_layout.balanced_chunks`` lays the
chunks out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from . import _launch, _layout, _pair_sums, _products, _targets
from ._balanced import _TUNING, _softmax_grad_in_place_kernel


class LossAndGrads(NamedTuple):
    """The loss (fp32 scalar) and its gradients, each in its input's dtype: an fp32 gradient is the fp32 sum itself;
    a 16-bit one is the pair ``(hi, lo)`` (``_pair_sums``), ``hi`` the sum rounded once and ``lo`` the remainder (the
    backward rounds ``g * (hi + lo)`` once), but a dC summed as the plain sum (``plain_sum``) and a dE without
    ``de_pair`` are ``hi`` alone.  dbias is fp32.  A gradient not asked for is None (dbias also without a bias; a
    ``lo`` for an fp32 gradient or a plain one)."""

    loss: torch.Tensor
    grad_e: torch.Tensor | None
    grad_c: torch.Tensor | None
    grad_bias: torch.Tensor | None
    grad_e_lo: torch.Tensor | None
    grad_c_lo: torch.Tensor | None


# Scratch rows are padded to a multiple of this many elements (module docstring; ``cce_inductor.paths`` sizes the
# scratch with the same padding).
ROW_ALIGN = _layout.VOCAB_ALIGN
# Columns of dC (rows of the product) per step of the pair sums' fallback (operands the tensor-memory accelerator
# cannot read): an fp32 slab of this many rows x D at a time.
_FALLBACK_SLAB = 4096


def _sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _gradient(shape, dtype, device, pair: bool):
    """A gradient's buffers: ``(sum, lo)``, lo None unless the gradient is a 16-bit pair."""
    return torch.empty(shape, dtype=dtype, device=device), (
        torch.empty(shape, dtype=dtype, device=device) if pair else None
    )


def _pair_sums_into(hi, lo, grad, e_rows, *, accumulate: bool, upcast: bool, num_counted=None, poison=None) -> None:
    """``(hi, lo) (+)= grad^T @ e_rows (+ poison)`` (``_pair_sums``), or with ``lo`` None the plain 16-bit sum, ``hi
    (+)= grad^T @ e_rows`` rounded once: the Triton product where the tensor-memory accelerator reads the operands,
    else in fp32 slabs of ``_FALLBACK_SLAB`` rows of the result.  ``num_counted`` / ``poison`` (rows compacted, which
    :func:`row_skipping_ok` allows only for operands the accelerator reads): the Triton product's device-side bound on
    the rows summed, and the poison it adds."""
    if _launch.tma_ok(grad, e_rows):
        _pair_sums.pair_product(hi, lo, grad, e_rows, accumulate=accumulate, num_counted=num_counted, poison=poison)
        return
    if num_counted is not None or poison is not None:
        raise ValueError("cce_inductor: a row-bounded pair sum needs operands the tensor-memory accelerator reads")
    a = grad.float() if upcast else grad
    b = e_rows.float() if upcast else e_rows
    out_dtype = {} if upcast or a.dtype == torch.float32 else {"out_dtype": torch.float32}
    for s0 in range(0, hi.shape[0], _FALLBACK_SLAB):
        s1 = min(s0 + _FALLBACK_SLAB, hi.shape[0])
        slab = torch.mm(a[:, s0:s1].T, b, **out_dtype)
        if accumulate:
            slab += hi[s0:s1].float()
            if lo is not None:
                slab += lo[s0:s1].float()
        if lo is None:
            hi[s0:s1].copy_(slab)
        else:
            _pair_sums.split_pair(slab, hi[s0:s1], lo[s0:s1])


def row_skipping_ok(e, c, *, compute_dtype, need_bias: bool) -> bool:
    """Whether :func:`loss_and_grads` can skip ignored rows (``counted_prefix_rows``) for these operands: 16-bit
    gradients in the products' dtype (the pairs; no conversion), no bias gradient (its column sums would read the
    rows skipped), and rows the tensor-memory accelerator can read."""
    return (
        _sixteen_bit(e.dtype)
        and c.dtype == e.dtype
        and compute_dtype in (None, e.dtype)
        and not need_bias
        and _launch.tma_ok(c)
        and (e.shape[1] * e.element_size()) % 16 == 0
    )


def loss_and_grads(
    e, c, targets, bias, *, softcap, ignore_index, reduction, label_smoothing=0.0, chunk_rows, compute_dtype=None,
    need_e=True, need_c=True, need_bias=True, check_range=False, counted_prefix_rows=None, observe_counted=None,
    plain_sum=False, de_pair=True, grad_scale=None,
) -> LossAndGrads:  # fmt: skip
    """Launch helper: :class:`LossAndGrads` of ``cross_entropy(softcap(e @ c.T + bias), targets)`` for reduction
    "mean" or "sum", ``chunk_rows`` rows at a time through one scratch of logits (module docstring).
    ``compute_dtype``: the dtype the products run in where it is not the inputs' (autocast: fp32 inputs, 16-bit
    products; the gradients stay in the inputs' dtypes).  ``counted_prefix_rows`` (where :func:`row_skipping_ok`):
    rows compacted (counted first), cuBLAS over that many of them, the row-skipping products past them (module
    docstring); None: cuBLAS over every row.  ``observe_counted``: called with the device-side count of counted rows
    and the rows (``cce_inductor/_counted_share.py``).  ``plain_sum``: a 16-bit dC is summed in its own dtype, one
    rounding a chunk, over at most ``PLAIN_SUM_MAX_CHUNKS`` chunks (``chunk_rows >= N / 2``; with a counted prefix
    the chunks are laid out so, ``_layout.balanced_chunks``), and returned without a remainder (``grad_c_lo``
    None); else as the pair (module docstring).  ``de_pair``: a 16-bit dE as the pair too, else rounded once, as
    torch.compile's product rounds it (``grad_e_lo`` None).  Each row of dE is one chunk's sum: its remainder only
    keeps ``g * dE`` rounded once for an upstream gradient g that is not a power of two, which ``grad_scale``
    otherwise stands for.  ``grad_scale`` (a 0-dim fp32 device tensor, finite and nonzero): the gradients are those of
    ``grad_scale * loss``, each rounded as at upstream gradient 1 (G carries the factor before its one rounding); the
    loss itself is not scaled."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"the balanced path computes reductions 'mean' and 'sum', got {reduction!r}")
    tune = _launch.tuning(_TUNING)
    n, d = e.shape
    v = c.shape[0]
    device = e.device
    dtype = compute_dtype or e.dtype
    need_bias = need_bias and bias is not None
    rows_per_chunk = max(1, min(chunk_rows, n))
    compact = counted_prefix_rows is not None and counted_prefix_rows < n
    if compact and not row_skipping_ok(e, c, compute_dtype=compute_dtype, need_bias=need_bias):
        raise ValueError("cce_inductor: the balanced path cannot skip rows for these operands (row_skipping_ok)")
    targets = targets.contiguous()
    pitch = triton.cdiv(v, ROW_ALIGN) * ROW_ALIGN  # whatever V is, no product sees an odd leading dimension
    split = v - v % ROW_ALIGN  # the vocabulary's aligned part; its tail (fewer than 64 entries) goes apart (below)
    ops = _operands(e, c, bias, dtype)
    scratch = torch.empty(rows_per_chunk * pitch, dtype=dtype, device=device)
    # the first chunk's logits first: the GPU starts on the call's largest kernel while the host launches the rest
    # (the count, the poison), which the row kernel needs only after it
    first_logits = n > 0 and split > 0 and not compact
    if first_logits:
        torch.mm(ops.e[:rows_per_chunk], ops.c[:split].T, out=scratch.view(rows_per_chunk, pitch)[:, :split])
    # row_scale: 1 / #counted (inf when no row counts; then every row is ignored: G = 0) or 1
    num_counted, row_scale = _targets.count_targets(
        targets, ignore_index, mean=reduction == "mean", check_vocab=v if check_range else None
    )
    if observe_counted is not None:
        observe_counted(num_counted, n)
    if grad_scale is not None:
        row_scale = row_scale * grad_scale

    e_pair = _sixteen_bit(e.dtype) and de_pair
    c_pair = _sixteen_bit(c.dtype)
    plain_sum = bool(plain_sum) and c_pair and need_c  # (an fp32 dC is its own fp32 sum at any number of chunks)
    c_pair = c_pair and not plain_sum
    grad_e, grad_e_lo = _gradient((n, d), e.dtype, device, e_pair) if need_e else (None, None)
    # dC's product runs over the padded scratch rows (pitch x D); rows past V are dropped
    grad_c, grad_c_lo = _gradient((pitch, d), c.dtype, device, c_pair) if need_c else (None, None)
    grad_bias = torch.zeros((v,), dtype=torch.float32, device=device) if need_bias else None
    # the kernel writes every row it reads (skipped rows: none, so they start at 0)
    row_loss = (torch.zeros if compact else torch.empty)((n,), dtype=torch.float32, device=device)
    if n == 0:
        for buffer in (grad_e, grad_e_lo, grad_c, grad_c_lo):
            if buffer is not None:
                buffer.zero_()
    else:
        _chunks(
            ops, scratch, targets, grad_e, grad_e_lo, grad_c, grad_c_lo, grad_bias, row_loss, row_scale,
            softcap=softcap, ignore_index=ignore_index, label_smoothing=label_smoothing, dtype=dtype,
            rows_per_chunk=rows_per_chunk, pitch=pitch, split=split, tune=tune,
            counted_prefix_rows=counted_prefix_rows if compact else None, plain_sum=plain_sum,
            first_logits=first_logits,
        )  # fmt: skip
    if need_c:
        grad_c = grad_c[:v]
        grad_c_lo = grad_c_lo[:v] if grad_c_lo is not None else None
    total = row_loss.sum()
    loss = total / num_counted if reduction == "mean" else total  # 0 / 0 = NaN when every row is ignored, as eager
    return LossAndGrads(loss, grad_e, grad_c, grad_bias, grad_e_lo, grad_c_lo)


class _Compacted(NamedTuple):
    """The rows in compacted order (counted ones first) and what the chunks past the counted prefix read: each
    chunk's count relative to its first row (device int32), the rows' poison in that order."""

    row_order: torch.Tensor
    targets: torch.Tensor
    e_poison: torch.Tensor
    row_poison: torch.Tensor  # e_poison + the weight's poison: an ignored row's dE
    chunk_counts: torch.Tensor  # (chunks past the prefix,) int32: #counted - first row of the chunk
    dc_poison: torch.Tensor  # what eager's dC (and dbias) receive from every row: 0 or NaN
    identity: torch.Tensor  # 0 .. rows_per_chunk - 1: the products' row order within a chunk (already compacted)

    @classmethod
    def of(cls, targets, ignore_index, e_poison, c_poison, prefix, n, rows_per_chunk):
        row_order, count = _launch.compact_counted(targets != ignore_index)
        e_poison = e_poison[row_order]
        starts = torch.arange(prefix, n, rows_per_chunk, dtype=torch.int32, device=targets.device)
        return cls(
            row_order,
            targets[row_order],
            e_poison,
            e_poison + c_poison,
            count - starts,
            e_poison.sum() + c_poison,
            torch.arange(rows_per_chunk, dtype=torch.int64, device=targets.device),
        )


class _Operands(NamedTuple):
    """What every chunk reads: the operands in the products' dtype (converted once per call), their fp32 copies
    where the products upcast (the CPU interpreter: no 16-bit products with fp32 results), and the keywords of an
    fp32-result product."""

    e: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    e_mm: torch.Tensor
    c_mm: torch.Tensor
    upcast: bool
    out_dtype: dict


def _operands(e, c, bias, dtype) -> _Operands:
    e_cd = e if e.dtype == dtype else e.to(dtype)
    c_cd = c if c.dtype == dtype else c.to(dtype)
    bias_cd = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
    # 16-bit operands, fp32 results: cuBLAS's out_dtype products; where there are none (the CPU interpreter)
    # the operands are upcast
    upcast = dtype != torch.float32 and not _launch.fp32_out_mm_available(e.device)
    out_dtype = {"out_dtype": torch.float32} if dtype != torch.float32 and not upcast else {}
    e_mm = e_cd.float() if upcast else e_cd
    c_mm = c_cd.float() if upcast else c_cd
    return _Operands(e_cd, c_cd, bias_cd, e_mm, c_mm, upcast, out_dtype)


def _chunks(
    ops, scratch, targets, grad_e, grad_e_lo, grad_c, grad_c_lo, grad_bias, row_loss, row_scale, *,
    softcap, ignore_index, label_smoothing, dtype, rows_per_chunk, pitch, split, tune, counted_prefix_rows,
    plain_sum, first_logits,
):  # fmt: skip
    """The row chunks of :func:`loss_and_grads` (module docstring), writing the gradients' buffers and ``row_loss``;
    ``first_logits``: the first chunk's aligned logits are in ``scratch`` already."""
    n, d = ops.e.shape
    v = ops.c.shape[0]
    device = ops.e.device
    # eager's NaN pattern of ignored rows, computed once for every chunk (the row kernel adds the two)
    e_poison, c_poison = _launch.nonfinite_rows(ops.e), _launch.weight_poison(ops.c, ops.bias)
    prefix, layout = _layout.balanced_chunks(n, rows_per_chunk, counted_prefix_rows, plain_sum)
    compacted = None
    if counted_prefix_rows is not None:
        compacted = _Compacted.of(targets, ignore_index, e_poison, c_poison, prefix, n, rows_per_chunk)
        targets, e_poison = compacted.targets, compacted.e_poison
    chunk_logits = scratch.view(rows_per_chunk, pitch)
    de_rows32 = _de_rows32(grad_e, grad_e_lo, rows_per_chunk, counted_prefix_rows is not None or split < v, ops)
    if compacted is not None:
        # the chunk's rows of E gathered in compacted order: in the first half of dE's fp32 rows, which are written
        # only after dC's product has read them (below), so the gather costs no memory where dE is wanted
        e_gathered = (
            de_rows32.view(-1).view(dtype)[: rows_per_chunk * d].view(rows_per_chunk, d)
            if de_rows32 is not None
            else torch.empty((rows_per_chunk, d), dtype=dtype, device=device)
        )
    tail = None
    if split < v:
        # the tail's logits in a buffer of aligned rows (every row in one product, not one per chunk, unless the
        # rows are compacted chunk by chunk); the row kernel reads them there and overwrites them with their gradient
        tail = torch.empty((n, ROW_ALIGN), dtype=dtype, device=device)
        if compacted is None:
            torch.mm(ops.e, ops.c[split:].T, out=tail[:, : v - split])
    block_v = tune["short_row_block_v"] if v <= tune["short_row"] else tune["block_v"]
    past_prefix = 0
    for i, (r0, rows) in enumerate(layout):
        padded = chunk_logits if rows == rows_per_chunk else chunk_logits[:rows]
        # past the prefix: the count of this chunk's counted rows, which the row-skipping products read
        count = None
        if compacted is not None and r0 >= prefix:
            count = compacted.chunk_counts[past_prefix : past_prefix + 1]
            past_prefix += 1
        if compacted is not None:
            row_order = compacted.row_order[r0 : r0 + rows]
            e_rows = torch.index_select(ops.e, 0, row_order, out=e_gathered[:rows])
        else:
            e_rows = ops.e[r0 : r0 + rows]
        chunk_tail = tail is not None and count is None
        if count is not None:  # every column at once (Triton has no alignment to keep): no tail buffer
            _products.logits_product(padded[:, :v], e_rows, ops.c, count)
        else:
            # rounded to the products' dtype, as torch.compile's matmul rounds them
            if split and not (first_logits and i == 0):
                torch.mm(e_rows, ops.c[:split].T, out=padded[:, :split])
            if chunk_tail and compacted is not None:
                torch.mm(e_rows, ops.c[split:].T, out=tail[r0 : r0 + rows, : v - split])
        _softmax_grad_in_place_kernel[(rows,)](
            padded, tail if chunk_tail else padded, ops.bias if ops.bias is not None else row_scale,
            targets, e_poison, c_poison, row_scale, row_loss, count if count is not None else row_scale,
            r0, v, split if chunk_tail else v, pitch, ROW_ALIGN, ignore_index,
            float(softcap) if softcap is not None else 1.0, 1.0 - label_smoothing, label_smoothing / v,
            HAS_BIAS=ops.bias is not None, HAS_SOFTCAP=softcap is not None, LOGIT_SUM=label_smoothing != 0.0,
            ROUND_RNE=_launch.INTERPRET and dtype == torch.bfloat16, TAIL=chunk_tail,
            SKIP_BLOCK=_products.skip_block() if count is not None else 0, BLOCK_V=block_v,
            num_warps=tune["num_warps"],
        )  # fmt: skip
        # the scratch now holds G, 0 past V.  dC before dE: dE's product overwrites the gathered rows of E
        if grad_c is not None:
            # compacted: every row's poison enters dC once, with the first chunk whose product adds it (a pair's
            # first chunk; a plain sum's first chunk past the prefix, the row-skipping product's)
            adds_poison = compacted is not None and (past_prefix == 1 and count is not None if plain_sum else i == 0)
            poison = compacted.dc_poison if adds_poison else None
            _dc_chunk(grad_c, grad_c_lo, padded, e_rows, ops, v, first=i == 0, count=count, poison=poison)
        if grad_e is not None:
            _de_chunk(grad_e, grad_e_lo, de_rows32, padded, ops, tail, v, split, r0, rows, count, compacted)
        if grad_bias is not None:
            grad = padded.float() if ops.upcast else padded
            grad_bias += grad[:, :v].sum(dim=0, dtype=torch.float32)


def _de_rows32(grad_e, grad_e_lo, rows_per_chunk, not_one_product: bool, ops: _Operands):
    """A 16-bit dE is complete after its chunk: its fp32 rows are split into the pair there, or rounded once into dE
    where it is not one cuBLAS product written in place (``not_one_product``: the vocabulary's tail a second product,
    rows compacted; fp32 products on the interpreter). None where neither."""
    if grad_e is None or grad_e.dtype == torch.float32:
        return None
    if grad_e_lo is None and not not_one_product and not ops.upcast:
        return None
    return torch.empty((rows_per_chunk, grad_e.shape[1]), dtype=torch.float32, device=grad_e.device)


def _dc_chunk(grad_c, grad_c_lo, padded, e_rows, ops: _Operands, v, *, first: bool, count, poison) -> None:
    """``dC (+)= G^T @ E[rows]`` for one chunk (``padded``: its G, over the padded vocabulary), rows past the prefix
    (``count``: their device-side count) by the row-skipping products, ``poison`` (a device scalar) added to every
    element where given: a 16-bit pair by the pair product; a plain 16-bit sum rounded once a chunk; an fp32 gradient
    is its own fp32 sum."""
    if grad_c_lo is not None:
        _pair_sums_into(
            grad_c, grad_c_lo, padded, e_rows, accumulate=not first, upcast=ops.upcast, num_counted=count, poison=poison
        )
    elif count is not None:
        if poison is None:
            poison = torch.zeros((), dtype=torch.float32, device=grad_c.device)
        _products.grad_products(
            padded[:, :v], count, e_compact=e_rows, dc_chunk=grad_c[:v], ignored_poison=poison, accumulate_c=not first
        )
    elif grad_c.dtype == torch.float32:
        grad = padded.float() if ops.upcast else padded
        rows = e_rows.float() if ops.upcast else e_rows
        _launch.product_into(grad_c, grad.T, rows, accumulate=not first, **ops.out_dtype)
    elif first and not ops.upcast:  # the plain sum's first chunk: cuBLAS's mm rounds its product once
        _launch.product_into(grad_c, padded.T, e_rows, accumulate=False)
    else:
        # its later chunks add before their one rounding (the error budget's model), which cuBLAS's 16-bit addmm
        # (beta = 1) does not promise: at some shapes it rounds the product first
        _pair_sums_into(grad_c, None, padded, e_rows, accumulate=not first, upcast=ops.upcast)


def _de_chunk(grad_e, grad_e_lo, de_rows32, padded, ops: _Operands, tail, v, split, r0, rows, count, compacted):
    """The chunk's rows of dE, whole (the aligned part of V, then the tail's; past the prefix the counted rows' row
    blocks, the others their poison), in ``de_rows32`` put into the pair (or rounded once into dE) at their rows
    (compacted: their original rows); without it written in place."""
    de_rows = de_rows32[:rows] if de_rows32 is not None else grad_e[r0 : r0 + rows]
    out_dtype = ops.out_dtype if de_rows.dtype == torch.float32 else {}  # (16-bit in place: cuBLAS rounds once)
    if count is not None:
        _products.grad_products(
            padded[:, :v],
            count,
            c_chunk=ops.c,
            de32=de_rows,
            row_order=compacted.identity[:rows],
            row_poison=compacted.row_poison[r0 : r0 + rows],
        )
    else:
        grad = padded.float() if ops.upcast else padded
        if split:
            _launch.product_into(de_rows, grad[:, :split], ops.c_mm[:split], accumulate=False, **out_dtype)
        if tail is not None:
            grad_tail = tail[r0 : r0 + rows, : v - split]
            grad_tail = grad_tail.float() if ops.upcast else grad_tail
            _launch.product_into(de_rows, grad_tail, ops.c_mm[split:], accumulate=split > 0, **out_dtype)
    if compacted is not None:
        _pair_sums.split_rows_into(de_rows, grad_e, grad_e_lo, compacted.row_order[r0 : r0 + rows])
    elif grad_e_lo is not None:
        _pair_sums.split_pair(de_rows, grad_e[r0 : r0 + rows], grad_e_lo[r0 : r0 + rows])
    elif de_rows32 is not None:
        grad_e[r0 : r0 + rows].copy_(de_rows)
