"""Chunked PyTorch implementation of linear-cross-entropy: the CPU path and the CUDA fallback.

Same contract as the Triton kernels in ``cce_inductor.kernels`` (``forward`` / ``backward``), computed with
plain matmuls over row chunks of ``e`` and vocabulary chunks of ``c``, so at most one
``row_chunk x vocab_chunk`` block of logits exists at a time: memory O(chunk + N*D + V*D), never O(N*V).

    logits[n, v] = softcap * tanh((e[n] . c[v] + bias[v]) / softcap)        (no tanh without softcap)
    lse[n]       = log sum_v exp(logits[n, v])                                (online over vocab chunks)
    logit_sum[n] = sum_v logits[n, v]                                         (label smoothing only)
    mean_logit[n] = sum_v p[n, v] logits[n, v],  p = exp(logits - lse)       (entropy only: H = lse - mean_logit)
    dlogits[n,v] = p[n, v] (grad_rows[n] + grad_lse[n] + grad_entropy[n] (mean_logit[n] - logits[n, v]))
                   - grad_rows[n] ((1 - eps) [v == targets[n]] + eps / V)
                   (grad_lse / grad_entropy: the upstream gradients of lse / the entropy where asked for, else 0)
    draw         = dlogits * (1 - tanh^2)                                    (softcap chain rule)
    dE = draw @ c,   dC = draw^T @ e,   dbias = sum_n draw

The backward walks the vocabulary in the outer loop so each ``dC`` chunk is accumulated in full precision
and written once in ``c``'s dtype; ``dE`` is accumulated in full precision (O(N*D)); with ``in_accumulation_dtype``
every gradient is returned in the accumulation dtype, unrounded (the balanced path's split into 16-bit pairs).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows x vocabulary entries of one logits block: 1024 x 4096 fp32 = 16 MiB.
ROW_CHUNK = 1024
VOCAB_CHUNK = 4096


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits_block(e_rows: Tensor, c_block: Tensor, bias_block: Tensor | None, softcap: float | None):
    """Logits of one block in the accumulation dtype, and tanh (for the softcap gradient) or None."""
    raw = e_rows @ c_block.T
    if bias_block is not None:
        raw = raw + bias_block
    if softcap is None:
        return raw, None
    capped = torch.tanh(raw / softcap)
    return capped * softcap, capped


def forward(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    *,
    softcap: float | None,
    ignore_index: int,
    logit_sum: bool = False,
    mean_logit: bool = False,
    row_chunk: int = ROW_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
    argmax_out: Tensor | None = None,
    argmax_round: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Returns ``(lse, target_logit, logit_sum | None, mean_logit | None)``, each ``(N,)`` in the accumulation
    dtype, for every row (ignored ones too); the target logit is 0 where the target is ``ignore_index`` or outside
    ``[0, V)``. ``logit_sum``: also the sum of each row's logits (the label-smoothing
    term); ``mean_logit``: also each row's softmax-weighted mean logit (the entropy is ``lse - mean_logit``).
    ``argmax_out``: an int64 ``(N,)`` tensor that receives each row's ``argmax`` (see :func:`fold_argmax`) over the
    logits rounded to ``argmax_round`` (the dtype eager's logits have: ties there are ties here)."""
    n_rows, vocab = e.shape[0], c.shape[0]
    acc = accumulation_dtype(e.dtype)
    lse = torch.empty(n_rows, dtype=acc, device=e.device)
    target_logit = torch.empty(n_rows, dtype=acc, device=e.device)
    row_sums = torch.zeros(n_rows, dtype=acc, device=e.device) if logit_sum else None
    row_means = torch.empty(n_rows, dtype=acc, device=e.device) if mean_logit else None
    bias_acc = None if bias is None else bias.to(acc)
    for r0 in range(0, n_rows, row_chunk):
        e_rows = e[r0 : r0 + row_chunk].to(acc)
        running_max = torch.full((e_rows.shape[0],), float("-inf"), dtype=acc, device=e.device)
        running_sum = torch.zeros(e_rows.shape[0], dtype=acc, device=e.device)
        running_weighted = torch.zeros(e_rows.shape[0], dtype=acc, device=e.device)  # sum exp(z - max) z
        best = torch.full((e_rows.shape[0],), float("-inf"), dtype=acc, device=e.device)
        best_index = torch.zeros(e_rows.shape[0], dtype=torch.int64, device=e.device)
        for v0 in range(0, vocab, vocab_chunk):
            bias_block = None if bias_acc is None else bias_acc[v0 : v0 + vocab_chunk]
            logits, _ = _logits_block(e_rows, c[v0 : v0 + vocab_chunk].to(acc), bias_block, softcap)
            if row_sums is not None:
                row_sums[r0 : r0 + row_chunk] += logits.sum(dim=1)
            if argmax_out is not None:
                best, best_index = fold_argmax(best, best_index, logits, v0, argmax_round)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            rescale = torch.exp(running_max - new_max)
            exps = torch.exp(logits - new_max[:, None])
            running_sum = running_sum * rescale + exps.sum(dim=1)
            if row_means is not None:
                running_weighted = running_weighted * rescale + (exps * logits).sum(dim=1)
            running_max = new_max
        lse[r0 : r0 + row_chunk] = running_max + torch.log(running_sum)
        if argmax_out is not None:
            argmax_out[r0 : r0 + row_chunk] = best_index
        if row_means is not None:
            row_means[r0 : r0 + row_chunk] = running_weighted / running_sum

        # 0 where the target is ignore_index or outside [0, V) (a vocabulary shard's "another shard's target")
        rows_targets = targets[r0 : r0 + row_chunk]
        hit = (rows_targets != ignore_index) & (rows_targets >= 0) & (rows_targets < vocab)
        safe_targets = torch.where(hit, rows_targets, 0)
        raw = (e_rows * c[safe_targets].to(acc)).sum(dim=1)
        if bias_acc is not None:
            raw = raw + bias_acc[safe_targets]
        raw = raw if softcap is None else torch.tanh(raw / softcap) * softcap
        target_logit[r0 : r0 + row_chunk] = torch.where(hit, raw, 0.0)
    return lse, target_logit, row_sums, row_means


def fold_argmax(
    best: Tensor, best_index: Tensor, logits: Tensor, offset: int, round_to: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    """The running ``(max, argmax)`` of each row after one more block of its logits (columns ``offset + j``), with
    ``torch.argmax``'s ties: the first maximal index wins (``torch.argmax`` within the block, a strictly larger
    value across blocks) and a NaN is larger than everything. ``round_to``: compare the logits rounded to this dtype
    (eager's 16-bit logits tie where their fp32 sums differ)."""
    values = logits if round_to is None or round_to == logits.dtype else logits.to(round_to).to(logits.dtype)
    block_index = values.argmax(dim=1)
    block_max = values.gather(1, block_index[:, None]).squeeze(1)
    better = (block_max > best) | (block_max.isnan() & ~best.isnan())
    return torch.where(better, block_max, best), torch.where(better, block_index + offset, best_index)


def backward(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_rows: Tensor,
    *,
    softcap: float | None,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    label_smoothing: float = 0.0,
    grad_lse: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    mean_logit: Tensor | None = None,
    row_chunk: int = ROW_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
    in_accumulation_dtype: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients w.r.t. ``e``, ``c``, ``bias`` (each ``None`` unless asked for), in their dtypes, or all in the
    accumulation dtype with ``in_accumulation_dtype``. ``grad_rows`` is 0 at ignored rows."""
    n_rows, vocab = e.shape[0], c.shape[0]
    acc = accumulation_dtype(e.dtype)
    grad_e = torch.zeros(e.shape, dtype=acc, device=e.device) if need_e else None
    grad_c = torch.empty(c.shape, dtype=acc if in_accumulation_dtype else c.dtype, device=c.device) if need_c else None
    grad_bias = (
        torch.empty(vocab, dtype=acc if in_accumulation_dtype else bias.dtype, device=bias.device)
        if need_bias
        else None
    )
    if not (need_e or need_c or need_bias):
        return None, None, None

    e_acc = e.to(acc)
    grad_rows = grad_rows.to(acc)
    grad_p = grad_rows if grad_lse is None else grad_rows + grad_lse.to(acc)
    bias_acc = None if bias is None else bias.to(acc)
    for v0 in range(0, vocab, vocab_chunk):
        c_block = c[v0 : v0 + vocab_chunk].to(acc)
        width = c_block.shape[0]
        bias_block = None if bias_acc is None else bias_acc[v0 : v0 + vocab_chunk]
        grad_c_block = torch.zeros_like(c_block) if need_c else None
        grad_bias_block = torch.zeros(width, dtype=acc, device=e.device) if need_bias else None
        for r0 in range(0, n_rows, row_chunk):
            e_rows = e_acc[r0 : r0 + row_chunk]
            logits, capped = _logits_block(e_rows, c_block, bias_block, softcap)
            rows_grad = grad_rows[r0 : r0 + row_chunk, None]
            weight = grad_p[r0 : r0 + row_chunk, None]
            if grad_entropy is not None:
                rows_mean = mean_logit[r0 : r0 + row_chunk, None].to(acc)
                weight = weight + grad_entropy[r0 : r0 + row_chunk, None].to(acc) * (rows_mean - logits)
            grad_logits = torch.exp(logits - lse[r0 : r0 + row_chunk, None]) * weight
            if label_smoothing:
                grad_logits -= rows_grad * (label_smoothing / vocab)
            # Subtract the one-hot with a masked scatter: no data-dependent shapes, so no device sync.
            local_targets = targets[r0 : r0 + row_chunk] - v0
            in_block = (local_targets >= 0) & (local_targets < width)
            grad_logits.scatter_add_(
                1,
                local_targets.clamp(0, width - 1)[:, None],
                -(1.0 - label_smoothing) * in_block.to(acc)[:, None] * rows_grad,
            )
            if capped is not None:
                grad_logits *= 1.0 - capped * capped
            if need_e:
                grad_e[r0 : r0 + row_chunk] += grad_logits @ c_block
            if need_c:
                grad_c_block += grad_logits.T @ e_rows
            if need_bias:
                grad_bias_block += grad_logits.sum(dim=0)
        if need_c:
            grad_c[v0 : v0 + width] = grad_c_block
        if need_bias:
            grad_bias[v0 : v0 + width] = grad_bias_block
    if grad_e is not None and not in_accumulation_dtype:
        grad_e = grad_e.to(e.dtype)
    return grad_e, grad_c, grad_bias
