"""Gradient products of the dense backward over compacted rows: dE and dC of one G block, in Triton, sized by
a device-side row count.  Always with ``products="triton"``; with ``products="auto"`` (the default) over the rows
past the cuBLAS products' counted prefix, or alone after a call that counted at most 40% of its rows (``_backward``,
``counted_hint``; ``cce_inductor/_counted_share.py``).

The backward (``_backward``) holds the softmax gradient of one (row chunk x vocabulary chunk)
block, G, with the chunk's rows in *compacted* order: position p of G is local row ``row_order[p]``, and the
``num_counted`` rows that count (target not ignored) come first.  Vendor-BLAS products must be sized on the
host, so they multiply the ignored rows' zeros too; these kernels read ``num_counted`` on the device and skip
them, with no host synchronisation.

Math (one block: positions p < rows, vocabulary entries v0 <= v < v0 + width; K = num_counted)
----
    dE32[row_order[p], :] (+)= sum_{j < width} G[p, j] * C[v0 + j, :]            p in row blocks reaching below K
    dE32[row_order[p], :]     = poison[row_order[p]]                             other p, first vocabulary chunk
    dC[v0 + j, :]       (+)= sum_{p < K'} G[p, j] * Ec[p, :]  + ignored_poison      Ec = E[row_order]

fp32 accumulation.  dE32 is an fp32 buffer; the first vocabulary chunk writes it, later chunks add to it.  dC is
written in its own dtype; the first row chunk writes it, later row chunks add to it (one rounding each).  K' is K
rounded up to ``BLOCK_K``; the positions between K and K' are ignored rows, and so are the rows past K in a row
block that reaches below K: their G is their poison, the contribution eager's product makes for them.

Eager's NaN pattern for the rows skipped: an ignored row's G is 0 * (softmax - 0), NaN where its logits are (a
non-finite row of E, or any non-finite entry of C / bias); ``poison`` holds that per row (0 or NaN), and
``ignored_poison`` is their sum, which eager's dC receives from every ignored row.

Block / grid layout
-------------------
Tiled GEMMs with a ``BLOCK_M x BLOCK_N`` fp32 accumulator and a K loop in ``BLOCK_K`` steps, software-pipelined
``num_stages`` deep, operand tiles fetched by the tensor-memory accelerator (host-built descriptors; reads past
an edge give 0), programs ordered in groups of ``GROUP_M`` row blocks so that consecutive programs share
operand tiles in L2 (Triton's matmul tutorial):

    dE tiles   cdiv(rows, BLOCK_M) * cdiv(D, BLOCK_N)    M = positions, N = D, K = width
               a row block past K (ignored rows only) computes nothing; rows scattered through row_order
    dC tiles   cdiv(width, BLOCK_M) * cdiv(D, BLOCK_N)   M = vocabulary, N = D, K = positions < K'
               the A tile is a G tile transposed in shared memory

One launch (``_grad_products_kernel``) takes both: its first programs the dE tiles, the rest the dC tiles (the two
products read the same G and write disjoint outputs; one launch per vocabulary chunk instead of two, where the
backward at >= 50% ignored rows waits on the host's launch work).

Descriptors need 16-byte aligned bases and row strides (:func:`_launch.tma_ok`): the caller pads G's row pitch and falls
back to cuBLAS products for a C that is not aligned.  Ec is a compacted copy of the chunk's rows of E (one
``rows x D`` buffer): gathering through row_order inside the K loop instead is slower (no TMA gather on
Hopper).

Cost (measured per block by an A/B probe; the figures are in docs/): per row, these products are
slower than cuBLAS's, so over every row they lose; with ignored rows they skip work cuBLAS cannot, and past a
break-even share of ignored rows they win.  Hence, by default, cuBLAS over the counted prefix and these products
only past it (or alone where most rows are ignored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._tile import dot, round_bf16_rne

# Hopper; the interpreter's tiny blocks keep the CPU tests fast.
_TUNING = {
    "gpu": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    "interpret": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
}
# The logits product's tiles: BLOCK_M must be the products' (a row block is skipped or computed whole in both).
_LOGITS_TUNING = {
    "gpu": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    "interpret": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1),
}


@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in grouped order: GROUP_M row blocks sweep the columns together."""
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _grad_products_kernel(
    ge_desc, c_desc,
    DE,
    RowOrder, RowPoison,
    gc_desc, e_desc,
    DC,
    AccIn, IgnoredPoison, NumCounted,
    n_rows, width, D,
    stride_de, stride_dc, stride_acc,
    e_tiles,
    HAS_E: tl.constexpr, HAS_C: tl.constexpr, ACCUMULATE_E: tl.constexpr, ACCUMULATE_C: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """dE's tiles (programs ``[0, e_tiles)``) and dC's (the rest) of one G block in one launch: the two products
    read the same G and write disjoint outputs, and one launch is one host call fewer per vocabulary chunk (the
    backward at >= 50% ignored rows waits on the host's launches)."""
    pid = tl.program_id(0)
    if pid < e_tiles:
        if HAS_E:  # DE[row_order[p]] (+)= G[p] @ C[chunk] (descriptors over G and the C chunk)
            pid_m, pid_n = _grouped_tile(pid, tl.cdiv(n_rows, BLOCK_M), tl.cdiv(D, BLOCK_N), GROUP_M)
            pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            in_chunk = pos < n_rows
            rows = tl.load(RowOrder + pos, mask=in_chunk, other=0).to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            de_mask = in_chunk[:, None] & (cols < D)[None, :]
            de_ptrs = DE + rows[:, None] * stride_de + cols[None, :]
            if pid_m * BLOCK_M >= tl.load(NumCounted):
                if not ACCUMULATE_E:
                    poison = tl.load(RowPoison + rows, mask=in_chunk, other=0.0)
                    tl.store(de_ptrs, poison[:, None] + tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=de_mask)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, width, BLOCK_K):
                    a = ge_desc.load([pid_m * BLOCK_M, k0])
                    b = c_desc.load([k0, pid_n * BLOCK_N])
                    acc = dot(a, b, acc, UPCAST, DOT_PRECISION)
                if ACCUMULATE_E:
                    acc += tl.load(de_ptrs, mask=de_mask, other=0.0)
                tl.store(de_ptrs, acc, mask=de_mask)
    else:
        # DC[chunk] = (AccIn[chunk] +) G[:K'].T @ Ec[:K'] + ignored_poison (descriptors over G and Ec; AccIn is DC
        # itself, or the fp32 sums of a product over earlier rows); the K loop runs unmasked to the count rounded up
        # to BLOCK_K (module docstring)
        if HAS_C:
            pid_m, pid_n = _grouped_tile(pid - e_tiles, tl.cdiv(width, BLOCK_M), tl.cdiv(D, BLOCK_N), GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, tl.load(NumCounted), BLOCK_K):
                a = gc_desc.load([k0, pid_m * BLOCK_M])
                b = e_desc.load([k0, pid_n * BLOCK_N])
                acc = dot(tl.trans(a), b, acc, UPCAST, DOT_PRECISION)
            acc += tl.load(IgnoredPoison)
            vocab = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            dc_mask = (vocab < width)[:, None] & (cols < D)[None, :]
            dc_ptrs = DC + vocab.to(tl.int64)[:, None] * stride_dc + cols[None, :]
            if ACCUMULATE_C:
                acc_ptrs = AccIn + vocab.to(tl.int64)[:, None] * stride_acc + cols[None, :]
                acc += tl.load(acc_ptrs, mask=dc_mask, other=0.0).to(tl.float32)
            tl.store(dc_ptrs, acc.to(DC.dtype.element_ty), mask=dc_mask)


@triton.jit
def _logits_kernel(
    e_desc, c_desc, s_desc,
    NumCounted,
    n_rows, width, D,
    ROUND_RNE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``S[p, :width] = Ec[p] @ C[:width]^T`` rounded to S's dtype, for the row blocks reaching below K (tile
    ``program_id(0)``; descriptors over Ec, C and S): the balanced path's logits over compacted rows."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.cdiv(width, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(NumCounted):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = e_desc.load([pid_m * BLOCK_M, k0])
            b = c_desc.load([pid_n * BLOCK_N, k0])
            acc = dot(a, tl.trans(b), acc, UPCAST, DOT_PRECISION)
        if ROUND_RNE:
            acc = round_bf16_rne(acc)
        s_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(s_desc.dtype))


def _launch_args(element_size: int):
    launch = dict(_launch.tuning(_TUNING))
    # fit_num_stages sizes one (rows x K) + (cols x K) operand pair per stage, the same bytes as here
    launch["num_stages"] = _launch.fit_num_stages(
        launch["num_stages"], launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"], element_size
    )
    return launch


def _dot_flags(dtype: torch.dtype):
    return dict(UPCAST=_launch.upcast_dots(dtype), DOT_PRECISION=_launch.dot_precision(dtype))


def grad_products(
    grad: torch.Tensor,
    num_counted: torch.Tensor,
    *,
    c_chunk: torch.Tensor | None = None,
    de32: torch.Tensor | None = None,
    row_order: torch.Tensor | None = None,
    row_poison: torch.Tensor | None = None,
    accumulate_e: bool = False,
    e_compact: torch.Tensor | None = None,
    dc_chunk: torch.Tensor | None = None,
    ignored_poison: torch.Tensor | None = None,
    accumulate_c: bool = False,
    acc_in: torch.Tensor | None = None,
) -> None:
    """Launch helper, one launch for dE and / or dC of one G block (``grad``: rows x width, compacted rows;
    ``num_counted``: the device-side count K).  dE where ``de32`` is given: ``de32[row_order[p]] (+)= grad[p] @
    c_chunk`` for the row blocks holding counted positions, the other rows get ``row_poison`` on the first chunk
    (``accumulate_e=False``); ``de32`` fp32 (rows x D).  dC where ``dc_chunk`` is given: ``dc_chunk (+)=
    grad[:K'].T @ e_compact[:K'] + ignored_poison`` (``e_compact = e_rows[row_order]``); ``dc_chunk`` (width x D,
    contiguous rows) in the input dtype or fp32; ``acc_in`` (with ``accumulate_c``): the fp32 sums added instead of
    ``dc_chunk``'s own values (the cuBLAS product over the rows before ``grad``'s, one rounding in all).  ``grad``,
    ``c_chunk`` and ``e_compact`` share the input dtype and pass :func:`_launch.tma_ok`."""
    rows, width = grad.shape
    has_e, has_c = de32 is not None, dc_chunk is not None
    if not (has_e or has_c):
        return
    d = (c_chunk if has_e else e_compact).shape[1]
    launch = _launch_args(grad.element_size())
    bm, bn, bk = launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"]
    e_tiles = triton.cdiv(rows, bm) * triton.cdiv(d, bn) if has_e else 0
    c_tiles = triton.cdiv(width, bm) * triton.cdiv(d, bn) if has_c else 0
    if has_e:
        ge_desc, c_desc = _launch.descriptor(grad, [bm, bk]), _launch.descriptor(c_chunk, [bk, bn])
    if has_c:
        gc_desc, e_desc = _launch.descriptor(grad, [bk, bm]), _launch.descriptor(e_compact, [bk, bn])
        # The interpreter rounds fp32 -> 16-bit stores toward zero (the GPU to nearest even): there the kernel
        # writes fp32 and torch rounds.
        out = dc_chunk.float() if _launch.INTERPRET and dc_chunk.dtype != torch.float32 else dc_chunk
        acc_in = out if acc_in is None else acc_in
    e_args = (ge_desc, c_desc, de32, row_order, row_poison) if has_e else None
    c_args = (gc_desc, e_desc, out, acc_in, ignored_poison) if has_c else None
    # (an absent product's arguments repeat the other's tensors: the kernel never reads them)
    e_args = e_args or (c_args[0], c_args[1], c_args[2], num_counted, c_args[4])
    c_args = c_args or (e_args[0], e_args[1], e_args[2], e_args[2], e_args[4])
    _grad_products_kernel[(e_tiles + c_tiles,)](
        *e_args,
        *c_args,
        num_counted,
        rows,
        width,
        d,
        e_args[2].stride(0),
        c_args[2].stride(0),
        c_args[3].stride(0),
        e_tiles,
        HAS_E=has_e,
        HAS_C=has_c,
        ACCUMULATE_E=accumulate_e,
        ACCUMULATE_C=accumulate_c,
        **_dot_flags(grad.dtype),
        **launch,
    )
    if has_c and out is not dc_chunk:
        dc_chunk.copy_(out)


def skip_block() -> int:
    """The row blocks these products skip or compute whole (their ``BLOCK_M``): rows past the count up to the next
    multiple of it are read, so they must hold real data (an ignored row's G: its poison)."""
    return _launch.tuning(_TUNING)["BLOCK_M"]


def logits_product(out: torch.Tensor, e_compact: torch.Tensor, c: torch.Tensor, num_counted: torch.Tensor) -> None:
    """Launch helper: ``out[p] = e_compact[p] @ c^T`` (rounded to ``out``'s dtype) for the row blocks of
    :func:`skip_block` rows that hold a position below ``num_counted`` (a 1-element int32 device tensor, the count
    relative to ``e_compact``'s first row); the other rows of ``out`` are left as they are.  ``out``: rows x width
    (a view with aligned row pitch), ``c``: width x D; all three pass :func:`_launch.tma_ok`, one dtype."""
    rows, width = out.shape
    d = e_compact.shape[1]
    launch = dict(_launch.tuning(_LOGITS_TUNING))
    bm, bn, bk = launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"]
    launch["num_stages"] = _launch.fit_num_stages(launch["num_stages"], bm, bn, bk, e_compact.element_size())
    _logits_kernel[(triton.cdiv(rows, bm) * triton.cdiv(width, bn),)](
        _launch.descriptor(e_compact, [bm, bk]),
        _launch.descriptor(c, [bn, bk]),
        _launch.descriptor(out, [bm, bn]),
        num_counted,
        rows,
        width,
        d,
        ROUND_RNE=_launch.INTERPRET and out.dtype == torch.bfloat16,
        **_dot_flags(e_compact.dtype),
        **launch,
    )
