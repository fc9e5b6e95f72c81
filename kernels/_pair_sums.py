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
rounding (|t - hi - lo| <= 2^-8 ulp(hi) for bf16), and ``hi`` alone is the sum rounded once.

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
# benchmarks/pair_sums_ab.py's configurations (measured; the figures are in docs/).
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
    a_desc,
    b_desc,
    hi_desc,
    lo_desc,
    M,
    N,
    K,
    ACCUMULATE: tl.constexpr,
    ROUND_RNE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``(hi, lo) (+)= A^T @ B`` for tile ``program_id(0)``: A is ``K x M`` (G of one row chunk), B ``K x N``; the
    pair's tiles through the tensor-memory accelerator too (reads past an edge give 0, stores past it are dropped)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([k0, m0])
        b = b_desc.load([k0, n0])
        acc = dot(tl.trans(a), b, acc, UPCAST, DOT_PRECISION)
    if ACCUMULATE:
        acc += hi_desc.load([m0, n0]).to(tl.float32)
        acc += lo_desc.load([m0, n0]).to(tl.float32)
    hi = _round_rne(acc, hi_desc.dtype, ROUND_RNE)
    lo = _round_rne(acc - hi.to(tl.float32), hi_desc.dtype, ROUND_RNE)
    hi_desc.store([m0, n0], hi)
    lo_desc.store([m0, n0], lo)


def pair_product(hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """Launch helper: ``(hi, lo) (+)= a^T @ b`` (module docstring).  ``a``: ``K x M``, ``b``: ``K x N``, both in one
    16-bit or fp32 dtype; ``hi`` / ``lo``: ``M x N``, one 16-bit dtype; all four readable by the tensor-memory
    accelerator (:func:`_launch.tma_ok`)."""
    k, m = a.shape
    n = b.shape[1]
    tune = dict(_launch.tuning(_TUNING))
    bm, bn, bk = tune["BLOCK_M"], tune["BLOCK_N"], tune["BLOCK_K"]
    tune["num_stages"] = _launch.fit_num_stages(tune["num_stages"], bm, bn, bk, a.element_size())
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _pair_product_kernel[grid](
        _launch.descriptor(a, [bk, bm]),
        _launch.descriptor(b, [bk, bn]),
        _launch.descriptor(hi, [bm, bn]),
        _launch.descriptor(lo, [bm, bn]),
        m,
        n,
        k,
        ACCUMULATE=accumulate,
        ROUND_RNE=_launch.INTERPRET and hi.dtype == torch.bfloat16,
        UPCAST=_launch.upcast_dots(a.dtype),
        DOT_PRECISION=_launch.dot_precision(a.dtype),
        **tune,
    )


def split_pair(x32: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``hi = round(x32)``, ``lo = round(x32 - hi)`` (a sum that is complete: one chunk's dE rows, say); ``x32`` is
    overwritten."""
    hi.copy_(x32)
    x32.sub_(hi)
    lo.copy_(x32)
