"""A gradient summed over row chunks as a pair of 16-bit values: ``hi + lo``, each in the gradient's own dtype.

The balanced path computes dC = G^T @ E one row chunk at a time and must add the chunks without a rounding per
chunk (a 16-bit running sum loses more than torch.compile's one rounding) and without an fp32 ``V x D`` buffer beside
the 16-bit gradient.  The pair holds the running sum to ~16 mantissa bits in ``2 x`` the gradient's own bytes, and
``hi`` is the gradient's own storage: the op's backward rounds ``g * (hi + lo)`` once, into ``hi``'s buffer.

Math (one output tile; ``acc`` the chunk's product in fp32)
----
    first chunk:   t = acc
    later chunks:  t = (hi + lo) + acc           (hi + lo is exact in fp32: |lo| <= half an ulp of hi)
    hi = round(t),  lo = round(t - hi)           (round: to nearest even, to the pair's 16-bit dtype)

so after any number of chunks ``hi + lo`` is the fp32 sum of the chunk products to within the pair's remainder
rounding (|t - hi - lo| <= 2^-8 ulp(hi) for bf16), and ``hi`` alone is the sum rounded once.  Without ``lo`` the
same kernel is the plain 16-bit sum, ``hi = round(hi + acc)``: one rounding a chunk, which cuBLAS's 16-bit
``addmm`` (``beta = 1``) does not promise (at some shapes it rounds the product before adding).

Block / grid layout
-------------------
A tiled GEMM over the output ``M x N`` (M = rows of dC: the scratch's padded vocabulary, N = D) with a K loop over
the chunk's rows in ``BLOCK_K`` steps, operand and pair tiles moved by the tensor-memory accelerator (the A tile is
a G tile transposed in shared memory), one program per tile, tiles in groups of ``GROUP_M`` row blocks (Triton's
matmul tutorial).  The epilogue reads and writes the pair: 8 bytes per element of dC per chunk, as an fp32 running
sum would; it is not overlapped with the next tile's products (cuBLAS's fp32 ``addmm`` hides more of its own),
which is what the pair costs over cuBLAS's fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._products import _grouped_tile
from ._tile import dot, round_bf16_rne

# Hopper; the interpreter's tiny blocks keep the CPU tests fast.  The GPU entry is the fastest of
# configurations measured by an A/B probe (the figures are in docs/performance.md).
_TUNING = {
    "gpu": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "interpret": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
}


@triton.jit
def _round_rne(x, DTYPE: tl.constexpr, ROUND_RNE: tl.constexpr):
    """fp32 -> DTYPE, to nearest even.  ``ROUND_RNE`` (bf16 under the interpreter, whose cast truncates): the bits
    are rounded first, after which the truncating cast is exact."""
    if ROUND_RNE:
        x = round_bf16_rne(x)
    return x.to(DTYPE)


@triton.jit
def _pair_product_kernel(
    a_desc, b_desc, hi_desc, lo_desc,
    NumCounted, Poison,
    M, N, K,
    ACCUMULATE: tl.constexpr, HAS_LO: tl.constexpr, ROW_BOUND: tl.constexpr, HAS_POISON: tl.constexpr,
    ROUND_RNE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``(hi, lo) (+)= A^T @ B (+ poison)`` for tile ``program_id(0)``: A is ``K x M`` (G of one row chunk), B
    ``K x N``; the pair's tiles through the tensor-memory accelerator too (reads past an edge give 0, stores past it
    are dropped).  Without ``HAS_LO``, ``hi (+)= A^T @ B`` rounded once (the plain 16-bit sum).  ``ROW_BOUND``: only
    A's and B's first ``NumCounted`` rows (a device-side count, rounded up to ``BLOCK_K``) are read; an accumulating
    tile with none leaves the pair as it is."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    k_end = K
    if ROW_BOUND:
        k_end = tl.minimum(K, tl.load(NumCounted))
        if ACCUMULATE and not HAS_POISON and k_end <= 0:
            return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        a = a_desc.load([k0, m0])
        b = b_desc.load([k0, n0])
        acc = dot(tl.trans(a), b, acc, UPCAST, DOT_PRECISION)
    if HAS_POISON:
        acc += tl.load(Poison)
    if ACCUMULATE:
        acc += hi_desc.load([m0, n0]).to(tl.float32)
        if HAS_LO:
            acc += lo_desc.load([m0, n0]).to(tl.float32)
    hi = _round_rne(acc, hi_desc.dtype, ROUND_RNE)
    hi_desc.store([m0, n0], hi)
    if HAS_LO:
        lo = _round_rne(acc - hi.to(tl.float32), hi_desc.dtype, ROUND_RNE)
        lo_desc.store([m0, n0], lo)


def pair_product(
    hi: torch.Tensor,
    lo: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    accumulate: bool,
    num_counted: torch.Tensor | None = None,
    poison: torch.Tensor | None = None,
) -> None:
    """Launch helper: ``(hi, lo) (+)= a^T @ b (+ poison)`` (module docstring).  ``a``: ``K x M``, ``b``: ``K x N``,
    both in one 16-bit or fp32 dtype; ``hi`` / ``lo``: ``M x N``, one 16-bit dtype; all four readable by the
    tensor-memory accelerator (:func:`_launch.tma_ok`).  ``num_counted`` (a 1-element int32 device tensor): only the
    first that many rows of ``a`` and ``b`` (rounded up to the K step) are summed, and tiles with none are not touched
    (compacted rows, ignored ones last).  ``poison``: a 0-dim fp32 device tensor added to every element (0, or NaN
    where eager's gradient is NaN).  ``lo`` None: ``hi (+)= a^T @ b`` in hi's dtype, the fp32 product and hi added
    before the one rounding (the plain sum; cuBLAS's 16-bit ``addmm`` may round the product first)."""
    k, m = a.shape
    n = b.shape[1]
    tune = dict(_launch.tuning(_TUNING))
    bm, bn, bk = tune["BLOCK_M"], tune["BLOCK_N"], tune["BLOCK_K"]
    tune["num_stages"] = _launch.fit_num_stages(tune["num_stages"], bm, bn, bk, a.element_size())
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    hi_desc = _launch.descriptor(hi, [bm, bn])
    _pair_product_kernel[grid](
        _launch.descriptor(a, [bk, bm]),
        _launch.descriptor(b, [bk, bn]),
        hi_desc,
        hi_desc if lo is None else _launch.descriptor(lo, [bm, bn]),  # (without lo the kernel never reads it)
        num_counted if num_counted is not None else hi, poison if poison is not None else hi, m, n, k,
        ACCUMULATE=accumulate, HAS_LO=lo is not None, ROW_BOUND=num_counted is not None, HAS_POISON=poison is not None,
        ROUND_RNE=_launch.INTERPRET and hi.dtype == torch.bfloat16, UPCAST=_launch.upcast_dots(a.dtype),
        DOT_PRECISION=_launch.dot_precision(a.dtype),
        **tune,
    )  # fmt: skip


def split_pair(x32: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``hi = round(x32)``, ``lo = round(x32 - hi)`` (a sum that is complete: one chunk's dE rows, say); ``x32`` is
    overwritten."""
    hi.copy_(x32)
    x32.sub_(hi)
    lo.copy_(x32)


@triton.jit
def _split_rows_kernel(
    X32, Hi, Lo, RowIndex, D, stride_x, stride_out, HAS_LO: tl.constexpr, ROUND_RNE: tl.constexpr, BLOCK: tl.constexpr
):
    """Row ``program_id(0)`` of X32 split into the pair at row ``RowIndex[row]`` of hi / lo (without ``HAS_LO``:
    rounded once into hi), ``BLOCK`` columns per program ``program_id(1)``."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X32 + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    out_row = tl.load(RowIndex + row).to(tl.int64) * stride_out
    hi = _round_rne(x, Hi.dtype.element_ty, ROUND_RNE)
    tl.store(Hi + out_row + cols, hi, mask=mask)
    if HAS_LO:
        lo = _round_rne(x - hi.to(tl.float32), Hi.dtype.element_ty, ROUND_RNE)
        tl.store(Lo + out_row + cols, lo, mask=mask)


def split_rows_into(x32: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor | None, row_index: torch.Tensor) -> None:
    """Launch helper: :func:`split_pair` of each row ``p`` of ``x32`` (fp32, rows x D) into row ``row_index[p]`` of
    ``hi`` / ``lo`` (one 16-bit dtype, contiguous rows; ``lo`` None: rounded once into ``hi``): a chunk's rows
    computed in compacted order put back."""
    rows, d = x32.shape
    if rows == 0:
        return
    block = 1024
    _split_rows_kernel[(rows, triton.cdiv(d, block))](
        x32,
        hi,
        lo if lo is not None else hi,
        row_index,
        d,
        x32.stride(0),
        hi.stride(0),
        HAS_LO=lo is not None,
        ROUND_RNE=_launch.INTERPRET and hi.dtype == torch.bfloat16,
        BLOCK=block if not _launch.INTERPRET else 64,
        num_warps=4,
    )
