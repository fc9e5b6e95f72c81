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

The host-side part of each row chunk (its compaction, the counted prefix's split, the target logits, dE put back
in row order) is ``_row_chunks``.

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

import torch
import triton
import triton.language as tl

from . import _forward, _launch, _products
from ._row_chunks import _block, _PrefixTail, _RowChunk, _target_logits, _uncompact_rows, counted_prefix
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
    E,
    C,
    Bias,
    Lse,
    GradRows,
    GradLse,
    GradEntropy,
    MeanLogit,
    Targets,
    TargetLogit,
    RowOrder,
    NumCounted,
    RowPoison,
    G,
    n_rows,
    stored_rows,
    width,
    vocab_start,
    V,
    D,
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    stride_g,
    softcap,
    target_weight,
    uniform,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    COMPACT_G: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_V: tl.constexpr,
):
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
        _grad_tile(
            E,
            C,
            Bias,
            Lse,
            GradRows,
            GradLse,
            GradEntropy,
            MeanLogit,
            Targets,
            TargetLogit,
            RowOrder,
            RowPoison,
            G,
            in_group // group_width,
            first_vblock + in_group % group_width,
            num_counted,
            n_rows,
            width,
            vocab_start,
            V,
            D,
            stride_en,
            stride_ed,
            stride_cv,
            stride_cd,
            stride_g,
            softcap,
            target_weight,
            uniform,
            HAS_BIAS,
            HAS_SOFTCAP,
            HAS_LSE_GRAD,
            HAS_ENTROPY_GRAD,
            COMPACT_G,
            TMA,
            UPCAST,
            DOT_PRECISION,
            EVEN_D,
            EVEN_TILE,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
        )
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
    row_block,
    vocab_block,
    n_rows,
    width,
    stride_g,
    COMPACT_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
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


@triton.jit
def _grad_tile(
    E,
    C,
    Bias,
    Lse,
    GradRows,
    GradLse,
    GradEntropy,
    MeanLogit,
    Targets,
    TargetLogit,
    RowOrder,
    RowPoison,
    G,
    row_block,
    vocab_block,
    num_counted,
    n_rows,
    width,
    vocab_start,
    V,
    D,
    stride_en,
    stride_ed,
    stride_cv,
    stride_cd,
    stride_g,
    softcap,
    target_weight,
    uniform,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    COMPACT_G: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One ``BLOCK_N x BLOCK_V`` tile of G whose row block holds counted rows (see the kernel)."""
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
        E,
        C,
        Bias,
        rows,
        vocab_ids,
        row_block * BLOCK_N,
        vocab_start + col0,
        D,
        stride_en,
        stride_ed,
        stride_cv,
        stride_cd,
        softcap,
        HAS_BIAS,
        HAS_SOFTCAP,
        TMA,
        UPCAST,
        DOT_PRECISION,
        EVEN_D,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
    )
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


def row_skipping_ok(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the row-skipping products (``products="triton"``) can run for these operands: C and E rows that the
    tensor-memory accelerator can read."""
    return _launch.tma_ok(c) and (e.shape[1] * e.element_size()) % 16 == 0


def backward(
    e,
    c,
    targets,
    bias,
    lse,
    grad_rows,
    *,
    softcap,
    ignore_index,
    need_e,
    need_c,
    need_bias,
    row_chunk,
    block_width,
    products,
    counted_hint=None,
    label_smoothing=0.0,
    grad_lse=None,
    grad_entropy=None,
    mean_logit=None,
    observe_counted=None,
    de_dtype=None,
    dc_dtype=None,
    compute_dtype=None,
):
    """Launch helper: ``(dE | None, dC | None, dbias | None)``; ``grad_rows`` fp32, 0 at ignored rows.  Rows whose
    target is ``ignore_index`` are skipped by the recompute (and by the Triton products) unless ``grad_lse`` (the
    upstream gradient of every row's lse, fp32) or ``grad_entropy`` (that of every row's entropy, with the forward's
    ``mean_logit``) is given; a target outside ``[0, V)`` (a vocabulary shard's code for "another shard's") counts,
    with no one-hot term.

    The plan (the caller's, every field explicit): G blocks of ``row_chunk`` rows x
    ``block_width`` columns; ``products``: ``"cublas"`` over every row, ``"triton"`` (the row-skipping products of
    ``_products``; their operands must pass :func:`row_skipping_ok`), or ``"prefix"``: cuBLAS over the first
    :func:`counted_prefix` rows of each compacted row chunk after an earlier call that counted ``counted_hint`` of its
    rows, the row-skipping products past them (nothing there where this call counts no more rows than the hint).
    ``observe_counted``: called with the first row chunk's device-side count of counted rows and its rows.
    ``de_dtype`` / ``dc_dtype``: the gradients' dtypes where not the operands' (autocast's fp32 inputs: dE is its fp32
    sums, dC written in fp32, with no 16-bit rounding between).  ``compute_dtype``: C (and bias) are stored in another
    dtype than the products' (autocast's fp32 head; ``e`` is already in ``compute_dtype``): each vocabulary chunk of C
    is converted as it is reached, into one ``block_width x D`` buffer, so no converted copy of the whole head
    exists."""
    n, d = e.shape
    v = c.shape[0]
    need_bias = need_bias and bias is not None
    de_dtype, dc_dtype = de_dtype or e.dtype, dc_dtype or c.dtype
    # an fp32 dE is its own fp32 sums (but where they are summed in compacted order and put back at the end)
    de_is_sums = need_e and de_dtype == torch.float32 and products != "prefix"
    de_out = torch.empty((n, d), dtype=de_dtype, device=e.device) if need_e else None
    dc_out = torch.empty((v, d), dtype=dc_dtype, device=e.device) if need_c else None
    dbias32 = torch.zeros((v,), dtype=torch.float32, device=e.device) if need_bias else None
    if n == 0 or not (need_e or need_c or need_bias):
        if need_c:
            dc_out.zero_()
        return de_out, dc_out, (dbias32.to(bias.dtype) if need_bias else None)
    call = _LeanCall.of(
        e, c, targets, bias, lse, grad_rows, de_out, dc_out, dbias32, de_is_sums,
        softcap=softcap, ignore_index=ignore_index, row_chunk=row_chunk, block_width=block_width,
        products=products, counted_hint=counted_hint, label_smoothing=label_smoothing,
        grad_lse=grad_lse, grad_entropy=grad_entropy, mean_logit=mean_logit, compute_dtype=compute_dtype,
    )  # fmt: skip
    if observe_counted is not None:
        observe_counted(call.chunks[0].num_counted, call.chunks[0].rows)
    for v0 in range(0, v, call.vocab_chunk):
        call.vocab_chunk_step(v0)
    return call.finish()


class _LeanCall:
    """One lean backward call, laid out (:meth:`of`) before its vocabulary chunks (:meth:`vocab_chunk_step`) and
    finished (:meth:`finish`): the G buffers, the row chunks and their recompute arguments, where each gradient is
    summed.  Attributes are set once in :meth:`of`."""

    @classmethod
    def of(
        cls, e, c, targets, bias, lse, grad_rows, de_out, dc_out, dbias32, de_is_sums, *, softcap, ignore_index,
        row_chunk, block_width, products, counted_hint, label_smoothing, grad_lse, grad_entropy, mean_logit,
        compute_dtype,
    ):  # fmt: skip
        self = cls()
        tune = _launch.tuning(_TUNING)
        n, d = e.shape
        v = c.shape[0]
        device = e.device
        need_e, need_c, need_bias = de_out is not None, dc_out is not None, dbias32 is not None
        convert_c = compute_dtype is not None and c.dtype != compute_dtype
        every_row = grad_lse is not None or grad_entropy is not None
        counted = torch.ones_like(targets, dtype=torch.bool) if every_row else targets != ignore_index
        row_chunk = min(n, row_chunk or n)
        sixteen_bit = e.dtype in (torch.bfloat16, torch.float16)
        triton_products = products == "triton"
        # cuBLAS over a counted prefix of the compacted rows, the Triton products over the rest (dE in compacted order)
        prefix = products == "prefix" and counted_prefix(counted_hint, row_chunk, tune["block_n"]) < row_chunk
        vocab_chunk = min(v, block_width)
        # 16-bit products with fp32 results where cuBLAS has them; where no such product exists (the CPU interpreter)
        # 16-bit operands are upcast.
        fp32_out = sixteen_bit and _launch.fp32_out_mm_available(device)
        upcast = sixteen_bit and not fp32_out and not triton_products  # (the interpreter's Triton products upcast)
        # G's row pitch: the chunk width padded to 16-byte aligned rows (the Triton products' descriptors and cuBLAS
        # both want aligned leading dimensions; the last, narrower chunk keeps the pitch)
        g_row_pitch = -(-vocab_chunk * e.element_size() // 16) * 16 // e.element_size()
        g_buf = torch.empty(row_chunk * g_row_pitch, dtype=e.dtype, device=device)
        # dE in fp32 until every vocabulary chunk has added to it; dC of one vocabulary chunk in fp32 where several
        # row chunks add to it: each gradient is rounded once, whatever N
        de32 = (de_out if de_is_sums else torch.empty((n, d), dtype=torch.float32, device=device)) if need_e else None
        # (the counted-prefix products sum cuBLAS's part there too, and the tail writes dC from it)
        dc_sums_fp32 = need_c and n > row_chunk
        dc32 = (
            torch.empty((vocab_chunk, d), dtype=torch.float32, device=device)
            if dc_sums_fp32 or (need_c and prefix)
            else None
        )
        lse = lse.contiguous()
        grad_rows = grad_rows.to(torch.float32).contiguous()
        grad_lse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(torch.float32).contiguous()
            mean_logit = mean_logit.to(torch.float32).contiguous()
        targets = targets.contiguous()
        # 0, or NaN when any of C / bias is not finite (then every logit row holds a NaN)
        weight_poison = _launch.weight_poison(c, bias, compute_dtype)  # (as autocast converts a wider head)
        c_buf = None
        if convert_c:
            bias = None if bias is None else bias.to(compute_dtype)
            c_buf = torch.empty((vocab_chunk, d), dtype=compute_dtype, device=device)
        # every in-vocabulary target's logit (ignored rows too: with grad_lse their target entry still has a gradient)
        target_logit = _target_logits(e, c, targets, bias, softcap, compute_dtype if convert_c else None)
        block_n, block_v, block_d = tune["block_n"], tune["block_v"], tune["block_d"]
        use_tma = _forward.tma_operands(e, c_buf if convert_c else c, tune)
        compact_g = triton_products or prefix
        # (the compacted copies of E's rows live in dE's rows while those are free: where dE is not its own fp32 sums
        # and the dtypes agree)
        spare_rows = de_out if need_e and not de_is_sums and de_out.dtype == e.dtype else None
        chunks = [
            _RowChunk.of(
                e, counted, r0, min(row_chunk, n - r0), weight_poison, spare_rows, block_n, block_d,
                compact=(compact_g and need_c) or use_tma, tma=use_tma, poison_sum=compact_g and need_c,
            )
            for r0 in range(0, n, row_chunk)
        ]  # fmt: skip
        tails = (
            [_PrefixTail.of(chunk, counted_prefix(counted_hint, chunk.rows, block_n)) for chunk in chunks]
            if prefix
            else None
        )
        self._recompute_args(
            chunks, tails, lse, grad_rows, grad_lse, grad_entropy, mean_logit, targets, target_logit, bias,
            softcap=softcap, label_smoothing=label_smoothing, v=v, d=d, compact_g=compact_g, need_bias=need_bias,
            use_tma=use_tma, dtype=e.dtype, tune=tune,
        )  # fmt: skip
        self.e, self.c, self.bias, self.targets = e, c, bias, targets
        self.bias_or_lse = bias if bias is not None else lse
        self.c_op = _launch.descriptor(c, [block_v, block_d]) if use_tma and not convert_c else c
        self.c_buf, self.convert_c, self.use_tma = c_buf, convert_c, use_tma
        self.block_n, self.block_v, self.block_d = block_n, block_v, block_d
        self.chunks, self.tails, self.prefix, self.triton_products = chunks, tails, prefix, triton_products
        self.vocab_chunk, self.g_buf, self.g_row_pitch = vocab_chunk, g_buf, g_row_pitch
        self.de_out, self.dc_out, self.dbias32, self.de32, self.dc32 = de_out, dc_out, dbias32, de32, dc32
        self.de_is_sums, self.dc_sums_fp32, self.upcast = de_is_sums, dc_sums_fp32, upcast
        self.out_dtype = {"out_dtype": torch.float32} if fp32_out else {}  # fp32 results, 16-bit operands
        self.programs = _launch.num_sms(device)  # a persistent grid: one program per multiprocessor
        return self

    def _recompute_args(
        self, chunks, tails, lse, grad_rows, grad_lse, grad_entropy, mean_logit, targets, target_logit, bias, *,
        softcap, label_smoothing, v, d, compact_g, need_bias, use_tma, dtype, tune,
    ):  # fmt: skip
        """The recompute kernel's arguments that do not change from one vocabulary chunk to the next."""
        block_n, block_v, block_d = tune["block_n"], tune["block_v"], tune["block_d"]
        # G's positions that some product reads: every row for cuBLAS over every row and for the bias gradient (a
        # sum over G's rows); in compacted order, the counted rows' blocks (the recompute stores those whole; the
        # Triton products read whole blocks and K steps that divide them: tests/kernels/test_backward.py checks the
        # tunings) and the cuBLAS prefix
        self.stored_rows = [
            chunk.rows if not compact_g or need_bias else (tails[k].h if tails is not None else 0)
            for k, chunk in enumerate(chunks)
        ]
        # per row chunk, the recompute's row-indexed arguments (sliced once here, not once per vocabulary chunk: the
        # host's launch work is what a small N waits on)
        self.chunk_rows_args = [
            (
                lse[r0:],
                grad_rows[r0:],
                (grad_rows if grad_lse is None else grad_lse)[r0:],
                (grad_rows if grad_entropy is None else grad_entropy)[r0:],
                (grad_rows if grad_entropy is None else mean_logit)[r0:],
                targets[r0:],
                target_logit[r0:],
            )
            for r0 in (chunk.r0 for chunk in chunks)
        ]
        self.flags = dict(
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_LSE_GRAD=grad_lse is not None,
            HAS_ENTROPY_GRAD=grad_entropy is not None,
            COMPACT_G=compact_g,
            TMA=use_tma,
            UPCAST=_launch.upcast_dots(dtype),
            DOT_PRECISION=_launch.dot_precision(dtype),
            EVEN_D=(d % block_d == 0),
            BLOCK_N=block_n,
            BLOCK_V=block_v,
            BLOCK_D=block_d,
            GROUP_V=max(1, tune["recompute_group"] // block_v),
            num_warps=tune["num_warps"],
            num_stages=_launch.fit_num_stages(tune["num_stages"], block_n, block_v, block_d, dtype.itemsize),
        )
        softcap_val = float(softcap) if softcap is not None else 1.0
        self.label_weights = (softcap_val, 1.0 - label_smoothing, label_smoothing / v)

    def vocab_chunk_step(self, v0: int) -> None:
        """The vocabulary chunk from ``v0``: per row chunk the recompute into G, then its products."""
        v, d = self.c.shape[0], self.e.shape[1]
        width = min(self.vocab_chunk, v - v0)
        c_chunk = self.c[v0 : v0 + width]
        # a head stored in another dtype: this chunk converted; the recompute then reads it (and the bias, and the
        # targets) from the chunk's own first entry
        chunk_start, chunk_vocab, chunk_bias, chunk_args, c_op = (
            v0,
            v,
            self.bias_or_lse,
            self.chunk_rows_args,
            self.c_op,
        )
        if self.convert_c:
            c_chunk = self.c_buf[:width].copy_(c_chunk)
            c_op = _launch.descriptor(c_chunk, [self.block_v, self.block_d]) if self.use_tma else c_chunk
            chunk_start, chunk_vocab = 0, width
            chunk_bias = self.bias[v0:] if self.bias is not None else self.bias_or_lse
            local_targets = self.targets - v0
            chunk_args = [
                args[:5] + (local_targets[chunk.r0 :],) + args[6:]
                for args, chunk in zip(self.chunk_rows_args, self.chunks)
            ]
        c_chunk_mm = c_chunk.float() if self.upcast else c_chunk
        # where this vocabulary chunk's dC is summed: straight into dC (one row chunk, one product), else in fp32
        dc_sum = (
            self.dc32[:width]
            if self.dc_sums_fp32
            else (self.dc_out[v0 : v0 + width] if self.dc_out is not None else None)
        )
        for k, chunk in enumerate(self.chunks):
            rows = chunk.rows
            grad = _block(self.g_buf, rows, self.g_row_pitch)[:, :width]
            tiles = triton.cdiv(rows, self.block_n) * triton.cdiv(width, self.block_v)
            _recompute_grad_kernel[(min(tiles, self.programs),)](
                chunk.e_op, c_op, chunk_bias, *chunk_args[k], chunk.row_order, chunk.num_counted, chunk.row_poison,
                grad, rows, self.stored_rows[k], width, chunk_start, chunk_vocab, d,
                self.e.stride(0), self.e.stride(1), c_chunk.stride(0), c_chunk.stride(1), grad.stride(0),
                *self.label_weights,
                EVEN_TILE=(rows % self.block_n == 0 and width % self.block_v == 0),
                **self.flags,
            )  # fmt: skip
            if self.dbias32 is not None:
                self.dbias32[v0 : v0 + width] += grad.sum(dim=0, dtype=torch.float32)
            self._products(k, chunk, grad, v0, width, c_chunk, c_chunk_mm, dc_sum)
        if self.dc_sums_fp32:
            self.dc_out[v0 : v0 + width] = dc_sum

    def _products(self, k, chunk, grad, v0, width, c_chunk, c_chunk_mm, dc_sum) -> None:
        """dE and dC of one G block: the row-skipping Triton products, cuBLAS over the counted prefix and the Triton
        products past it, or cuBLAS over every row."""
        need_e, need_c = self.de32 is not None, self.dc_out is not None
        de_rows = self.de32[chunk.r0 : chunk.r0 + chunk.rows] if need_e else None
        if self.triton_products:
            _products.grad_products(
                grad,
                chunk.num_counted,
                c_chunk=c_chunk,
                de32=de_rows,
                row_order=chunk.row_order,
                row_poison=chunk.row_poison,
                accumulate_e=v0 > 0,
                e_compact=chunk.e_compact,
                dc_chunk=dc_sum,
                ignored_poison=chunk.ignored_poison,
                accumulate_c=k > 0,
            )
            return
        if self.prefix:
            self.tails[k].products(
                grad,
                c_chunk_mm,
                chunk,
                de_rows,
                dc_sum if need_c else None,
                self.dc32[:width] if need_c else None,
                upcast=self.upcast,
                first_vocab=v0 == 0,
                first_rows=k == 0,
                **self.out_dtype,
            )
            return
        upcast, out_dtype = self.upcast, self.out_dtype
        grad_mm = grad.float() if upcast else grad
        e_rows_mm = chunk.e_rows.float() if upcast else chunk.e_rows
        if need_e:
            _launch.product_into(de_rows, grad_mm, c_chunk_mm, accumulate=v0 > 0, vocab_dim="k", **out_dtype)
        if need_c:
            # 16-bit operands, fp32 sums (dc32) or a 16-bit dC written once; upcast operands (the CPU interpreter)
            # give fp32, rounded by the copy below
            fp32_sum = {} if upcast or dc_sum.dtype != torch.float32 else out_dtype
            if upcast and dc_sum.dtype != torch.float32:
                dc_sum.copy_(grad_mm.T @ e_rows_mm)
            else:
                _launch.product_into(dc_sum, grad_mm.T, e_rows_mm, accumulate=k > 0, vocab_dim="m", **fp32_sum)

    def finish(self):
        """``(dE, dC, dbias)``: dE put back in row order or rounded from its fp32 sums, dbias in the bias's dtype."""
        # the G block and the dC sums are free before dE is written (the uncompaction's temporary rows must not add to
        # their peak: cce_inductor.paths.lean_peak)
        self.g_buf = self.dc32 = None
        de_out, de32 = self.de_out, self.de32
        if de_out is not None and self.prefix:
            for chunk in self.chunks:  # dE was summed in each chunk's compacted order
                rows = slice(chunk.r0, chunk.r0 + chunk.rows)
                _uncompact_rows(de_out[rows], de32[rows], chunk.row_order)
        elif de_out is not None and not self.de_is_sums:
            de_out.copy_(de32)
        self.de32 = None
        dbias = self.dbias32.to(self.bias.dtype) if self.dbias32 is not None else None
        return de_out, self.dc_out, dbias
