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
a G tile transposed in shared memory), tiles in groups of ``GROUP_M`` row blocks (Triton's matmul tutorial); one
program per tile, or (``persistent``) one per multiprocessor with the tile and K loops flattened into one, so that
a tile's epilogue overlaps the next tile's loads.  The epilogue reads and writes the pair: 8 bytes per element of
dC per chunk, as an fp32 running sum would.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._products import _grouped_tile
from ._tile import dot

# Hopper; the interpreter's tiny blocks keep the CPU tests fast.
# persistent: the flattened persistent loop (_pair_product_persistent_kernel) rather than one program per tile;
# prefetch (one program per tile): the pair's old values loaded before the K loop.  The GPU entry is the fastest of
# benchmarks/pair_sums_ab.py's configurations (the engineering log has the table).
_TUNING = {
    "gpu": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, persistent=False,
                prefetch=False),
    "interpret": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1, persistent=True,
                      prefetch=False),
}


@triton.jit
def _round_rne(x, DTYPE: tl.constexpr, ROUND_RNE: tl.constexpr):
    """fp32 -> DTYPE, to nearest even.  ``ROUND_RNE`` (bf16 under the interpreter, whose cast truncates): the bits
    are rounded first, after which the truncating cast is exact."""
    if ROUND_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _pair_tile(acc, hi_desc, lo_desc, m0, n0, ACCUMULATE: tl.constexpr, ROUND_RNE: tl.constexpr):
    """The epilogue of one tile: ``t = acc (+ hi + lo)``, ``hi = round(t)``, ``lo = round(t - hi)``."""
    if ACCUMULATE:
        acc += hi_desc.load([m0, n0]).to(tl.float32)
        acc += lo_desc.load([m0, n0]).to(tl.float32)
    hi = _round_rne(acc, hi_desc.dtype, ROUND_RNE)
    lo = _round_rne(acc - hi.to(tl.float32), hi_desc.dtype, ROUND_RNE)
    hi_desc.store([m0, n0], hi)
    lo_desc.store([m0, n0], lo)


@triton.jit
def _pair_product_kernel(
    a_desc, b_desc, hi_desc, lo_desc, Hi, Lo, M, N, K, stride_pair,
    ACCUMULATE: tl.constexpr, ROUND_RNE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``(hi, lo) (+)= A^T @ B`` for tile ``program_id(0)``: A is ``K x M`` (G of one row chunk), B ``K x N``; the
    pair's tiles through the tensor-memory accelerator too (reads past an edge give 0, stores past it are dropped).
    ``PREFETCH``: the pair's old values are loaded (plain loads, which do not wait) before the K loop, so that their
    reads overlap the tile's products."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    if PREFETCH and ACCUMULATE:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_pair + cols[None, :]
        old = tl.load(Hi + offs, mask=mask, other=0.0).to(tl.float32) + \
            tl.load(Lo + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([k0, m0])
        b = b_desc.load([k0, n0])
        acc = dot(tl.trans(a), b, acc, UPCAST, DOT_PRECISION)
    if PREFETCH and ACCUMULATE:
        _pair_tile(acc + old, hi_desc, lo_desc, m0, n0, False, ROUND_RNE)
    else:
        _pair_tile(acc, hi_desc, lo_desc, m0, n0, ACCUMULATE, ROUND_RNE)


@triton.jit
def _pair_product_persistent_kernel(
    a_desc, b_desc, hi_desc, lo_desc, M, N, K,
    ACCUMULATE: tl.constexpr, ROUND_RNE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """The same product on a persistent grid: each program takes every ``NUM_PROGRAMS``-th tile, and the tile loop
    and its K loop are one flattened loop, so that the pipeliner fetches the next tile's operands while a tile's
    epilogue reads and writes the pair."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles = num_m * num_n
    pid = tl.program_id(0)
    done = pid - NUM_PROGRAMS  # the tile whose epilogue comes next
    ki = -1
    pid_m, pid_n = 0, 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = k_tiles * tl.cdiv(tiles - pid, NUM_PROGRAMS)
    for _ in tl.range(0, steps, flatten=True):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            done += NUM_PROGRAMS
            pid_m, pid_n = _grouped_tile(done, num_m, num_n, GROUP_M)
        a = a_desc.load([ki * BLOCK_K, pid_m * BLOCK_M])
        b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])
        acc = dot(tl.trans(a), b, acc, UPCAST, DOT_PRECISION)
        if ki == k_tiles - 1:
            _pair_tile(acc, hi_desc, lo_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, ACCUMULATE, ROUND_RNE)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


def pair_product(hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """Launch helper: ``(hi, lo) (+)= a^T @ b`` (module docstring).  ``a``: ``K x M``, ``b``: ``K x N``, both in one
    16-bit or fp32 dtype; ``hi`` / ``lo``: ``M x N``, one 16-bit dtype; all four readable by the tensor-memory
    accelerator (:func:`_launch.tma_ok`)."""
    k, m = a.shape
    n = b.shape[1]
    tune = dict(_launch.tuning(_TUNING))
    persistent = tune.pop("persistent")
    prefetch = tune.pop("prefetch")
    bm, bn, bk = tune["BLOCK_M"], tune["BLOCK_N"], tune["BLOCK_K"]
    tune["num_stages"] = _launch.fit_num_stages(tune["num_stages"], bm, bn, bk, a.element_size())
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    args = (_launch.descriptor(a, [bk, bm]), _launch.descriptor(b, [bk, bn]), _launch.descriptor(hi, [bm, bn]),
            _launch.descriptor(lo, [bm, bn]))
    flags = dict(ACCUMULATE=accumulate, ROUND_RNE=_launch.INTERPRET and hi.dtype == torch.bfloat16,
                 UPCAST=_launch.upcast_dots(a.dtype), DOT_PRECISION=_launch.dot_precision(a.dtype), **tune)
    if persistent and k > 0:
        programs = min(tiles, _launch.num_sms(a.device))
        _pair_product_persistent_kernel[(programs,)](*args, m, n, k, NUM_PROGRAMS=programs, **flags)
    else:
        _pair_product_kernel[(tiles,)](*args, hi, lo, m, n, k, hi.stride(0), PREFETCH=prefetch, **flags)


def split_pair(x32: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """``hi = round(x32)``, ``lo = round(x32 - hi)`` (a sum that is complete: one chunk's dE rows, say); ``x32`` is
    overwritten."""
    hi.copy_(x32)
    x32.sub_(hi)
    lo.copy_(x32)
