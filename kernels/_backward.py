"""Backward: one Triton kernel recomputes each logit block and turns it into the softmax gradient; vendor-BLAS
products (or, with ``products="triton"``, the kernels of ``_products``) do dE and dC.

Every logit contributes to dE and dC (no gradient is filtered), so the two gradient products are plain GEMMs,
which cuBLAS runs near the tensor-core peak; no atomics.

Math
----
g_n = grad_rows[n] (0 at ignored rows), s = the softcap's chain factor:

    raw[n, v] = E[n] . C[v]                                        (fp32 accumulation)
    z[n, v]   = softcap * tanh((raw + bias[v]) / softcap)          (no tanh without softcap)
    p[n, v]   = exp(z - lse[n])
    G[n, v]   = (p (g_n + h_n + k_n (mu[n] - z)) - g_n ((1 - eps) [v == targets[n]] + eps / V)) * s[n, v]
                (eps: label smoothing; h_n: the upstream gradient of lse[n] where the log-sum-exp is used elsewhere;
                 k_n: that of the entropy H[n] = lse[n] - mu[n], mu[n] = sum_v p z, where it is asked for)
    dE = G @ C,     dC = G^T @ E,     dbias = sum_n G[n, :]

Chunking / layout
-----------------
The (rows x vocabulary) plane is cut into ``row_chunk x block_width`` blocks (the caller's plan, explicit
arguments); the vocabulary is the outer loop, so that each gradient is rounded to the output dtype once, whatever N:

    dE32 = fp32 (N, D);  compact each row chunk R on the device once: its counted rows first, their number in
    device memory
    for each vocabulary chunk W:
        for each row chunk R:
            G      = _recompute_grad_kernel(E[R], C[W])   Triton, persistent grid (one program per SM), input dtype
            dE32[R] += G @ C[W]                         cuBLAS, fp32 accumulation across vocabulary chunks
            dC[W] (+)= G^T @ E[R]                       cuBLAS: written once (one row chunk), or summed in an fp32
                                                        block_width x D buffer over the row chunks, then rounded
            dbias32[W] += sum_rows G
    dE = dE32

Every cuBLAS product over a vocabulary dimension (the last chunk's width may be odd) is split at a multiple of 64
(``_launch.product_into``) and G's rows keep an aligned pitch.

``_recompute_grad_kernel`` deals the block's tiles to its programs in column groups of ``recompute_group`` columns,
row blocks outer inside each, so that the programs at work at any moment share one group's part of C in L2 however
wide the block; tile (i, j) takes compacted rows ``i*BLOCK_N ...`` of the chunk and vocabulary tile j of the block:
``BLOCK_N x BLOCK_V`` logits from ``_tile.logit_tile`` (loop over ``BLOCK_D`` chunks of D), the gradient formed in
registers without its one-hot term and stored in the input dtype at the rows' own places in G; then (after a CTA
barrier, so that they land last) the entries ``G[n, targets[n]]`` that fall in the tile are overwritten with the full
formula evaluated at the row's target logit (``_forward.target_logits``, computed once per call): a per-row vector,
because comparing every column with the target keeps a tile-sized mask live and spills registers. A row with no
gradient (g = h = k = 0) gets lse = +inf, so p = 0 and G = 0 with no per-element select (NaN where z is NaN / +inf,
as in eager). A tile whose rows all lie past the device-side count of counted rows (ignored rows only) computes
nothing and stores G = 0 there (NaN where that row of E, or any of C / bias, is not finite: the pattern eager's
log-softmax backward gives an ignored row whose log-sum-exp is NaN, through 0 * NaN). So ignored rows cost no
recompute; the cuBLAS products, whose sizes the host must know, still run over every row.

Counted prefix (``products="prefix"``, after a call of the head that ignored some of its targets): G is stored in
compacted order (counted rows first); cuBLAS multiplies its first h rows, h the earlier call's counted share of the
chunk's rows rounded up to whole row blocks, and the row-skipping products of ``_products`` the rest, sized on the
device by the counted rows past h (none where the share held: their launches return at once, but for the first
vocabulary chunk's write of the ignored rows' dE). dE is summed in the compacted order and put back in row order at
the end; cuBLAS sums each vocabulary chunk's dC in fp32 (``block_width x D x 4`` bytes) and the tail kernel adds its
rows and writes the 16-bit chunk, one rounding.  With compacted G (the counted prefix, the Triton products) the
recompute stores ignored positions only as far as a product reads them (the counted rows' row blocks and the
prefix), unless a bias gradient sums all of G's rows.

The launch helpers (``backward``, the call object that walks the G blocks) are ``_backward_launch``; the host-side
part of each row chunk (its compaction, the counted prefix's split, the target logits, dE put back in row order) is
``_row_chunks``.

With TMA (16-bit inputs, ``_forward.tma_operands``) the recompute reads its E tiles from a compacted copy of each
chunk's rows, which lives in those rows of the dE output until dE is written there at the end, so it costs no
memory.

Memory above the outputs: one G block in the input dtype (``row_chunk x block_width``), dE in fp32 (``N x D x 4``)
and, where N exceeds one row chunk or with the counted prefix, one vocabulary chunk of dC in fp32 (``block_width x
D x 4``): the model ``cce_inductor.paths.lean_peak`` counts exactly these.  G is rounded to the input dtype before
the products, as eager PyTorch does for the logits' gradient. No atomics, so the result is bitwise reproducible
(``torch.use_deterministic_algorithms`` is satisfied).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tile import logit_tile, softmax_grad

# Hopper; the interpreter's tiny blocks keep the CPU tests fast.  The G block's width is the caller's
# (``block_width``: ``_layout.block_width``).  recompute_group: columns of the recompute's tile groups (each
# group's tiles taken row block by row block), so that a G block wider than it keeps C's part in L2 as a
# 4096-column block does.
_TUNING = {
    "gpu": dict(block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=4, tma=True, recompute_group=4096),
    "interpret": dict(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1, tma=True, recompute_group=64),
}


@triton.jit
def _recompute_grad_kernel(
    E, C, Bias, Lse, GradRows, GradLse, GradEntropy, MeanLogit, Targets, TargetLogit, RowOrder, NumCounted, RowPoison,
    G,
    n_rows, stored_rows, width, vocab_start, V, D,
    stride_en, stride_ed, stride_cv, stride_cd, stride_g,
    softcap, target_weight, uniform,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LSE_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
    COMPACT_G: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
    EVEN_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_V: tl.constexpr,
):  # fmt: skip
    """``G[r, c]`` of one (row chunk, vocabulary chunk) block.  Every pointer but C / Bias starts at the chunk's
    first row; ``RowOrder`` lists the chunk's rows (local indices), counted rows first.  G's row of local row
    ``RowOrder[p]`` is p (``COMPACT_G``, for the ``_products`` kernels) or the row itself (for cuBLAS products).

    A persistent grid, one program per multiprocessor: the block's tiles, in column groups of ``GROUP_V`` vocabulary
    tiles with row blocks outer inside each (so that the programs at work at any moment share one group's part of C in
    L2, however wide the block), are dealt round-robin to the programs, first the tiles of row blocks that hold
    counted rows (their number from the device-side count), then those of ignored rows only, which store G's value
    there without computing logits, up to ``stored_rows`` positions (the products past the counted rows read no
    further: compacted G without a bias gradient; every row otherwise).  (Not one program per tile: the launch and
    the tail cost more.  Not Triton's loop flattening: it leaves the D loop unpipelined.)"""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    vblocks = tl.cdiv(width, BLOCK_V)
    num_counted = tl.load(NumCounted)
    counted_blocks = tl.cdiv(num_counted, BLOCK_N)
    counted_tiles = counted_blocks * vblocks
    group_tiles = counted_blocks * GROUP_V
    for tile in range(pid, counted_tiles, num_programs):
        # column groups of GROUP_V vocabulary tiles, row blocks outer inside each (the last group may be narrower)
        first_vblock = (tile // group_tiles) * GROUP_V
        group_width = tl.minimum(vblocks - first_vblock, GROUP_V)
        in_group = tile % group_tiles
        row_block = in_group // group_width
        vocab_block = first_vblock + in_group % group_width
        # one BLOCK_N x BLOCK_V tile of G whose row block holds counted rows
        pos, in_chunk, rows, cols, g_rows, mask = _tile_rows(
            RowOrder, row_block, vocab_block, n_rows, width, stride_g, COMPACT_G, BLOCK_N, BLOCK_V
        )
        col0 = vocab_block * BLOCK_V
        g_offs = g_rows[:, None] + cols[None, :]
        vocab_ids = tl.minimum(vocab_start + cols, V - 1).to(tl.int64)
        # Ignored rows of this block (past the count) get 0, or NaN where eager has it (the kernel's docstring): as
        # lse = +inf + poison, so that no tile-sized term stays live across the logit loop.  Counted rows get their
        # NaNs from their own logits.
        poison = tl.where(pos < num_counted, 0.0, tl.load(RowPoison + rows, mask=in_chunk, other=0.0))

        grad_row = tl.load(GradRows + rows, mask=in_chunk, other=0.0)
        grad_p = grad_row
        if HAS_LSE_GRAD:
            grad_p += tl.load(GradLse + rows, mask=in_chunk, other=0.0)
        has_grad = (grad_p != 0.0) | (grad_row != 0.0)
        grad_entropy = grad_row  # (unused without HAS_ENTROPY_GRAD)
        mean_logit = grad_row
        if HAS_ENTROPY_GRAD:
            grad_entropy = tl.load(GradEntropy + rows, mask=in_chunk, other=0.0)
            mean_logit = tl.load(MeanLogit + rows, mask=in_chunk, other=0.0)
            has_grad = has_grad | (grad_entropy != 0.0)
        # a row with no gradient gets p = exp(z - inf) = 0: its G is 0 (NaN where z is NaN / +inf, as in eager)
        lse = tl.where(has_grad, tl.load(Lse + rows, mask=in_chunk, other=0.0), float("inf")) + poison
        logits = logit_tile(
            E, C, Bias,
            rows, vocab_ids, row_block * BLOCK_N, vocab_start + col0, D,
            stride_en, stride_ed, stride_cv, stride_cd,
            softcap,
            HAS_BIAS, HAS_SOFTCAP, TMA, UPCAST, DOT_PRECISION, EVEN_D, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        grad = softmax_grad(
            logits,
            lse[:, None],
            grad_p[:, None],
            grad_entropy[:, None],
            mean_logit[:, None],
            (grad_row * uniform)[:, None],
            softcap,
            HAS_SOFTCAP,
            HAS_ENTROPY_GRAD,
        )
        grad_hi = grad.to(G.dtype.element_ty)
        if EVEN_TILE:  # (the masked store of a full tile costs registers the softcap's epilogue needs)
            tl.store(G + g_offs, grad_hi)
        else:
            tl.store(G + g_offs, grad_hi, mask=mask)

        # The target entries of this tile, overwritten with their one-hot term from the row's target logit (a per-row
        # vector: comparing every column with the target kept a tile-sized mask live and spilled registers).
        target = tl.load(Targets + rows, mask=in_chunk, other=-1) - vocab_start
        hit = in_chunk & (target >= col0) & (target < col0 + BLOCK_V) & (target < width)
        target_logit = tl.load(TargetLogit + rows, mask=hit, other=0.0)
        at_target = softmax_grad(
            target_logit,
            lse,
            grad_p,
            grad_entropy,
            mean_logit,
            grad_row * (target_weight + uniform),
            softcap,
            HAS_SOFTCAP,
            HAS_ENTROPY_GRAD,
        )
        at_target_hi = at_target.to(G.dtype.element_ty)
        tl.debug_barrier()  # the tile's stores above land first
        tl.store(G + g_rows + target, at_target_hi, mask=hit)
    # G of an ignored row: 0, or NaN where eager's 0 * NaN puts it: everywhere in a row with a NaN logit (its
    # log-sum-exp is NaN), i.e. where that row of E, or any of C / bias, is not finite.
    first = pid + tl.maximum(tl.cdiv(counted_tiles - pid, num_programs), 0) * num_programs
    for tile in range(first, tl.cdiv(stored_rows, BLOCK_N) * vblocks, num_programs):
        pos, in_chunk, rows, cols, g_rows, mask = _tile_rows(
            RowOrder, tile // vblocks, tile % vblocks, n_rows, width, stride_g, COMPACT_G, BLOCK_N, BLOCK_V
        )
        g_offs = g_rows[:, None] + cols[None, :]
        poison = tl.load(RowPoison + rows, mask=in_chunk, other=0.0)
        skipped = (poison[:, None] + tl.zeros((BLOCK_N, BLOCK_V), tl.float32)).to(G.dtype.element_ty)
        tl.store(G + g_offs, skipped, mask=mask)


@triton.jit
def _tile_rows(
    RowOrder,
    row_block, vocab_block, n_rows, width,
    stride_g,
    COMPACT_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Where tile (row_block, vocab_block) of a G block lies: its compacted positions, whether they are in the
    chunk, the rows they hold, its columns, G's row offsets (per position with ``COMPACT_G``, else per row) and the
    tile's store mask."""
    pos = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    in_chunk = pos < n_rows
    rows = tl.load(RowOrder + pos, mask=in_chunk, other=0).to(tl.int64)
    cols = vocab_block * BLOCK_V + tl.arange(0, BLOCK_V)
    g_rows = (pos.to(tl.int64) if COMPACT_G else rows) * stride_g
    mask = in_chunk[:, None] & (cols < width)[None, :]
    return pos, in_chunk, rows, cols, g_rows, mask
