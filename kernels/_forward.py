"""Forward: log-sum-exp and target logit of ``logits = softcap(E @ C^T + bias)`` without materialising it.

Math
----
For every valid row n (targets[n] != ignore_index)

    lse[n]          = log sum_v exp(logits[n, v])
    target_logit[n] = logits[n, targets[n]]

Block / grid layout (flash-decoding style)
------------------------------------------
``grid = (row_blocks, vocab_splits)``.  Program (i, s) owns the compacted rows
``row_order[i*BLOCK_N : (i+1)*BLOCK_N]`` and the vocabulary range of split s, which it walks in
``BLOCK_V`` steps.  Each step computes one ``BLOCK_N x BLOCK_V`` logit tile (loop over ``BLOCK_D``
chunks of D, see ``_tile.logit_tile``) and folds it into a running (max, sum-of-exp) pair per row held in
registers; the target logit is picked out of the tile with ``tl.where(col == target)``.  Program order
is row-block fastest, so the programs resident at one time share the same split of C and C is streamed
from HBM about once while E (small) stays in L2.

Each program writes its partial ``(max, sumexp, target)`` for its rows into ``(splits, N)`` fp32
buffers; ``_combine_kernel`` (grid ``cdiv(N, BLOCK)``) merges the splits:
``lse = m + log(sum_s sumexp_s * exp(max_s - m))``.  Ignored rows get lse = target_logit = 0.

Summaries for the backward (``aux``, layout in ``_config.aux_spec``)
--------------------------------------------------------------------
Only with ``summaries=True``, i.e. when the backward may filter (the op asks for them when ``filter_eps`` is
not 0 and not in exact mode); otherwise the kernel is the bare (max, sumexp, target) loop and aux is empty.
* per-row maximum logit and per-row fraction of the mass held by entries below
  ``default_filter_eps(dtype)`` relative to the running max (written by the combine kernel); the backward
  keeps the whole dE of rows with a flat top or a heavy flat tail.
* ``WRITE_TILE_MAX``: max over the tile's valid rows of the logits of each ``tile_v``-wide column chunk
  -> ``tile_max[row_block, vocab_tile]``; the backward skips a tile without recomputing it when
  ``exp(tile_max - min lse) < filter_eps``.
* ``WRITE_VOCAB_SUM``: per-vocabulary sum of logits over valid rows (atomic fp32 adds) for sorting the
  vocabulary by average logit (paper sec. 4.3).

Memory: the partial buffers are ``3 * splits * N * 4`` bytes and aux is at most a few MB, far below the
logit matrix.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _config
from ._tile import logit_tile, no_target, tanh, target_raw_logit


@triton.jit
def _fold_tile(
    vb, run_max, run_sum, run_small, target_logit, rows, row_mask, target, row_block, tail_ref,
    E, C, Bias, TileMax, VocabLogitSum, V, D, stride_en, stride_ed, stride_cv, stride_cd, num_vocab_tiles, softcap,
    log_small,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TAIL_MASS: tl.constexpr, WRITE_TILE_MAX: tl.constexpr, WRITE_VOCAB_SUM: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILE_V: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One vocabulary step: logit tile, online (max, sumexp) update, target pick, aux summaries."""
    cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    vocab_ids = tl.minimum(cols, V - 1).to(tl.int64)
    logits = logit_tile(
        E, C, Bias, rows, vocab_ids, D, stride_en, stride_ed, stride_cv, stride_cd, softcap,
        HAS_BIAS, HAS_SOFTCAP, UPCAST, DOT_PRECISION, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
    )
    logits = tl.where(col_mask[None, :], logits, float("-inf"))

    new_max = tl.maximum(run_max, tl.max(logits, axis=1))
    scale = tl.exp(run_max - new_max)
    shifted = logits - new_max[:, None]
    weights = tl.exp(shifted)
    run_sum = run_sum * scale + tl.sum(weights, axis=1)
    if TAIL_MASS:
        # mass of the entries that are < filter_eps relative to max(running max, target logit) (a lower bound of
        # the mass the gradient filter may drop; large for rows whose mass sits in a long flat tail).  The
        # target logit makes the threshold independent of which vocabulary split the row's peak falls in.
        small_cut = tl.maximum(new_max, tail_ref) + log_small
        run_small = run_small * scale + tl.sum(tl.where(logits < small_cut[:, None], weights, 0.0), axis=1)
    run_max = new_max
    target_logit += tl.sum(tl.where(cols[None, :] == target[:, None], logits, 0.0), axis=1)

    if WRITE_TILE_MAX:
        col_max = tl.max(tl.where(row_mask[:, None], logits, float("-inf")), axis=0)
        tile_max = tl.max(tl.reshape(col_max, (BLOCK_V // TILE_V, TILE_V)), axis=1)
        tile_idx = vb * (BLOCK_V // TILE_V) + tl.arange(0, BLOCK_V // TILE_V)
        tl.store(TileMax + row_block * num_vocab_tiles + tile_idx, tile_max, mask=tile_idx < num_vocab_tiles)
    if WRITE_VOCAB_SUM:
        col_sum = tl.sum(tl.where(row_mask[:, None] & col_mask[None, :], logits, 0.0), axis=0)
        tl.atomic_add(VocabLogitSum + cols, col_sum, mask=col_mask, sem="relaxed")
    return run_max, run_sum, run_small, target_logit


@triton.jit
def _lse_forward_kernel(
    E, C, Bias, Targets, RowOrder, NumValid, TargetRef,
    PartMax, PartSum, PartSmall, PartTarget, TileMax, VocabLogitSum,
    N, V, D,
    stride_en, stride_ed, stride_cv, stride_cd,
    vblocks_per_split, num_vocab_tiles,
    softcap, log_small,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TAIL_MASS: tl.constexpr, WRITE_TILE_MAX: tl.constexpr, WRITE_VOCAB_SUM: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, TILE_V: tl.constexpr, BLOCK_D: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    num_valid = tl.load(NumValid)
    if row_block * BLOCK_N >= num_valid:
        return

    pos = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = pos < num_valid
    rows = tl.load(RowOrder + pos, mask=row_mask, other=0).to(tl.int64)
    target = tl.load(Targets + rows, mask=row_mask, other=-1)

    if TAIL_MASS:
        tail_ref = tl.load(TargetRef + rows, mask=row_mask, other=float("-inf"))
    else:
        tail_ref = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    run_small = tl.zeros((BLOCK_N,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_N,), dtype=tl.float32)

    num_vblocks = tl.cdiv(V, BLOCK_V)
    vb_start = split * vblocks_per_split
    vb_end = tl.minimum(vb_start + vblocks_per_split, num_vblocks)
    if FLATTEN:
        for vb in tl.range(vb_start, vb_end, flatten=True):
            run_max, run_sum, run_small, target_logit = _fold_tile(
                vb, run_max, run_sum, run_small, target_logit, rows, row_mask, target, row_block, tail_ref,
                E, C, Bias, TileMax, VocabLogitSum, V, D, stride_en, stride_ed, stride_cv, stride_cd, num_vocab_tiles,
                softcap, log_small, HAS_BIAS, HAS_SOFTCAP, TAIL_MASS, WRITE_TILE_MAX, WRITE_VOCAB_SUM, UPCAST, DOT_PRECISION, EVEN_D,
                BLOCK_N, BLOCK_V, TILE_V, BLOCK_D,
            )
    else:
        for vb in range(vb_start, vb_end):
            run_max, run_sum, run_small, target_logit = _fold_tile(
                vb, run_max, run_sum, run_small, target_logit, rows, row_mask, target, row_block, tail_ref,
                E, C, Bias, TileMax, VocabLogitSum, V, D, stride_en, stride_ed, stride_cv, stride_cd, num_vocab_tiles,
                softcap, log_small, HAS_BIAS, HAS_SOFTCAP, TAIL_MASS, WRITE_TILE_MAX, WRITE_VOCAB_SUM, UPCAST, DOT_PRECISION, EVEN_D,
                BLOCK_N, BLOCK_V, TILE_V, BLOCK_D,
            )

    out = split * N + rows
    tl.store(PartMax + out, run_max, mask=row_mask)
    tl.store(PartSum + out, run_sum, mask=row_mask)
    if TAIL_MASS:
        tl.store(PartSmall + out, run_small, mask=row_mask)
    tl.store(PartTarget + out, target_logit, mask=row_mask)


@triton.jit
def _target_ref_kernel(
    E, C, Bias, Targets, TargetRef, V, D, stride_en, stride_ed, stride_cv, stride_cd, ignore_index, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per row: the target logit by one fp32 D-dot (-inf for ignored rows and for targets outside
    [0, V), which a vocabulary shard sees for rows whose target another shard holds), the reference of the
    tail-mass estimate."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Targets + row)
    if no_target(target, ignore_index, V):
        tl.store(TargetRef + row, float("-inf"))
        return
    target = target.to(tl.int64)
    logit = target_raw_logit(E, C, Bias, row, target, D, stride_en, stride_ed, stride_cv, stride_cd,
                             HAS_BIAS, BLOCK_D)
    if HAS_SOFTCAP:
        logit = softcap * tanh(logit / softcap)
    tl.store(TargetRef + row, logit)


@triton.jit
def _combine_kernel(
    PartMax, PartSum, PartSmall, PartTarget, Targets, Lse, TargetLogit, RowMax, SmallFrac, N, num_splits,
    ignore_index, log_small,
    SUMMARIES: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = rows < N
    valid = in_range & (tl.load(Targets + rows, mask=in_range, other=ignore_index) != ignore_index)
    run_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        run_max = tl.maximum(run_max, tl.load(PartMax + s * N + rows, mask=valid, other=float("-inf")))
    safe_max = tl.where(valid, run_max, 0.0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    small = tl.zeros((BLOCK,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):
        part_max = tl.load(PartMax + s * N + rows, mask=valid, other=float("-inf"))
        part_sum = tl.load(PartSum + s * N + rows, mask=valid, other=0.0)
        rescale = tl.exp(part_max - safe_max)
        total += part_sum * rescale
        if SUMMARIES:
            part_small = tl.load(PartSmall + s * N + rows, mask=valid, other=0.0)
            # a split whose max is itself below the global cut holds only small entries
            small += tl.where(part_max < safe_max + log_small, part_sum, part_small) * rescale
        target_logit += tl.load(PartTarget + s * N + rows, mask=valid, other=0.0)
    lse = tl.where(valid, safe_max + tl.log(tl.where(valid, total, 1.0)), 0.0)
    tl.store(Lse + rows, lse, mask=in_range)
    tl.store(TargetLogit + rows, tl.where(valid, target_logit, 0.0), mask=in_range)
    if SUMMARIES:
        tl.store(RowMax + rows, safe_max, mask=in_range)
        tl.store(SmallFrac + rows, tl.where(valid, small / tl.where(valid, total, 1.0), 0.0), mask=in_range)


def forward(e, c, targets, bias, *, softcap, ignore_index, vocab_sort, summaries=True, row_compaction=None):
    """Launch helper; see package docstring for the contract.  ``summaries=False`` (the backward will not filter):
    no aux summaries are computed and ``aux`` is empty."""
    cfg = _config.CONFIG
    n, d = e.shape
    v = c.shape[0]
    device = e.device
    aux_shape, aux_dtype = _config.aux_spec(n, v, vocab_sort, summaries)
    aux = torch.empty(aux_shape, dtype=aux_dtype, device=device)
    row_max, small_frac, summary = aux[:n], aux[n:2 * n], aux[2 * n:]
    if summaries and vocab_sort:
        summary.zero_()
    lse = torch.empty((n,), dtype=torch.float32, device=device)
    target_logit = torch.empty((n,), dtype=torch.float32, device=device)
    if n == 0:
        return lse, target_logit, aux
    row_order, num_valid = row_compaction if row_compaction is not None else _config.compact_rows(targets, ignore_index)
    tile_n, tile_v = cfg["tile_n"], cfg["tile_v"]
    block_v = tile_v * cfg["fwd_v_mult"]
    block_d = cfg["fwd_block_d"]
    row_blocks = triton.cdiv(n, tile_n)
    vblocks = triton.cdiv(v, block_v)
    want = max(1, cfg["fwd_waves"] * _config.num_sms(device))
    splits = max(1, min(vblocks, triton.cdiv(want, row_blocks)))
    vblocks_per_split = triton.cdiv(vblocks, splits)
    splits = triton.cdiv(vblocks, vblocks_per_split)

    part = torch.empty((4 if summaries else 3, splits, n), dtype=torch.float32, device=device)
    part_max, part_sum, part_target = part[0], part[1], part[2]
    part_small = part[3] if summaries else part_max  # unused without summaries
    log_small = math.log(_config.default_filter_eps(e.dtype))
    softcap_val = float(softcap) if softcap is not None else 1.0
    if summaries:
        target_ref = torch.empty((n,), dtype=torch.float32, device=device)
        _target_ref_kernel[(n,)](
            e, c, bias if bias is not None else e, targets, target_ref, v, d, e.stride(0), e.stride(1), c.stride(0),
            c.stride(1), ignore_index, softcap_val,
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, BLOCK_D=min(1024, triton.next_power_of_2(d)),
            num_warps=4,
        )
    else:
        target_ref = lse  # unused
    upcast = _config.INTERPRET and e.dtype != torch.float32
    summary_arg = summary if summaries else lse  # unused without summaries
    _lse_forward_kernel[(row_blocks, splits)](
        e, c, bias if bias is not None else e, targets, row_order, num_valid, target_ref,
        part_max, part_sum, part_small, part_target, summary_arg, summary_arg,
        n, v, d,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1),
        vblocks_per_split, triton.cdiv(v, tile_v),
        softcap_val, log_small,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        TAIL_MASS=summaries, WRITE_TILE_MAX=summaries and not vocab_sort, WRITE_VOCAB_SUM=summaries and vocab_sort,
        UPCAST=upcast, DOT_PRECISION=_config.dot_precision(e.dtype), EVEN_D=(d % block_d == 0),
        BLOCK_N=tile_n, BLOCK_V=block_v, TILE_V=tile_v, BLOCK_D=block_d, FLATTEN=bool(cfg["fwd_flatten"]),
        num_warps=cfg["fwd_num_warps"],
        num_stages=_config.fit_num_stages(cfg["fwd_num_stages"], tile_n, block_v, block_d, e.element_size()),
    )
    combine_block = 256
    _combine_kernel[(triton.cdiv(n, combine_block),)](
        part_max, part_sum, part_small, part_target, targets, lse, target_logit,
        row_max if summaries else lse, small_frac if summaries else lse, n, splits, ignore_index, log_small,
        SUMMARIES=summaries, BLOCK=combine_block, num_warps=4,
    )
    return lse, target_logit, aux
