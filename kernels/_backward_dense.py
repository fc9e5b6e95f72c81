"""Dense backward: vendor-BLAS products around one fused Triton softmax-gradient kernel.

Used when no gradient is filtered (``filter_eps == 0``, the default): then every logit tile contributes
to dE and dC, tile skipping has nothing to skip, and the tile kernel of ``_backward`` pays for its
generality (a recompute and two products per tile with atomic adds into dE and dC).  Here the three
products are plain GEMMs, which cuBLAS runs near the tensor-core peak, and only the elementwise part is
ours.

Math
----
Same G as ``_backward`` (g_n = grad_rows[n], 0 at ignored rows; s = softcap chain factor):

    raw[n, v] = E[n] . C[v]                                        (fp32 accumulation)
    z[n, v]   = softcap * tanh((raw + bias[v]) / softcap)          (no tanh without softcap)
    G[n, v]   = g_n * (exp(z - lse[n]) - [v == targets[n]]) * s[n, v]
    dE = G @ C,     dC = G^T @ E,     dbias = sum_n G[n, :]

Chunking / layout
-----------------
The (rows x vocabulary) plane is cut into ``row_chunk x vocab_chunk`` blocks; rows are the outer loop:

    for each row chunk R:                          dE32 = zeros(|R|, D) in fp32
        for each vocabulary chunk W:
            raw   = E[R] @ C[W]^T                  cuBLAS, fp32 out (16-bit inputs: ``mm(..., out_dtype)``)
            G     = _softmax_grad_kernel(raw)      Triton, grid (|R| / BLOCK_R, |W| / BLOCK_C) -> input dtype
            dE32 += G @ C[W]                       cuBLAS, fp32 accumulation across chunks
            dC[W] = G^T @ E[R]  (first R)          cuBLAS, written in place; later R: += (one rounding each)
            dbias32[W] += sum_rows G
        dE[R] = dE32

Memory above the outputs: one fp32 block (G overwrites it) plus the fp32 dE rows of one row chunk: with
8192-row chunks (the default) and 2048 vocabulary entries, 64 MB + 72 MB at D = 2304, whatever N is; longer
batches pay one extra bf16 rounding of dC per further row chunk.  G is rounded
to the input dtype before the products, as eager PyTorch does for the logits' gradient.  No atomics, so
the result is bitwise reproducible (``torch.use_deterministic_algorithms`` uses this path).  Ignored rows
are not skipped (a cuBLAS product cannot read a device-side row count); they have g = 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from ._tile import tanh


@triton.jit
def _softmax_grad_kernel(
    Raw, G, Bias, Lse, GradRows, Targets,
    n_rows, width, vocab_start, stride_raw, stride_g, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``G[r, c]`` of one (row chunk, vocabulary chunk) block from its raw logits; the block's rows start at
    ``Lse`` / ``GradRows`` / ``Targets`` and its columns at vocabulary id ``vocab_start``.

    G may overwrite Raw in place: row r of G starts at the first byte of row r of Raw and is no wider in
    bytes.  Each program owns whole rows and walks their columns left to right, so every store lands on
    bytes of columns it has already loaded (a 16-bit G column c sits inside fp32 Raw column c // 2)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    lse = tl.load(Lse + rows, mask=row_mask, other=0.0)
    grad_row = tl.load(GradRows + rows, mask=row_mask, other=0.0)
    target = tl.load(Targets + rows, mask=row_mask, other=-1)
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_mask = cols < width
        mask = row_mask[:, None] & col_mask[None, :]
        raw = tl.load(Raw + rows64[:, None] * stride_raw + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            raw += tl.load(Bias + vocab_start + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            capped = tanh(raw / softcap)
            logits = softcap * capped
        else:
            logits = raw
        one_hot = (vocab_start + cols)[None, :] == target[:, None]
        grad = grad_row[:, None] * (tl.exp(logits - lse[:, None]) - one_hot.to(tl.float32))
        if HAS_SOFTCAP:
            grad = grad * (1.0 - capped * capped)
        # Rows with g = 0 (ignored) get 0, not g * (p - onehot): their lse is 0 from the forward and exp(logits)
        # may overflow to inf.  A NaN / inf logit still gives NaN there, as eager's log-softmax backward does.
        grad = tl.where(grad_row[:, None] != 0.0, grad, logits * 0.0)
        tl.store(G + rows64[:, None] * stride_g + cols[None, :], grad.to(G.dtype.element_ty), mask=mask)


def _fp32_out_mm_available(device: torch.device) -> bool:
    """cuBLAS 16-bit products with an fp32 result (``aten::mm.dtype``; CUDA only, torch >= 2.8)."""
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``rows x cols`` view at the start of a flat scratch buffer (last chunks are narrower)."""
    return buffer[: rows * cols].view(rows, cols)


def backward_dense(e, c, targets, bias, lse, grad_rows, *, softcap, need_e, need_c, need_bias):
    """Launch helper: ``(dE | None, dC | None, dbias | None)``; ``grad_rows`` fp32, 0 at ignored rows."""
    cfg = _config.CONFIG
    n, d = e.shape
    v = c.shape[0]
    device = e.device
    need_bias = need_bias and bias is not None
    de_out = torch.empty((n, d), dtype=e.dtype, device=device) if need_e else None
    dc_out = torch.empty((v, d), dtype=c.dtype, device=device) if need_c else None
    dbias32 = torch.zeros((v,), dtype=torch.float32, device=device) if need_bias else None
    if n == 0 or not (need_e or need_c or need_bias):
        if need_c:
            dc_out.zero_()
        return de_out, dc_out, (dbias32.to(bias.dtype) if need_bias else None)

    row_chunk = min(n, cfg["dense_row_chunk"] or n)
    vocab_chunk = min(v, cfg["dense_vocab_chunk"])
    block_r, block_c = cfg["dense_block_r"], cfg["dense_block_c"]
    # Raw logits in fp32 (16-bit inputs: straight from cuBLAS through ``mm(..., out_dtype)``), so that
    # p = exp(z - lse) is formed from logits as precise as the forward's; where no such product exists (the
    # CPU interpreter) 16-bit operands are upcast.  G is written over the raw logits (see the kernel).
    sixteen_bit = e.dtype in (torch.bfloat16, torch.float16)
    fp32_out = sixteen_bit and _fp32_out_mm_available(device)
    upcast = sixteen_bit and not fp32_out
    out_dtype = {"out_dtype": torch.float32} if fp32_out else {}  # the products' fp32 results, 16-bit operands
    raw_buf = torch.empty(row_chunk * vocab_chunk, dtype=torch.float32, device=device)
    g_view = raw_buf.view(e.dtype) if sixteen_bit else raw_buf  # 16-bit: twice as many elements
    g_pitch = 2 if sixteen_bit else 1  # G's row stride in units of the chunk width
    de32 = torch.empty((row_chunk, d), dtype=torch.float32, device=device) if need_e else None
    lse = lse.contiguous()
    grad_rows = grad_rows.to(torch.float32).contiguous()
    targets = targets.contiguous()
    softcap_val = float(softcap) if softcap is not None else 1.0

    for r0 in range(0, n, row_chunk):
        rows = min(row_chunk, n - r0)
        e_rows = e[r0 : r0 + rows]
        e_rows_mm = e_rows.float() if upcast else e_rows
        de_rows = de32[:rows] if need_e else None
        for v0 in range(0, v, vocab_chunk):
            width = min(vocab_chunk, v - v0)
            c_chunk = c[v0 : v0 + width]
            c_chunk_mm = c_chunk.float() if upcast else c_chunk
            raw = _block(raw_buf, rows, width)
            torch.mm(e_rows_mm, c_chunk_mm.T, out=raw, **out_dtype)
            grad = _block(g_view, rows, g_pitch * width)[:, :width]
            _softmax_grad_kernel[(triton.cdiv(rows, block_r),)](
                raw, grad, bias if bias is not None else raw, lse[r0:], grad_rows[r0:], targets[r0:],
                rows, width, v0, raw.stride(0), grad.stride(0), softcap_val,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=4,
            )
            grad_mm = grad.float() if upcast else grad
            if need_e:
                torch.addmm(de_rows, grad_mm, c_chunk_mm, beta=0 if v0 == 0 else 1, out=de_rows, **out_dtype)
            if need_c:
                dc_chunk = dc_out[v0 : v0 + width]
                if upcast:
                    update = grad_mm.T @ e_rows_mm
                    dc_chunk.copy_(update if r0 == 0 else dc_chunk.float() + update)
                else:
                    torch.addmm(dc_chunk, grad.T, e_rows, beta=0 if r0 == 0 else 1, out=dc_chunk)
            if need_bias:
                dbias32[v0 : v0 + width] += grad.sum(dim=0, dtype=torch.float32)
        if need_e:
            de_out[r0 : r0 + rows] = de_rows
    return de_out, dc_out, (dbias32.to(bias.dtype) if need_bias else None)
