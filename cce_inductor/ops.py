"""The fused linear-cross-entropy op: ``torch.ops.cce_inductor.linear_cross_entropy`` and its backward.

    loss = cross_entropy(softcap(e @ c.T + bias), targets, ignore_index=..., reduction=..., label_smoothing=...)
    lse = logsumexp(logits, -1),   entropy = -(softmax(logits) * log_softmax(logits)).sum(-1)   (when asked for)

computed without materialising the ``N x V`` logits. Both ops are ``torch.library.custom_op``s, so Inductor
keeps each as one opaque call; the backward is a second custom op traced into the joint graph by
``register_autograd``. On CUDA (with Triton) they run the kernels in ``cce_inductor.kernels``; everywhere else
the chunked PyTorch path in ``cce_inductor._chunked``. The user's options reach them as one string argument,
``CCEOptions.encode()``.

The balanced path (``CCEOptions.scratch_mb > 0``; mean / sum losses whose head needs gradients) is a third op,
``cce_inductor::linear_cross_entropy_with_grads``: it returns the loss with its own gradients, and its autograd
formula is ``grad_loss * saved`` in plain aten, which Inductor fuses into the compiled backward.

Public entry point: :func:`linear_cross_entropy` (shape handling, autocast, argument checks).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _checks, _chunked, _dispatch, _loss, diagnostics, paths
from .options import CCEOptions

__all__ = ["linear_cross_entropy"]


@torch.library.custom_op("cce_inductor::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    softcap: Optional[float],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    full_lse: bool,
    entropy: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(loss, lse, entropy)``: the reduced loss, the per-row log-sum-exp (what the backward needs) and
    the per-row entropy of the softmax (an empty tensor unless ``entropy``).

    With label smoothing eps (as ``F.cross_entropy``): ``row_loss = lse - (1 - eps) * target_logit - eps / V *
    sum_v logits``, the last sum coming out of the same forward pass. ``full_lse``: the graph uses ``lse`` beyond the
    loss (a z-loss): it is computed for every row, ignored ones included, and is differentiable. ``entropy``: every
    row's ``lse - sum_v softmax_v logits_v``, from the same forward pass, differentiable."""
    diagnostics.count_execution("linear_cross_entropy")
    # Autocast already did its work on the inputs (the public wrapper casts them as F.linear would); inside,
    # the chunked path's matmuls must run in the accumulation dtype, not be downcast again.
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias)
        _dispatch.check_target_range(e, targets, c.shape[0], ignore_index)
        acc = _chunked.accumulation_dtype(e.dtype)
        lse, target_logit, logit_sum, mean_logit = _dispatch.forward(
            e, c, targets, bias, softcap=softcap, ignore_index=ignore_index, logit_sum=label_smoothing != 0.0,
            mean_logit=entropy, every_row=full_lse or entropy,
        )
        valid = targets != ignore_index
        row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
        row_entropy = lse - mean_logit if entropy else lse.new_empty(0)
        return _loss.reduce_rows(row_loss, valid, reduction), lse, row_entropy


@linear_cross_entropy_op.register_fake
def _(e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, full_lse, entropy):
    _checks.check_inputs(e, c, targets, bias)
    n_rows = e.shape[0]
    loss = e.new_empty((n_rows,) if reduction == "none" else (), dtype=_chunked.accumulation_dtype(e.dtype))
    row_dtype = _dispatch.lse_dtype(e.device, e.dtype)
    return loss, e.new_empty((n_rows,), dtype=row_dtype), e.new_empty((n_rows if entropy else 0,), dtype=row_dtype)


@torch.library.custom_op("cce_inductor::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor,
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    lse: Tensor,
    grad_lse: Optional[Tensor],
    entropy: Optional[Tensor],
    grad_entropy: Optional[Tensor],
    softcap: Optional[float],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    class_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_e, grad_c, grad_bias)``; a gradient not asked for is an empty tensor and costs nothing.
    ``grad_lse`` / ``grad_entropy``: upstream gradients of the forward's per-row lse / entropy, where they are used.
    ``class_weights``: ``F.cross_entropy``'s ``weight`` (no label smoothing): each row's loss gradient scaled by its
    target's weight (the kernels need nothing else: the weight is a per-row factor)."""
    need_bias = need_bias and bias is not None
    with torch.autocast(e.device.type, enabled=False):
        # the entropy's gradient needs each row's softmax-weighted mean logit: lse - entropy
        mean_logit = None if grad_entropy is None else lse - entropy
        valid = targets != ignore_index
        acc = _chunked.accumulation_dtype(e.dtype)
        grad_rows = _loss.grad_rows(grad_loss, valid, reduction, acc,
                                    _loss.row_weights(class_weights, targets, valid, acc))
        grad_e, grad_c, grad_bias = _dispatch.backward(
            e, c, targets, bias, lse, grad_rows, softcap=softcap, ignore_index=ignore_index,
            options=CCEOptions.decode(options), need_e=need_e, need_c=need_c, need_bias=need_bias,
            label_smoothing=label_smoothing, grad_lse=grad_lse, grad_entropy=grad_entropy, mean_logit=mean_logit,
        )
    return _loss.empty_unless(need_e, grad_e, e), _loss.empty_unless(need_c, grad_c, e), \
        _loss.empty_unless(need_bias, grad_bias, e)  # fmt: skip


@linear_cross_entropy_backward_op.register_fake
def _(grad_loss, e, c, targets, bias, lse, grad_lse, entropy, grad_entropy, softcap, ignore_index, reduction,
      label_smoothing, options, need_e, need_c, need_bias, class_weights=None):  # fmt: skip
    return _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)


_FORWARD_ATTRS = ("softcap", "ignore_index", "reduction", "label_smoothing", "options")


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, *attrs, full_lse, entropy = inputs
    _, lse, row_entropy = output
    ctx.save_for_backward(e, c, targets, bias, lse, row_entropy if entropy else None)
    if not full_lse:
        ctx.mark_non_differentiable(lse)
    if not entropy:
        ctx.mark_non_differentiable(row_entropy)
    ctx.full_lse = full_lse
    ctx.attrs = dict(zip(_FORWARD_ATTRS, attrs))


def _backward(ctx, grad_loss, grad_lse, grad_entropy):
    e, c, targets, bias, lse, row_entropy = ctx.saved_tensors
    need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward_op(
        grad_loss, e, c, targets, bias, lse, grad_lse if ctx.full_lse else None,
        row_entropy, grad_entropy if row_entropy is not None else None, **ctx.attrs,
        need_e=need_e, need_c=need_c, need_bias=need_bias,
    )
    return (
        grad_e if need_e else None,
        grad_c if need_c else None,
        None,
        grad_bias if need_bias else None,
    ) + (None,) * (len(_FORWARD_ATTRS) + 2)


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------------------
# Class weights and the argmax: the same op with two more inputs / outputs (a separate op, so that the graphs of
# every other site keep their schema)
# --------------------------------------------------------------------------------------------------------------

_ARGMAX_ROUNDING = {"": None, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}  # fmt: skip


@torch.library.custom_op("cce_inductor::linear_cross_entropy_ext", mutates_args=())
def linear_cross_entropy_ext_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    class_weights: Optional[Tensor],
    softcap: Optional[float],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    full_lse: bool,
    entropy: bool,
    argmax: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`linear_cross_entropy_op` with ``F.cross_entropy``'s class weights and each row's argmax.
    Returns ``(loss, lse, entropy, argmax)``.

    ``class_weights`` (V,): each counted row's loss is scaled by its target's weight, and a mean divides by the sum
    of those weights (eager's semantics: 0/0 = NaN when every row is ignored); not with label smoothing (eager's
    weighted smoothing is another formula). ``argmax``: "" for none, else the dtype whose rounding the logits get
    before the comparison (the dtype eager's logits have: 16-bit logits tie where their fp32 sums differ): each
    row's ``argmax`` of the logits, int64, ``torch.argmax``'s ties (the first maximal index), every row computed."""
    diagnostics.count_execution("linear_cross_entropy")
    if class_weights is not None and label_smoothing != 0.0:
        raise ValueError("linear_cross_entropy: class weights with label_smoothing are not supported")
    if argmax not in _ARGMAX_ROUNDING:
        raise ValueError(f"argmax must be one of {sorted(_ARGMAX_ROUNDING)}, got {argmax!r}")
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias)
        _checks.check_class_weights(class_weights, c)
        _dispatch.check_target_range(e, targets, c.shape[0], ignore_index)
        acc = _chunked.accumulation_dtype(e.dtype)
        argmax_out = torch.empty(e.shape[0] if argmax else 0, dtype=torch.int64, device=e.device)
        lse, target_logit, logit_sum, mean_logit = _dispatch.forward(
            e, c, targets, bias, softcap=softcap, ignore_index=ignore_index, logit_sum=label_smoothing != 0.0,
            mean_logit=entropy, every_row=full_lse or entropy or bool(argmax),
            argmax_out=argmax_out if argmax else None, argmax_round=_ARGMAX_ROUNDING[argmax],
        )
        valid = targets != ignore_index
        row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
        row_entropy = lse - mean_logit if entropy else lse.new_empty(0)
        loss = _loss.reduce_rows(row_loss, valid, reduction, _loss.row_weights(class_weights, targets, valid, acc))
        return loss, lse, row_entropy, argmax_out


@linear_cross_entropy_ext_op.register_fake
def _(e, c, targets, bias, class_weights, softcap, ignore_index, reduction, label_smoothing, options, full_lse, entropy,
      argmax):  # fmt: skip
    _checks.check_inputs(e, c, targets, bias)
    _checks.check_class_weights(class_weights, c)
    n_rows = e.shape[0]
    loss = e.new_empty((n_rows,) if reduction == "none" else (), dtype=_chunked.accumulation_dtype(e.dtype))
    row_dtype = _dispatch.lse_dtype(e.device, e.dtype)
    return (loss, e.new_empty((n_rows,), dtype=row_dtype),
            e.new_empty((n_rows if entropy else 0,), dtype=row_dtype),
            e.new_empty((n_rows if argmax else 0,), dtype=torch.int64))  # fmt: skip


_EXT_ATTRS = ("softcap", "ignore_index", "reduction", "label_smoothing", "options")


def _setup_context_ext(ctx, inputs, output) -> None:
    e, c, targets, bias, class_weights, *attrs, full_lse, entropy, _ = inputs
    _, lse, row_entropy, argmax = output
    ctx.save_for_backward(e, c, targets, bias, lse, row_entropy if entropy else None, class_weights)
    ctx.mark_non_differentiable(argmax)
    if not full_lse:
        ctx.mark_non_differentiable(lse)
    if not entropy:
        ctx.mark_non_differentiable(row_entropy)
    ctx.full_lse = full_lse
    ctx.attrs = dict(zip(_EXT_ATTRS, attrs))


def _backward_ext(ctx, grad_loss, grad_lse, grad_entropy, _grad_argmax):
    e, c, targets, bias, lse, row_entropy, class_weights = ctx.saved_tensors
    need_e, need_c, _, need_bias, need_weights = ctx.needs_input_grad[:5]
    if need_weights:
        # never a silently missing gradient: the public wrapper and the pass refuse weights that require grad
        raise RuntimeError("cce_inductor: the gradient w.r.t. cross_entropy's class weights is not computed")
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward_op(
        grad_loss, e, c, targets, bias, lse, grad_lse if ctx.full_lse else None,
        row_entropy, grad_entropy if row_entropy is not None else None, **ctx.attrs,
        need_e=need_e, need_c=need_c, need_bias=need_bias, class_weights=class_weights,
    )
    return (grad_e if need_e else None, grad_c if need_c else None, None, grad_bias if need_bias else None, None) \
        + (None,) * (len(_EXT_ATTRS) + 3)  # fmt: skip


linear_cross_entropy_ext_op.register_autograd(_backward_ext, setup_context=_setup_context_ext)


# --------------------------------------------------------------------------------------------------------------
# The balanced path: the gradients computed with the loss (``CCEOptions.scratch_mb``)
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_inductor::linear_cross_entropy_with_grads", mutates_args=())
def linear_cross_entropy_with_grads_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    softcap: Optional[float],
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    returned_logits: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, grad_e, grad_c, grad_bias)``: the loss (reduction "mean" or "sum") and its own gradients
    (upstream gradient 1) in the accumulation dtype (fp32; fp64 for fp64 inputs), a gradient not asked for an empty
    tensor. The autograd formula scales them by the loss's upstream gradient and rounds once to the inputs' dtypes,
    so the backward pass costs one elementwise pass per gradient. On CUDA the balanced kernels
    (``kernels/_balanced.py``: row chunks of logits in a scratch of ``options.scratch_mb``, or sized here for the
    rows of the call within the budget of ``cce_inductor.paths``); elsewhere the chunked path's forward and backward
    back to back. ``returned_logits``: the site's graph also returns the logits (``paths.HeadFacts``), which raises
    that budget as it raised it when the pass chose this path."""
    diagnostics.count_execution("linear_cross_entropy")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy_with_grads computes reductions 'mean' and 'sum', got {reduction!r}")
    need_bias = need_bias and bias is not None
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias)
        # the scratch for the rows this call really has (the site may have been compiled for another batch size)
        facts = _dispatch.head_facts(*e.shape, c.shape[0], e.dtype, e.device, reduction, needs_grad=True,
                                     returned_logits=returned_logits, softcapped=softcap is not None)
        scratch = paths.scratch_for(facts, CCEOptions.decode(options).scratch_mb)
        loss, grad_e, grad_c, grad_bias = _dispatch.loss_and_grads(
            e, c, targets, bias, softcap=softcap, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, scratch_bytes=scratch, need_e=need_e, need_c=need_c, need_bias=need_bias,
        )
    acc = _chunked.accumulation_dtype(e.dtype)
    return loss, *(grad.to(acc) if needed else e.new_empty(0, dtype=acc)
                   for needed, grad in ((need_e, grad_e), (need_c, grad_c), (need_bias, grad_bias)))  # fmt: skip


@linear_cross_entropy_with_grads_op.register_fake
def _(e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, need_e, need_c, need_bias,
      returned_logits):
    _checks.check_inputs(e, c, targets, bias)
    acc = _chunked.accumulation_dtype(e.dtype)
    return (e.new_empty((), dtype=acc),) + tuple(
        grad.to(acc) for grad in _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)
    )


def _setup_context_with_grads(ctx, inputs, output) -> None:
    e, c, _, bias = inputs[:4]
    _, grad_e, grad_c, grad_bias = output
    ctx.mark_non_differentiable(grad_e, grad_c, grad_bias)
    # no zero tensors for the gradient outputs' (absent) upstream gradients: dC's would be a V x D fp32 fill
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_e, grad_c, grad_bias)
    ctx.computed = inputs[9:12]  # need_e, need_c, need_bias: which of them hold a gradient
    ctx.dtypes = (e.dtype, c.dtype, None if bias is None else bias.dtype)


def _scaled(grad: Tensor, grad_loss: Tensor, dtype: torch.dtype) -> Tensor:
    """``(grad * grad_loss).to(dtype)`` in one pass: the product is formed in ``grad``'s dtype and rounded as it is
    stored, with no temporary of ``grad``'s size (eager; Inductor fuses either spelling)."""
    return torch.mul(grad, grad_loss, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def _backward_with_grads(ctx, grad_loss, *_):
    """``(grad_loss * saved).to(dtype)``: the product of the fp32 gradients, rounded once to the input's dtype, so
    the gradients carry one rounding whatever the upstream gradient (Inductor fuses this into one pass)."""
    if grad_loss is None:  # (grads are not materialised) nothing flows back into the loss
        return (None,) * 13
    saved = ctx.saved_tensors
    grads = []
    for needed, computed, grad, dtype in zip(
        (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]), ctx.computed, saved, ctx.dtypes
    ):
        if needed and not computed:
            raise RuntimeError(
                "cce_inductor: a gradient is needed that the balanced path was told not to compute "
                "(linear_cross_entropy_with_grads was called with need_*=False for an input that requires grad)"
            )
        grads.append(_scaled(grad, grad_loss, dtype) if needed else None)
    grad_e, grad_c, grad_bias = grads
    return (grad_e, grad_c, None, grad_bias) + (None,) * 9


linear_cross_entropy_with_grads_op.register_autograd(_backward_with_grads, setup_context=_setup_context_with_grads)


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weights: Optional[Tensor] = None,
    options: Optional[CCEOptions] = None,
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

    Returns the loss in float32 (float64 for float64 inputs). Under autocast ``e``, ``c`` and ``bias`` are cast
    to the autocast dtype, as ``F.linear`` would be.
    """
    _checks.check_public_args(e, c, targets, softcap=softcap, reduction=reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if options is not None and not isinstance(options, CCEOptions):
        raise TypeError(f"options must be a cce_inductor.CCEOptions, got {type(options).__name__}")
    if class_weights is not None:
        if label_smoothing != 0.0:
            raise NotImplementedError("linear_cross_entropy: class_weights with label_smoothing are not supported "
                                      "(F.cross_entropy's weighted label smoothing is another formula)")
        if class_weights.requires_grad and torch.is_grad_enabled():
            raise ValueError("linear_cross_entropy: class_weights that require grad are not supported (their "
                             "gradient is not computed); pass class_weights.detach()")
    e, c, bias = _checks.autocast_inputs(e, c, bias)
    options = options or CCEOptions()
    if class_weights is not None:
        loss, _, _, _ = linear_cross_entropy_ext_op(
            e.reshape(-1, e.shape[-1]), c, targets.reshape(-1).long(), bias, class_weights,
            None if softcap is None else float(softcap), int(ignore_index), reduction, float(label_smoothing),
            options.encode(), False, False, "",
        )
        return loss.view(targets.shape) if reduction == "none" else loss
    need = (e.requires_grad, c.requires_grad, bias is not None and bias.requires_grad)
    facts = _dispatch.head_facts(math.prod(e.shape[:-1]), e.shape[-1], c.shape[0], e.dtype, e.device, reduction,
                                 needs_grad=torch.is_grad_enabled() and any(need))
    if paths.choose(facts, options.path, options.scratch_mb, options.backward_row_chunk,
                    options.products).path == "balanced":
        loss, _, _, _ = linear_cross_entropy_with_grads_op(
            e.reshape(-1, e.shape[-1]), c, targets.reshape(-1).long(), bias,
            None if softcap is None else float(softcap), int(ignore_index), reduction, float(label_smoothing),
            options.encode(), *need, False,
        )
        return loss
    loss, _, _ = linear_cross_entropy_op(
        e.reshape(-1, e.shape[-1]),
        c,
        targets.reshape(-1).long(),
        bias,
        None if softcap is None else float(softcap),
        int(ignore_index),
        reduction,
        float(label_smoothing),
        options.encode(),
        False,
        False,
    )
    if reduction == "none":
        loss = loss.view(targets.shape)
    return loss
