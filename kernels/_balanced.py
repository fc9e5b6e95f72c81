"""Balanced path: the loss and its gradients in one pass over row chunks, through a bounded scratch of logits.

Used when the loss is a mean or a sum and the head needs gradients, where ``cce_inductor.paths`` picks it (the
pass and ``linear_cross_entropy`` ask it): then ``d loss / d (E, C, bias) = grad_loss * (dE, dC, dbias)`` with
``(dE, dC, dbias)`` the gradients of the loss itself, known at forward time.  Computing them there takes three
matmuls (logits, dE, dC) where the lean path takes four (forward log-sum-exp, recompute, dE, dC); the backward
only scales by ``grad_loss`` (plain aten, outside this module).

Math
----
Per row n (x = E[n] . C[v] rounded to the products' dtype, as torch.compile's matmul rounds its logits):

    z[n, v]    = s * tanh((x + bias[v]) / s)          (z = x + bias without a softcap s)
    lse[n]     = log sum_v exp(z[n, v])
    row_loss   = lse - (1 - eps) z[n, t_n] - eps / V sum_v z[n, v]      (0 at ignored rows; eps: label smoothing)
    loss       = sum_n row_loss / #counted   (mean; #counted a device tensor)   |   sum_n row_loss   (sum)
    G[n, v]    = (exp(z - lse) - (1 - eps) [v == t_n] - eps / V) * (1 - (z / s)^2) * row_scale
                 row_scale = 1 / #counted (mean) | 1 (sum);  ignored rows: G = 0 (NaN where eager has NaN: below)
    dE = G @ C,   dC = G^T @ E,   dbias = sum_n G[n, :]

Chunk / grid layout
-------------------
R rows per chunk (``cce_inductor.paths.chunk_rows``: the most whose padded logits fit in the scratch the budget
leaves, a multiple of 128 once >= 128, at most N).  One flat scratch of R rows serves every chunk, each row
padded to P = V rounded up to a multiple of 64 elements (``ROW_ALIGN``).  cuBLAS runs a 16-bit product several times
slower when a dimension is not a multiple of 8 elements, so no product over V sees an unaligned one: with
A = V - V mod 64 (the aligned part) and T = V - A < 64 entries in the tail (T = 0 for most vocabularies), the logits
of A go through the scratch and those of the tail through a tail buffer (N x 64), whose logits product runs once per
call (each launch costs host time, which small heads wait for).  Operands are in the products' dtype: the inputs'
own, or autocast's (``compute_dtype``; fp32 inputs are converted once per call, and the copies are freed with it):

    once per call:  #counted and row_scale (``_targets.count_targets``: one program, and the op's range check);
                    the poison of E's rows and of C / bias (``_launch.nonfinite_rows`` / ``weight_poison``, below);
                    (T > 0) Tail[:, :T] = E @ C[A:]^T     cuBLAS, every row
    for each row chunk [r0, r0 + R):
        S[:, :A] = E[rows] @ C[:A]^T                     cuBLAS, into the scratch
        _softmax_grad_in_place_kernel, grid (R,)          one program per row, BLOCK_V columns at a time, columns
                                                          from A on read from the row of Tail:
                   pass 1 reads the row: online max / sum of exps (fp32) per lane of the block, reduced
                          across lanes after the loop; the target logit, the row sum (eps > 0) -> row_loss[n]
                   pass 2 reads it again and overwrites it with G (fp32 math, stored in the products' dtype):
                          S[:, :V] (0 in the padding columns up to P) and the tail's columns of Tail
                   ignored rows read nothing: pass 2 writes their G (0, or NaN for a non-finite row)
        dC_P    (+)= S^T @ E[rows]                        over the padded rows, summed over the chunks; dC is the
                                                          first V rows of the P x D sum
        dE[rows]  = S[:, :A] @ C[:A] + Tail[rows] @ C[A:] cuBLAS, fp32 results: complete for these rows
        dbias    += S[:, :V].sum(0)                       fp32

Each gradient leaves in its input's dtype, rounded once: an fp32 gradient (fp32 inputs, autocast's fp32 weights) is
its fp32 sum (cuBLAS accumulates dC in it); a 16-bit one is a pair of 16-bit sums ``hi + lo`` (``_pair_sums``:
dE's rows split once their chunk is done, dC summed chunk by chunk in the pair product's epilogue), ~16 mantissa
bits; or, with ``plain_sum``, a 16-bit dC is summed in its own dtype (cuBLAS's ``addmm`` adds each chunk's product
to it in its epilogue, ``beta = 1``: one rounding a chunk, at most ``_layout.PLAIN_SUM_MAX_CHUNKS`` chunks, the
error budget's bound; past a counted prefix the row-skipping product, which adds the skipped rows' poison too).
The op's backward scales them by the upstream gradient g, ``g * (hi + lo)`` rounded once, into ``hi``'s own buffer
(a saved tensor that only the backward reads is a donated buffer to Inductor, which writes the result in place):
the pairs carry no more rounding than torch.compile's, whatever g is, and the backward allocates no second copy of
them.

Ignored rows: cuBLAS's products are sized on the host, and the count of counted rows lives on the device.  Where an
earlier call of the head counted a share of its rows (``counted_prefix_rows``, ``cce_inductor/_counted_share.py``),
the rows are compacted on the device (a stable sort: counted rows first; the targets and poisons with them), the
first ``counted_prefix_rows`` of them go through the chunks above (each chunk's rows of E gathered into dE's fp32
rows, which hold them until dC's product has read them; its tail logits computed per chunk), and the chunks past them
through Triton products that read each chunk's count and skip the row blocks (``_products.skip_block()`` rows) that
hold no counted row:

    past the prefix, per chunk (K its count of counted rows, K' = K rounded up to a row block):
        S[:K', :V] = Ec[rows] @ C^T                       ``_products.logits_product``: whole V, no tail buffer
        the row kernel on rows < K' (rows in [K, K') are ignored ones: their G is their poison)
        dE32[:K'] = S @ C, rows past K' their poison      ``_products.grad_products`` (dE only)
        (dC_hi, dC_lo) += S[:K']^T @ Ec[:K']              ``_pair_sums.pair_product`` bounded by K; tiles with no
                                                          counted row leave the pair untouched
    every chunk's dE rows are split into the pair at their original rows (``_pair_sums.split_rows_into``), and the
    first chunk's dC product adds every row's poison (what eager's dC receives from the rows skipped).

So a call that counts no more rows than the prefix pays launches past it, not products; one that counts more pays
the Triton products' speed for them; the result is the same either way to within rounding.  Only where the
gradients are 16-bit pairs of the products' dtype, without a bias gradient (:func:`row_skipping_ok`).

NaN pattern: eager's softmax gradient of an ignored row is 0, or NaN in the whole row when its log-sum-exp is NaN
(a non-finite value in that row of E, or anywhere in C / bias); ``EPoison`` (0 or NaN per row of E) plus
``CPoison`` (0 or NaN: C and bias) reproduce it without reading the row.

Memory (above the inputs, R the chunk rows, b the products' element size, g each gradient's own)
------
    the gradients as returned: 2 x (N + P) x D x g for 16-bit pairs, (N + P) x D x 4 for fp32 ones, fp32 dbias;
    the scratch R x P x b; N fp32 row losses; an fp32 R x D block for a 16-bit dE's rows; the tail buffer N x 64 x b
    (T > 0 only); converted operands where the products' dtype is not the inputs' (``compute_dtype``): (N + V) x D x b
    for the call; with rows compacted, N x 28 bytes of order, targets and poisons (the chunk's rows of E are
    gathered into the fp32 dE rows' buffer, or an R x D x b one of their own where dE is not wanted).  The backward
    adds nothing where Inductor compiles it (in place, above).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _launch, _layout, _pair_sums, _products, _targets
from ._tile import round_bf16_rne, softmax_grad, tanh

# One program streams one row in BLOCK_V columns; 16-byte vector loads of bf16 need BLOCK_V / (32 * num_warps) >= 8.
# Rows up to short_row entries take wider blocks (measured; the figures are in docs/).
_TUNING = {
    "gpu": dict(block_v=2048, num_warps=8, short_row=65536, short_row_block_v=4096),
    "interpret": dict(block_v=64, num_warps=4, short_row=0, short_row_block_v=64),
}


@triton.jit
def _load_z(
    row_ptr,
    tail_ptr,
    Bias,
    cols,
    mask,
    split,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TAIL: tl.constexpr,
    EVICT: tl.constexpr,
):
    """One block of a row's (softcapped) logits in fp32; 0-based past V (callers mask).  With ``TAIL`` the columns
    from ``split`` on come from the row's entries of the tail buffer (``tail_ptr``: its column 0 is ``split``)."""
    if TAIL:
        x = tl.load(row_ptr + cols, mask=mask & (cols < split), other=0.0, eviction_policy=EVICT).to(tl.float32)
        x_tail = tl.load(tail_ptr + (cols - split), mask=mask & (cols >= split), other=0.0).to(tl.float32)
        x = tl.where(cols < split, x, x_tail)
    else:
        x = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    return x


@triton.jit
def _softmax_grad_in_place_kernel(
    S,
    Tail,
    Bias,
    Targets,
    EPoison,
    CPoison,
    RowScale,
    RowLoss,
    NumCounted,
    row0,
    V,
    split,
    stride_row,
    stride_tail,
    ignore_index,
    softcap,
    target_weight,
    uniform,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    LOGIT_SUM: tl.constexpr,
    ROUND_RNE: tl.constexpr,
    TAIL: tl.constexpr,
    SKIP_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Row ``program_id(0)`` of the chunk that starts at row ``row0``: reads its logits from ``S`` (columns from
    ``split`` on from ``Tail[row0 + row]`` where ``TAIL``), writes its loss (unscaled, 0 if ignored) to
    ``RowLoss[row0 + row]`` and overwrites the row of ``S`` with its scaled softmax gradient, 0 in its padding
    columns up to ``stride_row`` (and the tail's columns of ``Tail`` with theirs).  ``RowScale``: a one-element fp32
    device tensor (1 / #counted or 1), so the mean needs no host sync.  ``SKIP_BLOCK`` > 0 (rows compacted, counted
    ones first): rows from ``NumCounted`` (the chunk's count, a device-side int32) rounded up to a multiple of it on
    are not touched (the products skip them)."""
    row = tl.program_id(0)
    if SKIP_BLOCK > 0:
        if row >= tl.cdiv(tl.maximum(tl.load(NumCounted), 0), SKIP_BLOCK) * SKIP_BLOCK:
            return
    row_ptr = S + row.to(tl.int64) * stride_row
    tail_ptr = Tail + (row0 + row).to(tl.int64) * stride_tail
    offs = tl.arange(0, BLOCK_V)
    target = tl.load(Targets + row0 + row)
    if target == ignore_index:
        # nothing to read: the row's gradient is 0, or NaN where eager's would be (EPoison of the row + CPoison)
        poison = tl.load(EPoison + row0 + row) + tl.load(CPoison).to(tl.float32)
        fill = (poison + tl.zeros((BLOCK_V,), dtype=tl.float32)).to(S.dtype.element_ty)
        for v0 in range(0, stride_row, BLOCK_V):
            cols = v0 + offs
            tl.store(row_ptr + cols, fill, mask=cols < stride_row)
            if TAIL:
                tl.store(tail_ptr + (cols - split), fill, mask=(cols >= split) & (cols < V))
        tl.store(RowLoss + row0 + row, 0.0)
        return

    # pass 1: online log-sum-exp with one (max, sum) pair per *lane* of the block, reduced across lanes once after
    # the loop (no cross-warp reduction, with its barriers, inside the loop, where short rows would pay for it).
    # One exp per element: the larger of (z, m) becomes the lane's max and the smaller enters
    # as exp(smaller - larger).  evict_last: ask L2 to keep the row for pass 2.
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    z_sum = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = _load_z(row_ptr, tail_ptr, Bias, cols, mask, split, softcap, HAS_BIAS, HAS_SOFTCAP, TAIL, "evict_last")
        if LOGIT_SUM:
            z_sum += z  # 0 past V
        z = tl.where(mask, z, float("-inf"))  # columns past V add nothing to the sums
        above = z > m
        # a -inf logit adds 0 (also where the lane's max is still -inf, whose difference would be NaN); NaN and
        # +inf propagate to NaN as in eager
        smaller = tl.where(z == float("-inf"), 0.0, tl.exp(-tl.abs(z - m)))
        s = tl.where(above, s * smaller + 1.0, s + smaller)
        m = tl.maximum(m, z)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    z_sum = tl.sum(z_sum, axis=0)

    # the target's logit: one element of the row (targets outside [0, V) were refused by the op's check)
    safe_target = tl.minimum(tl.maximum(target, 0), V - 1)
    if TAIL:
        in_tail = safe_target >= split
        z_t = tl.where(
            in_tail,
            tl.load(tail_ptr + (safe_target - split), mask=in_tail, other=0.0),
            tl.load(row_ptr + safe_target, mask=safe_target < split, other=0.0),
        ).to(tl.float32)
    else:
        z_t = tl.load(row_ptr + safe_target).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(Bias + safe_target).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * tanh(z_t / softcap)
    row_loss = lse - target_weight * z_t
    if LOGIT_SUM:
        row_loss -= uniform * z_sum
    tl.store(RowLoss + row0 + row, row_loss)

    # pass 2: the gradient, in place (each program owns its row: no other program reads it)
    scale = tl.load(RowScale)
    for v0 in range(0, stride_row, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = _load_z(row_ptr, tail_ptr, Bias, cols, mask, split, softcap, HAS_BIAS, HAS_SOFTCAP, TAIL, "evict_first")
        offset = target_weight * (cols == target).to(tl.float32) + uniform
        g = softmax_grad(z, lse, 1.0, 0.0, 0.0, offset, softcap, HAS_SOFTCAP, False) * scale
        if ROUND_RNE:
            g = round_bf16_rne(g)
        g = tl.where(mask, g, 0.0).to(S.dtype.element_ty)  # the padding columns: 0 (dC's product reads them)
        tl.store(row_ptr + cols, g, mask=cols < stride_row)
        if TAIL:
            tl.store(tail_ptr + (cols - split), g, mask=mask & (cols >= split))


class LossAndGrads(NamedTuple):
    """The loss (fp32 scalar) and its gradients, each in its input's dtype: an fp32 gradient is the fp32 sum itself;
    a 16-bit one is the pair ``(hi, lo)`` (``_pair_sums``), ``hi`` the sum rounded once and ``lo`` the remainder (the
    backward rounds ``g * (hi + lo)`` once).  dbias is fp32.  A gradient not asked for is None (dbias also without a
    bias; a ``lo`` for an fp32 gradient)."""

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
    """``(hi, lo) (+)= grad^T @ e_rows (+ poison)`` (``_pair_sums``): the Triton product where the tensor-memory
    accelerator reads the operands, else in fp32 slabs of ``_FALLBACK_SLAB`` rows of the result.  ``num_counted`` /
    ``poison`` (rows compacted, which :func:`row_skipping_ok` allows only for operands the accelerator reads): the
    Triton product's device-side bound on the rows summed, and the poison it adds."""
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
            slab += lo[s0:s1].float()
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
    e,
    c,
    targets,
    bias,
    *,
    softcap,
    ignore_index,
    reduction,
    label_smoothing=0.0,
    chunk_rows,
    compute_dtype=None,
    need_e=True,
    need_c=True,
    need_bias=True,
    check_range=False,
    counted_prefix_rows=None,
    observe_counted=None,
    plain_sum=False,
) -> LossAndGrads:
    """Launch helper: :class:`LossAndGrads` of ``cross_entropy(softcap(e @ c.T + bias), targets)`` for reduction
    "mean" or "sum", ``chunk_rows`` rows at a time through one scratch of logits (module docstring).
    ``compute_dtype``: the dtype the products run in where it is not the inputs' (autocast: fp32 inputs, 16-bit
    products; the gradients stay in the inputs' dtypes).  ``counted_prefix_rows`` (where :func:`row_skipping_ok`):
    rows compacted (counted first), cuBLAS over that many of them, the row-skipping products past them (module
    docstring); None: cuBLAS over every row.  ``observe_counted``: called with the device-side count of counted rows
    and the rows (``cce_inductor/_counted_share.py``).  ``plain_sum``: a 16-bit dC is summed in its own dtype, one
    rounding a chunk, over at most ``PLAIN_SUM_MAX_CHUNKS`` chunks (``chunk_rows >= N / 2``; with a counted prefix
    the chunks are laid out so, ``_layout.balanced_chunks``), and returned without a remainder (``grad_c_lo``
    None); else as the pair (module docstring)."""
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
    # row_scale: 1 / #counted (inf when no row counts; then every row is ignored: G = 0) or 1
    num_counted, row_scale = _targets.count_targets(
        targets, ignore_index, mean=reduction == "mean", check_vocab=v if check_range else None
    )
    if observe_counted is not None:
        observe_counted(num_counted, n)

    pitch = triton.cdiv(v, ROW_ALIGN) * ROW_ALIGN  # whatever V is, no product sees an odd leading dimension
    split = v - v % ROW_ALIGN  # the vocabulary's aligned part; its tail (fewer than 64 entries) goes apart (below)
    e_pair, c_pair = _sixteen_bit(e.dtype), _sixteen_bit(c.dtype)
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
            e, c, targets, bias, grad_e, grad_e_lo, grad_c, grad_c_lo, grad_bias, row_loss, row_scale,
            softcap=softcap, ignore_index=ignore_index, label_smoothing=label_smoothing, dtype=dtype,
            rows_per_chunk=rows_per_chunk, pitch=pitch, split=split, tune=tune,
            counted_prefix_rows=counted_prefix_rows if compact else None, plain_sum=plain_sum,
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


def _plain_sum_into(out, a, b, *, accumulate: bool, upcast: bool) -> None:
    """``out (+)= a @ b`` in ``out``'s 16-bit dtype, one rounding: cuBLAS's epilogue adds ``out`` to the fp32
    product before it rounds (``beta = 1``); the interpreter's CPU path does the same in fp32."""
    if not upcast:
        _launch.product_into(out, a, b, accumulate=accumulate)
        return
    acc = a.float() @ b.float()
    if accumulate:
        acc += out.float()
    out.copy_(acc)


def _chunks(
    e, c, targets, bias, grad_e, grad_e_lo, grad_c, grad_c_lo, grad_bias, row_loss, row_scale, *,
    softcap, ignore_index, label_smoothing, dtype, rows_per_chunk, pitch, split, tune, counted_prefix_rows,
    plain_sum,
):  # fmt: skip
    """The row chunks of :func:`loss_and_grads` (module docstring), writing the gradients' buffers and ``row_loss``."""
    n, d = e.shape
    v = c.shape[0]
    device = e.device
    ops = _operands(e, c, bias, dtype)
    # eager's NaN pattern of ignored rows, computed once for every chunk (the row kernel adds the two)
    e_poison, c_poison = _launch.nonfinite_rows(ops.e), _launch.weight_poison(ops.c, ops.bias)
    prefix, layout = _layout.balanced_chunks(n, rows_per_chunk, counted_prefix_rows, plain_sum)
    compacted = None
    if counted_prefix_rows is not None:
        compacted = _Compacted.of(targets, ignore_index, e_poison, c_poison, prefix, n, rows_per_chunk)
        targets, e_poison = compacted.targets, compacted.e_poison
    scratch = torch.empty(rows_per_chunk * pitch, dtype=dtype, device=device)
    chunk_logits = scratch.view(rows_per_chunk, pitch)
    # a 16-bit dE is complete after its chunk: its fp32 rows are split into the pair there
    de_rows32 = torch.empty((rows_per_chunk, d), dtype=torch.float32, device=device) if grad_e_lo is not None else None
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
            if split:  # rounded to the products' dtype, as torch.compile's matmul rounds them
                torch.mm(e_rows, ops.c[:split].T, out=padded[:, :split])
            if chunk_tail and compacted is not None:
                torch.mm(e_rows, ops.c[split:].T, out=tail[r0 : r0 + rows, : v - split])
        _softmax_grad_in_place_kernel[(rows,)](
            padded,
            tail if chunk_tail else padded,
            ops.bias if ops.bias is not None else row_scale,
            targets,
            e_poison,
            c_poison,
            row_scale,
            row_loss,
            count if count is not None else row_scale,
            r0,
            v,
            split if chunk_tail else v,
            pitch,
            ROW_ALIGN,
            ignore_index,
            float(softcap) if softcap is not None else 1.0,
            1.0 - label_smoothing,
            label_smoothing / v,
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=softcap is not None,
            LOGIT_SUM=label_smoothing != 0.0,
            ROUND_RNE=_launch.INTERPRET and dtype == torch.bfloat16,
            TAIL=chunk_tail,
            SKIP_BLOCK=_products.skip_block() if count is not None else 0,
            BLOCK_V=block_v,
            num_warps=tune["num_warps"],
        )
        # the scratch now holds G, 0 past V.  dC before dE: dE's product overwrites the gathered rows of E
        if grad_c is not None:
            # compacted: every row's poison enters dC once, with the first chunk whose product can add it (the pair
            # product's; a plain sum's cuBLAS products cannot: its first chunk past the prefix)
            adds_poison = compacted is not None and (past_prefix == 1 and count is not None if plain_sum else i == 0)
            poison = compacted.dc_poison if adds_poison else None
            _dc_chunk(grad_c, grad_c_lo, padded, e_rows, ops, v, first=i == 0, count=count, poison=poison)
        if grad_e is not None:
            _de_chunk(grad_e, grad_e_lo, de_rows32, padded, ops, tail, v, split, r0, rows, count, compacted)
        if grad_bias is not None:
            grad = padded.float() if ops.upcast else padded
            grad_bias += grad[:, :v].sum(dim=0, dtype=torch.float32)


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
    else:
        _plain_sum_into(grad_c, padded.T, e_rows, accumulate=not first, upcast=ops.upcast)


def _de_chunk(grad_e, grad_e_lo, de_rows32, padded, ops: _Operands, tail, v, split, r0, rows, count, compacted):
    """The chunk's rows of dE, whole (the aligned part of V, then the tail's; past the prefix the counted rows' row
    blocks, the others their poison), put into the pair at their rows (compacted: their original rows) or, for an
    fp32 dE, written in place."""
    de_rows = de_rows32[:rows] if grad_e_lo is not None else grad_e[r0 : r0 + rows]
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
            _launch.product_into(de_rows, grad[:, :split], ops.c_mm[:split], accumulate=False, **ops.out_dtype)
        if tail is not None:
            grad_tail = tail[r0 : r0 + rows, : v - split]
            grad_tail = grad_tail.float() if ops.upcast else grad_tail
            _launch.product_into(de_rows, grad_tail, ops.c_mm[split:], accumulate=split > 0, **ops.out_dtype)
    if compacted is not None:
        _pair_sums.split_rows_into(de_rows, grad_e, grad_e_lo, compacted.row_order[r0 : r0 + rows])
    elif grad_e_lo is not None:
        _pair_sums.split_pair(de_rows, grad_e[r0 : r0 + rows], grad_e_lo[r0 : r0 + rows])
