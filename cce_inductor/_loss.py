"""The loss around the kernels, shared by the fused op and the vocabulary-parallel loss: each row's loss, the
reduction and its gradient per row.

    row_loss[n] = lse[n] - target_logit[n]   (0 where targets[n] == ignore_index; label smoothing: row_losses)
    loss        = row_loss | sum(row_loss) | sum(row_loss) / #valid        ("none" | "sum" | "mean")
    grad_rows   = d loss / d row_loss          (0 at ignored rows)
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_losses(
    lse: Tensor,
    target_logit: Tensor,
    logit_sum: Tensor | None,
    valid: Tensor,
    label_smoothing: float,
    vocab: int,
    acc: torch.dtype,
) -> Tensor:
    """Each row's loss in ``acc``: ``lse - target_logit`` (with label smoothing eps: ``lse - (1 - eps) target_logit -
    eps / V logit_sum``, as ``F.cross_entropy``), 0 at ignored rows."""
    row_loss = lse.to(acc) - target_logit.to(acc)
    if label_smoothing != 0.0:
        row_loss = row_loss + label_smoothing * (target_logit.to(acc) - logit_sum.to(acc) / vocab)
    return torch.where(valid, row_loss, 0.0)


def reduce_rows(row_loss: Tensor, valid: Tensor, reduction: str, row_weight: Tensor | None = None) -> Tensor:
    """``row_weight``: each row's class weight (``F.cross_entropy(weight=w)``: ``w[target]``, 0 at ignored rows); the
    rows' losses are scaled by it and a mean divides by its sum, as eager does."""
    if row_weight is not None:
        row_loss = row_loss * row_weight
    if reduction == "none":
        return row_loss
    if reduction == "sum":
        return row_loss.sum()
    # mean over counted rows (or their weights): 0/0 = NaN when all are ignored, as in PyTorch
    return row_loss.sum() / (valid.sum() if row_weight is None else row_weight.sum())


def grad_rows(
    grad_loss: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype, row_weight: Tensor | None = None
) -> Tensor:
    """The upstream gradient of each row's loss: ``grad_loss`` spread as the reduction spread the rows (times each
    row's class weight, where there are class weights: see :func:`reduce_rows`)."""
    if reduction == "none":
        per_row = grad_loss.to(dtype)
    elif reduction == "sum":
        per_row = grad_loss.to(dtype).expand(valid.shape[0])
    else:
        per_row = grad_loss.to(dtype) / (valid.sum() if row_weight is None else row_weight.sum())
    if row_weight is not None:
        per_row = per_row * row_weight
    return torch.where(valid, per_row, 0.0)


def row_weights(class_weights: Tensor | None, targets: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``class_weights[targets]`` in ``dtype``, 0 at ignored rows (whose targets may be any value), or None."""
    if class_weights is None:
        return None
    safe = torch.where(valid, targets, 0).clamp(0, class_weights.shape[0] - 1)
    return torch.where(valid, class_weights.to(dtype)[safe], 0.0)


def empty_unless(needed: bool, grad: Tensor | None, like: Tensor) -> Tensor:
    """``grad``, or a fresh empty tensor: a custom op returns a tensor for every output, and outputs may not
    alias each other."""
    return grad if needed else like.new_empty(0)


def grad_outputs_fake(e: Tensor, c: Tensor, bias: Tensor | None, need_e: bool, need_c: bool, need_bias: bool):
    """The backward ops' outputs as their fake impls describe them."""
    need_bias = need_bias and bias is not None
    return (
        torch.empty_like(e, memory_format=torch.contiguous_format) if need_e else e.new_empty(0),
        torch.empty_like(c, memory_format=torch.contiguous_format) if need_c else e.new_empty(0),
        torch.empty_like(bias) if need_bias else e.new_empty(0),
    )
