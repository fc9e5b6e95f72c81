"""Balanced path: the loss and its gradients in one pass over row chunks, through a bounded scratch of logits.

Used when the loss is a mean or a sum and the head needs gradients, where ``cce_inductor.paths`` picks it (the
pass and ``linear_cross_entropy`` ask it): then ``d loss / d (E, C, bias) = grad_loss * (dE, dC, dbias)`` with
``(dE, dC, dbias)`` the gradients of the loss itself, known at forward time.  Computing them there takes three
matmuls (logits, dE, dC) where the lean path takes four (forward log-sum-exp, recompute, dE, dC); the backward
only scales by ``grad_loss`` (plain aten, outside this module).

Math
----
Per row n (x = E[n] . C[v] rounded to the input dtype, as torch.compile's matmul rounds its logits):

    z[n, v]    = s * tanh((x + bias[v]) / s)          (z = x + bias without a softcap s)
    lse[n]     = log sum_v exp(z[n, v])
    row_loss   = lse - (1 - eps) z[n, t_n] - eps / V sum_v z[n, v]      (0 at ignored rows; eps: label smoothing)
    loss       = sum_n row_loss / #counted   (mean; #counted a device tensor)   |   sum_n row_loss   (sum)
    G[n, v]    = (exp(z - lse) - (1 - eps) [v == t_n] - eps / V) * (1 - (z / s)^2) * row_scale
                 row_scale = 1 / #counted (mean) | 1 (sum);  ignored rows: G = 0 (NaN where eager has NaN: below)
    dE = G @ C,   dC = G^T @ E,   dbias = sum_n G[n, :]

Chunk / grid layout
-------------------
R rows per chunk (``cce_inductor.paths.chunk_rows``: the most whose padded logits fit in the scratch the budget
leaves, a multiple of 128 once >= 128, at most N).  One flat scratch of R rows serves every chunk, each row
padded to a multiple of 64 elements (``ROW_ALIGN``), and every product over V is split at a multiple of 64
(``_launch.product_into``): cuBLAS runs a 16-bit product ~5x slower when a dimension is not a multiple of 8
elements, so GPT-2's 50257 and every other V run as fast as their aligned neighbours:

    once per call:  #counted and row_scale (``_targets.count_targets``: one program, and the op's range check);
                    the poison of E's rows and of C / bias (``_launch.nonfinite_rows`` / ``weight_poison``, below)
    for each row chunk [r0, r0 + R):
        S       = E[rows] @ C^T                          cuBLAS, into the scratch (input dtype)
        _softmax_grad_in_place_kernel, grid (R,)          one program per row, BLOCK_V columns at a time:
                   pass 1 reads the row: online max / sum of exps (fp32) per lane of the block, reduced
                          across lanes after the loop; the target logit, the row sum (eps > 0) -> row_loss[n]
                   pass 2 reads it again and overwrites it with G (fp32 math, stored in the input dtype)
                   ignored rows read nothing: pass 2 writes their G (0, or NaN for a non-finite row)
        dE[rows]  = S @ C                                cuBLAS, fp32 result (``out_dtype=float32``), one product
                                                          over all of V
        dC      (+)= S^T @ E[rows]                        cuBLAS, summed over the chunks in an fp32 V x D buffer
        dbias    += S.sum(0)                              fp32
The gradients are returned in fp32; the op's backward scales them by the upstream gradient and rounds once to the
inputs' dtype, so they carry no more rounding than torch.compile's, whatever that upstream gradient is.

Ignored rows are not skipped by the matmuls (their sizes must be known on the host, and the count of counted rows
lives on the device): a batch with many ignored targets is faster on the lean path.  NaN pattern: eager's softmax
gradient of an ignored row is 0, or NaN in the whole row when its log-sum-exp is NaN (a non-finite value in that
row of E, or anywhere in C / bias); ``EPoison`` (0 or NaN per row of E) plus ``CPoison`` (0 or NaN: C and bias)
reproduce it without reading the row.

Memory (above the inputs and the gradients themselves, R the chunk rows)
------
    scratch R * V (input dtype), the fp32 gradients 4 * (N + V) * D (+ 4 * V), N fp32 row losses; in the backward
    the rounded gradients 2 * (N + V) * D (16-bit) coexist with the fp32 ones until those are freed.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import _launch, _targets
from ._tile import softmax_grad, tanh

# One program streams one row in BLOCK_V columns; 16-byte vector loads of bf16 need BLOCK_V / (32 * num_warps) >= 8.
# Measured on the H100 (2048 rows, bf16; benchmarks/results/2026-11-25_h100_row-kernel-probe_v14.json): rows up to 64k
# entries (GPT-2's 50257) run best with 4096-wide blocks (0.37 ms against 0.59 with 2048), longer rows (Qwen2.5,
# Llama-3, Gemma-2) with 2048 / 8 warps, within 1-3% of the other shapes tried.
_TUNING = {
    "gpu": dict(block_v=2048, num_warps=8, short_row=65536, short_row_block_v=4096),
    "interpret": dict(block_v=64, num_warps=4, short_row=0, short_row_block_v=64),
}


@triton.jit
def _load_z(row_ptr, Bias, cols, mask, softcap, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            EVICT: tl.constexpr):
    """One block of a row's (softcapped) logits in fp32; 0-based past V (callers mask)."""
    x = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x = softcap * tanh(x / softcap)
    return x


@triton.jit
def _round_bf16_rne(x):
    """fp32 -> the nearest bf16 value (ties to even), still in fp32.  Only under the interpreter, whose fp32 ->
    bf16 cast truncates (the GPU's cvt.rn rounds to nearest); after it the truncating cast is exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _softmax_grad_in_place_kernel(
    S, Bias, Targets, EPoison, CPoison, RowScale, RowLoss,
    row0, V, stride_row, ignore_index, softcap, target_weight, uniform,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGIT_SUM: tl.constexpr, ROUND_RNE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Row ``program_id(0)`` of the chunk that starts at row ``row0``: reads its logits from ``S``, writes its loss
    (unscaled, 0 if ignored) to ``RowLoss[row0 + row]`` and overwrites the row of ``S`` with its scaled softmax
    gradient.  ``RowScale``: a one-element fp32 device tensor (1 / #counted or 1), so the mean needs no host sync."""
    row = tl.program_id(0)
    row_ptr = S + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK_V)
    target = tl.load(Targets + row0 + row)
    if target == ignore_index:
        # nothing to read: the row's gradient is 0, or NaN where eager's would be (EPoison of the row + CPoison)
        poison = tl.load(EPoison + row0 + row) + tl.load(CPoison).to(tl.float32)
        fill = (poison + tl.zeros((BLOCK_V,), dtype=tl.float32)).to(S.dtype.element_ty)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            tl.store(row_ptr + cols, fill, mask=cols < V)
        tl.store(RowLoss + row0 + row, 0.0)
        return

    # pass 1: online log-sum-exp with one (max, sum) pair per *lane* of the block, reduced across lanes once after
    # the loop (no cross-warp reduction, with its barriers, inside the loop; on GPT-2's short rows 0.44 -> 0.37 ms
    # per 2048-row chunk).  One exp per element: the larger of (z, m) becomes the lane's max and the smaller enters
    # as exp(smaller - larger).  evict_last: ask L2 to keep the row for pass 2.
    m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_V,), tl.float32)
    z_sum = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = _load_z(row_ptr, Bias, cols, mask, softcap, HAS_BIAS, HAS_SOFTCAP, "evict_last")
        if LOGIT_SUM:
            z_sum += z  # 0 past V
        z = tl.where(mask, z, float("-inf"))  # columns past V add nothing to the sums
        above = z > m
        # a -inf logit adds 0 (also where the lane's max is still -inf, whose difference would be NaN); NaN and
        # +inf propagate to NaN as in eager
        smaller = tl.where(z == float("-inf"), 0.0, tl.exp(-tl.abs(z - m)))
        s = tl.where(above, s * smaller + 1.0, s + smaller)
        m = tl.maximum(m, z)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    z_sum = tl.sum(z_sum, axis=0)

    # the target's logit: one element of the row (targets outside [0, V) were refused by the op's check)
    safe_target = tl.minimum(tl.maximum(target, 0), V - 1)
    z_t = tl.load(row_ptr + safe_target).to(tl.float32)
    if HAS_BIAS:
        z_t += tl.load(Bias + safe_target).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * tanh(z_t / softcap)
    row_loss = lse - target_weight * z_t
    if LOGIT_SUM:
        row_loss -= uniform * z_sum
    tl.store(RowLoss + row0 + row, row_loss)

    # pass 2: the gradient, in place (each program owns its row: no other program reads it)
    scale = tl.load(RowScale)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = _load_z(row_ptr, Bias, cols, mask, softcap, HAS_BIAS, HAS_SOFTCAP, "evict_first")
        offset = target_weight * (cols == target).to(tl.float32) + uniform
        g = softmax_grad(z, lse, 1.0, 0.0, 0.0, offset, softcap, HAS_SOFTCAP, False) * scale
        if ROUND_RNE:
            g = _round_bf16_rne(g)
        tl.store(row_ptr + cols, g.to(S.dtype.element_ty), mask=mask)


class LossAndGrads(NamedTuple):
    """The loss (fp32 scalar) and its gradients in fp32; a gradient not asked for is None (dbias also without a
    bias)."""

    loss: torch.Tensor
    grad_e: Optional[torch.Tensor]
    grad_c: Optional[torch.Tensor]
    grad_bias: Optional[torch.Tensor]


# Scratch rows are padded to a multiple of this many elements (module docstring; ``cce_inductor.paths`` sizes the
# scratch with the same padding).
ROW_ALIGN = 64


def loss_and_grads(e, c, targets, bias, *, softcap, ignore_index, reduction, label_smoothing=0.0, chunk_rows,
                   need_e=True, need_c=True, need_bias=True, check_range=False) -> LossAndGrads:
    """Launch helper: :class:`LossAndGrads` of ``cross_entropy(softcap(e @ c.T + bias), targets)`` for reduction
    "mean" or "sum", ``chunk_rows`` rows at a time through one scratch of logits (module docstring)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"the balanced path computes reductions 'mean' and 'sum', got {reduction!r}")
    tune = _launch.tuning(_TUNING)
    n, d = e.shape
    v = c.shape[0]
    device, dtype = e.device, e.dtype
    need_bias = need_bias and bias is not None
    targets = targets.contiguous()
    # row_scale: 1 / #counted (inf when no row counts; then every row is ignored: G = 0) or 1
    num_counted, row_scale = _targets.count_targets(targets, ignore_index, mean=reduction == "mean",
                                                    check_vocab=v if check_range else None)

    # the gradients stay in fp32: the backward scales them and rounds once to the inputs' dtype
    grad_e = torch.empty((n, d), dtype=torch.float32, device=device) if need_e else None
    grad_c = torch.empty((v, d), dtype=torch.float32, device=device) if need_c else None
    grad_bias = torch.zeros((v,), dtype=torch.float32, device=device) if need_bias else None
    row_loss = torch.empty((n,), dtype=torch.float32, device=device)  # the kernel writes every row
    rows_per_chunk = max(1, min(chunk_rows, n))
    if n == 0 and need_c:
        grad_c.zero_()
    if n > 0:
        # 16-bit operands, fp32 results: cuBLAS's out_dtype products; where there are none (the CPU interpreter)
        # the operands are upcast
        upcast = dtype != torch.float32 and not _launch.fp32_out_mm_available(device)
        out_dtype = {"out_dtype": torch.float32} if dtype != torch.float32 and not upcast else {}
        # eager's NaN pattern of ignored rows, computed once for every chunk (the row kernel adds the two)
        zeros = torch.zeros(d, dtype=dtype, device=device)
        e_poison, c_poison = _launch.nonfinite_rows(e, zeros), _launch.weight_poison(c, bias, zeros)
        c_mm = c.float() if upcast else c
        pitch = triton.cdiv(v, ROW_ALIGN) * ROW_ALIGN  # whatever V is, no product sees an odd leading dimension
        scratch = torch.empty(rows_per_chunk * pitch, dtype=dtype, device=device)
        c_t = c.T
        e_mm = e.float() if upcast else e
        softcap_arg = float(softcap) if softcap is not None else 1.0
        block_v = tune["short_row_block_v"] if v <= tune["short_row"] else tune["block_v"]
        chunk_logits = scratch.view(rows_per_chunk, pitch)[:, :v]
        for r0 in range(0, n, rows_per_chunk):
            rows = min(rows_per_chunk, n - r0)
            logits = chunk_logits if rows == rows_per_chunk else chunk_logits[:rows]
            # rounded to the input dtype, as torch.compile's matmul rounds them
            _launch.product_into(logits, e[r0 : r0 + rows], c_t, accumulate=False, vocab_dim="n")
            _softmax_grad_in_place_kernel[(rows,)](
                logits, bias if bias is not None else row_scale, targets, e_poison, c_poison, row_scale, row_loss,
                r0, v, pitch, ignore_index, softcap_arg, 1.0 - label_smoothing, label_smoothing / v,
                HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, LOGIT_SUM=label_smoothing != 0.0,
                ROUND_RNE=_launch.INTERPRET and dtype == torch.bfloat16, BLOCK_V=block_v,
                num_warps=tune["num_warps"],
            )
            grad = logits.float() if upcast else logits  # the scratch now holds G
            if need_e:  # one product over all of V per row
                _launch.product_into(grad_e[r0 : r0 + rows], grad, c_mm, accumulate=False, vocab_dim="k",
                                     **out_dtype)
            if need_c:  # summed over the chunks in fp32
                _launch.product_into(grad_c, grad.T, e_mm[r0 : r0 + rows], accumulate=r0 > 0, vocab_dim="m",
                                     **out_dtype)
            if need_bias:
                grad_bias += grad.sum(dim=0, dtype=torch.float32)
            del grad
    total = row_loss.sum()
    loss = total / num_counted if reduction == "mean" else total  # 0 / 0 = NaN when every row is ignored, as eager
    return LossAndGrads(loss, grad_e, grad_c, grad_bias)
