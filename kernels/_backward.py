"""Tile backward: dE, dC, dbias of the linear + (softcapped) cross-entropy without materialising logits,
skipping tiles below the gradient filter (paper sec. 4).  Without filtering ``backward`` hands over to
``_backward_dense`` (Triton recompute + cuBLAS products), which is faster, exact mode included; the tile kernel's
own exact mode (fp32 accumulation) remains reachable with kernel config ``bwd_dense=0``.

Math
----
With p = softmax(logits[n]), g_n = grad_rows[n] (already 0 at ignored rows) and the softcap chain factor
s[n, v] = 1 - tanh^2(raw[n, v] / softcap) = 1 - (logits[n, v] / softcap)^2 (s = 1 without softcap):

    G[n, v]  = g_n * (p[n, v] - [v == targets[n]]) * s[n, v]        (gradient w.r.t. the raw logits)
    dE       = G @ C,     dC = G^T @ E,     dbias = sum_n G[n, :]

Tile kernel: block / grid layout (paper Alg. 3, with pre-skipping)
-------------------------------------------------------------------
1-D grid of ``row_blocks * vocab_tiles`` programs, vocabulary-major (``GROUP > 0``: row blocks in groups of
GROUP), so the programs resident together work on the same C tile and E stays in L2.  Program (i, j) owns
compacted rows ``row_order[i*BLOCK_N:...]`` and vocabulary tile j (``vocab_order[j*BLOCK_V:...]`` when the
vocabulary is sorted).

1. Row block past the device-side ``num_valid`` -> return (ignored rows cost nothing).
2. Flat rows: a row whose largest probability is < 2**flat_row_log2 * filter_eps, or whose forward
   tail-mass estimate (mass in entries < eps relative to its peak) is > tail_frac_pct %, keeps its whole
   dE: its many tiny probabilities add up to a systematic part of dE that the filter would drop (e.g. 2%
   of dE on flat random logits at D=2304).  ``FILTER_E=0`` treats every row as flat.
3. Pre-skip (``PRE_SKIP``, unsorted vocabulary, no flat row in the block): the forward stored
   ``tile_max[i, j]``; since p[n, v] <= exp(tile_max - lse[n]), the tile is skipped *without recomputing
   it* when ``tile_max - min_n lse[n] < log(filter_eps)``.
4. Recompute the ``BLOCK_N x BLOCK_V`` logits (``_tile.logit_tile``), p = exp(logits - lse).  ``FILTER``:
   the tile is dropped when all its *off-target* p are < filter_eps (the target entries never prevent
   skipping: the target kernels handle them); a dropped tile still does the dE of its flat rows.
5. G = g * p * s on the off-target entries.  For each ``BLOCK_D`` chunk of D:
   ``dE[rows, d] += G @ C[vocab, d]`` and (kept tiles) ``dC[vocab, d] += G'^T @ E[rows, d]``, where G' also
   holds the tile's target entries g * (p_t - 1) * s_t (see below), with atomic adds in the output dtype
   (default) or into fp32 buffers (exact mode).  G is rounded to the input dtype for the tensor-core
   products; exact mode splits it into hi + lo halves (two products) so G keeps ~16 mantissa bits.
   dbias: fp32 atomics.

Target entries G[n, t_n] = g_n * (p_t - 1) * s_t
-----------------------------------------------
* dE / dbias: ``_target_row_kernel`` (grid N) recomputes the target logit by one fp32 D-dot and adds
  coef_n = G[n, t_n] once, *after* the tiles: the bf16 partial sums of the tiles carry only the small
  off-target mass, the large target term is rounded once, and p_t - 1 (confident rows) is formed in fp32.
* dC: a kept tile adds its target entries in-tile (for calibrated data the off-target and target parts of
  dC[v] cancel; interleaving them row block by row block keeps the bf16 partial sums small) and marks the
  rows done; for the other rows ``_target_scatter_kernel`` (grid N x D-chunks, over rows sorted by target)
  lets the first row of each run of equal targets sum ``coef * E[row]`` over the run in fp32 and add it to
  dC[t] once, so frequent targets pile up neither rounding errors nor atomics.

Measured on H200 (Gemma-2 shape, see examples/benchmark_notes.md): the dense regime is bound by the
tile recompute and the bf16 atomics (~2.4 MB of L2 traffic + 590 K atomic element-adds per kept tile).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _config
from ._backward_dense import backward_dense
from ._tile import logit_tile, no_target, tanh, target_raw_logit


@triton.jit
def _atomic_add_tile(ptrs, base_ptr, row_off, col0, value, mask_rows, D, stride_col,
                     PACKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``*ptrs += value`` for a (BLOCK_R, BLOCK_D) tile of the output (dtype of base_ptr).

    PACKED (16-bit outputs, contiguous D, even D): pairs of neighbouring columns are packed into one
    32-bit word and added with one ``red.global.add.noftz.{bf16x2|f16x2}``, half the atomic operations of
    ``tl.atomic_add`` (which issues one 16-bit reduction per element)."""
    if PACKED:
        value = value.to(base_ptr.dtype.element_ty)
        pairs = tl.reshape(value, (BLOCK_R, BLOCK_D // 2, 2))
        lo, hi = tl.split(pairs)
        word = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
        cols = col0 + 2 * tl.arange(0, BLOCK_D // 2)
        pair_ptrs = base_ptr + row_off[:, None] + cols[None, :]
        pair_mask = (mask_rows[:, None] & (cols[None, :] < D)).to(tl.uint32)
        if base_ptr.dtype.element_ty == tl.bfloat16:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p red.global.add.noftz.bf16x2 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,r", [pair_ptrs, word, pair_mask], dtype=tl.uint32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p red.global.add.noftz.f16x2 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,r", [pair_ptrs, word, pair_mask], dtype=tl.uint32, is_pure=False, pack=1)
    else:
        d_mask = (col0 + tl.arange(0, BLOCK_D)) < D
        tl.atomic_add(ptrs, value.to(base_ptr.dtype.element_ty), mask=mask_rows[:, None] & d_mask[None, :], sem="relaxed")


@triton.jit
def _split_operand(grad, dtype, UPCAST: tl.constexpr):
    """(hi, lo) 16-bit halves of an fp32 tile for tensor-core products (lo only used in exact mode)."""
    if UPCAST:  # interpreter: fp32 operands
        return grad, grad
    hi = grad.to(dtype)
    return hi, (grad - hi.to(tl.float32)).to(dtype)


@triton.jit
def _tile_grad_kernel(
    E, C, Bias, Targets, RowOrder, NumValid, Lse, GradRows, VocabOrder, TileMax, RowMax, TailFrac, TargetDone,
    DE, DC, DBias,
    N, V, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    stride_den, stride_ded, stride_dcv, stride_dcd,
    num_row_blocks, num_vocab_tiles,
    softcap, filter_eps, log_filter_eps, log_flat_prob, max_tail_frac,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PRE_SKIP: tl.constexpr, FILTER: tl.constexpr, FILTER_E: tl.constexpr, SORTED_VOCAB: tl.constexpr,
    NEED_E: tl.constexpr, NEED_C: tl.constexpr, NEED_BIAS: tl.constexpr,
    SPLIT_G: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    GROUP: tl.constexpr, PACKED: tl.constexpr,
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
    # "flat" rows (largest probability tiny, or much of the mass in a flat tail of sub-eps entries): the
    # filter would drop a real part of their dE, so their dE is never filtered; FILTER_E=0: every row.
    if FILTER:
        if FILTER_E:
            row_max = tl.load(RowMax + rows, mask=row_mask, other=float("-inf"))
            tail = tl.load(TailFrac + rows, mask=row_mask, other=0.0)
            flat = ((row_max - lse < log_flat_prob) | (tail > max_tail_frac)) & row_mask
        else:
            flat = row_mask
    else:
        flat = row_mask
    any_flat = tl.max(flat.to(tl.int32), axis=0)
    if PRE_SKIP:
        tile_max = tl.load(TileMax + row_block.to(tl.int64) * num_vocab_tiles + vocab_tile)
        if tile_max - tl.min(lse, axis=0) < log_filter_eps:
            if any_flat == 0:
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
    target = tl.load(Targets + rows, mask=row_mask, other=-1)
    in_tile = row_mask[:, None] & col_mask[None, :]
    is_target = in_tile & (vocab_ids[None, :] == target[:, None])
    prob = tl.where(in_tile, tl.exp(logits - lse[:, None]), 0.0)
    off_target_prob = tl.where(is_target, 0.0, prob)
    if FILTER:
        keep = (tl.max(tl.max(off_target_prob, axis=1), axis=0) >= filter_eps).to(tl.int32)
        if keep == 0:
            if any_flat == 0:
                return
    else:
        keep = 1

    grad_rows = tl.load(GradRows + rows, mask=row_mask, other=0.0)
    chain = 1.0
    if HAS_SOFTCAP:
        capped = logits / softcap
        chain = 1.0 - capped * capped
    # off-target part of G (the target entry of dE is added by _target_row_kernel, once, after the tiles)
    grad = grad_rows[:, None] * off_target_prob * chain
    if NEED_BIAS:
        if keep != 0:
            tl.atomic_add(DBias + vocab_ids, tl.sum(grad, axis=0), mask=col_mask, sem="relaxed")
    # target entry of each row in this tile, g * (p_t - 1) * s_t (0 where the target is elsewhere)
    target_term = tl.sum(tl.where(is_target, grad_rows[:, None] * (prob - 1.0) * chain, 0.0), axis=1)
    has_target = tl.max(is_target.to(tl.int32), axis=1) > 0
    # dE: every row of a kept tile, only the flat rows of a dropped one
    take = (flat.to(tl.int32) + keep) > 0
    ge_hi, ge_lo = _split_operand(tl.where(take[:, None], grad, 0.0), E.dtype.element_ty, UPCAST)

    offs_d = tl.arange(0, BLOCK_D)
    if NEED_E:
        c_ptrs = C + vocab_ids[:, None] * stride_cv + offs_d[None, :] * stride_cd
        de_ptrs = DE + rows[:, None] * stride_den + offs_d[None, :] * stride_ded
        for d0 in range(0, D, BLOCK_D):
            if EVEN_D:
                c_blk = tl.load(c_ptrs)
            else:
                c_blk = tl.load(c_ptrs, mask=((d0 + offs_d) < D)[None, :], other=0.0)
            if UPCAST:
                c_blk = c_blk.to(tl.float32)
            de = tl.dot(ge_hi, c_blk, input_precision=DOT_PRECISION)
            if SPLIT_G:
                de = tl.dot(ge_lo, c_blk, de, input_precision=DOT_PRECISION)
            _atomic_add_tile(de_ptrs, DE, rows * stride_den, d0, de, row_mask & take, D, stride_ded, PACKED,
                             BLOCK_N, BLOCK_D)
            c_ptrs += BLOCK_D * stride_cd
            de_ptrs += BLOCK_D * stride_ded
    if NEED_C:
        if keep != 0:
            # dC takes the target entries of a kept tile in-tile: for calibrated data the off-target and
            # target parts of dC[v] cancel, and interleaving them row block by row block keeps the bf16
            # partial sums small.  Rows whose target tile is dropped stay not-done and get their target
            # entry from _target_scatter_kernel.  (A kept tile has take == all rows, so G_e == G there.)
            tl.store(TargetDone + rows, tl.full((BLOCK_N,), 1, dtype=tl.int32), mask=has_target)
            gc = ge_hi.to(tl.float32) + tl.where(is_target, target_term[:, None], 0.0)
            if SPLIT_G:
                gc += ge_lo.to(tl.float32)
            gc_hi, gc_lo = _split_operand(gc, E.dtype.element_ty, UPCAST)
            e_ptrs = E + rows[:, None] * stride_en + offs_d[None, :] * stride_ed
            dc_ptrs = DC + vocab_ids[:, None] * stride_dcv + offs_d[None, :] * stride_dcd
            for d0 in range(0, D, BLOCK_D):
                if EVEN_D:
                    e_blk = tl.load(e_ptrs)
                else:
                    e_blk = tl.load(e_ptrs, mask=((d0 + offs_d) < D)[None, :], other=0.0)
                if UPCAST:
                    e_blk = e_blk.to(tl.float32)
                dc = tl.dot(tl.trans(gc_hi), e_blk, input_precision=DOT_PRECISION)
                if SPLIT_G:
                    dc = tl.dot(tl.trans(gc_lo), e_blk, dc, input_precision=DOT_PRECISION)
                _atomic_add_tile(dc_ptrs, DC, vocab_ids * stride_dcv, d0, dc, col_mask, D, stride_dcd, PACKED,
                                 BLOCK_V, BLOCK_D)
                e_ptrs += BLOCK_D * stride_ed
                dc_ptrs += BLOCK_D * stride_dcd


@triton.jit
def _target_row_kernel(
    E, C, Bias, Targets, GradRows, Lse, Coef, DE, DBias,
    V, D, stride_en, stride_ed, stride_cv, stride_cd, stride_den, stride_ded,
    ignore_index, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_E: tl.constexpr, NEED_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row n: coef_n = g_n * (p_t - 1) * s_t with the target logit recomputed in fp32,
    then dE[n] += coef_n * C[t_n] (after the tile kernel: one rounding) and dbias[t_n] += coef_n."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Targets + row)
    if no_target(target, ignore_index, V):
        tl.store(Coef + row, 0.0)
        return
    target = target.to(tl.int64)
    grad_row = tl.load(GradRows + row)
    logit = target_raw_logit(E, C, Bias, row, target, D, stride_en, stride_ed, stride_cv, stride_cd,
                             HAS_BIAS, BLOCK_D)
    chain = 1.0
    if HAS_SOFTCAP:
        capped = tanh(logit / softcap)
        logit = softcap * capped
        chain = 1.0 - capped * capped
    prob = tl.exp(logit - tl.load(Lse + row))
    coef = grad_row * (prob - 1.0) * chain
    tl.store(Coef + row, coef)
    if NEED_BIAS:
        tl.atomic_add(DBias + target, coef, sem="relaxed")
    if NEED_E:
        offs_d = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d_mask = (d0 + offs_d) < D
            c_val = tl.load(C + target * stride_cv + (d0 + offs_d) * stride_cd, mask=d_mask, other=0.0).to(tl.float32)
            de_ptrs = DE + row * stride_den + (d0 + offs_d) * stride_ded
            de_val = tl.load(de_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            tl.store(de_ptrs, (de_val + coef * c_val).to(DE.dtype.element_ty), mask=d_mask)


@triton.jit
def _target_scatter_kernel(
    E, SortedTargets, SortedRows, Coef, TargetDone, DC,
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
        if tl.load(TargetDone + row) != 0:  # its kept target tile already added it to dC
            coef = 0.0
        if coef != 0.0:
            acc += coef * tl.load(E + row * stride_en + offs_d * stride_ed, mask=d_mask, other=0.0).to(tl.float32)
        j += 1
        key_j = tl.load(SortedTargets + j, mask=j < N, other=-1)
    dc_ptrs = DC + key.to(tl.int64) * stride_dcv + offs_d * stride_dcd
    dc_val = tl.load(dc_ptrs, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(dc_ptrs, (dc_val + acc).to(DC.dtype.element_ty), mask=d_mask)


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
    vocab_sort = vocab_sort and filtering  # the order only matters for skipping
    if filtering and aux.numel() < 2 * n:
        raise ValueError("filter_eps > 0 needs the forward's summaries: call forward(..., summaries=True)")
    if not filtering and cfg["bwd_dense"]:
        counted = (targets != ignore_index if row_compaction is None
                   else _config.counted_mask(n, row_compaction, device))  # fmt: skip
        return backward_dense(e, c, targets, bias, lse, grad_rows, counted, softcap=softcap, need_e=need_e,
                              need_c=need_c, need_bias=need_bias, exact=exact)
    filter_e = bool(cfg["bwd_filter_e"])  # 0: dE takes every tile (dense), only dC/dbias are filtered
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
    row_max, tail_frac, summary = aux[:n], aux[n:2 * n], aux[2 * n:]
    vocab_order = torch.argsort(summary, descending=True) if vocab_sort else None
    target_done = torch.zeros((n,), dtype=torch.int32, device=device) if need_c else num_valid
    grad_rows = grad_rows.to(torch.float32).contiguous()
    upcast = _config.INTERPRET and e.dtype != torch.float32
    precision = _config.dot_precision(e.dtype)
    softcap_val = float(softcap) if softcap is not None else 1.0

    _tile_grad_kernel[(row_blocks * vocab_tiles,)](
        e, c, bias if bias is not None else e, targets, row_order, num_valid, lse, grad_rows,
        vocab_order if vocab_sort else row_order, summary, row_max, tail_frac, target_done,
        de_arg, dc_arg, dbias32 if need_bias else dummy,
        n, v, d,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1),
        de_strides[0], de_strides[1], dc_strides[0], dc_strides[1],
        row_blocks, vocab_tiles,
        softcap_val, float(filter_eps), math.log(filter_eps) if filtering else float("-inf"),
        math.log(filter_eps * 2.0 ** cfg["flat_row_log2"]) if filtering else float("-inf"),
        cfg["tail_frac_pct"] / 100.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        PRE_SKIP=filtering and filter_e and not vocab_sort, FILTER=filtering, FILTER_E=filter_e,
        SORTED_VOCAB=vocab_sort,
        NEED_E=need_e, NEED_C=need_c, NEED_BIAS=need_bias,
        SPLIT_G=exact and e.dtype != torch.float32 and not upcast, UPCAST=upcast, DOT_PRECISION=precision,
        EVEN_D=(d % block_d == 0), GROUP=cfg["bwd_group"],
        PACKED=(cfg["bwd_packed"] and not accum_fp32 and not _config.INTERPRET and d % 2 == 0
                and (not need_e or de_strides[1] == 1) and (not need_c or dc_strides[1] == 1)),
        BLOCK_N=tile_n, BLOCK_V=tile_v, BLOCK_D=block_d,
        num_warps=cfg["bwd_num_warps"], num_stages=cfg["bwd_num_stages"],
    )

    # target entries: dE / dbias always here, once, after the tiles; dC for rows whose target tile
    # was dropped (not marked in target_done)
    if True:
        coef = torch.empty((n,), dtype=torch.float32, device=device)
        row_block_d = min(1024, triton.next_power_of_2(d))
        _target_row_kernel[(n,)](
            e, c, bias if bias is not None else e, targets, grad_rows, lse, coef,
            de_arg, dbias32 if need_bias else dummy,
            v, d, e.stride(0), e.stride(1), c.stride(0), c.stride(1), de_strides[0], de_strides[1],
            ignore_index, softcap_val,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, NEED_E=need_e, NEED_BIAS=need_bias,
            BLOCK_D=row_block_d, num_warps=4,
        )
        if need_c:
            targetless = (targets == ignore_index) | (targets < 0) | (targets >= v)
            keys = torch.where(targetless, torch.full_like(targets, v), targets)
            sorted_targets, sorted_rows = torch.sort(keys)
            scatter_block_d = min(256, triton.next_power_of_2(d))
            _target_scatter_kernel[(n, triton.cdiv(d, scatter_block_d))](
                e, sorted_targets, sorted_rows, coef, target_done, dc_arg,
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
