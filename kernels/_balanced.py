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
                 row_scale = (1 / #counted (mean) | 1 (sum)) * g;  ignored rows: G = 0 (NaN where eager has NaN:
                 below); g: the upstream gradient the caller expects (``grad_scale``, else 1), carried by G before
                 its one rounding so that a 16-bit sum rounds as at g = 1
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
bits; or, with ``plain_sum``, a 16-bit dC is summed in its own dtype, one rounding a chunk (the first chunk cuBLAS's
``mm``; later ones the pair product without its ``lo``, which adds the chunk's fp32 product to the sum before it
rounds, where cuBLAS's 16-bit ``addmm`` may round the product first), at most ``_layout.PLAIN_SUM_MAX_CHUNKS``
chunks, the error budget's bound; past a counted prefix the row-skipping product, which adds the skipped rows'
poison too).
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

The launch helpers (``loss_and_grads`` and the chunk loop) are ``_balanced_launch``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tile import round_bf16_rne, softmax_grad, tanh

# One program streams one row in BLOCK_V columns; 16-byte vector loads of bf16 need BLOCK_V / (32 * num_warps) >= 8.
# Rows up to short_row entries take wider blocks (measured; the figures are in docs/).
_TUNING = {
    "gpu": dict(block_v=2048, num_warps=8, short_row=65536, short_row_block_v=4096),
    "interpret": dict(block_v=64, num_warps=4, short_row=0, short_row_block_v=64),
}


@triton.jit
def _load_z(
    row_ptr, tail_ptr,
    Bias,
    cols, mask, split, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TAIL: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
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
    S, Tail, Bias, Targets, EPoison, CPoison, RowScale, RowLoss, NumCounted,
    row0, V, split,
    stride_row, stride_tail,
    ignore_index, softcap, target_weight, uniform,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SUM: tl.constexpr, ROUND_RNE: tl.constexpr,
    TAIL: tl.constexpr, SKIP_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)`` of the chunk that starts at row ``row0``: reads its logits from ``S`` (columns from
    ``split`` on from ``Tail[row0 + row]`` where ``TAIL``), writes its loss (unscaled, 0 if ignored) to
    ``RowLoss[row0 + row]`` and overwrites the row of ``S`` with its scaled softmax gradient, 0 in its padding
    columns up to ``stride_row`` (and the tail's columns of ``Tail`` with theirs).  ``RowScale``: a one-element fp32
    device tensor (1 / #counted or 1, times the caller's ``grad_scale``), so the mean needs no host sync.
    ``SKIP_BLOCK`` > 0 (rows compacted, counted ones first): rows from ``NumCounted`` (the chunk's count, a
    device-side int32) rounded up to a multiple of it on are not touched (the products skip them)."""
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
