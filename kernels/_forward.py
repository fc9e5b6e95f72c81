"""Forward: log-sum-exp and target logit of ``logits = softcap(E @ C^T + bias)`` without materialising it.

Math
----
For every row n that counts (targets[n] != ignore_index)

    lse[n]          = log sum_v exp(logits[n, v])
    target_logit[n] = logits[n, targets[n]]        (0 when targets[n] is outside [0, V): a vocabulary shard
                                                    sees the targets other shards hold that way)
    logit_sum[n]    = sum_v logits[n, v]           (only with LOGIT_SUM: the label-smoothing term)
    mean_logit[n]   = sum_v softmax[n, v] logits[n, v]   (only with MEAN_LOGIT: entropy[n] = lse[n] - mean_logit[n])
    argmax[n]       = argmax_v round(logits[n, v])  (only with ARGMAX: torch.argmax's ties -- the first maximal
                                                    index, a NaN larger than everything -- over the logits rounded
                                                    to the dtype eager's logits have, ROUND)

Block / grid layout (flash-decoding style)
------------------------------------------
``grid = (row_blocks, vocab_splits)``.  Program (i, s) owns the compacted rows
``row_order[i*BLOCK_N : (i+1)*BLOCK_N]`` and the vocabulary range of split s, which it walks in
``BLOCK_V`` steps.  Each step computes one ``BLOCK_N x BLOCK_V`` logit tile (loop over ``BLOCK_D``
chunks of D, see ``_tile.logit_tile``) and folds it into a running (max, sum-of-exp) pair per row held in
registers (with MEAN_LOGIT also the running sum of ``exp(logit - max) * logit``, rescaled with the sum of exps).
When ``V % BLOCK_V == 0`` (``EVEN_V``) the tiles carry no column mask.  Program order
is row-block fastest, so the programs resident at one time share the same split of C and C is streamed
from HBM about once while E (small) stays in L2.  Row blocks past the device-side count of counted rows
return at once, so ignored rows cost nothing.  For 16-bit inputs the operand tiles come through the tensor-memory
accelerator (``_tile``, ``tma_operands``) from a compacted copy of E (the counted rows first, ``N x D``, built per
call) and from C: less forward time than per-thread ``cp.async`` loads (measured; the figures are in docs/).

The target logit is not picked out of the tiles: comparing every column of a tile with the row's target kept a
tile-sized mask live beside the accumulator, and the kernel spilled registers on Hopper (none without it).
``_target_logit_kernel`` (grid ``cdiv(N, 16)``) computes it as one dot product ``E[n] . C[targets[n]]`` per row
(+ bias, softcap), fp32 sums of exact bf16 products: N * D reads, small beside the tiles' N * V * D.  The lean
backward uses the same kernel (``target_logits``) for the one-hot entries of its gradient.

Each program writes its partial ``(max, sumexp[, logit_sum][, zexp][, best, best_index])`` for its rows into
``(splits, N)`` fp32 buffers (int32 for the index); ``_combine_kernel`` (grid ``cdiv(N, BLOCK)``) merges the splits
(the argmax: a strictly larger best, so the earlier split wins a tie):
``lse = m + log(sum_s sumexp_s * exp(max_s - m))``, ``mean_logit = sum_s zexp_s * exp(max_s - m) / sum_s sumexp_s *
exp(max_s - m)``.  Ignored rows get lse = target_logit = logit_sum = mean_logit = 0.

Memory: the partial buffers, ``(2 to 4) * splits * N * 4`` bytes (a few MB), and with TMA the compacted copy of E
(``N x D``, freed on return), far below the logit matrix.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _launch
from ._tile import logit_tile, round_to_tf32, tanh

# Hopper; the interpreter's tiny blocks keep the CPU tests fast.
_TUNING = {
    "gpu": dict(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, waves=16, tma=True),
    "interpret": dict(block_n=16, block_v=64, block_d=16, num_warps=4, num_stages=1, waves=2, tma=True),
}
# _target_logit_kernel's rows and D step per program.
_TARGET_TUNING = {"gpu": dict(rows=16, block_d=256), "interpret": dict(rows=16, block_d=32)}


@triton.jit
def _lse_forward_kernel(
    E, C, Bias, RowOrder, NumValid, PartMax, PartSum, PartLogitSum, PartZExp, PartBest, PartBestIndex,
    N, V, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    vblocks_per_split, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SUM: tl.constexpr, MEAN_LOGIT: tl.constexpr,
    TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr, EVEN_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, ARGMAX: tl.constexpr = False,
    ROUND: tl.constexpr = 0,
):  # fmt: skip
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    num_valid = tl.load(NumValid)
    if row_block * BLOCK_N >= num_valid:
        return

    pos = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = pos < num_valid
    rows = tl.load(RowOrder + pos, mask=row_mask, other=0).to(tl.int64)

    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    run_zexp = tl.zeros((BLOCK_N,), dtype=tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    best_index = tl.zeros((BLOCK_N,), dtype=tl.int32)

    vb_start = split * vblocks_per_split
    vb_end = tl.minimum(vb_start + vblocks_per_split, tl.cdiv(V, BLOCK_V))
    for vb in range(vb_start, vb_end):
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        if EVEN_V:
            vocab_ids = cols.to(tl.int64)
        else:
            vocab_ids = tl.minimum(cols, V - 1).to(tl.int64)  # clamped, never masked: see _tile
        logits = logit_tile(
            E, C, Bias,
            rows, vocab_ids, row_block * BLOCK_N, vb * BLOCK_V, D,
            stride_en, stride_ed, stride_cv, stride_cd,
            softcap,
            HAS_BIAS, HAS_SOFTCAP, TMA, UPCAST, DOT_PRECISION, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if not EVEN_V:
            in_vocab = (cols < V)[None, :]
            if LOGIT_SUM or MEAN_LOGIT:
                finite_logits = tl.where(in_vocab, logits, 0.0)  # padded columns: exp(-inf) * -inf is NaN
            logits = tl.where(in_vocab, logits, float("-inf"))
        else:
            finite_logits = logits
        if LOGIT_SUM:
            logit_sum += tl.sum(finite_logits, axis=1)
        if ARGMAX:
            best, best_index = _fold_argmax(best, best_index, logits, cols, ROUND)
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        rescale = tl.exp(run_max - new_max)
        exps = tl.exp(logits - new_max[:, None])
        run_sum = run_sum * rescale + tl.sum(exps, axis=1)
        if MEAN_LOGIT:
            run_zexp = run_zexp * rescale + tl.sum(exps * finite_logits, axis=1)
        run_max = new_max

    out = split * N + rows
    tl.store(PartMax + out, run_max, mask=row_mask)
    tl.store(PartSum + out, run_sum, mask=row_mask)
    if LOGIT_SUM:
        tl.store(PartLogitSum + out, logit_sum, mask=row_mask)
    if MEAN_LOGIT:
        tl.store(PartZExp + out, run_zexp, mask=row_mask)
    if ARGMAX:
        tl.store(PartBest + out, best, mask=row_mask)
        tl.store(PartBestIndex + out, best_index, mask=row_mask)


@triton.jit
def _fold_argmax(best, best_index, logits, cols, ROUND: tl.constexpr):
    """The running (max, argmax) of each row after one more tile (columns ``cols``; padded columns hold -inf): the
    logits rounded as eager's are (ROUND 1: bf16, 2: fp16), a NaN counted as +inf (torch.argmax: NaN is the
    largest; a row holding both +inf and a later NaN is the one difference), the first maximal column of the tile,
    and a strictly larger value across tiles, so the first maximal index wins as in ``torch.argmax``."""
    values = logits
    if ROUND == 1:
        values = values.to(tl.bfloat16).to(tl.float32)
    if ROUND == 2:
        values = values.to(tl.float16).to(tl.float32)
    values = tl.where(values != values, float("inf"), values)
    tile_max = tl.max(values, axis=1)
    first = tl.min(tl.where(values == tile_max[:, None], cols[None, :], 2147483647), axis=1)
    better = tile_max > best
    return tl.where(better, tile_max, best), tl.where(better, first, best_index)


@triton.jit
def _target_logit_kernel(
    E, C, Bias, Targets, TargetLogit,
    N, V, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    softcap, ignore_index,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr = "ieee",
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = rows < N
    target = tl.load(Targets + rows, mask=in_range, other=ignore_index)
    hit = in_range & (target != ignore_index) & (target >= 0) & (target < V)
    target = tl.where(hit, target, 0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    e_rows = E + rows.to(tl.int64) * stride_en
    c_rows = C + target * stride_cv
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        mask = hit[:, None] & (d < D)[None, :]
        e_blk = tl.load(e_rows[:, None] + (d * stride_ed)[None, :], mask=mask, other=0.0).to(tl.float32)
        c_blk = tl.load(c_rows[:, None] + (d * stride_cd)[None, :], mask=mask, other=0.0).to(tl.float32)
        if DOT_PRECISION == "tf32_rn":  # the operands the tiles' TF32 dots see (their products are exact in fp32)
            e_blk = round_to_tf32(e_blk)
            c_blk = round_to_tf32(c_blk)
        acc += tl.sum(e_blk * c_blk, axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + target, mask=hit, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        acc = softcap * tanh(acc / softcap)
    tl.store(TargetLogit + rows, tl.where(hit, acc, 0.0), mask=in_range)


@triton.jit
def _combine_kernel(
    PartMax, PartSum, PartLogitSum, PartZExp, Targets, Lse, LogitSum, MeanLogit,
    N, num_splits, ignore_index,
    LOGIT_SUM: tl.constexpr, MEAN_LOGIT: tl.constexpr, BLOCK: tl.constexpr,
    PartBest=None, PartBestIndex=None, Argmax=None,
    ARGMAX: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < N
    valid = in_range & (tl.load(Targets + rows, mask=in_range, other=ignore_index) != ignore_index)
    run_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        run_max = tl.maximum(run_max, tl.load(PartMax + s * N + rows, mask=valid, other=float("-inf")))
    safe_max = tl.where(valid, run_max, 0.0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    zexp = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):
        part_max = tl.load(PartMax + s * N + rows, mask=valid, other=float("-inf"))
        rescale = tl.exp(part_max - safe_max)
        total += tl.load(PartSum + s * N + rows, mask=valid, other=0.0) * rescale
        if MEAN_LOGIT:
            zexp += tl.load(PartZExp + s * N + rows, mask=valid, other=0.0) * rescale
        if LOGIT_SUM:
            logit_sum += tl.load(PartLogitSum + s * N + rows, mask=valid, other=0.0)
    lse = tl.where(valid, safe_max + tl.log(tl.where(valid, total, 1.0)), 0.0)
    tl.store(Lse + rows, lse, mask=in_range)
    if LOGIT_SUM:
        tl.store(LogitSum + rows, tl.where(valid, logit_sum, 0.0), mask=in_range)
    if MEAN_LOGIT:
        tl.store(MeanLogit + rows, tl.where(valid, zexp / tl.where(valid, total, 1.0), 0.0), mask=in_range)
    if ARGMAX:
        best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
        best_index = tl.zeros((BLOCK,), dtype=tl.int32)
        for s in range(0, num_splits):
            part_best = tl.load(PartBest + s * N + rows, mask=valid, other=float("-inf"))
            better = part_best > best
            best = tl.where(better, part_best, best)
            best_index = tl.where(better, tl.load(PartBestIndex + s * N + rows, mask=valid, other=0), best_index)
        tl.store(Argmax + rows, best_index.to(tl.int64), mask=in_range)


def tma_operands(e: torch.Tensor, c: torch.Tensor, tune: dict) -> bool:
    """Whether a logit-tile kernel reads its operand tiles through the tensor-memory accelerator (``_tile``): where
    the kernel file's tuning asks for it, for 16-bit inputs whose rows the copy engine can address (16-byte aligned
    C and row pitch); fp32 inputs and odd views take the pointer loads."""
    return (
        tune["tma"]
        and e.dtype in (torch.bfloat16, torch.float16)
        and e.shape[1] * e.element_size() % 16 == 0
        and _launch.tma_ok(c)
    )


class RowStats(NamedTuple):
    """The forward's per-row results, fp32 ``(N,)`` each; the optional ones are None unless asked for."""

    lse: torch.Tensor
    target_logit: torch.Tensor
    logit_sum: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None


# An ignore_index no target equals: every row counts (a log-sum-exp used beyond the loss needs every row's).
EVERY_ROW = -(2**63)


def target_logits(e, c, targets, bias, *, softcap, ignore_index, out=None):
    """Launch helper: ``logits[n, targets[n]]`` per row, fp32 ``(N,)``; 0 where the target is ``ignore_index`` or
    outside ``[0, V)``.  One dot product of D per row (``N * D`` reads of E and of C's target rows): the forward's
    and the recompute's tile loops then need no per-column comparison with the target, which cost the tile kernels
    registers (spills) on Hopper."""
    n, d = e.shape
    if out is None:
        out = torch.empty((n,), dtype=torch.float32, device=e.device)
    if n == 0:
        return out
    tune = _launch.tuning(_TARGET_TUNING)
    block_n, block_d = tune["rows"], tune["block_d"]
    _target_logit_kernel[(triton.cdiv(n, block_n),)](
        e, c, bias if bias is not None else e, targets, out, n, c.shape[0], d,
        e.stride(0),
        e.stride(1),
        c.stride(0),
        c.stride(1),
        float(softcap) if softcap is not None else 1.0,
        ignore_index,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=_launch.dot_precision(e.dtype),
        num_warps=4,
    )  # fmt: skip
    return out


_ROUND = {None: 0, torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}


def forward(
    e, c, targets, bias, *, softcap, ignore_index, logit_sum=False, mean_logit=False, every_row=False, argmax_out=None,
    argmax_round=None,
):  # fmt: skip
    """Launch helper: :class:`RowStats` ``(lse, target_logit, logit_sum | None, mean_logit | None)``; see the module
    docstring.  ``every_row``: the rows whose target is ``ignore_index`` are computed too (their target logit is that
    of ``ignore_index`` where it lies in ``[0, V)``, else 0).  ``argmax_out``: an int64 ``(N,)`` tensor that receives
    each counted row's argmax over the logits rounded to ``argmax_round`` (0 at rows not counted)."""
    if every_row:
        ignore_index = EVERY_ROW
    tune = _launch.tuning(_TUNING)
    (n, d), v, device = e.shape, c.shape[0], e.device
    lse = torch.empty((n,), dtype=torch.float32, device=device)
    target_logit = torch.empty((n,), dtype=torch.float32, device=device)
    row_sums = torch.empty((n,), dtype=torch.float32, device=device) if logit_sum else None
    row_means = torch.empty((n,), dtype=torch.float32, device=device) if mean_logit else None
    if n == 0:
        return RowStats(lse, target_logit, row_sums, row_means)
    row_order, num_valid = _launch.compact_counted(targets != ignore_index)
    block_n, block_v, block_d = tune["block_n"], tune["block_v"], tune["block_d"]
    row_blocks = triton.cdiv(n, block_n)
    splits, vblocks_per_split = _launch.vocab_splits(row_blocks, triton.cdiv(v, block_v), tune["waves"], device)
    argmax = argmax_out is not None
    part = torch.empty((2 + logit_sum + mean_logit + argmax, splits, n), dtype=torch.float32, device=device)
    part_logit_sum = part[2] if logit_sum else part[0]  # (unused without logit_sum)
    part_zexp = part[2 + logit_sum] if mean_logit else part[0]  # (unused without mean_logit)
    part_best = part[-1] if argmax else part[0]  # (unused without argmax)
    part_best_index = torch.empty((splits, n), dtype=torch.int32, device=device) if argmax else row_order
    use_tma = tma_operands(e, c, tune)
    e_op, c_op = e, c
    if use_tma:  # the counted rows, compacted: a tile's rows must be contiguous for the copy engine
        e_op = _launch.descriptor(e.index_select(0, row_order), [block_n, block_d])
        c_op = _launch.descriptor(c, [block_v, block_d])
    _lse_forward_kernel[(row_blocks, splits)](
        e_op, c_op, bias if bias is not None else e, row_order, num_valid, part[0], part[1], part_logit_sum, part_zexp,
        part_best, part_best_index, n, v, d,
        e.stride(0),
        e.stride(1),
        c.stride(0),
        c.stride(1),
        vblocks_per_split,
        float(softcap) if softcap is not None else 1.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, LOGIT_SUM=logit_sum, MEAN_LOGIT=mean_logit,
        TMA=use_tma, UPCAST=_launch.upcast_dots(e.dtype), DOT_PRECISION=_launch.dot_precision(e.dtype),
        EVEN_D=(d % block_d == 0), EVEN_V=(v % block_v == 0), BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d,
        ARGMAX=argmax, ROUND=_ROUND[argmax_round],
        num_warps=tune["num_warps"],
        num_stages=_launch.fit_num_stages(tune["num_stages"], block_n, block_v, block_d, e.element_size()),
    )  # fmt: skip
    target_logits(e, c, targets, bias, softcap=softcap, ignore_index=ignore_index, out=target_logit)
    stats = RowStats(lse, target_logit, row_sums, row_means)
    _combine(stats, part, part_logit_sum, part_zexp, part_best, part_best_index, targets, ignore_index, argmax_out)
    return stats


def _combine(stats, part, part_logit_sum, part_zexp, part_best, part_best_index, targets, ignore_index, argmax_out):
    """The splits' partial sums merged into ``stats`` (and each row's argmax into ``argmax_out``, where given)."""
    splits, n = part.shape[1:]
    combine_block = 256
    _combine_kernel[(triton.cdiv(n, combine_block),)](
        part[0], part[1], part_logit_sum, part_zexp, targets, stats.lse,
        stats.logit_sum if stats.logit_sum is not None else stats.lse,
        stats.mean_logit if stats.mean_logit is not None else stats.lse, n, splits, ignore_index,
        LOGIT_SUM=stats.logit_sum is not None, MEAN_LOGIT=stats.mean_logit is not None, BLOCK=combine_block,
        num_warps=4,
        PartBest=part_best, PartBestIndex=part_best_index,
        Argmax=argmax_out if argmax_out is not None else part_best_index,
        ARGMAX=argmax_out is not None,
    )  # fmt: skip
