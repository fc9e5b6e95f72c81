"""Backward: dE, dC, dbias of the linear + (softcapped) cross-entropy without materialising logits.

Math
----
With p = softmax(logits[n]), g_n = grad_rows[n] (already 0 at ignored rows) and the softcap chain factor
s[n, v] = 1 - tanh^2(raw[n, v] / softcap) = 1 - (logits[n, v] / softcap)^2 (s = 1 without softcap):

    G[n, v]  = g_n * (p[n, v] - [v == targets[n]]) * s[n, v]        (gradient w.r.t. the raw logits)
    dE       = G @ C,     dC = G^T @ E,     dbias = sum_n G[n, :]

Dense kernel: block / grid layout (paper Alg. 3, with pre-skipping)
-------------------------------------------------------------------
1-D grid of ``row_blocks * vocab_tiles`` programs, vocabulary-major (the programs resident together work
on the same C tile, E stays in L2).  Program (i, j) owns compacted rows ``row_order[i*BLOCK_N:...]`` and
vocabulary tile j (``vocab_order[j*BLOCK_V:...]`` when the vocabulary is sorted).

1. Row block past the device-side ``num_valid`` -> return (ignored rows cost nothing).
2. Pre-skip (``PRE_SKIP``, unsorted vocabulary): the forward stored ``tile_max[i, j]``; since
   p[n, v] <= exp(tile_max - lse[n]), the tile is skipped *without recomputing it* when
   ``tile_max - min_n lse[n] < log(filter_eps)``.
3. Recompute the ``BLOCK_N x BLOCK_V`` logits (``_tile.logit_tile``) and p = exp(logits - lse).
   ``FILTER``: skip when max p < filter_eps.  The one-hot term does *not* prevent skipping: targets
   inside a skipped tile are handled by the target kernels below.  A kept tile marks its rows'
   targets as done (``TargetDone[row] = 1``) and computes G with the one-hot term in fp32, so the
   cancellation p_t - 1 for confident rows happens in fp32.
4. For each ``BLOCK_D`` chunk of D: ``dE[rows, d] += G @ C[vocab, d]`` and ``dC[vocab, d] += G^T @ E[rows, d]``
   with atomic adds in the output dtype (default) or into fp32 buffers (exact mode).  G is rounded to
   the input dtype for the tensor-core products; exact mode splits it into hi + lo halves (two products)
   so G keeps ~16 mantissa bits.  dbias: atomic fp32 adds of the column sums of G.

Target kernels (only when tiles can be skipped)
-----------------------------------------------
For valid rows whose target tile was skipped, p_t < filter_eps was dropped, so the whole target term is
``-g_n * s_n`` at v = t_n:
* ``_target_row_kernel`` (grid N): coef_n = g_n * s_n (s_n needs the raw target logit, one D-dot),
  ``dE[n] -= coef_n * C[t_n]``, ``dbias[t_n] -= coef_n``.
* ``_target_scatter_kernel`` (grid N x D-chunks, over rows sorted by target): the first row of each
  run of equal targets sums ``coef * E[row]`` over the run in fp32 and does ``dC[t] -= sum`` once, so
  frequent targets do not pile up rounding errors nor atomics.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _config
from ._tile import logit_tile, tanh


@triton.jit
def _dense_grad_kernel(
    E, C, Bias, Targets, RowOrder, NumValid, Lse, GradRows, VocabOrder, TileMax, TargetDone,
    DE, DC, DBias,
    N, V, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    stride_den, stride_ded, stride_dcv, stride_dcd,
    num_row_blocks, num_vocab_tiles,
    softcap, filter_eps, log_filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PRE_SKIP: tl.constexpr, FILTER: tl.constexpr, SORTED_VOCAB: tl.constexpr,
    NEED_E: tl.constexpr, NEED_C: tl.constexpr, NEED_BIAS: tl.constexpr,
    SPLIT_G: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    if GROUP > 0:
        # row blocks in groups of GROUP; inside a group, vocab tiles vary slowest
        per_group = GROUP * num_vocab_tiles
        group_id = pid // per_group
        first_rb = group_id * GROUP
        group_size = tl.minimum(num_row_blocks - first_rb, GROUP)
        row_block = first_rb + (pid % per_group) % group_size
        vocab_tile = (pid % per_group) // group_size
    else:
        row_block = pid % num_row_blocks
        vocab_tile = pid // num_row_blocks
    num_valid = tl.load(NumValid)
    if row_block * BLOCK_N >= num_valid:
        return

    pos = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = pos < num_valid
    rows = tl.load(RowOrder + pos, mask=row_mask, other=0).to(tl.int64)
    lse = tl.load(Lse + rows, mask=row_mask, other=float("inf"))
    if PRE_SKIP:
        tile_max = tl.load(TileMax + row_block.to(tl.int64) * num_vocab_tiles + vocab_tile)
        if tile_max - tl.min(lse, axis=0) < log_filter_eps:
            return

    cols = vocab_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    if SORTED_VOCAB:
        vocab_ids = tl.load(VocabOrder + cols, mask=col_mask, other=0).to(tl.int64)
    else:
        vocab_ids = tl.minimum(cols, V - 1).to(tl.int64)
    logits = logit_tile(
        E, C, Bias, rows, vocab_ids, D, stride_en, stride_ed, stride_cv, stride_cd, softcap,
        HAS_BIAS, HAS_SOFTCAP, UPCAST, DOT_PRECISION, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
    )
    tile_mask = row_mask[:, None] & col_mask[None, :]
    prob = tl.where(tile_mask, tl.exp(logits - lse[:, None]), 0.0)
    if FILTER:
        if tl.max(tl.max(prob, axis=1), axis=0) < filter_eps:
            return

    target = tl.load(Targets + rows, mask=row_mask, other=-1)
    is_target = (vocab_ids[None, :] == target[:, None]) & tile_mask
    if FILTER:
        has_target = tl.max(is_target.to(tl.int32), axis=1) > 0
        tl.store(TargetDone + rows, tl.full((BLOCK_N,), 1, dtype=tl.int32), mask=has_target & row_mask)
    grad_rows = tl.load(GradRows + rows, mask=row_mask, other=0.0)
    grad = grad_rows[:, None] * (prob - is_target.to(tl.float32))
    if HAS_SOFTCAP:
        capped = logits / softcap
        grad = grad * (1.0 - capped * capped)
    grad = tl.where(tile_mask, grad, 0.0)

    if NEED_BIAS:
        tl.atomic_add(DBias + vocab_ids, tl.sum(grad, axis=0), mask=col_mask, sem="relaxed")

    if UPCAST:  # interpreter: fp32 operands, no split needed
        grad_hi = grad
        grad_lo = grad
    else:
        grad_hi = grad.to(E.dtype.element_ty)
        grad_lo = (grad - grad_hi.to(tl.float32)).to(E.dtype.element_ty)

    offs_d = tl.arange(0, BLOCK_D)
    e_ptrs = E + rows[:, None] * stride_en + offs_d[None, :] * stride_ed
    c_ptrs = C + vocab_ids[:, None] * stride_cv + offs_d[None, :] * stride_cd
    de_ptrs = DE + rows[:, None] * stride_den + offs_d[None, :] * stride_ded
    dc_ptrs = DC + vocab_ids[:, None] * stride_dcv + offs_d[None, :] * stride_dcd
    for d0 in range(0, D, BLOCK_D):
        d_mask = (d0 + offs_d) < D
        if NEED_E:
            if EVEN_D:
                c_blk = tl.load(c_ptrs)
            else:
                c_blk = tl.load(c_ptrs, mask=d_mask[None, :], other=0.0)
            if UPCAST:
                c_blk = c_blk.to(tl.float32)
            de = tl.dot(grad_hi, c_blk, input_precision=DOT_PRECISION)
            if SPLIT_G:
                de = tl.dot(grad_lo, c_blk, de, input_precision=DOT_PRECISION)
            tl.atomic_add(de_ptrs, de.to(DE.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :], sem="relaxed")
        if NEED_C:
            if EVEN_D:
                e_blk = tl.load(e_ptrs)
            else:
                e_blk = tl.load(e_ptrs, mask=d_mask[None, :], other=0.0)
            if UPCAST:
                e_blk = e_blk.to(tl.float32)
            dc = tl.dot(tl.trans(grad_hi), e_blk, input_precision=DOT_PRECISION)
            if SPLIT_G:
                dc = tl.dot(tl.trans(grad_lo), e_blk, dc, input_precision=DOT_PRECISION)
            tl.atomic_add(dc_ptrs, dc.to(DC.dtype.element_ty), mask=col_mask[:, None] & d_mask[None, :], sem="relaxed")
        e_ptrs += BLOCK_D * stride_ed
        c_ptrs += BLOCK_D * stride_cd
        de_ptrs += BLOCK_D * stride_ded
        dc_ptrs += BLOCK_D * stride_dcd


@triton.jit
def _target_row_kernel(
    E, C, Bias, Targets, GradRows, TargetDone, Coef, DE, DBias,
    D, stride_en, stride_ed, stride_cv, stride_cd, stride_den, stride_ded,
    ignore_index, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_E: tl.constexpr, NEED_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Targets + row)
    grad_row = tl.load(GradRows + row)
    done = tl.load(TargetDone + row)
    if (target == ignore_index) | (done != 0):
        tl.store(Coef + row, 0.0)
        return
    target = target.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    coef = grad_row
    if HAS_SOFTCAP:
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_mask = (d0 + offs_d) < D
            e_val = tl.load(E + row * stride_en + (d0 + offs_d) * stride_ed, mask=d_mask, other=0.0).to(tl.float32)
            c_val = tl.load(C + target * stride_cv + (d0 + offs_d) * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
            dot += e_val * c_val
        raw = tl.sum(dot, axis=0)
        if HAS_BIAS:
            raw += tl.load(Bias + target).to(tl.float32)
        capped = tanh(raw / softcap)
        coef = grad_row * (1.0 - capped * capped)
    tl.store(Coef + row, coef)
    if NEED_BIAS:
        tl.atomic_add(DBias + target, -coef, sem="relaxed")
    if NEED_E:
        for d0 in range(0, D, BLOCK_D):
            d_mask = (d0 + offs_d) < D
            c_val = tl.load(C + target * stride_cv + (d0 + offs_d) * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
            de_ptrs = DE + row * stride_den + (d0 + offs_d) * stride_ded
            de_val = tl.load(de_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            tl.store(de_ptrs, (de_val - coef * c_val).to(DE.dtype.element_ty), mask=d_mask)


@triton.jit
def _target_scatter_kernel(
    E, SortedTargets, SortedRows, Coef, DC,
    N, V, D, stride_en, stride_ed, stride_dcv, stride_dcd,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    d_blk = tl.program_id(1)
    key = tl.load(SortedTargets + i)
    if key >= V:  # ignored rows are sorted last with key V
        return
    if i > 0:
        if tl.load(SortedTargets + i - 1) == key:
            return
    offs_d = d_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    j = i
    key_j = key
    while key_j == key:
        row = tl.load(SortedRows + j).to(tl.int64)
        coef = tl.load(Coef + row)
        if coef != 0.0:
            acc += coef * tl.load(E + row * stride_en + offs_d * stride_ed, mask=d_mask, other=0.0).to(tl.float32)
        j += 1
        key_j = tl.load(SortedTargets + j, mask=j < N, other=-1)
    dc_ptrs = DC + key.to(tl.int64) * stride_dcv + offs_d * stride_dcd
    dc_val = tl.load(dc_ptrs, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(dc_ptrs, (dc_val - acc).to(DC.dtype.element_ty), mask=d_mask)


def backward(e, c, targets, bias, lse, aux, grad_rows, *, softcap, ignore_index, filter_eps, vocab_sort,
             exact, need_e, need_c, need_bias, row_compaction=None):
    """Launch helper; see package docstring for the contract."""
    cfg = _config.CONFIG
    n, d = e.shape
    v = c.shape[0]
    device = e.device
    need_bias = need_bias and bias is not None
    if exact:
        filter_eps = 0.0
    filtering = filter_eps > 0.0
    # bf16 atomics do not exist in the interpreter; exact mode accumulates in fp32.
    accum_fp32 = exact or (_config.INTERPRET and e.dtype == torch.bfloat16)

    de_out = torch.zeros((n, d), dtype=e.dtype, device=device) if need_e else None
    dc_out = torch.zeros((v, d), dtype=c.dtype, device=device) if need_c else None
    dbias32 = torch.zeros((v,), dtype=torch.float32, device=device) if need_bias else None
    if n == 0 or not (need_e or need_c or need_bias):
        return de_out, dc_out, (dbias32.to(bias.dtype) if need_bias else None)

    if accum_fp32:
        de_acc = torch.zeros((n, d), dtype=torch.float32, device=device) if need_e else None
        dc_acc = torch.zeros((v, d), dtype=torch.float32, device=device) if need_c else None
    else:
        de_acc, dc_acc = de_out, dc_out
    dummy = lse
    de_arg = de_acc if need_e else dummy
    dc_arg = dc_acc if need_c else dummy
    de_strides = de_acc.stride() if need_e else (0, 0)
    dc_strides = dc_acc.stride() if need_c else (0, 0)

    row_order, num_valid = row_compaction if row_compaction is not None else _config.compact_rows(targets, ignore_index)
    tile_n, tile_v = cfg["tile_n"], cfg["tile_v"]
    block_d = cfg["bwd_block_d"]
    row_blocks = triton.cdiv(n, tile_n)
    vocab_tiles = triton.cdiv(v, tile_v)
    vocab_order = torch.argsort(aux, descending=True) if vocab_sort else None
    target_done = torch.zeros((n,), dtype=torch.int32, device=device) if filtering else None
    grad_rows = grad_rows.to(torch.float32).contiguous()
    upcast = _config.INTERPRET and e.dtype != torch.float32
    precision = _config.dot_precision(e.dtype)
    softcap_val = float(softcap) if softcap is not None else 1.0

    _dense_grad_kernel[(row_blocks * vocab_tiles,)](
        e, c, bias if bias is not None else e, targets, row_order, num_valid, lse, grad_rows,
        vocab_order if vocab_sort else row_order, aux, target_done if filtering else num_valid,
        de_arg, dc_arg, dbias32 if need_bias else dummy,
        n, v, d,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1),
        de_strides[0], de_strides[1], dc_strides[0], dc_strides[1],
        row_blocks, vocab_tiles,
        softcap_val, float(filter_eps), math.log(filter_eps) if filtering else float("-inf"),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        PRE_SKIP=filtering and not vocab_sort, FILTER=filtering, SORTED_VOCAB=vocab_sort,
        NEED_E=need_e, NEED_C=need_c, NEED_BIAS=need_bias,
        SPLIT_G=exact and e.dtype != torch.float32 and not upcast, UPCAST=upcast, DOT_PRECISION=precision,
        EVEN_D=(d % block_d == 0), GROUP=cfg["bwd_group"],
        BLOCK_N=tile_n, BLOCK_V=tile_v, BLOCK_D=block_d,
        num_warps=cfg["bwd_num_warps"], num_stages=cfg["bwd_num_stages"],
    )

    if filtering:
        coef = torch.empty((n,), dtype=torch.float32, device=device)
        row_block_d = min(1024, triton.next_power_of_2(d))
        _target_row_kernel[(n,)](
            e, c, bias if bias is not None else e, targets, grad_rows, target_done, coef,
            de_arg, dbias32 if need_bias else dummy,
            d, e.stride(0), e.stride(1), c.stride(0), c.stride(1), de_strides[0], de_strides[1],
            ignore_index, softcap_val,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, NEED_E=need_e, NEED_BIAS=need_bias,
            BLOCK_D=row_block_d, num_warps=4,
        )
        if need_c:
            keys = torch.where(targets == ignore_index, torch.full_like(targets, v), targets)
            sorted_targets, sorted_rows = torch.sort(keys)
            scatter_block_d = min(256, triton.next_power_of_2(d))
            _target_scatter_kernel[(n, triton.cdiv(d, scatter_block_d))](
                e, sorted_targets, sorted_rows, coef, dc_arg,
                n, v, d, e.stride(0), e.stride(1), dc_strides[0], dc_strides[1],
                BLOCK_D=scatter_block_d, num_warps=2,
            )

    if accum_fp32:
        if need_e:
            de_out.copy_(de_acc)
            del de_acc
        if need_c:
            dc_out.copy_(dc_acc)
            del dc_acc
    dbias = dbias32.to(bias.dtype) if need_bias else None
    return de_out, dc_out, dbias
