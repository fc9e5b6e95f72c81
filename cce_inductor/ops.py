"""The fused linear-cross-entropy ops, and one keyword-argument helper per op that every caller uses.

    loss = cross_entropy(softcap(e @ c.T + bias), targets, ignore_index=..., reduction=..., label_smoothing=...)
    lse = logsumexp(logits, -1),   entropy = -(softmax(logits) * log_softmax(logits)).sum(-1)   (when asked for)

computed without materialising the ``N x V`` logits. The ops are ``torch.library.custom_op``s, so Inductor keeps
each as one opaque call:

* ``cce_inductor::linear_cross_entropy`` (the lean path): the loss, each row's log-sum-exp and, where asked for,
  each row's entropy and argmax, with ``F.cross_entropy``'s class weights where given; its backward is a second
  custom op, ``linear_cross_entropy_backward``, traced into the joint graph by ``register_autograd``;
* ``cce_inductor::linear_cross_entropy_with_grads`` (the balanced path, mean / sum losses whose head needs
  gradients; ``balanced_op.py``): the loss with its own gradients; its autograd formula scales them by the loss's
  upstream gradient in plain aten, which Inductor fuses into the compiled backward and writes in place.

On CUDA (with Triton) they run the kernels in ``cce_inductor.kernels``; everywhere else the chunked PyTorch path in
``cce_inductor._chunked``. The user's options reach them as one string argument, ``CCEOptions.encode()``.

``compute_dtype`` (both ops): the dtype the products run in where it is not the inputs' own: under autocast an fp32
head (and fp32 hidden states) computes as ``F.linear`` would, in the autocast dtype, but the ops take the inputs
as they are, convert them for the call only (no 16-bit copy of the head is held from the forward to the backward)
and return each gradient in its input's dtype (an fp32 weight's gradient is summed in fp32, not rounded to 16 bits).

Callers build a call with :func:`lean_call` / ``balanced_op.balanced_call`` (keywords, defaults left out of the
graph), then run it eagerly (``call()``) or put it in a graph (``call.emit(graph)``). Public entry point:
``functional.linear_cross_entropy`` (shape handling, autocast, argument checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _checks, _chunked, _dispatch, _loss, diagnostics
from .options import CCEOptions


class OpCall(NamedTuple):
    """One call of a fused op: the op and its arguments in schema order, with arguments at their defaults left out
    (so a graph shows only what a site sets)."""

    op: Any
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.op(*self.args, **self.kwargs)

    def emit(self, graph: torch.fx.Graph) -> torch.fx.Node:
        return graph.call_function(self.op, self.args, self.kwargs)


def _set(**optional) -> dict:
    """The keyword arguments that differ from their defaults (None, "", False)."""
    return {name: value for name, value in optional.items() if not (value is None or value is False or value == "")}


# --------------------------------------------------------------------------------------------------------------
# The lean path
# --------------------------------------------------------------------------------------------------------------

_ARGMAX_ROUNDING = {
    "": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@torch.library.custom_op("cce_inductor::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    full_lse: bool,
    entropy: bool,
    class_weights: Tensor | None = None,
    argmax: str = "",
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(loss, lse, entropy, argmax)``: the reduced loss, the per-row log-sum-exp (what the backward
    needs), the per-row entropy of the softmax (empty unless ``entropy``) and each row's argmax (empty unless
    ``argmax``).

    With label smoothing eps (as ``F.cross_entropy``): ``row_loss = lse - (1 - eps) * target_logit - eps / V *
    sum_v logits``, the last sum coming out of the same forward pass. ``full_lse``: the graph uses ``lse`` beyond the
    loss (a z-loss): it is computed for every row, ignored ones included, and is differentiable. ``entropy``: every
    row's ``lse - sum_v softmax_v logits_v``, from the same forward pass, differentiable. ``class_weights`` (V,):
    each counted row's loss is scaled by its target's weight, and a mean divides by the sum of those weights (eager's
    semantics; not with label smoothing: eager's weighted smoothing is another formula). ``argmax``: "" for none, else
    the dtype whose rounding the logits get before the comparison (the dtype eager's logits have: 16-bit logits tie
    where their fp32 sums differ): each row's argmax, int64, ``torch.argmax``'s ties, every row computed.
    ``compute_dtype``: module docstring."""
    diagnostics.count_execution("linear_cross_entropy")
    if class_weights is not None and label_smoothing != 0.0:
        raise ValueError("linear_cross_entropy: class weights with label_smoothing are not supported")
    if argmax not in _ARGMAX_ROUNDING:
        raise ValueError(f"argmax must be one of {sorted(_ARGMAX_ROUNDING)}, got {argmax!r}")
    # Autocast already did its work on the inputs (the public wrapper casts them as F.linear would, or the pass
    # names compute_dtype); inside, the chunked path's matmuls must run in the accumulation dtype.
    with torch.autocast(e.device.type, enabled=False):
        _checks.check_inputs(e, c, targets, bias, compute_dtype)
        _checks.check_class_weights(class_weights, c)
        e, c, bias = _dispatch.in_compute_dtype(e, c, bias, compute_dtype)
        _dispatch.check_target_range(e, targets, c.shape[0], ignore_index)
        acc = _chunked.accumulation_dtype(e.dtype)
        argmax_out = torch.empty(e.shape[0] if argmax else 0, dtype=torch.int64, device=e.device)
        lse, target_logit, logit_sum, mean_logit = _dispatch.forward(
            e,
            c,
            targets,
            bias,
            softcap=softcap,
            ignore_index=ignore_index,
            logit_sum=label_smoothing != 0.0,
            mean_logit=entropy,
            every_row=full_lse or entropy or bool(argmax),
            argmax_out=argmax_out if argmax else None,
            argmax_round=_ARGMAX_ROUNDING[argmax],
        )
        valid = targets != ignore_index
        row_loss = _loss.row_losses(lse, target_logit, logit_sum, valid, label_smoothing, c.shape[0], acc)
        row_entropy = lse - mean_logit if entropy else lse.new_empty(0)
        loss = _loss.reduce_rows(row_loss, valid, reduction, _loss.row_weights(class_weights, targets, valid, acc))
        return loss, lse, row_entropy, argmax_out


@linear_cross_entropy_op.register_fake
def _(
    e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, full_lse, entropy,
    class_weights=None, argmax="", compute_dtype=None,
):  # fmt: skip
    _checks.check_inputs(e, c, targets, bias, compute_dtype)
    _checks.check_class_weights(class_weights, c)
    dtype = compute_dtype or e.dtype
    n_rows = e.shape[0]
    loss = e.new_empty((n_rows,) if reduction == "none" else (), dtype=_chunked.accumulation_dtype(dtype))
    row_dtype = _dispatch.lse_dtype(e.device, dtype)
    return (
        loss,
        e.new_empty((n_rows,), dtype=row_dtype),
        e.new_empty((n_rows if entropy else 0,), dtype=row_dtype),
        e.new_empty((n_rows if argmax else 0,), dtype=torch.int64),
    )


def lean_call(
    e,
    c,
    targets,
    bias=None,
    *,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    options: str,
    full_lse: bool = False,
    entropy: bool = False,
    class_weights=None,
    argmax: str = "",
    compute_dtype: torch.dtype | None = None,
) -> OpCall:
    """A call of ``linear_cross_entropy`` (its docstring has the arguments); ``e``, ``c``, ``targets``, ``bias``
    may be tensors or graph nodes."""
    return OpCall(
        torch.ops.cce_inductor.linear_cross_entropy.default,
        (e, c, targets, bias, softcap, ignore_index, reduction, label_smoothing, options, full_lse, entropy),
        _set(class_weights=class_weights, argmax=argmax, compute_dtype=compute_dtype),
    )


@torch.library.custom_op("cce_inductor::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    grad_loss: Tensor,
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_lse: Tensor | None,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
    softcap: float | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    options: str,
    need_e: bool,
    need_c: bool,
    need_bias: bool,
    class_weights: Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(grad_e, grad_c, grad_bias)``, each in its input's dtype; a gradient not asked for is an empty
    tensor and costs nothing. ``grad_lse`` / ``grad_entropy``: upstream gradients of the forward's per-row lse /
    entropy, where they are used. ``class_weights``: each row's loss gradient scaled by its target's weight (the
    kernels need nothing else: the weight is a per-row factor)."""
    need_bias = need_bias and bias is not None
    with torch.autocast(e.device.type, enabled=False):
        # the entropy's gradient needs each row's softmax-weighted mean logit: lse - entropy
        mean_logit = None if grad_entropy is None else lse - entropy
        valid = targets != ignore_index
        acc = _chunked.accumulation_dtype(compute_dtype or e.dtype)
        grad_rows = _loss.grad_rows(
            grad_loss, valid, reduction, acc, _loss.row_weights(class_weights, targets, valid, acc)
        )
        grad_e, grad_c, grad_bias = _dispatch.backward(
            e,
            c,
            targets,
            bias,
            lse,
            grad_rows,
            softcap=softcap,
            ignore_index=ignore_index,
            options=CCEOptions.decode(options),
            need_e=need_e,
            need_c=need_c,
            need_bias=need_bias,
            label_smoothing=label_smoothing,
            grad_lse=grad_lse,
            grad_entropy=grad_entropy,
            mean_logit=mean_logit,
            compute_dtype=compute_dtype,
        )
    return tuple(
        grad if needed else e.new_empty(0)
        for needed, grad in ((need_e, grad_e), (need_c, grad_c), (need_bias, grad_bias))
    )


@linear_cross_entropy_backward_op.register_fake
def _(
    grad_loss, e, c, targets, bias, lse, grad_lse, entropy, grad_entropy, softcap, ignore_index, reduction,
    label_smoothing, options, need_e, need_c, need_bias, class_weights=None, compute_dtype=None,
):  # fmt: skip
    return _loss.grad_outputs_fake(e, c, bias, need_e, need_c, need_bias)


_FORWARD_ATTRS = ("softcap", "ignore_index", "reduction", "label_smoothing", "options")


def _setup_context(ctx, inputs, output) -> None:
    e, c, targets, bias, *attrs, full_lse, entropy, class_weights, _argmax, compute_dtype = inputs
    _, lse, row_entropy, argmax = output
    ctx.save_for_backward(e, c, targets, bias, lse, row_entropy if entropy else None, class_weights)
    ctx.mark_non_differentiable(argmax)
    if not full_lse:
        ctx.mark_non_differentiable(lse)
    if not entropy:
        ctx.mark_non_differentiable(row_entropy)
    ctx.full_lse = full_lse
    ctx.attrs = dict(zip(_FORWARD_ATTRS, attrs), compute_dtype=compute_dtype)


def _backward(ctx, grad_loss, grad_lse, grad_entropy, _grad_argmax):
    e, c, targets, bias, lse, row_entropy, class_weights = ctx.saved_tensors
    need_e, need_c, _, need_bias = ctx.needs_input_grad[:4]
    if len(ctx.needs_input_grad) > 11 and ctx.needs_input_grad[11]:
        # never a silently missing gradient: the public wrapper and the pass refuse weights that require grad
        raise RuntimeError("cce_inductor: the gradient w.r.t. cross_entropy's class weights is not computed")
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward_op(
        grad_loss,
        e,
        c,
        targets,
        bias,
        lse,
        grad_lse if ctx.full_lse else None,
        row_entropy,
        grad_entropy if row_entropy is not None else None,
        **ctx.attrs,
        need_e=need_e,
        need_c=need_c,
        need_bias=need_bias,
        class_weights=class_weights,
    )
    grads = (grad_e if need_e else None, grad_c if need_c else None, None, grad_bias if need_bias else None)
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)
