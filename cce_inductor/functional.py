"""The public entry point, :func:`linear_cross_entropy`: a fused linear cross-entropy called directly (shape
handling, autocast, argument checks), which takes the path ``paths.choose_for`` gives it and calls the op of that
path (``ops.lean_call`` / ``balanced_op.balanced_call``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _checks, _dispatch, paths
from .balanced_op import balanced_call
from .ops import lean_call
from .options import CCEOptions

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weights: Tensor | None = None,
    options: CCEOptions | None = None,
) -> Tensor:
    """``F.cross_entropy(softcap(e @ c.T + bias), targets, ...)`` without materialising the logits.

    Args:
        e: hidden states ``(..., D)``.
        c: classifier weight ``(V, D)`` (the ``weight`` of ``nn.Linear(D, V)``).
        targets: class indices of shape ``e.shape[:-1]``; ``ignore_index`` entries contribute nothing.
        bias: optional ``(V,)``.
        softcap: Gemma-2 style logit soft-capping ``softcap * tanh(logits / softcap)``; ``None`` for none.
        reduction: ``"mean"`` (over non-ignored targets; NaN if there are none), ``"sum"`` or ``"none"``
            (shape ``targets.shape``, 0 at ignored positions).
        label_smoothing: as in ``F.cross_entropy``, in ``[0, 1]``.
        class_weights: ``F.cross_entropy``'s ``weight``, ``(V,)``: a counted row's loss is scaled by its target's
            weight, and "mean" divides by the sum of those weights. Not with ``label_smoothing``; not differentiable
            (an error where they require grad). Always the lean path.
        options: :class:`cce_inductor.CCEOptions` (``exact``, ``products``, ``backward_row_chunk``, ``path``,
            ``scratch_mb``); default ``CCEOptions()``, not the environment: a direct call does what its arguments
            say. The path is chosen as the pass chooses it (``cce_inductor.paths.choose``) for these operands: a
            "mean" / "sum" loss of inputs that require grad (grad mode on) takes the balanced path (its gradients
            computed with the loss) where that fits the memory budget, else the lean one.

    Returns the loss in float32 (float64 for float64 inputs). Under autocast the products run in the autocast dtype,
    as ``F.linear``'s would, and each gradient comes back in its input's dtype.
    """
    _checks.check_public_args(e, c, targets, softcap=softcap, reduction=reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if options is not None and not isinstance(options, CCEOptions):
        raise TypeError(f"options must be a cce_inductor.CCEOptions, got {type(options).__name__}")
    if class_weights is not None:
        if label_smoothing != 0.0:
            raise NotImplementedError(
                "linear_cross_entropy: class_weights with label_smoothing are not supported "
                "(F.cross_entropy's weighted label smoothing is another formula)"
            )
        if class_weights.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "linear_cross_entropy: class_weights that require grad are not supported (their "
                "gradient is not computed); pass class_weights.detach()"
            )
    compute_dtype = _checks.autocast_dtype(e, c, bias)
    options = options or CCEOptions()
    shape = targets.shape
    rows, targets = e.reshape(-1, e.shape[-1]), targets.reshape(-1).long()
    common = dict(
        softcap=None if softcap is None else float(softcap),
        ignore_index=int(ignore_index),
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        options=options.encode(),
        compute_dtype=compute_dtype,
    )
    need = (e.requires_grad, c.requires_grad, bias is not None and bias.requires_grad)
    dtype = compute_dtype or e.dtype
    facts = _dispatch.head_facts(
        math.prod(e.shape[:-1]),
        e.shape[-1],
        c.shape[0],
        dtype,
        e.device,
        reduction,
        needs_grad=torch.is_grad_enabled() and any(need),
        **paths.storage_facts(e.dtype, c.dtype, dtype),
    )
    choice = paths.choose_for(facts, options)
    if class_weights is None and choice.path == "balanced":
        need_e, need_c, need_bias = need
        return balanced_call(
            rows,
            c,
            targets,
            bias,
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            plain_sum=choice.plain_sum,
            de_pair=choice.de_pair,
            **common,
        )()[0]
    loss = lean_call(rows, c, targets, bias, class_weights=class_weights, **common)()[0]
    return loss.view(shape) if reduction == "none" else loss
